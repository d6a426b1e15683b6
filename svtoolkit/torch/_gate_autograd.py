r"""The autograd core of the exact gate: fixed-partition state, App. A backward, Functions.

The entry points (:func:`svtoolkit.torch.svdd_gate`, :func:`~svtoolkit.torch.gate_from_solver`,
:func:`~svtoolkit.torch.svdd_gate_from_gram`) are in :mod:`svtoolkit.torch.exact_gate`; they
build a :class:`_GateState` from an exact solution and apply one of the two Functions here.

This is the *exact maintained* path of docs/design.md (Forgetful Attention
(arXiv:2607.12204), §3.3 and App. A). The forward pass is the exact fp64 solver
:class:`svtoolkit.IncrementalSVDD`; the backward pass reuses the bordered KKT inverse
``R = M^{-1}`` that the solver already maintains, so it performs **no linear solve and no
factorization**: one matrix-vector product with ``R^T`` and a few rank-one assemblies.

Mathematics (sign convention of docs/design.md: ``g_i = 2 (K a)_i - K_ii + rho``). Within a
fixed partition (margin S, error E, reserve R) the free variables ``u = [rho; a_S]`` solve

.. math::

    M u = c, \quad M = \begin{bmatrix} 0 & 1^T \\ 1 & 2 K_{SS} \end{bmatrix}, \quad
    c = \begin{bmatrix} 1 - |E| C \\ \operatorname{diag}(K)_S - 2 C K_{SE} 1 \end{bmatrix},
    \quad \mathcal{R} = M^{-1},

while ``a_E = C`` and ``a_R = 0`` are constants. For upstream cotangents ``alpha_bar`` and
``rho_bar`` let ``u_bar = [rho_bar; alpha_bar_S]`` and ``w = R^T u_bar`` (margin block ``w_S``).
From ``dL = w^T dc - w^T dM u`` (eq. 5):

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

**Warm-up.** While ``n C < 1`` the problem is infeasible and nothing is certified: the gate
entry points raise; :class:`svtoolkit.torch.SVAttention` falls back to the ungated readout and
says so in its info (docs/design.md, degenerate cases).

**Non-symmetric K** (K-level entry point only). The K-level map is the solution of the KKT
equations as written, ``g_S(K) = 0`` and ``1^T a = 1`` with ``g = 2 K a - diag(K) + rho`` (rows of
K): on a symmetric K it is the QP optimum, and its derivative is exactly the unsymmetrised
matrix above, so ``torch.autograd.gradcheck`` can perturb single entries of K. The gradient on
the manifold of symmetric matrices is its symmetric part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

__all__ = ["rbf", "ExactGateFunction", "GramGateFunction"]


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
    It is a torch twin of :func:`svtoolkit.rbf_kernel` (same formula and summation, torch's
    ``exp``; equal to about 1 ulp, not bit-identical) because the backward and the readout
    need autograd through the kernel, which the Numba kernel does not have.
    """
    diff = a.unsqueeze(-2) - b.unsqueeze(-3)
    return torch.exp(-(diff * diff).sum(-1) / (sigma * sigma))



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
