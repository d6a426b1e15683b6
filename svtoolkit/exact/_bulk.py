"""Bulk build of the exact solver: an SMO pass on the shifted Gram matrix, then an exact landing.

``IncrementalSVDD.extend`` of many keys into an empty solver does not replay the walk key by key
(O(n) walks of O(n m) events each). Instead:

1. :func:`shifted_gram` - the n x n matrix K' = K - 1 (k - 1 without cancellation);
2. :func:`smo` - sequential minimal optimisation (Platt 1998) of ``min a^T K' a`` subject to
   ``sum(a) = 1, 0 <= a <= C``, with the second-order working-set selection of Fan, Chen & Lin
   ("Working set selection using second order information for training SVM", JMLR 6, 2005),
   to a loose tolerance - it only has to find the partition;
3. the caller reads the partition, grows the bordered inverse over the margin keys (keys
   dependent on the margin set stay at a bound, as in the walk), and lets the walk's own rest
   state (relaxation of sign violators, correction walk) land exactly on the optimum. Nothing of
   the SMO solution survives but the partition it suggests.

Memory: the Gram matrix, O(n^2) (``BULK_MAX_KEYS`` caps it); the walk's state is O(n m + m^2).
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from ..kernels import rbf_row_minus_one

#: SMO stops when the largest violating pair differs by at most this (units of f). It only
#: suggests the partition; the exact landing removes the rest.
SMO_TOL = 1e-10


@njit
def shifted_gram(Xt, n, inv_sigma2):
    """K'[i, j] = k(x_i, x_j) - 1 for the first n columns of Xt (exact zero diagonal)."""
    Kp = np.empty((n, n))
    for j in range(n):
        rbf_row_minus_one(Xt, n, Xt[:, j], inv_sigma2, Kp[j])
        Kp[j, j] = 0.0
    for i in range(n):
        for j in range(i + 1, n):
            Kp[j, i] = Kp[i, j]
    return Kp


@njit
def smo(Kp, C, tol, max_iter, alpha, grad):
    """SMO on ``min a^T K' a`` s.t. ``sum(a) = 1, 0 <= a <= C``, in place.

    ``alpha`` must be feasible; ``grad`` is ``2 K' alpha`` on entry and is kept so. A step
    moves mass t from j (a_j > 0) to i (a_i < C): the objective changes by
    ``t (grad_i - grad_j) + 2 t^2 (1 - k_ij)``, whose curvature ``-4 K'_ij`` the shifted kernel
    gives to full relative precision even for near keys.

    Returns
    -------
    int
        Iterations used, or -1 when ``max_iter`` was reached first.
    """
    n = alpha.shape[0]
    for it in range(max_iter):
        i = -1
        gmin = np.inf
        gmax = -np.inf
        for t in range(n):
            g = grad[t]
            if alpha[t] < C and g < gmin:
                gmin = g
                i = t
            if alpha[t] > 0.0 and g > gmax:
                gmax = g
        if i < 0 or gmax - gmin <= tol:
            return it
        row = Kp[i]
        j = -1
        best = -1.0
        for t in range(n):
            if alpha[t] > 0.0 and grad[t] > gmin:
                b = grad[t] - gmin
                eta = -2.0 * row[t]
                if eta < 1e-300:
                    eta = 1e-300
                v = b * b / eta
                if v > best:
                    best = v
                    j = t
        eta = -2.0 * row[j]
        step = min(C - alpha[i], alpha[j])
        if eta > 0.0:
            step = min(step, (grad[j] - grad[i]) / (2.0 * eta))
        if step <= 0.0:
            return -1
        alpha[i] += step
        alpha[j] -= step
        if alpha[j] < C * 1e-15:
            alpha[j] = 0.0
        if alpha[i] > C * (1.0 - 1e-15):
            alpha[i] = C
        other = Kp[j]
        two = 2.0 * step
        for t in range(n):
            grad[t] += two * (row[t] - other[t])
    return -1


def feasible_start(n, C):
    """A feasible point: C on the first floor(1/C) keys, the remainder on the next one."""
    alpha = np.zeros(n)
    full = min(n, int(np.floor(1.0 / C)))
    alpha[:full] = C
    if full < n:
        alpha[full] = max(0.0, 1.0 - full * C)
    return alpha
