"""Softmax attention layers: full causal, sliding window, StreamingLLM (sinks + window)."""

from __future__ import annotations

import torch.nn.functional as F

from ..ops import softmax_attention
from ..._validation import check_bool, check_int
from ._base import HeadsAttention

__all__ = ["SoftmaxAttention", "SlidingWindowAttention", "StreamingLLMAttention"]


class SoftmaxAttention(HeadsAttention):
    """Causal multi-head softmax attention (unfused: scores, softmax, weighted sum).

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    block_size : int, default 256
        Queries per block in the op (memory knob only).
    qk_norm : bool, default False
        RMS-normalise each head's q and k (no learned gain, ``||q|| = ||k|| = sqrt(D)``) before
        the logits, as the SV layers do: a control that gives softmax the SV layers' query/key
        normalisation, so a comparison with them isolates the gate.

    Notes
    -----
    ``o_t = sum_{j <= t} softmax_j(q_t . k_j / sqrt(D)) v_j``. No positional encoding by
    default: the backbone supplies positions (learned absolute embeddings in TinyLM);
    ``enable_rotary`` rotates q and k instead (RoPE, with NTK-aware scaling through
    ``ntk_factor``; see :class:`HeadsAttention`). The streaming state is the full KV cache (it
    grows with the sequence); with rotary it holds the rotated keys.
    """

    window: int | None = None
    sinks: int = 0
    supports_rotary = True

    def __init__(self, d_model: int, n_heads: int, *, block_size: int = 256,
                 qk_norm: bool = False, **options):
        super().__init__(d_model, n_heads, **options)
        self.block_size = check_int(block_size, "block_size", min=1)
        self.qk_norm = check_bool(qk_norm, "qk_norm")

    def _mix(self, x, q, k, v, state, want_state):
        if self.qk_norm:  # rotation preserves norms: normalising after it is the same
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        return softmax_attention(
            q,
            k,
            v,
            window=self.window,
            sinks=self.sinks,
            block_size=self.block_size,
            initial_state=state,
            output_final_state=want_state,
        )


class SlidingWindowAttention(SoftmaxAttention):
    """Causal softmax attention over the window [t-W+1, t] (W tokens, the current one included).

    Parameters
    ----------
    d_model, n_heads, head_dim, bias, block_size, qk_norm
        See :class:`SoftmaxAttention`.
    window : int, default 64
        W. The streaming state keeps the last W-1 tokens (constant size).
    """

    def __init__(self, d_model: int, n_heads: int, *, window: int = 64, **options):
        super().__init__(d_model, n_heads, **options)
        self.window = check_int(window, "window", min=1)


class StreamingLLMAttention(SoftmaxAttention):
    """StreamingLLM: softmax over the first ``sinks`` tokens plus the window [t-W+1, t].

    Parameters
    ----------
    d_model, n_heads, head_dim, bias, block_size, qk_norm
        See :class:`SoftmaxAttention`.
    sinks : int, default 4
        Attention-sink tokens always kept (the StreamingLLM default).
    window : int, default 64
        Recent tokens W (the current one included).

    Notes
    -----
    Trained and evaluated with the same mask, so training and streaming agree exactly. With
    ``enable_rotary`` the keys are rotated by their original positions and kept so in the
    cache (no StreamingLLM position shift): the window keys sit at offsets the model was
    trained on, the sinks at ever larger ones.
    Streaming state: the sinks plus the last W-1 tokens, constant size.
    """

    def __init__(self, d_model: int, n_heads: int, *, sinks: int = 4, window: int = 64, **options):
        super().__init__(d_model, n_heads, **options)
        self.window = check_int(window, "window", min=1)
        self.sinks = check_int(sinks, "sinks", min=1)
