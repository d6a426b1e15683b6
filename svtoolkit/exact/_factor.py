"""The inverse of the bordered margin matrix, factorised afresh (:func:`bordered_inverse`).

The walk keeps ``R = M'^{-1}`` of the bordered margin matrix ``M' = [[0, 1^T], [1, 2 K'_SS]]``
(``K' = K - 1``, the shifted RBF kernel of the margin keys) by rank-one updates; a bulk build's
landing, a polish and the restore after a refused operation factorise it afresh. ``M'`` is
symmetric indefinite, and LU (``np.linalg.inv``: getrf + getri, about ``2 m^3`` flops) ignores
both its symmetry and the definiteness hidden in it.

The shift is a border identity: for ``B(c) = [[0, 1^T], [1, A + c 1 1^T]]``,
``B(c)^{-1} = B(0)^{-1} - c e_0 e_0^T`` (the border row fixes ``1^T x``, so ``c 1 1^T x`` only
moves the first unknown by a known amount). With ``A = 2 K_SS`` - positive definite for distinct
keys - and ``c = -2``, ``B(-2) = M'``, and

    R = [[2 - 1/s, u^T/s], [u/s, A^{-1} - u u^T/s]],    u = A^{-1} 1,  s = 1^T u,

where ``A^{-1}`` comes from a Cholesky factorisation (LAPACK potrf + potri, about ``m^3``
flops; 0.15 s against 0.35 s for LU at m = 2,048 on a 2-core Intel Xeon, 0.7 s against 1.9 s
at 4,000). The subtraction ``A^{-1} - u u^T / s`` cancels where ``1`` leans on ``A``'s small
eigenvalues (wide kernels), so this route's error grows faster with cond(A) than LU's: it is
taken only when LAPACK's estimate of ``1 / cond_1(A)`` (pocon, ``O(m^2)``) is at least
:data:`CHOLESKY_MIN_RCOND`, and LU on ``M'`` is used otherwise - also when ``A`` is not
positive definite to working precision (near-duplicate keys). The warm-up anchor keeps ``A``
positive definite: its unshifted kernel row is ``e_anchor``. The walk's own refactorisation
inside a kernel (``_walk.refresh_inverse_if_drifted``, after a shrink on a small pivot) stays
LU: it is rare and small, and Numba offers no potri.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import blas, lapack

from .._jit import njit

__all__ = ["bordered_inverse", "cholesky_bordered_inverse", "CHOLESKY_MIN_RCOND"]

#: The Cholesky route of :func:`bordered_inverse` is taken when LAPACK's estimate of
#: ``1 / cond_1(2 K_SS)`` is at least this. Measured ``max |R M' - I|`` of both routes on
#: Gaussian keys (m = 50 ... 800, d = 2 ... 16, kernel widths 0.05 ... 3 x the median
#: distance): up to cond(A) = 1e6 the Cholesky route's is at most 1.4x LU's and mostly 2-30x
#: smaller; from 3e8 up it is 17-400x larger (cancellation). The all-margin sets that make a
#: factorisation expensive (narrow kernels) have cond(A) of a few units.
CHOLESKY_MIN_RCOND = 1e-6

_TILE = 64


def bordered_inverse(M, R):
    """``M'^{-1}`` of a bordered margin matrix, by Cholesky where well conditioned, written
    into the leading block of ``R``.

    Parameters
    ----------
    M : ndarray of shape (m + 1, m + 1)
        ``[[0, 1^T], [1, 2 K'_SS]]``, symmetric.
    R : ndarray of shape (>= m + 1, >= m + 1), C-contiguous
        Receives the inverse in ``R[:m + 1, :m + 1]`` (the solver's inverse buffer, whose
        capacity exceeds m: written in place, no second copy of an m x m matrix).

    Returns
    -------
    ndarray of shape (m + 1, m + 1)
        The block ``R[:m + 1, :m + 1]``, exactly symmetric on the Cholesky route.

    Raises
    ------
    numpy.linalg.LinAlgError
        ``M`` is singular (from LU, as ``np.linalg.inv`` raises it); ``R`` is then unchanged.
    """
    m = M.shape[0] - 1
    if m >= 1:
        A = M[1:, 1:] + 2.0  # 2 K_SS; entries >= 0, so its 1-norm is its largest column sum
        if cholesky_bordered_inverse(A, float(A.sum(axis=0).max()), R):
            return R[: m + 1, : m + 1]
    R[: m + 1, : m + 1] = np.linalg.inv(M)
    return R[: m + 1, : m + 1]


def cholesky_bordered_inverse(A, anorm, R):
    """The Cholesky route of :func:`bordered_inverse` from ``A = 2 K_SS`` itself.

    Parameters
    ----------
    A : ndarray of shape (m, m), C-contiguous, m >= 1
        Its lower triangle holds ``2 K_SS`` (the strict upper triangle is never read, so a
        caller may leave it unwritten); overwritten.
    anorm : float
        ``||A||_1`` of the symmetric matrix, for the condition estimate.
    R : ndarray of shape (>= m + 1, >= m + 1), C-contiguous
        Receives ``M'^{-1}`` in ``R[:m + 1, :m + 1]`` when the route is taken.

    Returns
    -------
    bool
        Whether ``R`` was written: False when ``A`` is not positive definite to working
        precision or LAPACK's estimate of ``1 / cond_1(A)`` is below
        :data:`CHOLESKY_MIN_RCOND` (the caller then inverts ``M'`` by LU).
    """
    m = A.shape[0]
    # the lower triangle of a C-order A is the upper one of its transpose, the Fortran array
    # LAPACK factorises in place (potrf, pocon, potri and symv read that triangle only)
    factor, info = lapack.dpotrf(A.T, lower=0, clean=0, overwrite_a=1)
    if info != 0 or lapack.dpocon(factor, anorm)[0] < CHOLESKY_MIN_RCOND:
        return False
    inverse, info = lapack.dpotri(factor, lower=0, overwrite_c=1)
    if info != 0:
        return False
    u = blas.dsymv(1.0, inverse, np.ones(m), lower=0)
    # the upper triangle of the Fortran inverse is the lower one of its transpose
    _bordered_from_lower(inverse.T, u, float(u.sum()), R)
    return True


@njit
def _bordered_from_lower(L, u, s, R):
    """Fill ``R[:m + 1, :m + 1]`` from the lower triangle of ``L = A^{-1}`` (m, m), ``u = L 1``
    and ``s = 1^T u``: ``R = [[2 - 1/s, w^T], [w, L - u w^T]]`` with ``w = u / s``, written
    symmetric to the bit (each entry computed once, stored at (i, j) and (j, i)), in tiles so
    that the transposed stores stay in cache."""
    m = u.shape[0]
    w = u / s
    R[0, 0] = 2.0 - 1.0 / s
    for i in range(m):
        R[0, i + 1] = w[i]
        R[i + 1, 0] = w[i]
    for i0 in range(0, m, _TILE):
        for j0 in range(0, i0 + 1, _TILE):
            for i in range(i0, min(i0 + _TILE, m)):
                for j in range(j0, min(j0 + _TILE, i + 1)):
                    v = L[i, j] - u[i] * w[j]
                    R[i + 1, j + 1] = v
                    R[j + 1, i + 1] = v
