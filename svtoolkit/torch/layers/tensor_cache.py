"""Tensor Cache layer: window softmax (L1) + eviction-fed memory (L2), with the paper's switches.

Tensor Cache, "Tensor Cache: Eviction-conditioned Associative Memory for Transformers". Also
the layer selection of its App. A.3 (:func:`tensor_cache_layer_mask`,
:func:`tensor_cache_stack`): a model puts a Tensor Cache in all, none or the top k blocks and
plain sliding-window attention (the same window, no memory) in the others.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..._validation import check_bool, check_int, check_option, check_positive
from ..ops import TensorCacheState, tensor_cache_paths, tensor_cache_step_paths
from ..ops._common import compute_dtype
from ..ops.tensor_cache import RULES, _check_training_switches
from ._base import HeadsAttention
from .softmax import SlidingWindowAttention

__all__ = ["TensorCache", "tensor_cache_layer_mask", "tensor_cache_stack"]


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _check_probability(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:
        raise ValueError(f"{name} must be in (0, 1); got {p}")
    return float(p)


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
        L2-normalise keys written into the memory (App. A.3).
    normalize_queries : bool, default False
        L2-normalise the queries that read the memory (App. A.3).
    value_scale : float, default 1.0
        Values are written as ``value_scale * v`` (App. A.3).
    logit_clamp : float, default 10.0
        lambda and eta logits are clamped to [-c, c], so both stay in
        [sigmoid(-c), sigmoid(c)] (the op itself also accepts lambda = 0).
    train_writes : {"evicted", "all"}, default "evicted"
        "all": ``forward`` in training mode writes every token into the memory as it arrives
        (the training semantics of §3.4). Inference -- ``eval()`` mode, ``forward_with_state``
        and ``step`` -- always writes on eviction.
    write_mode : {"token", "chunk_mean"}, default "token"
        "chunk_mean": ``forward`` in training mode uses the chunk-mean shortcut (§4.6, Table 4
        baseline); inference writes per token.
    delta_residual : {"exact", "chunk_start"}, default "exact"
        "chunk_start" (rule="delta"): ``forward`` in training mode uses the chunk-start
        residual (§5); inference is exact.
    memory_proj : bool, default False
        A separate output projection W_tc for the memory path:
        ``y = W_o L1 + W_tc (sigmoid(gate) q^T A)`` (§3.4) instead of one ``W_o`` for both.
    slots : int, default 1
        S memories per head with learned slot keys ``slot_keys`` (H, S, D), hard write routing
        by the key and a top-k read (App. A.1).
    slot_top_k : int, default 1
        Slots mixed in each read.
    slot_temperature : float, default 1.0
        Temperature of the read softmax over ``cos(q, slot key)``.
    two_timescales : bool, default False
        A second, slow memory written by the same tokens, read as
        ``q^T A + sigmoid(slow_weight_logit) q^T A_slow`` (App. A.2).
    slow_decay_init, slow_rate_init, slow_weight_init : float, default 0.9995, 0.01, 0.5
        Initial lambda_slow, eta_slow and mixing weight (sigmoid logits, learned per head).

    Notes
    -----
    ``y_t = W_o (L1_t + sigmoid(gate_h) q_t^T A_t)`` per head, with
    ``A <- lambda A + eta write(k_hat, v)`` applied once per evicted token. log(lambda) is
    ``logsigmoid(logit)`` computed in fp32 (fp64 for a float64 module), never in the activation
    dtype. Training (``forward``) and streaming (``step``) give the same outputs with the
    default switches; the training-only switches (``train_writes``, ``write_mode``,
    ``delta_residual``) make ``forward`` in training mode differ from inference on purpose.
    With ``enable_rotary`` q and k are rotated before both paths, so the ring buffer holds
    rotated keys and an evicted key enters the memory as it was cached (see
    :class:`HeadsAttention`).
    """

    supports_rotary = True

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
        normalize_queries: bool = False,
        value_scale: float = 1.0,
        logit_clamp: float = 10.0,
        train_writes: str = "evicted",
        write_mode: str = "token",
        delta_residual: str = "exact",
        memory_proj: bool = False,
        slots: int = 1,
        slot_top_k: int = 1,
        slot_temperature: float = 1.0,
        two_timescales: bool = False,
        slow_decay_init: float = 0.9995,
        slow_rate_init: float = 0.01,
        slow_weight_init: float = 0.5,
        **options,
    ):
        super().__init__(d_model, n_heads, **options)
        check_option(rule, "rule", RULES)
        _check_training_switches(rule, train_writes, write_mode, delta_residual)
        for name, flag in (
            ("normalize_keys", normalize_keys),
            ("normalize_queries", normalize_queries),
            ("memory_proj", memory_proj),
            ("two_timescales", two_timescales),
        ):
            check_bool(flag, name)
        for name, p in (("decay_init", decay_init), ("rate_init", rate_init)):
            _check_probability(name, p)
        self.window = check_int(window, "window", min=1)
        self.chunk = check_int(chunk, "chunk", min=1)
        self.slots = check_int(slots, "slots", min=1)
        check_int(slot_top_k, "slot_top_k", min=1)
        if slot_top_k > slots:
            raise ValueError(f"slot_top_k must be in [1, slots={slots}]; got {slot_top_k}")
        self.slot_top_k = slot_top_k
        self.slot_temperature = check_positive(slot_temperature, "slot_temperature")
        self.value_scale = check_positive(value_scale, "value_scale")
        self.rule, self.normalize_keys, self.logit_clamp = rule, normalize_keys, logit_clamp
        self.normalize_queries = normalize_queries
        self.train_writes, self.write_mode = train_writes, write_mode
        self.delta_residual, self.two_timescales = delta_residual, two_timescales
        self.decay_logit = nn.Parameter(torch.full((n_heads,), _logit(decay_init)))
        self.rate_logit = nn.Parameter(torch.full((n_heads,), _logit(rate_init)))
        self.gate_logit = nn.Parameter(torch.full((n_heads,), float(gate_init)))
        inner = n_heads * self.head_dim
        bias = self.o_proj.bias is not None
        self.memory_out = nn.Linear(inner, d_model, bias=bias) if memory_proj else None
        self.slot_keys = (
            nn.Parameter(torch.randn(n_heads, slots, self.head_dim)) if slots > 1 else None
        )
        if two_timescales:
            for name, p in (
                ("slow_decay_init", slow_decay_init),
                ("slow_rate_init", slow_rate_init),
                ("slow_weight_init", slow_weight_init),
            ):
                _check_probability(name, p)
            self.slow_decay_logit = nn.Parameter(torch.full((n_heads,), _logit(slow_decay_init)))
            self.slow_rate_logit = nn.Parameter(torch.full((n_heads,), _logit(slow_rate_init)))
            self.slow_weight_logit = nn.Parameter(
                torch.full((n_heads,), _logit(slow_weight_init))
            )

    @property
    def banks(self) -> int:
        """Memories per head: slots x timescales."""
        return self.slots * (2 if self.two_timescales else 1)

    def memory_parameters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log_decay, rate, gate)`` per head, in fp32 (or wider)."""
        dtype = compute_dtype(self.decay_logit)
        c = self.logit_clamp
        log_decay = F.logsigmoid(self.decay_logit.to(dtype).clamp(-c, c))
        rate = torch.sigmoid(self.rate_logit.to(dtype).clamp(-c, c))
        gate = torch.sigmoid(self.gate_logit.to(dtype))
        return log_decay, rate, gate

    def _memory_options(self) -> dict:
        """Keyword options of the op shared by training and inference."""
        log_decay, rate, _ = self.memory_parameters()
        options = dict(
            log_decay=log_decay,
            rate=rate,
            rule=self.rule,
            normalize_keys=self.normalize_keys,
            normalize_queries=self.normalize_queries,
            value_scale=self.value_scale,
        )
        if self.slot_keys is not None:
            options.update(
                slot_keys=self.slot_keys,
                slot_top_k=self.slot_top_k,
                slot_temperature=self.slot_temperature,
            )
        if self.two_timescales:
            dtype = compute_dtype(self.slow_decay_logit)
            c = self.logit_clamp
            options.update(
                slow_log_decay=F.logsigmoid(self.slow_decay_logit.to(dtype).clamp(-c, c)),
                slow_rate=torch.sigmoid(self.slow_rate_logit.to(dtype).clamp(-c, c)),
                slow_weight=torch.sigmoid(self.slow_weight_logit.to(dtype)),
            )
        return options

    def init_state(self, batch: int, *, dtype=None, device=None) -> TensorCacheState:
        """Empty streaming state (ring of W slots and the D x D memories per head)."""
        dtype = compute_dtype(self.q_proj.weight) if dtype is None else dtype
        device = self.q_proj.weight.device if device is None else device
        return TensorCacheState.empty(
            batch,
            self.window,
            self.n_heads,
            self.head_dim,
            self.head_dim,
            banks=self.banks,
            dtype=dtype,
            device=device,
        )

    def _output(self, dtype: torch.dtype, local: torch.Tensor, read: torch.Tensor):
        """``W_o (L1 + g r)``, or ``W_o L1 + W_tc (g r)`` with ``memory_proj``; [..., H, D]."""
        gated = self.memory_parameters()[2][:, None].to(read.dtype) * read
        if self.memory_out is None:
            return self.o_proj((local + gated).to(dtype).flatten(-2))
        return self.o_proj(local.to(dtype).flatten(-2)) + self.memory_out(
            gated.to(dtype).flatten(-2)
        )

    def _run(self, x, state, want_state, ntk_factor=1.0):
        self._check_input(x)
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self._rotate(q, k, state, ntk_factor)
        # the training-time approximations apply to the training forward only
        training = self.training and not want_state
        local, read, state = tensor_cache_paths(
            q,
            k,
            v,
            window=self.window,
            train_writes=self.train_writes if training else "evicted",
            write_mode=self.write_mode if training else "token",
            delta_residual=self.delta_residual if training else "exact",
            chunk_size=self.chunk,
            initial_state=state,
            output_final_state=want_state,
            **self._memory_options(),
        )
        return self._output(x.dtype, local, read), state

    def step(self, x_t: torch.Tensor, state: TensorCacheState | None = None, *,
             ntk_factor: float = 1.0):
        """One token through the ring buffer: x_t (B, d_model) -> (y_t (B, d_model), state).

        ``state`` is updated in place (inference API; run under ``torch.no_grad()``).
        """
        if not isinstance(x_t, torch.Tensor) or x_t.ndim != 2 or x_t.shape[-1] != self.d_model:
            shape = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else type(x_t).__name__
            raise ValueError(f"x_t must have shape (B, d_model={self.d_model}); got {shape}")
        if state is None:
            state = self.init_state(x_t.shape[0], device=x_t.device)
        q, k, v = (self._heads(proj(x_t)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = (y[:, 0] for y in self._rotate(q[:, None], k[:, None], state, ntk_factor))
        local, read, state = tensor_cache_step_paths(q, k, v, state, **self._memory_options())
        return self._output(x_t.dtype, local, read), state


def tensor_cache_layer_mask(n_layers: int, layers="all") -> tuple[bool, ...]:
    """Which blocks of an ``n_layers`` stack get a Tensor Cache (Tensor Cache, App. A.3).

    Parameters
    ----------
    n_layers : int
    layers : {"all", "none"} or int, default "all"
        "all", "none", or k in [0, n_layers]: the top k blocks (the last k, nearest the output).

    Returns
    -------
    tuple of bool, length n_layers
        ``True`` where the block's attention is a Tensor Cache.
    """
    check_int(n_layers, "n_layers", min=1)
    if layers == "all":
        return (True,) * n_layers
    if layers == "none":
        return (False,) * n_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 0 <= layers <= n_layers:
        raise ValueError(
            f"layers must be 'all', 'none' or an int in [0, n_layers={n_layers}]; got {layers!r}"
        )
    return (False,) * (n_layers - layers) + (True,) * layers


def tensor_cache_stack(
    d_model: int, n_heads: int, n_layers: int, *, layers="all", **options
) -> nn.ModuleList:
    """One attention layer per block with the Tensor Cache in the selected blocks only.

    Parameters
    ----------
    d_model, n_heads : int
    n_layers : int
    layers : {"all", "none"} or int, default "all"
        As in :func:`tensor_cache_layer_mask`.
    **options
        Options of :class:`TensorCache`. The other blocks get a
        :class:`SlidingWindowAttention` with the same ``window`` (default 64), ``head_dim``
        and ``bias``: the window path of a Tensor Cache with its memory gate forced off.

    Returns
    -------
    nn.ModuleList of length n_layers
    """
    mask = tensor_cache_layer_mask(n_layers, layers)
    shared = {name: options[name] for name in ("window", "head_dim", "bias") if name in options}
    return nn.ModuleList(
        TensorCache(d_model, n_heads, **options)
        if selected
        else SlidingWindowAttention(d_model, n_heads, **shared)
        for selected in mask
    )
