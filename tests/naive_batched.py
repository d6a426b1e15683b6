"""Slow, obviously-correct references for the batched training path (NumPy, float64).

Nothing here is vectorised over problems; every function solves one problem the plain way:

* :func:`project_capped_simplex_sorted` - the capped-simplex projection by a walk over the sorted
  breakpoints of ``s(lam) = sum_i clip(y_i - lam, 0, C)`` (no iteration, no tolerance).
* :func:`exact_svdd` - the exact SVDD optimum: cvxpy + OSQP at eps 1e-10 with polishing, then an
  exact polish of its active set (identify S/E/R, solve the bordered system, verify the KKT
  conditions) - fails loudly instead of returning an unverified answer.
* :func:`ridged_solve` - the ridged bordered system of one problem, built entry by entry.
* data generators shared by the tests, the accuracy study and the benchmark.

Sign convention (docs/design.md): ``g_i = 2 (K a)_i - K_ii + rho``; S: 0 < a < C, g = 0; E: a = C,
g <= 0; R: a = 0, g >= 0.
"""

from __future__ import annotations

import numpy as np

# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def gaussian_keys(rng, n, d=6):
    """n keys drawn from N(0, I_d)."""
    return rng.normal(size=(n, d))


def redundant_keys(rng, n, d=6, cluster=8, jitter=1e-3):
    """Clusters of ``cluster`` near-duplicates: centres N(0, I_d), members moved by ``jitter``."""
    n_centres = -(-n // cluster)
    centres = rng.normal(size=(n_centres, d))
    keys = np.repeat(centres, cluster, axis=0)[:n]
    return keys + jitter * rng.normal(size=keys.shape)


def sq_dists(A, B):
    """Squared distances by explicit differences (no |a|^2 + |b|^2 - 2ab cancellation)."""
    return ((A[:, None, :] - B[None, :, :]) ** 2).sum(-1)


def median_sigma(X):
    """Median pairwise distance (the kernel width used in the studies)."""
    n = X.shape[0]
    return float(np.median(np.sqrt(sq_dists(X, X)[np.triu_indices(n, 1)])))


def rbf(A, B, sigma):
    """k(a, b) = exp(-||a - b||^2 / sigma^2)."""
    return np.exp(-sq_dists(A, B) / sigma**2)


# --------------------------------------------------------------------------------------------
# projection
# --------------------------------------------------------------------------------------------


def _total(y, lam, C):
    return float(np.clip(y - lam, 0.0, C).sum())


def project_capped_simplex_sorted(y, C):
    """argmin ||a - y|| s.t. sum(a) = 1, 0 <= a <= C, by the sorted breakpoint walk.

    ``s(lam) = sum_i clip(y_i - lam, 0, C)`` is continuous, non-increasing and linear between
    the sorted breakpoints ``{y_i - C} U {y_i}``; find the two neighbouring breakpoints that
    bracket ``s = 1`` and interpolate. Returns ``(a, lam)``; raises if ``len(y) C < 1``.
    """
    y = np.asarray(y, dtype=np.float64)
    if y.size * C < 1.0:
        raise ValueError("infeasible: len(y) * C < 1")
    points = np.sort(np.concatenate([y - C, y]))
    totals = np.array([_total(y, p, C) for p in points])
    if totals[0] <= 1.0:  # n C == 1 (the sum n C may round to just below 1): all entries at C
        return np.clip(y - points[0], 0.0, C), float(points[0])
    for k in range(len(points) - 1):
        s_left, s_right = totals[k], totals[k + 1]
        if s_left >= 1.0 >= s_right:
            if s_left == s_right:
                lam = points[k]
            else:
                lam = points[k] + (s_left - 1.0) * (points[k + 1] - points[k]) / (s_left - s_right)
            return np.clip(y - lam, 0.0, C), float(lam)
    raise AssertionError("no bracketing breakpoints; s(lam) is not monotone?")


# --------------------------------------------------------------------------------------------
# exact SVDD optimum
# --------------------------------------------------------------------------------------------


def objective(K, a):
    """a^T K a - diag(K)^T a."""
    return float(a @ K @ a - np.diag(K) @ a)


def gradient(K, a, rho):
    """g_i = 2 (K a)_i - K_ii + rho."""
    return 2.0 * K @ a - np.diag(K) + rho


def bordered_solve(K, C, margin, error, ridge=0.0):
    """Solve [[0, 1^T], [1, 2 K_SS + ridge I]] [rho; a_S] = [1 - |E| C; diag(K)_S - 2 C K_SE 1].

    ``margin`` and ``error`` are index arrays. Returns ``(a, rho)`` with ``a_E = C``.
    """
    m = len(margin)
    M = np.zeros((m + 1, m + 1))
    c = np.zeros(m + 1)
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    c[0] = 1.0 - len(error) * C
    for i, s in enumerate(margin):
        c[1 + i] = K[s, s] - 2.0 * C * sum(K[s, e] for e in error)
        for j, t in enumerate(margin):
            M[1 + i, 1 + j] = 2.0 * K[s, t] + (ridge if i == j else 0.0)
    u = np.linalg.solve(M, c)
    a = np.zeros(K.shape[0])
    a[list(error)] = C
    a[list(margin)] = u[1:]
    return a, float(u[0])


def ridged_solve(K, C, margin, error, ridge):
    """The ridged coefficients of one problem (reference for ``ridged_svdd_solve``)."""
    return bordered_solve(K, C, np.asarray(margin), np.asarray(error), ridge)


def _rho_without_margin(K, a, error, reserve):
    """S empty: rho in [max_R h, min_E h], h_i = K_ii - 2 (K a)_i; report the midpoint."""
    h = np.diag(K) - 2.0 * K @ a
    low = h[reserve].max() if len(reserve) else h[error].min()
    high = h[error].min() if len(error) else low
    return 0.5 * (low + high)


def kkt_violation(K, C, a, rho, margin, error, reserve):
    """Largest violation of the SVDD KKT conditions for the given partition."""
    g = gradient(K, a, rho)
    parts = [abs(a.sum() - 1.0), np.max(-a, initial=0.0), np.max(a - C, initial=0.0)]
    parts.append(np.max(np.abs(g[margin]), initial=0.0))
    parts.append(np.max(g[error], initial=0.0))
    parts.append(np.max(-g[reserve], initial=0.0))
    return float(max(parts))


def _polish(K, C, a0, kkt_tol):
    """Exact polish of an approximate optimum: try thresholds, keep the first KKT-exact set."""
    n = K.shape[0]
    for rel in (1e-10, 1e-8, 1e-6, 1e-4):
        error = np.flatnonzero(a0 >= C * (1.0 - rel))
        reserve = np.flatnonzero(a0 <= C * rel)
        margin = np.setdiff1d(np.arange(n), np.concatenate([error, reserve]))
        if len(margin):
            a, rho = bordered_solve(K, C, margin, error)
        else:
            if abs(len(error) * C - 1.0) > 1e-12:
                continue
            a = np.zeros(n)
            a[error] = C
            rho = _rho_without_margin(K, a, error, reserve)
        if kkt_violation(K, C, a, rho, margin, error, reserve) <= kkt_tol:
            return a, rho, margin, error
    raise RuntimeError("exact polish failed: no threshold gives a KKT-exact active set")


def exact_svdd(K, C, *, kkt_tol=1e-9):
    """Exact optimum of one SVDD dual (reference; see module docstring).

    Returns a dict with ``alpha`` (n,), ``rho``, ``margin`` and ``error`` (bool (n,)),
    ``objective`` and ``kkt`` (the verified KKT violation, <= ``kkt_tol``).
    """
    import cvxpy as cp

    K = np.asarray(K, dtype=np.float64)
    n = K.shape[0]
    if n * C < 1.0:
        raise ValueError("infeasible: n * C < 1")
    a = cp.Variable(n)
    problem = cp.Problem(
        cp.Minimize(cp.quad_form(a, cp.psd_wrap(K)) - np.diag(K) @ a),
        [cp.sum(a) == 1, a >= 0, a <= C],
    )
    problem.solve(solver="OSQP", eps_abs=1e-10, eps_rel=1e-10, polishing=True, max_iter=400_000)
    if problem.status != "optimal":
        raise RuntimeError(f"OSQP reference did not solve the problem: {problem.status}")
    alpha, rho, margin, error = _polish(K, C, np.clip(a.value, 0.0, C), kkt_tol)
    margin_mask = np.zeros(n, dtype=bool)
    error_mask = np.zeros(n, dtype=bool)
    margin_mask[margin] = True
    error_mask[error] = True
    reserve = np.flatnonzero(~margin_mask & ~error_mask)
    return {
        "alpha": alpha,
        "rho": rho,
        "margin": margin_mask,
        "error": error_mask,
        "objective": objective(K, alpha),
        "kkt": kkt_violation(K, C, alpha, rho, margin, error, reserve),
    }


# --------------------------------------------------------------------------------------------
# readouts
# --------------------------------------------------------------------------------------------


def readout(alpha, K_query, values):
    """o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i); K_query is (n_q, n)."""
    weights = K_query * alpha[None, :]
    return weights @ values / weights.sum(-1, keepdims=True)


def decision(alpha, rho, K_query, k_qq=1.0):
    """f(q) = 2 sum_i a_i k(q, x_i) - k(q, q) + rho."""
    return 2.0 * K_query @ alpha - k_qq + rho
