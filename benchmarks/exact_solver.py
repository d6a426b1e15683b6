"""Exact solver: deletion and addition latency against refitting, with the answer checked.

For n in {120, 256, 512, 1024}: d = 6 Gaussian keys, sigma = median pairwise distance,
nu = 0.4, C = 1 / (nu n) fixed. In one run:

* svtoolkit's exact deletion, split by the victim's class (reserve, margin, error), and its
  exact addition (each timed alone, garbage collector paused; n is kept fixed by an untimed
  re-add / removal after each timed operation);
* the refit alternatives on the retained keys after the first deletions: cvxpy + CLARABEL
  (Gram matrix, problem construction and solve; tolerances 1e-12), scikit-learn OneClassSVM
  (libsvm, tol 1e-9, nu = 1 / (C n) - the same C), and svtoolkit's own from-scratch build;
* each deletion's max |Delta f| against an exact refit (the polished QP reference) over the
  retained keys, the deleted key, 64 fresh points and 32 jittered keys - so every timed
  deletion is a correct one; the scikit-learn refit's own |Delta f| (mapped to the SVDD scale,
  f_svdd = 2 / (nu n) f_sklearn) is reported beside it.

A second table, **builds and large margin sets**: for n in {512, 2048} and sigma = median
distance x {1, 0.3, 0.1} (the last gives |S| close to n), ``extend`` of all n keys into an empty
solver (the bulk path: SMO on the Gram matrix and an exact landing) against a scikit-learn fit
of the same keys and, at n = 512, against the walk replaying the keys one at a time; then the
median of ``--build-deletions`` exact deletions of margin keys (each followed by an untimed
addition) against a scikit-learn refit. The bulk build's partition and coefficients
are checked against the walked build where it is timed (n = 512). Then the same for n = 4,000
keys in d = 384 at sigma = 0.1 x median distance (``--wide-build-sizes``): the kernel matrix is
nearly the identity and every key is on the margin; each row says how many polishes (fresh
O(m^3) factorisations) its timed deletions took.

A third table, **large bulk builds**: n = 10^5 Gaussian keys in d = 16 and 6 (sigma = median
distance of the first 1,000, nu = 0.3) with C = 1 / (nu n0) for n0 = n (about 30 % of the keys
carry weight) and n0 = 1,000 (about 300 do): ``extend`` into an empty solver takes the Gram-free
bulk path (SMO with a kernel-column cache from a subsample's partition, then the exact landing,
certified by a fresh evaluation); reported with the peak of Python/NumPy allocations during the
build (tracemalloc), the median deletion of a margin key, and a scikit-learn fit of the same keys
(``--large-sklearn-runs``; by default only at n0 = 1,000, see ``--large-sklearn-n0``).

The first table is run ``--table-runs`` times on the same keys (timing noise on a shared machine
moves a ratio by tens of percent): it shows the first run, and beside it the median and range
of the scikit-learn ratio over all runs.

JIT compilation is excluded (svtoolkit.warmup() and one untimed call of each peer first).

Usage: python benchmarks/exact_solver.py [--sizes 120 256 512 1024] [--deletions 45]
       [--refits 10] [--table-runs 5] [--build-sizes 512 2048] [--wide-build-sizes 4000]
       [--build-runs 3] [--large-n 100000] [--large-d 16 6] [--large-runs 3]
       [--large-sklearn-runs 1] [--large-sklearn-n0 1000]
Writes benchmarks/results/exact_solver.json and exact_solver.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    fmt_ms,
    fmt_us,
    machine_info,
    median_distance,
    stats,
    timed,
    write_json,
    write_text,
)

import svtoolkit  # noqa: E402
from svtoolkit import IncrementalSVDD, rbf_kernel  # noqa: E402
from svtoolkit.reference import decision_function, solve_svdd  # noqa: E402

D = 6
NU = 0.4
#: Dimension of the builds table's rows with every key on the margin.
WIDE_D = 384


def sklearn_refit(keys, C, sigma):
    from sklearn.svm import OneClassSVM

    n = len(keys)
    model = OneClassSVM(kernel="rbf", gamma=1.0 / sigma**2, nu=min(1.0, 1.0 / (C * n)),
                        tol=1e-9)
    model.fit(keys)
    return model


def sklearn_decision(model, C, n, Q):
    # nu-OCSVM -> SVDD with k(x, x) = 1: f_svdd = 2 / (nu n) f_sklearn = 2 C f_sklearn
    return 2.0 * C * model.decision_function(Q)


def cvxpy_refit(keys, C, sigma):
    return solve_svdd(rbf_kernel(keys, sigma=sigma), C, polish=False)


def probe_points(rng, keys, victim_key):
    return np.vstack([keys, victim_key[None, :], rng.standard_normal((64, D)),
                      keys[rng.choice(len(keys), 32)] + 0.05 * rng.standard_normal((32, D))])


def victim_class(solver, victim):
    if victim in set(solver.reserve_ids):
        return "reserve"
    if victim in set(solver.margin_ids):
        return "margin"
    return "error"


def pick_victim(solver, rng, wanted):
    pools = {"reserve": solver.reserve_ids, "margin": solver.margin_ids,
             "error": solver.error_ids}
    pool = pools[wanted]
    if not len(pool):
        pool = solver.ids
    return int(pool[rng.integers(len(pool))])


def run_size(n, n_deletions, n_refits, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, D))
    sigma = median_distance(X)
    C = 1.0 / (NU * n)
    solver, t_build = timed(lambda: _build(X, C, sigma))
    deletions = {"reserve": [], "margin": [], "error": []}
    deviations, sk_deviations = [], []
    refit = {"cvxpy_clarabel": [], "sklearn": [], "svtoolkit_build": []}
    classes = ["margin", "error", "reserve"]
    for trial in range(n_deletions):
        victim = pick_victim(solver, rng, classes[trial % 3])
        cls = victim_class(solver, victim)
        victim_key = solver.keys[list(solver.ids).index(victim)]
        _, dt = timed(solver.remove, victim)
        deletions[cls].append(dt)
        if trial < n_refits:
            keys = solver.keys
            ref = solve_svdd(rbf_kernel(keys, sigma=sigma), C)
            Q = probe_points(rng, keys, victim_key)
            f_ref = decision_function(keys, ref.alpha, ref.rho, Q, sigma=sigma)
            deviations.append(float(np.max(np.abs(solver.decision_function(Q) - f_ref))))
            _, t_cvx = timed(cvxpy_refit, keys, C, sigma)
            model, t_sk = timed(sklearn_refit, keys, C, sigma)
            _, t_own = timed(_build, keys, C, sigma)
            refit["cvxpy_clarabel"].append(t_cvx)
            refit["sklearn"].append(t_sk)
            refit["svtoolkit_build"].append(t_own)
            f_sk = sklearn_decision(model, C, len(keys), Q)
            sk_deviations.append(float(np.max(np.abs(f_sk - f_ref))))
        solver.add(rng.standard_normal(D))  # untimed: keep n fixed
    adds = {"to_reserve": [], "to_support": []}
    for _ in range(30):
        x = rng.standard_normal(D) * (1.0 + rng.random())
        new_id, dt = timed(solver.add, x)
        where = "to_reserve" if new_id in set(solver.reserve_ids) else "to_support"
        adds[where].append(dt)
        solver.remove(int(solver.ids[rng.integers(len(solver))]))  # untimed
    active = deletions["margin"] + deletions["error"]
    med_active = float(np.median(active))
    result = {
        "n": n, "C": C, "sigma": sigma, "seed": seed,
        "partition": {"margin": len(solver.margin_ids), "error": len(solver.error_ids),
                      "reserve": len(solver.reserve_ids)},
        "build_seconds": t_build,
        "delete": {k: stats(v) for k, v in deletions.items()},
        "delete_active": stats(active),
        "add": {k: stats(v) for k, v in adds.items()},
        "add_all": stats(adds["to_reserve"] + adds["to_support"]),
        "refit": {k: stats(v) for k, v in refit.items()},
        "ratio_refit_over_active_delete": {
            k: float(np.median(v)) / med_active for k, v in refit.items()
        },
        "delete_max_abs_df_vs_exact_refit": {"median": float(np.median(deviations)),
                                              "max": float(np.max(deviations))},
        "sklearn_refit_max_abs_df_vs_exact_refit": {"median": float(np.median(sk_deviations)),
                                                     "max": float(np.max(sk_deviations))},
        "final_kkt_residual": solver.kkt_residual(),
        "events": solver.n_events,
        "polishes": solver.n_polishes,
    }
    return result


def _build(X, C, sigma):
    s = IncrementalSVDD(C, sigma)
    s.extend(X)
    return s


def _walked_build(X, C, sigma):
    import svtoolkit.exact.solver as solver_module

    saved = solver_module.BULK_MIN_KEYS
    solver_module.BULK_MIN_KEYS = len(X) + 1
    try:
        return _build(X, C, sigma)
    finally:
        solver_module.BULK_MIN_KEYS = saved


def run_build(n, scale, runs, seed, n_deletions, d=D):
    """One row of the builds / large-margin-set table (see the module docstring)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    sigma = scale * median_distance(X[:512])
    C = 1.0 / (NU * n)
    builds, fits = [], []
    for _ in range(runs):
        solver, dt = timed(_build, X, C, sigma)
        builds.append(dt)
        fits.append(timed(sklearn_refit, X, C, sigma)[1])
    row = {"n": n, "d": d, "sigma_scale": scale, "sigma": sigma, "C": C,
           "margin": len(solver.margin_ids), "bulk_built": solver.n_bulk_builds == 1,
           "extend": stats(builds), "sklearn_fit": stats(fits),
           "extend_over_sklearn": float(np.median(builds) / np.median(fits)),
           "kkt_residual": solver.kkt_residual()}
    if n <= 512:
        walked, dt = timed(_walked_build, X, C, sigma)
        row["walked_extend_seconds"] = dt
        row["bulk_vs_walk_max_abs_dalpha"] = float(np.max(np.abs(walked.alpha - solver.alpha)))
        row["bulk_vs_walk_same_partition"] = bool(
            np.array_equal(walked.margin_ids, solver.margin_ids)
            and np.array_equal(walked.error_ids, solver.error_ids))
    deletions, polishes = [], 0
    for _ in range(n_deletions):
        victim = int(solver.margin_ids[rng.integers(len(solver.margin_ids))]) \
            if len(solver.margin_ids) else int(solver.ids[0])
        before = solver.n_polishes
        deletions.append(timed(solver.remove, victim)[1])
        polishes += solver.n_polishes - before
        solver.add(rng.standard_normal(d))  # untimed: keep n fixed
    row["delete_margin"] = stats(deletions)
    row["delete_polishes"] = polishes
    row["sklearn_refit_over_delete"] = float(np.median(fits) / np.median(deletions))
    return row


LARGE_D = (16, 6)
LARGE_NU = 0.3


def _traced_build(X, C, sigma):
    import tracemalloc

    tracemalloc.start()
    try:
        solver = _build(X, C, sigma)
        return solver, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def run_large(n, n0, d, runs, sklearn_runs, seed):
    """One row of the large-build table (see the module docstring)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    sigma = median_distance(X[:1000])
    C = 1.0 / (LARGE_NU * n0)
    builds, peaks = [], []
    for _ in range(runs):
        (solver, peak), dt = timed(_traced_build, X, C, sigma)
        builds.append(dt)
        peaks.append(peak)
    row = {"n": n, "d": d, "n0": n0, "nu": LARGE_NU, "C": C, "sigma": sigma,
           "bulk_built": solver.n_bulk_builds == 1,
           "partition": {"margin": len(solver.margin_ids), "error": len(solver.error_ids),
                         "reserve": len(solver.reserve_ids)},
           "extend": stats(builds), "peak_traced_bytes": int(max(peaks))}
    residual, dt = timed(solver.kkt_residual)
    row["kkt_residual"], row["kkt_residual_seconds"] = residual, dt
    deletions = []
    for _ in range(7):
        pool = solver.margin_ids if len(solver.margin_ids) else solver.error_ids
        deletions.append(timed(solver.remove, int(pool[rng.integers(len(pool))]))[1])
    row["delete_margin"] = stats(deletions)
    row["kkt_residual_after_deletions"] = solver.kkt_residual()
    if sklearn_runs:
        fits = [timed(sklearn_refit, X, C, sigma)[1] for _ in range(sklearn_runs)]
        row["sklearn_fit"] = stats(fits)
        row["extend_over_sklearn"] = float(np.median(builds) / np.median(fits))
        row["sklearn_refit_over_delete"] = float(np.median(fits) / np.median(deletions))
    return row


def large_table(rows):
    lines = [
        "| n | d | n0 | S/E/R | extend (bulk) s | peak traced MiB | sklearn fit s "
        "| extend / sklearn | delete ms | sklearn fit / delete | KKT |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, e, fit = r["partition"], r["extend"], r.get("sklearn_fit")
        cells = [f"{r['n']:,}", str(r["d"]), f"{r['n0']:,}",
                 f"{p['margin']}/{p['error']}/{p['reserve']}",
                 f"{e['median']:.1f} ({e['min']:.1f}-{e['max']:.1f})",
                 f"{r['peak_traced_bytes'] / 2**20:.0f}",
                 f"{fit['median']:.1f} ({fit['count']} run)" if fit else "—",
                 f"{r['extend_over_sklearn']:.2f}×" if fit else "—",
                 fmt_ms(r["delete_margin"]["median"]),
                 f"{r['sklearn_refit_over_delete']:,.0f}×" if fit else "—",
                 f"{r['kkt_residual']:.0e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_table(rows):
    lines = [
        r"| n | d | sigma / median | \|S\| | extend (bulk) s | sklearn fit s | extend / sklearn "
        "| walked extend s | delete ms (polishes) | sklearn refit / delete | KKT |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        walked = f"{r['walked_extend_seconds']:.2f}" if "walked_extend_seconds" in r else "—"
        lines.append(
            f"| {r['n']} | {r['d']} | {r['sigma_scale']} | {r['margin']} "
            f"| {r['extend']['median']:.3f} "
            f"({r['extend']['min']:.3f}-{r['extend']['max']:.3f}) "
            f"| {r['sklearn_fit']['median']:.3f} | {r['extend_over_sklearn']:.1f}× | {walked} "
            f"| {fmt_ms(r['delete_margin']['median'])} ({r['delete_polishes']}) "
            f"| {r['sklearn_refit_over_delete']:.1f}× "
            f"| {r['kkt_residual']:.0e} |")
    return "\n".join(lines)


#: The headings of exact_solver.md (README.md shows each table by its heading).
TITLES = ("Deletion and addition against refitting (first of the table runs)",
          "Builds and large margin sets",
          "Large bulk builds (Gram-free path)")


def warm_up():
    svtoolkit.warmup()
    X = np.random.default_rng(0).standard_normal((40, D))
    cvxpy_refit(X, 0.1, 2.0)
    sklearn_refit(X, 0.1, 2.0)
    solve_svdd(rbf_kernel(X, sigma=2.0), 0.1)
    _build(np.random.default_rng(1).standard_normal((100, D)), 0.05, 1.0)  # the bulk path


def table(results):
    lines = [
        "| n | partition S/E/R | delete reserve µs | delete margin µs | delete error µs "
        "| add µs | sklearn refit ms | cvxpy refit ms | own build ms | sklearn / delete "
        "| cvxpy / delete | sklearn / delete over runs (min-max) "
        "| max \\|Δf\\| delete vs exact refit | max \\|Δf\\| sklearn refit |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d = r["delete"]
        cell = {k: (f"{fmt_us(d[k]['median'])} ({d[k]['count']})" if d[k] else "—")
                for k in d}
        p = r["partition"]
        ratio = r["ratio_refit_over_active_delete"]
        lines.append(
            f"| {r['n']} | {p['margin']}/{p['error']}/{p['reserve']} | {cell['reserve']} "
            f"| {cell['margin']} | {cell['error']} | {fmt_us(r['add_all']['median'])} "
            f"| {fmt_ms(r['refit']['sklearn']['median'])} "
            f"| {fmt_ms(r['refit']['cvxpy_clarabel']['median'])} "
            f"| {fmt_ms(r['refit']['svtoolkit_build']['median'])} "
            f"| {ratio['sklearn']:,.0f}× | {ratio['cvxpy_clarabel']:,.0f}× "
            f"| {_spread(r.get('ratio_over_runs', {}).get('sklearn'))} "
            f"| {r['delete_max_abs_df_vs_exact_refit']['max']:.1e} "
            f"| {r['sklearn_refit_max_abs_df_vs_exact_refit']['max']:.1e} |"
        )
    return "\n".join(lines)


def _spread(ratio):
    """``median× (min-max, k runs)`` of a ratio over runs ("—" without runs)."""
    if not ratio:
        return "—"
    return (f"{ratio['median']:,.0f}× ({ratio['min']:,.0f}-{ratio['max']:,.0f}, "
            f"{ratio['count']} runs)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[120, 256, 512, 1024])
    parser.add_argument("--deletions", type=int, default=45)
    parser.add_argument("--refits", type=int, default=10)
    parser.add_argument("--table-runs", type=int, default=5,
                        help="run the deletion table this many times (same keys): the table "
                             "shows the first run, its ratio columns the spread over all")
    parser.add_argument("--build-sizes", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--wide-build-sizes", type=int, nargs="*", default=[4000],
                        help="n of the d = 384 rows (sigma 0.1 x median: every key on the "
                             "margin)")
    parser.add_argument("--build-runs", type=int, default=3)
    parser.add_argument("--build-deletions", type=int, default=15,
                        help="timed deletions of margin keys per build row (the median is "
                             "reported; with 5 it moved by a third between runs)")
    parser.add_argument("--large-n", type=int, nargs="*", default=[100_000])
    parser.add_argument("--large-d", type=int, nargs="*", default=list(LARGE_D))
    parser.add_argument("--large-runs", type=int, default=3)
    parser.add_argument("--large-sklearn-runs", type=int, default=1)
    parser.add_argument("--large-sklearn-n0", type=int, nargs="*", default=[1000],
                        help="the n0 of the large rows that get a scikit-learn fit (at n0 = n "
                             "= 10^5 one fit takes far longer than the whole benchmark)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*Solution may be inaccurate.*")
    load_before = os.getloadavg()  # the machine may be shared: say how busy it was
    warm_up()
    runs = []
    for run in range(args.table_runs):
        runs.append([])
        for n in args.sizes:
            r = run_size(n, args.deletions, args.refits, seed=n)
            runs[-1].append(r)
            print(f"run {run + 1}, n={n}: active delete median "
                  f"{fmt_us(r['delete_active']['median'])} µs, sklearn/delete "
                  f"{r['ratio_refit_over_active_delete']['sklearn']:.0f}×, cvxpy/delete "
                  f"{r['ratio_refit_over_active_delete']['cvxpy_clarabel']:.0f}×", flush=True)
    results = runs[0]
    for i, r in enumerate(results):  # the spread of each ratio over the runs
        r["ratio_over_runs"] = {
            peer: stats([run[i]["ratio_refit_over_active_delete"][peer] for run in runs])
            for peer in ("sklearn", "cvxpy_clarabel")}
        r["delete_active_median_over_runs"] = stats(
            [run[i]["delete_active"]["median"] for run in runs])
    builds = []
    for n in args.build_sizes:
        for scale in (1.0, 0.3, 0.1):
            r = run_build(n, scale, args.build_runs, n + 1, args.build_deletions)
            builds.append(r)
            print(f"n={n} sigma x{scale}: |S|={r['margin']} extend/sklearn "
                  f"{r['extend_over_sklearn']:.1f}x, refit/delete "
                  f"{r['sklearn_refit_over_delete']:.1f}x", flush=True)
    for n in args.wide_build_sizes:
        r = run_build(n, 0.1, args.build_runs, n + 2, args.build_deletions, d=WIDE_D)
        builds.append(r)
        print(f"n={n} d={WIDE_D}: |S|={r['margin']} extend/sklearn "
              f"{r['extend_over_sklearn']:.1f}x, refit/delete "
              f"{r['sklearn_refit_over_delete']:.1f}x", flush=True)
    large = []
    for n in args.large_n:
        for d in args.large_d:
            for n0 in (n, 1000):
                fits = args.large_sklearn_runs if n0 in args.large_sklearn_n0 else 0
                r = run_large(n, n0, d, args.large_runs, fits, seed=n + n0)
                large.append(r)
                print(f"n={n} d={d} n0={n0}: extend {r['extend']['median']:.1f} s, "
                      f"KKT {r['kkt_residual']:.1e}", flush=True)
    payload = {"benchmark": "exact_solver", "machine": machine_info(),
               "load_average_1_5_15min": {"start": load_before, "end": os.getloadavg()},
               "setup": {"d": D, "nu": NU, "sigma": "median pairwise distance",
                         "C": "1 / (nu n), fixed", "deletions_per_size": args.deletions,
                         "deletions_per_build_row": args.build_deletions,
                         "table_runs": args.table_runs,
                         "refits_per_size": args.refits,
                         "timing": "perf_counter, gc paused, medians (min/max in JSON); "
                                   "JIT compile excluded"},
               "results": results, "builds": builds, "large_builds": large}
    path = write_json("exact_solver", payload)
    md = markdown(payload)
    write_text("exact_solver.md", md)
    print(md)
    print(f"wrote {path}")


def markdown(payload):
    """The three tables under the headings that README.md's generated blocks name."""
    md = (f"## {TITLES[0]}\n\n{table(payload['results'])}\n\n"
          f"## {TITLES[1]}\n\n{build_table(payload['builds'])}\n")
    if payload["large_builds"]:
        md += f"\n## {TITLES[2]}\n\n{large_table(payload['large_builds'])}\n"
    return f"# Exact solver: deletion, addition and builds against refitting\n\n{md}"


if __name__ == "__main__":
    main()
