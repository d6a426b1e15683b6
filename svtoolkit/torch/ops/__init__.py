"""Pure sequence ops: tensors in, tensors out; one layout ``[B, T, H, D]``; gates by keyword.

Every op has a slow per-token reference in :mod:`svtoolkit.torch.ops.naive` and is tested
against it (outputs, final state, all gradients, in float64).

=========================  =====================================================================
op                         recurrence / rule
=========================  =====================================================================
softmax_attention          causal softmax; ``window=W`` -> keys [t-W+1, t]; ``sinks=s`` adds 0..s-1
linear_attention           S_t = S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t
decayed_linear_attention   S_t = a_t S_{t-1} + k_t v_t^T, g_t = log a_t (decay only)
delta_rule                 S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
gated_delta_rule           S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, g_t = log a_t
tensor_cache(_paths)       window softmax + memory of the tokens <= t-W (outer / delta / wedge)
tensor_cache_step          the same, one token, ring buffer (constant state)
infini_attention           segment-local softmax + compressive memory of past segments
sv_gate / exact_sv_gate    SVDD gate of every chunk's causal prefix (batched / exact fp64)
sv_rbf_readout             chunk-frozen RBF readout of the gate
sv_hybrid_readout          q.k softmax over [0, t], prefix keys times their gate multiplier
=========================  =====================================================================
"""

from . import naive
from .attention import KVCache, softmax_attention
from .delta_rule import decayed_linear_attention, delta_rule, gated_delta_rule
from .infini_attention import INFINI_RULES, InfiniState, infini_attention
from .linear_attention import linear_attention
from .chunked_sv import SVGate, exact_sv_gate, sv_gate, sv_hybrid_readout, sv_rbf_readout
from .tensor_cache import (
    DELTA_RESIDUALS,
    RULES,
    TRAIN_WRITES,
    WRITE_MODES,
    TensorCacheState,
    tensor_cache,
    tensor_cache_paths,
    tensor_cache_step,
    tensor_cache_step_paths,
)

__all__ = [
    "INFINI_RULES",
    "RULES",
    "InfiniState",
    "SVGate",
    "KVCache",
    "TensorCacheState",
    "DELTA_RESIDUALS",
    "TRAIN_WRITES",
    "WRITE_MODES",
    "decayed_linear_attention",
    "delta_rule",
    "exact_sv_gate",
    "gated_delta_rule",
    "infini_attention",
    "linear_attention",
    "naive",
    "softmax_attention",
    "sv_gate",
    "sv_hybrid_readout",
    "sv_rbf_readout",
    "tensor_cache",
    "tensor_cache_paths",
    "tensor_cache_step",
    "tensor_cache_step_paths",
]
