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
   * ``store`` - ``memory.forget(id)``: the default receipt (fresh KKT residual).

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

Usage::

    python benchmarks/memory.py              # ~3 min on 2 cores
    python benchmarks/memory.py --quick      # smaller sizes, for a smoke run
"""

from __future__ import annotations

import argparse
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
        receipt, seconds = timed(mem.forget, rid)
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
        lines.append(
            f"| {r['n']} | {r['d']} ({r['intrinsic_d']}) | "
            f"{p['margin']}/{p['error']}/{p['reserve']} | {s['bare']['median']:.2e} | "
            f"{s['bare+kkt']['median']:.2e} | "
            f"{s['store (verify=False)']['median']:.2e} | {s['store']['median']:.2e} | "
            f"{s['edit (value only)']['median']:.2e} | "
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
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    warmup()
    ForgettableMemory(sigma=1.0, C=1.0).add([0.0], 0)  # compile the store's kernels
    ForgettableMemory(sigma=1.0, C=1.0).query([0.0])
    rng = np.random.default_rng(SEED)
    if args.quick:
        deletion_cases, save_cases = [(500, 8, 8, 50)], [(2000, 16, 16)]
    else:
        deletion_cases = [(2000, 8, 8, 200), (2000, 16, 16, 200), (2000, 16, 384, 200)]
        save_cases = [(10_000, 16, 16), (10_000, 16, 384)]
    t0 = time.perf_counter()
    payload = {"benchmark": "memory", "seed": SEED, "quick": args.quick,
               "machine": machine_info(packages=("numpy", "numba"))}
    payload["deletion"] = [deletion_benchmark(n, di, d, k, rng)
                           for n, di, d, k in deletion_cases]
    payload["save_load"] = [save_load_benchmark(n, di, d, rng) for n, di, d in save_cases]
    payload["seconds"] = time.perf_counter() - t0
    name = "memory_quick" if args.quick else "memory"
    print(f"wrote {write_json(name, payload)}")
    text = table(payload)
    write_text(f"{name}.md", text)
    print(text)


if __name__ == "__main__":
    main()
