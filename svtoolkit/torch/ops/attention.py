"""Causal softmax attention: full, sliding window, and StreamingLLM (attention sinks + window).

Visibility is defined on absolute token positions. Query at position t sees key position j iff::

    0 <= j <= t   and   (window is None  or  j >= t - window + 1  or  j < sinks)

so ``window=W`` gives the window [t-W+1, t] (W tokens, the current one included; the same
convention as fla's ``naive_parallel_attn``), and ``sinks=s`` adds the first s tokens
(StreamingLLM). The op carries a :class:`KVCache` between calls, pruned to what future queries
can still see, so a sequence split in pieces gives the same outputs as the whole, and stepping
one token at a time with a window keeps a constant-size cache (sinks + window - 1 tokens).

There is no positional encoding in the op. StreamingLLM's position shift (re-applying RoPE at
positions inside the cache) is therefore moot here: the layers use learned absolute positional
embeddings in the backbone, as in the SV-Attention paper's TinyLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._validation import check_int
from ._common import check_qkv, compute_dtype

__all__ = ["KVCache", "softmax_attention", "attend"]


@dataclass
class KVCache:
    """Keys and values retained for future queries.

    Attributes
    ----------
    keys : Tensor of shape (B, S, H, K)
    values : Tensor of shape (B, S, H, V)
    positions : LongTensor of shape (S,)
        Absolute position of each cached token, ascending (kept on the CPU: it is metadata).
    seen : int
        Number of tokens processed so far (the position of the next token).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    seen: int

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return self.keys.numel() * self.keys.element_size() + (
            self.values.numel() * self.values.element_size()
        )


def _visible(q_pos, k_pos, window, sinks):
    """Boolean mask [Tq, S] of the visibility rule (module docstring); negative k_pos = padding."""
    kp = k_pos[None, :]
    qp = q_pos[:, None]
    mask = (kp >= 0) & (kp <= qp)
    if window is not None:
        mask &= (kp > qp - window) | (kp < sinks)
    return mask


def _key_index_ranges(k_pos, first_q, last_q, window, sinks):
    """Index slices of the (ascending) key positions a block of queries can see."""
    hi = int(torch.searchsorted(k_pos, torch.tensor(last_q), right=True))
    first_valid = int(torch.searchsorted(k_pos, torch.tensor(0)))
    if window is None:
        return [slice(first_valid, hi)]
    lo = int(torch.searchsorted(k_pos, torch.tensor(max(first_q - window + 1, 0))))
    sink_end = min(int(torch.searchsorted(k_pos, torch.tensor(sinks))), lo)
    if sink_end <= first_valid:
        return [slice(lo, hi)]
    return [slice(first_valid, sink_end), slice(lo, hi)]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float,
    window: int | None,
    sinks: int,
    block_size: int,
) -> torch.Tensor:
    """Masked softmax attention by position, processed in blocks of ``block_size`` queries.

    Parameters
    ----------
    q : Tensor of shape (B, T, H, K)
    k : Tensor of shape (B, S, H, K)
    v : Tensor of shape (B, S, H, V)
    q_pos : LongTensor of shape (T,), ascending, on the CPU
    k_pos : LongTensor of shape (S,), ascending, on the CPU; negative entries are padding
    scale : float
    window, sinks, block_size : see :func:`softmax_attention`

    Returns
    -------
    Tensor of shape (B, T, H, V)
        Each block only gathers the keys it can see, so a window makes the cost O(T (W + block)).
    """
    outputs = []
    for start in range(0, q.shape[1], block_size):
        qp = q_pos[start : start + block_size]
        ranges = _key_index_ranges(k_pos, int(qp[0]), int(qp[-1]), window, sinks)
        kb = torch.cat([k[:, r] for r in ranges], dim=1)
        vb = torch.cat([v[:, r] for r in ranges], dim=1)
        kp = torch.cat([k_pos[r] for r in ranges])
        mask = _visible(qp, kp, window, sinks).to(q.device)  # [Tq, Sb]
        qb = q[:, start : start + block_size].transpose(1, 2)  # [B, H, Tq, K]
        scores = (qb @ kb.transpose(1, 2).transpose(-1, -2)) * scale  # [B, H, Tq, Sb]
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        outputs.append((weights @ vb.transpose(1, 2)).transpose(1, 2))  # [B, Tq, H, V]
    return torch.cat(outputs, dim=1)


def _check_cache(cache: KVCache, q: torch.Tensor, v: torch.Tensor) -> None:
    batch, _, heads, key_dim = q.shape
    if not isinstance(cache, KVCache):
        raise TypeError(f"initial_state must be a KVCache; got {type(cache).__name__}")
    expected_k = (batch, cache.positions.numel(), heads, key_dim)
    expected_v = (batch, cache.positions.numel(), heads, v.shape[-1])
    if tuple(cache.keys.shape) != expected_k or tuple(cache.values.shape) != expected_v:
        raise ValueError(
            f"initial_state does not match q/v: keys {tuple(cache.keys.shape)} (expected "
            f"{expected_k}), values {tuple(cache.values.shape)} (expected {expected_v})"
        )


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sinks: int = 0,
    block_size: int = 256,
    initial_state: KVCache | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, KVCache | None]:
    """Causal softmax attention with an optional sliding window and attention sinks.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    scale : float, optional
        Multiplies q.k; default ``K ** -0.5``.
    window : int, optional
        Sliding window W >= 1: the query at t sees [t-W+1, t]. None: all of [0, t].
    sinks : int, default 0
        Number of initial tokens always visible (StreamingLLM); needs ``window``.
    block_size : int, default 256
        Queries per block (memory/speed knob only; results do not depend on it).
    initial_state : KVCache, optional
        Cache from a previous call; the new tokens continue at position ``initial_state.seen``.
    output_final_state : bool, default False
        Return the cache pruned to the tokens future queries can see: everything without a
        window; the sinks plus the last W-1 tokens with one.

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    cache : KVCache or None

    Notes
    -----
    ``o_t = sum_{j in V(t)} softmax_j(scale q_t . k_j) v_j`` with V(t) the visible set in the
    module docstring. Reference: :func:`svtoolkit.torch.ops.naive.naive_softmax_attention`.
    """
    batch, length, heads, key_dim, value_dim = check_qkv(q, k, v)
    if window is not None:
        check_int(window, "window", min=1)
    check_int(sinks, "sinks", min=0)
    if sinks and window is None:
        raise ValueError("sinks only make sense with a window (StreamingLLM); pass window=")
    check_int(block_size, "block_size", min=1)
    dtype = compute_dtype(q, k, v)
    seen = 0
    keys, values = k.to(dtype), v.to(dtype)
    k_pos = torch.arange(length)
    if initial_state is not None:
        _check_cache(initial_state, q, v)
        seen = initial_state.seen
        keys = torch.cat([initial_state.keys.to(dtype), keys], dim=1)
        values = torch.cat([initial_state.values.to(dtype), values], dim=1)
        k_pos = torch.cat([initial_state.positions.cpu(), k_pos + seen])
    q_pos = torch.arange(length) + seen
    o = attend(
        q.to(dtype),
        keys,
        values,
        q_pos,
        k_pos,
        scale=key_dim**-0.5 if scale is None else float(scale),
        window=window,
        sinks=sinks,
        block_size=block_size,
    )
    cache = None
    if output_final_state:
        cache = _prune(keys, values, k_pos, seen + length, window, sinks)
    return o.to(q.dtype), cache


def _prune(keys, values, k_pos, seen, window, sinks) -> KVCache:
    """Keep what a future query (position >= seen) can see."""
    keep = k_pos >= 0
    if window is not None:
        keep &= (k_pos >= seen - window + 1) | (k_pos < sinks)
    index = keep.nonzero().flatten()
    device_index = index.to(keys.device)
    return KVCache(keys[:, device_index], values[:, device_index], k_pos[index], seen)
