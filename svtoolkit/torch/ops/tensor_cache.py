"""Tensor Cache (004_a46bfd66cfce050d.txt): window softmax (L1) + eviction-fed fast weights (L2).

Exact semantics (one statement, used by every code path here)::

    query t sees the window [t-W+1, t] through exact softmax (L1), and
    a memory A_t holding exactly the tokens <= t-W (L2), read as r_t = q_t^T A_t;
    o_t = L1_t + gate * r_t.

So every token j <= t is visible to exactly one path. The memory is the recurrence

    A <- lambda A + eta * write(k_hat, v)        (k_hat = k / ||k|| when normalize_keys)

    outer:  write = k_hat v^T
    delta:  write = k_hat (v - A^T k_hat)^T      (prediction from the pre-decay A, as published)
    wedge:  write = k_hat v^T - v k_hat^T        (needs K == V)

applied once per *evicted* token: at step t the token t-W leaves the window and is written
(nothing is written, and nothing decays, while t < W). Read after write, so r_t includes t-W.

Three code paths give the same outputs:

* :func:`tensor_cache` / :func:`tensor_cache_paths` -- the parallel training form. The memory is
  the chunked scan of :mod:`._scan` run on the key/value stream shifted right by W; every rule
  maps onto that scan exactly (no chunk-start approximation for delta):

  - outer: decay log(lambda), values eta v, no delta correction;
  - wedge: two additive streams, keys (k_hat, v) and values (eta v, -eta k_hat), one decay;
  - delta: the scan's ``decayed_beta`` variant ``A <- lambda A + eta k (v - A^T k)^T``
    directly (the gated delta rule with a = lambda, b = eta / lambda and values lambda v,
    written without dividing by lambda, so lambda may underflow to 0).

* :func:`tensor_cache_step` -- streaming: a ring buffer of W slots (token p in slot p % W) and the
  D x D memory; constant state; the evicted pair is written *before* the read.
* :func:`svtoolkit.torch.ops.naive.naive_tensor_cache_paths` -- the per-token reference.

Decay is handled in log space in fp32 or wider: ``log_decay`` is log(lambda) per head, the scan
exponentiates only non-positive cumulative sums (never lambda ** n in low precision).
``log_decay = -inf`` (lambda = 0: the memory keeps only the last write) is allowed, and so is a
log_decay whose exp underflows; every path then agrees with the per-token reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import (
    check_per_head,
    check_positive_int,
    check_qkv,
    check_state,
    compute_dtype,
    gate_weight,
    l2_normalize,
)
from ._scan import chunk_scan
from .attention import attend

__all__ = [
    "RULES",
    "TensorCacheState",
    "tensor_cache",
    "tensor_cache_paths",
    "tensor_cache_step",
]

RULES = ("outer", "delta", "wedge")


@dataclass
class TensorCacheState:
    """Constant-size streaming state of a Tensor Cache.

    Attributes
    ----------
    keys : Tensor of shape (B, W, H, K)
        Ring buffer of raw keys; the token at position p lives in slot ``p % W``.
    values : Tensor of shape (B, W, H, V)
    memory : Tensor of shape (B, H, K, V)
        Fast-weight matrix A holding the evicted tokens (positions <= seen - 1 - W).
    seen : int
        Tokens processed so far. Slots not yet filled (``seen < W``) are zero.
    """

    keys: torch.Tensor
    values: torch.Tensor
    memory: torch.Tensor
    seen: int

    @classmethod
    def empty(
        cls,
        batch: int,
        window: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> TensorCacheState:
        """A state before any token: empty ring, zero memory."""
        check_positive_int("window", window)
        return cls(
            keys=torch.zeros(batch, window, heads, key_dim, dtype=dtype, device=device),
            values=torch.zeros(batch, window, heads, value_dim, dtype=dtype, device=device),
            memory=torch.zeros(batch, heads, key_dim, value_dim, dtype=dtype, device=device),
            seen=0,
        )

    @property
    def window(self) -> int:
        return self.keys.shape[1]

    def nbytes(self) -> int:
        """Bytes held by the ring buffer and the memory (constant in the sequence length)."""
        return sum(x.numel() * x.element_size() for x in (self.keys, self.values, self.memory))

    def chronological(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ring contents oldest first, with positions ``seen - W + i`` (negative = empty slot)."""
        shift = -(self.seen % self.window)
        positions = torch.arange(self.window) + (self.seen - self.window)
        return self.keys.roll(shift, dims=1), self.values.roll(shift, dims=1), positions


def _check_rule(rule: str, key_dim: int, value_dim: int) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    if rule == "wedge" and key_dim != value_dim:
        raise ValueError(f"rule='wedge' needs K == V; got K={key_dim}, V={value_dim}")


def _check_decay_rate(log_decay: torch.Tensor, rate: torch.Tensor, heads: int) -> None:
    check_per_head("log_decay", log_decay, heads)
    check_per_head("rate", rate, heads)
    if bool(log_decay.isnan().any()):
        raise ValueError("log_decay must not contain NaN (log of lambda in [0, 1])")
    if bool((log_decay > 0).any()):
        raise ValueError(
            "log_decay must be <= 0 (log of lambda in (0, 1]); "
            f"got max {log_decay.max().item():.3g}"
        )


def _check_initial_state(state: TensorCacheState, batch, window, heads, key_dim, value_dim):
    if not isinstance(state, TensorCacheState):
        raise TypeError(f"initial_state must be a TensorCacheState; got {type(state).__name__}")
    check_state("initial_state.keys", state.keys, (batch, window, heads, key_dim))
    check_state("initial_state.values", state.values, (batch, window, heads, value_dim))
    check_state("initial_state.memory", state.memory, (batch, heads, key_dim, value_dim))


def _memory_scan(q, wk, wv, on, log_decay, rate, rule, memory, chunk_size, output_final_state):
    """Read r_t = q_t^T A_t of the memory fed by the write stream (wk, wv); on[t] = write or not."""
    batch, length, heads, _ = q.shape
    on3 = on[None, :, None] > 0  # [1, T, 1]
    # where, not a product: log_decay = -inf times "off" (0) would be NaN
    g = torch.where(on3, log_decay[None, None, :], 0.0).expand(batch, length, heads)
    eta = torch.where(on3, rate[None, None, :], 0.0).expand(batch, length, heads)
    common = dict(scale=1.0, chunk_size=chunk_size, output_final_state=output_final_state)
    if rule == "outer":
        return chunk_scan(
            q, wk, wv * eta[..., None], g=g, beta=None, initial_state=memory, **common
        )
    if rule == "delta":
        return chunk_scan(
            q, wk, wv, g=g, beta=eta, initial_state=memory, decayed_beta=True, **common
        )
    # wedge: A += eta (k v^T - v k^T), two additive streams sharing one decay
    o, state = chunk_scan(
        torch.cat([q, q]),
        torch.cat([wk, wv]),
        torch.cat([wv * eta[..., None], -wk * eta[..., None]]),
        g=torch.cat([g, g]),
        beta=None,
        initial_state=torch.cat([memory, torch.zeros_like(memory)]),
        **common,
    )
    return o[:batch] + o[batch:], (None if state is None else state[:batch] + state[batch:])


def tensor_cache_paths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    log_decay: torch.Tensor,
    rate: torch.Tensor,
    rule: str = "outer",
    scale: float | None = None,
    normalize_keys: bool = True,
    chunk_size: int = 32,
    initial_state: TensorCacheState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, TensorCacheState | None]:
    """The two read paths of a Tensor Cache, parallel (chunked) form.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, K)
    v : Tensor of shape (B, T, H, V)
    window : int
        W >= 1: the L1 window [t-W+1, t]; token t-W is written to the memory at step t.
    log_decay : Tensor of shape (H,)
        log(lambda) per head, <= 0 and not NaN; ``-inf`` means lambda = 0 (pass it in fp32 or
        wider; it is used in log space).
    rate : Tensor of shape (H,)
        Write rate eta per head.
    rule : {"outer", "delta", "wedge"}, default "outer"
    scale : float, optional
        Softmax scale of L1; default ``K ** -0.5``. The memory read is ``q^T A`` (unscaled).
    normalize_keys : bool, default True
        Write ``k / ||k||`` into the memory (L1 uses the raw keys).
    chunk_size : int, default 32
        Chunk of the memory scan and query block of L1 (results do not depend on it).
    initial_state : TensorCacheState, optional
        State from a previous call or from :func:`tensor_cache_step`.
    output_final_state : bool, default False

    Returns
    -------
    o_local : Tensor of shape (B, T, H, V)
        Exact softmax over the window (L1), in the compute dtype (float32 or float64).
    o_memory : Tensor of shape (B, T, H, V)
        ``q_t^T A_t`` with A_t holding exactly the tokens <= t-W (L2), in the compute dtype.
    final_state : TensorCacheState or None
        In the compute dtype; interchangeable with the streaming state.
    """
    batch, length, heads, key_dim, value_dim = check_qkv(q, k, v)
    check_positive_int("window", window)
    check_positive_int("chunk_size", chunk_size)
    _check_rule(rule, key_dim, value_dim)
    _check_decay_rate(log_decay, rate, heads)
    if initial_state is None:
        initial_state = TensorCacheState.empty(
            batch, window, heads, key_dim, value_dim, dtype=q.dtype, device=q.device
        )
    _check_initial_state(initial_state, batch, window, heads, key_dim, value_dim)
    dtype = compute_dtype(q, k, v, log_decay, rate, initial_state.memory)
    ring_k, ring_v, ring_pos = initial_state.chronological()
    seen = initial_state.seen
    # extended sequence: the W ring tokens (oldest first, negative position = empty) + the new T
    ext_k = torch.cat([ring_k.to(dtype), k.to(dtype)], dim=1)
    ext_v = torch.cat([ring_v.to(dtype), v.to(dtype)], dim=1)
    ext_pos = torch.cat([ring_pos, torch.arange(length) + seen])
    ext_on = (ext_pos >= 0).to(dtype=dtype, device=q.device)
    ext_k = ext_k * ext_on[None, :, None, None]
    ext_v = ext_v * ext_on[None, :, None, None]
    q = q.to(dtype)

    o_local = attend(
        q,
        ext_k,
        ext_v,
        ext_pos[window:],
        ext_pos,
        scale=key_dim**-0.5 if scale is None else float(scale),
        window=window,
        sinks=0,
        block_size=chunk_size,
    )
    # the token written at step t is ext[t], i.e. position seen + t - W
    write_k = ext_k[:, :length]
    if normalize_keys:
        write_k = l2_normalize(write_k)
    o_memory, memory = _memory_scan(
        q,
        write_k,
        ext_v[:, :length],
        ext_on[:length],
        log_decay.to(dtype),
        rate.to(dtype),
        rule,
        initial_state.memory.to(dtype),
        chunk_size,
        output_final_state,
    )
    final_state = None
    if output_final_state:
        shift = (seen + length) % window  # token at position p goes to slot p % W
        final_state = TensorCacheState(
            keys=ext_k[:, length:].roll(shift, dims=1),
            values=ext_v[:, length:].roll(shift, dims=1),
            memory=memory,
            seen=seen + length,
        )
    return o_local, o_memory, final_state


def tensor_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    log_decay: torch.Tensor,
    rate: torch.Tensor,
    gate: torch.Tensor,
    rule: str = "outer",
    scale: float | None = None,
    normalize_keys: bool = True,
    chunk_size: int = 32,
    initial_state: TensorCacheState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, TensorCacheState | None]:
    """Tensor Cache, parallel (chunked) form: ``o_t = L1_t + gate * q_t^T A_t``.

    Parameters
    ----------
    q, k, v, window, log_decay, rate, rule, scale, normalize_keys, chunk_size, initial_state,
    output_final_state
        As in :func:`tensor_cache_paths`.
    gate : Tensor of shape (H,) or (B, T, H)
        Weight of the memory path (the layer passes ``sigmoid(gate_logit)``).

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : TensorCacheState or None
    """
    batch, length, heads, _, _ = check_qkv(q, k, v)
    weight = gate_weight(gate, batch, length, heads)
    o_local, o_memory, state = tensor_cache_paths(
        q,
        k,
        v,
        window=window,
        log_decay=log_decay,
        rate=rate,
        rule=rule,
        scale=scale,
        normalize_keys=normalize_keys,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    o = o_local + weight.to(o_local.dtype) * o_memory
    return o.to(q.dtype), state


def _step_gate(gate: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Check a streaming gate of shape ``[H]`` or ``[B, H]``; return it as ``[B or 1, H, 1]``."""
    if not isinstance(gate, torch.Tensor) or gate.ndim == 1:
        check_per_head("gate", gate, heads)
        return gate[None, :, None]
    if tuple(gate.shape) != (batch, heads):
        raise ValueError(
            f"gate must have shape [H] or [B, H] = {(batch, heads)}; got {tuple(gate.shape)}"
        )
    check_state("gate", gate, (batch, heads))  # floating point
    return gate[..., None]


def _write(memory, key, value, decay, rate, rule):
    """One memory write: A <- lambda A + eta write(key, value); key/value [B, H, K] / [B, H, V]."""
    lam = decay[None, :, None, None]
    eta = rate[None, :, None, None]
    if rule == "outer":
        update = key[..., :, None] * value[..., None, :]
    elif rule == "delta":
        prediction = (key[..., None, :] @ memory)[..., 0, :]
        update = key[..., :, None] * (value - prediction)[..., None, :]
    else:
        update = key[..., :, None] * value[..., None, :] - value[..., :, None] * key[..., None, :]
    return lam * memory + eta * update


def tensor_cache_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: TensorCacheState,
    *,
    log_decay: torch.Tensor,
    rate: torch.Tensor,
    gate: torch.Tensor,
    rule: str = "outer",
    scale: float | None = None,
    normalize_keys: bool = True,
) -> tuple[torch.Tensor, TensorCacheState]:
    """One streaming step of a Tensor Cache (ring buffer, constant state).

    Order: (1) if the ring is full, the slot about to be overwritten holds token t-W: write it
    into the memory; (2) put token t in its slot; (3) softmax over the ring (L1) and read
    ``q^T A`` (L2). Equals the parallel form token for token.

    Parameters
    ----------
    q, k : Tensor of shape (B, H, K)
    v : Tensor of shape (B, H, V)
    state : TensorCacheState
        Updated **in place** (ring slot, memory, seen) and returned. This is an inference API;
        train with :func:`tensor_cache`.
    log_decay, rate, rule, scale, normalize_keys
        As in :func:`tensor_cache_paths`.
    gate : Tensor of shape (H,) or (B, H)
        Weight of the memory path (checked like the parallel form's gate).

    Returns
    -------
    o : Tensor of shape (B, H, V)
    state : TensorCacheState
    """
    if not isinstance(state, TensorCacheState):
        raise TypeError(f"state must be a TensorCacheState; got {type(state).__name__}")
    batch, window, heads, key_dim = state.keys.shape
    value_dim = state.values.shape[-1]
    check_state("q", q, (batch, heads, key_dim))
    check_state("k", k, (batch, heads, key_dim))
    check_state("v", v, (batch, heads, value_dim))
    _check_rule(rule, key_dim, value_dim)
    _check_decay_rate(log_decay, rate, heads)
    weight = _step_gate(gate, batch, heads)
    dtype = compute_dtype(q, k, v, state.memory, log_decay)  # float32 or wider
    decay, eta = log_decay.to(dtype).exp(), rate.to(dtype)
    state.memory = state.memory.to(dtype)
    slot = state.seen % window
    if state.seen >= window:
        evicted_key = state.keys[:, slot].to(dtype)
        if normalize_keys:
            evicted_key = l2_normalize(evicted_key)
        evicted_value = state.values[:, slot].to(dtype)
        state.memory = _write(state.memory, evicted_key, evicted_value, decay, eta, rule)
    state.keys[:, slot] = k.to(state.keys.dtype)
    state.values[:, slot] = v.to(state.values.dtype)
    filled = min(state.seen + 1, window)
    state.seen += 1

    q = q.to(dtype)
    scale = key_dim**-0.5 if scale is None else float(scale)
    keys = state.keys[:, :filled].to(dtype).transpose(1, 2)  # [B, H, S, K]
    values = state.values[:, :filled].to(dtype).transpose(1, 2)  # [B, H, S, V]
    scores = (keys @ q[..., None])[..., 0] * scale  # [B, H, S]
    local = (scores.softmax(dim=-1)[..., None, :] @ values)[..., 0, :]
    read = (q[..., None, :] @ state.memory)[..., 0, :]
    return local + weight.to(dtype) * read, state
