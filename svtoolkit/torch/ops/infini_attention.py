"""Infini-attention (Munkhdalai et al., 2024, arXiv 2404.07143): segment softmax + memory.

The sequence is cut into segments of N tokens at absolute positions 0, N, 2N, ... For a query
t in segment s (per batch row and head; sigma(x) = ELU(x) + 1)::

    A_dot(t) = causal softmax attention over the tokens of segment s up to t
    A_mem(t) = sigma(q_t)^T M_{s-1} / max(sigma(q_t) . z_{s-1}, eps)       (previous segments only)
    o_t      = gate * A_mem(t) + (1 - gate) * A_dot(t)

and when segment s is complete the memory absorbs it (K_s, V_s its keys and values):

    linear:  M_s = M_{s-1} + sigma(K_s)^T V_s
    delta:   M_s = M_{s-1} + sigma(K_s)^T (V_s - sigma(K_s) M_{s-1} / (sigma(K_s) z_{s-1}))
    both:    z_s = z_{s-1} + sum_t sigma(k_t)

The memory is read before the segment is written (no leak of the current segment into its own
retrieval) and the local softmax is causal. The eps floor (the paper divides without one) makes
the first segment read exactly 0, since M_0 = 0 and z_0 = 0. The state carries M, z and the keys
and values of the unfinished segment, so split sequences and single steps equal the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..._validation import check_int, check_option, check_positive
from ._common import check_qkv, check_state, compute_dtype, gate_weight

__all__ = ["INFINI_RULES", "InfiniState", "infini_attention"]

#: Memory update rules of :func:`infini_attention` (its ``rule``).
INFINI_RULES = ("linear", "delta")
INFINI_EPS = 1e-6


@dataclass
class InfiniState:
    """Streaming state of Infini-attention (constant size).

    Attributes
    ----------
    memory : Tensor of shape (B, H, K, V)
        M after the last complete segment.
    normalizer : Tensor of shape (B, H, K)
        z after the last complete segment.
    keys : Tensor of shape (B, N, H, K)
        Keys of the unfinished segment in slots ``0 .. seen % N - 1`` (rest zero).
    values : Tensor of shape (B, N, H, V)
    seen : int
        Tokens processed so far.
    """

    memory: torch.Tensor
    normalizer: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    seen: int

    @classmethod
    def empty(cls, batch, segment, heads, key_dim, value_dim, *, dtype=torch.float32, device=None):
        """A state before any token."""
        check_int(segment, "segment", min=1)
        return cls(
            memory=torch.zeros(batch, heads, key_dim, value_dim, dtype=dtype, device=device),
            normalizer=torch.zeros(batch, heads, key_dim, dtype=dtype, device=device),
            keys=torch.zeros(batch, segment, heads, key_dim, dtype=dtype, device=device),
            values=torch.zeros(batch, segment, heads, value_dim, dtype=dtype, device=device),
            seen=0,
        )

    def nbytes(self) -> int:
        """Bytes held by the state (constant in the sequence length)."""
        tensors = (self.memory, self.normalizer, self.keys, self.values)
        return sum(x.numel() * x.element_size() for x in tensors)


def _feature(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


def _check_state(state, batch, segment, heads, key_dim, value_dim):
    if not isinstance(state, InfiniState):
        raise TypeError(f"initial_state must be an InfiniState; got {type(state).__name__}")
    check_state("initial_state.memory", state.memory, (batch, heads, key_dim, value_dim))
    check_state("initial_state.normalizer", state.normalizer, (batch, heads, key_dim))
    check_state("initial_state.keys", state.keys, (batch, segment, heads, key_dim))
    check_state("initial_state.values", state.values, (batch, segment, heads, value_dim))


def _segment_softmax(q, k, v, scale):
    """Causal softmax inside each segment; inputs [B, H, S, N, D]."""
    size = q.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


def _absorb(memory, normalizer, sk, v, rule, eps):
    """Write one complete segment (sk = sigma(K) [B, H, N, K], v [B, H, N, V])."""
    if rule == "delta":
        retrieved = (sk @ memory) / (sk @ normalizer[..., None]).clamp_min(eps)
        v = v - retrieved
    return memory + sk.transpose(-1, -2) @ v, normalizer + sk.sum(dim=-2)


def infini_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    segment: int,
    gate: torch.Tensor,
    rule: str = "linear",
    scale: float | None = None,
    eps: float = INFINI_EPS,
    initial_state: InfiniState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, InfiniState | None]:
    """Infini-attention, segment-parallel form.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    segment : int
        Segment length N.
    gate : Tensor of shape (H,) or (B, T, H)
        Weight of the memory path, in [0, 1] (the layer passes ``sigmoid(beta)``).
    rule : {"linear", "delta"}, default "linear"
    scale : float, optional
        Softmax scale of the local path; default ``K ** -0.5``.
    eps : float, default 1e-6
        Floor of the memory-read denominator; finite and > 0 (checked: ``eps = 0`` would read
        an empty memory as 0 / 0).
    initial_state : InfiniState, optional
    output_final_state : bool, default False

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : InfiniState or None

    Notes
    -----
    Equations in the module docstring. Reference:
    :func:`svtoolkit.torch.ops.naive.naive_infini_attention`.
    """
    batch, length, heads, key_dim, value_dim = check_qkv(q, k, v)
    check_int(segment, "segment", min=1)
    eps = check_positive(eps, "eps")
    check_option(rule, "rule", INFINI_RULES)
    weight = gate_weight(gate, batch, length, heads)
    if initial_state is None:
        initial_state = InfiniState.empty(
            batch, segment, heads, key_dim, value_dim, dtype=q.dtype, device=q.device
        )
    _check_state(initial_state, batch, segment, heads, key_dim, value_dim)
    dtype = compute_dtype(q, k, v, gate, initial_state.memory)
    scale = key_dim**-0.5 if scale is None else float(scale)

    # extended sequence starts at the unfinished segment's first token (a segment boundary)
    buffered = initial_state.seen % segment
    ext_q = torch.cat([q.new_zeros(batch, buffered, heads, key_dim).to(dtype), q.to(dtype)], dim=1)
    ext_k = torch.cat([initial_state.keys[:, :buffered].to(dtype), k.to(dtype)], dim=1)
    ext_v = torch.cat([initial_state.values[:, :buffered].to(dtype), v.to(dtype)], dim=1)
    ext_len = buffered + length
    n_segments = -(-ext_len // segment)
    qs, ks, vs = (_to_segments(x, n_segments, segment) for x in (ext_q, ext_k, ext_v))

    local = _segment_softmax(qs, ks, vs, scale)  # [B, H, S, N, V]
    sq, sk = _feature(qs), _feature(ks)
    memory = initial_state.memory.to(dtype)
    normalizer = initial_state.normalizer.to(dtype)
    reads = []
    for s in range(n_segments):
        numerator = sq[:, :, s] @ memory
        denominator = (sq[:, :, s] @ normalizer[..., None]).clamp_min(eps)
        reads.append(numerator / denominator)
        if (s + 1) * segment <= ext_len:  # complete segment: absorb it
            memory, normalizer = _absorb(memory, normalizer, sk[:, :, s], vs[:, :, s], rule, eps)
    read = _from_segments(torch.stack(reads, dim=2), ext_len)[:, buffered:]
    local = _from_segments(local, ext_len)[:, buffered:]
    weight = weight.to(dtype)
    o = weight * read + (1 - weight) * local

    final_state = None
    if output_final_state:
        tail = ext_len % segment
        start = ext_len - tail
        keys = torch.zeros(batch, segment, heads, key_dim, dtype=dtype, device=q.device)
        values = torch.zeros(batch, segment, heads, value_dim, dtype=dtype, device=q.device)
        keys = torch.cat([ext_k[:, start:], keys[:, tail:]], dim=1)
        values = torch.cat([ext_v[:, start:], values[:, tail:]], dim=1)
        final_state = InfiniState(memory, normalizer, keys, values, initial_state.seen + length)
    return o.to(q.dtype), final_state


def _to_segments(x, n_segments, segment):
    """[B, L, H, D] -> [B, H, S, N, D], zero-padding the tail segment."""
    batch, length, heads, dim = x.shape
    pad = n_segments * segment - length
    if pad:
        x = torch.cat([x, x.new_zeros(batch, pad, heads, dim)], dim=1)
    return x.transpose(1, 2).reshape(batch, heads, n_segments, segment, dim)


def _from_segments(x, length):
    """[B, H, S, N, D] -> [B, L, H, D]."""
    batch, heads, n_segments, segment, dim = x.shape
    return x.reshape(batch, heads, n_segments * segment, dim)[:, :, :length].transpose(1, 2)
