"""The rows of the synthetic studies: which attention layer, with which options.

The SV rows use the layer of Forgetful Attention (arXiv:2607.12204), equation 1: the raw
learned query and key projections with a fixed kernel bandwidth (``qk_norm="none"``,
``sigma=None`` meaning 2.0), defined once in :data:`SV_PAPER`; the RMS-normalised layer
(``qk_norm="rms"``, sigma ``sqrt(2 D)``) is the ablation row "SV (rms-normalised)".
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["METHODS", "SV_LAYERS", "SV_PAPER", "Method", "layer_options"]

#: The paper's SV layer: raw projections, fixed sigma (None: 2.0 for qk_norm="none"), the
#: paper's language-model C and the batched gate's FISTA iterations.
SV_PAPER = {"qk_norm": "none", "sigma": None, "C": 0.25, "fista_iters": 80}

#: Layers whose chunk is the block gate of the SV readout.
SV_LAYERS = ("sv", "sv_hybrid")

#: Scan block of the chunked recurrences (a speed setting only: their outputs do not depend
#: on it; 32 was the fastest of 16 / 32 / 128 at length 129 on one CPU thread).
RECURRENT_SCAN_CHUNK = 32


@dataclass(frozen=True)
class Method:
    """One row: a label, a layer of :data:`svtoolkit.torch.ATTENTION_LAYERS`, its options.

    Attributes
    ----------
    label : str
    layer : str
    options : dict
        Options added to the layer's (for the SV rows on top of :data:`SV_PAPER`).
    kind : {"main", "ablation", "extra"}
        Main rows are compared with SV in the paired tests; ablations and extra rows are
        reported beside them.
    """

    label: str
    layer: str
    options: dict = field(default_factory=dict)
    kind: str = "main"


#: The compared methods by name, each a :class:`Method` (label, layer, options, kind).
METHODS = {
    "sv": Method("SV-Attention", "sv", {}),
    "sv_rms": Method("SV (rms-normalised)", "sv", {"qk_norm": "rms"}, "ablation"),
    "sv_no_gate": Method("SV (no gate)", "sv", {"gate": "uniform"}, "ablation"),
    "softmax": Method("softmax", "softmax"),
    "deltanet": Method("DeltaNet", "deltanet"),
    "linear": Method("linear attention", "linear"),
    "gated_deltanet": Method("Gated DeltaNet", "gated_deltanet", {}, "extra"),
    "sv_hybrid": Method("SV hybrid", "sv_hybrid", {}, "extra"),
}


def layer_options(method, chunk):
    """The full option dict of ``method``'s layer (JSON-serialisable, part of the cell key).

    Parameters
    ----------
    method : str
        Key of :data:`METHODS`.
    chunk : int
        The SV chunk (block gate) or the recurrences' scan block is
        :data:`RECURRENT_SCAN_CHUNK`.
    """
    m = METHODS[method]
    if m.layer in SV_LAYERS:
        return {**SV_PAPER, "chunk": int(chunk), **m.options}
    if m.layer in ("linear", "deltanet", "gated_deltanet"):
        return {"chunk": RECURRENT_SCAN_CHUNK, **m.options}
    return dict(m.options)
