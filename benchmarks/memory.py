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
   5 (after one warm-up), with ``load(check_kkt=False)`` to show what the KKT verification
   costs. The loaded memory's digest must equal the saved one.
3. **Scale.** 10^5 records, d = 16 Gaussian keys, nu = 0.3, n0 = n (about 30 % support) and
   n0 = 1000; 3 * 10^4 records of d = 384 (intrinsic 16), n0 = n. A signed memory is built
   by one ``extend`` (one solver call); then: save; load by default (signed, MAC verified:
   the maintained certificate) and with ``verify="full"`` (both must give the same digest);
   ``forget()`` with its default receipt (median and max over random records; the receipts'
   ``kkt_source`` is recorded); value-only ``edit``; the longest single operation over a
   stream of forgets and adds crossing 1,000 operations (where the solver's periodic audit
   used to fall: the rolling audit replaces it); and the wall time of command-line calls
   (``query``, ``forget``, each a fresh process) beside that of ``python -c "import
   svtoolkit"`` in the same way (the fixed start-up cost of any command), and of the same
   two commands through a server holding the store (``--server URL``; the server's own
   start-up, one load, is not counted). Goals: build <= 60 s, forget <= 0.1 s, no operation
   > 1 s, value edit <= 1 ms, a command <= 1 s.

Usage::

    python benchmarks/memory.py              # long: the 10^5-record rows take tens of minutes
    python benchmarks/memory.py --quick      # smaller sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, stats, timed, write_json, write_text  # noqa: E402

from svtoolkit import IncrementalSVDD, warmup  # noqa: E402
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
    D = np.sqrt(((Z[idx, None] - Z[None, idx]) ** 2).sum(-1))
    return float(np.median(D[np.triu_indices(len(idx), 1)]))


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
        out["save"] = stats([timed(mem.save, path)[1] for _ in range(repeats)])
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
        "query": (py + ["-m", "svtoolkit", "memory", "query", str(path), key], repeats),
        "query --verify full": (py + ["-m", "svtoolkit", "memory", "query", str(path), key,
                                      "--verify", "full"], 1),
    }
    # one untimed call of each first, on a copy: a fresh process then loads Numba's cached
    # kernels instead of compiling them (minutes when the solver's sources just changed)
    spare = path.with_name("spare.svtk")
    spare.write_bytes(path.read_bytes())
    for argv in (py + ["-m", "svtoolkit", "memory", "forget", str(spare), victim],
                 cmds["query"][0]):
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
              "| n | d | S/E/R | file MB | save | load | load (no KKT) | KKT alone | "
              "save+load < 1 s |", "|" + "---|" * 9]
    for r in payload["save_load"]:
        p = r["partition"]
        lines.append(
            f"| {r['n']} | {r['d']} | {p['margin']}/{p['error']}/{p['reserve']} | "
            f"{r['file_bytes'] / 1e6:.1f} | {r['save']['median']:.3f} | "
            f"{r['load']['median']:.3f} | {r['load (check_kkt=False)']['median']:.3f} | "
            f"{r['kkt_residual_alone']['median']:.3f} | {r['goal_under_1s']} |")
    if payload.get("scale"):
        lines += ["", "## Scale (signed memory built by one extend; seconds)", "",
                  "| n, d, n0 | S/E/R | build | forget() default (median / max) | "
                  "value edit (median / max) | load default / full | longest op in stream | "
                  "CLI query / forget (wall) | the same with --server | "
                  "import svtoolkit (wall) |",
                  "|" + "---|" * 10]
        for r in payload["scale"]:
            p, c = r["partition"], r.get("cli", {})
            cli = (f"{c['query']['median']:.2f} / {c['forget']['median']:.2f}" if c else "-")
            remote = (f"{c['query --server']['median']:.2f} / "
                      f"{c['forget --server']['median']:.2f}" if "query --server" in c else "-")
            imp = f"{c['import svtoolkit']['median']:.2f}" if c else "-"
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
    args = parser.parse_args(argv)
    warmup()
    ForgettableMemory(sigma=1.0, C=1.0).add([0.0], 0)  # compile the store's kernels
    ForgettableMemory(sigma=1.0, C=1.0).query([0.0])
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
