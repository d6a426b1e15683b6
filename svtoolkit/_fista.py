"""Fused CPU kernels of the batched FISTA partition finder (Numba, one Gram per thread).

The torch path (:func:`svtoolkit.torch.fista_svdd`) expresses FISTA as tensor operations over
the whole batch; on a CPU each iteration then costs a few dozen small tensor operations
(the projection's Newton passes alone are ~15 per pass), so it is bound by per-operation
overhead, not arithmetic. These kernels run the *same algorithm* - same start point,
same guaranteed Lipschitz bound, same exact capped-simplex projection (safeguarded Newton with
a closed-form finish, warm-started), same momentum - with each problem's Gram block compacted
to its masked keys: :func:`fista_batch` one problem per thread, :func:`fista_prefix_batch`
the causal prefixes of one Gram per thread, in lockstep. Results agree with the tensor path
to rounding (tested), and both kernels give a problem the same bits (tested): they depend only
on each problem's own inputs.

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

    The chunk-boundary problems of a causal layer share one Gram matrix per sequence and head,
    and prefix j's compacted block is the leading block of the longest prefix's. The J
    problems of one sequence-head therefore run in lockstep (one thread per sequence-head):
    each iteration's matrix-vector products read the compacted Gram once for all J of them
    (:func:`_prefix_matvecs`) instead of J times, which is what bounds the time on a CPU (the
    block outgrows the caches). Every problem's arithmetic is exactly that of
    :func:`fista_batch` on its own masked Gram (same operations in the same order), so the
    results are bit-for-bit those, independent of the other problems.
    """
    G = K.shape[0]
    unconverged = np.zeros(G, dtype=np.int64)
    for g in prange(G):
        unconverged[g] = _fista_prefixes(K[g], keep[g], ends, C, iters, power_iters, restart,
                                         out[g])
    return unconverged.sum()


@njit
def _fista_prefixes(K, keep, ends, C, iters, power_iters, restart, a_out):
    """The J prefix problems of one Gram K (P, P) in lockstep; writes a_out (J, P)."""
    dtype = K.dtype
    J = ends.shape[0]
    idx = np.flatnonzero(keep[: ends[J - 1]] if J > 0 else keep[:0])
    m = idx.shape[0]
    sizes = np.searchsorted(idx, ends)  # keys of prefix j: idx[:sizes[j]]
    a_out[:, :] = 0.0
    active = np.zeros(J, dtype=np.int64)  # sizes of the problems that iterate, 0 otherwise
    for j in range(J):
        if sizes[j] > 0 and sizes[j] * np.float64(C) < FEASIBLE_FROM:
            for r in range(sizes[j]):
                a_out[j, idx[r]] = C
        elif sizes[j] > 0:
            active[j] = sizes[j]
    if active.max() == 0:
        return 0
    Kc = np.empty((m, m), dtype=dtype)
    for r in range(m):
        for c in range(m):
            Kc[r, c] = K[idx[r], idx[c]]
    step = _prefix_steps(Kc, active, power_iters)
    c_box = dtype.type(C)
    a = np.zeros((J, m), dtype=dtype)
    for j in range(J):
        for r in range(active[j]):
            a[j, r] = dtype.type(1.0) / dtype.type(active[j])
    y = a.copy()
    ky = np.empty((J, m), dtype=dtype)
    z = np.empty(m, dtype=dtype)
    a_new = np.empty(m, dtype=dtype)
    t = np.ones(J)  # float64, as the momentum scalars of _fista_one
    lam = np.zeros(J)  # scalars of the projection in float64
    eps = np.float64(np.finfo(dtype).eps)  # rounding level of the result's dtype
    unconverged = 0
    for _ in range(iters):
        _prefix_matvecs(Kc, y, active, ky)
        for j in range(J):
            n = active[j]
            if n == 0:
                continue
            for r in range(n):
                z[r] = y[j, r] - step[j] * (dtype.type(2.0) * ky[j, r] - Kc[r, r])
            lam[j], ok = _projection_root(z[:n], np.float64(C), lam[j], eps)
            if not ok:
                unconverged += 1
            lam_d = dtype.type(lam[j])
            for r in range(n):
                v = z[r] - lam_d
                a_new[r] = dtype.type(0.0) if v < 0 else (c_box if v > c_box else v)
            t_new = dtype.type(0.5) * (dtype.type(1.0) + np.sqrt(dtype.type(1.0)
                                                                  + 4 * t[j] * t[j]))
            weight = (t[j] - dtype.type(1.0)) / t_new
            if restart:
                dot = dtype.type(0.0)
                for r in range(n):
                    dot += (y[j, r] - a_new[r]) * (a_new[r] - a[j, r])
                if dot > 0:
                    weight = dtype.type(0.0)
                    t_new = dtype.type(1.0)
            for r in range(n):
                y[j, r] = a_new[r] + weight * (a_new[r] - a[j, r])
                a[j, r] = a_new[r]
            t[j] = t_new
    for j in range(J):
        for r in range(active[j]):
            a_out[j, idx[r]] = a[j, r]
    return unconverged


@njit
def _prefix_steps(Kc, active, power_iters):
    """FISTA step ``0.5 / L`` of every active prefix (L: :func:`_lipschitz`'s bound on its
    leading block of Kc), the power iterations of all prefixes in lockstep."""
    dtype = Kc.dtype
    J = active.shape[0]
    m = Kc.shape[0]
    v = np.ones((J, m), dtype=dtype)
    w = np.empty((J, m), dtype=dtype)
    tiny = np.finfo(dtype).tiny
    for _ in range(power_iters):
        _prefix_matvecs(Kc, v, active, w)
        for j in range(J):
            if active[j] == 0:
                continue
            top = max(w[j, : active[j]].max(), tiny)
            for r in range(active[j]):
                v[j, r] = w[j, r] / top
    _prefix_matvecs(Kc, v, active, w)
    step = np.ones(J, dtype=dtype)
    for j in range(J):
        n = active[j]
        if n == 0:
            continue
        if _has_negative(Kc, n):
            bound = _gershgorin(Kc, n)
        else:
            bound = dtype.type(0.0)
            for r in range(n):
                if v[j, r] > 0:
                    bound = max(bound, w[j, r] / v[j, r])
        step[j] = dtype.type(0.5) / bound if bound > 0 else dtype.type(1.0)
    return step


@njit
def _prefix_matvecs(Kc, Y, active, out):
    """``out[j, :n_j] = Kc[:n_j, :n_j] Y[j, :n_j]`` for every j (n_j = active[j]), reading
    each row of Kc once for all j. Per j the sum is :func:`_sym_matvec`'s, in the same order
    (the same result to the last bit)."""
    J = active.shape[0]
    n_max = active.max()
    for j in range(J):
        for r in range(active[j]):
            out[j, r] = 0.0
    for c in range(0, n_max, 4):
        for j in range(J):
            n = active[j]
            if c + 4 <= n:
                _axpy4(Kc, c, Y[j], out[j], n)
            else:
                for cc in range(c, n):
                    _axpy1(Kc, cc, Y[j], out[j], n)


@njit
def _axpy4(K, c, v, out, n):
    """out[:n] += K[c:c+4, :n]^T v[c:c+4], the four terms added pairwise."""
    v0, v1, v2, v3 = v[c], v[c + 1], v[c + 2], v[c + 3]
    row0, row1, row2, row3 = K[c], K[c + 1], K[c + 2], K[c + 3]
    for r in range(n):
        out[r] += (v0 * row0[r] + v1 * row1[r]) + (v2 * row2[r] + v3 * row3[r])


@njit
def _axpy1(K, c, v, out, n):
    vc = v[c]
    row = K[c]
    for r in range(n):
        out[r] += vc * row[r]


@njit
def _has_negative(K, n):
    for r in range(n):
        for c in range(n):
            if K[r, c] < 0:
                return True
    return False


@njit
def _gershgorin(K, n):
    """Largest absolute row sum of the leading n x n block."""
    best = K.dtype.type(0.0)
    for r in range(n):
        s = K.dtype.type(0.0)
        for c in range(n):
            s += abs(K[r, c])
        best = max(best, s)
    return best


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
    if _has_negative(K, m):
        return _gershgorin(K, m)
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
    """out = K v for symmetric K, as a sum of rows (axpy: vectorises without fastmath), four
    rows at a time (:func:`_axpy4`) to a quarter of the loads and stores of ``out``."""
    m = K.shape[0]
    for r in range(m):
        out[r] = 0.0
    for c in range(0, m - 3, 4):
        _axpy4(K, c, v, out, m)
    for c in range(m - m % 4, m):
        _axpy1(K, c, v, out, m)


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
