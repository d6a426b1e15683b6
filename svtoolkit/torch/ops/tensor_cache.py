"""Tensor Cache: window softmax (L1) + eviction-fed fast weights (L2).

Tensor Cache, "Tensor Cache: Eviction-conditioned Associative Memory for Transformers".
Exact semantics (one statement, used by every code path here)::

    query t sees the window [t-W+1, t] through exact softmax (L1), and
    a memory A_t holding exactly the tokens <= t-W (L2), read as r_t = q_t^T A_t;
    o_t = L1_t + gate * r_t.

So every token j <= t is visible to exactly one path. The memory is the recurrence

    A <- lambda A + eta * write(k_hat, s v)      (k_hat = k / ||k|| when normalize_keys)

    outer:  write = k_hat v^T
    delta:  write = k_hat (v - A^T k_hat)^T      (prediction from the pre-decay A, as published)
    wedge:  write = k_hat v^T - v k_hat^T        (needs K == V)

applied once per *evicted* token: at step t the token t-W leaves the window and is written
(nothing is written, and nothing decays, while t < W). Read after write, so r_t includes t-W.
``s`` is ``value_scale`` (1 by default).

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

Ablation switches of the paper (defaults reproduce the exact semantics above):

* ``train_writes="all"`` (§3.4, parallel form only): every token is written as it arrives,
  including the ones still in the window, and the memory decays from t = 0;
* ``write_mode="chunk_mean"`` (§4.6, Table 4 baseline; parallel form only): one write per chunk
  of C tokens, ``A <- lambda A + eta write(k_bar, v_bar)`` with the chunk means, and the reads of
  a chunk see the memory at its start;
* ``delta_residual="chunk_start"`` (§5; parallel form, delta rule only): every residual of a
  chunk is taken against the chunk-start memory;
* ``normalize_queries`` / ``normalize_keys`` / ``value_scale`` (App. A.3);
* ``slot_keys`` (App. A.1): S memories per head; each write goes to the slot whose key is most
  cosine-similar to the written key (hard routing), the read mixes the top-k slots by a softmax
  over ``cos(q, slot key) / temperature``;
* ``slow_log_decay``, ``slow_rate``, ``slow_weight`` (App. A.2): a second, slower memory written
  by the same tokens, read as ``r_fast + slow_weight * r_slow``.

Internally the memory is a stack of M = timescales x slots *banks* per head, each its own
``A <- lambda_m A + eta_m write`` recurrence fed by the tokens routed to it (a bank decays only
on its own writes), and the read is ``sum_m w_m q^T A_m``. With one bank (the default) the
state's memory is ``(B, H, K, V)``; with M > 1 it is ``(B, H, M, K, V)``, bank
``m = timescale * S + slot``.

Decay is handled in log space in fp32 or wider: ``log_decay`` is log(lambda) per head, the scan
exponentiates only non-positive cumulative sums (never lambda ** n in low precision).
``log_decay = -inf`` (lambda = 0: the memory keeps only the last write) is allowed, and so is a
log_decay whose exp underflows; every path then agrees with the per-token reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._validation import check_bool, check_int, check_option, check_positive
from ._common import (
    check_per_head,
    check_qkv,
    check_state,
    compute_dtype,
    gate_weight,
    l2_normalize,
    pad_time,
)
from ._scan import chunk_scan
from .attention import attend

__all__ = [
    "DELTA_RESIDUALS",
    "RULES",
    "TRAIN_WRITES",
    "WRITE_MODES",
    "TensorCacheState",
    "tensor_cache",
    "tensor_cache_paths",
    "tensor_cache_step",
    "tensor_cache_step_paths",
]

#: Memory write rules of the tensor-cache ops (their ``rule``).
RULES = ("outer", "delta", "wedge")
#: Which tokens the parallel form writes to memory (``train_writes``).
TRAIN_WRITES = ("evicted", "all")
#: One write per token or one per chunk (``write_mode``).
WRITE_MODES = ("token", "chunk_mean")
#: Delta-rule residuals against the running memory or the chunk's start (``delta_residual``).
DELTA_RESIDUALS = ("exact", "chunk_start")


@dataclass
class TensorCacheState:
    """Constant-size streaming state of a Tensor Cache.

    Attributes
    ----------
    keys : Tensor of shape (B, W, H, K)
        Ring buffer of raw keys; the token at position p lives in slot ``p % W``.
    values : Tensor of shape (B, W, H, V)
    memory : Tensor of shape (B, H, K, V), or (B, H, M, K, V) with M > 1 memory banks
        Fast-weight matrices holding the evicted tokens (positions <= seen - 1 - W).
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
        banks: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> TensorCacheState:
        """A state before any token: empty ring, zero memory (``banks`` = slots x timescales)."""
        check_int(window, "window", min=1)
        check_int(banks, "banks", min=1)
        bank_shape = () if banks == 1 else (banks,)
        return cls(
            keys=torch.zeros(batch, window, heads, key_dim, dtype=dtype, device=device),
            values=torch.zeros(batch, window, heads, value_dim, dtype=dtype, device=device),
            memory=torch.zeros(
                batch, heads, *bank_shape, key_dim, value_dim, dtype=dtype, device=device
            ),
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


@dataclass(frozen=True)
class _Banks:
    """Validated memory layout: per-bank decay and rate, routing and read mixing."""

    log_decay: torch.Tensor  # [H, M], bank m = timescale * slots + slot
    rate: torch.Tensor  # [H, M]
    slot_keys: torch.Tensor | None  # [H, S, K]
    slot_top_k: int
    slot_temperature: float
    slow_weight: torch.Tensor | None  # [H]
    slots: int

    @property
    def count(self) -> int:
        return self.log_decay.shape[1]


def _check_rule(rule: str, key_dim: int, value_dim: int) -> None:
    check_option(rule, "rule", RULES)
    if rule == "wedge" and key_dim != value_dim:
        raise ValueError(f"rule='wedge' needs K == V; got K={key_dim}, V={value_dim}")


def _check_log_decay(name: str, log_decay: torch.Tensor, heads: int) -> None:
    check_per_head(name, log_decay, heads)
    if bool(log_decay.isnan().any()):
        raise ValueError(f"{name} must not contain NaN (log of lambda in [0, 1])")
    if bool((log_decay > 0).any()):
        raise ValueError(
            f"{name} must be <= 0 (log of lambda in (0, 1]); got max {log_decay.max().item():.3g}"
        )


def _check_slots(slot_keys, slot_top_k, slot_temperature, heads, key_dim) -> int:
    """Validate the multi-slot options; return the number of slots S (1 without slot_keys)."""
    if slot_keys is None:
        if slot_top_k != 1:
            raise ValueError(f"slot_top_k needs slot_keys; got slot_top_k={slot_top_k!r}")
        return 1
    if not isinstance(slot_keys, torch.Tensor) or not slot_keys.is_floating_point():
        raise TypeError("slot_keys must be a floating-point tensor of shape (H, S, K)")
    if slot_keys.ndim != 3 or slot_keys.shape[0] != heads or slot_keys.shape[2] != key_dim:
        raise ValueError(
            f"slot_keys must have shape (H, S, K) = ({heads}, S, {key_dim}); "
            f"got {tuple(slot_keys.shape)}"
        )
    slots = slot_keys.shape[1]
    check_int(slot_top_k, "slot_top_k", min=1)
    if not 1 <= slot_top_k <= slots:
        raise ValueError(f"slot_top_k must be in [1, S={slots}]; got {slot_top_k}")
    check_positive(slot_temperature, "slot_temperature")
    return slots


def _memory_banks(
    heads, key_dim, log_decay, rate, slot_keys, slot_top_k, slot_temperature,
    slow_log_decay, slow_rate, slow_weight,
) -> _Banks:
    """Check the per-head memory parameters and build the bank layout."""
    _check_log_decay("log_decay", log_decay, heads)
    check_per_head("rate", rate, heads)
    slots = _check_slots(slot_keys, slot_top_k, slot_temperature, heads, key_dim)
    slow = (slow_log_decay, slow_rate, slow_weight)
    if any(x is not None for x in slow) and any(x is None for x in slow):
        raise ValueError(
            "two-timescale memory needs slow_log_decay, slow_rate and slow_weight together; "
            f"got {['set' if x is not None else None for x in slow]}"
        )
    decays, rates = [log_decay], [rate]
    if slow_log_decay is not None:
        _check_log_decay("slow_log_decay", slow_log_decay, heads)
        check_per_head("slow_rate", slow_rate, heads)
        check_per_head("slow_weight", slow_weight, heads)
        decays.append(slow_log_decay)
        rates.append(slow_rate)
    # [H, timescales] -> [H, timescales * slots], slot index fastest
    per_bank = [torch.stack(x, dim=1).repeat_interleave(slots, dim=1) for x in (decays, rates)]
    return _Banks(
        log_decay=per_bank[0],
        rate=per_bank[1],
        slot_keys=slot_keys,
        slot_top_k=slot_top_k,
        slot_temperature=float(slot_temperature),
        slow_weight=slow_weight,
        slots=slots,
    )


def _slot_logits(x: torch.Tensor, banks: _Banks) -> torch.Tensor:
    """cos(x, slot key) / temperature: x [..., H, K] -> [..., H, S]."""
    keys = l2_normalize(banks.slot_keys.to(x.dtype))
    return torch.einsum("...hk,hsk->...hs", l2_normalize(x), keys) / banks.slot_temperature


def _route_writes(keys: torch.Tensor, banks: _Banks) -> torch.Tensor:
    """One-hot bank of each write (hard routing by the key): [..., H, K] -> [..., H, M]."""
    if banks.slot_keys is None:
        return keys.new_ones(*keys.shape[:-1], banks.count)
    slot = _slot_logits(keys, banks).argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(slot, banks.slots).to(keys.dtype)
    timescales = banks.count // banks.slots
    return one_hot.repeat(*([1] * (one_hot.ndim - 1)), timescales)  # bank = ts * S + slot


def _read_weights(queries: torch.Tensor, banks: _Banks) -> torch.Tensor:
    """Weight of each bank in the read: [..., H, K] -> [..., H, M] (top-k softmax x timescale)."""
    if banks.slot_keys is None:
        slot_weights = queries.new_ones(*queries.shape[:-1], 1)
    else:
        logits = _slot_logits(queries, banks)
        top, index = logits.topk(banks.slot_top_k, dim=-1)
        slot_weights = torch.zeros_like(logits).scatter(-1, index, top.softmax(dim=-1))
    if banks.slow_weight is None:
        return slot_weights
    slow = banks.slow_weight.to(queries.dtype)[:, None] * slot_weights
    return torch.cat([slot_weights, slow], dim=-1)


def _flatten_banks(x: torch.Tensor, count: int) -> torch.Tensor:
    """Repeat a per-head stream over the banks: [B, T, H, D] -> [B, T, H*M, D]."""
    if count == 1:
        return x
    return x[:, :, :, None].expand(*x.shape[:3], count, x.shape[-1]).flatten(2, 3)


def _check_initial_state(state, batch, window, heads, key_dim, value_dim, count):
    if not isinstance(state, TensorCacheState):
        raise TypeError(f"initial_state must be a TensorCacheState; got {type(state).__name__}")
    check_state("initial_state.keys", state.keys, (batch, window, heads, key_dim))
    check_state("initial_state.values", state.values, (batch, window, heads, value_dim))
    bank_shape = () if count == 1 else (count,)
    memory_shape = (batch, heads, *bank_shape, key_dim, value_dim)
    check_state("initial_state.memory", state.memory, memory_shape)


def _memory_scan(q, wk, wv, on, log_decay, rate, rule, memory, chunk_size, output_final_state,
                 delta_residual="exact"):
    """Read r_t = q_t^T A_t of the memory fed by the write stream (wk, wv).

    ``on`` [B or 1, T, H] is 1 where the token is written; log_decay, rate are [H].
    """
    batch, length, heads, _ = q.shape
    on3 = (on > 0).expand(batch, length, heads)
    # where, not a product: log_decay = -inf times "off" (0) would be NaN
    g = torch.where(on3, log_decay[None, None, :], 0.0)
    eta = torch.where(on3, rate[None, None, :], 0.0)
    common = dict(scale=1.0, chunk_size=chunk_size, output_final_state=output_final_state)
    if rule == "outer":
        return chunk_scan(
            q, wk, wv * eta[..., None], g=g, beta=None, initial_state=memory, **common
        )
    if rule == "delta":
        return chunk_scan(
            q, wk, wv, g=g, beta=eta, initial_state=memory, decayed_beta=True,
            frozen_residual=delta_residual == "chunk_start", **common,
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


def _chunk_mean_scan(q, wk, wv, on, log_decay, rate, rule, memory, chunk_size):
    """Chunk-mean shortcut: one write ``write(k_bar, v_bar)`` per chunk, reads at the chunk start.

    Shapes as :func:`_memory_scan`; the means are over the tokens of the chunk that are written
    (a chunk with none neither writes nor decays). Returns (reads [B, T, H, V], final memory).
    """
    batch, length, heads, _ = q.shape
    chunk = min(chunk_size, length)
    n_chunks = math.ceil(length / chunk)
    padded = n_chunks * chunk
    on = pad_time(on.expand(batch, length, heads), padded).unflatten(1, (n_chunks, chunk))
    wk, wv, q = (pad_time(x, padded).unflatten(1, (n_chunks, chunk)) for x in (wk, wv, q))
    count = on.sum(dim=2)  # [B, N, H]
    weight = (on / count.clamp_min(1.0)[:, :, None])[..., None]  # [B, N, C, H, 1]
    key_mean, value_mean = (wk * weight).sum(dim=2), (wv * weight).sum(dim=2)  # [B, N, H, D]
    decay = log_decay.exp()
    reads = []
    for n in range(n_chunks):
        reads.append(torch.einsum("bchk,bhkv->bchv", q[:, n], memory))
        written = _write(
            memory[:, :, None], key_mean[:, n], value_mean[:, n], decay[:, None], rate[:, None],
            rule,
        )[:, :, 0]
        memory = torch.where(count[:, n, :, None, None] > 0, written, memory)
    return torch.cat(reads, dim=1)[:, :length], memory


def _check_training_switches(rule, train_writes, write_mode, delta_residual) -> None:
    check_option(train_writes, "train_writes", TRAIN_WRITES)
    check_option(write_mode, "write_mode", WRITE_MODES)
    check_option(delta_residual, "delta_residual", DELTA_RESIDUALS)
    if delta_residual == "chunk_start" and rule != "delta":
        raise ValueError(f"delta_residual='chunk_start' needs rule='delta'; got rule={rule!r}")
    if delta_residual == "chunk_start" and write_mode == "chunk_mean":
        raise ValueError(
            "delta_residual='chunk_start' needs write_mode='token' "
            "(the chunk-mean write already uses the chunk-start memory)"
        )


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
    normalize_queries: bool = False,
    value_scale: float = 1.0,
    train_writes: str = "evicted",
    write_mode: str = "token",
    delta_residual: str = "exact",
    slot_keys: torch.Tensor | None = None,
    slot_top_k: int = 1,
    slot_temperature: float = 1.0,
    slow_log_decay: torch.Tensor | None = None,
    slow_rate: torch.Tensor | None = None,
    slow_weight: torch.Tensor | None = None,
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
        Write ``k / ||k||`` into the memory (L1 uses the raw keys). Tensor Cache, App. A.3.
    normalize_queries : bool, default False
        Read the memory (and route the read) with ``q / ||q||`` (L1 uses the raw queries).
        Tensor Cache, App. A.3.
    value_scale : float, default 1.0
        s > 0: the memory is written with ``s v`` (L1 uses the raw values). Tensor Cache,
        App. A.3.
    train_writes : {"evicted", "all"}, default "evicted"
        "evicted": the exact semantics (the memory holds the tokens <= t-W, as at inference).
        "all": every token is written at its own step, ``A_t = lambda A_{t-1} + eta
        write(k_hat_t, v_t)`` for every t, so the memory also holds the tokens still in the
        window (the training semantics of Tensor Cache, §3.4). The carried ring is taken as
        already written, so split calls equal one call; such a state continues only this
        mode, not :func:`tensor_cache_step` (which always writes on eviction).
    write_mode : {"token", "chunk_mean"}, default "token"
        "chunk_mean": the chunk-mean shortcut of Tensor Cache, §4.6 (Table 4 baseline): per
        chunk of ``chunk_size`` steps (counted from the start of the call) one write
        ``A <- lambda A + eta write(k_bar, v_bar)`` with the means of the chunk's written keys
        and values, applied after the chunk; every read of the chunk sees the memory at the
        chunk start. Depends on ``chunk_size`` and on where a sequence is split.
    delta_residual : {"exact", "chunk_start"}, default "exact"
        rule="delta" only. "chunk_start": every token of a chunk takes its residual against
        the chunk-start memory A_s, ``A_t = lambda A_{t-1} + eta k_t (v_t - A_s^T k_t)^T``
        (Tensor Cache, §5); reads stay per token. Depends on ``chunk_size`` (1 is exact).
    slot_keys : Tensor of shape (H, S, K), optional
        Multi-slot memory (Tensor Cache, App. A.1): S memories per head. Token j is written
        only into slot ``argmax_m cos(k_j, slot_keys[h, m])`` (hard routing, no gradient);
        the read is ``sum_m w_m q^T A_m`` with ``w`` the softmax of
        ``cos(q, slot_keys) / slot_temperature`` over the ``slot_top_k`` largest, 0 elsewhere.
    slot_top_k : int, default 1
        Slots mixed in the read (1 <= slot_top_k <= S).
    slot_temperature : float, default 1.0
    slow_log_decay, slow_rate, slow_weight : Tensor of shape (H,), optional
        Two-timescale memory (Tensor Cache, App. A.2), all three or none: a second memory
        ``A_slow <- lambda_slow A_slow + eta_slow write(k_hat, v)`` fed by the same writes;
        the read is ``q^T A + slow_weight * q^T A_slow``. Combines with slots (each timescale
        has S slots).
    chunk_size : int, default 32
        Chunk of the memory scan and query block of L1 (results do not depend on it, except
        with ``write_mode="chunk_mean"`` or ``delta_residual="chunk_start"``).
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
        In the compute dtype; interchangeable with the streaming state (with the default
        ``train_writes``, ``write_mode`` and ``delta_residual``).
    """
    batch, length, heads, key_dim, value_dim = check_qkv(q, k, v)
    check_int(window, "window", min=1)
    check_int(chunk_size, "chunk_size", min=1)
    _check_rule(rule, key_dim, value_dim)
    _check_training_switches(rule, train_writes, write_mode, delta_residual)
    check_bool(normalize_keys, "normalize_keys")
    check_bool(normalize_queries, "normalize_queries")
    value_scale = check_positive(value_scale, "value_scale")
    banks = _memory_banks(
        heads, key_dim, log_decay, rate, slot_keys, slot_top_k, slot_temperature,
        slow_log_decay, slow_rate, slow_weight,
    )
    if initial_state is None:
        initial_state = TensorCacheState.empty(
            batch, window, heads, key_dim, value_dim, banks=banks.count,
            dtype=q.dtype, device=q.device,
        )
    _check_initial_state(initial_state, batch, window, heads, key_dim, value_dim, banks.count)
    dtype = compute_dtype(
        q, k, v, log_decay, rate, initial_state.memory, slot_keys, slow_log_decay, slow_rate,
        slow_weight,
    )
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
    # evicted: the token written at step t is ext[t] (position seen + t - W); all: token t
    first = 0 if train_writes == "evicted" else window
    raw_k, write_v = ext_k[:, first : first + length], ext_v[:, first : first + length]
    on = ext_on[first : first + length][None, :, None, None] * _route_writes(raw_k, banks)
    write_k = l2_normalize(raw_k) if normalize_keys else raw_k
    read_q = l2_normalize(q) if normalize_queries else q
    count = banks.count
    memory = initial_state.memory.to(dtype)
    memory = (memory if count > 1 else memory[:, :, None]).flatten(1, 2)  # [B, H*M, K, V]
    stream = dict(
        q=_flatten_banks(read_q, count),
        wk=_flatten_banks(write_k, count),
        wv=_flatten_banks(write_v * value_scale, count),
        on=on.flatten(2),
        log_decay=banks.log_decay.to(dtype).flatten(),
        rate=banks.rate.to(dtype).flatten(),
        rule=rule,
        memory=memory,
        chunk_size=chunk_size,
    )
    if write_mode == "chunk_mean":
        bank_reads, memory = _chunk_mean_scan(**stream)
    else:
        bank_reads, memory = _memory_scan(
            **stream, output_final_state=output_final_state, delta_residual=delta_residual
        )
    weights = _read_weights(read_q, banks)[..., None]  # [B, T, H, M, 1]
    o_memory = (bank_reads.unflatten(2, (heads, count)) * weights).sum(dim=3)
    final_state = None
    if output_final_state:
        memory = memory.unflatten(1, (heads, count))
        shift = (seen + length) % window  # token at position p goes to slot p % W
        final_state = TensorCacheState(
            keys=ext_k[:, length:].roll(shift, dims=1),
            values=ext_v[:, length:].roll(shift, dims=1),
            memory=memory if count > 1 else memory[:, :, 0],
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
    **options,
) -> tuple[torch.Tensor, TensorCacheState | None]:
    """Tensor Cache, parallel (chunked) form: ``o_t = L1_t + gate * q_t^T A_t``.

    Parameters
    ----------
    q, k, v, window, log_decay, rate
        As in :func:`tensor_cache_paths`.
    gate : Tensor of shape (H,) or (B, T, H)
        Weight of the memory path (the layer passes ``sigmoid(gate_logit)``).
    **options
        Any keyword option of :func:`tensor_cache_paths` (rule, scale, normalize_keys, ...,
        chunk_size, initial_state, output_final_state).

    Returns
    -------
    o : Tensor of shape (B, T, H, V), dtype of ``q``
    final_state : TensorCacheState or None
    """
    batch, length, heads, _, _ = check_qkv(q, k, v)
    weight = gate_weight(gate, batch, length, heads)
    o_local, o_memory, state = tensor_cache_paths(
        q, k, v, window=window, log_decay=log_decay, rate=rate, **options
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
    """One write per bank: A_m <- lambda_m A_m + eta_m write(key, value).

    memory [B, H, M, K, V]; key / value [B, H, K] / [B, H, V] (the same pair for every bank,
    or [B, H, M, K] / [B, H, M, V]); decay, rate [H, M].
    """
    if key.ndim == 3:
        key, value = key[:, :, None], value[:, :, None]
    lam = decay[None, :, :, None, None]
    eta = rate[None, :, :, None, None]
    if rule == "outer":
        update = key[..., :, None] * value[..., None, :]
    elif rule == "delta":
        prediction = (key[..., None, :] @ memory)[..., 0, :]
        update = key[..., :, None] * (value - prediction)[..., None, :]
    else:
        update = key[..., :, None] * value[..., None, :] - value[..., :, None] * key[..., None, :]
    return lam * memory + eta * update


def tensor_cache_step_paths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: TensorCacheState,
    *,
    log_decay: torch.Tensor,
    rate: torch.Tensor,
    rule: str = "outer",
    scale: float | None = None,
    normalize_keys: bool = True,
    normalize_queries: bool = False,
    value_scale: float = 1.0,
    slot_keys: torch.Tensor | None = None,
    slot_top_k: int = 1,
    slot_temperature: float = 1.0,
    slow_log_decay: torch.Tensor | None = None,
    slow_rate: torch.Tensor | None = None,
    slow_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, TensorCacheState]:
    """One streaming step, both paths: ``(o_local, o_memory, state)``, each (B, H, V).

    Order: (1) if the ring is full, the slot about to be overwritten holds token t-W: write it
    into the memory (into its routed bank(s)); (2) put token t in its slot; (3) softmax over
    the ring (L1) and read ``sum_m w_m q^T A_m`` (L2). Equals the parallel form token for token
    (default ``train_writes``, ``write_mode`` and ``delta_residual``, the only ones at
    inference).

    Parameters
    ----------
    q, k : Tensor of shape (B, H, K)
    v : Tensor of shape (B, H, V)
    state : TensorCacheState
        Updated **in place** (ring slot, memory, seen) and returned. This is an inference API;
        train with :func:`tensor_cache`.
    log_decay, rate, rule, scale, normalize_keys, normalize_queries, value_scale, slot_keys,
    slot_top_k, slot_temperature, slow_log_decay, slow_rate, slow_weight
        As in :func:`tensor_cache_paths`.

    Returns
    -------
    o_local, o_memory : Tensor of shape (B, H, V), in the compute dtype
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
    check_bool(normalize_keys, "normalize_keys")
    check_bool(normalize_queries, "normalize_queries")
    value_scale = check_positive(value_scale, "value_scale")
    banks = _memory_banks(
        heads, key_dim, log_decay, rate, slot_keys, slot_top_k, slot_temperature,
        slow_log_decay, slow_rate, slow_weight,
    )
    bank_shape = () if banks.count == 1 else (banks.count,)
    check_state("state.memory", state.memory, (batch, heads, *bank_shape, key_dim, value_dim))
    dtype = compute_dtype(q, k, v, state.memory, log_decay)  # float32 or wider
    decay, eta = banks.log_decay.to(dtype).exp(), banks.rate.to(dtype)
    memory = state.memory.to(dtype)
    memory = memory if banks.count > 1 else memory[:, :, None]  # [B, H, M, K, V]
    slot = state.seen % window
    if state.seen >= window:
        raw_key = state.keys[:, slot].to(dtype)
        evicted_key = l2_normalize(raw_key) if normalize_keys else raw_key
        evicted_value = state.values[:, slot].to(dtype) * value_scale
        written = _write(memory, evicted_key, evicted_value, decay, eta, rule)
        routed = _route_writes(raw_key, banks)[..., None, None] > 0
        memory = torch.where(routed, written, memory)
    state.memory = memory if banks.count > 1 else memory[:, :, 0]
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
    read_q = l2_normalize(q) if normalize_queries else q
    bank_reads = (read_q[:, :, None, None, :] @ memory)[..., 0, :]  # [B, H, M, V]
    read = (bank_reads * _read_weights(read_q, banks)[..., None]).sum(dim=2)
    return local, read, state


def tensor_cache_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: TensorCacheState,
    *,
    log_decay: torch.Tensor,
    rate: torch.Tensor,
    gate: torch.Tensor,
    **options,
) -> tuple[torch.Tensor, TensorCacheState]:
    """One streaming step of a Tensor Cache (ring buffer, constant state).

    ``o = L1 + gate * L2`` of :func:`tensor_cache_step_paths`; equals the parallel form token
    for token.

    Parameters
    ----------
    q, k : Tensor of shape (B, H, K)
    v : Tensor of shape (B, H, V)
    state : TensorCacheState
        Updated **in place** and returned (inference API).
    log_decay, rate
        As in :func:`tensor_cache_paths`.
    gate : Tensor of shape (H,) or (B, H)
        Weight of the memory path (checked like the parallel form's gate).
    **options
        Any keyword option of :func:`tensor_cache_step_paths`.

    Returns
    -------
    o : Tensor of shape (B, H, V)
    state : TensorCacheState
    """
    if not isinstance(state, TensorCacheState):
        raise TypeError(f"state must be a TensorCacheState; got {type(state).__name__}")
    weight = _step_gate(gate, state.keys.shape[0], state.keys.shape[2])
    local, read, state = tensor_cache_step_paths(
        q, k, v, state, log_decay=log_decay, rate=rate, **options
    )
    return local + weight.to(local.dtype) * read, state
