"""PyTorch side of svtoolkit (optional: ``pip install 'svtoolkit[torch]'``).

Sections, one per capability; each imports from its own module:

* exact differentiable gate (inverse-reusing backward)
* batched training path (FISTA partition finder, ridged bordered solve)
* memory layers svtoolkit is compared with (softmax, sliding window, linear attention, ...)
* SV-Attention sequence layers
"""

from .._optional import require

require("torch", feature="svtoolkit.torch")

# --- exact differentiable gate -------------------------------------------------------------
# --- memory layers (baselines) -------------------------------------------------------------
from . import ops  # noqa: E402

# --- batched training path -----------------------------------------------------------------
from .batched import (  # noqa: E402
    fista_svdd,
    lipschitz_bound,
    partition_masks,
    project_capped_simplex,
    ridged_svdd_solve,
)
from .exact_gate import (  # noqa: E402
    SVAttention,
    SVAttentionInfo,
    gate_from_solver,
    sv_attention,
    svdd_gate,
    svdd_gate_from_gram,
)

# --- SV-Attention sequence layers ----------------------------------------------------------
from .layers import (  # noqa: E402
    ATTENTION_LAYERS,
    CausalSVAttention,
    DeltaNet,
    GatedDeltaNet,
    HybridSVAttention,
    InfiniAttention,
    LinearAttention,
    SlidingWindowAttention,
    SoftmaxAttention,
    StreamingLLMAttention,
    SVStreamState,
    TensorCache,
)
from .model import TinyLM  # noqa: E402

__all__ = [
    # exact differentiable gate
    "SVAttention",
    "SVAttentionInfo",
    "gate_from_solver",
    "sv_attention",
    "svdd_gate",
    "svdd_gate_from_gram",
    # batched training path
    "fista_svdd",
    "lipschitz_bound",
    "partition_masks",
    "project_capped_simplex",
    "ridged_svdd_solve",
    # memory layers (baselines)
    "ops",
    "ATTENTION_LAYERS",
    "DeltaNet",
    "GatedDeltaNet",
    "InfiniAttention",
    "LinearAttention",
    "SlidingWindowAttention",
    "SoftmaxAttention",
    "StreamingLLMAttention",
    "TensorCache",
    # SV-Attention sequence layers
    "CausalSVAttention",
    "HybridSVAttention",
    "SVStreamState",
    "TinyLM",
]
