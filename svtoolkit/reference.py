"""Independent reference solutions of the SVDD dual: cvxpy interior point plus an exact polish.

This module shares no code with the exact solver's walk. It solves

    minimise  a^T K a - diag(K)^T a    subject to  sum(a) = 1,  0 <= a_i <= C

with cvxpy + CLARABEL (an interior-point method) at tight tolerances, then *polishes*: it reads
the partition margin / error / reserve off the interior-point solution, solves the bordered KKT
system of that partition exactly, and repairs the partition one violator at a time until every
KKT sign condition holds. Interior-point coefficients alone are accurate to only ~1e-6 C;
the polish makes the reference exact to rounding where the optimum is unique.
``solver="OSQP"`` (eps 1e-10, polishing on) gives an independent cross-check. OSQP at its
default eps is never used: it reports "optimal" on wrong answers.

Requires the ``verify`` extra (cvxpy, clarabel, osqp).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ._optional import require
from ._rules import BOUND_SNAP, IPM_PARTITION_TOL, SUM_ROUNDOFF, feasible, sums_to_one
from ._validation import as_keys, check_option, check_positive, check_sigma, largest_violation
from .kernels import rbf_kernel

__all__ = [
    "ReferenceSolution",
    "solve_svdd",
    "solve_svdd_keys",
    "kkt_residual",
    "objective",
    "decision_function",
]

#: Sign conditions of the polished partition must hold to this (units of f).
POLISH_SIGN_TOL = 1e-12
#: A polished solution is accepted when its KKT residual is below this.
POLISH_ACCEPT_TOL = 1e-9
#: A bordered system with a larger condition number has (near) duplicate margin members.
DEPENDENCE_COND = 1e10


def _sum_rounding(alpha):
    """SUM_ROUNDOFF * sum_i |s_i| over the partial sums s_i of alpha's nonzero entries in
    index order: a bound on the rounding of fl(sum a) (svtoolkit._rules.SUM_ROUNDOFF)."""
    nonzero = alpha[alpha != 0.0]
    return SUM_ROUNDOFF * float(np.abs(np.cumsum(nonzero)).sum())


@dataclass(frozen=True)
class ReferenceSolution:
    """Result of :func:`solve_svdd` (frozen: a solution is not edited after the fact).

    Attributes
    ----------
    alpha : ndarray of shape (n,)
    rho : float
        Offset of ``f(x) = 2 sum_i a_i k(x, x_i) - k(x, x) + rho``; the midpoint of its optimal
        interval when the margin set is empty.
    margin, error, reserve : ndarray of int
        Index sets (0 < a < C; a = C; a = 0).
    objective : float
    kkt_residual : float
        Largest KKT violation in units of f (see :func:`kkt_residual`).
    status : str
        cvxpy's status of the interior-point solve.
    polished : bool
        Whether the exact polish succeeded (``alpha`` is then the polished solution).
    solver : str
    message : str
    iterations : int
        Polish repairs performed.
    raw_alpha : ndarray of shape (n,)
        The interior-point coefficients before the polish.
    """

    alpha: np.ndarray
    rho: float
    margin: np.ndarray
    error: np.ndarray
    reserve: np.ndarray
    objective: float
    kkt_residual: float
    status: str
    polished: bool
    solver: str
    message: str = ""
    iterations: int = 0
    raw_alpha: np.ndarray = field(default=None, repr=False)


def objective(K, alpha):
    """Dual objective ``a^T K a - diag(K)^T a``."""
    return float(alpha @ K @ alpha - np.diag(K) @ alpha)


def _gradient_without_rho(K, alpha):
    return 2.0 * (K @ alpha) - np.diag(K)


def kkt_residual(K, C, alpha, rho, margin=None, error=None, reserve=None):
    """Largest KKT violation of (alpha, rho), in units of f.

    Terms: ``2 |sum(a) - 1|``, ``2 x`` box violations, ``|g|`` on the margin set,
    ``max(g, 0)`` on the error set, ``max(-g, 0)`` on the reserve set, with
    ``g = 2 K a - diag(K) + rho``. When the sets are not given they are read off alpha with
    :data:`IPM_PARTITION_TOL`.
    """
    K = np.asarray(K, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    given = [s is not None for s in (margin, error, reserve)]
    if any(given) and not all(given):
        raise ValueError("give all three of margin, error and reserve, or none of them")
    if margin is None:
        margin, error, reserve = _partition(alpha, C)
    g = _gradient_without_rho(K, alpha) + rho
    terms = [
        2.0 * abs(alpha.sum() - 1.0),
        2.0 * float(np.max(np.maximum(-alpha, 0.0), initial=0.0)),
        2.0 * float(np.max(np.maximum(alpha - C, 0.0), initial=0.0)),
        float(np.max(np.abs(g[margin]), initial=0.0)),
        float(np.max(np.maximum(g[error], 0.0), initial=0.0)),
        float(np.max(np.maximum(-g[reserve], 0.0), initial=0.0)),
    ]
    return largest_violation(terms)


def _partition(alpha, C):
    thr = IPM_PARTITION_TOL * C
    error = np.flatnonzero(alpha >= C - thr)
    reserve = np.flatnonzero(alpha <= thr)
    margin = np.flatnonzero((alpha > thr) & (alpha < C - thr))
    return margin, error, reserve


def _rho_interval(K, alpha, error, reserve):
    """With S empty: rho in [max_R (-h), min_E (-h)], h = 2 K a - diag(K)."""
    h = _gradient_without_rho(K, alpha)
    lo = float(np.max(-h[reserve])) if len(reserve) else -np.inf
    hi = float(np.min(-h[error])) if len(error) else np.inf
    return lo, hi


def _bordered(K, margin):
    m = len(margin)
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[np.ix_(margin, margin)]
    return M


def _most_dependent(M):
    """Position (in the margin list) of the member most involved in M's near-null space, or -1
    when M is well conditioned (condition number below :data:`DEPENDENCE_COND`)."""
    _, sv, vt = np.linalg.svd(M)
    if sv[-1] > sv[0] / DEPENDENCE_COND:
        return -1
    return int(np.argmax(np.abs(vt[-1, 1:])))


def _solve_partition(K, C, margin, error, n):
    """Exact coefficients and rho for a given partition (bordered system, refined solve)."""
    alpha = np.zeros(n)
    alpha[error] = C
    m = len(margin)
    if m == 0:
        return alpha, None
    M = _bordered(K, margin)
    rhs = np.empty(m + 1)
    rhs[0] = 1.0 - C * len(error)
    rhs[1:] = np.diag(K)[margin] - 2.0 * C * K[np.ix_(margin, error)].sum(axis=1)
    u = np.linalg.solve(M, rhs)
    u += np.linalg.solve(M, rhs - M @ u)  # one step of iterative refinement
    alpha[margin] = u[1:]
    return alpha, float(u[0])


def _polish(K, C, raw, max_repairs):
    """Exact active-set polish starting from the partition read off ``raw``."""
    n = len(raw)
    margin, error, reserve = (list(s) for s in _partition(raw, C))
    best = None  # the candidate with the smallest KKT residual, for degenerate cycling
    for it in range(max_repairs + 1):
        if margin:
            dep = _most_dependent(_bordered(K, np.array(margin, int)))
            if dep >= 0:
                # (near) duplicates in S make the system singular: the member most involved
                # goes to the bound nearer to its interior-point value
                i = margin.pop(dep)
                (error if raw[i] > 0.5 * C else reserve).append(i)
                continue
        alpha, rho = _solve_partition(K, C, np.array(margin, int), np.array(error, int), n)
        if rho is None:
            if not sums_to_one(len(error), C):
                # sum(a) = 1 needs a free coefficient: free the most interior raw point
                bound = error + reserve
                pick = bound[int(np.argmax(np.minimum(raw[bound], C - raw[bound])))]
                (error if pick in error else reserve).remove(pick)
                margin.append(pick)
                continue
            lo, hi = _rho_interval(K, alpha, np.array(error, int), np.array(reserve, int))
            if lo > hi + POLISH_SIGN_TOL:
                # no rho satisfies every sign: the most violated point enters S
                h = _gradient_without_rho(K, alpha)
                cand = [(h[i] + hi, i) for i in reserve] + [(-(h[i] + lo), i) for i in error]
                _, pick = min(cand)
                (error if pick in error else reserve).remove(pick)
                margin.append(pick)
                continue
            rho = lo if hi == np.inf else hi if lo == -np.inf else 0.5 * (lo + hi)
        g = _gradient_without_rho(K, alpha) + rho
        sets = (np.array(sorted(margin), int), np.array(sorted(error), int),
                np.array(sorted(reserve), int))
        residual = kkt_residual(K, C, alpha, rho, *sets)
        if best is None or residual < best[0]:
            best = (residual, (alpha, rho, sets, it))
        worst, action = 0.0, None
        for i in margin:
            if alpha[i] < 0.0 and -alpha[i] > worst:
                worst, action = -alpha[i], (i, "margin", "reserve")
            elif alpha[i] > C and alpha[i] - C > worst:
                worst, action = alpha[i] - C, (i, "margin", "error")
        for i in error:
            if g[i] > POLISH_SIGN_TOL and g[i] > worst:
                worst, action = g[i], (i, "error", "margin")
        for i in reserve:
            if g[i] < -POLISH_SIGN_TOL and -g[i] > worst:
                worst, action = -g[i], (i, "reserve", "margin")
        if action is None:
            return _canonical(K, C, alpha, rho, sets), it
        i, src, dst = action
        groups = {"margin": margin, "error": error, "reserve": reserve}
        groups[src].remove(i)
        groups[dst].append(i)
    # Near duplicates can make the repairs cycle at the level of their first-order gradient
    # difference; the best candidate met is returned (accepted only below POLISH_ACCEPT_TOL).
    if best is None:
        return None
    alpha, rho, sets, it = best[1]
    return _canonical(K, C, alpha, rho, sets), it


def _canonical(K, C, alpha, rho, sets):
    """Margin coefficients within ``BOUND_SNAP * C`` of a bound, or within the rounding bound
    of sum(a) (:func:`_sum_rounding`), join that bound's set - all of them, and only if the
    mass they move together is within the same bound (the exact solver's rule, so both report
    the same partition); with S then empty, rho is the midpoint of its optimal interval (the
    solver's convention)."""
    margin, error, reserve = sets
    sum_tol = _sum_rounding(alpha)
    at_upper = (alpha[margin] >= C * (1.0 - BOUND_SNAP)) | (C - alpha[margin] <= sum_tol)
    at_lower = ~at_upper & ((alpha[margin] <= C * BOUND_SNAP)
                            | (alpha[margin] <= sum_tol))
    if not (at_upper.any() or at_lower.any()):
        return alpha, rho, sets
    moved = float(np.sum(C - alpha[margin[at_upper]]) - np.sum(alpha[margin[at_lower]]))
    if abs(moved) > max(BOUND_SNAP * C, sum_tol):
        return alpha, rho, sets
    alpha = alpha.copy()
    alpha[margin[at_upper]] = C
    alpha[margin[at_lower]] = 0.0
    error = np.sort(np.concatenate([error, margin[at_upper]]))
    reserve = np.sort(np.concatenate([reserve, margin[at_lower]]))
    margin = margin[~(at_upper | at_lower)]
    if len(margin) == 0:
        lo, hi = _rho_interval(K, alpha, error, reserve)
        rho = lo if hi == np.inf else hi if lo == -np.inf else 0.5 * (lo + hi)
    return alpha, rho, (margin, error, reserve)


def solve_svdd(K, C, *, solver="CLARABEL", polish=True, max_repairs=None, verbose=False):
    """Reference solution of the SVDD dual on a Gram matrix.

    Parameters
    ----------
    K : array_like of shape (n, n)
        Symmetric positive semi-definite kernel matrix.
    C : float
        Box constraint; ``n * C >= 1`` is required for feasibility.
    solver : {"CLARABEL", "OSQP"}
        Interior point (default; tolerances 1e-12) or OSQP with eps 1e-10 and polishing.
    polish : bool, default True
        Run the exact active-set polish (recommended; the raw coefficients are accurate to
        ~1e-6 C only).
    max_repairs : int, optional
        Limit on polish repairs (default ``2 n + 20``).

    Returns
    -------
    ReferenceSolution

    Raises
    ------
    ValueError
        ``n * C < 1`` (infeasible), K not square, not finite or not symmetric.
    """
    cp = require("cvxpy", feature="svtoolkit.reference")
    K = np.array(K, dtype=np.float64)
    C = check_positive(C, "C")
    if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] == 0:
        raise ValueError(f"K must be a non-empty square matrix; got shape {K.shape}")
    if not np.isfinite(K).all():
        raise ValueError("K contains NaN or inf")
    if not np.allclose(K, K.T, rtol=0.0, atol=1e-12):
        raise ValueError("K must be symmetric")
    n = K.shape[0]
    if not feasible(n, C):
        raise ValueError(
            f"infeasible: n * C = {n * C:.6g} < 1 (sum(a) = 1 with a <= C needs n * C >= 1)"
        )
    a = cp.Variable(n)
    problem = cp.Problem(
        cp.Minimize(cp.quad_form(a, cp.psd_wrap(K)) - np.diag(K) @ a),
        [cp.sum(a) == 1, a >= 0, a <= C],
    )
    name = check_option(solver.upper() if isinstance(solver, str) else solver, "solver",
                        ("CLARABEL", "OSQP"))
    if name == "CLARABEL":
        problem.solve(solver=cp.CLARABEL, verbose=verbose, tol_gap_abs=1e-12,
                      tol_gap_rel=1e-12, tol_feas=1e-12, tol_ktratio=1e-10, max_iter=500)
    else:
        problem.solve(solver=cp.OSQP, verbose=verbose, eps_abs=1e-10, eps_rel=1e-10,
                      polishing=True, max_iter=200000)
    if a.value is None:
        raise RuntimeError(f"{name} returned no solution (status {problem.status})")
    raw = np.clip(np.asarray(a.value, dtype=np.float64), 0.0, C)
    margin, error, reserve = _partition(raw, C)
    raw_rho = _raw_rho(K, raw, margin, error, reserve)
    result = ReferenceSolution(
        alpha=raw, rho=raw_rho, margin=margin, error=error, reserve=reserve,
        objective=objective(K, raw),
        kkt_residual=kkt_residual(K, C, raw, raw_rho, margin, error, reserve),
        status=str(problem.status), polished=False, solver=name, raw_alpha=raw.copy(),
        message="raw interior-point solution",
    )
    if not polish:
        return result
    repairs = max_repairs if max_repairs is not None else 2 * n + 20
    polished = _polish(K, C, raw, repairs)
    if polished is None:
        return replace(result, message=f"polish did not converge in {repairs} repairs; raw "
                       "solution returned")
    (alpha, rho, (margin, error, reserve)), iterations = polished
    residual = kkt_residual(K, C, alpha, rho, margin, error, reserve)
    if residual > POLISH_ACCEPT_TOL:
        return replace(result, message=f"polish residual {residual:.2e} too large; raw solution "
                       "returned")
    return ReferenceSolution(
        alpha=alpha, rho=rho, margin=margin, error=error, reserve=reserve,
        objective=objective(K, alpha), kkt_residual=residual, status=str(problem.status),
        polished=True, solver=name, message="polished", iterations=iterations,
        raw_alpha=raw,
    )


def _raw_rho(K, alpha, margin, error, reserve):
    h = _gradient_without_rho(K, alpha)
    if len(margin):
        return float(np.median(-h[margin]))
    lo, hi = _rho_interval(K, alpha, error, reserve)
    return lo if hi == np.inf else hi if lo == -np.inf else 0.5 * (lo + hi)


def solve_svdd_keys(X, *, C, sigma, **kwargs):
    """:func:`solve_svdd` on the RBF Gram matrix of keys ``X`` (shape (n, d))."""
    X = as_keys(X, "X")
    return solve_svdd(rbf_kernel(X, sigma=check_sigma(sigma)), C, **kwargs)


def decision_function(keys, alpha, rho, Q, *, sigma):
    """f(q) = 2 sum_i a_i k(q, x_i) - 1 + rho for each row of Q (RBF kernel)."""
    Kq = rbf_kernel(Q, keys, sigma=sigma)
    return 2.0 * Kq @ np.asarray(alpha, dtype=np.float64) - 1.0 + rho
