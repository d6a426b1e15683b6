"""Softmax attention op (full, sliding window, StreamingLLM) vs the per-query reference."""

from __future__ import annotations

import pytest
import torch

from svtoolkit.torch.ops import KVCache, softmax_attention
from svtoolkit.torch.ops._testing import FP64_TOL, assert_close, cotangents_like, vjp
from svtoolkit.torch.ops.naive import naive_softmax_attention

SEED = 31337
B, T, H, K, V = 2, 45, 3, 12, 10

# (window, sinks): full causal, window of one token, a window, StreamingLLM, window > T
MASKS = [(None, 0), (1, 0), (7, 0), (7, 3), (60, 2)]


def make_qkv(length=T, seed=SEED, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, length, H, K), (B, length, H, K), (B, length, H, V))
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window, sinks", MASKS)
def test_matches_per_query_reference(window, sinks, block_size):
    """Outputs and dq, dk, dv in fp64, with query blocks smaller and larger than the window."""
    q, k, v = make_qkv()
    o, _ = softmax_attention(q, k, v, window=window, sinks=sinks, block_size=block_size)
    o_ref = naive_softmax_attention(q, k, v, window=window, sinks=sinks)
    assert_close("o", o_ref, o, FP64_TOL["output"])
    (do,) = cotangents_like([o], torch.Generator().manual_seed(SEED + 1))
    grads, grads_ref = vjp([o], [do], [q, k, v]), vjp([o_ref], [do], [q, k, v])
    for name, got, ref in zip("qkv", grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


@pytest.mark.parametrize("window, sinks", MASKS)
def test_split_sequence_with_carried_cache_equals_full(window, sinks):
    q, k, v = (x.detach() for x in make_qkv())
    o_full, _ = softmax_attention(q, k, v, window=window, sinks=sinks)
    cache, outputs, start = None, [], 0
    for piece in (5, 1, 20, 19):
        part = (x[:, start : start + piece] for x in (q, k, v))
        o, cache = softmax_attention(
            *part, window=window, sinks=sinks, initial_state=cache, output_final_state=True
        )
        outputs.append(o)
        start += piece
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert cache.seen == T


@pytest.mark.parametrize("window, sinks", [(7, 0), (7, 3)])
def test_token_by_token_keeps_a_constant_cache(window, sinks):
    """StreamingLLM / sliding window streaming: equal outputs, cache of sinks + W - 1 tokens."""
    q, k, v = (x.detach() for x in make_qkv())
    o_full, _ = softmax_attention(q, k, v, window=window, sinks=sinks)
    cache, outputs = None, []
    for t in range(T):
        step = (x[:, t : t + 1] for x in (q, k, v))
        o, cache = softmax_attention(
            *step, window=window, sinks=sinks, initial_state=cache, output_final_state=True
        )
        outputs.append(o)
        assert cache.positions.numel() <= sinks + window - 1
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    expected = list(range(sinks)) + list(range(T - window + 1, T))
    assert cache.positions.tolist() == expected
    assert cache.nbytes() == B * len(expected) * H * (K + V) * 8


def test_window_covers_exactly_w_tokens():
    """Query t sees [t-W+1, t]: with one-hot values the output support is exactly that window."""
    length, window = 12, 4
    q = torch.randn(
        1, length, 1, 3, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64
    )
    values = torch.eye(length, dtype=torch.float64)[None, :, None, :]
    o, _ = softmax_attention(q, q, values, window=window)
    for t in range(length):
        support = (o[0, t, 0] != 0).nonzero().flatten().tolist()
        assert support == list(range(max(0, t - window + 1), t + 1))


def test_bad_arguments_are_rejected():
    q, k, v = (x.detach() for x in make_qkv())
    with pytest.raises(ValueError, match=r"sinks only make sense with a window"):
        softmax_attention(q, k, v, sinks=2)
    with pytest.raises(ValueError, match=r"window must be >= 1"):
        softmax_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match=r"sinks must be >= 0; got -1"):
        softmax_attention(q, k, v, window=3, sinks=-1)
    with pytest.raises(ValueError, match=r"v must share \[B, T, H\]"):
        softmax_attention(q, k, v[:, :3])
    with pytest.raises(TypeError, match=r"initial_state must be a KVCache"):
        softmax_attention(q, k, v, initial_state=(k, v))
    bad = KVCache(k[:, :3, :, :5], v[:, :3], torch.arange(3), 3)
    with pytest.raises(ValueError, match=r"initial_state does not match q/v"):
        softmax_attention(q, k, v, initial_state=bad)
