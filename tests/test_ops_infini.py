"""Infini-attention: segment-parallel form vs per-token reference, split and streamed."""

from __future__ import annotations

import pytest
import torch

from svtoolkit.torch.ops import INFINI_RULES, InfiniState, infini_attention
from svtoolkit.torch.ops._testing import FP32_TOL, FP64_TOL, assert_close, cotangents_like, vjp
from svtoolkit.torch.ops.naive import naive_infini_attention

SEED = 2404
B, H, K, V = 2, 2, 12, 10


def make_inputs(length, seed=SEED, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "q": torch.randn(B, length, H, K, generator=gen, dtype=torch.float64),
        "k": torch.randn(B, length, H, K, generator=gen, dtype=torch.float64),
        "v": torch.randn(B, length, H, V, generator=gen, dtype=torch.float64),
        "gate": torch.tensor([0.3, 0.7], dtype=torch.float64),
    }
    return {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}


@pytest.mark.parametrize("length", [50, 64])
@pytest.mark.parametrize("segment", [16, 32, 64])
@pytest.mark.parametrize("rule", INFINI_RULES)
def test_matches_per_token_reference(rule, segment, length):
    """Outputs, final M and z, and the gradients of q, k, v and the gate, fp64."""
    inputs = make_inputs(length)
    q, k, v, gate = inputs.values()
    o, state = infini_attention(
        q, k, v, segment=segment, gate=gate, rule=rule, output_final_state=True
    )
    o_ref, memory_ref, normalizer_ref = naive_infini_attention(
        q, k, v, segment=segment, gate=gate, rule=rule
    )
    assert_close("o", o_ref, o, FP64_TOL["output"])
    assert_close("memory", memory_ref, state.memory, FP64_TOL["state"])
    assert_close("normalizer", normalizer_ref, state.normalizer, FP64_TOL["state"])
    refs = [o_ref, memory_ref, normalizer_ref]
    cotangents = cotangents_like(refs, torch.Generator().manual_seed(SEED + 1))
    grads = vjp([o, state.memory, state.normalizer], cotangents, inputs.values())
    grads_ref = vjp(refs, cotangents, inputs.values())
    for name, got, ref in zip(inputs, grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


@pytest.mark.parametrize("rule", INFINI_RULES)
def test_split_sequence_and_single_steps_equal_full(rule):
    """Pieces that cut segments anywhere, then one token at a time, equal one call."""
    inputs = make_inputs(50)
    q, k, v, gate = (x.detach() for x in inputs.values())
    o_full, state_full = infini_attention(
        q, k, v, segment=8, gate=gate, rule=rule, output_final_state=True
    )
    state, outputs, start = None, [], 0
    for piece in (5, 1, 13, 8, *([1] * 23)):
        part = (x[:, start : start + piece] for x in (q, k, v))
        o, state = infini_attention(
            *part, segment=8, gate=gate, rule=rule, initial_state=state, output_final_state=True
        )
        outputs.append(o)
        start += piece
    assert start == 50 and state.seen == 50
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("memory", state_full.memory, state.memory, FP64_TOL["state"])
    assert torch.equal(state_full.keys, state.keys)


def test_memory_is_read_before_the_segment_is_written():
    """With the gate fully open, the first segment reads an empty memory: outputs exactly 0."""
    inputs = make_inputs(20)
    q, k, v, _ = (x.detach() for x in inputs.values())
    o, _ = infini_attention(q, k, v, segment=8, gate=torch.ones(H, dtype=q.dtype))
    assert torch.all(o[:, :8] == 0)
    assert torch.all(o[:, 8:].abs().sum(dim=-1) > 0)


def test_float32_close_to_float64_reference():
    inputs64 = make_inputs(50)
    q, k, v, gate = (x.detach().float() for x in inputs64.values())
    o32, _ = infini_attention(q, k, v, segment=16, gate=gate)
    q64, k64, v64, gate64 = inputs64.values()
    o_ref, _, _ = naive_infini_attention(q64, k64, v64, segment=16, gate=gate64)
    assert o32.dtype == torch.float32
    assert_close("o", o_ref, o32, FP32_TOL["output"])


def test_bad_arguments_are_rejected():
    q, k, v, gate = (x.detach() for x in make_inputs(10).values())
    with pytest.raises(ValueError, match=r"rule must be one of"):
        infini_attention(q, k, v, segment=4, gate=gate, rule="outer")
    with pytest.raises(ValueError, match=r"segment must be >= 1"):
        infini_attention(q, k, v, segment=0, gate=gate)
    with pytest.raises(ValueError, match=r"gate must have shape \[H\]"):
        infini_attention(q, k, v, segment=4, gate=gate[:1])
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match=r"eps must be finite and > 0"):
            infini_attention(q, k, v, segment=4, gate=gate, eps=eps)
    wrong = InfiniState.empty(B, 5, H, K, V, dtype=q.dtype)
    with pytest.raises(ValueError, match=r"initial_state.keys must have shape"):
        infini_attention(q, k, v, segment=4, gate=gate, initial_state=wrong)
