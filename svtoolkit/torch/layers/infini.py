"""Infini-attention layer (Munkhdalai et al., 2024): segment softmax + compressive memory."""

from __future__ import annotations

import torch
from torch import nn

from ..._validation import check_int, check_option
from ..ops import infini_attention
from ..ops._common import compute_dtype
from ..ops.infini_attention import INFINI_RULES
from ._base import HeadsAttention

__all__ = ["InfiniAttention"]


class InfiniAttention(HeadsAttention):
    """Infini-attention: causal softmax inside segments of N tokens plus a memory of the past.

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    segment : int, default 64
        Segment length N.
    rule : {"linear", "delta"}, default "linear"
        Memory update (the paper's "Linear" and "Linear + Delta").
    gate_init : float, default 0.0
        Initial per-head gate logit beta (sigmoid(0) = 0.5 mixes the paths equally).

    Notes
    -----
    ``o_t = sigmoid(beta) A_mem + (1 - sigmoid(beta)) A_dot`` per head, with
    ``A_mem = sigma(q_t)^T M_{s-1} / (sigma(q_t) . z_{s-1})`` (sigma = ELU + 1) read from the
    segments before t's own, and the memory updated once a segment is complete. Equations in
    :mod:`svtoolkit.torch.ops.infini_attention`. With ``enable_rotary`` both paths see the
    rotated q and k (see :class:`HeadsAttention`).
    """

    supports_rotary = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        segment: int = 64,
        rule: str = "linear",
        gate_init: float = 0.0,
        **options,
    ):
        super().__init__(d_model, n_heads, **options)
        check_option(rule, "rule", INFINI_RULES)
        self.segment = check_int(segment, "segment", min=1)
        self.rule = rule
        self.gate_logit = nn.Parameter(torch.full((n_heads,), float(gate_init)))

    def _mix(self, x, q, k, v, state, want_state):
        gate = torch.sigmoid(self.gate_logit.to(compute_dtype(self.gate_logit)))
        return infini_attention(
            q,
            k,
            v,
            segment=self.segment,
            gate=gate,
            rule=self.rule,
            initial_state=state,
            output_final_state=want_state,
        )
