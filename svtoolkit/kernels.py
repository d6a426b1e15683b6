"""RBF Gram and cross-kernel matrices (Numba, fp64).

The one kernel of svtoolkit is ``k(a, b) = exp(-||a - b||^2 / sigma^2)`` (no factor 2; see
DESIGN.md §1). So ``k(x, x) = 1`` for every key.
"""

from __future__ import annotations

import numpy as np

from ._jit import njit
from ._validation import as_keys, check_sigma

__all__ = ["rbf_kernel"]


def rbf_kernel(X, Y=None, *, sigma):
    """RBF kernel matrix ``K[i, j] = exp(-||X[i] - Y[j]||^2 / sigma^2)``.

    Parameters
    ----------
    X : array_like of shape (n, d)
        Keys.
    Y : array_like of shape (m, d), optional
        Second set of points; ``X`` itself when omitted (the Gram matrix, computed symmetric
        with an exact unit diagonal).
    sigma : float
        Kernel width, ``> 0``.

    Returns
    -------
    ndarray of shape (n, m), float64

    Notes
    -----
    Squared distances are accumulated coordinate by coordinate (no ``|x|^2 + |y|^2 - 2 x.y``
    expansion), so nearby points do not lose their distance to cancellation: two keys 1e-7
    apart get a kernel value that differs from 1, as it must for the near-duplicate logic of
    the exact solver.

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit import rbf_kernel
    >>> K = rbf_kernel(np.array([[0.0], [1.0]]), sigma=1.0)
    >>> bool(np.allclose(K, [[1.0, np.exp(-1.0)], [np.exp(-1.0), 1.0]]))
    True
    """
    sigma = check_sigma(sigma)
    X = as_keys(X, "X")
    inv_sigma2 = 1.0 / (sigma * sigma)
    if Y is None:
        return _gram(X, inv_sigma2)
    Y = as_keys(Y, "Y")
    if Y.shape[1] != X.shape[1]:
        raise ValueError(
            f"X and Y must have the same number of features; got {X.shape[1]} and {Y.shape[1]}"
        )
    return _cross(X, Y, inv_sigma2)


@njit
def _sqdist(X, i, Y, j):
    s = 0.0
    for k in range(X.shape[1]):
        diff = X[i, k] - Y[j, k]
        s += diff * diff
    return s


@njit
def _gram(X, inv_sigma2):
    n = X.shape[0]
    K = np.empty((n, n))
    for i in range(n):
        K[i, i] = 1.0
        for j in range(i + 1, n):
            v = np.exp(-_sqdist(X, i, X, j) * inv_sigma2)
            K[i, j] = v
            K[j, i] = v
    return K


@njit
def _cross(X, Y, inv_sigma2):
    n = X.shape[0]
    m = Y.shape[0]
    K = np.empty((n, m))
    for i in range(n):
        for j in range(m):
            K[i, j] = np.exp(-_sqdist(X, i, Y, j) * inv_sigma2)
    return K
