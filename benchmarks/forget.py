"""Forgetting a batch of samples: the estimator's exact forget against a scikit-learn refit.

``IncrementalOneClassSVM.forget`` deletes fitted samples exactly
(``IncrementalSVDD.remove_many``: decrements, or a fresh bulk solve of the retained samples
where a batch of decrements costs more); the peer is what a user without exact deletion does,
``sklearn.svm.OneClassSVM(tol=1e-9).fit`` on the retained samples (its nu set so that its
C = 1 / (nu n) equals the estimator's fixed C, the same optimisation problem). Also timed: the
same deletions as one ``IncrementalSVDD.remove`` per sample (the decrement path alone), so the
table shows what the batch path buys.

Data: scikit-learn's digits (1,797 x 64, standardised), nu = 0.3 with n0 = n, two kernel
widths - gamma 0.02 (few margin samples: decrements are cheap) and 0.1 (most samples on the
margin: each decrement costs O(m^2)) - and 5 / 10 / 30 % of the samples forgotten, the same
random ids for every method. Each figure is the median (min, max) of ``--runs`` runs, after a
warm-up that compiles every kernel; one thread per native pool. Every state is checked against
the refit: the largest |f| difference on the data (both in scikit-learn's scale).

Writes benchmarks/results/forget.json and forget.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, stats, timed, write_json, write_text  # noqa: E402

NU = 0.3
GAMMAS = (0.02, 0.1)
FRACTIONS = (0.05, 0.1, 0.3)


def digits():
    from sklearn.datasets import load_digits

    X = load_digits().data.astype(np.float64)
    return (X - X.mean(0)) / (X.std(0) + 1e-9)


def refit(X, keep, C, gamma):
    """scikit-learn's one-class SVM on the retained rows at the same C (nu = 1 / (C n))."""
    from sklearn.svm import OneClassSVM

    return OneClassSVM(nu=1.0 / (C * len(keep)), gamma=gamma, tol=1e-9).fit(X[keep])


def one_setting(X, gamma, fraction, runs, seed):
    from svtoolkit.sklearn import IncrementalOneClassSVM

    fitted = IncrementalOneClassSVM(nu=NU, gamma=gamma).fit(X)
    n, C = len(X), fitted.solver_.C
    victims = np.random.default_rng(seed).choice(fitted.sample_ids_, int(fraction * n),
                                                 replace=False)
    keep = np.setdiff1d(np.arange(n), victims)
    times = {"forget": [], "decrements": [], "sklearn_refit": []}
    for _ in range(runs):
        est = IncrementalOneClassSVM(nu=NU, gamma=gamma).fit(X)
        _, t = timed(est.forget, victims)
        times["forget"].append(t)
        solver = fitted.solver_.copy()

        def decrements(solver=solver):
            for v in victims:
                solver.remove(int(v))

        _, t = timed(decrements)
        times["decrements"].append(t)
        peer, t = timed(refit, X, keep, C, gamma)
        times["sklearn_refit"].append(t)
    f_peer = peer.decision_function(X)  # the estimator reports f in scikit-learn's scale
    return {
        "gamma": gamma, "fraction": fraction, "n": n, "forgotten": int(len(victims)),
        "margin_keys": int(len(fitted.solver_.margin_ids)),
        "bulk_rebuild": bool(est.solver_.n_bulk_builds > 1),
        "seconds": {k: stats(v) for k, v in times.items()},
        "max_f_difference_vs_refit": float(np.max(np.abs(est.decision_function(X) - f_peer))),
    }


def table(rows):
    lines = ["| gamma | margin keys | forgotten | path | forget (s) | decrements (s) | "
             "scikit-learn refit (s) | forget / refit | max \\|f\\| difference |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["seconds"]
        cell = lambda k: (f"{s[k]['median']:.3f} ({s[k]['min']:.3f}-{s[k]['max']:.3f})")  # noqa: E731
        lines.append(
            f"| {r['gamma']} | {r['margin_keys']} | {r['forgotten']} "
            f"({r['fraction']:.0%}) | {'bulk rebuild' if r['bulk_rebuild'] else 'decrements'} "
            f"| {cell('forget')} | {cell('decrements')} | {cell('sklearn_refit')} | "
            f"{s['forget']['median'] / s['sklearn_refit']['median']:.1f}x | "
            f"{r['max_f_difference_vs_refit']:.1e} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="one run of one setting (a pipeline check; writes forget_quick.*)")
    args = parser.parse_args(argv)
    from svtoolkit import warmup

    warmup()
    X = digits()
    settings = [(0.1, 0.1)] if args.quick else [(g, f) for g in GAMMAS for f in FRACTIONS]
    runs = 1 if args.quick else args.runs
    payload = {"benchmark": "forget", "machine": machine_info(),
               "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",
                           "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")},
               "loadavg_before": list(os.getloadavg()), "nu": NU, "runs": runs, "rows": []}
    for i, (gamma, fraction) in enumerate(settings):
        payload["rows"].append(one_setting(X, gamma, fraction, runs, seed=i))
    payload["loadavg_after"] = list(os.getloadavg())
    name = "forget_quick" if args.quick else "forget"
    write_json(name, payload)
    text = "\n".join([
        "# Forgetting a batch of samples (digits, nu = 0.3): exact forget vs scikit-learn refit",
        "", *table(payload["rows"]), "",
        f"Median (min-max) of {runs} run(s); one thread per pool; load average "
        f"{payload['loadavg_before'][0]:.2f} before, {payload['loadavg_after'][0]:.2f} after; "
        f"{payload['machine']['cpu']}. `forget` is the estimator's exact forget "
        "(IncrementalSVDD.remove_many), `decrements` one remove per sample, the refit "
        "scikit-learn's OneClassSVM(tol=1e-9) on the retained samples at the same C; the last "
        "column compares the forgotten model's decision function with the refit's.", ""])
    path = write_text(f"{name}.md", text)
    print(text)
    print(f"results: {path} and {path.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
