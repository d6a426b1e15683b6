"""Attention layers (nn.Modules owning the projections), selectable by name.

Every layer is built as ``Name(d_model, n_heads, **options)`` and maps x of shape
(B, T, d_model) to (B, T, d_model), exactly causally, in float32 or float64. Each also has
``forward_with_state(x, state)`` and ``step(x_t, state)`` for streaming (the ops' carried state).

``ATTENTION_LAYERS`` maps a short name to the class, for models that pick their attention by
name (``ATTENTION_LAYERS["tensor_cache"](256, 4, window=64)``).
"""

from ._base import HeadsAttention
from .infini import InfiniAttention
from .recurrent import DeltaNet, GatedDeltaNet, LinearAttention
from .softmax import SlidingWindowAttention, SoftmaxAttention, StreamingLLMAttention
from .sv import CausalSVAttention, HybridSVAttention, SVStreamState
from .tensor_cache import TensorCache, tensor_cache_layer_mask, tensor_cache_stack

#: Every attention layer class by its short name (the ``attn`` of :class:`svtoolkit.torch.TinyLM`).
ATTENTION_LAYERS: dict[str, type] = {
    "softmax": SoftmaxAttention,
    "sliding_window": SlidingWindowAttention,
    "streaming_llm": StreamingLLMAttention,
    "linear": LinearAttention,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "tensor_cache": TensorCache,
    "infini": InfiniAttention,
    "sv": CausalSVAttention,
    "sv_hybrid": HybridSVAttention,
}

__all__ = [
    "ATTENTION_LAYERS",
    "CausalSVAttention",
    "HybridSVAttention",
    "SVStreamState",
    "DeltaNet",
    "GatedDeltaNet",
    "HeadsAttention",
    "InfiniAttention",
    "LinearAttention",
    "SlidingWindowAttention",
    "SoftmaxAttention",
    "StreamingLLMAttention",
    "TensorCache",
    "tensor_cache_layer_mask",
    "tensor_cache_stack",
]
