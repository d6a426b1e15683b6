"""Batched training path in PyTorch: FISTA partition finder and ridged bordered solve.

This is the *approximate* path of docs/design.md (Forgetful Attention (arXiv:2607.12204), §3.4,
App. B, Algorithm 1). It solves many SVDD duals at once,

    minimise  a^T K a - diag(K)^T a   subject to  sum(a) = 1,  0 <= a_i <= C,          (eq. 2)

one per batch entry ``g``, estimates each problem's partition (margin S, error E, reserve R) with
accelerated projected gradient (FISTA), and then solves the 1e-3-ridged bordered KKT system over
the estimated margin set with :func:`torch.linalg.solve`, which autograd differentiates (eq. 6).
It carries **no certificate**: anything that claims exactness comes from the exact fp64 solver.

Every problem's result depends only on its own inputs: step sizes, momentum restarts, projection
searches and stopping, and validity flags are all per problem, so a causal layer can pack many
prefixes into one batch. FISTA results are bit-for-bit independent of the other problems (CPU,
tested). The ridged solve pads each problem's system to the next power of two of its own margin
size with decoupled identity rows; its results can change at rounding level when other problems
change (batched LAPACK is not bitwise independent of memory layout).

Shapes: ``K`` is ``(G, n, n)`` (G problems padded to n keys), ``mask`` is ``(G, n)`` bool with
True on the keys that belong to each problem (default: all). Code is device-agnostic (CPU, CUDA)
and runs in float32 or float64 (the dtype of ``K``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .._gate_core import bucket_width, check_box, check_iters, check_partition_tol, check_ridge
from .._rules import (
    BATCHED_PARTITION_TOL,
    ERRORS_OVERFLOW_ABOVE,
    FEASIBLE_FROM,
    POWER_ITERS,
    PROJECTION_MAX_ITER,
    RIDGE,
)
from .._validation import check_option


#: A ridged solution is accepted when max|M u - c| <= RESIDUAL_TOL * p * eps *
#: (max|M| max|u| + max|c|), p = w + 1 the size of the bordered system (see _accurate).
RESIDUAL_TOL = 64.0
#: Bordered systems larger than this are not given to torch's batched CPU LU when torch runs
#: more than one thread (the torch 2.13 thread bug; see :func:`_solve_where`). The bug was
#: reported for systems larger than ~150; smaller batches keep the batched LU.
LU_BUG_MIN_SIZE = 128

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


def _check_float_tensor(x, name, ndim, shape_text):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name} must be float32 or float64; got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}; got {tuple(x.shape)}")
    return x


def _check_mask(mask, shape, device, name="mask"):
    """Return a bool (G, n) mask (all True when ``mask`` is None)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool torch.Tensor of shape {tuple(shape)}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the data is on {device}")
    return mask


def _all_finite(x):
    """One reduction in the common case; the elementwise test only when the sum is not finite."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _check_gram(K, mask):
    """Validate a (G, n, n) Gram batch and its mask; zero everything off the mask."""
    _check_float_tensor(K, "K", 3, "(G, n, n)")
    G, n, n2 = K.shape
    if n != n2:
        raise ValueError(f"K must have shape (G, n, n); got {tuple(K.shape)}")
    mask = _check_mask(mask, (G, n), K.device)
    if not bool(mask.all()):
        pair = mask[:, :, None] & mask[:, None, :]
        K = torch.where(pair, K, torch.zeros((), dtype=K.dtype, device=K.device))
    if not _all_finite(K.detach()):
        raise ValueError("K contains NaN or inf on the masked entries")
    return K, mask


# --------------------------------------------------------------------------------------------
# capped-simplex projection
# --------------------------------------------------------------------------------------------


def _off_mask_to_minus_inf(y, mask):
    """y with -inf off the mask: such entries are then zero (neither free nor capped) at any lam."""
    return torch.where(mask, y, torch.tensor(-math.inf, dtype=y.dtype, device=y.device))


def _piece(y, lam, C):
    """s(lam) = sum_i clip(y_i - lam, 0, C) and the numbers of free and capped entries."""
    d = y - lam[:, None]
    s = d.clamp(0.0, C).sum(-1)
    n_capped = (d >= C).sum(-1)
    n_free = (d > 0).sum(-1) - n_capped  # C > 0, so every capped entry is also positive
    return s, n_free, n_capped


def _bracket(y, mask, C):
    """lo with s(lo) = m C (>= 1 on feasible rows) and hi with s(hi) = 0 (masked min/max of y)."""
    inf = torch.tensor(math.inf, dtype=y.dtype, device=y.device)
    lo = torch.where(mask, y, inf).amin(-1) - C
    hi = torch.where(mask, y, -inf).amax(-1)
    return lo, hi


def _rounding_tol(lam, n_free):
    """The rounding level of ``s(lam) - 1``: the sum's own rounding plus ``|F|`` ulps of lam.

    At the root the clipped terms are >= 0 and sum to 1, so the sum rounds at ``eps``; what
    limits ``|s - 1|`` beyond that is the resolution of lam, each free term moving by
    ``ulp(lam) <= eps |lam|``. It does not grow with ``m C``.
    """
    eps = torch.finfo(lam.dtype).eps
    return 4.0 * eps * (1.0 + n_free.to(lam.dtype) * lam.abs())


def _newton_pass(y, C, lam, lo, hi, done, came_from_newton, prev_free, prev_capped):
    """One safeguarded Newton step of every row that has not stopped (see _projection_root)."""
    s, n_free, n_capped = _piece(y, lam, C)
    r = s - 1.0
    same_piece = (n_free == prev_free) & (n_capped == prev_capped)
    small = r.abs() <= _rounding_tol(lam, n_free)
    converged = ~done & ((came_from_newton & same_piece) | small)
    done = done | converged
    lo = torch.where(~done & (r > 0), lam, lo)
    hi = torch.where(~done & (r < 0), lam, hi)
    newton = lam + r / n_free.clamp(min=1).to(y.dtype)
    inside = (n_free > 0) & (newton > lo) & (newton < hi)
    mid = 0.5 * (lo + hi)
    done = done | (~inside & ((mid <= lo) | (mid >= hi)))
    step = torch.where(inside, newton, mid)
    finish = converged & (n_free > 0)  # closed-form step on the final piece
    lam = torch.where(finish, newton, torch.where(done, lam, step))
    return lam, lo, hi, done, inside, n_free, n_capped


def _projection_root(y, mask, C, lam, max_iter=PROJECTION_MAX_ITER):
    """Per-row root lam of s(lam) = sum_i clip(y_i - lam, 0, C) = 1.

    ``y`` has -inf off the mask. s is continuous, piecewise linear and non-increasing, with
    slope ``-|F|`` on the piece whose free set is F. Safeguarded Newton: every evaluated point
    shrinks a bracket ``lo < root < hi``; the Newton point ``lam + (s - 1) / |F|`` (the
    closed-form root of the current piece) is taken when it lies inside the bracket, the
    bracket midpoint otherwise. A row stops when

    * the Newton point lands on the piece it came from (same numbers of free and capped
      entries; lam only moved one way, so no entry changed state): it is that piece's exact
      root;
    * ``|s - 1|`` is at rounding level (:func:`_rounding_tol`, which depends on lam and the
      number of free entries, not on ``m C``); or
    * the bracket cannot be split further in floating point.

    A row that stops by one of the first two rules takes a last closed-form step on its final
    piece, ``lam += (s - 1) / |F|`` (when ``|F| > 0``), so the result is feasible to rounding.
    Rows stop independently and a stopped row is frozen, so each row's result depends only on
    that row. Returns ``(lam, feasible)``; infeasible rows are not searched.
    """
    m = mask.sum(-1)
    feasible = _feasible(m, C)
    lo, hi = _bracket(y, mask, C)
    lam = torch.where(feasible, torch.minimum(torch.maximum(lam, lo), hi), lo)
    done = ~feasible
    came_from_newton = torch.zeros_like(done)
    n_free = n_capped = torch.zeros_like(m)
    for _ in range(max_iter):
        lam, lo, hi, done, came_from_newton, n_free, n_capped = _newton_pass(
            y, C, lam, lo, hi, done, came_from_newton, n_free, n_capped
        )
        if bool(done.all()):
            return lam, feasible
    warnings.warn(
        f"capped-simplex projection: {int((~done).sum())} row(s) did not converge in "
        f"{max_iter} safeguarded Newton steps; their dual variable is approximate",
        RuntimeWarning,
        stacklevel=3,
    )
    return lam, feasible


def _feasible(m, C):
    """``m C >= FEASIBLE_FROM`` for integer counts m, evaluated in float64.

    The exact solver's rule (:func:`svtoolkit._rules.feasible`, on tensors), so ``C = 1 / n``
    with ``n (1 / n)`` rounded just below 1 is feasible on both paths.
    """
    return (m > 0) & (m.to(torch.float64) * C >= FEASIBLE_FROM)


def _too_many_errors(count, C):
    """``count C > ERRORS_OVERFLOW_ABOVE`` (error keys alone exceed the unit sum), in float64."""
    return count.to(torch.float64) * C > ERRORS_OVERFLOW_ABOVE


def _apply_projection(y, lam, C, feasible, mask):
    """clip(y - lam, 0, C) on feasible rows, C on the mask of infeasible rows, 0 off the mask."""
    a = (y - lam[:, None]).clamp(0.0, C)
    return torch.where(feasible[:, None], a, mask.to(y.dtype) * C)


def project_capped_simplex(y, C, *, mask=None):
    """Exact Euclidean projection of each row onto the capped simplex.

    Parameters
    ----------
    y : Tensor of shape (G, n), float32 or float64
        Points to project, one per row.
    C : float
        Box, ``> 0``.
    mask : Tensor of shape (G, n), bool, optional
        Entries that belong to each row's problem (default all). Entries off the mask get 0
        and do not influence the rest.

    Returns
    -------
    Tensor of shape (G, n)
        ``argmin_a ||a - y_g||`` over ``{a : sum_{i in mask} a_i = 1, 0 <= a_i <= C,
        a_i = 0 off the mask}``. Rows with ``m C < 1 - 1e-12`` (m = number of masked entries,
        the exact solver's feasibility rule) have an empty feasible set; they get ``C`` on
        every masked entry (the box point whose sum is closest to 1). Rows with an empty mask
        are all zero. ``|sum(a) - 1|`` is at rounding level, ``~eps (1 + |F| |lam|)`` (F the
        free entries), whatever C.

    Notes
    -----
    The projection is ``a_i = clip(y_i - lam, 0, C)`` with the scalar ``lam`` solving
    ``sum_i clip(y_i - lam, 0, C) = 1``; ``lam`` is found by a safeguarded Newton search with a
    closed-form finish on the final linear piece (exact up to rounding, typically 3-8 steps),
    not by a fixed number of bisection steps. Not differentiable (used inside FISTA only).

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import project_capped_simplex
    >>> y = torch.tensor([[0.75, 0.25, 0.0]], dtype=torch.float64)
    >>> project_capped_simplex(y, 0.5).tolist()
    [[0.5, 0.375, 0.125]]
    """
    _check_float_tensor(y, "y", 2, "(G, n)")
    C = check_box(C)
    mask = _check_mask(mask, y.shape, y.device)
    if y.numel() == 0:  # no rows or no entries
        return torch.zeros_like(y)
    y = torch.where(mask, y.detach(), torch.zeros((), dtype=y.dtype, device=y.device))
    if not bool(torch.isfinite(y).all()):
        raise ValueError("y contains NaN or inf on the masked entries")
    lam0 = (y.sum(-1) - 1.0) / mask.sum(-1).clamp(min=1).to(y.dtype)
    y = _off_mask_to_minus_inf(y, mask)
    lam, feasible = _projection_root(y, mask, C, lam0)
    return _apply_projection(y, lam, C, feasible, mask)


# --------------------------------------------------------------------------------------------
# FISTA
# --------------------------------------------------------------------------------------------


def lipschitz_bound(K, mask=None, *, power_iters=POWER_ITERS):
    """Upper bound on ``lambda_max(K_g)`` for every problem, by batched power iteration.

    Parameters
    ----------
    K : Tensor of shape (G, n, n)
        Symmetric Gram matrices (zero off the mask).
    mask : Tensor of shape (G, n), bool, optional
    power_iters : int
        Power iterations before the bound is read off (default :data:`POWER_ITERS`).

    Returns
    -------
    Tensor of shape (G,)
        A bound ``>= lambda_max``; the FISTA step of problem g is ``1 / (2 * bound_g)``.

    Notes
    -----
    For an entrywise non-negative matrix (every RBF Gram) and any positive vector v the
    Collatz-Wielandt inequality gives ``lambda_max <= max_i (K v)_i / v_i``; the power
    iteration started from the all-ones vector only tightens this bound, so it can never
    under-estimate (a plain Rayleigh quotient can, which makes FISTA diverge). Rows with a
    negative entry fall back to the Gershgorin bound ``max_i sum_j |K_ij|``.
    """
    K, mask = _check_gram(K, mask)
    if K.numel() == 0:  # no problems or no keys: the bound of an empty problem is 0
        return K.new_zeros(K.shape[0])
    return _lipschitz(K.detach(), mask, power_iters)


def _lipschitz(K, mask, power_iters):
    dtype = K.dtype
    zero = torch.zeros((), dtype=dtype, device=K.device)
    v = mask.to(dtype)
    for _ in range(power_iters):
        w = _matvec(K, v)
        v = w / w.amax(-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
    w = _matvec(K, v)
    positive = mask & (v > 0)
    ratio = torch.where(positive, w / torch.where(positive, v, torch.ones_like(v)), zero)
    bound = ratio.amax(-1)
    negative = torch.amin(K, dim=(1, 2)) < 0
    if bool(negative.any()):
        rows = negative.nonzero()[:, 0]
        bound = bound.index_put((rows,), K[rows].abs().sum(-1).amax(-1))
    return bound


def fista_svdd(K, C, *, mask=None, iters=80, restart=False, backend="auto"):
    """Approximate SVDD duals of a batch by FISTA (paper Algorithm 1, lines 1-9).

    Parameters
    ----------
    K : Tensor of shape (G, n, n), float32 or float64
        Symmetric positive semi-definite Gram matrices (RBF: ``K_ij = exp(-||x_i-x_j||^2 /
        sigma^2)``), one problem per batch entry, padded to n.
    C : float
        Box of the dual, fixed (``C = 1 / (nu n0)`` when derived from nu).
    mask : Tensor of shape (G, n), bool, optional
        Keys that belong to each problem (default all). Off-mask entries of K are ignored
        (even NaN) and get ``alpha = 0`` exactly.
    iters : int
        FISTA iterations (default 80, as in the paper's layer). 0 returns the start point.
    restart : bool, default False
        Per-problem gradient-based momentum restart (O'Donoghue & Candes 2015): when
        ``(y - a_new) . (a_new - a) > 0`` the momentum of that problem is reset. It changes no
        fixed point. Measured (docs/batched.md): it reaches high accuracy sooner on Gaussian
        keys (relative objective gap 7e-11 vs 2e-7 at 160 iterations, n = 64) but is *worse*
        at 80-160 iterations on clusters of near-duplicates and on n = 256 partitions, so the
        default is the paper's plain FISTA.
    backend : {"auto", "numba", "torch"}
        ``"numba"``: the fused CPU kernel of :mod:`svtoolkit._fista` (one problem per thread,
        the same algorithm; 10-100x faster than tensor operations on a CPU, where they are
        bound by per-operation overhead). ``"torch"``: tensor operations on K's device.
        ``"auto"`` (default): numba for CPU tensors, torch otherwise.

    Returns
    -------
    Tensor of shape (G, n), dtype of K
        Feasible iterate: ``sum = 1`` and ``0 <= alpha <= C`` on every problem with
        ``m C >= 1 - 1e-12`` (m = number of masked keys; the exact solver's rule). Problems in
        warm-up (``m C < 1 - 1e-12``, infeasible) get ``C`` on every key; they must be
        treated as ungated by the caller (:func:`ridged_svdd_solve` flags them). Not
        differentiable: it is a partition finder.

    Notes
    -----
    One iteration, all problems in parallel, with per-problem step ``1/L_g``::

        grad = 2 K y - diag(K)
        a'   = Pi_C(y - grad / L)              (exact capped-simplex projection)
        t'   = (1 + sqrt(1 + 4 t^2)) / 2,  y = a' + (t - 1)/t' (a' - a),  a = a'

    ``L_g = 2 * lipschitz_bound(K_g)`` is a guaranteed upper bound on the gradient's Lipschitz
    constant (never an under-estimate). The projection's dual variable is warm-started from
    the previous iteration, so each projection typically needs two or three passes over n.
    There is no convergence certificate: see docs/batched.md for the measured accuracy.
    """
    K, mask = _check_gram(K, mask)
    C = check_box(C)
    iters = check_iters(iters)
    check_option(backend, "backend", ("auto", "numba", "torch"))
    on_cpu = K.device.type == "cpu"
    if backend == "numba" and not on_cpu:
        raise ValueError(f"backend='numba' needs CPU tensors; K is on {K.device}")
    if K.numel() == 0:  # no problems or no keys
        return K.new_zeros(K.shape[:2])
    if backend == "numba" or (backend == "auto" and on_cpu):
        return _fista_numba(K.detach(), mask, C, int(iters), bool(restart))
    return _fista(K.detach(), mask, C, int(iters), bool(restart))


def _fista_numba(K, mask, C, iters, restart):
    from .._fista import fista_batch

    K_np = K.contiguous().numpy()
    out = np.empty(K_np.shape[:2], dtype=K_np.dtype)
    unconverged = fista_batch(K_np, mask.contiguous().numpy(), C, iters, POWER_ITERS, restart,
                              out)
    if unconverged:
        warnings.warn(
            f"capped-simplex projection: {unconverged} projection(s) did not converge in "
            "their safeguarded Newton steps; their dual variable is approximate",
            RuntimeWarning, stacklevel=3,
        )
    return torch.from_numpy(out)


def _matvec(K, y):
    """K y for symmetric K, computed as y^T K (measured 2-9x faster than K y on CPU)."""
    return torch.bmm(y[:, None, :], K)[:, 0, :]


def _fista(K, mask, C, iters, restart):
    G, n, _ = K.shape
    dtype, device = K.dtype, K.device
    m = mask.sum(-1)
    feasible = _feasible(m, C)
    bound = _lipschitz(K, mask, POWER_ITERS)
    step = torch.where(bound > 0, 0.5 / bound, torch.ones_like(bound))[:, None]
    diag = torch.diagonal(K, dim1=-2, dim2=-1)
    off_mask = _off_mask_to_minus_inf(torch.zeros_like(diag), mask)
    uniform = mask.to(dtype) / m.clamp(min=1).to(dtype)[:, None]
    a = torch.where(feasible[:, None], uniform, mask.to(dtype) * C)
    y = a
    t = torch.ones(G, dtype=dtype, device=device)
    lam = torch.zeros(G, dtype=dtype, device=device)
    for _ in range(iters):
        z = y - step * (2.0 * _matvec(K, y) - diag) + off_mask
        lam, _ = _projection_root(z, mask, C, lam)
        a_new = _apply_projection(z, lam, C, feasible, mask)
        y, t = _momentum(a_new, a, y, t, restart)
        a = a_new
    return a


def _momentum(a_new, a, y, t, restart):
    """FISTA extrapolation y = a' + (t - 1)/t' (a' - a), with per-problem gradient restart."""
    t_new = 0.5 * (1.0 + torch.sqrt(1.0 + 4.0 * t * t))
    weight = (t - 1.0) / t_new
    if restart:
        reset = ((y - a_new) * (a_new - a)).sum(-1) > 0
        weight = torch.where(reset, torch.zeros_like(weight), weight)
        t_new = torch.where(reset, torch.ones_like(t_new), t_new)
    return a_new + weight[:, None] * (a_new - a), t_new


# --------------------------------------------------------------------------------------------
# partition and ridged bordered solve
# --------------------------------------------------------------------------------------------


def partition_masks(alpha, C, *, tol=BATCHED_PARTITION_TOL, mask=None):
    """Margin and error masks read off approximate coefficients.

    Parameters
    ----------
    alpha : Tensor of shape (G, n)
        Approximate coefficients (e.g. from :func:`fista_svdd`).
    C : float
        Box.
    tol : float
        Relative threshold in ``[0, 0.5)``, a fraction of C (default
        :data:`svtoolkit._rules.BATCHED_PARTITION_TOL`, 1e-3).
    mask : Tensor of shape (G, n), bool, optional
        Keys that belong to each problem; off-mask keys are in neither set.

    Returns
    -------
    margin_mask, error_mask : Tensor of shape (G, n), bool
        Thresholds (relative to C, so they mean the same thing for every n and nu)::

            error  E:  alpha >= (1 - tol) C
            margin S:  tol C < alpha < (1 - tol) C
            reserve R: alpha <= tol C            (everything else)

    Notes
    -----
    The projection inside FISTA produces exact zeros and exact C's, so ``tol = 0`` is
    meaningful; a small positive tol moves coefficients that are still drifting towards a
    bound into that bound's set.

    The margin threshold ``tol C`` is relative to C, and the coefficients sum to 1: at most
    ``1 / (tol C)`` keys can exceed it, and for ``C >= 1 / tol`` (C >= 1000 at the default)
    the margin set is always empty, so :func:`ridged_svdd_solve` flags every problem invalid.
    """
    _check_float_tensor(alpha, "alpha", 2, "(G, n)")
    C = check_box(C)
    tol = check_partition_tol(tol)
    mask = _check_mask(mask, alpha.shape, alpha.device)
    alpha = alpha.detach()
    error = mask & (alpha >= (1.0 - tol) * C)
    margin = mask & (alpha > tol * C) & ~error
    return margin, error


def _check_partition(margin_mask, error_mask, mask):
    for name, sub in (("margin_mask", margin_mask), ("error_mask", error_mask)):
        _check_mask(sub, mask.shape, mask.device, name)
        if bool((sub & ~mask).any()):
            raise ValueError(f"{name} marks keys outside mask")
    if bool((margin_mask & error_mask).any()):
        raise ValueError("margin_mask and error_mask overlap; a key is in one set only")


def _bucket_widths(n_margin):
    """Padded size of each problem's margin block (:func:`svtoolkit._gate_core.bucket_width`).

    It depends on the problem's own |S| only, never on another problem's.
    """
    return torch.tensor([bucket_width(k) for k in n_margin.tolist()], dtype=torch.long,
                        device=n_margin.device)


def _first_of(member, width):
    """Per row, the indices where ``member`` is True first (ascending), then the rest, cut to
    ``width`` (index 0 repeated where ``width`` exceeds the row); and ``slot`` (B, width), True
    on the member positions."""
    n = member.shape[-1]
    index = torch.arange(n, device=member.device)[None, :]
    order = torch.argsort(torch.where(member, index, index + n), dim=-1)[:, :width]
    if width > n:
        order = torch.cat([order, order.new_zeros(order.shape[0], width - n)], 1)
    slot = torch.arange(width, device=member.device)[None, :] < member.sum(-1)[:, None]
    return order, slot


def _check_groups(groups, K):
    """The Gram of each problem: ``groups`` (G',) int indices into K (default: problem g uses
    K[g], then G' = G)."""
    if groups is None:
        return torch.arange(K.shape[0], device=K.device)
    if (not isinstance(groups, torch.Tensor) or groups.ndim != 1
            or groups.dtype not in (torch.int32, torch.int64)):
        raise TypeError("groups must be a 1-d integer torch.Tensor (one Gram index per problem)")
    if groups.device != K.device:
        raise ValueError(f"groups is on {groups.device} but K is on {K.device}")
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= K.shape[0]):
        raise ValueError(f"groups must index K's first axis, 0 .. {K.shape[0] - 1}")
    return groups.long()


def _check_finite_on_masks(K, groups, mask):
    """Raise if a problem's Gram has NaN or inf on its masked entries (one reduction when every
    entry is finite; the per-problem test only otherwise)."""
    K = K.detach()
    if _all_finite(K):
        return
    bad = ~torch.isfinite(K)
    for i in range(groups.numel()):
        pair = mask[i][:, None] & mask[i][None, :]
        if bool((bad[groups[i]] & pair).any()):
            raise ValueError("K contains NaN or inf on the masked entries")


class _Bucket:
    """The problems ``rows`` of one padded margin width: their margin keys ``order`` (B, w)
    with ``slot`` (padding slots False) and error keys ``e_order`` (B, e) with ``e_slot``."""

    def __init__(self, rows, width, margin_mask, error_mask):
        self.rows = rows
        self.order, self.slot = _first_of(margin_mask[rows], width)
        n_errors = int(error_mask[rows].sum(-1).max())
        self.e_order, self.e_slot = _first_of(error_mask[rows], max(n_errors, 1))

    def flat_index(self, groups, n):
        """Flat indices into K of this bucket's K_SS (B, w, w) and K_SE (B, w, e) entries."""
        base = groups[self.rows][:, None, None] * (n * n) + self.order[:, :, None] * n
        return (base + self.order[:, None, :]).reshape(-1), (base + self.e_order[:, None, :]
                                                            ).reshape(-1)


def _gather_blocks(K, groups, buckets):
    """K_SS and K_SE of every bucket, read from K in one gather.

    One ``torch.take`` for all buckets: its backward is a single scatter-add into a tensor of
    K's size, where a gather per bucket (or per chunk boundary) would allocate and fill one
    K-sized gradient each.
    """
    if not buckets:
        return []
    n = K.shape[-1]
    parts = [index for bucket in buckets for index in bucket.flat_index(groups, n)]
    values = torch.take(K, torch.cat(parts)).split([p.numel() for p in parts])
    blocks = []
    for bucket, K_SS, K_SE in zip(buckets, values[0::2], values[1::2]):
        B, w = bucket.order.shape
        blocks.append((K_SS.view(B, w, w), K_SE.view(B, w, bucket.e_order.shape[1])))
    return blocks


def _bordered_system(K_SS, K_SE, bucket, C, ridge):
    """M~ = [[0, 1^T], [1, 2 K_SS + ridge I]] and c = [1 - |E| C ; diag(K)_S - 2 C K_SE 1].

    Padding slots (``bucket.slot`` False) become identity rows with zero right-hand side; the
    entries read there are discarded with ``where`` (never multiplied: they may be anything).
    """
    B, width = bucket.order.shape
    dtype = K_SS.dtype
    zero = torch.zeros((), dtype=dtype, device=K_SS.device)
    slot, slot_f = bucket.slot, bucket.slot.to(dtype)
    K_SS = torch.where(slot[:, :, None] & slot[:, None, :], K_SS, zero)
    K_SE = torch.where(slot[:, :, None] & bucket.e_slot[:, None, :], K_SE, zero)
    eye = torch.eye(width, dtype=dtype, device=K_SS.device)
    block = 2.0 * K_SS + eye * ((1.0 - slot_f) + ridge * slot_f)[:, None, :]
    top = torch.cat([torch.zeros(B, 1, 1, dtype=dtype, device=K_SS.device), slot_f[:, None, :]],
                    2)
    M = torch.cat([top, torch.cat([slot_f[:, :, None], block], 2)], 1)
    diag_S = torch.diagonal(K_SS, dim1=1, dim2=2)
    c_top = 1.0 - C * bucket.e_slot.to(dtype).sum(-1, keepdim=True)
    # the error sums in index order (a running sum, read at its end): a plain sum rounds
    # differently with the padded length e, which the bucket's largest |E| sets
    c = torch.cat([c_top, diag_S - 2.0 * C * K_SE.cumsum(-1)[..., -1]], 1)
    return M, c


def ridged_svdd_solve(K, C, margin_mask, error_mask, *, ridge=RIDGE, mask=None, groups=None):
    """Ridged bordered KKT solve over given partitions, differentiable by autograd (eq. 6).

    Parameters
    ----------
    K : Tensor of shape (G, n, n), float32 or float64
        Gram matrices; gradients flow to K (and through it to keys, e.g. K = rbf(X)).
    C : float
        Box.
    margin_mask, error_mask : Tensor of shape (G', n), bool
        The partition of each problem (from :func:`partition_masks`); disjoint and inside
        ``mask``. G' = G unless ``groups`` is given.
    ridge : float
        ``>= 0`` added to the diagonal of the margin block (default 1e-3, the paper's value).
        ``ridge = 0`` solves the unregularised system of the given partition.
    mask : Tensor of shape (G', n), bool, optional
        Keys that belong to each problem (default all).
    groups : Tensor of shape (G',), int, optional
        The Gram of each problem: problem i is posed on ``K[groups[i]]``, so problems that
        share a Gram (e.g. the prefixes of one sequence) are solved in one call without
        copying it. Default: problem g on K[g].

    Returns
    -------
    alpha : Tensor of shape (G', n)
        ``alpha_S = u_S``, ``alpha_E = C``, 0 elsewhere; 0 on invalid problems.
    rho : Tensor of shape (G',)
        ``u_0``, the multiplier of ``sum(alpha) = 1`` in the convention
        ``g_i = 2 (K alpha)_i - K_ii + rho`` (f = 0 on the margin, > 0 inside); 0 when invalid.
    valid : Tensor of shape (G',), bool
        False for problems in warm-up (``m C < 1 - 1e-12``), with an empty margin set, with
        ``|E| C > 1 + 1e-12`` (an inconsistent partition: the error keys alone exceed the unit sum),
        or whose system is singular or gives non-finite values. Invalid rows are computed on
        an identity system, so neither their outputs nor any gradient is NaN.

    Notes
    -----
    With ``u = [rho; alpha_S]`` the system of each problem is (paper eq. 6)::

        [[0, 1^T], [1, 2 K_SS + ridge I]] u = [1 - |E| C ; diag(K)_S - 2 C K_SE 1]

    Problems are grouped by a padded width that depends on their own ``|S|`` only
    (:func:`svtoolkit._gate_core.bucket_width`: a quarter octave above ``|S| + 1`` and a
    multiple of 8 rows, so that every system of a batch is aligned alike), and each group
    is padded to it with decoupled identity rows, so a problem's result never depends on the
    other problems in the batch, to the bit. The backward pass reuses the forward's LU
    factors: with ``M u = c`` and ``lam = M^-T du``, ``dM = -lam u^T`` and ``dc = lam``. With ridge = 0 and the exact
    partition this returns the exact coefficients; with ridge > 0 it returns the exact solution
    of the ridged system, an approximation of the SVDD coefficients that need not respect
    ``0 <= alpha <= C``. With ridge > 0 and a positive semi-definite K the system is never
    singular. No certificate is attached to these coefficients.
    """
    _check_float_tensor(K, "K", 3, "(G, n, n)")
    C = check_box(C)
    ridge = check_ridge(ridge)
    G, n, n2 = K.shape
    if n != n2:
        raise ValueError(f"K must have shape (G, n, n); got {tuple(K.shape)}")
    groups = _check_groups(groups, K)
    mask = _check_mask(mask, (groups.numel(), n), K.device)
    _check_finite_on_masks(K, groups, mask)
    _check_partition(margin_mask, error_mask, mask)
    n_margin = margin_mask.sum(-1)
    too_many_errors = _too_many_errors(error_mask.sum(-1), C)
    valid = _feasible(mask.sum(-1), C) & (n_margin > 0) & ~too_many_errors
    # problems with an empty margin set are invalid: they keep alpha = 0, rho = 0
    width = torch.where(n_margin > 0, _bucket_widths(n_margin), 0)
    buckets = [_Bucket((width == w).nonzero()[:, 0], int(w), margin_mask, error_mask)
               for w in torch.unique(width).tolist() if w > 0]
    alpha = torch.zeros(groups.numel(), n, dtype=K.dtype, device=K.device)
    rho = torch.zeros(groups.numel(), dtype=K.dtype, device=K.device)
    for bucket, (K_SS, K_SE) in zip(buckets, _gather_blocks(K, groups, buckets)):
        M, c = _bordered_system(K_SS, K_SE, bucket, C, float(ridge))
        alpha_b, rho_b, valid_b = _solve_bucket(M, c, bucket, error_mask[bucket.rows],
                                                valid[bucket.rows], C)
        alpha = alpha.index_copy(0, bucket.rows, alpha_b)
        rho = rho.index_copy(0, bucket.rows, rho_b)
        valid = valid.index_copy(0, bucket.rows, valid_b)
    return alpha, rho, valid


def _solve_bucket(M, c, bucket, error_mask, valid, C):
    """Solve one bucket's systems; invalid rows are solved as identity systems (u = 0)."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device).expand_as(M)
    M = torch.where(valid[:, None, None], M, eye)
    c = torch.where(valid[:, None], c, torch.zeros_like(c))
    u, solved = _BorderedSolve.apply(M, c)
    return _scatter_solution(u, bucket, error_mask, valid & solved, C)


class _BorderedSolve(torch.autograd.Function):
    """``u = M^-1 c`` per row, with ``solved`` (accurate rows; u = 0 elsewhere), and the backward
    ``lam = M^-T du``, ``dM = -lam u^T``, ``dc = lam`` on the forward's LU factors."""

    @staticmethod
    def forward(ctx, M, c):
        LU, pivots, u, solved = _lu_solve_checked(M, c)
        ctx.save_for_backward(LU, pivots, u, solved)
        ctx.mark_non_differentiable(solved)
        return u, solved

    @staticmethod
    def backward(ctx, du, _):
        LU, pivots, u, solved = ctx.saved_tensors
        lam = torch.where(solved[:, None], _lu_apply(LU, pivots, du, adjoint=True),
                          torch.zeros_like(du))
        return -lam[:, :, None] * u[:, None, :], lam


def _lu_solve_checked(M, c):
    """LU factors and solutions of M u = c (B, p, p), with ``solved``: u finite and its
    residual at rounding level (:func:`_accurate`); unsolved rows get u = 0.

    Every solution is checked, per row (an O(p^2) product beside the O(p^3) factorisation)::

        max|M u - c| <= RESIDUAL_TOL * p * eps * (max|M| max|u| + max|c|)

    with p = w + 1 the size of the bordered system and eps that of the dtype. Rows that fail
    are factorised again one at a time: batched LU of torch 2.13 on a CPU returns wrong
    solutions silently (or raises) once ``torch.set_num_threads`` has been called with 2 or
    more threads (pytorch#142815); the one-matrix path is not affected. On some CPUs the
    batched call does not return at all under that bug (MKL's DLASWP reports a bad parameter
    in a loop), so with more than one torch thread on a CPU, systems above
    ``LU_BUG_MIN_SIZE`` are factorised and solved one matrix at a time from the start.
    """
    with torch.no_grad():
        if _batched_lu_unsafe(M):
            LU, pivots = _lu_rows(M)
        else:
            try:
                LU, pivots, _ = torch.linalg.lu_factor_ex(M)
            except RuntimeError:  # the same torch bug can raise from the batched call
                LU, pivots = _lu_rows(M)
        u = _lu_apply(LU, pivots, c)
        solved = _accurate(M, u, c)
        if not bool(solved.all()):
            redo = (~solved).nonzero()[:, 0]
            LU_r, pivots_r = _lu_rows(M[redo])
            LU[redo], pivots[redo] = LU_r, pivots_r
            u[redo] = _lu_apply(LU_r, pivots_r, c[redo], rows=True)
            solved = _accurate(M, u, c)
        u = torch.where(solved[:, None], u, torch.zeros_like(u))
    return LU, pivots, u, solved


def _batched_lu_unsafe(M):
    return (M.device.type == "cpu" and M.shape[0] > 1 and M.shape[-1] > LU_BUG_MIN_SIZE
            and torch.get_num_threads() > 1)


def _lu_rows(M):
    """LU factors of each matrix of M (B, p, p), one at a time; a failed factorisation leaves
    its row's solution non-finite or inaccurate, which :func:`_accurate` reports."""
    factors = [torch.linalg.lu_factor_ex(M[i])[:2] for i in range(M.shape[0])]
    return torch.stack([f[0] for f in factors]), torch.stack([f[1] for f in factors])


def _lu_apply(LU, pivots, c, *, adjoint=False, rows=None):
    """Solutions of the factorised systems for right-hand sides c (B, p): batched, or one
    matrix at a time where the batched CPU path is unsafe (``rows=True`` forces it)."""
    if rows or _batched_lu_unsafe(LU):
        out = [torch.linalg.lu_solve(LU[i], pivots[i], c[i][:, None], adjoint=adjoint)[:, 0]
               for i in range(LU.shape[0])]
        return torch.stack(out)
    try:
        return torch.linalg.lu_solve(LU, pivots, c[:, :, None], adjoint=adjoint)[:, :, 0]
    except RuntimeError:
        return _lu_apply(LU, pivots, c, adjoint=adjoint, rows=True)


def _accurate(M, u, c):
    """Finite u with a backward error at rounding level, per row (the test in
    :func:`_lu_solve_checked`)."""
    with torch.no_grad():
        residual = (torch.bmm(M, u[:, :, None])[:, :, 0] - c).abs().amax(-1)
        scale = M.abs().amax((-2, -1)) * u.abs().amax(-1) + c.abs().amax(-1)
        tol = RESIDUAL_TOL * M.shape[-1] * torch.finfo(M.dtype).eps
        return torch.isfinite(u).all(-1) & (residual <= tol * scale)


def _scatter_solution(u, bucket, error_mask, valid, C):
    """alpha (B, n): the margin solution at its keys, C on the error keys; 0 on invalid rows."""
    B, n = error_mask.shape
    dtype = u.dtype
    zero = torch.zeros((), dtype=dtype, device=u.device)
    keep = valid[:, None]
    u = torch.where(keep, u, zero)
    coeff_S = torch.where(bucket.slot, u[:, 1:], zero)
    alpha = torch.zeros(B, n, dtype=dtype, device=u.device).scatter_add(1, bucket.order, coeff_S)
    alpha = alpha + (error_mask & keep).to(dtype) * C
    return alpha, u[:, 0], valid
