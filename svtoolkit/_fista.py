"""Fused CPU kernel of the batched FISTA partition finder (Numba, one problem per thread).

The torch path (:func:`svtoolkit.torch.fista_svdd`) expresses FISTA as tensor operations over
the whole batch; on a CPU each iteration then costs a few dozen small tensor operations
(the projection's Newton passes alone are ~15 per pass), so it is bound by per-operation
overhead, not arithmetic. This kernel runs the *same algorithm* - same start point,
same guaranteed Lipschitz bound, same exact capped-simplex projection (safeguarded Newton with
a closed-form finish, warm-started), same momentum - one problem per thread, with the
problem's Gram block compacted to its masked keys. Results agree with the tensor path to
rounding (tested) and depend only on each problem's own inputs.

Arrays only: K (G, n, n) float32/float64, mask (G, n) bool; output (G, n) in K's dtype.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ._jit import njit
from ._rules import FEASIBLE_FROM, PROJECTION_MAX_ITER

__all__ = ["fista_batch", "fista_prefix_batch"]

# The settings of the batched path are defined, with their reasons, in svtoolkit._rules. The
# kernels read FEASIBLE_FROM and PROJECTION_MAX_ITER as compile-time constants.


@njit(parallel=True, cache=True)
def fista_batch(K, mask, C, iters, power_iters, restart, out):
    """FISTA on every problem of the batch in parallel; writes alpha into ``out`` (G, n).

    Infeasible problems (m C < FEASIBLE_FROM, m masked keys) get C on their keys; off-mask
    entries get 0.
    Returns the number of projections that hit the iteration safeguard (0 when all exact).
    """
    G = K.shape[0]
    unconverged = np.zeros(G, dtype=np.int64)
    for g in prange(G):
        unconverged[g] = _fista_one(K[g], mask[g], C, iters, power_iters, restart, out[g])
    return unconverged.sum()


@njit(parallel=True, cache=True)
def fista_prefix_batch(K, keep, ends, C, iters, power_iters, restart, out):
    """FISTA on every causal prefix: problem (g, j) uses the keys [0, ends[j]) of K[g] that
    ``keep`` marks. K (G, P, P), keep (G, P) bool, ends (J,) int; writes out (G, J, P).

    The chunk-boundary problems of a causal layer share one Gram matrix per sequence and head;
    this reads it in place instead of replicating it J times.
    """
    G = K.shape[0]
    J = ends.shape[0]
    unconverged = np.zeros(G * J, dtype=np.int64)
    for flat in prange(G * J):
        g = flat // J
        j = flat % J
        mask = keep[g].copy()
        mask[ends[j]:] = False
        unconverged[flat] = _fista_one(K[g], mask, C, iters, power_iters, restart, out[g, j])
    return unconverged.sum()


@njit
def _fista_one(K, mask, C, iters, power_iters, restart, a_out):
    dtype = K.dtype
    idx = np.flatnonzero(mask)
    m = idx.shape[0]
    for i in range(a_out.shape[0]):
        a_out[i] = 0.0
    if m == 0:
        return 0
    if m * np.float64(C) < FEASIBLE_FROM:
        for i in idx:
            a_out[i] = C
        return 0
    Kc = np.empty((m, m), dtype=dtype)
    for r in range(m):
        for c in range(m):
            Kc[r, c] = K[idx[r], idx[c]]
    bound = _lipschitz(Kc, power_iters)
    step = dtype.type(0.5) / bound if bound > 0 else dtype.type(1.0)
    c_box = dtype.type(C)
    a = np.full(m, dtype.type(1.0) / dtype.type(m))
    y = a.copy()
    z = np.empty(m, dtype=dtype)
    a_new = np.empty(m, dtype=dtype)
    t = dtype.type(1.0)
    lam = 0.0  # scalars of the projection in float64
    eps = np.float64(np.finfo(dtype).eps)  # rounding level of the result's dtype
    unconverged = 0
    ky = np.empty(m, dtype=dtype)
    for _ in range(iters):
        _sym_matvec(Kc, y, ky)
        for r in range(m):
            z[r] = y[r] - step * (dtype.type(2.0) * ky[r] - Kc[r, r])
        lam, ok = _projection_root(z, np.float64(C), lam, eps)
        if not ok:
            unconverged += 1
        lam_d = dtype.type(lam)
        for r in range(m):
            v = z[r] - lam_d
            a_new[r] = dtype.type(0.0) if v < 0 else (c_box if v > c_box else v)
        t_new = dtype.type(0.5) * (dtype.type(1.0) + np.sqrt(dtype.type(1.0) + 4 * t * t))
        weight = (t - dtype.type(1.0)) / t_new
        if restart:
            dot = dtype.type(0.0)
            for r in range(m):
                dot += (y[r] - a_new[r]) * (a_new[r] - a[r])
            if dot > 0:
                weight = dtype.type(0.0)
                t_new = dtype.type(1.0)
        for r in range(m):
            y[r] = a_new[r] + weight * (a_new[r] - a[r])
            a[r] = a_new[r]
        t = t_new
    for r in range(m):
        a_out[idx[r]] = a[r]
    return unconverged


@njit
def _lipschitz(K, power_iters):
    """Guaranteed upper bound on lambda_max(K) (Collatz-Wielandt; Gershgorin if K has a
    negative entry), as in :func:`svtoolkit.torch.lipschitz_bound`."""
    dtype = K.dtype
    m = K.shape[0]
    negative = False
    for r in range(m):
        for c in range(m):
            if K[r, c] < 0:
                negative = True
    if negative:
        best = dtype.type(0.0)
        for r in range(m):
            s = dtype.type(0.0)
            for c in range(m):
                s += abs(K[r, c])
            best = max(best, s)
        return best
    v = np.ones(m, dtype=dtype)
    w = np.empty(m, dtype=dtype)
    tiny = np.finfo(dtype).tiny
    for _ in range(power_iters):
        _sym_matvec(K, v, w)
        top = max(w.max(), tiny)
        for r in range(m):
            v[r] = w[r] / top
    _sym_matvec(K, v, w)
    bound = dtype.type(0.0)
    for r in range(m):
        if v[r] > 0:
            bound = max(bound, w[r] / v[r])
    return bound


@njit
def _sym_matvec(K, v, out):
    """out = K v for symmetric K, as a sum of rows (axpy: vectorises without fastmath)."""
    m = K.shape[0]
    for r in range(m):
        out[r] = 0.0
    for c in range(m):
        vc = v[c]
        row = K[c]
        for r in range(m):
            out[r] += vc * row[r]


@njit
def _piece(z, lam, C):
    s = 0.0
    n_free = 0
    n_capped = 0
    for v0 in z:
        v = v0 - lam
        if v >= C:
            s += C
            n_capped += 1
        elif v > 0:
            s += v
            n_free += 1
    return s, n_free, n_capped


@njit
def _rounding_tol(eps, lam, n_free):
    """Rounding level of ``s(lam) - 1``: ``4 eps (1 + |F| |lam|)`` (see the tensor path)."""
    return 4.0 * eps * (1.0 + n_free * abs(lam))


@njit
def _projection_root(z, C, lam, eps):
    """Root of s(lam) = sum_i clip(z_i - lam, 0, C) = 1 by safeguarded Newton.

    Same stopping rules as the tensor path: the Newton point lands on the piece it came from,
    |s - 1| <= 4 eps (1 + |F| |lam|) (``eps`` of the result's dtype), or the bracket cannot be
    split further; the first two end with a closed-form step on the final piece,
    ``lam += (s - 1) / |F|``. Returns (lam, converged).
    """
    lo = np.float64(z.min()) - C
    hi = np.float64(z.max())
    lam = min(max(lam, lo), hi)
    came_from_newton = False
    prev_free = -1
    prev_capped = -1
    for _ in range(PROJECTION_MAX_ITER):
        s, n_free, n_capped = _piece(z, lam, C)
        r = s - 1.0
        newton = lam + r / max(n_free, 1)
        same_piece = came_from_newton and n_free == prev_free and n_capped == prev_capped
        if same_piece or abs(r) <= _rounding_tol(eps, lam, n_free):
            return (newton if n_free > 0 else lam), True
        if r > 0:
            lo = lam
        else:
            hi = lam
        inside = n_free > 0 and lo < newton < hi
        mid = 0.5 * (lo + hi)
        if not inside and (mid <= lo or mid >= hi):
            return lam, True
        lam = newton if inside else mid
        came_from_newton = inside
        prev_free = n_free
        prev_capped = n_capped
    return lam, False
