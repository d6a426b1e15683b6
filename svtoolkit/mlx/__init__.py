"""MLX side of svtoolkit (optional: ``pip install 'svtoolkit[mlx]'``).

The layout mirrors :mod:`svtoolkit.torch`: ``batched`` (FISTA partition finder, ridged bordered
solve), ``ops`` (the chunked SV gate and its readouts), ``layers`` (the SV-Attention modules
with exact streaming and ``forget``). MLX has no float64 on GPU; the batched path runs in
float32 there and in float32/float64 on CPU.
"""

from .._optional import require

require("mlx.core", feature="svtoolkit.mlx")

# --- batched training path -----------------------------------------------------------------
from .batched import (  # noqa: E402
    fista_svdd,
    lipschitz_bound,
    partition_masks,
    project_capped_simplex,
    ridged_svdd_solve,
)

# --- SV-Attention sequence layers ----------------------------------------------------------
from .layers import CausalSVAttention, HybridSVAttention, SVStreamState, from_torch  # noqa: E402
from .ops import MLXSVGate, exact_sv_gate, sv_gate, sv_hybrid_readout, sv_rbf_readout  # noqa: E402

__all__ = [
    # batched training path
    "fista_svdd",
    "lipschitz_bound",
    "partition_masks",
    "project_capped_simplex",
    "ridged_svdd_solve",
    # SV-Attention sequence layers
    "CausalSVAttention",
    "HybridSVAttention",
    "SVStreamState",
    "from_torch",
    # SV gate and readouts
    "MLXSVGate",
    "exact_sv_gate",
    "sv_gate",
    "sv_hybrid_readout",
    "sv_rbf_readout",
]
