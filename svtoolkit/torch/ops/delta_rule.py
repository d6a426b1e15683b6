"""DeltaNet, Gated DeltaNet and the decay-only corner: the (gated) delta rule in chunked form.

Per batch row and head, with the state S a K x V matrix, the gated delta rule is (Yang, Kautz &
Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025)::

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t

with a_t = exp(g_t), g_t <= 0, and the read after the write. Unrolled per token this is
"decay, then error against the decayed state, then write": ``S <- a S``,
``u = b (v - S^T k)``, ``S <- S + k u^T``. The corners of the (a, b) square:

* a_t = 1, delta write: DeltaNet (:func:`delta_rule`);
* a_t = 1, additive write ``S_t = S_{t-1} + k_t v_t^T``: linear attention
  (:func:`svtoolkit.torch.ops.linear_attention`);
* decay, additive write ``S_t = a_t S_{t-1} + k_t v_t^T``: the gated-linear-attention / Mamba-2
  form with a scalar decay per head and token (:func:`decayed_linear_attention`).

The chunked form is in :mod:`svtoolkit.torch.ops._scan`: a unit-lower-triangular solve per chunk
(the WY/UT transform), inclusive chunk-local cumulative log-decay, and exponentials of
non-positive numbers only.
"""

from __future__ import annotations

import torch

from ..._validation import check_int
from ._common import check_per_token, check_qkv, check_state, compute_dtype
from ._scan import chunk_scan

__all__ = ["decayed_linear_attention", "delta_rule", "gated_delta_rule"]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked (WY/UT transform with cumulative log-decay).

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
        Queries and keys (the layer L2-normalises keys; the op does not).
    v : Tensor of shape (B, T, H, V)
    g : Tensor of shape (B, T, H)
        Log-decay ``g_t = log a_t``; must be <= 0 and not NaN (checked: raises
        ``ValueError``). ``-inf`` is allowed: a_t = 0 forgets the state exactly.
    beta : Tensor of shape (B, T, H)
        Write strength b_t (usually in (0, 1); not restricted here).
    scale : float, optional
        Multiplies the read; default ``K ** -0.5``.
    chunk_size : int, default 64
        Tokens per chunk; any positive int.
    initial_state : Tensor of shape (B, H, K, V), optional
    output_final_state : bool, default False

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : Tensor of shape (B, H, K, V) or None
        In the compute dtype (float32 for fp32/bf16/fp16 inputs, float64 for fp64).

    Notes
    -----
    ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.
    Reference: :func:`svtoolkit.torch.ops.naive.naive_gated_delta_rule`. Gates are keyword-only
    on purpose (fla's recurrent and chunked references take them in different orders).
    """
    batch, length, heads, key_dim, value_dim = check_qkv(q, k, v)
    _check_log_decay(g, batch, length, heads)
    check_per_token("beta", beta, batch, length, heads)
    return _delta_scan(q, k, v, g, beta, scale, chunk_size, initial_state, output_final_state)


def _check_log_decay(g, batch, length, heads):
    check_per_token("g", g, batch, length, heads)
    if bool(g.isnan().any()):
        raise ValueError("g must not contain NaN (g = log a_t <= 0; -inf means a_t = 0)")
    if bool((g > 0).any()):
        raise ValueError(f"g must be <= 0 (g = log a_t); got max {g.max().item():.3g}")


def decayed_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention with a scalar decay per head and token (the decay-only corner).

    ``S_t = a_t S_{t-1} + k_t v_t^T``, ``a_t = exp(g_t)``, ``o_t = scale S_t^T q_t``: decay the
    past, then add the new pair at full strength (the gated-linear-attention / Mamba-2 form;
    Yang, Kautz & Hatamizadeh, ICLR 2025, the a-corner of the gated delta rule without the
    delta correction).

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    g : Tensor of shape (B, T, H)
        Log-decay ``g_t = log a_t``; must be <= 0 and not NaN (``ValueError``); ``-inf``
        resets the state exactly.
    scale : float, optional
        Multiplies the read; default ``K ** -0.5``.
    chunk_size : int, default 64
    initial_state : Tensor of shape (B, H, K, V), optional
    output_final_state : bool, default False

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : Tensor of shape (B, H, K, V) or None
        In the compute dtype.

    Notes
    -----
    With ``g = 0`` this is :func:`svtoolkit.torch.ops.linear_attention`. Reference:
    :func:`svtoolkit.torch.ops.naive.naive_decayed_linear_attention`.
    """
    batch, length, heads, _, _ = check_qkv(q, k, v)
    _check_log_decay(g, batch, length, heads)
    return _delta_scan(q, k, v, g, None, scale, chunk_size, initial_state, output_final_state)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet's delta rule, chunked (WY/UT transform).

    Same as :func:`gated_delta_rule` with no decay (a_t = 1):
    ``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    beta : Tensor of shape (B, T, H)
    scale : float, optional
        Default ``K ** -0.5``.
    chunk_size : int, default 64
    initial_state : Tensor of shape (B, H, K, V), optional
    output_final_state : bool, default False

    Returns
    -------
    o : Tensor of shape (B, T, H, V)
    final_state : Tensor of shape (B, H, K, V) or None

    Notes
    -----
    Reference: :func:`svtoolkit.torch.ops.naive.naive_delta_rule`.
    """
    batch, length, heads, _, _ = check_qkv(q, k, v)
    check_per_token("beta", beta, batch, length, heads)
    return _delta_scan(q, k, v, None, beta, scale, chunk_size, initial_state, output_final_state)


def _delta_scan(q, k, v, g, beta, scale, chunk_size, initial_state, output_final_state):
    batch, _, heads, key_dim = q.shape
    check_int(chunk_size, "chunk_size", min=1)
    if initial_state is not None:
        check_state("initial_state", initial_state, (batch, heads, key_dim, v.shape[-1]))
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    o, state = chunk_scan(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        g=None if g is None else g.to(dtype),
        beta=None if beta is None else beta.to(dtype),
        scale=key_dim**-0.5 if scale is None else float(scale),
        chunk_size=chunk_size,
        initial_state=None if initial_state is None else initial_state.to(dtype),
        output_final_state=output_final_state,
    )
    return o.to(q.dtype), state
