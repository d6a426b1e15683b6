"""The compiled half of a memory's nearest-record search (:func:`nearest_rows`).

:meth:`svtoolkit.memory._table.RecordTable.nearest` computes ``-2 X q`` with one BLAS
matrix-vector product and hands the rest to :func:`nearest_rows`: the expansion of every
squared distance, the normaliser, the candidates its rounding bound cannot rule out (the k-th
smallest by a bounded heap), their direct re-scoring, the ranking and the weights - loops over
the rows or the candidates with no temporary the size of the table beyond the product. Written
as NumPy calls the same steps cost about twenty calls of fixed overhead, which below 10^5
records is most of a query.
"""

from __future__ import annotations

import math

import numpy as np

from .._jit import njit

__all__ = ["nearest_rows", "warm_search", "UNIT", "TOTAL_RTOL"]

UNIT = 2.0 ** -53  # unit roundoff of float64
#: A query's normaliser ``sum_i a_i k(q, x_i)`` takes the terms of the records it does not
#: return from the expansion while that is off by at most this factor (relative, per term:
#: ``E / sigma^2`` of :func:`nearest_rows`), else from the direct differences of every
#: support record. 2^-30: far above what keys of moderate norm give (1e-14..1e-12), far below
#: anything a weight is read for.
TOTAL_RTOL = 2.0 ** -30


@njit
def _direct_similarity(keys, row, q, inv_sigma2):
    """exp(-||keys[row] - q||^2 inv_sigma2), the squared differences summed in coordinate
    order (no cancellation: within gamma_{d+2} of the exact sum, relative)."""
    s = 0.0
    for j in range(q.shape[0]):
        diff = keys[row, j] - q[j]
        s += diff * diff
    return math.exp(s * -inv_sigma2)


@njit
def _ahead(sims, sids, i, j):
    """Whether candidate i ranks before candidate j: higher similarity, then the older
    record (smaller solver id; ids are distinct, so the order is total)."""
    return sims[i] > sims[j] or (sims[i] == sims[j] and sids[i] < sids[j])


@njit
def _sift_down(order, root, end, sims, sids):
    """Restore the heap ``order[:end]`` below ``root``: every parent ranks behind its
    children (the last-ranked candidate on top)."""
    while 2 * root + 1 < end:
        child = 2 * root + 1
        if child + 1 < end and _ahead(sims, sids, order[child], order[child + 1]):
            child += 1  # the child further behind
        if not _ahead(sims, sids, order[root], order[child]):
            return
        order[root], order[child] = order[child], order[root]
        root = child


@njit
def _best_first(rows, sims, row_sid, k, min_similarity):
    """``rows`` and ``sims`` by decreasing similarity, ties by increasing solver id, cut to
    the supporting ones (``sims >= min_similarity``, then a prefix) and to ``k``.

    A heap sort on (similarity, solver id): O(c log c) for c candidates whatever their ties,
    and a small kernel to compile (NumPy's stable argsort compiles for seconds)."""
    sids = row_sid[rows]
    c = rows.shape[0]
    order = np.arange(c)
    for root in range(c // 2 - 1, -1, -1):
        _sift_down(order, root, c, sims, sids)
    for end in range(c - 1, 0, -1):  # move the last-ranked to the end, one at a time
        order[0], order[end] = order[end], order[0]
        _sift_down(order, 0, end, sims, sids)
    keep = 0
    for s in sims:
        if s >= min_similarity:
            keep += 1
    order = order[: min(k, keep)]
    return rows[order], sims[order]


@njit
def nearest_rows(keys, q, a, row_sqnorm, qq, span, support, support_alpha, row_alpha, row_sid,
                 k, inv_sigma2, min_similarity):
    """The (at most) ``k`` held records most similar to ``q`` that support it.

    The similarity of row i is ``s_i = exp(-D_i * inv_sigma2)`` with ``D_i`` the squared
    distance summed over the direct differences ``keys[i] - q`` (no cancellation). Rows with
    ``s_i >= min_similarity`` are ranked by decreasing ``s_i``, ties by increasing solver id
    (older first). Computing ``D_i`` so for every row is the cost of a query; instead
    ``a_i = |x_i|^2 - 2 x_i . q + |q|^2`` from the maintained squared norms ranks the rows to
    within an absolute error ``E`` (below); only the rows that the bound cannot rule out
    (usually ``k`` or a few more) are re-scored by direct differences, and the answer is read
    from those scores alone.

    Bound (u = 2^-53, gamma_m = m u / (1 - m u)): a dot product of length d is off by at most
    ``gamma_d`` times the sum of the absolute products, so ``|a_i - D_i| <= gamma_{d+2}
    (|x_i| + |q|)^2 <= E = 2 gamma_{d+4} (M + |q|)^2``, M the largest key norm (the 2 absorbs
    the rounding of M and |q| themselves); the direct sum is off by at most ``gamma_{d+2} D_i``
    (a relative error). When ``span = (M + |q|)^2`` is not below 1e300 the expansion could
    overflow where the differences do not, and every row is scored directly.

    Parameters
    ----------
    keys : ndarray of shape (n, d)
        The held keys (table rows).
    q : ndarray of shape (d,)
    a : ndarray of shape (n,)
        ``-2 keys @ q`` on entry; overwritten with ``a_i`` (unused when every row is scored
        directly).
    row_sqnorm : ndarray of shape (n,)
        ``|x_i|^2`` of each row.
    qq, span : float
        ``q . q`` and ``(M + sqrt(qq))^2``.
    support : ndarray of shape (m,), int64
        The rows with a nonzero coefficient; ``support_alpha`` their coefficients.
    row_alpha : ndarray of shape (n,)
        Every row's coefficient (0 off the support).
    row_sid : ndarray of shape (n,), int64
        Every row's solver id (the tie-break).
    k : int >= 1
    inv_sigma2 : float
        ``1 / sigma^2``.
    min_similarity : float in (0, 1]

    Returns
    -------
    sids : ndarray of shape (m,), int64
        The solver ids of m <= k records, best first.
    sims : ndarray of shape (m,)
        Their similarities (direct differences).
    weights : ndarray of shape (m,)
        Their readout weights ``row_alpha[r] s_r / total`` (equation 1), the normaliser
        ``total = sum_i row_alpha[i] s_i`` over the support: the candidates' terms from the
        direct differences, the others' from ``a_i`` (relative error of each such term at
        most ``E inv_sigma2`` plus rounding), or every term directly when that exceeds
        :data:`TOTAL_RTOL` (keys far from the origin for sigma); zeros when every term
        underflows.
    """
    n = keys.shape[0]
    if not span < 1e300:
        rows = np.arange(n)
        sims = np.empty(n)
        total = 0.0
        for i in range(n):
            sims[i] = _direct_similarity(keys, i, q, inv_sigma2)
            total += row_alpha[i] * sims[i]
        rows, sims = _best_first(rows, sims, row_sid, k, min_similarity)
        return row_sid[rows], sims, _weights(rows, sims, row_alpha, total)
    g = (q.shape[0] + 4) * UNIT / (1.0 - (q.shape[0] + 4) * UNIT)
    err = 2.0 * g * span  # E above
    # |a_i - D'_i| <= A + B a_i for the direct sum D'_i: E, the relative error of D'_i, and a
    # margin of 64 u (relative, and absolute in units of sigma^2) for the rounding of
    # exp(-D' inv_sigma2) and of the threshold (rows whose D' differ by less can tie in s)
    slack_b = g + 64.0 * UNIT
    slack_a = err * (1.0 + slack_b) + 64.0 * UNIT / inv_sigma2
    # a row can support q only if D'_i <= r_hi, hence only if a_i <= cut
    r_hi = (-math.log(min_similarity) * (1.0 + 16.0 * UNIT) + 16.0 * UNIT) / inv_sigma2
    cut = (r_hi + slack_a) / (1.0 - slack_b)
    count = 0
    for i in range(n):
        a[i] = (a[i] + row_sqnorm[i]) + qq
        count += a[i] <= cut
    if count > k:
        # the k rows of smallest a have D' <= t + A + B t (t: the k-th smallest a); a row
        # ranks above one of them only if its D' is no larger: only if a <= cut_k
        t = _kth_smallest(a, k)
        cut = min(cut, (t * (1.0 + slack_b) + 2.0 * slack_a) / (1.0 - slack_b))
    rows = _rows_at_most(a, cut)
    # the normaliser's other terms from a (then a_i >= -E, so exp(-a_i / sigma^2) <= 1 + 2^-30:
    # no overflow); past TOTAL_RTOL, every support term directly below
    approximate_total = err * inv_sigma2 <= TOTAL_RTOL
    total = 0.0
    if approximate_total:
        for j in range(support.shape[0]):
            total += support_alpha[j] * math.exp(a[support[j]] * -inv_sigma2)
    sims = np.empty(rows.shape[0])
    for j in range(rows.shape[0]):
        r = rows[j]
        sims[j] = _direct_similarity(keys, r, q, inv_sigma2)
        if approximate_total and row_alpha[r] != 0.0:  # this term from its direct score
            total += row_alpha[r] * (sims[j] - math.exp(a[r] * -inv_sigma2))
    if not approximate_total:  # keys far from the origin for sigma: every term directly
        for j in range(support.shape[0]):
            total += support_alpha[j] * _direct_similarity(keys, support[j], q, inv_sigma2)
    rows, sims = _best_first(rows, sims, row_sid, k, min_similarity)
    return row_sid[rows], sims, _weights(rows, sims, row_alpha, total)


@njit
def _kth_smallest(a, k):
    """The k-th smallest entry of ``a`` (1 <= k <= len(a)): one pass keeping the k smallest
    so far in a max-heap (an entry enters only below the heap's top, rarely after the
    first few)."""
    heap = np.full(k, np.inf)
    for x in a:
        if x < heap[0]:
            i = 0  # replace the top by x and sift it down
            while 2 * i + 1 < k:
                c = 2 * i + 1
                if c + 1 < k and heap[c + 1] > heap[c]:
                    c += 1
                if heap[c] <= x:
                    break
                heap[i] = heap[c]
                i = c
            heap[i] = x
    return heap[0]


@njit
def _rows_at_most(a, cut):
    """Indices i of ``a[i] <= cut``, ascending (a counting pass, then the fill)."""
    count = 0
    for x in a:
        count += x <= cut
    rows = np.empty(count, dtype=np.int64)
    j = 0
    for i in range(a.shape[0]):
        if j == count:
            break
        if a[i] <= cut:
            rows[j] = i
            j += 1
    return rows


@njit
def _weights(rows, sims, row_alpha, total):
    """``row_alpha[rows] sims / total`` (equation 1's readout weights), zeros when every
    term of the normaliser underflowed."""
    weights = np.zeros(rows.shape[0])
    if total > 0.0:
        for j in range(rows.shape[0]):
            weights[j] = row_alpha[rows[j]] * sims[j] / total
    return weights


def warm_search():
    """Compile :func:`nearest_rows` (or load it from Numba's cache) with the argument types a
    query passes, on two one-dimensional keys: a long-running process (the memory server)
    calls it at start-up, so that its first query does not pay it."""
    keys = np.array([[0.0], [1.0]])
    q = np.zeros(1)
    nearest_rows(keys, q, keys @ (q * -2.0), np.array([0.0, 1.0]), 0.0, 1.0,
                 np.array([0], dtype=np.int64), np.array([1.0]), np.array([1.0, 0.0]),
                 np.array([0, 1], dtype=np.int64), 1, 1.0, 0.5)
