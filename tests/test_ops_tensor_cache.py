"""Tensor Cache: parallel chunked form vs per-token reference vs streaming ring buffer.

Exact semantics under test: query t sees the window [t-W+1, t] (L1) and a memory holding
exactly the tokens <= t-W (L2). The public code this replaces had a token in neither path, a
window one token wider in training than in streaming, writes on insert in training, chunk-frozen
reads and bf16 decay (docs/layers.md lists them); each test below would fail on one of those.
The paper's training-time variants (writes of every token, the chunk-mean shortcut, the
chunk-start delta residual) are opt-in switches, tested against their own per-token references.
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


# --------------------------------------------------------------------------------------------
# Ablation switches (Tensor Cache §3.4, §4.6, §5, App. A.1-A.3): each against the per-token
# reference, with gradients; the streaming ones also step == parallel and split == full.
# --------------------------------------------------------------------------------------------

SWITCH_T, SWITCH_W = 23, 5  # T is not a multiple of any chunk size used below
SLOTS = 3


def switch_options(name, heads=H, key_dim=K, seed=SEED + 10, dtype=torch.float64):
    """Keyword options of one switch; tensors are fresh leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(x):
        return x.to(dtype).requires_grad_()

    slots = dict(
        slot_keys=leaf(torch.randn(heads, SLOTS, key_dim, generator=gen, dtype=torch.float64)),
        slot_top_k=2,
        slot_temperature=0.5,
    )
    slow = dict(
        slow_log_decay=leaf(torch.log(torch.linspace(0.97, 0.999, heads, dtype=torch.float64))),
        slow_rate=leaf(torch.linspace(0.1, 0.02, heads, dtype=torch.float64)),
        slow_weight=leaf(torch.linspace(0.6, 0.3, heads, dtype=torch.float64)),
    )
    return {
        "train_writes_all": dict(train_writes="all"),
        "chunk_mean": dict(write_mode="chunk_mean"),
        "chunk_mean_all": dict(write_mode="chunk_mean", train_writes="all"),
        "chunk_start_residual": dict(delta_residual="chunk_start"),
        "normalize_queries": dict(normalize_queries=True),
        "raw_keys": dict(normalize_keys=False),
        "value_scale": dict(value_scale=0.5),
        "slots": slots,
        "slots_top_1": {**slots, "slot_top_k": 1},
        "two_timescales": slow,
        "slots_and_two_timescales": {**slots, **slow},
    }[name]


SWITCHES = [
    "train_writes_all", "chunk_mean", "chunk_mean_all", "chunk_start_residual",
    "normalize_queries", "raw_keys", "value_scale", "slots", "slots_top_1", "two_timescales",
    "slots_and_two_timescales",
]
# switches the streaming step implements (the others are training-only approximations)
STREAMING_SWITCHES = [
    "normalize_queries", "raw_keys", "value_scale", "slots", "slots_top_1", "two_timescales",
    "slots_and_two_timescales",
]


def switch_cases(names):
    """(switch, rule) pairs; the chunk-start residual exists for the delta rule only."""
    return [
        (name, rule)
        for name in names
        for rule in RULES
        if name != "chunk_start_residual" or rule == "delta"
    ]


def detached(options):
    return {n: x.detach() if torch.is_tensor(x) else x for n, x in options.items()}


def tensors_of(options):
    return {name: x for name, x in options.items() if torch.is_tensor(x)}


@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("switch, rule", switch_cases(SWITCHES))
def test_switch_matches_per_token_reference(switch, rule, chunk_size):
    """Both paths, the final memory and every gradient, fp64, T = 23 with C = 4 and 16."""
    inputs = make_inputs(rule, length=SWITCH_T)
    options = switch_options(switch)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = dict(window=SWITCH_W, **memory_args(inputs, rule), **options)
    local, read, state = tensor_cache_paths(
        q, k, v, chunk_size=chunk_size, output_final_state=True, **args
    )
    local_ref, read_ref, memory_ref = naive_tensor_cache_paths(
        q, k, v, chunk_size=chunk_size, **args
    )
    assert_close("o_local", local_ref, local, FP64_TOL["output"])
    assert_close("o_memory", read_ref, read, FP64_TOL["output"])
    assert_close("final_memory", memory_ref, state.memory, FP64_TOL["state"])
    assert read.abs().max() > 1e-3  # the memory path is exercised

    leaves = {n: t for n, t in inputs.items() if n != "gate"} | tensors_of(options)
    cotangents = cotangents_like([read_ref, memory_ref], torch.Generator().manual_seed(SEED + 3))
    grads = vjp([read, state.memory], cotangents, leaves.values())
    grads_ref = vjp([read_ref, memory_ref], cotangents, leaves.values())
    for name, got, ref in zip(leaves, grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


def _tiny_inputs(rule, seed=SEED + 20):
    """B = 1, T = 7, H = 2, K = V = 3 leaves for gradcheck."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 7, 2, 3)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    log_decay = torch.log(torch.tensor([0.8, 0.95], dtype=torch.float64))
    rate = torch.tensor([0.4, 0.2], dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, log_decay, rate)]


@pytest.mark.parametrize(
    "switch, rule", [(s, r) for s, r in switch_cases(SWITCHES) if r != "wedge"]
)
def test_switch_gradcheck(switch, rule):
    """torch.autograd.gradcheck of both paths and the final memory on tiny fp64 inputs."""
    options = switch_options(switch, heads=2, key_dim=3)
    extra = tensors_of(options)
    fixed = {n: x for n, x in options.items() if not torch.is_tensor(x)}

    def run(q, k, v, log_decay, rate, *extra_values):
        local, read, state = tensor_cache_paths(
            q, k, v, window=2, log_decay=log_decay, rate=rate, rule=rule, chunk_size=3,
            output_final_state=True, **fixed, **dict(zip(extra, extra_values, strict=True)),
        )
        return local, read, state.memory

    assert torch.autograd.gradcheck(run, (*_tiny_inputs(rule), *extra.values()), fast_mode=True)


@pytest.mark.parametrize("prefill", [0, 7])
@pytest.mark.parametrize("switch, rule", switch_cases(STREAMING_SWITCHES))
def test_switch_streaming_step_equals_parallel_forward(switch, rule, prefill):
    """Ring-buffer steps (after an optional parallel prefill) equal the parallel outputs and
    the final (multi-bank) memory."""
    inputs = make_inputs(rule, length=SWITCH_T)
    q, k, v, gate = (inputs[n].detach() for n in ("q", "k", "v", "gate"))
    options = detached(switch_options(switch))
    params = detached(memory_args(inputs, rule))
    args = dict(gate=gate, **params, **options)
    o_full, state_full = tensor_cache(
        q, k, v, window=SWITCH_W, chunk_size=8, output_final_state=True, **args
    )
    outputs, state = [], None
    if prefill:
        o_head, state = tensor_cache(
            *(x[:, :prefill] for x in (q, k, v)), window=SWITCH_W, chunk_size=8,
            output_final_state=True, **args,
        )
        outputs.append(o_head)
    else:
        banks = state_full.memory.shape[2] if state_full.memory.ndim == 5 else 1
        state = TensorCacheState.empty(B, SWITCH_W, H, K, v.shape[-1], banks=banks, dtype=q.dtype)
    for t in range(prefill, SWITCH_T):
        o_t, state = tensor_cache_step(q[:, t], k[:, t], v[:, t], state, **args)
        outputs.append(o_t[:, None])
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("memory", state_full.memory, state.memory, FP64_TOL["state"])


@pytest.mark.parametrize(
    "switch, rule",
    [("train_writes_all", r) for r in RULES] + switch_cases(["slots_and_two_timescales"]),
)
def test_switch_split_sequence_equals_full(switch, rule):
    """Pieces of 3, 1, 9 and 10 tokens carrying ring + memory equal one call."""
    inputs = make_inputs(rule, length=SWITCH_T)
    q, k, v, gate = (inputs[n].detach() for n in ("q", "k", "v", "gate"))
    options = detached(switch_options(switch))
    params = detached(memory_args(inputs, rule))
    args = dict(window=SWITCH_W, gate=gate, chunk_size=4, **params, **options)
    o_full, state_full = tensor_cache(q, k, v, output_final_state=True, **args)
    state, outputs, start = None, [], 0
    for piece in (3, 1, 9, 10):
        part = (x[:, start : start + piece] for x in (q, k, v))
        o, state = tensor_cache(*part, initial_state=state, output_final_state=True, **args)
        outputs.append(o)
        start += piece
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("memory", state_full.memory, state.memory, FP64_TOL["state"])


def _paths(rule, length=SWITCH_T, **options):
    """Both paths and the final state on the first ``length`` tokens of the T = 23 inputs."""
    inputs = make_inputs(rule, length=SWITCH_T)
    q, k, v = (inputs[n].detach()[:, :length] for n in ("q", "k", "v"))
    params = detached(memory_args(inputs, rule))
    return tensor_cache_paths(
        q, k, v, window=SWITCH_W, output_final_state=True, **{**params, **options}
    )


@pytest.mark.parametrize("chunk_size", [1, 6])
def test_chunk_start_residual_is_exact_at_chunk_one_and_not_beyond(chunk_size):
    """C = 1: the chunk-start memory is the previous memory, so the delta rule is exact."""
    _, exact, exact_state = _paths("delta", chunk_size=chunk_size)
    _, approx, approx_state = _paths("delta", chunk_size=chunk_size, delta_residual="chunk_start")
    if chunk_size == 1:
        assert_close("o_memory", exact, approx, FP64_TOL["output"])
        assert_close("memory", exact_state.memory, approx_state.memory, FP64_TOL["state"])
    else:
        assert (exact - approx).abs().max() > 1e-6


@pytest.mark.parametrize("rule", RULES)
def test_chunk_mean_at_chunk_one_writes_every_token_and_reads_one_step_late(rule):
    """C = 1: one write per token (the final memory is exact) but each read sees the memory
    before its own step's write; C > 1 adds the cross-token products (a different memory)."""
    _, exact, exact_state = _paths(rule, chunk_size=1)
    _, mean, mean_state = _paths(rule, chunk_size=1, write_mode="chunk_mean")
    assert_close("memory", exact_state.memory, mean_state.memory, FP64_TOL["state"])
    _, _, late_state = _paths(rule, length=SWITCH_T - 1, chunk_size=1)
    inputs = make_inputs(rule, length=SWITCH_T)
    q_last = inputs["q"].detach()[:, -1]
    expected_last = (q_last[:, :, None, :] @ late_state.memory)[:, :, 0, :]
    assert_close("o_memory[T-1]", expected_last, mean[:, -1], FP64_TOL["output"])
    _, _, wide_state = _paths(rule, chunk_size=4, write_mode="chunk_mean")
    assert (wide_state.memory - exact_state.memory).abs().max() > 1e-3


def test_train_writes_all_is_linear_attention_over_every_past_token():
    """lambda = eta = 1, outer, train_writes="all": o_memory[t] = sum_{j<=t} (q_t.k_hat_j) v_j."""
    inputs = make_inputs("outer")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    ones = torch.ones(H, dtype=q.dtype)
    _, read, _ = tensor_cache_paths(
        q, k, v, window=6, log_decay=torch.zeros(H, dtype=q.dtype), rate=ones, train_writes="all"
    )
    scores = torch.einsum("bthd,bshd->bhts", q, F.normalize(k, dim=-1))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    expected = torch.einsum("bhts,bshv->bthv", scores * causal, v)
    assert_close("o_memory", expected, read, FP64_TOL["output"])


@pytest.mark.parametrize("rule", RULES)
def test_value_scale_scales_the_memory_read(rule):
    """Every rule is linear in the written values (delta: A and its prediction scale together)."""
    _, read, state = _paths(rule, chunk_size=8)
    _, scaled, scaled_state = _paths(rule, chunk_size=8, value_scale=2.5)
    assert_close("o_memory", 2.5 * read, scaled, FP64_TOL["output"])
    assert_close("memory", 2.5 * state.memory, scaled_state.memory, FP64_TOL["state"])


@pytest.mark.parametrize("rule", RULES)
def test_one_slot_and_silent_slow_memory_reduce_to_the_plain_memory(rule):
    """S = 1 slot is the plain memory; slow_weight = 0 leaves the read unchanged."""
    _, read, _ = _paths(rule, chunk_size=8)
    one_slot = torch.randn(H, 1, K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, slotted, state = _paths(rule, chunk_size=8, slot_keys=one_slot)
    assert state.memory.shape == (B, H, K, read.shape[-1])
    assert_close("one slot", read, slotted, FP64_TOL["output"])
    zeros = torch.zeros(H, dtype=torch.float64)
    _, silent, state = _paths(
        rule, chunk_size=8, slow_log_decay=zeros - 0.01, slow_rate=zeros + 0.1, slow_weight=zeros
    )
    assert state.memory.shape == (B, H, 2, K, read.shape[-1])
    assert_close("slow weight 0", read, silent, FP64_TOL["output"])


def test_hard_routing_writes_each_token_into_one_slot():
    """Slot keys aligned with two key directions: each token lands in its own slot only."""
    heads, key_dim, length = 1, 4, 9
    basis = torch.eye(key_dim, dtype=torch.float64)
    k = torch.stack([basis[t % 2] for t in range(length)])[None, :, None, :]
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(1, length, heads, 3, generator=gen, dtype=torch.float64)
    _, _, state = tensor_cache_paths(
        k.clone(), k, v, window=1, log_decay=torch.zeros(1, dtype=torch.float64),
        rate=torch.ones(1, dtype=torch.float64), slot_keys=basis[None, :2], output_final_state=True,
    )
    evicted = range(length - 1)  # window 1: tokens 0 .. T-2 are in the memory
    for slot in (0, 1):
        expected = sum(
            basis[t % 2][:, None] * v[0, t, 0][None, :] for t in evicted if t % 2 == slot
        )
        assert_close(f"slot {slot}", expected, state.memory[0, 0, slot], FP64_TOL["state"])


def test_switch_arguments_are_rejected():
    inputs = make_inputs("outer")
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    log_decay, rate, gate = (inputs[n].detach() for n in ("log_decay", "rate", "gate"))
    args = dict(window=4, log_decay=log_decay, rate=rate, gate=gate)
    cases = [
        (dict(train_writes="inserted"),
         r"train_writes must be one of 'evicted', 'all'; got 'inserted'"),
        (dict(write_mode="mean"), r"write_mode must be one of 'token', 'chunk_mean'; got 'mean'"),
        (dict(delta_residual="frozen"),
         r"delta_residual must be one of 'exact', 'chunk_start'; got"),
        (dict(delta_residual="chunk_start"), r"delta_residual='chunk_start' needs rule='delta'"),
        (dict(rule="delta", delta_residual="chunk_start", write_mode="chunk_mean"),
         r"delta_residual='chunk_start' needs write_mode='token'"),
        (dict(value_scale=0.0), r"value_scale must be finite and > 0"),
        (dict(value_scale=float("nan")), r"value_scale must be finite and > 0"),
        (dict(slot_keys=torch.zeros(H, 3, K + 1, dtype=q.dtype)),
         r"slot_keys must have shape \(H, S, K\)"),
        (dict(slot_keys=torch.ones(H, 3, K, dtype=q.dtype), slot_top_k=4),
         r"slot_top_k must be in \[1, S=3\]"),
        (dict(slot_top_k=2), r"slot_top_k needs slot_keys"),
        (dict(slot_keys=torch.ones(H, 3, K, dtype=q.dtype), slot_temperature=-1.0),
         r"slot_temperature must be finite and > 0"),
        (dict(slow_log_decay=log_decay),
         r"needs slow_log_decay, slow_rate and slow_weight together"),
        (dict(slow_log_decay=-log_decay, slow_rate=rate, slow_weight=rate),
         r"slow_log_decay must be <= 0"),
        (dict(slow_log_decay=log_decay, slow_rate=rate[:1], slow_weight=rate),
         r"slow_rate must have shape \[H\]"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            tensor_cache(q, k, v, **args, **options)
    with pytest.raises(TypeError, match=r"normalize_queries must be a bool"):
        tensor_cache(q, k, v, normalize_queries=1, **args)
    with pytest.raises(TypeError, match=r"slot_keys must be a floating-point tensor"):
        tensor_cache(q, k, v, slot_keys=torch.ones(H, 3, K, dtype=torch.int64), **args)
    # a single-bank state cannot continue a two-timescale memory; the step refuses it untouched
    state = TensorCacheState.empty(B, 4, H, K, v.shape[-1], dtype=q.dtype)
    slow = dict(slow_log_decay=log_decay, slow_rate=rate, slow_weight=rate)
    with pytest.raises(ValueError, match=r"initial_state.memory must have shape"):
        tensor_cache(q, k, v, initial_state=state, **args, **slow)
    with pytest.raises(ValueError, match=r"state.memory must have shape"):
        tensor_cache_step(
            q[:, 0], k[:, 0], v[:, 0], state, log_decay=log_decay, rate=rate, gate=gate, **slow
        )
    assert state.seen == 0 and not state.keys.any()
    # the training-only switches do not exist at inference
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'train_writes'"):
        tensor_cache_step(q[:, 0], k[:, 0], v[:, 0], state, log_decay=log_decay, rate=rate,
                          gate=gate, train_writes="all")
