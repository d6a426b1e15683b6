"""Slow, obviously correct references for the exact path (no Numba, no shared code).

Each function here is written for clarity, not speed, and shares nothing with svtoolkit's
implementation: kernels by a double loop over ``math.exp``, optimality checked coordinate by
coordinate from the values of ``a`` alone, and tiny SVDD problems solved by enumerating every
partition into margin / error / reserve sets.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def rbf(X, Y, sigma):
    """K[i, j] = exp(-||X[i] - Y[j]||^2 / sigma^2) by a double loop."""
    X = np.asarray(X, dtype=float)
    Y = np.asarray(Y, dtype=float)
    K = np.empty((len(X), len(Y)))
    for i, x in enumerate(X):
        for j, y in enumerate(Y):
            K[i, j] = math.exp(-sum((a - b) ** 2 for a, b in zip(x, y, strict=True)) / sigma**2)
    return K


def objective(K, a):
    """a^T K a - diag(K)^T a."""
    n = len(a)
    return sum(a[i] * K[i, j] * a[j] for i in range(n) for j in range(n)) - sum(
        K[i, i] * a[i] for i in range(n)
    )


def kkt_violation(K, C, a, rho):
    """Largest KKT violation of (a, rho), classifying each coordinate by its value only.

    a_i <= 0 needs g_i >= 0; a_i >= C needs g_i <= 0; otherwise g_i = 0; plus |sum a - 1| and
    box violations. g_i = 2 (K a)_i - K_ii + rho.
    """
    n = len(a)
    worst = abs(sum(a) - 1.0)
    for i in range(n):
        g = 2.0 * sum(K[i, j] * a[j] for j in range(n)) - K[i, i] + rho
        if a[i] <= 0.0:
            worst = max(worst, -g, -a[i])
        elif a[i] >= C:
            worst = max(worst, g, a[i] - C)
        else:
            worst = max(worst, abs(g))
    return worst


def decision(keys, a, rho, Q, sigma):
    """f(q) = 2 sum_i a_i k(q, x_i) - 1 + rho."""
    return 2.0 * rbf(Q, keys, sigma) @ np.asarray(a) - 1.0 + rho


def enumerate_svdd(K, C, tol=1e-10):
    """Exact optimum of a tiny SVDD dual by trying every partition (n <= 7).

    For every assignment of the points to margin (free), error (a = C) and reserve (a = 0):
    solve the bordered system for the margin coefficients and rho (or, with no margin point,
    take the midpoint of rho's interval, or its finite end), and accept it if every condition
    holds. A margin coefficient within ``tol`` of a bound rejects its partition: the same point
    is the partition with that key at the bound, as the solver's canonical rest state reads it.
    Returns (objective, a, rho) of the best accepted partition (they all share the objective).
    """
    n = K.shape[0]
    assert n <= 7, "enumeration is exponential"
    best = None
    diag = np.diag(K)
    for labels in itertools.product((0, 1, 2), repeat=n):
        S = [i for i in range(n) if labels[i] == 1]
        E = [i for i in range(n) if labels[i] == 2]
        Rv = [i for i in range(n) if labels[i] == 0]
        a = np.zeros(n)
        a[E] = C
        if S:
            m = len(S)
            M = np.zeros((m + 1, m + 1))
            M[0, 1:] = 1.0
            M[1:, 0] = 1.0
            M[1:, 1:] = 2.0 * K[np.ix_(S, S)]
            if np.linalg.matrix_rank(M, tol=1e-10) < m + 1:
                continue
            rhs = np.concatenate(([1.0 - C * len(E)], diag[S] - 2.0 * C * K[np.ix_(S, E)].sum(1)))
            u = np.linalg.solve(M, rhs)
            rho = u[0]
            a[S] = u[1:]
            # a margin coefficient at a bound (to tol) is the same point as the partition with
            # that key in the bound's set, which the canonical rest state reports: rho at the
            # midpoint of its interval, not pinned by the key at the bound
            if np.any(a[S] < tol) or np.any(a[S] > C - tol):
                continue
        else:
            if abs(C * len(E) - 1.0) > tol:
                continue
            h = 2.0 * K @ a - diag
            lo = max((-h[i] for i in Rv), default=-np.inf)
            hi = min((-h[i] for i in E), default=np.inf)
            if lo > hi + tol:
                continue
            rho = lo if hi == np.inf else hi if lo == -np.inf else 0.5 * (lo + hi)
        g = 2.0 * K @ a - diag + rho
        if any(g[i] > tol for i in E) or any(g[i] < -tol for i in Rv):
            continue
        obj = objective(K, a)
        if best is None or obj < best[0] - 1e-14:
            best = (obj, a.copy(), rho)
    return best
