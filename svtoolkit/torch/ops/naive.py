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
    "naive_decayed_linear_attention",
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


def naive_decayed_linear_attention(q, k, v, *, g, scale=None, initial_state=None):
    """S_t = a_t S_{t-1} + k_t v_t^T, a_t = exp(g_t); o_t = scale S_t^T q_t. Returns (o, S_T)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _zero_state(q, v, initial_state)
    outputs = []
    for t in range(q.shape[1]):
        state = g[:, t, :, None, None].exp() * state + _outer(k[:, t], v[:, t])
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
    """A <- lambda A + eta write(k, v), the three published rules, one token, one memory.

    memory [B, H, K, V]; key, value [B, H, K] / [B, H, V]; decay, rate [H].
    """
    if rule == "outer":
        write = _outer(key, value)
    elif rule == "delta":
        write = _outer(key, value - _read(key, memory))
    elif rule == "wedge":
        write = _outer(key, value) - _outer(value, key)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return decay[None, :, None, None] * memory + rate[None, :, None, None] * write


def _unit(x):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def _cosine_logits(x, slot_keys, temperature):
    """cos(x, slot key) / temperature for x [B, H, K], slot_keys [H, S, K] -> [B, H, S]."""
    return (_unit(x)[:, :, None, :] * _unit(slot_keys)[None]).sum(-1) / temperature


def _slot_read_weights(q_t, slot_keys, top_k, temperature):
    """Softmax over the top-k slot logits, 0 for the other slots: [B, H, S]."""
    logits = _cosine_logits(q_t, slot_keys, temperature)
    weights = torch.zeros_like(logits)
    for b in range(logits.shape[0]):
        for h in range(logits.shape[1]):
            chosen = logits[b, h].topk(top_k).indices
            weights[b, h, chosen] = logits[b, h, chosen].softmax(dim=-1)
    return weights


class _Memories:
    """The per-token memory of a Tensor Cache: one matrix per (timescale, slot), as lists."""

    def __init__(self, q, v, timescales, slots):
        batch, _, heads, key_dim = q.shape
        zero = q.new_zeros(batch, heads, key_dim, v.shape[-1])
        self.banks = [[zero for _ in range(slots)] for _ in range(timescales)]

    def write(self, key_raw, key, value, params, rule, slot_keys, temperature, frozen=None):
        """Write one token into the slot its raw key routes to, in every timescale.

        ``frozen`` (same layout as ``banks``) replaces the memory in the delta prediction.
        """
        slots = len(self.banks[0])
        route = None
        if slot_keys is not None:
            route = _cosine_logits(key_raw, slot_keys, temperature).argmax(dim=-1)  # [B, H]
        for ts, (decay, rate) in enumerate(params):
            for m in range(slots):
                memory = self.banks[ts][m]
                predict_from = memory if frozen is None else frozen[ts][m]
                if rule == "delta":
                    written = decay[None, :, None, None] * memory + rate[None, :, None, None] * (
                        _outer(key, value - _read(key, predict_from))
                    )
                else:
                    written = _tensor_cache_write(memory, key, value, decay, rate, rule)
                if route is None:
                    self.banks[ts][m] = written
                else:
                    mask = (route == m)[:, :, None, None]
                    self.banks[ts][m] = torch.where(mask, written, memory)

    def read(self, q_t, slot_keys, top_k, temperature, slow_weight):
        """sum over timescales and slots of w_ts * w_slot * q^T A: [B, H, V]."""
        slots = len(self.banks[0])
        if slot_keys is None:
            slot_w = q_t.new_ones(q_t.shape[0], q_t.shape[1], 1)
        else:
            slot_w = _slot_read_weights(q_t, slot_keys, top_k, temperature)
        out = 0
        for ts, row in enumerate(self.banks):
            ts_w = 1.0 if ts == 0 else slow_weight[None, :, None]
            for m in range(slots):
                out = out + ts_w * slot_w[:, :, m, None] * _read(q_t, row[m])
        return out

    def snapshot(self):
        return [list(row) for row in self.banks]

    def stacked(self):
        """(B, H, K, V) for one memory, else (B, H, M, K, V) with m = timescale * S + slot."""
        flat = [memory for row in self.banks for memory in row]
        return flat[0] if len(flat) == 1 else torch.stack(flat, dim=2)


def naive_tensor_cache_paths(
    q, k, v, *, window, log_decay, rate, rule="outer", scale=None, normalize_keys=True,
    normalize_queries=False, value_scale=1.0, train_writes="evicted", write_mode="token",
    delta_residual="exact", chunk_size=32, slot_keys=None, slot_top_k=1, slot_temperature=1.0,
    slow_log_decay=None, slow_rate=None, slow_weight=None,
):
    """Per-token Tensor Cache: returns (o_local, o_memory, memory_T).

    At step t: the token written is t-W if t >= W (``train_writes="evicted"``) or t itself
    (``"all"``); its raw key picks a slot (``argmax cos(k, slot key)``, when ``slot_keys``), and
    every timescale's memory of that slot gets ``A <- lambda A + eta write(k_hat, s v)``. Then
    o_local[t] = softmax over tokens max(0, t-W+1) .. t and o_memory[t] = sum of
    ``w q_t^T A`` over the memories (``q_t`` normalised when ``normalize_queries``).

    ``write_mode="chunk_mean"``: the writes of steps in chunk c = t // chunk_size are collected
    per slot, the reads of the chunk use the memory as it was at the chunk start, and after the
    chunk's last step each slot with writes gets one write of the means. With
    ``delta_residual="chunk_start"`` the delta residual uses the memory as it was at the start
    of the chunk of step t. memory_T has the layout of ``TensorCacheState.memory``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length = q.shape[1]
    params = [(log_decay.exp(), rate)]
    if slow_log_decay is not None:
        params.append((slow_log_decay.exp(), slow_rate))
    slots = 1 if slot_keys is None else slot_keys.shape[1]
    memories = _Memories(q, v, len(params), slots)
    frozen, pending = None, []
    write_args = dict(params=params, rule=rule, slot_keys=slot_keys, temperature=slot_temperature)
    local, reads = [], []
    for t in range(length):
        if t % chunk_size == 0 and delta_residual == "chunk_start":
            frozen = memories.snapshot()
        source = t - window if train_writes == "evicted" else t
        if source >= 0:
            key = _unit(k[:, source]) if normalize_keys else k[:, source]
            token = (k[:, source], key, value_scale * v[:, source])
            if write_mode == "chunk_mean":
                pending.append(token)
            else:
                memories.write(*token, frozen=frozen, **write_args)
        in_window = torch.arange(max(0, t - window + 1), t + 1, device=q.device)
        local.append(_softmax_over(q[:, t], k[:, in_window], v[:, in_window], scale))
        q_t = _unit(q[:, t]) if normalize_queries else q[:, t]
        reads.append(memories.read(q_t, slot_keys, slot_top_k, slot_temperature, slow_weight))
        if write_mode == "chunk_mean" and (t % chunk_size == chunk_size - 1 or t == length - 1):
            _write_chunk_means(memories, pending, write_args)
            pending = []
    return torch.stack(local, dim=1), torch.stack(reads, dim=1), memories.stacked()


def _write_chunk_means(memories, pending, write_args):
    """After a chunk: each slot gets one write of the means of the chunk's tokens routed to it.

    Means are per (batch row, head); a row with no token in the slot is left unchanged.
    """
    if not pending:
        return
    slot_keys, rule = write_args["slot_keys"], write_args["rule"]
    for m in range(len(memories.banks[0])):
        masks = []
        for raw, key, _ in pending:
            if slot_keys is None:
                masks.append(key.new_ones(key.shape[:2]))
            else:
                route = _cosine_logits(raw, slot_keys, write_args["temperature"]).argmax(dim=-1)
                masks.append((route == m).to(key.dtype))
        count = sum(masks)
        safe = count.clamp_min(1.0)[..., None]
        key_mean = sum(w[..., None] * key for w, (_, key, _) in zip(masks, pending)) / safe
        value_mean = sum(w[..., None] * val for w, (_, _, val) in zip(masks, pending)) / safe
        for ts, (decay, rate) in enumerate(write_args["params"]):
            memory = memories.banks[ts][m]
            written = _tensor_cache_write(memory, key_mean, value_mean, decay, rate, rule)
            memories.banks[ts][m] = torch.where((count > 0)[..., None, None], written, memory)


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
