r"""The differentiable exact gate: the fp64 SVDD optimum with an inverse-reusing backward.

This is the *exact maintained* path of DESIGN.md §3 (paper 000 §3.3 and App. A). The forward
pass is the exact fp64 solver :class:`svtoolkit.IncrementalSVDD`; the backward pass reuses the
bordered KKT inverse ``R = M^{-1}`` that the solver already maintains, so it performs **no linear
solve and no factorization**: one matrix-vector product with ``R^T`` and a few rank-one
assemblies.

Mathematics (DESIGN.md §1; ``g_i = 2 (K a)_i - K_ii + rho``). Within a fixed partition
(margin S, error E, reserve R) the free variables ``u = [rho; a_S]`` solve

.. math::

    M u = c, \quad M = \begin{bmatrix} 0 & 1^T \\ 1 & 2 K_{SS} \end{bmatrix}, \quad
    c = \begin{bmatrix} 1 - |E| C \\ \operatorname{diag}(K)_S - 2 C K_{SE} 1 \end{bmatrix},
    \quad \mathcal{R} = M^{-1},

while ``a_E = C`` and ``a_R = 0`` are constants. For upstream cotangents ``alpha_bar`` and
``rho_bar`` let ``u_bar = [rho_bar; alpha_bar_S]`` and ``w = R^T u_bar`` (margin block ``w_S``).
From ``dL = w^T dc - w^T dM u`` (paper eq. 5):

* ``dL/dK_ii  += w_i``               for i in S      (diag(K)_S in c)
* ``dL/dK_ie  += -2 C w_i``          for i in S, e in E   (K_SE in c)
* ``dL/dK_ij  += -2 w_i a_j``        for i, j in S   (the 2 K_SS block of M)

and nothing else: error and reserve coefficients have zero derivative. Through the kernel
``k(a, b) = exp(-||a - b||^2 / sigma^2)`` (``k(x, x) = 1``, so the diagonal terms vanish) the
key gradient is assembled from the same blocks (:func:`_key_cotangent`).

**Kinks.** Set migrations (a margin coefficient reaching 0 or C, an error/reserve point reaching
``g = 0``) happen on a measure-zero set of inputs across which the map is only piecewise
smooth. As with a ReLU, no gradient is routed through the discrete change of membership: the
partition is held fixed, error/reserve coefficients have zero derivative.

**Empty margin set.** With S empty every coefficient sits at a bound (locally constant, zero
derivative) and rho is any value of its optimal interval ``[max_R -h_i, min_E -h_i]``,
``h = 2 K a - diag(K)``; the solver reports the midpoint (the finite end when one side is
empty). The gate differentiates that rule (the two interval ends are held fixed).

**Warm-up.** While ``n C < 1`` the problem is infeasible and nothing is certified:
:func:`svdd_gate` and :func:`gate_from_solver` raise; :class:`SVAttention` falls back to the
ungated readout and says so in its info (DESIGN.md §2.4).

**Non-symmetric K** (K-level entry point only). The K-level map is the solution of the KKT
equations as written, ``g_S(K) = 0`` and ``1^T a = 1`` with ``g = 2 K a - diag(K) + rho`` (rows of
K): on a symmetric K it is the QP optimum, and its derivative is exactly the unsymmetrised
matrix above, so ``torch.autograd.gradcheck`` can perturb single entries of K. The gradient on
the manifold of symmetric matrices is its symmetric part.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from .._validation import check_positive
from ..exact import IncrementalSVDD

__all__ = [
    "svdd_gate",
    "svdd_gate_from_gram",
    "gate_from_solver",
    "bordered_solve_gate",
    "svdd_decision",
    "rbf",
    "sv_attention",
    "SVAttention",
    "SVAttentionInfo",
    "ExactGateFunction",
    "GramGateFunction",
]

#: K-level forward: a given partition is accepted when its KKT signs hold to this (units of f).
PARTITION_SIGN_TOL = 1e-9
#: Readout denominators below this (the smallest normal float64) count as zero.
ZERO_DENOMINATOR = torch.finfo(torch.float64).tiny


# --------------------------------------------------------------------------------------------
# kernel and validation helpers
# --------------------------------------------------------------------------------------------


def rbf(a, b, *, sigma):
    """RBF cross-kernel ``exp(-||a_i - b_j||^2 / sigma^2)`` in torch (autograd-friendly).

    Parameters
    ----------
    a : Tensor of shape (..., n, d)
    b : Tensor of shape (..., m, d)
    sigma : float

    Returns
    -------
    Tensor of shape (..., n, m)

    Notes
    -----
    Squared distances are summed from coordinate differences (no ``|a|^2 + |b|^2 - 2 a.b``
    expansion), so k(x, x) = 1 exactly and the derivative at coincident points is 0, not NaN.
    """
    diff = a.unsqueeze(-2) - b.unsqueeze(-3)
    return torch.exp(-(diff * diff).sum(-1) / (sigma * sigma))


def _check_tensor(x, name, ndim=None, shape_text=""):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}; got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return x


def _check_keys_shape(keys):
    """At least one key and one feature in ``keys`` of shape (..., n, d)."""
    if keys.shape[-2] == 0:
        raise ValueError(f"keys must hold at least one key; got shape {tuple(keys.shape)}")
    if keys.shape[-1] == 0:
        raise ValueError(f"keys must have at least one feature; got shape {tuple(keys.shape)}")


def _positions(idx, name, n):
    """A partition argument as int64 positions in ``[0, n)``.

    Non-integer dtypes are refused rather than cast: float positions would be truncated and a
    bool mask would be read as the positions 0 and 1.
    """
    idx = np.asarray(idx)
    if idx.size and idx.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer positions (np.flatnonzero(mask) for a bool "
                        f"mask); got dtype {idx.dtype}")
    if idx.ndim > 1:
        raise ValueError(f"{name} must be a 1-D sequence of positions; got shape {idx.shape}")
    idx = idx.astype(np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"{name} positions must be in [0, {n}); got {idx.tolist()}")
    return idx


def _as_numpy64(x):
    return np.ascontiguousarray(x.detach().to(device="cpu", dtype=torch.float64).numpy())


# --------------------------------------------------------------------------------------------
# the fixed-partition state shared by forward and backward
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GateState:
    """Everything the backward needs: the partition, the maintained inverse and alpha.

    ``margin`` / ``error`` are positions (LongTensor) into the n keys, ``margin`` in bordered
    order (row/column p+1 of ``inverse`` belongs to ``margin[p]``). The backward's dL/dK lives
    on ``rows`` x ``columns`` (S x (S, E)) plus the diagonal of ``rows``, and has the form
    ``outer(v, column_coeff)`` + ``diag(v)`` (see :func:`_gram_cotangent_rows`). For an empty
    margin set, ``rows`` are the positions of the rho-interval ends and ``rho_weights`` their
    weights in the reported rho (0.5 each for the midpoint, 1.0 for a one-sided interval).
    """

    n: int
    C: float
    alpha: torch.Tensor
    rho: torch.Tensor
    margin: torch.Tensor
    error: torch.Tensor
    inverse_t: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    column_coeff: torch.Tensor
    flat_index: torch.Tensor
    rho_weights: torch.Tensor


def _empty_margin_rho(h, error, reserve):
    """Positions and weights of the rho rule with S empty: rho = sum_k weight_k * (-h[row_k])."""
    rows = []
    if len(reserve):
        rows.append(int(reserve[np.argmax(-h[reserve])]))
    if len(error):
        rows.append(int(error[np.argmin(-h[error])]))
    return rows, [1.0 / len(rows)] * len(rows)


def _make_state(n, C, alpha, rho, margin, error, inverse, h_for_empty, device):
    """Build a _GateState from NumPy pieces (``h_for_empty`` only used when S is empty)."""
    margin = np.asarray(margin, dtype=np.int64)
    error = np.asarray(error, dtype=np.int64)
    alpha = np.asarray(alpha, dtype=np.float64)
    rho_weights = []
    if len(margin):
        rows = margin
        column_coeff = np.concatenate([-2.0 * alpha[margin], np.full(len(error), -2.0 * C)])
    else:
        bound = np.zeros(n, bool)
        bound[error] = True
        rows, rho_weights = _empty_margin_rho(h_for_empty(), error, np.flatnonzero(~bound))
        rows = np.asarray(rows, dtype=np.int64)
        column_coeff = np.full(len(error), -2.0 * C)
        inverse = np.zeros((1, 1))
    columns = np.concatenate([margin, error])
    flat_index = np.concatenate([(rows[:, None] * n + columns[None, :]).ravel(), rows * (n + 1)])
    f64 = dict(dtype=torch.float64, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return _GateState(
        n=n,
        C=float(C),
        alpha=torch.tensor(alpha, **f64),
        rho=torch.tensor(float(rho), **f64),
        margin=torch.tensor(margin, **i64),
        error=torch.tensor(error, **i64),
        inverse_t=torch.tensor(np.ascontiguousarray(np.asarray(inverse, np.float64).T), **f64),
        rows=torch.tensor(rows, **i64),
        columns=torch.tensor(columns, **i64),
        column_coeff=torch.tensor(column_coeff, **f64),
        flat_index=torch.tensor(flat_index, **i64),
        rho_weights=torch.tensor(np.asarray(rho_weights, dtype=np.float64), **f64),
    )


# --------------------------------------------------------------------------------------------
# the backward: App. A with the maintained inverse (no solve, no factorization)
# --------------------------------------------------------------------------------------------


def _gram_cotangent_rows(state, alpha_bar, rho_bar):
    """The row weights v with dL/dK = outer(v, column_coeff) on rows x columns, + diag(v).

    With S non-empty, v = w_S, the margin block of ``w = R^T u_bar``, ``u_bar = [rho_bar;
    alpha_bar_S]`` - one matrix-vector product with the maintained inverse, no solve - and
    ``column_coeff = [-2 alpha_S, -2 C 1_E]``, which is paper eq. 5:
    ``dL/dK_ij = -2 w_i a_j`` (i, j in S), ``dL/dK_ie = -2 C w_i`` (e in E), ``dL/dK_ii += w_i``.
    With S empty, alpha is locally constant and ``rho = sum_k t_k (K_kk - 2 C sum_e K_ke)``
    over the interval ends k, so v = t rho_bar and ``column_coeff = -2 C 1_E``.
    """
    rho_bar = rho_bar.reshape(1).to(torch.float64)
    if state.margin.numel():
        u_bar = torch.cat([rho_bar, alpha_bar.to(torch.float64)[state.margin]])
        return torch.mv(state.inverse_t, u_bar)[1:]  # w = R^T u_bar: a product, not a solve
    return state.rho_weights * rho_bar


def _dense_gram_cotangent(state, alpha_bar, rho_bar):
    """Assemble the (n, n) dL/dK (not symmetrised) with one scatter-add."""
    v = _gram_cotangent_rows(state, alpha_bar, rho_bar)
    values = torch.cat([torch.outer(v, state.column_coeff).reshape(-1), v])
    grad = torch.zeros(state.n * state.n, dtype=torch.float64, device=v.device)
    return grad.index_add_(0, state.flat_index, values).view(state.n, state.n)


def _key_cotangent(state, keys64, sigma, alpha_bar, rho_bar):
    """dL/dkeys through ``K_ij = exp(-||x_i - x_j||^2 / sigma^2)``, from the compact blocks.

    With ``T_pq = -(2 / sigma^2) v_p column_coeff_q K[rows_p, cols_q]`` (the diagonal of K is
    constant, so diag(v) drops out), ``dL = sum_pq T_pq (x_p - x_q) . (dx_p - dx_q)``.
    Cost O(|rows| (|S| + |E|) d); the (n, n) dL/dK is never formed.
    """
    grad = torch.zeros_like(keys64)
    rows, cols = state.rows, state.columns
    if rows.numel() == 0 or cols.numel() == 0:
        return grad
    v = _gram_cotangent_rows(state, alpha_bar, rho_bar)
    x_rows, x_cols = keys64[rows], keys64[cols]
    t = torch.outer((-2.0 / (sigma * sigma)) * v, state.column_coeff)
    t = t * rbf(x_rows, x_cols, sigma=sigma)
    grad.index_add_(0, rows, t.sum(1).unsqueeze(1) * x_rows - t @ x_cols)
    grad.index_add_(0, cols, t.sum(0).unsqueeze(1) * x_cols - t.T @ x_rows)
    return grad


class ExactGateFunction(torch.autograd.Function):
    """keys -> (alpha, rho) with the App. A backward fused with the kernel map.

    ``apply(keys, state, sigma)``: ``state`` is the exact solution (see :func:`gate_from_solver`);
    the forward only returns it. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, keys, state, sigma):
        ctx.state, ctx.sigma = state, sigma
        ctx.save_for_backward(keys)
        return state.alpha.clone(), state.rho.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, alpha_bar, rho_bar):
        (keys,) = ctx.saved_tensors
        grad = _key_cotangent(ctx.state, keys.detach().to(torch.float64), ctx.sigma,
                              alpha_bar, rho_bar)
        return grad.to(keys.dtype), None, None


class GramGateFunction(torch.autograd.Function):
    """K -> (alpha, rho) with the App. A backward (dense, unsymmetrised dL/dK)."""

    @staticmethod
    def forward(ctx, K, state):
        ctx.state = state
        ctx.K_dtype = K.dtype
        return state.alpha.clone(), state.rho.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, alpha_bar, rho_bar):
        return _dense_gram_cotangent(ctx.state, alpha_bar, rho_bar).to(ctx.K_dtype), None


# --------------------------------------------------------------------------------------------
# public entry points
# --------------------------------------------------------------------------------------------


def _fresh_solver(keys64, C, sigma):
    solver = IncrementalSVDD(C, sigma)
    solver.extend(keys64)
    return solver


def _state_from_solver(solver, device):
    system = solver.margin_system()
    ids = solver.ids
    margin = np.searchsorted(ids, system.margin_ids)
    error = np.searchsorted(ids, system.error_ids)
    keys = solver.keys

    def h():
        # h = 2 K a - 1 (only needed with S empty, where a = C on E and 0 elsewhere)
        x_error = keys[error]
        sq = ((keys[:, None, :] - x_error[None, :, :]) ** 2).sum(-1)
        return 2.0 * solver.C * np.exp(-sq / solver.sigma**2).sum(1) - 1.0

    return _make_state(len(ids), solver.C, solver.alpha, solver.rho, margin, error,
                       system.inverse, h, device)


def gate_from_solver(solver, keys):
    """Differentiate an existing exact solver state with respect to its keys (no re-solve).

    Parameters
    ----------
    solver : IncrementalSVDD
        A certified solver (``n C >= 1``), e.g. a memory that has had deletions.
    keys : Tensor of shape (n, d)
        The solver's keys **in the order of** ``solver.ids`` (``solver.keys``), as a tensor that
        carries the graph to differentiate. Must equal ``solver.keys`` exactly (in float64).

    Returns
    -------
    alpha : Tensor of shape (n,), float64
        Coefficients aligned with ``solver.ids`` (reserve keys exactly 0).
    rho : Tensor of shape (), float64

    Raises
    ------
    RuntimeError
        The solver is in warm-up (``n C < 1``): nothing is certified and the gate is undefined.
    ValueError
        ``keys`` has the wrong shape or differs from the solver's keys.

    Notes
    -----
    The backward is paper 000 App. A with the solver's maintained inverse
    (``solver.margin_system().inverse``) - see the module docstring.
    """
    if not isinstance(solver, IncrementalSVDD):
        raise TypeError(f"solver must be an IncrementalSVDD; got {type(solver).__name__}")
    _check_tensor(keys, "keys", 2, "(n, d)")
    if not solver.certified:
        raise RuntimeError(
            "the exact gate needs a certified solver: it is in warm-up (n * C < 1, "
            f"n = {len(solver)}, C = {solver.C:.6g}); use the ungated readout until n * C >= 1"
        )
    held = solver.keys
    if tuple(keys.shape) != held.shape:
        raise ValueError(
            f"keys must have the solver's shape {held.shape} (rows in the order of "
            f"solver.ids); got {tuple(keys.shape)}"
        )
    if not np.array_equal(_as_numpy64(keys), held):
        raise ValueError("keys differ from solver.keys: the gradient would be of another problem")
    state = _state_from_solver(solver, keys.device)
    return ExactGateFunction.apply(keys, state, solver.sigma)


def svdd_gate(keys, *, C, sigma):
    """The exact SVDD gate ``keys -> (alpha, rho)`` with the inverse-reusing backward.

    Parameters
    ----------
    keys : Tensor of shape (n, d)
    C : float
        Box constraint (fixed); ``n C >= 1`` is required.
    sigma : float
        RBF width, ``k(a, b) = exp(-||a - b||^2 / sigma^2)``.

    Returns
    -------
    alpha : Tensor of shape (n,), float64
        The exact optimum (fp64 solver); reserve keys exactly 0.
    rho : Tensor of shape (), float64
        ``f(x) = 2 sum_i a_i k(x, x_i) - 1 + rho`` (DESIGN.md sign convention).

    Raises
    ------
    ValueError
        ``n C < 1`` (warm-up: infeasible, nothing certified), no keys or no features, bad
        shapes, NaN or inf.

    Notes
    -----
    Forward: :class:`svtoolkit.IncrementalSVDD` built by ``extend`` in fp64. Backward: paper
    000 App. A with the solver's maintained inverse (one product with ``R^T``, rank-one
    assemblies, the kernel chain rule); no solve, no factorization. Partition changes are
    kinks and are not differentiated through.

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import svdd_gate
    >>> keys = torch.randn(20, 3, dtype=torch.float64,
    ...                    generator=torch.Generator().manual_seed(0)).requires_grad_()
    >>> alpha, rho = svdd_gate(keys, C=0.1, sigma=1.5)
    >>> bool(abs(alpha.sum().item() - 1.0) < 1e-12)
    True
    >>> (alpha[:5].sum() + rho).backward()
    >>> keys.grad.shape
    torch.Size([20, 3])
    """
    C = check_positive(C, "C")
    sigma = check_positive(sigma, "sigma")
    _check_tensor(keys, "keys", 2, "(n, d)")
    _check_keys_shape(keys)
    n = keys.shape[0]
    if n * C < 1.0 - 1e-12:
        raise ValueError(
            f"infeasible: n * C = {n * C:.6g} < 1 (warm-up); the exact gate needs n * C >= 1"
        )
    solver = _fresh_solver(_as_numpy64(keys), C, sigma)
    return gate_from_solver(solver, keys)


def svdd_gate_from_gram(K, C, *, margin=None, error=None):
    """The K-level gate ``K -> (alpha, rho)`` with the same inverse-reusing backward.

    Parameters
    ----------
    K : Tensor of shape (n, n)
        Kernel matrix (symmetric PSD at the point of interest).
    C : float
    margin, error : array_like of int, optional
        A partition to hold fixed: 1-D integer positions (not bool masks; an empty list is
        fine). When omitted it is found by the QP reference
        :func:`svtoolkit.reference.solve_svdd` on ``(K + K^T) / 2`` (needs the ``verify``
        extra).

    Returns
    -------
    alpha : Tensor of shape (n,), float64
    rho : Tensor of shape (), float64

    Raises
    ------
    TypeError
        ``margin`` or ``error`` is not integer (floats, a bool mask).
    ValueError
        The partition is not optimal for ``K`` (a margin coefficient outside (0, C) or an
        error/reserve sign violated beyond :data:`PARTITION_SIGN_TOL`), or it does not sum to
        one when S is empty; positions out of range or repeated; bad shapes, NaN or inf.

    Notes
    -----
    The forward solves the bordered system of the given partition (``np.linalg.inv`` once:
    the forward's factorization); the backward uses only that inverse and alpha, exactly as
    :func:`svdd_gate` does with the solver's maintained one. For a non-symmetric K the map is
    the solution of the KKT equations as written (see the module docstring).
    """
    C = check_positive(C, "C")
    _check_tensor(K, "K", 2, "(n, n)")
    n = K.shape[0]
    if K.shape[1] != n or n == 0:
        raise ValueError(f"K must be a non-empty square matrix; got shape {tuple(K.shape)}")
    K64 = _as_numpy64(K)
    if (margin is None) != (error is None):
        raise ValueError("give both margin and error, or neither")
    if margin is None:
        from ..reference import solve_svdd

        ref = solve_svdd(0.5 * (K64 + K64.T), C)
        if not ref.polished:
            raise RuntimeError(f"the QP reference did not polish: {ref.message}")
        margin, error = ref.margin, ref.error
    margin = _positions(margin, "margin", n)
    error = _positions(error, "error", n)
    member = np.zeros(n, dtype=np.int64)
    for idx in (margin, error):
        np.add.at(member, idx, 1)
    if member.max(initial=0) > 1:
        raise ValueError("margin and error must be disjoint and without repeats")
    alpha = np.zeros(n)
    alpha[error] = C
    m = len(margin)
    diagK = np.diag(K64)
    if m:
        M = np.zeros((m + 1, m + 1))
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * K64[np.ix_(margin, margin)]
        c = np.empty(m + 1)
        c[0] = 1.0 - len(error) * C
        c[1:] = diagK[margin] - 2.0 * C * K64[np.ix_(margin, error)].sum(axis=1)
        inverse = np.linalg.inv(M)  # the forward's one factorization
        u = inverse @ c
        u += inverse @ (c - M @ u)  # one step of iterative refinement
        rho = float(u[0])
        alpha[margin] = u[1:]
    else:
        if abs(len(error) * C - 1.0) > 1e-12:
            raise ValueError(
                f"with an empty margin set sum(a) = |E| C must be 1; got {len(error) * C:.6g}"
            )
        inverse = np.zeros((1, 1))
        rho = None
    h = 2.0 * (K64 @ alpha) - diagK
    state = _make_state(n, C, alpha, 0.0 if rho is None else rho, margin, error, inverse,
                        lambda: h, K.device)
    if rho is None:
        rows = state.rows.cpu().numpy()
        rho = float(np.sum(state.rho_weights.cpu().numpy() * -h[rows]))
        state = dataclasses.replace(
            state, rho=torch.tensor(rho, dtype=torch.float64, device=K.device))
    _check_partition(alpha, h + rho, margin, error, C)
    return GramGateFunction.apply(K, state)


def _check_partition(alpha, g, margin, error, C):
    n = len(alpha)
    if len(margin) and not ((alpha[margin] > 0.0).all() and (alpha[margin] < C).all()):
        raise ValueError("the partition is not optimal for K: a margin coefficient left (0, C)")
    reserve = np.setdiff1d(np.arange(n), np.concatenate([margin, error]))
    if len(error) and g[error].max() > PARTITION_SIGN_TOL:
        raise ValueError(f"the partition is not optimal for K: g = {g[error].max():.3e} > 0 "
                         "on the error set")
    if len(reserve) and g[reserve].min() < -PARTITION_SIGN_TOL:
        raise ValueError(f"the partition is not optimal for K: g = {g[reserve].min():.3e} < 0 "
                         "on the reserve set")


def bordered_solve_gate(K, margin, error, C):
    """Slow reference: (alpha, rho) by autograd through a fresh ``torch.linalg.solve``.

    Builds M and c of the given partition from K with differentiable torch ops and solves; the
    gradient is standard autograd (a second solve in the backward). Used by the tests, the
    verification check and the benchmark as the dense implicit-function reference; it does not
    check that the partition is optimal.

    Returns
    -------
    alpha : Tensor of shape (n,)
    rho : Tensor of shape ()

    Raises
    ------
    ValueError
        Empty margin set (the bordered matrix is then singular).
    """
    if len(margin) == 0:
        raise ValueError("bordered_solve_gate needs a non-empty margin set")
    margin = torch.as_tensor(np.asarray(margin, dtype=np.int64), device=K.device)
    error = torch.as_tensor(np.asarray(error, dtype=np.int64), device=K.device)
    n, m = K.shape[0], margin.numel()
    ones = torch.ones(m, dtype=K.dtype, device=K.device)
    top = torch.cat([K.new_zeros(1), ones]).unsqueeze(0)
    bottom = torch.cat([ones.unsqueeze(1), 2.0 * K[margin][:, margin]], dim=1)
    M = torch.cat([top, bottom], dim=0)
    c = torch.cat([
        K.new_tensor([1.0 - error.numel() * C]),
        torch.diagonal(K)[margin] - 2.0 * C * K[margin][:, error].sum(1),
    ])
    u = torch.linalg.solve(M, c)
    alpha = K.new_zeros(n).index_put((error,), K.new_full((error.numel(),), C))
    alpha = alpha.index_put((margin,), u[1:])
    return alpha, u[0]


def svdd_decision(queries, keys, alpha, rho, *, sigma):
    """Decision scores ``f(q) = 2 sum_i a_i k(q, x_i) - 1 + rho`` (f > 0 inside).

    Parameters
    ----------
    queries : Tensor of shape (m, d)
    keys : Tensor of shape (n, d)
    alpha : Tensor of shape (n,)
    rho : Tensor of shape ()

    Returns
    -------
    Tensor of shape (m,)
    """
    return 2.0 * rbf(queries, keys, sigma=sigma) @ alpha - 1.0 + rho


# --------------------------------------------------------------------------------------------
# SV-Attention readout
# --------------------------------------------------------------------------------------------


class SVAttentionInfo(NamedTuple):
    """Diagnostics of one :func:`sv_attention` call (detached tensors).

    Attributes
    ----------
    alpha : Tensor of shape (..., n)
        Gate coefficients (the uniform 1/n in warm-up).
    rho : Tensor of shape (...)
        NaN in warm-up (no gate).
    warmup : Tensor of shape (...), bool
        True where ``n C < 1``: the readout was ungated.
    zero_denominator : Tensor of shape (..., m), bool
        True where ``sum_i a_i k(q, x_i)`` underflowed to below the smallest normal float64 (a
        query farther than about 26.6 sigma from every support key): the output there is 0.
    """

    alpha: torch.Tensor
    rho: torch.Tensor
    warmup: torch.Tensor
    zero_denominator: torch.Tensor


def _check_attention_inputs(keys, values, queries):
    for x, name, shape in ((keys, "keys", "(..., n, d)"), (values, "values", "(..., n, dv)"),
                           (queries, "queries", "(..., m, d)")):
        _check_tensor(x, name)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(x.shape)}")
    batch = keys.shape[:-2]
    if values.shape[:-2] != batch or queries.shape[:-2] != batch:
        raise ValueError(
            "keys, values and queries must share their leading dimensions; got "
            f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(queries.shape)}"
        )
    if values.shape[-2] != keys.shape[-2]:
        raise ValueError(f"values must have one row per key ({keys.shape[-2]}); "
                         f"got {tuple(values.shape)}")
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"queries must have the key dimension {keys.shape[-1]}; "
                         f"got {tuple(queries.shape)}")
    _check_keys_shape(keys)


def _flatten_batch(x):
    """``(..., r, c) -> (B, r, c)``, B the product of the leading sizes (also when B or r*c
    is 0, where ``reshape(-1, r, c)`` is ambiguous)."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


def _gate_or_warmup(keys, C, sigma):
    """(alpha, rho, warmup) for one problem; warm-up gives the ungated uniform weights."""
    keys64 = _as_numpy64(keys)
    n = keys.shape[0]
    if n * C < 1.0 - 1e-12:
        alpha = torch.full((n,), 1.0 / n, dtype=torch.float64, device=keys.device)
        return alpha, torch.tensor(float("nan"), dtype=torch.float64, device=keys.device), True
    solver = _fresh_solver(keys64, C, sigma)
    alpha, rho = gate_from_solver(solver, keys)
    return alpha, rho, False


def _readout(kq, alpha, values):
    """``o = (kq * a) v / sum(kq * a)`` with the zero-denominator rule (output 0, flagged)."""
    weights = kq * alpha
    den = weights.sum(-1)
    zero = den < ZERO_DENOMINATOR
    safe = torch.where(zero, torch.ones_like(den), den)
    out = (weights @ values) / safe.unsqueeze(-1)
    return torch.where(zero.unsqueeze(-1), torch.zeros_like(out), out), zero


def sv_attention(keys, values, queries, *, C, sigma, return_info=False):
    """SV-Attention readout ``o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i)``.

    Parameters
    ----------
    keys : Tensor of shape (..., n, d)
        ``n >= 1`` keys with ``d >= 1`` features.
    values : Tensor of shape (..., n, dv)
        ``dv = 0`` is allowed (the output is then empty).
    queries : Tensor of shape (..., m, d)
        Leading dimensions must agree; each index is an independent exact problem (a loop).
        ``m = 0`` queries and an empty leading batch are allowed: the outputs are then empty
        tensors of the shapes below.
    C, sigma : float
    return_info : bool, default False
        Also return :class:`SVAttentionInfo`.

    Returns
    -------
    out : Tensor of shape (..., m, dv)
        Computed in float64, returned in the promoted dtype of the inputs.
    info : SVAttentionInfo, only when ``return_info``

    Raises
    ------
    ValueError
        No keys (``n = 0``) or no features (``d = 0``); mismatched shapes; NaN or inf.

    Notes
    -----
    * The gate a comes from :func:`svdd_gate` (exact fp64 forward, App. A backward);
      gradients reach keys through a and through k(q, x), and values and queries directly.
    * **Zero denominator.** With a >= 0 and sum(a) = 1 the denominator is positive in exact
      arithmetic, but ``exp`` underflows for queries far from every support key. Where it is
      below the smallest normal float64 the output is defined as 0, the gradient there is 0
      (never NaN), and ``info.zero_denominator`` flags the query.
    * **Warm-up** (``n C < 1``): the gate is infeasible; the readout is ungated (a = 1/n, the
      normalised RBF readout, DESIGN.md §2.4), ``info.warmup`` is True and ``info.rho`` NaN.
    """
    C = check_positive(C, "C")
    sigma = check_positive(sigma, "sigma")
    _check_attention_inputs(keys, values, queries)
    out_dtype = torch.promote_types(torch.promote_types(keys.dtype, values.dtype), queries.dtype)
    batch = keys.shape[:-2]
    n, m, dv = keys.shape[-2], queries.shape[-2], values.shape[-1]
    out, alpha, rho, warm, zero = _attend(
        _flatten_batch(keys), _flatten_batch(values).to(torch.float64),
        _flatten_batch(queries).to(torch.float64), C, sigma,
    )
    out = out.reshape(*batch, m, dv).to(out_dtype)
    if not return_info:
        return out
    info = SVAttentionInfo(
        alpha=alpha.reshape(*batch, n),
        rho=rho.reshape(batch),
        warmup=warm.reshape(batch),
        zero_denominator=zero.reshape(*batch, m),
    )
    return out, info


def _attend(k2, v2, q2, C, sigma):
    """One exact problem per row of (B, n, d) keys, (B, n, dv) values, (B, m, d) queries.

    Returns the stacked ``out (B, m, dv)``, ``alpha (B, n)``, ``rho (B,)``, ``warmup (B,)``
    and ``zero_denominator (B, m)``; values and queries are float64 already.
    """
    if k2.shape[0] == 0:
        return _empty_attention(k2, v2, q2)
    outs, alphas, rhos, warm, zeros = [], [], [], [], []
    for b in range(k2.shape[0]):
        alpha, rho, is_warm = _gate_or_warmup(k2[b], C, sigma)
        kq = rbf(q2[b], k2[b].to(torch.float64), sigma=sigma)
        out, zero = _readout(kq, alpha, v2[b])
        outs.append(out)
        alphas.append(alpha.detach())
        rhos.append(rho.detach())
        warm.append(is_warm)
        zeros.append(zero)
    warm = torch.tensor(warm, dtype=torch.bool, device=k2.device)
    return torch.stack(outs), torch.stack(alphas), torch.stack(rhos), warm, torch.stack(zeros)


def _empty_attention(k2, v2, q2):
    """The results of an empty batch (B = 0): zero-size tensors of the right shapes.

    ``out`` is tied to the inputs' graph (by a zero-weighted sum), so a backward through it
    works as for any other batch and gives empty gradients.
    """
    _, n, _ = k2.shape
    m, dv = q2.shape[1], v2.shape[2]
    f64 = dict(dtype=torch.float64, device=k2.device)
    anchor = 0.0 * (k2.sum().to(torch.float64) + v2.sum() + q2.sum())
    out = torch.zeros(0, m, dv, **f64) + anchor
    flags = dict(dtype=torch.bool, device=k2.device)
    return (out, torch.zeros(0, n, **f64), torch.zeros(0, **f64), torch.zeros(0, **flags),
            torch.zeros(0, m, **flags))


class SVAttention(torch.nn.Module):
    """SV-Attention over given keys, values and queries (no projections; exact gate).

    Parameters
    ----------
    C : float
        Box constraint of every gate (fixed).
    sigma : float
        RBF width.

    Attributes
    ----------
    last_info : SVAttentionInfo or None
        Diagnostics of the latest forward (warm-up and zero-denominator flags).

    Notes
    -----
    ``forward(keys (..., n, d), values (..., n, dv), queries (..., m, d)) -> (..., m, dv)``;
    see :func:`sv_attention` for the readout, the zero-denominator rule and warm-up.

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import SVAttention
    >>> g = torch.Generator().manual_seed(0)
    >>> x, v, q = (torch.randn(2, s, k, generator=g, dtype=torch.float64)
    ...            for s, k in ((16, 3), (16, 4), (5, 3)))
    >>> layer = SVAttention(C=0.2, sigma=1.5)
    >>> layer(x, v, q).shape
    torch.Size([2, 5, 4])
    >>> layer.support_mask(x).shape
    torch.Size([2, 16])
    """

    def __init__(self, C, sigma):
        super().__init__()
        self.C = check_positive(C, "C")
        self.sigma = check_positive(sigma, "sigma")
        self.last_info = None

    def forward(self, keys, values, queries):
        out, self.last_info = sv_attention(keys, values, queries, C=self.C, sigma=self.sigma,
                                           return_info=True)
        return out

    @torch.no_grad()
    def support_mask(self, keys):
        """Bool tensor of shape (..., n): True where the gate coefficient is > 0.

        Reserve keys (a = 0 exactly) are False: they are certified inert and can be evicted
        without changing any readout. In warm-up every key is True (the readout is ungated).
        """
        _check_tensor(keys, "keys")
        if keys.ndim < 2:
            raise ValueError(f"keys must have shape (..., n, d); got {tuple(keys.shape)}")
        _check_keys_shape(keys)
        masks = [_gate_or_warmup(k, self.C, self.sigma)[0] > 0 for k in _flatten_batch(keys)]
        if not masks:  # an empty batch
            return torch.zeros(keys.shape[:-1], dtype=torch.bool, device=keys.device)
        return torch.stack(masks).reshape(keys.shape[:-1])

    def extra_repr(self):
        return f"C={self.C:.6g}, sigma={self.sigma:.6g}"
