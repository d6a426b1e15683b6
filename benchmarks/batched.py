"""Throughput of the batched training path (no certificate; docs/design.md §5): problems/s.

For G in {64, 1024, 8192} problems of n in {64, 256} Gaussian keys (d = 6, sigma = median pairwise
distance of each problem, C = 1 / (0.2 n)), one timed call is the whole batched path on a Gram
batch that already exists: ``fista_svdd`` (80 iterations) + ``partition_masks`` +
``ridged_svdd_solve``; the FISTA part alone is timed too. Rows:

* torch CPU float32, MLX CPU float32 (the batched path, Gram matrices given);
* the exact Numba solver (:class:`svtoolkit.IncrementalSVDD`) in a Python loop, ``extend(keys)``
  per problem (it builds its own kernel columns);
* cvxpy + CLARABEL (tolerances 1e-9, no polish) in a loop on the Gram matrix, small G only;
* GPU rows only with ``--device cuda`` (torch CUDA, synchronized), else recorded as not measured.

Loops over single problems are measured on a sample (``--loop-sample``) and reported per
problem; their rows for larger G are that per-problem rate, marked "extrapolated". Every timed
call is preceded by an untimed warm-up of the same shape (MLX compiles per shape; Numba
compiles on first use); medians and min/max over ``--repeats``. Each batched answer that was
timed is checked on a sample of problems against the exact solver (objective gap of the FISTA
iterate, partition agreement, ridged coefficient error).

Usage::

    python benchmarks/batched.py                 # CPU rows (~10 min on 2 cores)
    python benchmarks/batched.py --quick         # G in {64, 1024} only
    python benchmarks/batched.py --device cuda   # adds the torch CUDA rows

Writes ``benchmarks/results/batched.json`` and ``batched.md``.
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

from svtoolkit import IncrementalSVDD
from svtoolkit.torch import set_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

RESULTS = Path(__file__).with_name("results")
SEED = 20261201
D = 6
NU = 0.2
ITERS = 80
CHECK_SAMPLE = 8
#: The MLX path is not run above this many Gram entries (G n^2): at G = 8192, n = 256 (5.4e8)
#: it was killed for memory on the 24 GiB machine (24 GB resident; its ridged solve gathers
#: every bucket's blocks through int64 flat indices, 4.6 GB per copy, and MLX's lazy graph
#: holds them until the solve is evaluated). The torch path, eager, runs there.
MLX_MAX_GRAM_ENTRIES = 1024 * 256 * 256
MLX_NOT_RUN = "not run: out of memory at 24 GiB (int64 gather indices held by the lazy graph)"


# --------------------------------------------------------------------------------------------
# problems
# --------------------------------------------------------------------------------------------


def make_problems(G, n, seed):
    """Keys (G, n, d) float64, per-problem sigma (G,), Gram batch (G, n, n) float32 and C."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, n, D, generator=gen, dtype=torch.float64)
    grams, sigmas = [], []
    for start in range(0, G, 512):
        X = keys[start : start + 512]
        dist = torch.cdist(X, X)
        upper = torch.triu_indices(n, n, 1)
        sigma = dist[:, upper[0], upper[1]].median(dim=-1).values
        grams.append(torch.exp(-(dist / sigma[:, None, None]) ** 2).float())
        sigmas.append(sigma)
    K = torch.cat(grams)
    idx = torch.arange(n)
    K[:, idx, idx] = 1.0
    return keys.numpy(), torch.cat(sigmas).numpy(), K.contiguous(), 1.0 / (NU * n)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def timed(path, repeats):
    """Warm up with 2 iterations (same shapes: MLX compiles here), then time ``repeats`` calls.

    ``path(iters)`` returns ``(outputs, seconds of the FISTA stage, seconds in total)``.
    Returns medians and min/max of both, and the outputs of the last call.
    """
    path(2)
    fista, full = [], []
    for _ in range(repeats):
        out, t_fista, t_full = path(ITERS)
        fista.append(t_fista)
        full.append(t_full)

    def stats(times):
        return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                "repeats": len(times)}

    return {"fista": stats(fista), "full": stats(full)}, out


def torch_path(K, C, sync=lambda: None, backend="auto"):
    from svtoolkit.torch import fista_svdd, partition_masks, ridged_svdd_solve

    def path(iters):
        start = time.perf_counter()
        alpha = fista_svdd(K, C, iters=iters, backend=backend)
        sync()
        middle = time.perf_counter()
        margin, error = partition_masks(alpha, C)
        out = (alpha, *ridged_svdd_solve(K, C, margin, error))
        sync()
        end = time.perf_counter()
        return out, middle - start, end - start

    return path


def mlx_path(K_np, C):
    import mlx.core as mx

    from svtoolkit.mlx import fista_svdd, partition_masks, ridged_svdd_solve

    K = mx.array(K_np, dtype=mx.float32)

    def path(iters):
        start = time.perf_counter()
        alpha = fista_svdd(K, C, iters=iters)
        mx.eval(alpha)
        middle = time.perf_counter()
        margin, error = partition_masks(alpha, C)
        out = (alpha, *ridged_svdd_solve(K, C, margin, error))
        mx.eval(*out)
        end = time.perf_counter()
        return out, middle - start, end - start

    return path


def exact_loop(keys, sigmas, C, sample):
    """Seconds per problem of IncrementalSVDD(C, sigma).extend(keys), over ``sample`` problems."""
    IncrementalSVDD(C, float(sigmas[0])).extend(keys[0])  # compile / load the Numba cache
    start = time.perf_counter()
    for g in range(sample):
        IncrementalSVDD(C, float(sigmas[g])).extend(keys[g])
    return (time.perf_counter() - start) / sample


def cvxpy_loop(K, C, sample):
    """Seconds per problem of cvxpy + CLARABEL (tol 1e-9, no polish) on a Gram matrix."""
    import cvxpy as cp

    def solve(Kg):
        n = Kg.shape[0]
        a = cp.Variable(n)
        problem = cp.Problem(cp.Minimize(cp.quad_form(a, cp.psd_wrap(Kg)) - np.diag(Kg) @ a),
                             [cp.sum(a) == 1, a >= 0, a <= C])
        problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-9, tol_gap_rel=1e-9, tol_feas=1e-9)
        return a.value

    Ks = K[:sample].double().numpy()
    solve(Ks[0])
    start = time.perf_counter()
    for Kg in Ks:
        solve(Kg)
    return (time.perf_counter() - start) / sample


# --------------------------------------------------------------------------------------------
# answer check
# --------------------------------------------------------------------------------------------


def check_answers(keys, sigmas, K, C, alpha, margin_alpha):
    """On CHECK_SAMPLE problems: FISTA objective gap, partition agreement, ridged error / C."""
    gaps, agreement, ridged_err = [], [], []
    for g in range(min(CHECK_SAMPLE, len(keys))):
        svdd = IncrementalSVDD(C, float(sigmas[g]))
        ids = svdd.extend(keys[g])
        exact = svdd.alpha
        Kg = K[g].double().numpy()
        a = np.asarray(alpha[g], dtype=np.float64)
        obj = exact @ Kg @ exact - np.diag(Kg) @ exact
        gaps.append(float((a @ Kg @ a - np.diag(Kg) @ a - obj) / abs(obj)))
        labels = np.isin(ids, svdd.margin_ids) + 2 * np.isin(ids, svdd.error_ids)
        est = (a > 1e-3 * C) & (a < (1 - 1e-3) * C)
        est_labels = est.astype(int) + 2 * (a >= (1 - 1e-3) * C)
        agreement.append(float(np.mean(est_labels == labels)))
        ridged_err.append(float(np.abs(np.asarray(margin_alpha[g], np.float64) - exact).max() / C))
    return {"sample": len(gaps), "max_objective_gap": max(gaps),
            "min_partition_agreement": min(agreement),
            "max_ridged_alpha_error_over_C": max(ridged_err)}


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def environment():
    import mlx.core as mx

    info = {
        "python": sys.version.split()[0],
        "svtoolkit": svtoolkit.__version__,
        "torch": torch.__version__,
        "mlx": mx.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "numba_num_threads": numba.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import cvxpy

        info["cvxpy"] = cvxpy.__version__
    except ImportError:
        info["cvxpy"] = None
    return info


def row(backend, G, n, timing=None, per_problem_s=None, note="", check=None):
    if timing is not None:
        per_problem_s = timing["full"]["median_s"] / G
    return {"backend": backend, "G": G, "n": n, "timing": timing,
            "seconds_per_problem": per_problem_s,
            "problems_per_second": None if per_problem_s is None else 1.0 / per_problem_s,
            "note": note, "check": check}


def bench_setting(G, n, args, loop_rates):
    keys, sigmas, K, C = make_problems(G, n, SEED + G + n)
    rows = []
    repeats = args.repeats if G * n * n <= 1024 * 64 * 64 else max(2, args.repeats - 2)
    if G * n * n > 1024 * 256 * 256:
        repeats = 2
    for name, make in (("torch CPU float32 (fused Numba FISTA)", lambda: torch_path(K, C)),
                       ("torch CPU float32 (tensor ops)",
                        lambda: torch_path(K, C, backend="torch")),
                       ("MLX CPU float32", lambda: mlx_path(K.numpy(), C))):
        if name.startswith("MLX") and G * n * n > MLX_MAX_GRAM_ENTRIES:
            rows.append(row(name, G, n, note=MLX_NOT_RUN))
            continue
        timing, out = timed(make(), repeats)
        to_np = (lambda x: x.numpy()) if name.startswith("torch") else np.asarray
        check = check_answers(keys, sigmas, K, C, to_np(out[0]), to_np(out[1]))
        rows.append(row(name, G, n, timing, check=check))
        print(f"  {name:22s} G={G:5d} n={n}: {timing['full']['median_s']:.3f} s "
              f"({G / timing['full']['median_s']:.0f} problems/s) check {check}", flush=True)
    if args.device == "cuda":
        rows.append(bench_cuda(keys, sigmas, K, C, G, n, repeats))
    for name in ("exact", "cvxpy"):
        key = (name, n)
        if key not in loop_rates:
            sample = args.loop_sample if name == "exact" else args.cvxpy_sample
            fn = exact_loop if name == "exact" else cvxpy_loop
            data = (keys, sigmas, C) if name == "exact" else (K, C)
            loop_rates[key] = (fn(*data, min(sample, G)), min(sample, G), G)
        per, sample, measured_at = loop_rates[key]
        label = ("IncrementalSVDD loop (Numba, fp64)" if name == "exact"
                 else "cvxpy + CLARABEL loop")
        note = (f"measured on {sample} problems at G={measured_at}"
                + ("" if G == sample else "; per-problem rate extrapolated to this G"))
        if name == "cvxpy" and G > args.cvxpy_max_g:
            rows.append(row(label, G, n, note="not run (small G only)"))
        else:
            rows.append(row(label, G, n, per_problem_s=per, note=note))
    return rows


def bench_cuda(keys, sigmas, K, C, G, n, repeats):
    timing, out = timed(torch_path(K.cuda(), C, torch.cuda.synchronize), repeats)
    check = check_answers(keys, sigmas, K, C, out[0].cpu().numpy(), out[1].cpu().numpy())
    return row(f"torch CUDA float32 ({torch.cuda.get_device_name(0)})", G, n, timing,
               check=check)


def markdown(rows, meta):
    lines = [
        "# Batched training path: throughput",
        "",
        f"Command: `{meta['command']}`. {meta['environment']['cpu']}, "
        f"{meta['environment']['cpu_count']} CPUs, torch {meta['environment']['torch']} "
        f"({meta['environment']['torch_num_threads']} threads), MLX {meta['environment']['mlx']}. "
        f"Load average before/after: {meta['load_before']} / {meta['load_after']}. "
        "One call = FISTA (80 iterations) + partition masks + ridged solve on given Gram matrices "
        "(fp32); median (min-max) of the repeats after a warm-up. GPU: "
        f"{meta['gpu']}.",
        "",
        "| backend | G | n | s per call, median (min-max) | FISTA only, median | problems/s "
        "| check: max obj. gap / min partition agreement (8 problems) | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["timing"]
        call = ("-" if t is None else
                f"{t['full']['median_s']:.3g} ({t['full']['min_s']:.3g}-{t['full']['max_s']:.3g})")
        fista = "-" if t is None else f"{t['fista']['median_s']:.3g}"
        rate = "-" if r["problems_per_second"] is None else f"{r['problems_per_second']:.3g}"
        check = ("-" if r["check"] is None else
                 f"{r['check']['max_objective_gap']:.1e} / "
                 f"{r['check']['min_partition_agreement']:.3f}")
        lines.append(f"| {r['backend']} | {r['G']} | {r['n']} | {call} | {fista} | {rate} "
                     f"| {check} | {r['note']} |")
    lines += ["", "Speed-ups per problem (same run):", ""]
    lines += _speedups(rows)
    return "\n".join(lines + ["", f"## {RATES_TITLE}", ""] + _rates_table(rows)) + "\n"


#: The heading of the problems-per-second table (README.md shows it by this title).
RATES_TITLE = "Problems per second, by backend (one call per G problems of n keys)"


def _rates_table(rows):
    """Problems/s per (G, n) setting and backend, in the order of the rows."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    settings = list(dict.fromkeys((r["G"], r["n"]) for r in rows))
    lines = ["| G | n | " + " | ".join(backends) + " |",
             "|---:|---:|" + "---:|" * len(backends)]
    for G, n in settings:
        cells = []
        for backend in backends:
            r = next((r for r in rows if (r["G"], r["n"], r["backend"]) == (G, n, backend)), None)
            if r is None or r["problems_per_second"] is None:
                cells.append("not run")
                continue
            rate = float(f"{r['problems_per_second']:.3g}")  # three significant digits
            cells.append((f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}") + " /s"
                         + (" (extrapolated)" if "extrapolated" in r["note"] else ""))
        lines.append(f"| {G} | {n} | " + " | ".join(cells) + " |")
    return lines


def _speedups(rows):
    """One line per timed row: its per-problem speed-up over each loop peer of its setting."""
    lines = []
    for n in sorted({r["n"] for r in rows}):
        for G in sorted({r["G"] for r in rows}):
            mine = [r for r in rows if r["n"] == n and r["G"] == G and r["timing"] is not None]
            peers = {r["backend"]: r for r in rows if r["n"] == n and r["G"] == G
                     and r["timing"] is None and r["seconds_per_problem"] is not None}
            for r in mine:
                ratios = ", ".join(f"{p['seconds_per_problem'] / r['seconds_per_problem']:.3g}x vs "
                                   f"{name}" for name, p in peers.items())
                lines.append(f"* G={G}, n={n}, {r['backend']}: {ratios}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="G in {64, 1024} only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and Numba, set with svtoolkit.torch.set_threads "
                             "(which avoids torch 2.13's batched-LU thread bug, pytorch#142815, "
                             "and Numba's reset of the OpenMP thread count); default: leave both")
    parser.add_argument("--loop-sample", type=int, default=256,
                        help="problems timed for the exact-solver loop")
    parser.add_argument("--cvxpy-sample", type=int, default=16)
    parser.add_argument("--cvxpy-max-g", type=int, default=1024,
                        help="largest G that gets an (extrapolated) cvxpy row")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    if args.threads is not None:
        set_threads(args.threads)
    sizes = (64, 1024) if args.quick else (64, 1024, 8192)
    load_before = os.getloadavg()
    rows, loop_rates = [], {}
    for n in (64, 256):
        for G in sizes:
            rows += bench_setting(G, n, args, loop_rates)
    meta = {
        "command": " ".join(["python benchmarks/batched.py", *(argv or sys.argv[1:])]),
        "seed": SEED,
        "iters": ITERS,
        "nu": NU,
        "gpu": ("measured: " + torch.cuda.get_device_name(0)) if args.device == "cuda"
        else "not measured (no GPU in this session; run with --device cuda on a CUDA machine)",
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "environment": environment(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batched.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / "batched.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
