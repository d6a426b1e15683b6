"""Tensor Cache: parallel chunked form vs per-token reference vs streaming ring buffer.

Exact semantics under test: query t sees the window [t-W+1, t] (L1) and a memory holding
exactly the tokens <= t-W (L2). The public code this replaces had a token in neither path, a
window one token wider in training than in streaming, writes on insert in training, chunk-frozen
reads and bf16 decay (../shared/research/layer_anchors.md 2.6); each test below would fail on one
of those.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from svtoolkit.torch.ops import (
    RULES,
    TensorCacheState,
    softmax_attention,
    tensor_cache,
    tensor_cache_paths,
    tensor_cache_step,
)
from svtoolkit.torch.ops._testing import FP32_TOL, FP64_TOL, assert_close, cotangents_like, vjp
from svtoolkit.torch.ops.naive import naive_tensor_cache_paths

SEED = 4004
B, T, H, K = 2, 45, 2, 12


def make_inputs(rule, length=T, seed=SEED, dtype=torch.float64):
    """q, k, v and per-head (log_decay, rate, gate); V = K for wedge, else V = 10."""
    gen = torch.Generator().manual_seed(seed)
    value_dim = K if rule == "wedge" else 10

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = {
        "q": randn(B, length, H, K),
        "k": randn(B, length, H, K),
        "v": randn(B, length, H, value_dim),
        "log_decay": torch.log(torch.tensor([0.9, 0.995], dtype=torch.float64)),
        "rate": torch.tensor([0.3, 0.05], dtype=torch.float64),
        "gate": torch.tensor([0.25, 0.8], dtype=torch.float64),
    }
    return {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}


def memory_args(inputs, rule):
    return dict(log_decay=inputs["log_decay"], rate=inputs["rate"], rule=rule)


@pytest.mark.parametrize("window", [5, 20])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("rule", RULES)
def test_paths_match_per_token_reference(rule, chunk_size, window):
    """Both paths, the final memory and the gradients of q, k, v, lambda, eta and the gate."""
    inputs = make_inputs(rule)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    local, memory_read, state = tensor_cache_paths(
        q,
        k,
        v,
        window=window,
        chunk_size=chunk_size,
        output_final_state=True,
        **memory_args(inputs, rule),
    )
    local_ref, memory_read_ref, memory_ref = naive_tensor_cache_paths(
        q, k, v, window=window, **memory_args(inputs, rule)
    )
    assert_close("o_local", local_ref, local, FP64_TOL["output"])
    assert_close("o_memory", memory_read_ref, memory_read, FP64_TOL["output"])
    assert_close("final_memory", memory_ref, state.memory, FP64_TOL["state"])

    gate = inputs["gate"][None, None, :, None]
    fused, fused_ref = local + gate * memory_read, local_ref + gate * memory_read_ref
    cotangents = cotangents_like([fused_ref, memory_ref], torch.Generator().manual_seed(SEED + 1))
    grads = vjp([fused, state.memory], cotangents, inputs.values())
    grads_ref = vjp([fused_ref, memory_ref], cotangents, inputs.values())
    for name, got, ref in zip(inputs, grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


@pytest.mark.parametrize("rule", RULES)
def test_every_past_token_is_visible_to_exactly_one_path(rule):
    """d o_local[t] / d v_j != 0 iff t-W+1 <= j <= t; d o_memory[t] / d v_j != 0 iff j <= t-W."""
    length, window = 14, 4
    inputs = make_inputs(rule, length=length)
    q, k, v = (inputs[n].detach()[:1] for n in ("q", "k", "v"))
    args = dict(window=window, chunk_size=4, **memory_args(inputs, rule))

    gen = torch.Generator().manual_seed(SEED + 2)

    def seen_by(path):
        """[t, j] -> does output t of the path depend on v_j (one backward pass per t)."""
        values = v.clone().requires_grad_()
        out = tensor_cache_paths(q, k, values, **args)[path]
        rows = []
        for t in range(length):
            probe = torch.randn(out[:, t].shape, generator=gen, dtype=out.dtype)
            (grad,) = torch.autograd.grad((out[:, t] * probe).sum(), values, retain_graph=True)
            rows.append(grad.abs().sum(dim=(0, 2, 3)) > 0)
        return torch.stack(rows)

    local, memory = seen_by(0), seen_by(1)
    for t in range(length):
        for j in range(length):
            expected_local = t - window + 1 <= j <= t
            expected_memory = j <= t - window
            assert bool(local[t, j]) == expected_local, (t, j)
            assert bool(memory[t, j]) == expected_memory, (t, j)
            assert int(local[t, j]) + int(memory[t, j]) == (1 if j <= t else 0), (t, j)


@pytest.mark.parametrize("rule", RULES)
def test_split_sequence_with_carried_state_equals_full(rule):
    """Pieces shorter and longer than W (including single tokens) carry ring + memory exactly."""
    inputs = make_inputs(rule)
    q, k, v, gate = (inputs[n].detach() for n in ("q", "k", "v", "gate"))
    args = dict(window=7, gate=gate, chunk_size=16, **memory_args(inputs, rule))
    o_full, state_full = tensor_cache(q, k, v, output_final_state=True, **args)
    state, outputs, start = None, [], 0
    for piece in (3, 1, 9, 20, 12):
        part = (x[:, start : start + piece] for x in (q, k, v))
        o, state = tensor_cache(*part, initial_state=state, output_final_state=True, **args)
        outputs.append(o)
        start += piece
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("memory", state_full.memory, state.memory, FP64_TOL["state"])
    assert torch.equal(state_full.keys, state.keys) and torch.equal(state_full.values, state.values)
    assert state.seen == state_full.seen == T


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("prefill", [0, 3, 17])
def test_streaming_step_equals_parallel_forward(rule, prefill):
    """Ring-buffer steps (after an optional parallel prefill) equal the parallel outputs, state."""
    inputs = make_inputs(rule)
    q, k, v, gate = (inputs[n].detach() for n in ("q", "k", "v", "gate"))
    window, params = 7, memory_args(inputs, rule)
    params = {name: p.detach() if torch.is_tensor(p) else p for name, p in params.items()}
    o_full, state_full = tensor_cache(
        q, k, v, window=window, gate=gate, chunk_size=16, output_final_state=True, **params
    )
    if prefill:
        head = (x[:, :prefill] for x in (q, k, v))
        o_head, state = tensor_cache(
            *head, window=window, gate=gate, chunk_size=16, output_final_state=True, **params
        )
        outputs = [o_head]
    else:
        state, outputs = TensorCacheState.empty(B, window, H, K, v.shape[-1], dtype=q.dtype), []
    nbytes = state.nbytes()
    for t in range(prefill, T):
        o_t, state = tensor_cache_step(q[:, t], k[:, t], v[:, t], state, gate=gate, **params)
        outputs.append(o_t[:, None])
        assert state.nbytes() == nbytes  # constant state
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("memory", state_full.memory, state.memory, FP64_TOL["state"])
    assert torch.equal(state_full.keys, state.keys) and state.seen == T


def test_outer_rule_without_decay_is_linear_attention_over_evicted_tokens():
    """lambda = eta = 1, outer: o_memory[t] = sum_{j <= t-W} (q_t . k_hat_j) v_j, summed here."""
    inputs = make_inputs("outer")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    window = 6
    ones = torch.ones(H, dtype=q.dtype)
    _, memory_read, _ = tensor_cache_paths(
        q, k, v, window=window, log_decay=torch.zeros(H, dtype=q.dtype), rate=ones, rule="outer"
    )
    scores = torch.einsum("bthd,bshd->bhts", q, F.normalize(k, dim=-1))
    evicted = torch.ones(T, T, dtype=torch.bool).tril(-window)  # j <= t - W
    expected = torch.einsum("bhts,bshv->bthv", scores * evicted, v)
    assert_close("o_memory", expected, memory_read, FP64_TOL["output"])


def test_closed_gate_is_sliding_window_attention():
    inputs = make_inputs("delta")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    params = {n: p.detach() for n, p in memory_args(inputs, "delta").items() if n != "rule"}
    o, _ = tensor_cache(
        q, k, v, window=9, gate=torch.zeros(H, dtype=q.dtype), rule="delta", **params
    )
    o_window, _ = softmax_attention(q, k, v, window=9)
    assert_close("o", o_window, o, FP64_TOL["output"])


@pytest.mark.parametrize("rule", RULES)
def test_float32_parallel_close_to_float64_reference(rule):
    inputs64 = make_inputs(rule)
    inputs32 = {n: t.detach().float() for n, t in inputs64.items()}
    local, memory_read, _ = tensor_cache_paths(
        inputs32["q"], inputs32["k"], inputs32["v"], window=5, **memory_args(inputs32, rule)
    )
    local_ref, memory_read_ref, _ = naive_tensor_cache_paths(
        inputs64["q"], inputs64["k"], inputs64["v"], window=5, **memory_args(inputs64, rule)
    )
    assert local.dtype == memory_read.dtype == torch.float32
    assert_close("o_local", local_ref, local, FP32_TOL["output"])
    assert_close("o_memory", memory_read_ref, memory_read, FP32_TOL["output"])


def test_bad_arguments_are_rejected():
    inputs = make_inputs("outer")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    log_decay, rate, gate = (inputs[n].detach() for n in ("log_decay", "rate", "gate"))
    args = dict(window=4, log_decay=log_decay, rate=rate, gate=gate)
    with pytest.raises(ValueError, match=r"rule must be one of"):
        tensor_cache(q, k, v, rule="hebbian", **args)
    with pytest.raises(ValueError, match=r"rule='wedge' needs K == V"):
        tensor_cache(q, k, v, rule="wedge", **args)
    with pytest.raises(ValueError, match=r"log_decay must be <= 0"):
        tensor_cache(q, k, v, **{**args, "log_decay": -log_decay})
    with pytest.raises(ValueError, match=r"rate must have shape \[H\]"):
        tensor_cache(q, k, v, **{**args, "rate": rate[:1]})
    with pytest.raises(ValueError, match=r"gate must have shape \[H\] or \[B, T, H\]"):
        tensor_cache(q, k, v, **{**args, "gate": gate[None]})
    with pytest.raises(ValueError, match=r"window must be >= 1"):
        tensor_cache(q, k, v, **{**args, "window": 0})
    wrong = TensorCacheState.empty(B, 5, H, K, v.shape[-1], dtype=q.dtype)
    with pytest.raises(ValueError, match=r"initial_state.keys must have shape"):
        tensor_cache(q, k, v, initial_state=wrong, **args)
    with pytest.raises(TypeError, match=r"state must be a TensorCacheState"):
        tensor_cache_step(
            q[:, 0], k[:, 0], v[:, 0], None, log_decay=log_decay, rate=rate, gate=gate
        )
    nan_decay = log_decay.clone()
    nan_decay[0] = float("nan")
    with pytest.raises(ValueError, match=r"log_decay must not contain NaN"):
        tensor_cache(q, k, v, **{**args, "log_decay": nan_decay})


@pytest.mark.parametrize("gate_shape", [(1,), (H + 1,), (B, 1, H), (1, H), (B, H, 1)])
def test_streaming_gate_shape_is_checked_like_the_parallel_one(gate_shape):
    """The step accepted gates of shape (1,) or (B, 1, H) and broadcast them silently."""
    inputs = make_inputs("outer")
    q, k, v = (inputs[n].detach()[:, 0] for n in ("q", "k", "v"))
    log_decay, rate = inputs["log_decay"].detach(), inputs["rate"].detach()
    state = TensorCacheState.empty(B, 4, H, K, v.shape[-1], dtype=q.dtype)
    with pytest.raises(ValueError, match=r"gate must have shape \[H\]"):
        tensor_cache_step(
            q, k, v, state, log_decay=log_decay, rate=rate, gate=torch.ones(gate_shape)
        )
    assert state.seen == 0 and not state.keys.any()  # refused before any change
    o, _ = tensor_cache_step(q, k, v, state, log_decay=log_decay, rate=rate, gate=q[..., 0])
    assert o.shape == v.shape  # a [B, H] gate is accepted


def _three_paths(rule, log_decay, dtype, window=4, length=19):
    """Parallel, streaming and (fp64) per-token outputs with the given log_decay."""
    inputs = make_inputs(rule, length=length)
    q, k, v, rate, gate = (inputs[n].detach() for n in ("q", "k", "v", "rate", "gate"))
    args = dict(log_decay=log_decay.to(dtype), rate=rate.to(dtype), rule=rule)
    o, _ = tensor_cache(
        q.to(dtype), k.to(dtype), v.to(dtype), window=window, gate=gate.to(dtype),
        chunk_size=8, **args,
    )
    state, steps = TensorCacheState.empty(B, window, H, K, v.shape[-1], dtype=dtype), []
    for t in range(length):
        qt, kt, vt = (x[:, t].to(dtype) for x in (q, k, v))
        o_t, state = tensor_cache_step(qt, kt, vt, state, gate=gate.to(dtype), **args)
        steps.append(o_t)
    local, read, _ = naive_tensor_cache_paths(
        q, k, v, window=window, log_decay=log_decay.double(), rate=rate, rule=rule
    )
    return o, torch.stack(steps, dim=1), local + gate[None, None, :, None] * read


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(
    "dtype, strongest", [(torch.float64, -float("inf")), (torch.float32, -120.0)]
)
def test_vanishing_decay_agrees_on_every_path(rule, dtype, strongest):
    """lambda = 0 (log_decay = -inf) or underflowing (fp32 exp(-120) = 0): the parallel delta
    rule divided by lambda (NaN) and -inf reached the scan as -inf * 0 = NaN."""
    log_decay = torch.tensor([-0.1, strongest], dtype=torch.float64)
    parallel, streaming, reference = _three_paths(rule, log_decay, dtype)
    tol = FP64_TOL["output"] if dtype == torch.float64 else FP32_TOL["output"]
    assert_close("parallel", reference, parallel, tol)
    assert_close("streaming", reference, streaming, tol)
