"""Check 4: exact forgetting as equivalence to retraining, per regime (Forgetful Attention
(arXiv:2607.12204), §4, App. C).

One trial (:func:`run_trial`) is a pure function of ``(regime, seed)``:

1. draw a context of keys for the regime; ``C = 1 / (nu n)`` once, at the context size n;
2. build the exact solver on it; forget two tokens (drawn uniformly) by exact decrement;
3. refit from scratch on the retained keys with the **same C**: a fresh build by the same exact
   solver (the definition of exact unlearning: same algorithm, same hyper-parameters), and the
   polished interior-point reference (an independent algorithm);
4. measure the decision-function deviation ``max |f_decrement - f_refit|`` over probes that
   span the retained keys, the forgotten keys and every key jittered by :data:`JITTER`;
   the partition (S, E, R) of both; the Gram condition number of the retained keys; and the
   same deviation for **coefficient decay**.

Decay (the paper's baseline, App. C): the forgotten tokens' coefficients are multiplied by
gamma; every other coefficient, rho and all keys (the forgotten ones included) are left as they
were. Nothing is re-solved (so ``sum(a) < 1`` afterwards), which is the point of the baseline.

**Uniqueness.** The SVDD optimum in alpha is unique when the Gram matrix is positive definite;
numerically we call it unique when the retained keys' Gram condition number is at most
:data:`UNIQUE_COND`: fp64 then resolves the coefficients to about ``eps * cond <= 1e-8``
relative, far below anything that could flip a key between sets. Partition match is a goal only
on those trials; the decision function is compared everywhere.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from svtoolkit import IncrementalSVDD, rbf_kernel
from svtoolkit import reference as ref
from svtoolkit.data import (
    deduplicate,
    gaussian_keys,
    load_shuttle,
    redundant_keys,
    sliding_windows,
    standardize,
)

from .exactness import reference_labels, solver_labels
from .records import make_check, skipped_check

__all__ = ["REGIMES", "Regime", "GAMMAS", "run_trial", "summarize", "regime_checks",
           "polished_reference", "SKIPPED_REGIMES", "UNIQUE_COND", "DEV_FLOOR"]

#: Decay factors of the baseline.
GAMMAS = (0.5, 0.1, 0.01)
#: Probe jitter (key units).
JITTER = 0.05
#: Tokens forgotten per trial.
N_FORGET = 2
#: Retained-key Gram condition number up to which the optimum counts as unique.
UNIQUE_COND = 1e8
#: Deviations are floored here on log scales and in order-of-magnitude ratios (an exact 0.0
#: has no logarithm; 1e-17 is below the fp64 resolution of f, whose values are O(1)).
DEV_FLOOR = 1e-17
#: Shuttle contexts: consecutive rows per context and the deduplication radius (standardized
#: units), as the paper's clinical regime (<= 40 hourly tokens, dedup 0.1).
SHUTTLE_WINDOW = 40
SHUTTLE_DEDUP = 0.1


@dataclass(frozen=True)
class Regime:
    """One regime of the sweep.

    Attributes
    ----------
    name, label : str
    stream : int
        Mixed into every trial's seed (``default_rng([stream, seed])``) so that regimes with
        the same trial seed draw independent numbers.
    nu, sigma : float
        ``C = 1 / (nu n)`` at the context size n; RBF width.
    goals : dict
        ``dev_median`` / ``dev_worst`` bounds of the decrement's deviation (None: no goal).
    description : str
    """

    name: str
    label: str
    stream: int
    make_keys: object = field(repr=False)
    nu: float = 0.4
    sigma: float = 2.0
    goals: dict = field(default_factory=dict)
    description: str = ""


def _gaussian(rng):
    return gaussian_keys(24, 6, rng=rng)


def _redundant(rng):
    return redundant_keys(4, 6, 6, spread=1.0, jitter=0.03, rng=rng)


def _duplicates(rng):
    return redundant_keys(4, 6, 6, spread=1.0, jitter=0.0, rng=rng)


def _near_duplicates(rng):
    return redundant_keys(4, 6, 6, spread=1.0, jitter=1e-6, rng=rng)


@lru_cache(maxsize=1)
def _shuttle_contexts():
    """Standardized (whole-data-set z-scores) Shuttle rows cut into consecutive contexts."""
    return sliding_windows(standardize(load_shuttle()), SHUTTLE_WINDOW, step=SHUTTLE_WINDOW)


def _shuttle(rng):
    contexts = _shuttle_contexts()
    window = contexts[rng.integers(len(contexts))]
    return deduplicate(window, SHUTTLE_DEDUP)[0]


#: The learned keys' RBF width: the SV layers' sqrt(2 D) at head width D = 16.
LEARNED_SIGMA = math.sqrt(32.0)


@lru_cache(maxsize=1)
def _learned_contexts():
    """Key sets of a small trained TinyLM (sv_hybrid): W_k projections of held-out text."""
    from svtoolkit.torch.learned_keys import learned_key_sets

    keys = learned_key_sets()
    if not math.isclose(keys.sigma, LEARNED_SIGMA):
        raise RuntimeError(f"learned keys have sigma {keys.sigma}, expected {LEARNED_SIGMA}")
    return keys.key_sets


def _learned(rng):
    contexts = _learned_contexts()
    return contexts[rng.integers(len(contexts))]


@lru_cache(maxsize=1)
def _recall_contexts():
    """Key sets of a small trained MQAR recall model: W_k projections of held-out facts."""
    from svtoolkit.torch.learned_keys import recall_key_sets

    keys = recall_key_sets()
    if not math.isclose(keys.sigma, RECALL_SIGMA):
        raise RuntimeError(f"recall keys have sigma {keys.sigma}, expected {RECALL_SIGMA}")
    return keys.key_sets


def _learned_recall(rng):
    contexts = _recall_contexts()
    return contexts[rng.integers(len(contexts))]


#: The recall model's RBF width (its layer's sigma, on RMS-normalised keys of width 32).
RECALL_SIGMA = 2.0

REGIMES = {
    "gaussian": Regime(
        "gaussian", "Gaussian (n=24, d=6)", 1, _gaussian,
        goals={"dev_median": 1e-12, "dev_worst": 1e-9},
        description="24 keys from N(0, I_6)"),
    "redundant": Regime(
        "redundant", "Redundant (4x6 near-duplicates)", 2, _redundant,
        goals={"dev_worst": 1e-6},
        description="4 centres from N(0, I_6), 6 members each at 0.03 N(0, I_6) around them"),
    "shuttle": Regime(
        "shuttle", "Shuttle sensors (real, <=40 rows, dedup 0.1)", 3, _shuttle,
        goals={"dev_median": 1e-12, "dev_worst": 1e-9},
        description=f"river's Statlog Shuttle NASA sensor rows (9 channels), z-scored over the "
                    f"whole data set, cut into consecutive {SHUTTLE_WINDOW}-row contexts, one "
                    f"context per trial, deduplicated within {SHUTTLE_DEDUP}"),
    # stress regimes beyond the paper (exact and near duplicates, docs/design.md §4)
    "duplicates": Regime(
        "duplicates", "Exact duplicates (4x6 copies; stress)", 4, _duplicates,
        goals={"dev_worst": 1e-6},
        description="4 centres from N(0, I_6), 6 exact copies of each: the optimum in alpha "
                    "is not unique, the decision function is"),
    "near_duplicates": Regime(
        "near_duplicates", "Near-duplicates at 1e-6 (4x6; stress)", 5, _near_duplicates,
        goals={"dev_worst": 1e-6},
        description="as redundant but members at 1e-6 N(0, I_6) around their centre (Gram "
                    "condition number ~1e14: numerically non-unique)"),
}

# the learned-keys regime needs torch (it trains the model whose keys it uses)
REGIMES["learned"] = Regime(
    "learned", "Learned keys (TinyLM sv_hybrid W_k, <=40 tokens, dedup 0.1)", 6, _learned,
    sigma=LEARNED_SIGMA, goals={"dev_median": 1e-12, "dev_worst": 1e-9},
    description="key projections of a small TinyLM with the hybrid SV layer, trained "
                "deterministically on the Python standard library's source "
                "(svtoolkit.torch.learned_keys); contexts of 40 consecutive held-out tokens "
                "per layer and head, deduplicated within 0.1")
# the paper's source of learned keys: a trained multi-query associative-recall model
REGIMES["learned_recall"] = Regime(
    "learned_recall", "Learned keys (trained MQAR recall model W_k, 40 facts, dedup 0.1)", 7,
    _learned_recall, sigma=RECALL_SIGMA, goals={"dev_median": 1e-12, "dev_worst": 1e-9},
    description="key projections of a small recall model (linear embedding, one SV layer, "
                "value head) trained deterministically on continuous multi-query associative "
                "recall (svtoolkit.torch.learned_keys.recall_key_sets); contexts of 40 "
                "held-out fact tokens, deduplicated within 0.1")
#: Regimes that cannot run in this environment, with the reason.
SKIPPED_REGIMES = {}
if importlib.util.find_spec("torch") is None:
    for _name in ("learned", "learned_recall"):
        del REGIMES[_name]
        SKIPPED_REGIMES[_name] = ("learned-keys regimes need PyTorch to train the model that "
                                  "produces the keys: pip install 'svtoolkit[torch]'")


def _probes(X, rng):
    return np.vstack([X, X + JITTER * rng.standard_normal(X.shape)])


def _partition_gap(solver, keys):
    """How far the fresh optimum is from a partition change: min over S of
    min(a, C - a) / C and over E and R of |f(x_i)|."""
    C, alpha, labels = solver.C, solver.alpha, solver_labels(solver)
    f = solver.decision_function(keys)
    gaps = [np.abs(f[labels != 1])]
    margin = alpha[labels == 1]
    gaps.append(np.minimum(margin, C - margin) / C)
    return float(min(g.min() for g in gaps if g.size))


def polished_reference(K, C):
    """The polished reference; cvxpy's "Solution may be inaccurate" warning (exact duplicates
    make the QP degenerate) is recorded as the status instead of printed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Solution may be inaccurate.*",
                                category=UserWarning)
        return ref.solve_svdd(K, C)


def _decay_devs(X, alpha0, rho0, forget, probes, f_refit, sigma):
    devs = {}
    for gamma in GAMMAS:
        alpha = alpha0.copy()
        alpha[forget] *= gamma
        f_decay = ref.decision_function(X, alpha, rho0, probes, sigma=sigma)
        devs[str(gamma)] = float(np.max(np.abs(f_decay - f_refit)))
    return devs


def _trial(regime, seed):
    rng = np.random.default_rng([regime.stream, seed])
    X = regime.make_keys(rng)
    n = len(X)
    C = 1.0 / (regime.nu * n)
    solver = IncrementalSVDD(C, regime.sigma)
    ids = solver.extend(X)
    alpha0, rho0, labels0 = solver.alpha, solver.rho, solver_labels(solver)
    forget = np.sort(rng.choice(n, N_FORGET, replace=False))
    for victim in forget:
        solver.remove(ids[victim])
    keep = np.setdiff1d(np.arange(n), forget)
    Xk = X[keep]
    fresh = IncrementalSVDD(C, regime.sigma)
    fresh.extend(Xk)
    K = rbf_kernel(Xk, sigma=regime.sigma)
    sol = polished_reference(K, C)
    probes = _probes(X, rng)
    f_dec = solver.decision_function(probes)
    f_fresh = fresh.decision_function(probes)
    f_ref = ref.decision_function(Xk, sol.alpha, sol.rho, probes, sigma=regime.sigma)
    cond = float(np.linalg.cond(K))
    labels, labels_fresh = solver_labels(solver), solver_labels(fresh)
    return {
        "n": n, "C": C,
        "forgotten": forget.tolist(),
        "forgotten_sets": [int(labels0[i]) for i in forget],
        "dev": float(np.max(np.abs(f_dec - f_fresh))),
        "dev_reference": float(np.max(np.abs(f_dec - f_ref))),
        "fresh_vs_reference": float(np.max(np.abs(f_fresh - f_ref))),
        "alpha_dev": float(np.max(np.abs(solver.alpha - fresh.alpha))),
        "rho_dev": abs(solver.rho - fresh.rho),
        "partition_match": bool(np.array_equal(labels, labels_fresh)),
        "partition_match_reference": bool(np.array_equal(labels,
                                                         reference_labels(sol, len(keep)))),
        "partition_gap": _partition_gap(fresh, Xk),
        "reference_polished": bool(sol.polished),
        "reference_status": sol.status,
        "kkt_residual": float(solver.kkt_residual()),
        "cond": cond,
        "unique": bool(cond <= UNIQUE_COND),
        "sizes": [int(np.sum(labels == s)) for s in (1, 2, 0)],
        "decay_dev": _decay_devs(X, alpha0, rho0, forget, probes, f_fresh, regime.sigma),
    }


def run_trial(regime, seed):
    """One forgetting trial; a pure function of ``(regime, seed)``.

    Parameters
    ----------
    regime : str
        A key of :data:`REGIMES`.
    seed : int
        Trial seed (the generator is ``default_rng([REGIMES[regime].stream, seed])``).

    Returns
    -------
    dict
        ``regime``, ``seed``, ``status`` ("ok" or "error: ...") and, when ok, the measurements
        (``dev``, ``dev_reference``, ``partition_match``, ``cond``, ``unique``,
        ``decay_dev`` by gamma, ...). Plain JSON types only.
    """
    out = {"regime": regime, "seed": int(seed), "status": "ok"}
    try:
        out.update(_trial(REGIMES[regime], int(seed)))
    except Exception as exc:  # a failed trial is a result (coverage), not a crash
        out["status"] = f"error: {type(exc).__name__}: {exc}"
    return out


def _stats(values):
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"median": None, "p95": None, "mean": None, "worst": None}
    return {"median": float(np.median(v)), "p95": float(np.percentile(v, 95)),
            "mean": float(np.mean(v)), "worst": float(np.max(v))}


def _rate(flags):
    return float(np.mean(flags)) if len(flags) else None


def summarize(trials):
    """Aggregate one regime's trial records (see :func:`run_trial`).

    Returns
    -------
    dict
        ``trials``, ``completed``, ``unique_trials``, ``partition_match`` (over unique trials),
        ``partition_match_all``, ``partition_match_reference``, ``dev_median`` / ``_p95`` /
        ``_mean`` / ``_worst`` (vs the fresh exact build), the same prefixed ``ref_`` (vs the
        polished reference), ``decay_dev_median`` (gamma = 0.01),
        ``decay_dev_median_by_gamma``, ``cond_median``, ``cond_max``, ``kkt_worst``,
        ``mismatches`` and ``errors``.
    """
    ok = [t for t in trials if t["status"] == "ok"]
    unique = [t for t in ok if t["unique"]]
    dev, dev_ref = _stats([t["dev"] for t in ok]), _stats([t["dev_reference"] for t in ok])
    decay = {str(g): _stats([t["decay_dev"][str(g)] for t in ok])["median"] for g in GAMMAS}
    conds = [t["cond"] for t in ok]
    out = {
        "trials": len(trials),
        "completed": len(ok),
        "unique_trials": len(unique),
        "partition_match": _rate([t["partition_match"] for t in unique]),
        "partition_match_all": _rate([t["partition_match"] for t in ok]),
        "partition_match_reference": _rate([t["partition_match_reference"] for t in unique]),
        **{f"dev_{k}": v for k, v in dev.items()},
        **{f"ref_dev_{k}": v for k, v in dev_ref.items()},
        "decay_dev_median": decay[str(GAMMAS[-1])],
        "decay_dev_median_by_gamma": decay,
        "fresh_vs_reference_worst": _stats([t["fresh_vs_reference"] for t in ok])["worst"],
        "reference_polished": sum(t["reference_polished"] for t in ok),
        "reference_inaccurate": sum(t["reference_status"] != "optimal" for t in ok),
        "cond_median": float(np.median(conds)) if conds else None,
        "cond_max": float(np.max(conds)) if conds else None,
        "kkt_worst": _stats([t["kkt_residual"] for t in ok])["worst"],
        "mismatches": [{"seed": t["seed"], "unique": t["unique"], "cond": t["cond"],
                        "partition_gap": t["partition_gap"], "dev": t["dev"]}
                       for t in ok if not t["partition_match"]],
        "errors": [{"seed": t["seed"], "status": t["status"]} for t in trials
                   if t["status"] != "ok"],
    }
    return out


def decay_orders(summary):
    """log10 of (smallest decay median over the gammas) / (decrement worst, floored)."""
    smallest = min(summary["decay_dev_median_by_gamma"].values())
    worst = max(summary["dev_worst"], DEV_FLOOR)
    return float(np.log10(smallest / worst))


def regime_checks(name, summary):
    """The goal checks of one regime (the goals of ``Regime.goals``, docs/verification.md)."""
    regime = REGIMES[name]
    prefix = f"forget.{name}"
    n = summary["trials"]
    records = [make_check(f"{prefix}.coverage", summary["completed"] / n if n else 0.0, 1.0,
                          op=">=", detail=f"{summary['completed']}/{n} trials completed "
                          "without an exception (build, exact decrement, refits)")]
    if not summary["completed"]:
        return records
    if summary["unique_trials"]:
        records.append(make_check(
            f"{prefix}.partition_match", summary["partition_match"], 1.0, op=">=",
            detail=f"same (S, E, R) as the fresh exact build on the {summary['unique_trials']} "
                   f"trials with a unique optimum (Gram cond <= {UNIQUE_COND:.0e}); vs the "
                   f"polished reference {summary['partition_match_reference']:.3f}"))
    else:
        records.append(skipped_check(f"{prefix}.partition_match",
                                     "no trial has a unique optimum (all Gram cond > "
                                     f"{UNIQUE_COND:.0e}); the decision function is compared"))
    for stat in ("median", "worst"):
        goal = regime.goals.get(f"dev_{stat}")
        if goal is None:
            continue
        records.append(make_check(
            f"{prefix}.dev_{stat}", summary[f"dev_{stat}"], goal,
            detail=f"{stat} over trials of max|f_decrement - f_fresh build| (same C)"))
        records.append(make_check(
            f"{prefix}.dev_{stat}_vs_reference", summary[f"ref_dev_{stat}"], goal,
            detail=f"{stat} over trials of max|f_decrement - f_polished reference|"))
    records.append(make_check(
        f"{prefix}.decay_orders", decay_orders(summary), 6.0, op=">=",
        detail="log10(smallest decay median over gamma in {0.5, 0.1, 0.01} / decrement worst "
               f"(floored at {DEV_FLOOR:.0e}))"))
    return records
