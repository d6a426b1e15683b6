"""Batched training path in MLX: the twin of :mod:`svtoolkit.torch.batched`.

Same problems, same semantics, same thresholds (Forgetful Attention (arXiv:2607.12204), §3.4,
App. B, Algorithm 1, eq. 6); the option checks and the count rules are shared with torch
(:mod:`svtoolkit._gate_core`):

    minimise  a^T K a - diag(K)^T a   subject to  sum(a) = 1,  0 <= a_i <= C,          (eq. 2)

one per batch entry, estimated by FISTA with an exact capped-simplex projection, then a ridged
bordered solve over the estimated margin set. It carries **no certificate**.

MLX notes:

* The elementwise work of each FISTA iteration and each Newton pass of the projection is
  compiled with :func:`mlx.core.compile` (one graph per shape, compiled in milliseconds).
* float32 everywhere; float64 only on the CPU device (MLX has no float64 on GPU).
* ``mx.linalg.solve`` runs on the CPU stream only and has no VJP with respect to the matrix;
  :func:`ridged_svdd_solve` supplies one (``dM = -c_bar u^T``, ``c_bar = M^{-T} u_bar``), so
  ``mx.grad`` differentiates the ridged path end to end.
* A singular matrix makes ``mx.linalg.solve`` raise for the whole batch; the solve then falls
  back to one problem at a time to flag exactly the singular ones (never NaN).

Shapes: ``K`` is ``(G, n, n)``, ``mask`` is ``(G, n)`` bool (default all True).
"""

from __future__ import annotations

import math
import warnings

import mlx.core as mx

from .._gate_core import (
    bucket_width,
    check_box,
    check_iters,
    check_partition_tol,
    check_ridge,
    count_threshold,
)
from .._rules import (
    BATCHED_PARTITION_TOL,
    ERRORS_OVERFLOW_ABOVE,
    POWER_ITERS,
    PROJECTION_MAX_ITER,
    RIDGE,
)

__all__ = [
    "project_capped_simplex",
    "fista_svdd",
    "partition_masks",
    "ridged_svdd_solve",
    "lipschitz_bound",
]



# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def _check_float_array(x, name, ndim, shape_text):
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array; got {type(x).__name__}")
    if x.dtype not in (mx.float32, mx.float64):
        raise TypeError(f"{name} must be float32 or float64; got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}; got {tuple(x.shape)}")
    return x


def _check_mask(mask, shape, name="mask"):
    if mask is None:
        return mx.ones(shape, dtype=mx.bool_)
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        raise TypeError(f"{name} must be a bool mlx.core.array of shape {tuple(shape)}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(mask.shape)}")
    return mask


def _all_finite(x):
    return bool(mx.isfinite(mx.sum(x)).item()) or bool(mx.all(mx.isfinite(x)).item())


def _check_gram(K, mask):
    """Validate a (G, n, n) Gram batch and its mask; zero everything off the mask."""
    _check_float_array(K, "K", 3, "(G, n, n)")
    G, n, n2 = K.shape
    if n != n2:
        raise ValueError(f"K must have shape (G, n, n); got {tuple(K.shape)}")
    mask = _check_mask(mask, (G, n))
    if K.size == 0:  # nothing to check; MLX 0.32 can hang reducing an empty array
        return K, mask
    if not bool(mx.all(mask).item()):
        pair = mask[:, :, None] & mask[:, None, :]
        K = mx.where(pair, K, mx.zeros((), dtype=K.dtype))
    if not _all_finite(mx.stop_gradient(K)):
        raise ValueError("K contains NaN or inf on the masked entries")
    return K, mask


def _feasible(m, C):
    """``m C >= FEASIBLE_FROM`` for integer counts m, decided as torch does (float64).

    The count threshold is found in Python float64 arithmetic (MLX has no float64 on the GPU,
    :func:`svtoolkit._gate_core.count_threshold`); a threshold no int32 count reaches (tiny C)
    makes every row infeasible.
    """
    k = count_threshold(C)
    if k is None:
        return mx.zeros(m.shape, dtype=mx.bool_)
    return (m > 0) & (m >= k)


def _too_many_errors(count, C):
    """``count C > ERRORS_OVERFLOW_ABOVE`` (error keys alone exceed the unit sum), as torch."""
    k = count_threshold(C, level=ERRORS_OVERFLOW_ABOVE, strict=True)
    if k is None:
        return mx.zeros(count.shape, dtype=mx.bool_)
    return count >= k


# --------------------------------------------------------------------------------------------
# capped-simplex projection
# --------------------------------------------------------------------------------------------


def _off_mask_to_minus_inf(y, mask):
    return mx.where(mask, y, mx.array(-math.inf, dtype=y.dtype))


def _piece(y, lam, C):
    """s(lam) = sum_i clip(y_i - lam, 0, C) and the numbers of free and capped entries."""
    d = y - lam[:, None]
    s = mx.sum(mx.clip(d, 0.0, C), axis=-1)
    n_capped = mx.sum(d >= C, axis=-1)
    n_free = mx.sum(d > 0, axis=-1) - n_capped
    return s, n_free, n_capped


def _rounding_tol(lam, n_free):
    """Rounding level of ``s(lam) - 1``: ``4 eps (1 + |F| |lam|)``, as in the torch twin."""
    eps = mx.finfo(lam.dtype).eps
    return 4.0 * eps * (1.0 + n_free.astype(lam.dtype) * mx.abs(lam))


def _newton_pass_impl(y, C, lam, lo, hi, done, came_from_newton, prev_free, prev_capped):
    """One safeguarded Newton step of every row that has not stopped (see _projection_root)."""
    s, n_free, n_capped = _piece(y, lam, C)
    r = s - 1.0
    same_piece = (n_free == prev_free) & (n_capped == prev_capped)
    small = mx.abs(r) <= _rounding_tol(lam, n_free)
    converged = ~done & ((came_from_newton & same_piece) | small)
    done = done | converged
    lo = mx.where(~done & (r > 0), lam, lo)
    hi = mx.where(~done & (r < 0), lam, hi)
    newton = lam + r / mx.maximum(n_free, 1).astype(y.dtype)
    inside = (n_free > 0) & (newton > lo) & (newton < hi)
    mid = 0.5 * (lo + hi)
    done = done | (~inside & ((mid <= lo) | (mid >= hi)))
    step = mx.where(inside, newton, mid)
    finish = converged & (n_free > 0)  # closed-form step on the final piece
    lam = mx.where(finish, newton, mx.where(done, lam, step))
    return lam, lo, hi, done, inside, n_free, n_capped


_newton_pass = mx.compile(_newton_pass_impl)


def _projection_root(y, mask, C, lam, max_iter=PROJECTION_MAX_ITER):
    """Per-row root of s(lam) = 1 by safeguarded Newton with a closed-form finish.

    Identical to :func:`svtoolkit.torch.batched._projection_root`: a row stops when the Newton
    point lands on the piece it came from (exact root of that linear piece), when
    ``|s - 1| <= 4 eps (1 + |F| |lam|)``, or when its bracket cannot be split further; the
    first two end with a closed-form step on the final piece (``lam += (s - 1) / |F|``).
    Stopped rows are frozen, so each row depends only on itself.
    """
    m = mx.sum(mask, axis=-1)
    feasible = _feasible(m, C)
    inf = mx.array(math.inf, dtype=y.dtype)
    lo = mx.min(mx.where(mask, y, inf), axis=-1) - C
    hi = mx.max(mx.where(mask, y, -inf), axis=-1)
    lam = mx.where(feasible, mx.minimum(mx.maximum(lam, lo), hi), lo)
    done = ~feasible
    came_from_newton = mx.zeros_like(done)
    n_free = n_capped = mx.zeros_like(m)
    for _ in range(max_iter):
        lam, lo, hi, done, came_from_newton, n_free, n_capped = _newton_pass(
            y, C, lam, lo, hi, done, came_from_newton, n_free, n_capped
        )
        if bool(mx.all(done).item()):
            return lam, feasible
    warnings.warn(
        f"capped-simplex projection: {int(mx.sum(~done).item())} row(s) did not converge in "
        f"{max_iter} safeguarded Newton steps; their dual variable is approximate",
        RuntimeWarning,
        stacklevel=3,
    )
    return lam, feasible


def _apply_projection(y, lam, C, feasible, mask):
    a = mx.clip(y - lam[:, None], 0.0, C)
    return mx.where(feasible[:, None], a, mask.astype(y.dtype) * C)


def project_capped_simplex(y, C, *, mask=None):
    """Exact Euclidean projection of each row onto the capped simplex (MLX).

    Parameters
    ----------
    y : mlx.core.array of shape (G, n), float32 or float64
    C : float
        Box, ``> 0``.
    mask : mlx.core.array of shape (G, n), bool, optional
        Entries that belong to each row (default all); off-mask entries get 0.

    Returns
    -------
    mlx.core.array of shape (G, n)
        ``clip(y - lam, 0, C)`` with ``sum = 1`` over the mask; ``C`` on the mask of rows with
        ``m C < 1 - 1e-12`` (infeasible), 0 on rows with an empty mask. See
        :func:`svtoolkit.torch.project_capped_simplex` for the search.
    """
    _check_float_array(y, "y", 2, "(G, n)")
    C = check_box(C)
    mask = _check_mask(mask, y.shape)
    if y.size == 0:  # no rows or no entries (MLX 0.32 can hang reducing an empty array)
        return mx.zeros(y.shape, dtype=y.dtype)
    y = mx.where(mask, mx.stop_gradient(y), mx.zeros((), dtype=y.dtype))
    if not _all_finite(y):
        raise ValueError("y contains NaN or inf on the masked entries")
    count = mx.maximum(mx.sum(mask, axis=-1), 1).astype(y.dtype)
    lam0 = (mx.sum(y, axis=-1) - 1.0) / count
    y = _off_mask_to_minus_inf(y, mask)
    lam, feasible = _projection_root(y, mask, C, lam0)
    return _apply_projection(y, lam, C, feasible, mask)


# --------------------------------------------------------------------------------------------
# FISTA
# --------------------------------------------------------------------------------------------


def _matvec(K, y):
    """K y for symmetric K, as y^T K."""
    return (y[:, None, :] @ K)[:, 0, :]


def lipschitz_bound(K, mask=None, *, power_iters=POWER_ITERS):
    """Upper bound on ``lambda_max(K_g)`` per problem (Collatz-Wielandt after power iteration).

    Same construction as :func:`svtoolkit.torch.lipschitz_bound`: for entrywise non-negative K
    the bound ``max_i (K v)_i / v_i`` holds for every positive v, so it never under-estimates;
    rows with a negative entry use the Gershgorin bound.

    Returns
    -------
    mlx.core.array of shape (G,)
    """
    K, mask = _check_gram(K, mask)
    if K.size == 0:  # no problems or no keys: the bound of an empty problem is 0
        return mx.zeros((K.shape[0],), dtype=K.dtype)
    return _lipschitz(mx.stop_gradient(K), mask, power_iters)


def _lipschitz(K, mask, power_iters):
    dtype = K.dtype
    v = mask.astype(dtype)
    for _ in range(power_iters):
        w = _matvec(K, v)
        v = w / mx.maximum(mx.max(w, axis=-1, keepdims=True), mx.finfo(dtype).smallest_normal)
    w = _matvec(K, v)
    positive = mask & (v > 0)
    ratio = mx.where(positive, w / mx.where(positive, v, 1.0), 0.0)
    bound = mx.max(ratio, axis=-1)
    negative = mx.min(K, axis=(1, 2)) < 0
    gershgorin = mx.max(mx.sum(mx.abs(K), axis=-1), axis=-1)
    return mx.where(negative, gershgorin, bound).astype(dtype)


def _fista_front_impl(K, y, diag, step, off_mask):
    return y - step * (2.0 * _matvec(K, y) - diag) + off_mask


def _momentum_impl(a_new, a, y, t, restart):
    t_new = 0.5 * (1.0 + mx.sqrt(1.0 + 4.0 * t * t))
    weight = (t - 1.0) / t_new
    if restart:
        reset = mx.sum((y - a_new) * (a_new - a), axis=-1) > 0
        weight = mx.where(reset, mx.zeros_like(weight), weight)
        t_new = mx.where(reset, mx.ones_like(t_new), t_new)
    return a_new + weight[:, None] * (a_new - a), t_new


_fista_front = mx.compile(_fista_front_impl)
_momentum = mx.compile(_momentum_impl)


def fista_svdd(K, C, *, mask=None, iters=80, restart=False):
    """Approximate SVDD duals of a batch by FISTA (MLX twin of the torch function).

    Parameters
    ----------
    K : mlx.core.array of shape (G, n, n), float32 (float64 on the CPU device only)
        Symmetric PSD Gram matrices, padded to n.
    C : float
        Box of the dual, fixed.
    mask : mlx.core.array of shape (G, n), bool, optional
        Keys of each problem (default all). Off-mask entries are ignored and get 0.
    iters : int
        FISTA iterations (default 80).
    restart : bool, default False
        Per-problem gradient-based momentum restart (see the torch twin for when it helps).

    Returns
    -------
    mlx.core.array of shape (G, n)
        Feasible iterate (``C`` on the mask of problems in warm-up, ``m C < 1 - 1e-12``). Not
        differentiable. See :func:`svtoolkit.torch.fista_svdd` for the algorithm.
    """
    K, mask = _check_gram(K, mask)
    C = check_box(C)
    iters = check_iters(iters)
    if K.size == 0:  # no problems or no keys
        return mx.zeros(K.shape[:2], dtype=K.dtype)
    return _fista(mx.stop_gradient(K), mask, C, int(iters), bool(restart))


def _fista(K, mask, C, iters, restart):
    G, n, _ = K.shape
    dtype = K.dtype
    m = mx.sum(mask, axis=-1)
    feasible = _feasible(m, C)
    bound = _lipschitz(K, mask, POWER_ITERS)
    step = mx.where(bound > 0, 0.5 / mx.where(bound > 0, bound, 1.0), 1.0)[:, None]
    step = step.astype(dtype)
    diag = mx.diagonal(K, axis1=-2, axis2=-1)
    off_mask = _off_mask_to_minus_inf(mx.zeros_like(diag), mask)
    uniform = mask.astype(dtype) / mx.maximum(m, 1).astype(dtype)[:, None]
    a = mx.where(feasible[:, None], uniform, mask.astype(dtype) * C)
    y = a
    t = mx.ones((G,), dtype=dtype)
    lam = mx.zeros((G,), dtype=dtype)
    for _ in range(iters):
        z = _fista_front(K, y, diag, step, off_mask)
        lam, _ = _projection_root(z, mask, C, lam)
        a_new = _apply_projection(z, lam, C, feasible, mask)
        y, t = _momentum(a_new, a, y, t, restart)
        a = a_new
    mx.eval(a)
    return a


# --------------------------------------------------------------------------------------------
# partition and ridged bordered solve
# --------------------------------------------------------------------------------------------


def partition_masks(alpha, C, *, tol=BATCHED_PARTITION_TOL, mask=None):
    """Margin and error masks (thresholds relative to C, as in the torch twin)::

        error  E:  alpha >= (1 - tol) C
        margin S:  tol C < alpha < (1 - tol) C
        reserve R: alpha <= tol C

    For ``C >= 1 / tol`` the margin set is always empty (the coefficients sum to 1).

    Returns
    -------
    margin_mask, error_mask : mlx.core.array of shape (G, n), bool
    """
    _check_float_array(alpha, "alpha", 2, "(G, n)")
    C = check_box(C)
    tol = check_partition_tol(tol)
    mask = _check_mask(mask, alpha.shape)
    alpha = mx.stop_gradient(alpha)
    error = mask & (alpha >= (1.0 - tol) * C)
    margin = mask & (alpha > tol * C) & ~error
    return margin, error


def _check_partition(margin_mask, error_mask, mask):
    for name, sub in (("margin_mask", margin_mask), ("error_mask", error_mask)):
        _check_mask(sub, mask.shape, name)
        if bool(mx.any(sub & ~mask).item()):
            raise ValueError(f"{name} marks keys outside mask")
    if bool(mx.any(margin_mask & error_mask).item()):
        raise ValueError("margin_mask and error_mask overlap; a key is in one set only")


def _bucket_widths(n_margin):
    """Each problem's own padded margin size (:func:`svtoolkit._gate_core.bucket_width`)."""
    return [bucket_width(k) for k in n_margin.tolist()]


def _first_of(member, width):
    """Per row, the indices where ``member`` is True first (ascending), then the rest, cut to
    ``width`` (index 0 repeated where ``width`` exceeds the row); and ``slot`` (B, width), True
    on the member positions."""
    n = member.shape[-1]
    index = mx.arange(n)[None, :]
    order = mx.argsort(mx.where(member, index, index + n), axis=-1)[:, :width]
    if width > n:
        order = mx.concatenate([order, mx.zeros((order.shape[0], width - n),
                                                dtype=order.dtype)], axis=1)
    slot = mx.arange(width)[None, :] < mx.sum(member, axis=-1)[:, None]
    return order, slot


def _check_groups(groups, K):
    """The Gram of each problem (default: problem g on K[g]), as torch checks it."""
    if groups is None:
        return mx.arange(K.shape[0])
    if (not isinstance(groups, mx.array) or groups.ndim != 1
            or groups.dtype not in (mx.int32, mx.int64)):
        raise TypeError("groups must be a 1-d integer mlx array (one Gram index per problem)")
    if groups.size and (int(mx.min(groups).item()) < 0
                        or int(mx.max(groups).item()) >= K.shape[0]):
        raise ValueError(f"groups must index K's first axis, 0 .. {K.shape[0] - 1}")
    return groups.astype(mx.int64)


def _check_finite_on_masks(K, groups, mask):
    """Raise if a problem's Gram has NaN or inf on its masked entries."""
    K = mx.stop_gradient(K)
    if _all_finite(K):
        return
    bad = ~mx.isfinite(K)
    for i in range(groups.size):
        pair = mask[i][:, None] & mask[i][None, :]
        if bool(mx.any(bad[groups[i].item()] & pair).item()):
            raise ValueError("K contains NaN or inf on the masked entries")


class _Bucket:
    """The problems ``rows`` of one padded margin width: margin keys ``order`` (B, w) with
    ``slot``, error keys ``e_order`` (B, e) with ``e_slot``."""

    def __init__(self, rows, width, margin_mask, error_mask):
        self.rows = rows
        self.order, self.slot = _first_of(margin_mask[rows], width)
        n_errors = int(mx.max(mx.sum(error_mask[rows], axis=-1)).item())
        self.e_order, self.e_slot = _first_of(error_mask[rows], max(n_errors, 1))

    def flat_index(self, groups, n):
        """Flat indices into K of this bucket's K_SS (B, w, w) and K_SE (B, w, e) entries."""
        base = groups[self.rows][:, None, None] * (n * n) + self.order[:, :, None] * n
        return ((base + self.order[:, None, :]).reshape(-1),
                (base + self.e_order[:, None, :]).reshape(-1))


def _gather_blocks(K, groups, buckets):
    """K_SS and K_SE of every bucket, read from K in one gather (one scatter-add backward)."""
    if not buckets:
        return []
    n = K.shape[-1]
    parts = [index for bucket in buckets for index in bucket.flat_index(groups, n)]
    cuts, total = [], 0
    for p in parts[:-1]:
        total += p.size
        cuts.append(total)
    values = mx.split(mx.take(K.reshape(-1), mx.concatenate(parts)), cuts)
    blocks = []
    for bucket, K_SS, K_SE in zip(buckets, values[0::2], values[1::2]):
        B, w = bucket.order.shape
        blocks.append((K_SS.reshape(B, w, w), K_SE.reshape(B, w, bucket.e_order.shape[1])))
    return blocks


def _bordered_system(K_SS, K_SE, bucket, C, ridge):
    """M~ = [[0, 1^T], [1, 2 K_SS + ridge I]] and c = [1 - |E| C ; diag(K)_S - 2 C K_SE 1]
    (padding slots: identity rows, zero right-hand side; their entries discarded by where)."""
    B, width = bucket.order.shape
    dtype = K_SS.dtype
    zero = mx.zeros((), dtype=dtype)
    slot, slot_f = bucket.slot, bucket.slot.astype(dtype)
    K_SS = mx.where(slot[:, :, None] & slot[:, None, :], K_SS, zero)
    K_SE = mx.where(slot[:, :, None] & bucket.e_slot[:, None, :], K_SE, zero)
    eye = mx.eye(width, dtype=dtype)
    block = 2.0 * K_SS + eye * ((1.0 - slot_f) + ridge * slot_f)[:, None, :]
    top = mx.concatenate([mx.zeros((B, 1, 1), dtype=dtype), slot_f[:, None, :]], axis=2)
    M = mx.concatenate([top, mx.concatenate([slot_f[:, :, None], block], axis=2)], axis=1)
    diag_S = mx.diagonal(K_SS, axis1=1, axis2=2)
    c_top = 1.0 - C * mx.sum(bucket.e_slot.astype(dtype), axis=-1, keepdims=True)
    # the error sums in index order (as torch: a plain sum may round with the padded length)
    c = mx.concatenate([c_top, diag_S - 2.0 * C * mx.cumsum(K_SE, axis=-1)[..., -1]], axis=1)
    return M, c


@mx.custom_function
def _solve(M, c):
    """u = M^{-1} c for (G, p, p) and (G, p), on the CPU stream."""
    return mx.linalg.solve(M, c[:, :, None], stream=mx.cpu)[:, :, 0]


@_solve.vjp
def _solve_vjp(primals, cotangent, output):
    M, _ = primals
    c_bar = mx.linalg.solve(mx.swapaxes(M, -1, -2), cotangent[:, :, None], stream=mx.cpu)
    c_bar = c_bar[:, :, 0]
    return -c_bar[:, :, None] * output[:, None, :], c_bar


def _solve_rows(M, c):
    """Solve all rows at once; if MLX raises (a singular row), find the failing rows one by one.

    Returns ``(u, None)`` on success, ``(None, failed_rows)`` otherwise.
    """
    try:
        u = _solve(M, c)
        mx.eval(u)
        return u, None
    except RuntimeError:
        pass
    failed = []
    for g in range(M.shape[0]):
        try:
            mx.eval(_solve(M[g : g + 1], c[g : g + 1]))
        except RuntimeError:
            failed.append(g)
    return None, failed


def _solve_where(M, c, valid):
    """Solve M u = c on valid rows; other rows get the identity system (u = 0)."""
    eye = mx.broadcast_to(mx.eye(M.shape[-1], dtype=M.dtype), M.shape)
    M = mx.where(valid[:, None, None], M, eye)
    c = mx.where(valid[:, None], c, mx.zeros_like(c))
    u, failed = _solve_rows(M, c)
    if u is None:
        failed = set(failed)
        return None, mx.array([g not in failed for g in range(M.shape[0])])
    return u, mx.all(mx.isfinite(mx.stop_gradient(u)), axis=-1)


def ridged_svdd_solve(K, C, margin_mask, error_mask, *, ridge=RIDGE, mask=None, groups=None):
    """Ridged bordered KKT solve over given partitions, differentiable by ``mx.grad`` (eq. 6).

    Same contract as :func:`svtoolkit.torch.ridged_svdd_solve`::

        [[0, 1^T], [1, 2 K_SS + ridge I]] [rho; alpha_S] = [1 - |E| C ; diag(K)_S - 2 C K_SE 1]

    ``groups`` (G',) int, optional: problem i is posed on ``K[groups[i]]`` (default: problem g
    on K[g]); the masks are then (G', n).

    Returns
    -------
    alpha : mlx.core.array of shape (G', n)
        ``alpha_S`` from the solve, ``alpha_E = C``, 0 elsewhere and on invalid problems.
    rho : mlx.core.array of shape (G',)
        Multiplier of ``sum(alpha) = 1`` (``g_i = 2 (K alpha)_i - K_ii + rho``); 0 if invalid.
    valid : mlx.core.array of shape (G',), bool
        False for warm-up (``m C < 1 - 1e-12``), empty margin set, ``|E| C > 1 + 1e-12``, or
        a singular / non-finite system. Invalid rows are solved as identity systems (no NaN
        anywhere). No problems (G' = 0) or no keys (n = 0): empty or all-invalid outputs.
    """
    _check_float_array(K, "K", 3, "(G, n, n)")
    C = check_box(C)
    ridge = check_ridge(ridge)
    G, n, n2 = K.shape
    if n != n2:
        raise ValueError(f"K must have shape (G, n, n); got {tuple(K.shape)}")
    groups = _check_groups(groups, K)
    mask = _check_mask(mask, (groups.size, n))
    if K.size == 0 or groups.size == 0:
        return _empty_solution(K, margin_mask, error_mask, mask)
    _check_finite_on_masks(K, groups, mask)
    _check_partition(margin_mask, error_mask, mask)
    n_margin = mx.sum(margin_mask, axis=-1)
    too_many_errors = _too_many_errors(mx.sum(error_mask, axis=-1), C)
    valid = _feasible(mx.sum(mask, axis=-1), C) & (n_margin > 0) & ~too_many_errors
    # problems with an empty margin set are invalid: they keep alpha = 0, rho = 0
    widths = [w if k > 0 else 0 for w, k in zip(_bucket_widths(n_margin), n_margin.tolist())]
    buckets = [_Bucket(mx.array([g for g, wg in enumerate(widths) if wg == w]), w, margin_mask,
                       error_mask) for w in sorted(set(widths) - {0})]
    empty = [g for g, w in enumerate(widths) if w == 0]
    rows_all = [mx.array(empty, dtype=mx.int64)] if empty else []
    alphas = [mx.zeros((len(empty), n), dtype=K.dtype)] if empty else []
    rhos = [mx.zeros((len(empty),), dtype=K.dtype)] if empty else []
    valids = [mx.zeros((len(empty),), dtype=mx.bool_)] if empty else []
    for bucket, (K_SS, K_SE) in zip(buckets, _gather_blocks(K, groups, buckets)):
        M, c = _bordered_system(K_SS, K_SE, bucket, C, float(ridge))
        alpha_b, rho_b, valid_b = _solve_bucket(M, c, bucket, error_mask[bucket.rows],
                                                valid[bucket.rows], C)
        rows_all.append(bucket.rows.astype(mx.int64))
        alphas.append(alpha_b)
        rhos.append(rho_b)
        valids.append(valid_b)
    back = mx.argsort(mx.concatenate(rows_all))  # undo the grouping
    alpha = mx.concatenate(alphas, axis=0)[back]
    rho = mx.concatenate(rhos, axis=0)[back]
    return alpha, rho, mx.concatenate(valids, axis=0)[back]


def _empty_solution(K, margin_mask, error_mask, mask):
    """No problems or no keys: check the partition's shapes, return empty/zero outputs.

    Nothing is reduced (MLX 0.32 can hang reducing an empty array); every problem is invalid.
    """
    for name, sub in (("margin_mask", margin_mask), ("error_mask", error_mask)):
        _check_mask(sub, mask.shape, name)
    G, n = mask.shape
    return (mx.zeros((G, n), dtype=K.dtype), mx.zeros((G,), dtype=K.dtype),
            mx.zeros((G,), dtype=mx.bool_))


def _solve_bucket(M, c, bucket, error_mask, valid, C):
    """Solve one bucket's systems; returns alpha, rho, valid."""
    u, solved = _solve_where(M, c, valid)
    if u is None or not bool(mx.all(solved | ~valid).item()):
        valid = valid & solved
        u, _ = _solve_where(M, c, valid)
    return _scatter_solution(u, bucket, error_mask, valid, C)


def _scatter_solution(u, bucket, error_mask, valid, C):
    dtype = u.dtype
    keep = valid[:, None]
    u = mx.where(keep, u, mx.zeros((), dtype=dtype))
    coeff_S = mx.where(bucket.slot, u[:, 1:], mx.zeros((), dtype=dtype))
    # padding slots write their zeros to a spare column n: a put has no defined winner when two
    # slots share an index (the padding beyond n repeats index 0), an add in torch does not care
    B, n = error_mask.shape
    target = mx.where(bucket.slot, bucket.order, n)
    alpha = mx.put_along_axis(mx.zeros((B, n + 1), dtype=dtype), target, coeff_S,
                              axis=-1)[:, :n]
    alpha = alpha + (error_mask & keep).astype(dtype) * C
    return alpha, u[:, 0], valid
