"""Causal linear attention (Katharopoulos et al., 2020) as a chunked scan.

Per batch row and head, with the state S a K x V matrix::

    S_t = S_{t-1} + k_t v_t^T,        o_t = scale * S_t^T q_t        (read after the write)

so ``o_t = scale * sum_{j <= t} (q_t . k_j) v_j``. Feature maps and the normaliser belong to the
layer (:class:`svtoolkit.torch.layers.LinearAttention`); the op is the plain recurrence.
"""

from __future__ import annotations

import torch

from ..._validation import check_int
from ._common import check_qkv, check_state, compute_dtype
from ._scan import chunk_scan

__all__ = ["linear_attention"]


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Unnormalised causal linear attention, chunked.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    scale : float, optional
        Multiplies the read; default ``K ** -0.5``.
    chunk_size : int, default 64
        Tokens per chunk (any positive int; the result does not depend on it beyond rounding).
    initial_state : Tensor of shape (B, H, K, V), optional
        State carried from a previous call (zero when omitted).
    output_final_state : bool, default False
        Return the state after the last token.

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : Tensor of shape (B, H, K, V) or None
        In the compute dtype (float32 or float64).

    Notes
    -----
    ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``. Reference:
    :func:`svtoolkit.torch.ops.naive.naive_linear_attention`.
    """
    batch, _, heads, key_dim, value_dim = check_qkv(q, k, v)
    check_int(chunk_size, "chunk_size", min=1)
    if initial_state is not None:
        check_state("initial_state", initial_state, (batch, heads, key_dim, value_dim))
    dtype = compute_dtype(q, k, v, initial_state)
    o, state = chunk_scan(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        g=None,
        beta=None,
        scale=key_dim**-0.5 if scale is None else float(scale),
        chunk_size=chunk_size,
        initial_state=None if initial_state is None else initial_state.to(dtype),
        output_final_state=output_final_state,
    )
    return o.to(q.dtype), state
