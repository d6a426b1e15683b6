"""Fresh evaluations from the keys that check the exact solver's maintained state.

:meth:`IncrementalSVDD.kkt_residual`, :meth:`~IncrementalSVDD.consistency`,
:meth:`~IncrementalSVDD.audit` and :meth:`~IncrementalSVDD.audit_slice` compare what the walk
maintains with what the keys give: every gradient evaluated afresh (:func:`fresh_gradients`),
the KKT residual of the coefficients (:func:`kkt_residual_from`), rho against the rho a fresh
solve reports (:func:`rho_offset`), the bordered matrix the maintained inverse must invert
(:func:`bordered_matrix`) and the margin set's kernel rows (:func:`margin_rows_drift`). Plain
functions over the solver's arrays (layout: :mod:`svtoolkit.exact._walk`); the results are
reported as :class:`Consistency`, :class:`Audit` and :class:`AuditSlice`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._jit import njit
from .._validation import largest_violation
from . import _bulk as B
from . import _walk as W
from ._rest import at_lower_bound, at_upper_bound, sum_rounding

__all__ = ["Consistency", "Audit", "AuditSlice", "fresh_gradients", "kkt_residual_from",
           "sign_violation", "rho_offset", "bordered_matrix", "margin_rows_drift"]

#: Fresh gradients switch from the Numba loop to blocked matrix products above this much work
#: (n * |support| * d multiply-adds) for keys of at least BLAS_FRESH_MIN_DIM dimensions (below
#: that the vectorised Numba loop was measured faster).
BLAS_FRESH_WORK = 20_000_000
BLAS_FRESH_MIN_DIM = 128
#: The matrix-product path is taken only while every key, centred on the support's mean, has
#: ||x - c||^2 / sigma^2 at most this: the expansion |x|^2 + |y|^2 - 2 x.y then loses at most
#: ~eps * 2 * BLAS_FRESH_MAX_SPREAD ~ 5e-14 of a scaled squared distance. Keys spread wider (or
#: far from the origin without centring: a translated problem, or huge finite keys) take the
#: coordinate-wise loop, which is exact for any finite keys.
BLAS_FRESH_MAX_SPREAD = 100.0


@dataclass(frozen=True)
class Consistency:
    """What :meth:`IncrementalSVDD.consistency` measured (NaN anywhere reads as ``inf``).

    Attributes
    ----------
    kkt_residual : float
        As :meth:`IncrementalSVDD.kkt_residual`, from fresh gradients.
    grad_drift : float
        ``max |g maintained - g fresh|`` over every key (on the margin set both are ~0).
    inverse_residual : float
        ||R M - I||_max for the maintained bordered inverse R.
    margin_rows_drift : float
        ``max |K_S maintained - K_S fresh|`` over the margin set's kernel rows (0.0 when not
        recomputed).
    rho_offset : float
        ``|rho - the rho a fresh solve reports|`` when no margin coefficient is free (every one
        within a rounding residue of a bound, or none at all; rho is then optimal anywhere in
        an interval and a fresh solve reports its midpoint), from fresh gradients; 0.0 while
        a free margin key fixes rho. Every f is off a fresh solve's by this much. Nonzero
        after :meth:`IncrementalSVDD.evict_reserve` with an empty margin set (rho is kept
        there) or in a state whose rho a residue pinned (also a KKT term then).
    """

    kkt_residual: float
    grad_drift: float
    inverse_residual: float
    margin_rows_drift: float
    rho_offset: float = 0.0


@dataclass(frozen=True)
class Audit:
    """What :meth:`IncrementalSVDD.audit` found and did.

    Attributes
    ----------
    grad_drift, inverse_residual : float
        As in :class:`Consistency`, before any repair.
    kkt_residual : float
        After any repair.
    refactorized : bool
        Whether the drift exceeded the audit thresholds and the state was refactorised.
    rho_offset : float
        As in :class:`Consistency`, before any repair (above AUDIT_GRAD_TOL it is repaired).
    """

    grad_drift: float
    inverse_residual: float
    kkt_residual: float
    refactorized: bool
    rho_offset: float = 0.0


@dataclass(frozen=True)
class AuditSlice:
    """What :meth:`IncrementalSVDD.audit_slice` read: maintained quantities beside fresh ones.

    Attributes
    ----------
    maintained_gradients, fresh_gradients : ndarray of shape (k,)
        For the chosen keys, the gradients g = f(x) the walk maintains and the same evaluated
        from the keys (the decision function at each key).
    inverse_columns : ndarray of shape (m + 1, c)
        ``R M'[:, columns]`` for the maintained inverse R of the bordered matrix
        M' = [[0, 1^T], [1, 2 K'_SS]] of the shifted kernel K' = K - 1 (m =
        :attr:`IncrementalSVDD.margin_size`); column j is the identity's column ``columns[j]``
        up to the inverse's drift.
    rho_offset : float
        As :attr:`Consistency.rho_offset`, from the maintained gradients (O(n)).
    """

    maintained_gradients: np.ndarray
    fresh_gradients: np.ndarray
    inverse_columns: np.ndarray
    rho_offset: float

def fresh_gradients(Xt, alpha, n, anchor, d, inv_sigma2, rho):
    """g_i = 2 sum_j a_j K'_ij + rho' (= 2 sum_j a_j k(x_i, x_j) - 1 + rho) for every slot.

    Small problems use the coordinate-wise Numba loop (above ``_bulk.SUM_PARALLEL_PAIRS``
    key pairs split over threads, with the same bits). Large ones with wide keys
    (``n |support| d`` above ``BLAS_FRESH_WORK``, d >= ``BLAS_FRESH_MIN_DIM``) take the squared
    distances from one matrix product per block of rows, |x|^2 + |y|^2 - 2 x.y on keys
    centred on the support's mean (measured 2.3x faster at n = 10^4, d = 384). The
    expansion loses ~eps (|x - c|^2 + |y - c|^2) of a squared distance, so it is used only
    while every key has ||x - c||^2 / sigma^2 <= ``BLAS_FRESH_MAX_SPREAD`` (a loss below
    5e-14 in units of sigma^2); wider keys take the loop, which has no cancellation.

    Parameters
    ----------
    Xt : ndarray of shape (d, >= n)
        The keys as columns (the anchor's column, if any, is ignored).
    alpha : ndarray of shape (>= n,)
    n : int
        Number of live slots.
    anchor : int
        Slot of the virtual anchor, -1 if absent.
    d : int or None
        Key dimension.
    inv_sigma2, rho : float
        ``1 / sigma**2`` and rho' = rho + 1.

    Returns
    -------
    ndarray of shape (n,)
    """
    support = np.flatnonzero(alpha[:n] != 0.0)
    support = support[support != anchor]
    out = np.empty(n)
    if (d or 1) < BLAS_FRESH_MIN_DIM or n * len(support) * d < BLAS_FRESH_WORK \
            or not _blas_distances_accurate(Xt, n, support, inv_sigma2):
        if n * len(support) < B.SUM_PARALLEL_PAIRS:
            W.fresh_gradients(Xt, alpha, n, anchor, inv_sigma2, rho, out)
            return out
        # the same sums in the same order, over disjoint ranges of keys in threads
        out = B.kernel_sums(Xt, n, inv_sigma2, support, alpha[support])
        W.anchor_terms(alpha, n, anchor, out)
        return 2.0 * out + rho
    X = Xt[:, :n].T
    centre = X[support].mean(axis=0)
    S = X[support] - centre
    coef = alpha[support]
    sq_s = np.einsum("ij,ij->i", S, S)
    for start in range(0, n, 1024):
        block = X[start:start + 1024] - centre
        d2 = np.einsum("ij,ij->i", block, block)[:, None] + sq_s[None, :] - 2.0 * block @ S.T
        np.maximum(d2, 0.0, out=d2)
        out[start:start + 1024] = np.expm1(-d2 * inv_sigma2) @ coef
    W.anchor_terms(alpha, n, anchor, out)
    return 2.0 * out + rho


def _blas_distances_accurate(Xt, n, support, inv_sigma2):
    """True when every key is within BLAS_FRESH_MAX_SPREAD sigma^2 of the support's mean."""
    if len(support) == 0:
        return False
    X = Xt[:, :n]
    with np.errstate(over="ignore", invalid="ignore"):
        centre = X[:, support].mean(axis=1)
        spread = np.einsum("ij,ij->j", X - centre[:, None], X - centre[:, None])
        return bool(np.all(spread * inv_sigma2 <= BLAS_FRESH_MAX_SPREAD))


def kkt_residual_from(g, alpha, status, n, anchor, C, rho):
    """The KKT residual of the coefficients ``alpha[:n]`` given their gradients ``g`` (n,).

    The terms of :meth:`IncrementalSVDD.kkt_residual` (twice the equality's and the box's
    violations, |g| on margin keys, g > 0 on error keys, g < 0 on reserve keys), and rho's
    offset (:func:`rho_offset`) when every margin coefficient is a rounding residue of a
    bound. ``rho`` is rho'. One pass over the keys: a memory certifies every change with it.

    Returns
    -------
    float
        The largest term; ``inf`` when any term is NaN.
    """
    if n == 0:
        return 0.0
    # the sum pairwise (NumPy's), as a fresh reader of the coefficients would take it
    top = _kkt_terms(g, alpha, status, n, anchor, C, float(alpha[:n].sum()))
    pinned, offset = rho_offset(g, alpha, status, n, anchor, C, rho)
    if pinned:  # a margin set of residues only fixes nothing: rho must be a fresh solve's
        top = largest_violation([top, offset])
    return top


@njit
def _kkt_terms(g, alpha, status, n, anchor, C, total):
    """max of the KKT terms of :func:`kkt_residual_from` but rho's offset (inf on a NaN);
    ``total`` is sum(a)."""
    top = 0.0
    for i in range(n):
        a = alpha[i]
        ub = np.inf if i == anchor else C
        v = max(-a, a - ub, 0.0) * 2.0
        st = status[i]
        if st == W.MARGIN:
            v = max(v, abs(g[i]))
        elif st == W.ERROR:
            v = max(v, g[i])
        elif st == W.RESERVE:
            v = max(v, -g[i])
        if v != v or a != a or g[i] != g[i]:
            return np.inf
        top = max(top, v)
    v = 2.0 * abs(total - 1.0)
    if v != v:
        return np.inf
    return max(top, v)


@njit
def sign_violation(g, status, n):
    """The largest sign violation among the first n slots' gradients g: g > 0 on an error
    key, g < 0 on a reserve key (0 if none). On the maintained gradients it is what the
    rest state tolerated (``_rest.worst_violator`` relaxes every larger one unless the key is
    nearly dependent on S). One pass, no allocation."""
    top = 0.0
    for i in range(n):
        st = status[i]
        if st == W.ERROR:
            top = max(top, g[i])
        elif st == W.RESERVE:
            top = max(top, -g[i])
    return top


def rho_offset(g, alpha, status, n, anchor, C, rho):
    """``(pinned, |rho - the rho a fresh solve reports|)`` for gradients g (n,); ``rho`` is rho'.

    The margin coefficients are read as a fresh solve's rest state reads them (within a
    rounding residue of a bound they are at it: ``_rest.at_upper_bound`` /
    ``at_lower_bound``). While one is free, rho is fixed by f = 0 on it and the offset is
    0. Otherwise rho is optimal anywhere in [max_R (rho - g_i), min_E (rho - g_i)] (the
    residues in the set of their bound) and a fresh solve reports its midpoint, or its
    finite end (``_rest.recenter_rho``). ``pinned``: the state holds margin keys, all of
    them residues - rho then sits where the residue fixed it, not where it belongs.
    During warm-up (``anchor >= 0``) there is nothing to compare: ``(False, 0.0)``.
    """
    if n == 0 or anchor >= 0:
        return False, 0.0
    free, margin, lo, hi = _rho_interval(g, alpha, status, n, C, rho, sum_rounding(alpha, n))
    if free:
        return False, 0.0
    if lo == -np.inf and hi == np.inf:
        return margin, 0.0
    choice = hi if lo == -np.inf else lo if hi == np.inf else 0.5 * (lo + hi)
    return margin, largest_violation([abs(rho - choice)])


@njit
def _rho_interval(g, alpha, status, n, C, rho, sum_tol):
    """``(free, margin, lo, hi)``: whether a margin coefficient is free of both bounds,
    whether any margin key is held, and rho's optimal interval ``[lo, hi]`` from the keys at
    (or within a residue of) a bound (see :func:`rho_offset`)."""
    margin = False
    lo = -np.inf
    hi = np.inf
    for i in range(n):
        st = status[i]
        h = rho - g[i]
        if h != h:  # no interval: the offset reads as NaN, which the caller takes as inf
            return False, True, np.nan, np.nan
        if st == W.MARGIN:
            margin = True
            a = alpha[i]
            if at_upper_bound(a, C, sum_tol):
                hi = min(hi, h)
            elif at_lower_bound(a, C, sum_tol):
                lo = max(lo, h)
            else:
                return True, True, lo, hi
        elif st == W.RESERVE:
            lo = max(lo, h)
        elif st == W.ERROR:
            hi = min(hi, h)
    return False, margin, lo, hi


def bordered_matrix(S, KSt, m):
    """M' = [[0, 1^T], [1, 2 K'_SS]] of the margin list ``S[:m]``, shape (m + 1, m + 1)."""
    S = S[:m]
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * KSt[:m][:, S]
    return M


def margin_rows_drift(Xt, n, S, KSt, m, anchor, inv_sigma2):
    """``max |K_S maintained - K_S fresh|`` over the rows KSt[:m, :n] (NaN reads as inf)."""
    drift = 0.0
    column = np.empty(n)
    for p, slot in enumerate(S[:m]):
        W.kernel_column(Xt, n, slot, anchor, inv_sigma2, column)
        drift = max(drift, largest_violation(np.abs(KSt[p, :n] - column)))
    return drift
