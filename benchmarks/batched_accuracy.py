"""Accuracy of the batched training path against the exact solver (docs/design.md §5).

For every regime (a dict, :data:`REGIMES`, so more can be added), key count n and nu, draw P
problems; solve each exactly with :class:`svtoolkit.IncrementalSVDD` (fp64, the reference) and
approximately with :func:`svtoolkit.torch.fista_svdd` -> :func:`partition_masks` ->
:func:`ridged_svdd_solve` at several iteration counts and ridges, in float32 (the training
dtype) and float64. Reported per setting:

* **partition agreement** - fraction of keys whose set (margin / error / reserve) equals the
  exact one (mean over problems), and the fraction of problems whose whole partition is right;
* **max |alpha~ - alpha| / C** - largest coefficient error (over keys and problems), for the
  raw FISTA iterate (``ridge = None``) and for the ridged solve;
* **readout deviation** - ``max_q max_j |o~_j(q) - o_j(q)|`` of ``o(q) = sum_i a_i k(q, x_i) v_i
  / sum_i a_i k(q, x_i)`` with values ``v ~ N(0, I_4)``, over 64 queries (32 perturbed keys, 32
  fresh draws); max and median over problems;
* **decision deviation** - ``max_q |f~(q) - f(q)|`` of ``f(q) = 2 sum_i a_i k(q, x_i) - 1 + rho``
  (ridged solve only: FISTA gives no rho);
* **objective gap** of the FISTA iterate, relative; and the fraction of problems flagged valid.

``iters = "oracle"`` feeds the *exact* partition to the ridged solve: the error that remains is
the ridge's alone. sigma is the median pairwise distance of each problem's keys; C = 1/(nu n).

Usage::

    python benchmarks/batched_accuracy.py             # 32 problems per setting (~2 min)
    python benchmarks/batched_accuracy.py --quick     # 4 problems per setting

Writes ``benchmarks/results/batched_accuracy.json`` and ``batched_accuracy.md``.
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from svtoolkit import IncrementalSVDD, rbf_kernel
from svtoolkit.data import gaussian_keys, redundant_keys
from svtoolkit.torch import fista_svdd, partition_masks, ridged_svdd_solve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_distance  # noqa: E402

RESULTS = Path(__file__).with_name("results")
SEED = 20261130
D = 6
ITERS = (20, 40, 80, 160)
RIDGES = (0.0, 1e-4, 1e-3, 1e-2)
SIZES = (64, 256)
NUS = (0.2, 0.5)
DTYPES = ("float32", "float64")
#: partition_masks thresholds (fraction of C) compared at TOL_ITERS iterations, ridge 1e-3.
TOLS = (0.0, 1e-3, 1e-2, 5e-2)
TOL_ITERS = (80, 160)
DEFAULT_TOL = 1e-3
N_QUERIES = 64
V_DIM = 4

#: Regimes: name -> (keys(rng, n) -> (n, d) array, one-line description). Add real data here.
REGIMES = {
    "gaussian": (
        lambda rng, n: gaussian_keys(n, D, rng=rng),
        "keys ~ N(0, I_6)",
    ),
    "redundant": (
        lambda rng, n: redundant_keys(n // 8, 8, D, jitter=0.03, rng=rng),
        "n/8 clusters of 8 near-duplicates (centres N(0, I_6), jitter 0.03); optimum "
        "non-unique in alpha",
    ),
}


# --------------------------------------------------------------------------------------------
# one problem
# --------------------------------------------------------------------------------------------


def exact_problem(keys, C, sigma, rng):
    """Exact solution, partition labels (0 R, 1 S, 2 E), queries and exact readouts."""
    svdd = IncrementalSVDD(C, sigma)
    ids = svdd.extend(keys)
    labels = np.zeros(len(keys), dtype=np.int64)
    labels[np.isin(ids, svdd.margin_ids)] = 1
    labels[np.isin(ids, svdd.error_ids)] = 2
    half = N_QUERIES // 2
    picked = keys[rng.choice(len(keys), size=half, replace=False)]
    queries = np.concatenate(
        [picked + 0.25 * sigma / np.sqrt(D) * rng.standard_normal(picked.shape),
         rng.standard_normal((N_QUERIES - half, D))]
    )
    values = rng.standard_normal((len(keys), V_DIM))
    K_query = rbf_kernel(queries, keys, sigma=sigma)
    return {
        "K": rbf_kernel(keys, sigma=sigma),
        "alpha": svdd.alpha.copy(),
        "rho": svdd.rho,
        "labels": labels,
        "K_query": K_query,
        "values": values,
        "readout": readout(svdd.alpha, K_query, values),
        "decision": decision(svdd.alpha, svdd.rho, K_query),
        "kkt": svdd.kkt_residual(),
    }


def readout(alpha, K_query, values):
    weights = K_query * alpha[None, :]
    return weights @ values / weights.sum(-1, keepdims=True)


def decision(alpha, rho, K_query):
    return 2.0 * K_query @ alpha - 1.0 + rho


def objective(K, a):
    return float(a @ K @ a - np.diag(K) @ a)


def labels_of(margin, error):
    return margin.astype(np.int64) + 2 * error.astype(np.int64)


# --------------------------------------------------------------------------------------------
# one setting
# --------------------------------------------------------------------------------------------


def summarize(problems, C, alphas, labels=None, rhos=None, valid=None):
    """Metrics of one approximate solution per problem against the exact ones."""
    valid = np.ones(len(problems), dtype=bool) if valid is None else valid
    alpha_err, read_dev, dec_dev, gaps, agree, whole = [], [], [], [], [], []
    for p, ref in enumerate(problems):
        if labels is not None:
            agree.append(float(np.mean(labels[p] == ref["labels"])))
            whole.append(bool(np.all(labels[p] == ref["labels"])))
        if not valid[p]:
            continue
        a = alphas[p]
        alpha_err.append(float(np.abs(a - ref["alpha"]).max() / C))
        approx_readout = readout(a, ref["K_query"], ref["values"])
        read_dev.append(float(np.abs(approx_readout - ref["readout"]).max()))
        if rhos is not None:
            approx_decision = decision(a, rhos[p], ref["K_query"])
            dec_dev.append(float(np.abs(approx_decision - ref["decision"]).max()))
        else:
            gaps.append((objective(ref["K"], a) - objective(ref["K"], ref["alpha"]))
                        / abs(objective(ref["K"], ref["alpha"])))

    def stat(values, how):
        return None if not values else float(how(values))

    return {
        "partition_agreement": stat(agree, np.mean),
        "partition_agreement_min": stat(agree, np.min),
        "whole_partition_right": stat(whole, np.mean),
        "max_alpha_error_over_C": stat(alpha_err, np.max),
        "median_alpha_error_over_C": stat(alpha_err, np.median),
        "max_readout_deviation": stat(read_dev, np.max),
        "median_readout_deviation": stat(read_dev, np.median),
        "max_decision_deviation": stat(dec_dev, np.max),
        "max_objective_gap": stat(gaps, np.max),
        "valid_fraction": float(np.mean(valid)),
    }


def evaluate_setting(regime, n, nu, n_problems, seed, dtypes=DTYPES, iters_list=ITERS,
                     ridges=RIDGES, tols=TOLS):
    """All records of one (regime, n, nu): list of dicts (see module docstring)."""
    make_keys = REGIMES[regime][0]
    rng = np.random.default_rng(seed)
    C = 1.0 / (nu * n)
    problems = []
    for _ in range(n_problems):
        keys = make_keys(rng, n)
        problems.append(exact_problem(keys, C, median_distance(keys), rng))
    base = {"regime": regime, "n": n, "nu": nu, "C": C, "problems": n_problems,
            "exact_max_kkt": max(p["kkt"] for p in problems),
            "exact_mean_margin": float(np.mean([(p["labels"] == 1).sum() for p in problems]))}
    K_np = np.stack([p["K"] for p in problems])
    exact_masks = (torch.tensor(np.stack([p["labels"] == 1 for p in problems])),
                   torch.tensor(np.stack([p["labels"] == 2 for p in problems])))
    records = []
    for dtype in dtypes:
        K = torch.tensor(K_np, dtype=getattr(torch, dtype))
        setting = {**base, "dtype": dtype, "restart": False}
        for iters in iters_list:
            alpha = fista_svdd(K, C, iters=iters)
            records.append({**setting, "iters": iters, "ridge": None, "tol": None,
                            **summarize(problems, C, alpha.double().numpy())})
            for tol in tols if iters in TOL_ITERS else (DEFAULT_TOL,):
                masks = partition_masks(alpha, C, tol=tol)
                labels = labels_of(masks[0].numpy(), masks[1].numpy())
                for ridge in ridges if tol == DEFAULT_TOL else (1e-3,):
                    records.append({**setting, "iters": iters, "ridge": ridge, "tol": tol,
                                    **_ridged(problems, K, C, masks, ridge, labels)})
        for ridge in ridges:
            records.append({**setting, "iters": "oracle", "ridge": ridge, "tol": None,
                            **_ridged(problems, K, C, exact_masks, ridge, None)})
        for iters in TOL_ITERS:  # the optional momentum restart, for comparison
            alpha = fista_svdd(K, C, iters=iters, restart=True)
            masks = partition_masks(alpha, C)
            labels = labels_of(masks[0].numpy(), masks[1].numpy())
            records.append({**setting, "iters": iters, "ridge": None, "tol": None,
                            "restart": True, **summarize(problems, C, alpha.double().numpy())})
            records.append({**setting, "iters": iters, "ridge": 1e-3, "tol": DEFAULT_TOL,
                            "restart": True, **_ridged(problems, K, C, masks, 1e-3, labels)})
    return records


def _ridged(problems, K, C, masks, ridge, labels):
    alpha, rho, valid = ridged_svdd_solve(K, C, *masks, ridge=ridge)
    return summarize(problems, C, alpha.double().numpy(), labels, rho.double().numpy(),
                     valid.numpy())


def run_study(n_problems, *, regimes=None, sizes=SIZES, nus=NUS):
    records = []
    for r, regime in enumerate(regimes or REGIMES):
        for s, n in enumerate(sizes):
            for u, nu in enumerate(nus):
                seed = SEED + 1000 * r + 100 * s + 10 * u
                started = time.perf_counter()
                records += evaluate_setting(regime, n, nu, n_problems, seed)
                print(f"{regime:10s} n={n:4d} nu={nu}: {time.perf_counter() - started:.1f} s",
                      flush=True)
    return records


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def environment():
    import mlx.core as mx  # noqa: F401  (version only)

    return {
        "python": sys.version.split()[0],
        "svtoolkit": svtoolkit.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
    }


def fmt(x, spec=".1e"):
    return "-" if x is None else format(x, spec)


def _pick(records, **where):
    where.setdefault("restart", False)
    return [r for r in records if all(r[k] == v for k, v in where.items())]


def _settings(records):
    return sorted({(r["regime"], r["n"], r["nu"]) for r in records},
                  key=lambda s: (list(REGIMES).index(s[0]), s[1], s[2]))


def table_iterations(records, dtype):
    head = ("| regime | n | nu | mean S | iters | partition agreement (min) | whole partition "
            "right | FISTA max abs(a - a*)/C | FISTA objective gap | FISTA readout dev. max "
            "| ridged max abs(a~ - a*)/C | ridged readout dev. max (median) "
            "| ridged decision dev. max |")
    lines = [head, "|" + "---|" * 13]
    for regime, n, nu in _settings(records):
        for iters in (*ITERS, "oracle"):
            where = dict(regime=regime, n=n, nu=nu, dtype=dtype, iters=iters)
            raw = _pick(records, ridge=None, **where)
            raw = raw[0] if raw else {}
            rid = _pick(records, ridge=1e-3, tol=None if iters == "oracle" else DEFAULT_TOL,
                        **where)[0]
            agreement = ("-" if rid["partition_agreement"] is None else
                         f"{rid['partition_agreement']:.4f} ({rid['partition_agreement_min']:.3f})")
            lines.append(
                f"| {regime} | {n} | {nu} | {rid['exact_mean_margin']:.1f} | {iters} "
                f"| {agreement} | {fmt(rid['whole_partition_right'], '.2f')} "
                f"| {fmt(raw.get('max_alpha_error_over_C'))} | {fmt(raw.get('max_objective_gap'))} "
                f"| {fmt(raw.get('max_readout_deviation'))} "
                f"| {fmt(rid['max_alpha_error_over_C'])} "
                f"| {fmt(rid['max_readout_deviation'])} ({fmt(rid['median_readout_deviation'])}) "
                f"| {fmt(rid['max_decision_deviation'])} |"
            )
    return "\n".join(lines)


def table_ridges(records, dtype, iters):
    head = ("| regime | n | nu | ridge | valid | max abs(a~ - a*)/C | readout dev. max (median) "
            "| decision dev. max |")
    lines = [head, "|" + "---|" * 8]
    tol = None if iters == "oracle" else DEFAULT_TOL
    for regime, n, nu in _settings(records):
        for ridge in RIDGES:
            r = _pick(records, regime=regime, n=n, nu=nu, dtype=dtype, iters=iters, ridge=ridge,
                      tol=tol)[0]
            lines.append(
                f"| {regime} | {n} | {nu} | {ridge:g} | {r['valid_fraction']:.2f} "
                f"| {fmt(r['max_alpha_error_over_C'])} "
                f"| {fmt(r['max_readout_deviation'])} ({fmt(r['median_readout_deviation'])}) "
                f"| {fmt(r['max_decision_deviation'])} |"
            )
    return "\n".join(lines)


def table_tols(records, dtype):
    head = ("| regime | n | nu | iters | tol | partition agreement | ridged (1e-3) max "
            "abs(a~ - a*)/C | readout dev. max | decision dev. max |")
    lines = [head, "|" + "---|" * 9]
    for regime, n, nu in _settings(records):
        for iters in TOL_ITERS:
            for tol in TOLS:
                r = _pick(records, regime=regime, n=n, nu=nu, dtype=dtype, iters=iters,
                          ridge=1e-3, tol=tol)[0]
                lines.append(
                    f"| {regime} | {n} | {nu} | {iters} | {tol:g} "
                    f"| {fmt(r['partition_agreement'], '.4f')} "
                    f"| {fmt(r['max_alpha_error_over_C'])} | {fmt(r['max_readout_deviation'])} "
                    f"| {fmt(r['max_decision_deviation'])} |"
                )
    return "\n".join(lines)


def table_restart(records, dtype):
    head = ("| regime | n | nu | iters | restart | FISTA objective gap | partition agreement "
            "| ridged readout dev. max | ridged decision dev. max |")
    lines = [head, "|" + "---|" * 9]
    for regime, n, nu in _settings(records):
        for iters in TOL_ITERS:
            for restart in (False, True):
                where = dict(regime=regime, n=n, nu=nu, dtype=dtype, iters=iters,
                             restart=restart)
                raw = _pick(records, ridge=None, **where)[0]
                rid = _pick(records, ridge=1e-3, tol=DEFAULT_TOL, **where)[0]
                lines.append(
                    f"| {regime} | {n} | {nu} | {iters} | {restart} "
                    f"| {fmt(raw['max_objective_gap'])} | {fmt(rid['partition_agreement'], '.4f')} "
                    f"| {fmt(rid['max_readout_deviation'])} "
                    f"| {fmt(rid['max_decision_deviation'])} |"
                )
    return "\n".join(lines)


def markdown(records, meta):
    parts = [
        "# Batched training path: accuracy against the exact solver",
        "",
        f"Command: `{meta['command']}` ({meta['problems']} problems per setting, seed "
        f"{meta['seed']}, reference: {meta['reference']}). Partition thresholds: "
        "`partition_masks` default (tol = 1e-3 of C) unless stated. `oracle` = the exact "
        "partition given to the ridged solve (the ridge's own error). Readout values "
        "v ~ N(0, I_4). Max over problems unless stated; the redundant regime's optimum is not "
        "unique in alpha, so its partition and coefficient columns compare against one optimal "
        "vertex (the exact solver's) and only the decision deviation is a fair measure there.",
        "",
        "## float32 (the training dtype), ridge 1e-3 for the ridged columns",
        "",
        table_iterations(records, "float32"),
        "",
        "## float64, ridge 1e-3 for the ridged columns",
        "",
        table_iterations(records, "float64"),
        "",
        "## Partition threshold (tol, a fraction of C), float32, ridge 1e-3",
        "",
        table_tols(records, "float32"),
        "",
        "## Ridge sweep, float32, 160 iterations",
        "",
        table_ridges(records, "float32", 160),
        "",
        "## Ridge sweep, float64, exact (oracle) partition",
        "",
        table_ridges(records, "float64", "oracle"),
        "",
        "## Momentum restart (optional, off by default), float64, ridge 1e-3",
        "",
        table_restart(records, "float64"),
        "",
    ]
    return "\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 problems per setting")
    parser.add_argument("--problems", type=int, default=None, help="problems per setting")
    args = parser.parse_args(argv)
    n_problems = args.problems or (4 if args.quick else 32)
    started = time.perf_counter()
    records = run_study(n_problems)
    meta = {
        "command": "python benchmarks/batched_accuracy.py" + (" --quick" if args.quick else ""),
        "problems": n_problems,
        "seed": SEED,
        "reference": "svtoolkit.IncrementalSVDD (exact fp64 walk)",
        "regimes": {name: desc for name, (_, desc) in REGIMES.items()},
        "iters": list(ITERS),
        "ridges": list(RIDGES),
        "tols": list(TOLS),
        "seconds": time.perf_counter() - started,
        "environment": environment(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batched_accuracy.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    (RESULTS / "batched_accuracy.md").write_text(markdown(records, meta))
    print(markdown(records, meta))


if __name__ == "__main__":
    main()
