"""ForgettableMemory costs: deletion through the store vs a bare solver deletion, and save/load.

Goals: a deletion through the store within 2x of a bare solver deletion (median, same
keys, warm); save and load of a 10,000-record memory in under a second.

1. **Deletion.** One key set is admitted into a bare :class:`IncrementalSVDD` and into a
   :class:`ForgettableMemory` (same order: identical solver states), and copied so that each
   variant deletes the same records in the same order from the same state. Variants, timed
   per deletion in interleaved rounds (deletion j of every variant, then j + 1):

   * ``bare`` - ``solver.remove(id)``;
   * ``bare+kkt`` - ``solver.remove(id)`` then ``solver.kkt_residual()`` (the verification the
     default receipt carries);
   * ``store (verify=False)`` - ``memory.forget(id, verify=False)``: lock, bookkeeping,
     tombstone, receipt with both state digests, no KKT recomputation;
   * ``store`` - ``memory.forget(id, verify="full")``: a receipt with the KKT residual
     recomputed from the keys (the default receipt up to this version; the default now
     recomputes it only while n |support| d <= ``FRESH_KKT_WORK``, else uses the
     maintained gradients - the scale rows below measure it).

   * ``edit (value only)`` - ``memory.edit(id, value=...)`` on the held records after the
     deletions: the solver is untouched, so the receipt reuses the KKT residual already
     computed for this solver state and rehashes one record block (no O(n |S| d) sweep).

   The answers are checked: after the run the store's and the bare solver's coefficients and
   rho are bit-identical, and every receipt's KKT residual is below 1e-9. Keys: d = 8 and
   16 (full rank), and d = 384 with intrinsic dimension 16 (sentence-embedding width): the
   store's overhead is fixed (digests, bookkeeping; independent of d) while the deletion's
   cost grows with d and |S|, so the ratio depends on the regime.
2. **Save/load** of 10,000 records (d = 16, and d = 384 as for sentence embeddings), median of
   5 (after one warm-up): a save that writes a whole new database (the memory bound to
   another path in between), the save of one forget to the store the memory is bound to (one
   transaction of the change), and the load, with ``load(check_kkt=False)`` to show what the
   KKT verification costs. The loaded memory's digest must equal the saved one.
3. **Scale.** 10^5 records, d = 16 Gaussian keys, nu = 0.3, n0 = n (about 30 % support) and
   n0 = 1000; 3 * 10^4 records of d = 384 (intrinsic 16), n0 = n. A signed memory is built
   by one ``extend`` (one solver call); then: save; load by default (signed, MAC verified:
   the maintained certificate) and with ``verify="full"`` (both must give the same digest);
   ``forget()`` with its default receipt (median and max over random records; the receipts'
   ``kkt_source`` is recorded); value-only ``edit``; the longest single operation over a
   stream of forgets and adds crossing 1,000 operations (where the solver's periodic audit
   used to fall: the rolling audit replaces it); and the wall time of command-line calls
   (``query``, ``forget``, each a fresh process) beside that of ``python -c "import
   svtoolkit"`` in the same way (the fixed start-up cost of any command) and of a process
   that calls the solver's smallest kernel from Numba's cache (:data:`FLOOR_COMMAND`: the
   floor of every command that runs a compiled kernel, which a change and a load do), and
   of the same two commands through a server holding the store (``--server URL``; the
   server's own start-up, one load, is not counted). Goals: build <= 60 s, forget <= 0.1 s,
   no operation > 1 s, value edit <= 1 ms, a command <= 1 s.

4. **Query** (``--only-query``, writes ``memory_query.json``): ``ForgettableMemory.query``
   against two scans that give the same answer from the same held keys, timed interleaved
   on the same queries (a stored key plus noise, k = 10, ``min_similarity`` 0.5), 10^3, 10^4
   and 10^5 records at d = 16 and d = 384 (intrinsic 16):

   * ``numpy scan`` - one matrix-vector product ``|x|^2 - 2 X q + |q|^2`` on squared norms
     and support rows found beforehand (not timed), the readout normaliser over the support
     rows from it, the threshold, ``argpartition`` for the top k, their similarities, and
     the answer as ``(record id, value, weight, similarity)`` tuples read from per-row lists
     of ids and of values decoded beforehand (the scan the store's query should cost no
     more than 1.3x of; no re-score, no validation, the stored objects rather than copies);
   * ``numpy scan (rows only)`` - the same without the answer's tuples (rows, similarities
     and normaliser: what ``store nearest`` returns);
   * ``faiss flat`` - FAISS's ``IndexFlatL2`` over float32 copies of the keys (built
     beforehand), ``search`` of one query for k (no threshold, no normaliser): a peer, not
     the same answer (float32);
   * ``direct (previous query)`` - what the store's query did before the expansion: every
     squared distance from the differences, a sort of every supporting record;
   * ``store nearest`` - the store's scan alone (``RecordTable.nearest``: the product, then
     the compiled expansion, bound, exact re-score and weights), without the lock,
     validation and the decoding of values.

   Warm (each variant runs the queries once before timing), one thread per pool (the script
   sets ``OMP_NUM_THREADS`` etc. to 1 before NumPy loads unless they are set), medians of
   ``--rounds`` rounds (each round times every query once per variant, interleaved, the
   variants' order rotated from one query to the next so that none always runs after the
   same one) with the min and max of the round medians; the load average before and after
   is recorded (the machine is shared). The answers are checked: the store's ids, order and
   similarities equal the direct computation's.

Usage::

    python benchmarks/memory.py              # long: the 10^5-record rows take tens of minutes
    python benchmarks/memory.py --quick      # smaller sizes, for a smoke run
    python benchmarks/memory.py --only-query # the query rows only (memory_query.json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# one thread per native pool (set before NumPy loads; a variable already set is kept)
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, median_distance, stats, timed, write_json, write_text  # noqa: E402

from svtoolkit import IncrementalSVDD, warmup  # noqa: E402
from svtoolkit.experiments import record  # noqa: E402
from svtoolkit.memory import ForgettableMemory  # noqa: E402

SEED = 0
NU = 0.3


def keys(n, d_intrinsic, d, rng):
    """Gaussian keys of intrinsic dimension ``d_intrinsic`` embedded isometrically in R^d."""
    Z = rng.standard_normal((n, d_intrinsic))
    if d == d_intrinsic:
        return Z, Z
    Q, _ = np.linalg.qr(rng.standard_normal((d, d_intrinsic)))
    return Z @ Q.T, Z


def median_sigma(Z, rng):
    idx = rng.choice(len(Z), size=min(len(Z), 400), replace=False)
    return median_distance(Z[idx])


def build_memory(X, sigma):
    mem = ForgettableMemory(sigma=sigma, nu=NU, n0=len(X))
    for i, x in enumerate(X):
        mem.add(x, f"record {i}", record_id=f"r{i}")
    return mem


def deletion_benchmark(n, d_intrinsic, d, n_delete, rng):
    X, Z = keys(n, d_intrinsic, d, rng)
    sigma = median_sigma(Z, rng)
    t0 = time.perf_counter()
    mem = build_memory(X, sigma)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        mem.save(Path(tmp) / "m")
        mem_nv = ForgettableMemory.load(Path(tmp) / "m")
    bare = IncrementalSVDD(mem.C, sigma)
    bare.extend(X)
    bare_kkt = bare.copy()
    # the same optimum by two routes (a bulk extend, one add per record): equal to rounding
    assert np.allclose(bare.alpha, mem._solver.alpha, rtol=0, atol=1e-12)
    assert abs(bare.rho - mem._solver.rho) <= 1e-12
    part = mem.partition()
    kind = {r: k for k, ids in part.items() for r in ids}
    victims = [f"r{i}" for i in rng.choice(n, size=n_delete, replace=False)]
    times = {"bare": [], "bare+kkt": [], "store (verify=False)": [], "store": []}
    residuals = []
    for rid in victims:
        sid = int(rid[1:])  # admitted in order, so solver id i is record r<i>
        times["bare"].append(timed(bare.remove, sid)[1])
        times["bare+kkt"].append(timed(lambda i=sid: (bare_kkt.remove(i),
                                                      bare_kkt.kkt_residual()))[1])
        times["store (verify=False)"].append(timed(mem_nv.forget, rid, verify=False)[1])
        receipt, seconds = timed(mem.forget, rid, verify="full")
        times["store"].append(seconds)
        residuals.append(receipt.kkt_residual)
    edits = []
    for rid in mem.record_ids[:n_delete]:
        receipt, seconds = timed(mem.edit, rid, value=f"edited {rid}")
        edits.append(seconds)
        residuals.append(receipt.kkt_residual)
    times["edit (value only)"] = edits
    same = (np.allclose(bare.alpha, mem._solver.alpha, rtol=0, atol=1e-12)
            and abs(bare.rho - mem._solver.rho) <= 1e-12  # two routes, equal to rounding
            and np.array_equal(mem._solver.alpha, mem_nv._solver.alpha)
            and mem._solver.rho == mem_nv._solver.rho)  # the edits changed values only
    assert same, "the store and the bare solver diverged"
    assert max(residuals) < 1e-9
    med = {k: stats(v) for k, v in times.items()}
    by_kind = {}
    for k in ("margin", "error", "reserve"):
        sel = [j for j, r in enumerate(victims) if kind[r] == k]
        medians = {name: float(np.median([times[name][j] for j in sel])) for name in times
                   if name != "edit (value only)"} if sel else {}
        by_kind[k] = {"count": len(sel), **medians}
    b = med["bare"]["median"]
    return {
        "n": n, "d": d, "intrinsic_d": d_intrinsic, "nu": NU, "sigma": sigma,
        "build_seconds": build_s, "partition": {k: len(v) for k, v in part.items()},
        "deletions": n_delete, "seconds": med, "median_by_partition_of_victim": by_kind,
        "ratios_of_medians": {
            "store (verify=False) / bare": med["store (verify=False)"]["median"] / b,
            "store / bare+kkt": med["store"]["median"] / med["bare+kkt"]["median"],
            "store / bare": med["store"]["median"] / b,
            "edit (value only) / bare": med["edit (value only)"]["median"] / b,
        },
        "max_receipt_kkt_residual": max(residuals),
        "equal_to_bare_to_1e-12": same,
    }


def save_load_benchmark(n, d_intrinsic, d, rng, repeats=5):
    X, Z = keys(n, d_intrinsic, d, rng)
    sigma = median_sigma(Z, rng)
    t0 = time.perf_counter()
    mem = build_memory(X, sigma)
    build_s = time.perf_counter() - t0
    out = {"n": n, "d": d, "intrinsic_d": d_intrinsic, "sigma": sigma, "build_seconds": build_s,
           "partition": {k: len(v) for k, v in mem.partition().items()}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.svtk"
        mem.save(path)  # warm-up
        ForgettableMemory.load(path)
        saves = []
        for _ in range(repeats):
            mem.save(Path(tmp) / "elsewhere.svtk")  # bound elsewhere: the next save is whole
            saves.append(timed(mem.save, path)[1])
        out["save"] = stats(saves)
        # one forget, then the save of that change to the store the memory is bound to
        victims = iter(mem.record_ids)
        mem.save(path)
        changes = []
        for _ in range(repeats):
            mem.forget(next(victims), verify=False)
            changes.append(timed(mem.save, path)[1])
        out["save of one forget"] = stats(changes)
        loads, loaded = [], None
        for _ in range(repeats):
            loaded, seconds = timed(ForgettableMemory.load, path)
            loads.append(seconds)
        out["load"] = stats(loads)
        out["load (check_kkt=False)"] = stats(
            [timed(ForgettableMemory.load, path, check_kkt=False)[1] for _ in range(repeats)])
        out["kkt_residual_alone"] = stats([timed(mem._solver.kkt_residual)[1]
                                           for _ in range(repeats)])
        out["file_bytes"] = path.stat().st_size
        assert loaded.state_digest() == mem.state_digest()
    out["save+load_median"] = out["save"]["median"] + out["load"]["median"]
    out["goal_under_1s"] = out["save+load_median"] < 1.0
    return out


SCALE_KEY = b"benchmark signing key, not a secret"
GOALS = {"build": 60.0, "forget": 0.1, "stall": 1.0, "edit": 1e-3, "cli": 1.0}


#: What ``one cached kernel`` of the command-line rows runs: the smallest kernel of the solver,
#: loaded from Numba's cache, with nothing of the store.
FLOOR_COMMAND = ("import numpy as np; from svtoolkit.exact._rest import sum_rounding; "
                 "sum_rounding(np.ones(3), 3)")


def _wall(argv, env=None):
    """Wall seconds of one fresh process (and its exit status)."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, done.returncode


def cli_benchmark(path, q, victim, server_victim, repeats):
    """Median wall seconds of command-line calls on a signed store, each a fresh process: on
    the file, and through a server holding it (the server's start-up not counted)."""
    env = dict(os.environ, SVTOOLKIT_MEMORY_KEY=SCALE_KEY.decode())
    py = [sys.executable]
    key = "--key=" + ",".join(f"{v:.17g}" for v in q)
    cmds = {
        "import svtoolkit": (py + ["-c", "import svtoolkit"], repeats),
        # the floor of every command that runs a compiled kernel (a change always does, a
        # load does): Python, NumPy, Numba, its one-time initialisation and one cached kernel
        "one cached kernel": (py + ["-c", FLOOR_COMMAND], repeats),
        "query": (py + ["-m", "svtoolkit", "memory", "query", str(path), key], repeats),
        "query --verify full": (py + ["-m", "svtoolkit", "memory", "query", str(path), key,
                                      "--verify", "full"], 1),
    }
    # one untimed call of each first, on a copy: a fresh process then loads Numba's cached
    # kernels instead of compiling them (minutes when the solver's sources just changed)
    spare = path.with_name("spare.svtk")
    spare.write_bytes(path.read_bytes())
    for argv in (py + ["-m", "svtoolkit", "memory", "forget", str(spare), victim],
                 cmds["query"][0], cmds["one cached kernel"][0]):
        _wall(argv, env)
    out = {}
    for name, (argv, times) in cmds.items():
        runs = [_wall(argv, env) for _ in range(times)]
        assert all(code == 0 for _, code in runs), f"{name} failed"
        out[name] = stats([s for s, _ in runs])
    seconds, code = _wall(py + ["-m", "svtoolkit", "memory", "forget", str(path), victim], env)
    assert code == 0, "forget failed"
    out["forget"] = stats([seconds])
    out.update(_server_cli(path, key, server_victim, repeats, env))
    return out


def _server_cli(path, key, victim, repeats, env):
    """Wall seconds of the same commands through a resident server (``--server URL``)."""
    token = path.with_name("token")
    token.write_text("benchmark-token-0123456789\n")
    server = subprocess.Popen([sys.executable, "-m", "svtoolkit", "memory", "serve", str(path),
                               "--port", "0", "--token-file", str(token)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=env)
    try:
        url = server.stdout.readline().strip().rsplit(" on ", 1)[-1]
        assert url.startswith("http://"), "the server did not start"
        client = [sys.executable, "-m", "svtoolkit", "memory"]
        remote = ["--server", url, "--token-file", str(token)]
        _wall(client + ["query", *remote, key], env)  # untimed: file caches
        runs = [_wall(client + ["query", *remote, key], env) for _ in range(repeats)]
        assert all(code == 0 for _, code in runs), "query --server failed"
        seconds, code = _wall(client + ["forget", *remote, victim], env)
        assert code == 0, "forget --server failed"
        return {"query --server": stats([s for s, _ in runs]),
                "forget --server": stats([seconds])}
    finally:
        server.terminate()
        server.wait(timeout=60)


def _stream(mem, X_new, victims, n_ops):
    """Seconds of each operation of a stream alternating forget and add."""
    seconds, adds = [], iter(enumerate(X_new))
    for j in range(n_ops):
        if j % 2 == 0:
            seconds.append(timed(mem.forget, victims[j // 2])[1])
        else:
            i, x = next(adds)
            seconds.append(timed(mem.add, x, f"new {i}", record_id=f"new{i}")[1])
    return seconds


def scale_benchmark(n, d_intrinsic, d, n0, rng, *, n_forget, n_edit, n_stream, cli_repeats):
    X, Z = keys(n + n_stream, d_intrinsic, d, rng)
    sigma = median_sigma(Z, rng)
    X, X_new = X[:n], X[n:]
    n0 = n if n0 is None else n0
    mem = ForgettableMemory(sigma=sigma, nu=NU, n0=n0, signing_key=SCALE_KEY)
    out = {"n": n, "d": d, "intrinsic_d": d_intrinsic, "n0": n0, "nu": NU, "sigma": sigma}
    _, out["build_seconds"] = timed(mem.extend, X, [f"record {i}" for i in range(n)],
                                    record_ids=[f"r{i}" for i in range(n)])
    out["partition"] = {k: len(v) for k, v in mem.partition().items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.svtk"
        _, out["save_seconds"] = timed(mem.save, path)
        out["file_bytes"] = path.stat().st_size
        loaded, out["load_seconds"] = timed(ForgettableMemory.load, path, key=SCALE_KEY)
        full, out["load_full_seconds"] = timed(ForgettableMemory.load, path, key=SCALE_KEY,
                                               verify="full")
        out["load_levels"] = [loaded.load_verification, full.load_verification]
        assert loaded.state_digest() == full.state_digest() == mem.state_digest()
        del loaded, full
        order = rng.permutation(n)
        victims = [f"r{i}" for i in order[:n_forget]]
        forgets, sources = [], set()
        for rid in victims:
            receipt, seconds = timed(mem.forget, rid)
            forgets.append(seconds)
            sources.add(receipt.kkt_source)
            assert receipt.kkt_residual < 1e-9
        out["forget"] = stats(forgets)
        out["forget_kkt_sources"] = sorted(sources)
        edits = [timed(mem.edit, f"r{i}", value=f"edited {i}")[1]
                 for i in order[n_forget:n_forget + n_edit]]
        out["edit_value"] = stats(edits)
        first = n_forget + n_edit
        stream_victims = [f"r{i}" for i in order[first:first + n_stream // 2 + 1]]
        audits_before = mem._solver.n_refactorizations
        stream = _stream(mem, X_new, stream_victims, n_stream)
        out["stream"] = {"operations": n_stream, **stats(stream),
                         "argmax": int(np.argmax(stream)),
                         "operations_before_stream": mem.revision - n_stream,
                         "refactorisations_in_stream":
                             mem._solver.n_refactorizations - audits_before}
        out["kkt_after_stream"] = float(mem._solver.kkt_residual())
        mem.save(path)
        if cli_repeats:
            out["cli"] = cli_benchmark(path, X[order[-1]], f"r{order[-1]}",
                                       f"r{order[-2]}", cli_repeats)
    out["goals_met"] = {
        "build": out["build_seconds"] <= GOALS["build"],
        "forget": out["forget"]["median"] <= GOALS["forget"],
        "stall": out["stream"]["max"] <= GOALS["stall"],
        "edit": out["edit_value"]["median"] <= GOALS["edit"],
        "cli": bool(cli_repeats) and max(out["cli"][c]["median"] for c in ("query", "forget"))
        <= GOALS["cli"],
        "cli (server)": bool(cli_repeats) and max(
            out["cli"][c]["median"] for c in ("query --server", "forget --server"))
        <= GOALS["cli"],
    }
    return out


QUERY_K = 10
QUERY_TAU = 0.5


def numpy_scan_rows(keys, sqnorms, support, alpha, q, k, inv_sigma2, tau):
    """The query's rows by one matrix-vector product on maintained squared norms: rows best
    first, their similarities, and the readout normaliser ``sum_i alpha_i k(q, x_i)`` over
    the support rows ``support`` (``alpha``: their coefficients)."""
    a = keys @ (q * -2.0)
    a += sqnorms
    a += q @ q
    total = float(alpha @ np.exp(a[support] * -inv_sigma2))
    rows = (a <= -np.log(tau) / inv_sigma2).nonzero()[0]
    if rows.size > k:
        rows = rows[np.argpartition(a[rows], k - 1)[:k]]
    rows = rows[np.argsort(a[rows], kind="stable")]
    return rows, np.exp(a[rows] * -inv_sigma2), total


def numpy_scan(scan_rows, row_alpha, row_ids, row_values, q):
    """The query's answer from :func:`numpy_scan_rows` (``scan_rows(q)``): ``(record id,
    value, weight, similarity)`` per row, the ids and values read from per-row lists (the
    values decoded beforehand: the stored objects themselves, not copies)."""
    rows, sims, total = scan_rows(q)
    weights = row_alpha[rows] * sims / total
    return [(row_ids[r], row_values[r], w, s)
            for r, w, s in zip(rows.tolist(), weights.tolist(), sims.tolist())]


def direct_query(keys, alpha, sids, q, k, inv_sigma2, tau, block=512):
    """The store's query before the expansion: every squared distance from the differences
    (blocks of rows), then a sort of every supporting record."""
    n = keys.shape[0]
    sims = np.empty(n)
    for start in range(0, n, block):
        diff = keys[start:start + block] - q
        np.einsum("ij,ij->i", diff, diff, out=sims[start:start + block])
    np.multiply(sims, -inv_sigma2, out=sims)
    np.exp(sims, out=sims)
    rows = np.flatnonzero(sims >= tau)
    total = float((alpha * sims).sum())
    rows = rows[np.lexsort((sids[rows], -sims[rows]))[:k]]
    return rows, sims[rows], total


def _faiss_index(keys):
    """IndexFlatL2 over float32 copies of ``keys`` (one thread), or None without faiss."""
    try:
        import faiss
    except ImportError:
        return None
    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatL2(keys.shape[1])
    index.add(np.ascontiguousarray(keys, dtype=np.float32))
    return index


def query_benchmark(n, d_intrinsic, d, rng, *, n_queries, rounds):
    X, Z = keys(n, d_intrinsic, d, rng)
    sigma = median_sigma(Z, rng)
    mem = ForgettableMemory(sigma=sigma, nu=NU, n0=min(n, 1000))
    _, build_s = timed(mem.extend, X, [f"record {i}" for i in range(n)],
                       record_ids=[f"r{i}" for i in range(n)])
    # a stored key plus noise of norm about 0.3 sigma (similarity about 0.9 to it)
    Q = X[rng.choice(n, size=n_queries)] + (0.3 * sigma / np.sqrt(d)) * rng.standard_normal(
        (n_queries, d))
    mem.query(Q[0], k=QUERY_K)  # syncs the coefficient copies into the rows
    table = mem._table
    held = table.keys[: table.n].copy()
    sqnorms = np.einsum("ij,ij->i", held, held)
    alpha, sids = table.row_alpha[: table.n].copy(), table.row_sid[: table.n].copy()
    support = alpha.nonzero()[0]
    inv = 1.0 / (sigma * sigma)
    index = _faiss_index(held)
    row_ids = table.record_ids(sids)
    row_values = [json.loads(table.get(r)[1]) for r in row_ids]

    def scan_rows(q):
        return numpy_scan_rows(held, sqnorms, support, alpha[support], q, QUERY_K, inv,
                               QUERY_TAU)

    variants = {
        "store query": lambda q: mem.query(q, k=QUERY_K, min_similarity=QUERY_TAU),
        "store nearest": lambda q: table.nearest(q, QUERY_K, inv, QUERY_TAU),
        "numpy scan": lambda q: numpy_scan(scan_rows, alpha, row_ids, row_values, q),
        "numpy scan (rows only)": scan_rows,
        "direct (previous query)": lambda q: direct_query(held, alpha, sids, q, QUERY_K, inv,
                                                          QUERY_TAU),
    }
    if index is not None:
        variants["faiss flat"] = lambda q: index.search(
            np.asarray(q, dtype=np.float32)[None], QUERY_K)
    # the answers: the store's ids, order and similarities against the direct computation
    agree, scan_agree, faiss_agree = 0, 0, 0
    for q in Q:
        hits = mem.query(q, k=QUERY_K, min_similarity=QUERY_TAU)
        rows, ref_sims, _ = direct_query(held, alpha, sids, q, QUERY_K, inv, QUERY_TAU)
        same = ([h.record_id for h in hits] == table.record_ids(sids[rows])
                and np.allclose([h.score for h in hits], ref_sims, rtol=1e-12, atol=0))
        agree += bool(same)
        scanned = variants["numpy scan"](q)
        scan_agree += bool([h[:2] for h in hits] == [s[:2] for s in scanned]
                           and np.allclose([h[2:] for h in hits], [s[2:] for s in scanned],
                                           rtol=1e-9, atol=0))
        if index is not None:
            _, ids = variants["faiss flat"](q)
            faiss_agree += set(ids[0][: len(rows)].tolist()) == set(rows.tolist())
    assert agree == n_queries, "the store's answers differ from the direct computation"
    for fn in variants.values():  # warm
        for q in Q:
            fn(q)
    times = {name: [[] for _ in range(rounds)] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for i, q in enumerate(Q):
            shift = (r * len(Q) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name][r].append(timed(variants[name], q)[1])
    out = {"n": n, "d": d, "intrinsic_d": d_intrinsic, "sigma": sigma, "n0": min(n, 1000),
           "build_seconds": build_s, "partition": {k: len(v) for k, v in
                                                   mem.partition().items()},
           "queries": n_queries, "rounds": rounds, "k": QUERY_K,
           "min_similarity": QUERY_TAU,
           "supporting_per_query_median": float(np.median(
               [len(direct_query(held, alpha, sids, q, n, inv, QUERY_TAU)[0])
                for q in Q[:5]])),
           "answers_equal_direct": agree, "numpy_scan_same_answer": scan_agree,
           "faiss_same_ids": faiss_agree if index else None,
           "seconds": {}}
    for name, per_round in times.items():
        medians = [float(np.median(t)) for t in per_round]
        out["seconds"][name] = {"median": float(np.median(medians)), "min": min(medians),
                                "max": max(medians), "all": stats(sum(per_round, []))}
    scan = out["seconds"]["numpy scan"]["median"]
    out["ratios_to_numpy_scan"] = {name: v["median"] / scan
                                   for name, v in out["seconds"].items()}
    return out


def query_table(payload):
    lines = ["# ForgettableMemory query benchmark", "",
             f"{payload['machine']['cpu']}, {payload['machine']['cores']} cores, one thread per "
             f"pool; load average {payload['loadavg_before'][0]:.2f} before, "
             f"{payload['loadavg_after'][0]:.2f} after; "
             f"`python benchmarks/memory.py --only-query`", "",
             f"Median µs per query (k = {QUERY_K}, min_similarity {QUERY_TAU}) over rounds "
             "[min-max of the round medians]; ratio to the NumPy scan in parentheses.", "",
             "| n | d | store query | store nearest | numpy scan | numpy scan (rows only) | "
             "faiss flat | direct (previous query) |", "|" + "---|" * 8]
    for r in payload["query"]:
        cells = []
        for name in ("store query", "store nearest", "numpy scan", "numpy scan (rows only)",
                     "faiss flat", "direct (previous query)"):
            v = r["seconds"].get(name)
            cells.append("-" if v is None else
                         f"{v['median'] * 1e6:,.0f} [{v['min'] * 1e6:,.0f}-"
                         f"{v['max'] * 1e6:,.0f}] ({r['ratios_to_numpy_scan'][name]:.2f})")
        lines.append(f"| {r['n']} | {r['d']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_queries(args):
    cases = ([(1000, 16, 16), (3000, 16, 384)] if args.quick else
             [(1000, 16, 16), (10_000, 16, 16), (100_000, 16, 16),
              (1000, 16, 384), (10_000, 16, 384), (100_000, 16, 384)])
    name = "memory_query_quick" if args.quick else "memory_query"
    payload = {"benchmark": "memory query", "seed": SEED, "quick": args.quick,
               "machine": machine_info(packages=("numpy", "numba", "faiss-cpu")),
               "run": record.run_record({"cases": cases, "k": QUERY_K, "tau": QUERY_TAU,
                                         "queries": args.queries, "rounds": args.rounds}),
               "loadavg_before": list(os.getloadavg()), "complete": False, "query": []}
    rng = np.random.default_rng(SEED)
    for n, di, d in cases:
        payload["query"].append(query_benchmark(n, di, d, rng, n_queries=args.queries,
                                                rounds=args.rounds))
        payload["loadavg_after"] = list(os.getloadavg())
        write_json(name, payload)
        print(f"query row done: n={n} d={d}", flush=True)
    payload["complete"] = True
    print(f"wrote {write_json(name, payload)}")
    text = query_table(payload)
    write_text(f"{name}.md", text)
    print(text)


def table(payload):
    lines = ["# ForgettableMemory benchmark", "",
             f"{payload['machine']['cpu']}, {payload['machine']['cores']} cores; "
             f"`python benchmarks/memory.py{' --quick' if payload['quick'] else ''}`", "",
             "## Deletion (median seconds per deletion, same records, warm)", "",
             "| n | d (intrinsic) | S/E/R | bare | bare+kkt | store (verify=False) | store | "
             "edit (value only) | store(vF)/bare | store/bare+kkt | store/bare |",
             "|" + "---|" * 11]
    for r in payload["deletion"]:
        s, q, p = r["seconds"], r["ratios_of_medians"], r["partition"]
        edit = f"{s['edit (value only)']['median']:.2e}" if "edit (value only)" in s else "-"
        lines.append(
            f"| {r['n']} | {r['d']} ({r['intrinsic_d']}) | "
            f"{p['margin']}/{p['error']}/{p['reserve']} | {s['bare']['median']:.2e} | "
            f"{s['bare+kkt']['median']:.2e} | "
            f"{s['store (verify=False)']['median']:.2e} | {s['store']['median']:.2e} | "
            f"{edit} | "
            f"{q['store (verify=False) / bare']:.2f} | {q['store / bare+kkt']:.2f} | "
            f"{q['store / bare']:.1f} |")
    lines += ["", "## Save / load (median seconds)", "",
              "| n | d | S/E/R | file MB | save (whole database) | save of one forget | load | "
              "load (no KKT) | KKT alone | save+load < 1 s |", "|" + "---|" * 10]
    for r in payload["save_load"]:
        p = r["partition"]
        lines.append(
            f"| {r['n']} | {r['d']} | {p['margin']}/{p['error']}/{p['reserve']} | "
            f"{r['file_bytes'] / 1e6:.1f} | {r['save']['median']:.3f} | "
            f"{r['save of one forget']['median']:.4f} | {r['load']['median']:.3f} | "
            f"{r['load (check_kkt=False)']['median']:.3f} | "
            f"{r['kkt_residual_alone']['median']:.3f} | {r['goal_under_1s']} |")
    if payload.get("scale"):
        lines += ["", "## Scale (signed memory built by one extend; seconds)", "",
                  "| n, d, n0 | S/E/R | build | forget() default (median / max) | "
                  "value edit (median / max) | load default / full | longest op in stream | "
                  "CLI query / forget (wall) | the same with --server | "
                  "import svtoolkit / one cached kernel (wall) |",
                  "|" + "---|" * 10]
        for r in payload["scale"]:
            p, c = r["partition"], r.get("cli", {})
            cli = (f"{c['query']['median']:.2f} / {c['forget']['median']:.2f}" if c else "-")
            remote = (f"{c['query --server']['median']:.2f} / "
                      f"{c['forget --server']['median']:.2f}" if "query --server" in c else "-")
            imp = (f"{c['import svtoolkit']['median']:.2f} / "
                   f"{c['one cached kernel']['median']:.2f}" if c else "-")
            lines.append(
                f"| {r['n']}, {r['d']}, {r['n0']} | {p['margin']}/{p['error']}/{p['reserve']} | "
                f"{r['build_seconds']:.1f} | {r['forget']['median']:.3f} / "
                f"{r['forget']['max']:.3f} ({', '.join(r['forget_kkt_sources'])}) | "
                f"{r['edit_value']['median'] * 1e3:.2f} ms / "
                f"{r['edit_value']['max'] * 1e3:.2f} ms | "
                f"{r['load_seconds']:.2f} / {r['load_full_seconds']:.2f} | "
                f"{r['stream']['max']:.3f} (of {r['stream']['operations']}) | {cli} | "
                f"{remote} | {imp} |")
        lines += ["", "Goals: " + ", ".join(f"{k} <= {v:g} s" for k, v in GOALS.items())
                  + " (forget and edit: the median; stall: the longest operation; cli: the "
                  "slower of query and forget on the file; cli (server): the same through a "
                  "running server)",
                  ""] + [f"* {r['n']}, {r['d']}, n0 = {r['n0']}: " + ", ".join(
                      f"{k} {'met' if ok else 'NOT met'}" for k, ok in r["goals_met"].items())
                      for r in payload["scale"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only-scale", action="store_true",
                        help="run the scale rows only (writes memory_scale*.json)")
    parser.add_argument("--only-query", action="store_true",
                        help="run the query rows only (writes memory_query*.json)")
    parser.add_argument("--queries", type=int, default=30, help="queries per query row")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per query row")
    args = parser.parse_args(argv)
    warmup()
    ForgettableMemory(sigma=1.0, C=1.0).add([0.0], 0)  # compile the store's kernels
    ForgettableMemory(sigma=1.0, C=1.0).query([0.0])
    if args.only_query:
        run_queries(args)
        return
    rng = np.random.default_rng(SEED)
    if args.quick:
        deletion_cases, save_cases = [(500, 8, 8, 50)], [(2000, 16, 16)]
        scale_cases = [(2000, 16, 16, None, 60)]
        scale_sizes = {"n_forget": 10, "n_edit": 20, "cli_repeats": 1}
    else:
        deletion_cases = [(2000, 8, 8, 200), (2000, 16, 16, 200), (2000, 16, 384, 200)]
        save_cases = [(10_000, 16, 16), (10_000, 16, 384)]
        # (n, intrinsic d, d, n0, stream length): the n0 = 1000 row streams past 1,000
        # operations; the others stream 300 (each of their operations costs more)
        scale_cases = [(100_000, 16, 16, 1000, 1050), (100_000, 16, 16, None, 300),
                       (30_000, 16, 384, None, 300)]
        scale_sizes = {"n_forget": 30, "n_edit": 200, "cli_repeats": 2}
    if args.only_scale:
        deletion_cases, save_cases = [], []
    t0 = time.perf_counter()
    payload = {"benchmark": "memory", "seed": SEED, "quick": args.quick,
               "machine": machine_info(packages=("numpy", "numba"))}
    name = ("memory_quick" if args.quick else "memory") + ("_scale" if args.only_scale else "")
    payload.update(complete=False, deletion=[], save_load=[], scale=[])
    # the scale rows first, the file rewritten after each row (a long run keeps what it did)
    for n, di, d, n0, n_stream in scale_cases:
        payload["scale"].append(scale_benchmark(n, di, d, n0, rng, n_stream=n_stream,
                                                **scale_sizes))
        write_json(name, payload)
        print(f"scale row done: n={n} d={d} n0={n0 or n}", flush=True)
    rng = np.random.default_rng(SEED)  # the earlier rows draw as they always did
    payload["deletion"] = [deletion_benchmark(n, di, d, k, rng)
                           for n, di, d, k in deletion_cases]
    write_json(name, payload)
    payload["save_load"] = [save_load_benchmark(n, di, d, rng) for n, di, d in save_cases]
    payload["seconds"] = time.perf_counter() - t0
    payload["complete"] = True
    print(f"wrote {write_json(name, payload)}")
    text = table(payload)
    write_text(f"{name}.md", text)
    print(text)


if __name__ == "__main__":
    main()
