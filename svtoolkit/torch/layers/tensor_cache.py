"""Tensor Cache layer (004_a46bfd66cfce050d.txt): window softmax (L1) + eviction-fed memory (L2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import TensorCacheState, tensor_cache, tensor_cache_step
from ..ops._common import check_positive_int, compute_dtype
from ..ops.tensor_cache import RULES
from ._base import HeadsAttention

__all__ = ["TensorCache"]


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


class TensorCache(HeadsAttention):
    """Tensor Cache: exact softmax over a window of W tokens plus a fast-weight memory of evictions.

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    window : int, default 64
        W: query t attends exactly to [t-W+1, t]; the memory holds exactly the tokens <= t-W.
    rule : {"outer", "delta", "wedge"}, default "outer"
        Memory write rule (the paper's main results use "outer").
    chunk : int, default 32
        Chunk size of the parallel scan (the paper's C).
    decay_init, rate_init : float, default 0.995 and 0.05
        Initial lambda and eta (learned per head as sigmoid logits).
    gate_init : float, default -2.0
        Initial gate logit per head (sigmoid(-2) ~ 0.12).
    normalize_keys : bool, default True
        L2-normalise keys written into the memory.
    logit_clamp : float, default 10.0
        lambda and eta logits are clamped to [-c, c], so both stay in
        [sigmoid(-c), sigmoid(c)] (the op itself also accepts lambda = 0).

    Notes
    -----
    ``y_t = W_o (L1_t + sigmoid(gate_h) q_t^T A_t)`` per head, with
    ``A <- lambda A + eta write(k_hat, v)`` applied once per evicted token. log(lambda) is
    ``logsigmoid(logit)`` computed in fp32 (fp64 for a float64 module), never in the activation
    dtype. Training (``forward``) and streaming (``step``) give the same outputs.
    One output projection serves both paths (the public code has a second one for L2).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        window: int = 64,
        rule: str = "outer",
        chunk: int = 32,
        decay_init: float = 0.995,
        rate_init: float = 0.05,
        gate_init: float = -2.0,
        normalize_keys: bool = True,
        logit_clamp: float = 10.0,
        **options,
    ):
        super().__init__(d_model, n_heads, **options)
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
        for name, p in (("decay_init", decay_init), ("rate_init", rate_init)):
            if not 0.0 < p < 1.0:
                raise ValueError(f"{name} must be in (0, 1); got {p}")
        self.window = check_positive_int("window", window)
        self.chunk = check_positive_int("chunk", chunk)
        self.rule, self.normalize_keys, self.logit_clamp = rule, normalize_keys, logit_clamp
        self.decay_logit = nn.Parameter(torch.full((n_heads,), _logit(decay_init)))
        self.rate_logit = nn.Parameter(torch.full((n_heads,), _logit(rate_init)))
        self.gate_logit = nn.Parameter(torch.full((n_heads,), float(gate_init)))

    def memory_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_decay, rate, gate)`` per head, in fp32 (or wider)."""
        dtype = compute_dtype(self.decay_logit)
        c = self.logit_clamp
        log_decay = F.logsigmoid(self.decay_logit.to(dtype).clamp(-c, c))
        rate = torch.sigmoid(self.rate_logit.to(dtype).clamp(-c, c))
        gate = torch.sigmoid(self.gate_logit.to(dtype))
        return log_decay, rate, gate

    def init_state(self, batch: int, *, dtype=None, device=None) -> TensorCacheState:
        """Empty streaming state (ring of W slots and a D x D memory per head)."""
        dtype = compute_dtype(self.q_proj.weight) if dtype is None else dtype
        device = self.q_proj.weight.device if device is None else device
        return TensorCacheState.empty(
            batch,
            self.window,
            self.n_heads,
            self.head_dim,
            self.head_dim,
            dtype=dtype,
            device=device,
        )

    def _mix(self, x, q, k, v, state, want_state):
        log_decay, rate, gate = self.memory_parameters()
        return tensor_cache(
            q,
            k,
            v,
            window=self.window,
            log_decay=log_decay,
            rate=rate,
            gate=gate,
            rule=self.rule,
            normalize_keys=self.normalize_keys,
            chunk_size=self.chunk,
            initial_state=state,
            output_final_state=want_state,
        )

    def step(self, x_t: torch.Tensor, state: TensorCacheState | None = None):
        """One token through the ring buffer: x_t (B, d_model) -> (y_t (B, d_model), state).

        ``state`` is updated in place (inference API; run under ``torch.no_grad()``).
        """
        if not isinstance(x_t, torch.Tensor) or x_t.ndim != 2 or x_t.shape[-1] != self.d_model:
            shape = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else type(x_t).__name__
            raise ValueError(f"x_t must have shape (B, d_model={self.d_model}); got {shape}")
        if state is None:
            state = self.init_state(x_t.shape[0], device=x_t.device)
        q, k, v = (self._heads(proj(x_t)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        log_decay, rate, gate = self.memory_parameters()
        o, state = tensor_cache_step(
            q,
            k,
            v,
            state,
            log_decay=log_decay,
            rate=rate,
            gate=gate,
            rule=self.rule,
            normalize_keys=self.normalize_keys,
        )
        return self.o_proj(o.to(x_t.dtype).flatten(-2)), state
