"""Slow, obviously-correct per-token references for every op in :mod:`svtoolkit.torch.ops`.

Each function is a plain Python loop over tokens that writes the paper's equation literally:
no chunking, no cumulative sums, no masks built by formula where a list of indices will do.
They compute in the promotion of their inputs (use float64 in tests), are differentiable (no
in-place updates), and take the same ``[B, T, H, D]`` layout and keyword gates as the fast ops.
They handle whole sequences only (no carried state besides an initial matrix state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "naive_softmax_attention",
    "naive_linear_attention",
    "naive_delta_rule",
    "naive_gated_delta_rule",
    "naive_tensor_cache_paths",
    "naive_infini_attention",
]


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched outer product: [B, H, K] x [B, H, V] -> [B, H, K, V]."""
    return a[..., :, None] * b[..., None, :]


def _read(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x^T S: [B, H, K] x [B, H, K, V] -> [B, H, V]."""
    return (x[..., None, :] @ state)[..., 0, :]


def _zero_state(q, v, initial_state):
    if initial_state is not None:
        return initial_state
    batch, _, heads, key_dim = q.shape
    return q.new_zeros(batch, heads, key_dim, v.shape[-1])


def _softmax_over(q_t, keys, values, scale):
    """softmax_j(scale q_t . k_j) v_j over the listed keys; q_t [B, H, K], keys [B, J, H, K]."""
    scores = (keys.transpose(1, 2) @ q_t[..., None])[..., 0] * scale  # [B, H, J]
    return (scores.softmax(dim=-1)[..., None, :] @ values.transpose(1, 2))[..., 0, :]


def naive_softmax_attention(q, k, v, *, scale=None, window=None, sinks=0):
    """Per-query causal softmax attention over an explicit list of visible positions.

    Query t sees j <= t with j >= t - window + 1 or j < sinks (no window: all j <= t).
    Shapes as :func:`svtoolkit.torch.ops.softmax_attention`; returns o of shape (B, T, H, V).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outputs = []
    for t in range(q.shape[1]):
        visible = [j for j in range(t + 1) if window is None or j >= t - window + 1 or j < sinks]
        index = torch.tensor(visible, device=q.device)
        outputs.append(_softmax_over(q[:, t], k[:, index], v[:, index], scale))
    return torch.stack(outputs, dim=1)


def naive_linear_attention(q, k, v, *, scale=None, initial_state=None):
    """S_t = S_{t-1} + k_t v_t^T; o_t = scale S_t^T q_t. Returns (o, S_T)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _zero_state(q, v, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        state = state + _outer(k[:, t], v[:, t])
        outputs.append(scale * _read(q[:, t], state))
    return torch.stack(outputs, dim=1), state


def naive_delta_rule(q, k, v, *, beta, scale=None, initial_state=None):
    """S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T; o_t = scale S_t^T q_t.

    Returns (o, S_T).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _zero_state(q, v, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        k_t, b_t = k[:, t], beta[:, t, :, None, None]
        state = state - b_t * _outer(k_t, _read(k_t, state)) + b_t * _outer(k_t, v[:, t])
        outputs.append(scale * _read(q[:, t], state))
    return torch.stack(outputs, dim=1), state


def naive_gated_delta_rule(q, k, v, *, g, beta, scale=None, initial_state=None):
    """S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, a_t = exp(g_t); o_t = scale S_t^T q_t.

    Returns (o, S_T). The equation is applied as written, one token at a time.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _zero_state(q, v, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        k_t, a_t, b_t = k[:, t], g[:, t, :, None, None].exp(), beta[:, t, :, None, None]
        householder = state - b_t * _outer(k_t, _read(k_t, state))
        state = a_t * householder + b_t * _outer(k_t, v[:, t])
        outputs.append(scale * _read(q[:, t], state))
    return torch.stack(outputs, dim=1), state


def _tensor_cache_write(memory, key, value, decay, rate, rule):
    """A <- lambda A + eta write(k, v), the three published rules, one token."""
    if rule == "outer":
        write = _outer(key, value)
    elif rule == "delta":
        write = _outer(key, value - _read(key, memory))
    elif rule == "wedge":
        write = _outer(key, value) - _outer(value, key)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return decay[None, :, None, None] * memory + rate[None, :, None, None] * write


def naive_tensor_cache_paths(
    q, k, v, *, window, log_decay, rate, rule="outer", scale=None, normalize_keys=True
):
    """Per-token Tensor Cache: returns (o_local, o_memory, memory_T).

    At step t: if t >= W, token t-W leaves the window and is written into the memory; then
    o_local[t] = softmax over tokens max(0, t-W+1) .. t and o_memory[t] = q_t^T A.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    decay = log_decay.exp()
    memory = _zero_state(q, v, None)
    local, reads = [], []
    for t in range(q.shape[1]):
        evicted = t - window
        if evicted >= 0:
            key = k[:, evicted]
            if normalize_keys:
                key = key / key.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            memory = _tensor_cache_write(memory, key, v[:, evicted], decay, rate, rule)
        in_window = torch.arange(max(0, t - window + 1), t + 1, device=q.device)
        local.append(_softmax_over(q[:, t], k[:, in_window], v[:, in_window], scale))
        reads.append(_read(q[:, t], memory))
    return torch.stack(local, dim=1), torch.stack(reads, dim=1), memory


def _infini_absorb(memory, normalizer, keys, values, rule, eps):
    """Write one complete segment; every token's delta uses the memory before the segment."""
    update = torch.zeros_like(memory)
    for j in range(keys.shape[1]):
        sk = F.elu(keys[:, j]) + 1.0
        value = values[:, j]
        if rule == "delta":
            denominator = (sk * normalizer).sum(-1, keepdim=True).clamp_min(eps)
            value = value - _read(sk, memory) / denominator
        update = update + _outer(sk, value)
    normalizer = normalizer + (F.elu(keys) + 1.0).sum(dim=1)
    return memory + update, normalizer


def naive_infini_attention(q, k, v, *, segment, gate, rule="linear", scale=None, eps=1e-6):
    """Per-token Infini-attention: returns (o, memory_T, normalizer_T).

    At step t (segment s = t // N): when t starts a new segment, absorb the previous one; then
    o_t = gate * sigma(q_t)^T M / max(sigma(q_t) . z, eps) + (1 - gate) * softmax over
    tokens sN .. t. The final memory has absorbed every complete segment.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, length, heads, key_dim = q.shape
    memory = _zero_state(q, v, None)
    normalizer = q.new_zeros(batch, heads, key_dim)
    outputs = []
    for t in range(length):
        start = (t // segment) * segment
        if t == start and t > 0:
            previous = slice(t - segment, t)
            memory, normalizer = _infini_absorb(
                memory, normalizer, k[:, previous], v[:, previous], rule, eps
            )
        in_segment = torch.arange(start, t + 1, device=q.device)
        local = _softmax_over(q[:, t], k[:, in_segment], v[:, in_segment], scale)
        sq = F.elu(q[:, t]) + 1.0
        read = _read(sq, memory) / (sq * normalizer).sum(-1, keepdim=True).clamp_min(eps)
        weight = (gate if gate.ndim == 1 else gate[:, t])[..., None]
        outputs.append(weight * read + (1 - weight) * local)
    if length % segment == 0:
        last = slice(length - segment, length)
        memory, normalizer = _infini_absorb(memory, normalizer, k[:, last], v[:, last], rule, eps)
    return torch.stack(outputs, dim=1), memory, normalizer
