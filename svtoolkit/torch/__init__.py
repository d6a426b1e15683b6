"""PyTorch side of svtoolkit (optional: ``pip install 'svtoolkit[torch]'``).

Capabilities, each in its own module:

* ``exact_gate`` - the exact differentiable gate (entry points; the autograd core is
  ``_gate_autograd``, the slow reference ``ops.naive_gate``, the set-level readout
  ``layers.set_readout``)
* ``batched`` - the batched training path (FISTA partition finder, ridged bordered solve)
* ``ops`` / ``layers`` - the memory layers svtoolkit is compared with and the SV-Attention
  sequence layers (``ATTENTION_LAYERS`` selects them by name)
* ``model`` - TinyLM, a small byte-level decoder with a pluggable attention
* ``threads`` - ``set_threads``: torch and Numba thread counts without torch 2.13's
  batched-solve thread bug
"""

from .._optional import require

require("torch", feature="svtoolkit.torch")

from . import ops  # noqa: E402  (pure sequence ops; layout [B, T, H, D])
from .batched import (  # noqa: E402  (batched training path)
    fista_svdd,
    lipschitz_bound,
    partition_masks,
    project_capped_simplex,
    ridged_svdd_solve,
)
from .exact_gate import (  # noqa: E402  (exact differentiable gate)
    gate_from_solver,
    svdd_gate,
    svdd_gate_from_gram,
)
from .layers.set_readout import (  # noqa: E402  (SV-Attention over a given key set)
    SVAttention,
    SVAttentionInfo,
    sv_attention,
)
from .layers import (  # noqa: E402  (memory layers and SV-Attention sequence layers)
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
from .model import TinyLM  # noqa: E402  (small decoder with a pluggable attention)
from .threads import set_threads  # noqa: E402  (thread counts for torch and Numba)

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
    # threads
    "set_threads",
]
