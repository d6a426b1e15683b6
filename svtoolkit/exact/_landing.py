"""The exact landing of a bulk build: from SMO coefficients to the walk's state arrays.

:meth:`IncrementalSVDD.extend` of many keys into an empty solver runs SMO
(:mod:`svtoolkit.exact._bulk`) and lands on its partition: the coefficients within
``BULK_PARTITION_SNAP`` C of a bound are put at it, the bordered inverse is built over the
margin keys (one factorisation, or grown key by key from the most interior one when a key is
dependent on the others), and the walk's own rest state then ends on the exact optimum. The
functions here are plain functions over the solver's arrays (layout: :mod:`svtoolkit.exact._walk`);
the solver keeps the orchestration (array capacity, the rest state, acceptance of the landing).
"""

from __future__ import annotations

import numpy as np

from . import _bulk as B
from . import _walk as W
from ._factor import cholesky_bordered_inverse

#: The Gram-free SMO keeps at most this many bytes of kernel columns (an LRU cache; 335
#: columns at n = 10^5) ...
BULK_CACHE_BYTES = 256 * 2**20
#: ... starts from the partition of an evenly spaced subsample of this many keys (at most
#: n / 8: a subsample near n costs what the whole build costs) ...
BULK_GUESS_KEYS = 4096
#: ... and gives up (the walk replays the batch) after this many iterations per key.
BULK_SMO_ITERATIONS = 50
#: SMO coefficients within this fraction of C of a bound are read as at the bound.
BULK_PARTITION_SNAP = 1e-9


def smo_on_gram(Xt, n, inv_sigma2, C):
    """SMO on the n x n shifted Gram matrix (O(n^2) memory) from :func:`_bulk.feasible_start`.

    Parameters
    ----------
    Xt : ndarray of shape (d, >= n)
        The keys as columns.
    n : int
    inv_sigma2, C : float

    Returns
    -------
    Kp : ndarray of shape (n, n)
        The shifted Gram matrix K' = K - 1.
    a : ndarray of shape (n,)
        SMO's last iterate.
    converged : bool
        Whether SMO met its tolerance (the landing proceeds from ``a`` either way).
    """
    Kp = B.shifted_gram(Xt, n, inv_sigma2)
    a = B.feasible_start(n, C)
    grad = 2.0 * (Kp @ a)
    converged = B.smo(Kp, C, B.SMO_TOL, 200 * n + 10_000, a, grad) >= 0
    return Kp, a, converged


def smo_gram_free(Xt, n, inv_sigma2, C):
    """Gram-free SMO (:func:`_bulk.smo_cached`) from a start guessed on a subsample.

    The kernel columns live in an LRU cache of ``BULK_CACHE_BYTES``; the gradients at the
    start, g0 = 2 K' a0, are evaluated from the keys and SMO maintains them.

    Returns
    -------
    a : ndarray of shape (n,)
        SMO's coefficients.
    a0, g0 : ndarray of shape (n,)
        The start and its gradients 2 K' a0 (from the keys; no rho').
    grad : ndarray of shape (n,)
        2 K' a as SMO maintained it.
    converged : bool
        False when SMO stopped at ``BULK_SMO_ITERATIONS`` iterations per key (or could not
        step).
    """
    a = B.guess_start(Xt, n, inv_sigma2, C, min(BULK_GUESS_KEYS, n // 8))
    a0 = a.copy()
    g0 = kernel_sums(Xt, n, inv_sigma2, a0)
    grad = g0.copy()
    cache = B.column_cache(n, BULK_CACHE_BYTES // (8 * n))
    converged = B.smo_cached(Xt, n, inv_sigma2, C, B.SMO_TOL,
                             BULK_SMO_ITERATIONS * n + 10_000, a, grad, *cache) >= 0
    return a, a0, g0, grad, converged


def kernel_sums(Xt, n, inv_sigma2, coef):
    """2 K' coef over the first n slots, from the keys, summing only coef's nonzeros.

    Returns
    -------
    ndarray of shape (n,)
    """
    idx = np.flatnonzero(coef)
    return 2.0 * B.kernel_sums(Xt, n, inv_sigma2, idx, coef[idx])


def margin_rows(Xt, n, inv_sigma2, order):
    """rows[p] = K'[order[p], :n] from the keys (no anchor), shape (len(order), n)."""
    rows = np.empty((len(order), n))
    for p, k in enumerate(order):
        W.kernel_column(Xt, n, k, -1, inv_sigma2, rows[p])
    return rows


def snap_partition(a, C, status):
    """Read the partition off SMO coefficients ``a`` (n,), in place (``a`` and ``status``).

    Coefficients within ``BULK_PARTITION_SNAP`` C of a bound are put at it and marked ERROR
    or RESERVE; the others are the margin candidates.

    Returns
    -------
    ndarray of int
        The margin candidates, most interior (largest min(a, C - a)) first.
    """
    n = len(a)
    snap = BULK_PARTITION_SNAP * C
    at_c, at_0 = a >= C - snap, a <= snap
    a[at_c], a[at_0] = C, 0.0
    status[:n] = np.where(at_c, W.ERROR, W.RESERVE)
    inner = np.flatnonzero(~at_c & ~at_0)
    return inner[np.argsort(-np.minimum(a[inner], C - a[inner]), kind="stable")]


def factor_margin(rows, order, S, spos, status, KSt, R, ist):
    """Margin set = ``order`` by one factorisation, when no key in it is dependent.

    ``rows[p]`` is K'[order[p], :n]. Returns len(order), or 0 (only R and KSt written, which
    the growth rewrites from its first key) when some key's Schur complement against the others,
    1 / |R_kk|, is below KAPPA_TOL - the caller then grows S key by key
    (:func:`grow_margin_from`). That complement is the smallest any order of growth would see
    for k, so passing it means the walk would have admitted every key. A factorised inverse is
    what a polish would compute (:func:`_factor.bordered_inverse`): no small-pivot flag is set
    (the caller calibrates the inverse probe on it).
    """
    m = len(order)
    order = np.ascontiguousarray(order, dtype=np.int64)
    # the Cholesky route factorises 2 K_SS in the margin rows' buffer (C-contiguous, at least
    # m n >= m^2 entries; the rows go in only after the inverse): no m x m array of its own
    A = KSt.reshape(-1)[: m * m].reshape(m, m)
    if m >= 1 and cholesky_bordered_inverse(A, B.margin_block_lower(rows, order, A), R):
        inverse = R[: m + 1, : m + 1]
    else:  # LU on M', as bordered_inverse falls back to
        try:
            R[: m + 1, : m + 1] = np.linalg.inv(B.bordered_margin_matrix(rows, order))
        except np.linalg.LinAlgError:
            return 0
        inverse = R[: m + 1, : m + 1]
    # 1 / |R_kk| < KAPPA_TOL, written without the division (an R_kk of exactly 0 occurs)
    if not np.isfinite(inverse).all() \
            or np.max(np.abs(np.diag(inverse)[1:])) > 1.0 / W.KAPPA_TOL:
        return 0
    KSt[:m, : rows.shape[1]] = rows
    S[:m] = order
    ist[W._M] = m
    spos[order] = np.arange(m)
    status[order] = W.MARGIN
    return m


def grow_margin_from(rows, order, a, C, S, spos, status, KSt, R, bk, vbuf, fs):
    """Grow S over ``order`` key by key (rank-one updates); dependent keys go to a bound.

    A key whose Schur complement against S is below KAPPA_TOL is put at its nearer bound
    (in ``a`` and ``status``), as the walk would keep it; the smallest pivot used is recorded
    in ``fs[_MIN_PIVOT]``.

    Returns
    -------
    int
        The size m of the margin set grown (the caller stores it in ``ist[_M]``).
    """
    n, m = rows.shape[1], 0
    for p, k in enumerate(order):
        if m == 0:
            W._grow(R, 0, bk, 0.0)
        else:
            kappa = W._schur(m, S, KSt, R, k, bk, vbuf)
            if kappa < W.KAPPA_TOL:  # dependent on S: the walk keeps it at a bound
                a[k] = C if a[k] > 0.5 * C else 0.0
                status[k] = W.ERROR if a[k] == C else W.RESERVE
                continue
            W._grow(R, m, bk, kappa)
            fs[W._MIN_PIVOT] = min(fs[W._MIN_PIVOT], kappa)
        KSt[m, :n] = rows[p]
        S[m] = k
        spos[k] = m
        status[k] = W.MARGIN
        m += 1
    return m
