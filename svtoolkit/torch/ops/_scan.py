"""The chunked scan shared by linear attention, DeltaNet, Gated DeltaNet and Tensor Cache.

One recurrence covers them all (per batch row and head; S is a K x V matrix)::

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T          (with the delta correction)
    S_t = a_t S_{t-1} + k_t v_t^T                                    (without it)
    o_t = scale * S_t^T q_t                                          (read after the write)

with a_t = exp(g_t), g_t <= 0. The chunked form (Yang et al., "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", NeurIPS 2024, App. B; the gated variant
of Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR
2025) splits T into chunks of C tokens. In a chunk, with gamma_i = g_1 + ... + g_i the
inclusive chunk-local cumulative log-decay:

* the intra-chunk delta correction is a unit-lower-triangular solve (the WY/UT transform)::

      (I + L) U = diag(b) V,   (I + L) W = diag(b exp(gamma)) K,
      L_ij = b_i (k_i . k_j) exp(gamma_i - gamma_j)   for i > j, else 0;

* with S the chunk-start state, the corrected values are ``U_eff = U - W S`` and::

      O      = scale [ diag(exp(gamma)) Q S + (Q K^T * exp(gamma_i - gamma_j) * [i >= j]) U_eff ]
      S_next = exp(gamma_C) S + (K * exp(gamma_C - gamma))^T U_eff.

Every exponential is of a non-positive number: gamma_i, gamma_i - gamma_j for i >= j (the upper
triangle is masked to 0 *before* exponentiating) and gamma_C - gamma_i. Nothing is divided by a
cumulative decay, so strong decay cannot overflow. Without the delta correction U_eff = V.

A decay of exactly 0 (``g_t = -inf``, or any g_t whose ``exp`` is 0 in the compute dtype) is a
*reset*: it is left out of the cumulative sums (which would otherwise meet ``-inf - (-inf)``)
and every factor whose product of decays spans a reset is set to 0 instead, so the result is
exact and finite.

``decayed_beta=True`` is the variant ``S_t = a_t S_{t-1} + c_t k_t (v_t - S_{t-1}^T k_t)^T``
(correction against the pre-decay state, write not decayed; c_t passed as ``beta``). It is the
gated rule with ``b_t = c_t / a_t`` and values ``a_t v_t`` but needs no division by a_t, so
a_t = 0 is allowed: in the UT transform ``b_i exp(gamma_i - gamma_j)`` becomes
``c_i exp(gamma_{i-1} - gamma_j)``, ``b_i exp(gamma_i)`` becomes ``c_i exp(gamma_{i-1})`` and
``diag(b) V`` becomes ``diag(c) V``.

``frozen_residual=True`` is the chunk-start residual approximation of that variant (Tensor
Cache, §5, after Beck et al., "xLSTM: Extended Long Short-Term Memory", NeurIPS 2024)::

    S_t = a_t S_{t-1} + c_t k_t (v_t - S_s^T k_t)^T,     S_s = the state at the chunk start

Every token's residual is taken against the same S_s, so there is no intra-chunk coupling:
L = 0, ``U = diag(c) V`` and ``W = diag(c) K`` (no decay on W: S_s is not decayed), and
``U_eff = U - W S_s`` as above. The result depends on the chunk size (C = 1 is exact).
"""

from __future__ import annotations

import math

import torch

from ._common import pad_time

__all__ = ["chunk_scan"]


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """``[B, T, H, *rest]`` -> ``[B, H, N, C, *rest]`` after zero-padding T to N*C."""
    x = pad_time(x, n_chunks * chunk)
    batch, _, heads = x.shape[:3]
    x = x.transpose(1, 2)
    return x.reshape(batch, heads, n_chunks, chunk, *x.shape[3:])


def _decay_terms(g_chunks: torch.Tensor, causal: torch.Tensor):
    """Decay factors of one chunk from the inclusive chunk-local cumsum of g (all exp args <= 0).

    Returns ``(pair, to_start, to_end, total)`` with shapes ``[..., C, C]``, ``[..., C, 1]``,
    ``[..., C, 1]`` and ``[...]``: exp(gamma_i - gamma_j) masked to i >= j, exp(gamma_i),
    exp(gamma_C - gamma_i) and exp(gamma_C). A reset (decay exactly 0) is summed as 0 and
    counted instead; a factor spanning a reset is 0.
    """
    reset = g_chunks.exp() == 0
    gamma = torch.where(reset, torch.zeros_like(g_chunks), g_chunks).cumsum(dim=-1)
    resets = reset.to(torch.int64).cumsum(dim=-1)  # resets in tokens 1..i of the chunk
    diff = gamma[..., :, None] - gamma[..., None, :]
    keep = causal & (resets[..., :, None] == resets[..., None, :])
    pair = torch.where(keep, diff, torch.zeros_like(diff)).exp() * keep
    to_start = (gamma.exp() * (resets == 0))[..., None]
    to_end = ((gamma[..., -1:] - gamma).exp() * (resets[..., -1:] == resets))[..., None]
    total = gamma[..., -1].exp() * (resets[..., -1] == 0)
    return pair, to_start, to_end, total


def chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    decayed_beta: bool = False,
    frozen_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the chunked recurrence on validated inputs already cast to one compute dtype.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    g : Tensor of shape (B, T, H) or None
        Log-decay per token (<= 0, ``-inf`` allowed: a_t = 0); None means no decay (a_t = 1).
    beta : Tensor of shape (B, T, H) or None
        Delta-rule write strength; None means the plain additive write ``S += k v^T``.
    scale : float
        Multiplies the read ``S_t^T q_t``.
    chunk_size : int
        Chunk length C; the effective chunk is ``min(C, T)``.
    initial_state : Tensor of shape (B, H, K, V) or None
    output_final_state : bool
    decayed_beta : bool, default False
        ``beta`` is c_t of ``S_t = a_t S_{t-1} + c_t k_t (v_t - S_{t-1}^T k_t)^T`` (module
        docstring) instead of b_t of the gated delta rule.
    frozen_residual : bool, default False
        With ``decayed_beta``: the residual of every token of a chunk is taken against the
        chunk-start state (module docstring; an approximation that depends on ``chunk_size``).

    Returns
    -------
    o : Tensor of shape (B, T, H, V)
    final_state : Tensor of shape (B, H, K, V) or None
    """
    batch, length, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    chunk = min(chunk_size, length)
    n_chunks = math.ceil(length / chunk)
    qc = _to_chunks(q, n_chunks, chunk) * scale  # [B, H, N, C, K]
    kc = _to_chunks(k, n_chunks, chunk)  # [B, H, N, C, K]
    vc = _to_chunks(v, n_chunks, chunk)  # [B, H, N, C, V]

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if g is None:
        pair = causal.to(q.dtype)
        to_start = to_end = total = None
    else:
        # padded steps have g = 0: no decay, and k = 0: no write, so the state is unaffected
        pair, to_start, to_end, total = _decay_terms(_to_chunks(g, n_chunks, chunk), causal)

    if beta is None:
        values, wy_keys = vc, None
    elif frozen_residual:
        beta_c = _to_chunks(beta, n_chunks, chunk)[..., None]
        values, wy_keys = vc * beta_c, kc * beta_c
    else:
        beta_c = _to_chunks(beta, n_chunks, chunk)
        values, wy_keys = _wy_transform(kc, vc, beta_c, pair, to_start, decayed_beta)

    scores = (qc @ kc.transpose(-1, -2)) * pair  # [B, H, N, C, C], causal incl. the diagonal
    state = initial_state
    if state is None:
        state = q.new_zeros(batch, heads, key_dim, value_dim)
    outputs = []
    for n in range(n_chunks):
        u = values[:, :, n]
        if wy_keys is not None:
            u = u - wy_keys[:, :, n] @ state  # U_eff = U - W S
        q_n = qc[:, :, n] if to_start is None else qc[:, :, n] * to_start[:, :, n]
        outputs.append(q_n @ state + scores[:, :, n] @ u)
        k_n = kc[:, :, n] if to_end is None else kc[:, :, n] * to_end[:, :, n]
        carried = state if total is None else total[:, :, n, None, None] * state
        state = carried + k_n.transpose(-1, -2) @ u
    o = torch.stack(outputs, dim=2).reshape(batch, heads, n_chunks * chunk, value_dim)
    o = o[:, :, :length].transpose(1, 2)
    return o, (state if output_final_state else None)


def _shift_rows(x, fill):
    """Row i of the result is row i - 1 of x (row 0 is ``fill``): exclusive from inclusive."""
    return torch.cat([torch.full_like(x[..., :1, :], fill), x[..., :-1, :]], dim=-2)


def _wy_transform(kc, vc, beta_c, pair, to_start, decayed_beta):
    """UT transform: solve (I + L) [U, W] = [diag(b) V, diag(b exp(gamma)) K] per chunk.

    With ``decayed_beta`` the decays of L and of the key right-hand side stop one token
    earlier (gamma_{i-1}, module docstring).
    """
    chunk = kc.shape[-2]
    if decayed_beta:
        pair = _shift_rows(pair, 0.0)
        to_start = None if to_start is None else _shift_rows(to_start, 1.0)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=kc.device).tril(-1)
    gram = (kc @ kc.transpose(-1, -2)) * pair * beta_c[..., :, None]
    lower = torch.eye(chunk, dtype=kc.dtype, device=kc.device) + gram * strict
    rhs_keys = kc * beta_c[..., None]
    if to_start is not None:
        rhs_keys = rhs_keys * to_start
    rhs = torch.cat([vc * beta_c[..., None], rhs_keys], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    value_dim = vc.shape[-1]
    return solved[..., :value_dim], solved[..., value_dim:]
