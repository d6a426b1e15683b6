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

Above that cap the build is Gram-free (:func:`smo_cached`): the same SMO with the kernel columns
computed on demand and kept in a least-recently-used cache of a fixed number of columns, so its
memory is O(n * columns). It starts from a partition guessed on an evenly spaced subsample
(:func:`guess_start`: the subsample's own SMO solution at the same nu, evaluated at every key),
and its gradients start from one evaluation from the keys (:func:`weighted_sums`). The landing
is the same; its certificate is a fresh evaluation from the keys (the start's evaluation plus
the kernel sums of every coefficient that moved since, :func:`weighted_sums` again).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._jit import njit
from ..kernels import rbf_row_minus_one

#: SMO stops when the largest violating pair differs by at most this (units of f). It only
#: suggests the partition; the exact landing removes the rest.
SMO_TOL = 1e-10


@njit
def shifted_gram(Xt, n, inv_sigma2):
    """K'[i, j] = k(x_i, x_j) - 1 for the first n columns of Xt (exact zero diagonal).

    Symmetric to the bit without a copy of one triangle into the other: entry (i, j) sums the
    squares of fl(x_j[k] - x_i[k]) = -fl(x_i[k] - x_j[k]) in the same order of k as entry
    (j, i), then scales and exponentiates them alike (the copy took 17 ms of 75 at n = 2,048,
    its stores striding down columns; computing one triangle and copying it saved nothing)."""
    Kp = np.empty((n, n))
    for j in range(n):
        rbf_row_minus_one(Xt, n, Xt[:, j], inv_sigma2, Kp[j])
        Kp[j, j] = 0.0
    return Kp


@njit
def margin_block_lower(rows, order, A):
    """The lower triangle of ``A = 2 K_SS`` (= 2 K'_SS + 2, the same bits as ``M'``'s block
    plus 2) for the margin keys ``order`` (rows[p] = K'[order[p], :]), and ``||A||_1``.

    What the Cholesky route of the inverse reads (``_factor.cholesky_bordered_inverse``): half
    the gathers of :func:`bordered_margin_matrix` and no second m x m matrix (at 2,048 margin
    keys the bordered matrix and its shifted copy took about 40 ms of a 0.4 s build).

    Parameters
    ----------
    rows : ndarray of shape (m, n)
    order : ndarray of shape (m,), int64
    A : ndarray of shape (m, m), C-contiguous
        Receives ``A[p, :p + 1]`` in row p; the strict upper triangle is not written.

    Returns
    -------
    float
        The largest column sum of the symmetric A (its entries are >= 0): the sum of row p of
        the lower triangle plus column p of its strict part.
    """
    m = order.shape[0]
    row_sums = np.zeros(m)
    strict_column_sums = np.zeros(m)
    for p in range(m):
        row = rows[p]
        out = A[p]
        total = 0.0
        for q in range(p + 1):
            v = 2.0 * row[order[q]] + 2.0
            out[q] = v
            total += v
        row_sums[p] = total
        for q in range(p):
            strict_column_sums[q] += out[q]
    anorm = 0.0
    for p in range(m):
        anorm = max(anorm, row_sums[p] + strict_column_sums[p])
    return anorm


@njit
def bordered_margin_matrix(rows, order):
    """M' = [[0, 1^T], [1, 2 K'_SS]] for the margin keys ``order`` (rows[p] = K'[order[p], :]).

    Gathered within each contiguous row (a column gather ``rows[:, order]`` in NumPy costs 20x
    more at 2,048 margin keys)."""
    m = order.shape[0]
    M = np.empty((m + 1, m + 1))
    M[0, 0] = 0.0
    for p in range(m):
        M[0, p + 1] = 1.0
        M[p + 1, 0] = 1.0
        row = rows[p]
        out = M[p + 1]
        for q in range(m):
            out[q + 1] = 2.0 * row[order[q]]
    return M


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
        i, gmin = _first_of_pair(n, alpha, grad, C, tol)
        if i < 0:
            return it
        row = Kp[i]
        j = _second_of_pair(n, row, alpha, grad, gmin)
        step = _pair_step(i, j, row, alpha, grad, C)
        if step <= 0.0:
            return -1
        _pair_gradients(n, grad, row, Kp[j], step)
    return -1


@njit
def _first_of_pair(n, alpha, grad, C, tol):
    """(i, grad_i): the key that may gain mass with the smallest gradient; i = -1 once the
    maximal violation ``max_{a_t > 0} g_t - min_{a_t < C} g_t`` is at most ``tol``."""
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
        return -1, gmin
    return i, gmin


@njit
def _second_of_pair(n, row, alpha, grad, gmin):
    """j: the second-order choice (largest ``b^2 / eta``) among keys that may lose mass;
    ``row`` is K'[i, :]."""
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
    return j


@njit
def _pair_step(i, j, row, alpha, grad, C):
    """Move the optimal mass t from j to i (clipped to the box, snapped to its ends); returns
    t (nothing moves when t <= 0)."""
    eta = -2.0 * row[j]
    step = min(C - alpha[i], alpha[j])
    if eta > 0.0:
        step = min(step, (grad[j] - grad[i]) / (2.0 * eta))
    if step <= 0.0:
        return step
    alpha[i] += step
    alpha[j] -= step
    if alpha[j] < C * 1e-15:
        alpha[j] = 0.0
    if alpha[i] > C * (1.0 - 1e-15):
        alpha[i] = C
    return step


@njit
def _pair_gradients(n, grad, row, other, step):
    """grad += 2 t (K'[i, :] - K'[j, :]) after a step t from j to i."""
    two = 2.0 * step
    for t in range(n):
        grad[t] += two * (row[t] - other[t])


def feasible_start(n, C):
    """A feasible point: C on the first floor(1/C) keys, the remainder on the next one."""
    alpha = np.zeros(n)
    full = min(n, int(np.floor(1.0 / C)))
    alpha[:full] = C
    if full < n:
        alpha[full] = max(0.0, 1.0 - full * C)
    return alpha


@njit
def weighted_sums(Xt, lo, hi, inv_sigma2, keys, coef, out):
    """out[i] = sum_q coef[q] K'(x_i, keys[:, q]) for lo <= i < hi (x_i = Xt[:, i]).

    The distance loop and ``expm1`` of :func:`svtoolkit.kernels.rbf_row_minus_one` (the
    walk's own kernel evaluations): O((hi - lo) q d), no cancellation. Disjoint ranges of i
    can run in separate threads (the kernel releases the GIL).

    Parameters
    ----------
    Xt : ndarray of shape (d, >= hi)
    keys : ndarray of shape (d, q), C-contiguous
    coef : ndarray of shape (q,)
    out : ndarray of shape (>= hi,)
    """
    row = np.empty(keys.shape[1])
    for i in range(lo, hi):
        rbf_row_minus_one(keys, keys.shape[1], Xt[:, i], inv_sigma2, row)
        s = 0.0
        for q in range(keys.shape[1]):
            s += coef[q] * row[q]
        out[i] = s


@njit
def cached_column(Xt, n, inv_sigma2, key, cols, slot_of, key_of, stamp, clock):
    """Row of ``cols`` holding K'[:, key] (computed into the least recently used row on a miss).

    ``slot_of[key]`` is the row of a cached key or -1; ``key_of[row]`` the key of a row or -1;
    ``stamp[row]`` the clock of its last use (the newest row is never the one evicted, so two
    columns fetched in a row are both valid while ``cols`` has at least two rows).
    """
    s = slot_of[key]
    if s < 0:
        s = 0
        for t in range(1, stamp.shape[0]):
            if stamp[t] < stamp[s]:
                s = t
        if key_of[s] >= 0:
            slot_of[key_of[s]] = -1
        rbf_row_minus_one(Xt, n, Xt[:, key], inv_sigma2, cols[s])
        cols[s, key] = 0.0
        key_of[s] = key
        slot_of[key] = s
    stamp[s] = clock
    return s


@njit
def smo_cached(Xt, n, inv_sigma2, C, tol, max_iter, alpha, grad, cols, slot_of, key_of, stamp):
    """:func:`smo` without the Gram matrix: columns from :func:`cached_column`, in place.

    Same selection, step and snapping as :func:`smo`, on the same kernel values (the walk's
    ``rbf_row_minus_one``). ``grad`` must be ``2 K' alpha`` on entry.

    Returns
    -------
    int
        Iterations used, or -1 when ``max_iter`` was reached or no step could be made.
    """
    for it in range(max_iter):
        i, gmin = _first_of_pair(n, alpha, grad, C, tol)
        if i < 0:
            return it
        row = cols[cached_column(Xt, n, inv_sigma2, i, cols, slot_of, key_of, stamp, 2 * it)]
        j = _second_of_pair(n, row, alpha, grad, gmin)
        step = _pair_step(i, j, row, alpha, grad, C)
        if step <= 0.0:
            return -1
        other = cols[cached_column(Xt, n, inv_sigma2, j, cols, slot_of, key_of, stamp,
                                   2 * it + 1)]
        _pair_gradients(n, grad, row, other, step)
    return -1


#: Kernel sums of at least this many key pairs are split over threads (one per CPU, at most
#: SUM_THREADS); below it a thread's start costs more than it saves.
SUM_PARALLEL_PAIRS = 10_000_000
SUM_THREADS = 4


def kernel_sums(Xt, n, inv_sigma2, idx, coef):
    """sum_q coef[q] K'(x_i, x_idx[q]) for every i < n, from the keys (:func:`weighted_sums`).

    Large sums run in one thread per available CPU over disjoint ranges of i; each range is
    computed exactly as a single thread would, so the result does not depend on the split.

    Returns
    -------
    ndarray of shape (n,)
    """
    out = np.zeros(n)
    if len(idx) == 0:
        return out
    keys = np.ascontiguousarray(Xt[:, idx])
    coef = np.ascontiguousarray(coef, dtype=np.float64)
    threads = min(SUM_THREADS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else (os.cpu_count() or 1))
    if threads < 2 or n * len(idx) < SUM_PARALLEL_PAIRS:
        weighted_sums(Xt, 0, n, inv_sigma2, keys, coef, out)
        return out
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    with ThreadPoolExecutor(threads) as pool:
        jobs = [pool.submit(weighted_sums, Xt, int(lo), int(hi), inv_sigma2, keys, coef, out)
                for lo, hi in zip(bounds[:-1], bounds[1:])]
        for job in jobs:
            job.result()
    return out


def column_cache(n, n_columns):
    """Empty cache arrays for :func:`smo_cached`: (cols, slot_of, key_of, stamp), with
    between 2 and n columns."""
    n_columns = max(2, min(n, int(n_columns)))
    return (np.empty((n_columns, n)), np.full(n, -1, dtype=np.int64),
            np.full(n_columns, -1, dtype=np.int64), np.full(n_columns, -1, dtype=np.int64))


def guess_start(Xt, n, inv_sigma2, C, sample_size):
    """A feasible start whose error set is guessed from an evenly spaced subsample.

    The subsample (``sample_size`` keys) is solved by :func:`smo` at the same nu (box
    ``C n / sample_size``); its decision function, evaluated at every key, ranks the keys,
    and the floor(1/C) most outlying get C (the remainder of the unit mass goes to the next).
    Only the ranking is used: the start is feasible whatever the subsample's quality.

    Returns
    -------
    ndarray of shape (n,)
    """
    alpha = np.zeros(n)
    if sample_size >= n or sample_size < 2:
        return feasible_start(n, C)
    idx = np.unique(np.linspace(0, n - 1, sample_size).round().astype(np.int64))
    sub = np.ascontiguousarray(Xt[:, idx])
    Kp = shifted_gram(sub, len(idx), inv_sigma2)
    Cs = C * n / len(idx)
    a_sub = feasible_start(len(idx), Cs)
    g_sub = 2.0 * (Kp @ a_sub)
    smo(Kp, Cs, SMO_TOL, 200 * len(idx) + 10_000, a_sub, g_sub)
    support = idx[np.flatnonzero(a_sub)]
    field = kernel_sums(Xt, n, inv_sigma2, support, a_sub[a_sub != 0.0])
    order = np.argsort(field, kind="stable")  # most outlying (smallest f) first
    full = min(n, int(np.floor(1.0 / C)))
    alpha[order[:full]] = C
    if full < n:
        alpha[order[full]] = max(0.0, 1.0 - full * C)
    return alpha
