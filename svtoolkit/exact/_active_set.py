"""The bulk build's last resort: a primal active-set method on fresh least-squares solves.

The walk keeps an explicit inverse of the bordered margin matrix up to date by rank-one
updates. Where the margin keys sample a smooth curve or surface densely (keys in one or two
dimensions at a small sigma) that matrix is numerically singular and its updated inverse falls
apart (docs/exact_solver.md, "Limits"). The method here needs no inverse to stay accurate:
every iteration solves the equality-constrained problem of its free set afresh - by LU where
that is backward stable, else by a minimum-norm least-squares solve (an SVD, stable whatever
the conditioning) - and moves towards it as far as the box allows (the classical primal
active-set method; Nocedal & Wright, *Numerical Optimization*, 2nd ed., Algorithm 16.3). The
objective never increases; the caller caps the iterations. Each costs O(m^3) for m free keys,
which is why it is the last resort and not the rule.
"""

from __future__ import annotations

import math

import numpy as np

#: Singular values of the bordered matrix below this times the largest are its rounding and are
#: dropped by the least-squares solve: an SVD determines singular values to about u times the
#: largest (u the unit roundoff), so below that they carry no information about the matrix.
ACTIVE_SET_RCOND = float(np.finfo(np.float64).eps)
_U = ACTIVE_SET_RCOND / 2.0  # the unit roundoff
#: A bulk landing's active set starts from the SMO iterate with every coefficient within this
#: fraction of C of a bound put at it (:func:`snapped_start`). An SMO stopped short leaves many
#: keys barely inside the box: on 5,000 2-D Gaussian keys (sigma = 0.1 x the median distance,
#: nu = 0.01) 2,952 of them, whose equality system is numerically singular (every LU solution
#: rejected, an SVD of 12 s each: not finished after 20 minutes); snapped at 1e-2 C, 1,203
#: stay free and the method converged in 2,620 iterations by LU, 10 minutes beside another
#: process. The method frees what the snap held wrongly, one key per iteration.
ACTIVE_SET_START_SNAP = 1e-2


def equality_solution(Kp, a, free):
    """The minimiser of a^T K' a over the free keys, the others held where ``a`` has them.

    Solves the bordered system ``M x = r``, ``M = [[0, 1^T], [1, 2 K'_FF]]``,
    ``x = [rho'; a_F]``, ``r = [1 - sum a_W; -2 K'_FW a_W]``: by an LU factorisation when
    that is backward stable (residual within (m + 1) u (||M|| ||x|| + ||r||), max norms) and
    every coefficient is in [-1, 1] - a feasible point has no coefficient outside, so a
    solution outside is either far from the box (the step is blocked either way) or the
    null-space noise of a numerically singular system - and otherwise by the minimum-norm
    least-squares solve (an SVD; singular values below ``ACTIVE_SET_RCOND`` times the
    largest dropped). Measured in bulk builds: 3,000 2-D Gaussian keys, 334 iterations at up
    to 1,609 free keys, every one by LU (a version that always took the SVD needed 465
    iterations and 303 s); 500 collinear keys, 154 of 310 by the SVD.

    Parameters
    ----------
    Kp : ndarray of shape (n, n)
        The shifted Gram matrix K' = K - 1.
    a : ndarray of shape (n,)
        Feasible coefficients (sum 1, within [0, C]).
    free : ndarray of bool, shape (n,)

    Returns
    -------
    a_free : ndarray of shape (m,)
        The free keys' coefficients at the minimiser (may lie outside the box).
    rho_shifted : float
        rho' = rho + 1, the multiplier of sum(a) = 1 in the shifted convention.
    """
    F, W = np.flatnonzero(free), np.flatnonzero(~free)
    m = len(F)
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * Kp[np.ix_(F, F)]
    rhs = np.empty(m + 1)
    rhs[0] = 1.0 - a[W].sum()
    rhs[1:] = -2.0 * (Kp[np.ix_(F, W)] @ a[W])
    try:
        x = np.linalg.solve(M, rhs)
    except np.linalg.LinAlgError:  # exactly singular
        x = None
    if x is not None and np.all(np.abs(x[1:]) <= 1.0):
        bound = (m + 1) * _U * (np.abs(M).sum(1).max() * np.abs(x).max() + np.abs(rhs).max())
        if np.abs(M @ x - rhs).max() <= bound:
            return x[1:], float(x[0])
    x = np.linalg.lstsq(M, rhs, rcond=ACTIVE_SET_RCOND)[0]  # LAPACK gelsd: an SVD
    return x[1:], float(x[0])


def snapped_start(a, C, snap):
    """A feasible start with fewer free keys: ``a`` with every coefficient within ``snap`` C of
    a bound put at it and ``sum = 1`` restored by an equal share over the others.

    Parameters
    ----------
    a : ndarray of shape (n,)
        Feasible coefficients (sum 1, within [0, C]); not changed.
    C : float
    snap : float
        Fraction of C.

    Returns
    -------
    ndarray of shape (n,)
        The snapped coefficients, or a copy of ``a`` where none would stay strictly inside
        the box or the restored sum would leave it.
    """
    b = a.copy()
    low, high = b <= snap * C, b >= C - snap * C
    b[low], b[high] = 0.0, C
    free = ~low & ~high
    if not free.any():
        return a.copy()
    b[free] += (1.0 - b.sum()) / np.count_nonzero(free)
    if b[free].min() <= 0.0 or b[free].max() >= C:
        return a.copy()
    return b


def active_set(Kp, C, a, violation_tol, max_iter):
    """Minimise a^T K' a over sum(a) = 1, 0 <= a <= C from feasible ``a`` (updated in place).

    Keys strictly inside the box are free, the others held at their bound. Each iteration
    solves the free keys' equality problem (:func:`equality_solution`) and steps towards its
    solution until a free coefficient meets a bound, which then holds it; after a full step
    the held key whose gradient has the wrong sign by most (more than ``violation_tol``) is
    freed; with none, the state is optimal.

    Parameters
    ----------
    Kp : ndarray of shape (n, n)
        The shifted Gram matrix.
    C : float or ndarray of shape (n,)
        The upper bounds (an array where they differ: ``np.inf`` for the warm-up anchor,
        which has none).
    a : ndarray of shape (n,)
        Feasible start (the bulk build's SMO iterate); holds the result.
    violation_tol : float
        Sign violations of held keys at or below this are rounding (units of f).
    max_iter : int

    Returns
    -------
    free : ndarray of bool, shape (n,)
        The free keys at the end (the margin set).
    rho_shifted : float
        rho' of the last equality solve.
    converged : bool
        False when ``max_iter`` iterations were not enough.
    """
    upper = np.broadcast_to(np.asarray(C, dtype=float), a.shape)
    free = (a > 0.0) & (a < upper)
    for _ in range(max_iter):
        a_free, rho_shifted = equality_solution(Kp, a, free)
        F = np.flatnonzero(free)
        step = a_free - a[F]
        # the longest step in [0, 1] that keeps every free coefficient in the box
        with np.errstate(divide="ignore", invalid="ignore"):
            room = np.where(step < 0.0, -a[F] / step,
                            np.where(step > 0.0, (upper[F] - a[F]) / step, np.inf))
        j = int(np.argmin(room)) if len(F) else -1
        if j >= 0 and room[j] < 1.0:
            a[F] += room[j] * step
            k = F[j]
            a[k] = 0.0 if step[j] < 0.0 else upper[k]
            free[k] = False
            continue
        a[F] = a_free
        grad = 2.0 * (Kp @ a) + rho_shifted
        wrong = np.where(~free & (a == 0.0), -grad, np.where(~free, grad, 0.0))
        k = int(np.argmax(wrong))
        if wrong[k] <= violation_tol:
            return free, rho_shifted, True
        free[k] = True
    return free, rho_shifted, False


def merge_twins(Xt, a, free, upper):
    """Exact duplicates among the free keys, all but one held on a bound (in place).

    Keys with equal coordinates have equal kernel rows, so only their total coefficient
    enters the objective and every gradient: the active-set method's minimum-norm solve
    shares it among them, which leaves the bordered matrix of the free keys exactly singular
    (equal rows), and the walk needs it invertible. Per group of equal free keys (ascending
    slots) the total T is put back as ``floor(T / C)`` keys at C, one key with the remainder
    (free when it is positive) and the others at 0: the same objective and gradients, each
    held key's gradient that of the free one (0), which satisfies either bound's sign
    condition. A remainder within the rounding of the group's sum (4 g u C for g members) is
    that rounding, not mass: it goes to the bound it is next to, since a free key holding it
    would pin rho at an arbitrary point of its interval. The warm-up anchor (``upper = inf``)
    is no key and is never merged.

    Parameters
    ----------
    Xt : ndarray of shape (d, n)
        The keys as columns.
    a : ndarray of shape (n,)
        Coefficients (the active set's result); updated.
    free : ndarray of bool, shape (n,)
        The free keys; updated.
    upper : ndarray of shape (n,)
        Upper bounds.
    """
    F = np.flatnonzero(free & np.isfinite(upper))
    if len(F) < 2:
        return
    _, group = np.unique(Xt[:, F].T, axis=0, return_inverse=True)
    group = group.ravel()
    for g in np.flatnonzero(np.bincount(group) > 1):
        members = F[group == g]
        C = float(upper[members[0]])
        total = math.fsum(a[members].tolist())
        rounding = 4.0 * len(members) * _U * C
        full = min(int((total + rounding) // C), len(members))
        remainder = total - full * C
        a[members] = 0.0
        a[members[:full]] = C
        free[members] = False
        if full < len(members) and remainder > rounding:
            a[members[full]] = remainder
            free[members[full]] = True
