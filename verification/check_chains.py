"""Extension check: long random chains of exact operations, each state against a fresh solve.

The forgetting trials (check 4) delete two tokens from a fresh build. A memory lives longer:
keys come and go one at a time and in batches, reserve keys are evicted, the warm-up boundary
``n C = 1`` is crossed both ways. Here a chain builds :class:`svtoolkit.IncrementalSVDD` from
``n0`` keys of one data shape and applies a seeded random sequence of ``add``, ``extend``,
``remove`` (of a margin, error or reserve key), ``remove_many`` and ``evict_reserve``
(:func:`random_step`). After every operation:

* ``chains.<shape>.refused`` - operations the solver refused (``SolverFailure``), or that
  raised anything else: 0. A valid operation is never refused.
* ``chains.<shape>.fresh`` - over the states whose keys are numerically unique (Gram
  condition number at most :data:`UNIQUE_COND`, check 4's rule), the largest ratio of the
  state's distance to a fresh solve of the keys it holds (same C, same sigma; coefficients
  summed over identical keys, whose split is free; rho; the decision function on the keys and
  on probes; in warm-up too) to :func:`agreement_bound`, the distance two exact fp64 solves of
  those keys may have: <= 1.
* ``chains.<shape>.fresh_flat`` - over the other states, whose coefficients are not
  determined (two certified optima may differ in f by what their certificates allow), the
  largest change of f or rho to a fresh solve: <= :data:`FLAT_TOL`.
* ``chains.<shape>.objective`` - the difference of the dual objective ``a^T K a`` of the
  certified states, which is unique even where the coefficients are not, to a fresh solve's,
  over :func:`objective_bound`: <= 1.
* ``chains.<shape>.kkt`` - the largest KKT residual evaluated from the keys (not the maintained
  gradients): <= :data:`KKT_TOL` of the shape.
* ``chains.<shape>.restored`` - halfway through each chain a twin is restored from the state's
  export (``state_dict`` / ``from_state_dict``) and given the same operations; the largest
  difference of coefficients and rho between the two afterwards: 0 (bit for bit).
* ``chains.<shape>.reference`` - the last state of each chain against the polished
  interior-point reference (cvxpy + exact polish): max |f - f_ref| over keys and probes,
  over 1e-9 (checks 1-2) where the state is numerically unique and :data:`FLAT_TOL` where
  not: <= 1. Where cvxpy stops "inaccurate" and its polish gives up, the state's objective
  must be no worse than the reference's (skipped without cvxpy).

``quick`` runs three chains of 40 operations per shape (seconds); the full run (``python -m
verification --full``) twenty of 100. Alone: ``python -m verification.check_chains [--full]
[--chains N] [--ops N] [--shapes gauss,ring]``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from .forgetting import UNIQUE_COND, polished_reference
from .records import make_check, skipped_check

__all__ = ["Shape", "SHAPES", "KKT_TOL", "UNIQUE_COND", "FLAT_TOL", "shape_keys", "random_step",
           "agreement_bound", "objective_bound", "distance_to_fresh", "reference_gap",
           "run_chain", "run", "main"]

EPS = float(np.finfo(np.float64).eps)
SEED = 20261207

RING = np.stack([np.cos(2 * np.pi * np.arange(12) / 12),
                 np.sin(2 * np.pi * np.arange(12) / 12)], axis=1)

class Shape(NamedTuple):
    """Settings of a chain's data shape: the random stream (mixed into every chain's seed, so
    that shapes with the same chain seed draw independent numbers), sigma over the median
    pairwise distance, nu and n0 (C = 1 / (nu n0))."""

    stream: int
    scale: float
    nu: float
    n0: int


#: The data shapes of the chains: those where operations were once refused or left off the
#: optimum.
SHAPES = {
    "gauss": Shape(2, 1.0, 0.9, 54),  # nu n0 = 48.6: deletions cross the warm-up boundary
    "twins": Shape(5, 1.0, 0.5, 55),  # a quarter of the keys copies (exact or 1e-9 apart)
    "clusters": Shape(0, 0.3, 0.1, 100),  # tight clusters in R^6, jitter 1e-5
    "clusters2d": Shape(6, 0.1, 0.5, 120),  # tight clusters in R^2, a small kernel width
    "collinear": Shape(1, 0.1, 0.01, 100),  # keys on a line in R^2, a small kernel width
    "heavy": Shape(3, 0.3, 0.5, 100),  # student-t (2 degrees of freedom) in R^2
    "ring": Shape(4, 3.0, 0.3, 200),  # twelve ring points held many times each, wide kernel
}
#: Where the optimum is not numerically unique the coefficients are not determined, and two
#: certified optima can differ in f by what their certificates allow: f and rho are compared
#: with this absolute bound, the goal of check 4's stress regimes.
FLAT_TOL = 1e-6

#: Largest KKT residual from the keys a state may keep: the exact certificate
#: (``svtoolkit.exact.solver.BULK_KKT_TOL``), except on collinear keys, whose margin set is
#: numerically singular: there the walk's sign-violation tolerance ``REPAIR_FACTOR C
#: KAPPA_TOL`` at C = 1 / (0.01 n0) bounds it (measured up to 3.3e-12 on such chains).
KKT_TOL = {"collinear": 1e-10}


def shape_keys(name, rng, n):
    """``n`` keys of the data shape ``name`` (a key of :data:`SHAPES`).

    Returns
    -------
    ndarray of shape (n, d)
    """
    if name == "twins":  # every fourth key a copy of the one before it, exact or 1e-9 apart
        X = rng.standard_normal((n, 6))
        k = len(X[3::4])
        X[3::4] = X[2::4][:k] + rng.choice([0.0, 1e-9], size=(k, 1)) * rng.standard_normal((k, 6))
        return X
    if name in ("clusters", "clusters2d"):
        d = 2 if name == "clusters2d" else 6
        centres = 3.0 * rng.standard_normal((max(2, n // 8), d))
        return centres[rng.integers(len(centres), size=n)] + 1e-5 * rng.standard_normal((n, d))
    if name == "collinear":
        return np.outer(rng.standard_normal(n), rng.standard_normal(2))
    if name == "heavy":
        return rng.standard_t(2, size=(n, 2))
    if name == "gauss":
        return rng.standard_normal((n, 6))
    if name == "ring":
        return np.hstack([RING[rng.integers(12, size=n)], np.zeros((n, 1))])
    raise ValueError(f"unknown data shape {name!r}; known: {sorted(SHAPES)}")


def random_step(solver, rng, take):
    """Apply one random operation to ``solver``; ``take(k)`` hands out the next k new keys.

    ``add`` 0.3, ``extend`` (2-5 keys) 0.15, ``remove`` 0.3 (a margin, error or reserve key,
    the set drawn first), ``remove_many`` (up to a tenth of the keys) 0.15, ``evict_reserve``
    0.1.

    Returns
    -------
    str
        The operation's name (a removal drawn while too few keys are held does nothing).
    """
    kind = str(rng.choice(["add", "extend", "remove", "remove_many", "evict"],
                          p=[0.3, 0.15, 0.3, 0.15, 0.1]))
    if kind == "add":
        solver.add(take(1)[0])
    elif kind == "extend":
        solver.extend(take(int(rng.integers(2, 6))))
    elif kind == "remove" and len(solver) > 1:
        parts = [p for p in (solver.margin_ids, solver.error_ids, solver.reserve_ids) if len(p)]
        part = parts[rng.integers(len(parts))]
        solver.remove(int(part[rng.integers(len(part))]))
    elif kind == "remove_many" and len(solver) > 3:
        k = int(rng.integers(1, max(2, len(solver) // 10)))
        solver.remove_many(rng.choice(solver.ids, size=k, replace=False).tolist())
    elif kind == "evict":
        solver.evict_reserve()
    return kind


def agreement_bound(solver):
    """How far two exact fp64 solves of the same keys may differ in a, rho and f.

    Both end on the same partition and solve the same bordered system of its margin set,
    ``M [rho'; a_S] = b`` with ``M = [[0, 1^T], [1, 2 K'_SS]]`` (|K'| <= 1), from sums over at
    most n keys taken in different orders. Each such sum has terms of size <= 2 (the
    coefficients sum to one), so it is off by at most about ``2 n eps``, and the solve
    multiplies that by ``cond(M)``; a factor 2 for the two solves' errors adding and 2 for
    ``f = 2 sum a k + rho'`` reading both. With S empty there is no solve (cond 1): only the
    sums that place rho.
    """
    cond = 1.0
    if solver._m > 0:
        cond = float(np.linalg.cond(solver._bordered()))
    return 8.0 * cond * EPS * len(solver)


def objective_bound(solver, kkt, kkt_fresh):
    """How far the dual objectives ``a^T K a`` of ``solver`` and a fresh solve of its keys may
    differ, given their KKT residuals.

    For coefficients a with KKT residual r (in units of f), convexity gives
    ``W(a) - W(a*) <= sum_i f_i (a_i - a*_i) <= r sum_i |a_i - a*_i| <= 2 r``: every term is
    at most r times the coefficient's move, and the moves sum to at most 2. Both lie above
    the optimum, so they differ by at most ``2 max(r, r_fresh)``; each evaluation adds at most
    ``n eps sum_ij a_i |K_ij| a_j <= n eps`` (the coefficients sum to one, |K| <= 1).
    """
    return 2.0 * max(kkt, kkt_fresh) + 2.0 * len(solver) * EPS


def distance_to_fresh(solver, probes):
    """The distance of ``solver`` to a fresh solve of the keys it holds, over its bounds.

    Parameters
    ----------
    solver : IncrementalSVDD
        Holding at least one key (in warm-up too: both then hold the warm-up's coefficients).
    probes : ndarray of shape (p, d)
        Extra points where the decision functions are compared (the keys always are).

    Returns
    -------
    dict
        ``unique``: the keys' Gram condition number is at most :data:`UNIQUE_COND`. Then
        ``ratio`` is ``max(|d a| summed over identical keys, |d rho| (certified states),
        |d f|)`` over :func:`agreement_bound` (the larger of the two solvers') and ``flat``
        is 0; else ``ratio`` is 0 and ``flat`` is ``max(|d rho|, |d f|)``. ``distance``: the
        numerator either way; ``objective_ratio``: the objectives' difference over
        :func:`objective_bound` (0 in warm-up, where the anchor's mass is part of the
        objective); ``objective``: that difference; ``fresh``: the fresh solver.
    """
    from svtoolkit import IncrementalSVDD, rbf_kernel

    fresh = IncrementalSVDD(solver.C, solver.sigma)
    fresh.extend(solver.keys)
    K = rbf_kernel(solver.keys, sigma=solver.sigma)
    unique = bool(np.linalg.cond(K) <= UNIQUE_COND)
    points = np.vstack([solver.keys, probes])
    gaps = [np.max(np.abs(solver.decision_function(points) - fresh.decision_function(points)))]
    if solver.certified != fresh.certified:
        gaps.append(np.inf)
    elif solver.certified:
        gaps.append(abs(solver.rho - fresh.rho))
    if unique:
        _, group = np.unique(solver.keys, axis=0, return_inverse=True)
        group = group.ravel()
        gaps.append(np.max(np.abs(np.bincount(group, solver.alpha)
                                  - np.bincount(group, fresh.alpha))))
    distance = float(max(gaps))
    bound = max(agreement_bound(solver), agreement_bound(fresh))
    objective, objective_ratio = 0.0, 0.0  # in warm-up the anchor is part of the objective
    if solver.certified and fresh.certified:
        objective = abs(float(solver.alpha @ K @ solver.alpha - fresh.alpha @ K @ fresh.alpha))
        objective_ratio = objective / objective_bound(solver, float(solver.kkt_residual()),
                                                      float(fresh.kkt_residual()))
    return {"unique": unique, "ratio": distance / bound if unique else 0.0,
            "flat": 0.0 if unique else distance, "distance": distance,
            "objective_ratio": objective_ratio, "objective": objective, "fresh": fresh}


def _differs(a, b):
    """Largest difference of coefficients and rho between two solvers (inf: other keys)."""
    if not np.array_equal(a.ids, b.ids):
        return float("inf")
    return max(float(np.max(np.abs(a.alpha - b.alpha), initial=0.0)), abs(a.rho - b.rho))


def run_chain(name, seed, n_ops):
    """One chain of the shape ``name``; a pure function of ``(name, seed, n_ops)``.

    Returns
    -------
    dict
        ``refused`` (list of "op index: operation: message"), the worst ``ratio``, ``flat``,
        ``distance``, ``objective_ratio`` and ``objective`` of :func:`distance_to_fresh` over
        the states (``worst_ratio``, ...), ``worst_kkt``, ``restored`` (the largest twin
        difference), ``states`` (states compared), ``unique_states``, ``last`` (the final
        solver) and ``probes``.
    """
    from scipy.spatial.distance import pdist

    from svtoolkit import IncrementalSVDD
    from svtoolkit.exact import BulkFallbackWarning

    stream, scale, nu, n0 = SHAPES[name]
    rng = np.random.default_rng([SEED, stream, seed])
    pool = shape_keys(name, rng, n0 + 8 * n_ops)
    sigma = scale * float(np.median(pdist(pool[:300])))
    probes = pool[-40:] + 0.1
    cursor = [0]

    def take(k):
        out = pool[cursor[0]:cursor[0] + k]
        cursor[0] += k
        return out

    out = {"refused": [], "worst_ratio": 0.0, "worst_flat": 0.0, "worst_distance": 0.0,
           "worst_objective_ratio": 0.0, "worst_objective": 0.0, "worst_kkt": 0.0,
           "restored": 0.0, "states": 0, "unique_states": 0, "probes": probes}
    solver, twin = IncrementalSVDD(1.0 / (nu * n0), sigma), None
    with warnings.catch_warnings():
        # a bulk landing replayed key by key says so: a path, not a failure
        warnings.simplefilter("ignore", BulkFallbackWarning)
        solver.extend(take(n0))
        for op in range(n_ops):
            if op == n_ops // 2:
                twin = IncrementalSVDD.from_state_dict(solver.state_dict())
            state, start = rng.bit_generator.state, cursor[0]
            try:
                kind = random_step(solver, rng, take)
                if twin is not None:  # the same draws, the same new keys
                    rng.bit_generator.state, cursor[0] = state, start
                    random_step(twin, rng, take)
                    out["restored"] = max(out["restored"], _differs(solver, twin))
            except Exception as exc:  # noqa: BLE001 - any refusal is what this check counts
                out["refused"].append(f"{op}: {type(exc).__name__}: {exc}")
                break
            pinned = kind == "evict" and len(solver.margin_ids) == 0
            if len(solver) and not pinned:
                # after evict_reserve with an empty margin set rho stays where it was by
                # design (a fresh solve re-centres it): that state is compared after the next
                found = distance_to_fresh(solver, probes)
                for key in ("ratio", "flat", "distance", "objective_ratio", "objective"):
                    out[f"worst_{key}"] = max(out[f"worst_{key}"], found[key])
                out["worst_kkt"] = max(out["worst_kkt"], float(solver.kkt_residual()))
                out["states"] += 1
                out["unique_states"] += found["unique"]
    out["last"] = solver
    return out


def reference_gap(solver, probes):
    """The state of ``solver`` against the polished interior-point reference on its keys.

    Returns
    -------
    polished : bool
        Whether the reference's exact polish succeeded (cvxpy can stop "inaccurate" on
        degenerate keys, and its polish then gives up).
    distance : float
        max |f - f_ref| over the keys and ``probes``.
    objective_excess : float
        ``a^T K a - a_ref^T K a_ref``: how much worse the solver's objective is (negative:
        better).
    """
    from svtoolkit import rbf_kernel
    from svtoolkit import reference as ref

    X = solver.keys
    K = rbf_kernel(X, sigma=solver.sigma)
    sol = polished_reference(K, solver.C)
    points = np.vstack([X, probes])
    f_ref = ref.decision_function(X, sol.alpha, sol.rho, points, sigma=solver.sigma)
    distance = float(np.max(np.abs(solver.decision_function(points) - f_ref)))
    excess = float(solver.alpha @ K @ solver.alpha - sol.alpha @ K @ sol.alpha)
    return bool(sol.polished), distance, excess


def _reference_record(name, runs):
    """``chains.<name>.reference``: the worst distance to a polished reference over its
    tolerance (1e-9, checks 1-2's, where the last state is numerically unique; else
    :data:`FLAT_TOL`); a state whose reference was not polished passes only if its objective
    is no worse than the reference's beyond :func:`objective_bound` (else the value is
    inf)."""
    from svtoolkit import rbf_kernel

    worst, unpolished, better = 0.0, 0, 0.0
    for run in runs:
        solver = run["last"]
        if not (solver.certified and len(solver)):
            continue
        polished, distance, excess = reference_gap(solver, run["probes"])
        if polished:
            unique = np.linalg.cond(rbf_kernel(solver.keys, sigma=solver.sigma)) <= UNIQUE_COND
            worst = max(worst, distance / (1e-9 if unique else FLAT_TOL))
            continue
        unpolished += 1
        better = max(better, -excess)
        if excess > objective_bound(solver, float(solver.kkt_residual()), 0.0):
            worst = float("inf")
    note = (f"; {unpolished} reference(s) not polished (cvxpy inaccurate), where the solver's "
            f"objective is lower by up to {better:.2g}") if unpolished else ""
    return make_check(f"chains.{name}.reference", worst, 1.0,
                      detail="last state of each chain against the polished interior-point "
                             "reference, the largest change of f over its tolerance (1e-9 "
                             "where the last state is numerically unique, as checks 1-2; "
                             f"{FLAT_TOL:.0e} where not)" + note)


def _shape_records(name, chains, n_ops, reference):
    """The records of ``chains`` chains of ``n_ops`` operations on the shape ``name``."""
    runs = [run_chain(name, seed, n_ops) for seed in range(chains)]
    refused = [r for run in runs for r in run["refused"]]
    states = sum(run["states"] for run in runs)
    unique = sum(run["unique_states"] for run in runs)
    what = f"{chains} chains of {n_ops} operations, {states} states compared"
    records = [
        make_check(f"chains.{name}.refused", len(refused), 0,
                   detail=what + (f"; first refusal: {refused[0]:.300}" if refused else "")),
        make_check(f"chains.{name}.fresh", max(run["worst_ratio"] for run in runs), 1.0,
                   detail=f"{what}, {unique} numerically unique (Gram cond <= "
                          f"{UNIQUE_COND:.0e}); their distance to a fresh solve over its "
                          "rounding bound"),
        make_check(f"chains.{name}.fresh_flat", max(run["worst_flat"] for run in runs),
                   FLAT_TOL, detail=f"{what}, {states - unique} not numerically unique; "
                                    "their largest change of f or rho to a fresh solve"),
        make_check(f"chains.{name}.objective",
                   max(run["worst_objective_ratio"] for run in runs), 1.0,
                   detail=f"{what}; the change of a^T K a to a fresh solve over 2 max(KKT) "
                          f"+ 2 n eps (worst {max(run['worst_objective'] for run in runs):.2g})"),
        make_check(f"chains.{name}.kkt", max(run["worst_kkt"] for run in runs),
                   _kkt_tol(name), detail=f"{what}; KKT residual from the keys"),
        make_check(f"chains.{name}.restored", max(run["restored"] for run in runs), 0.0,
                   detail="a twin restored from state_dict halfway through each chain, given "
                          "the same operations: the largest change of a or rho"),
    ]
    if reference:
        records.append(_reference_record(name, runs))
    else:
        records.append(skipped_check(f"chains.{name}.reference",
                                     "cvxpy is not installed: pip install 'svtoolkit[verify]'"))
    return records


def _kkt_tol(name):
    from svtoolkit.exact.solver import BULK_KKT_TOL

    return KKT_TOL.get(name, BULK_KKT_TOL)


def run(quick: bool = True, *, chains=None, n_ops=None, shapes=None) -> list[dict]:
    """Run the chains of every shape; ``quick``: three chains of 40 operations per shape, else
    twenty of 100 (``chains``, ``n_ops`` and ``shapes``, a list of :data:`SHAPES` keys,
    override)."""
    import importlib.util

    reference = importlib.util.find_spec("cvxpy") is not None
    default_chains, default_ops = (3, 40) if quick else (20, 100)
    chains = default_chains if chains is None else chains
    n_ops = default_ops if n_ops is None else n_ops
    return [record for name in (SHAPES if shapes is None else shapes)
            for record in _shape_records(name, chains, n_ops, reference)]


def main(argv=None):
    """``python -m verification.check_chains [--full] [--chains N] [--ops N] [--shapes a,b]``:
    print the records as JSON; exit 1 if any check fails."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m verification.check_chains",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="twenty chains of 100 operations")
    parser.add_argument("--chains", type=int, help="chains per shape")
    parser.add_argument("--ops", type=int, help="operations per chain")
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    shapes = None if args.shapes is None else args.shapes.split(",")
    unknown = sorted(set(shapes or ()) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    results = run(quick=not args.full, chains=args.chains, n_ops=args.ops, shapes=shapes)
    print(json.dumps(results, indent=2))
    return 1 if any(r["passed"] is False for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
