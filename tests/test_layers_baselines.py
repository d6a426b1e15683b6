"""The baseline attention modules: registry, causality, dtypes, streaming, gradients, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from svtoolkit.torch import (
    ATTENTION_LAYERS,
    GatedDeltaNet,
    LinearAttention,
    SlidingWindowAttention,
    SoftmaxAttention,
    TensorCache,
)
from svtoolkit.torch.layers import tensor_cache_layer_mask, tensor_cache_stack

SEED = 777
D_MODEL, N_HEADS, T = 24, 3, 23

# small windows, chunks and segments so that T = 23 crosses all their boundaries
OPTIONS = {
    "softmax": {},
    "sliding_window": {"window": 5},
    "streaming_llm": {"sinks": 2, "window": 5},
    "linear": {"chunk": 8},
    "deltanet": {"chunk": 8},
    "gated_deltanet": {"chunk": 8},
    "tensor_cache": {"window": 5, "chunk": 8},
    "infini": {"segment": 6},
}
# largest |y_before - y_after| / max|y| allowed at positions before the perturbation
CAUSAL_TOL = {torch.float32: 1e-6, torch.float64: 1e-13}
STREAM_TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def build(name: str, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(SEED)
    return ATTENTION_LAYERS[name](D_MODEL, N_HEADS, **OPTIONS[name]).to(dtype)


def make_x(dtype=torch.float64, length=T, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, length, D_MODEL, generator=gen, dtype=torch.float64).to(dtype)


def test_registry_lists_every_baseline_and_builds_with_defaults():
    # the SV layers are registered too; they are tested in test_sv_layers.py (their streaming
    # path is the exact gate, not the batched forward, so the stream tests here do not apply)
    assert set(ATTENTION_LAYERS) == set(OPTIONS) | {"sv", "sv_hybrid"}
    for name, cls in ATTENTION_LAYERS.items():
        layer = cls(32, 4)
        assert isinstance(layer, nn.Module), name
        assert layer(torch.zeros(1, 3, 32)).shape == (1, 3, 32), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_forward_shape_dtype_and_causality(name, dtype):
    """Changing tokens >= t0 never changes outputs < t0 (and does change the output at t0)."""
    layer = build(name, dtype)
    x = make_x(dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    gen = torch.Generator().manual_seed(SEED + 1)
    for t0 in (1, 7, 16):
        x_future = x.clone()
        x_future[:, t0:] += torch.randn(x[:, t0:].shape, generator=gen, dtype=torch.float64).to(
            dtype
        )
        y_future = layer(x_future)
        scale = y.abs().max().item()
        leak = (y_future[:, :t0] - y[:, :t0]).abs().max().item() / scale
        assert leak <= CAUSAL_TOL[dtype], f"{name}: future tokens moved past outputs by {leak:.2e}"
        assert (y_future[:, t0] - y[:, t0]).abs().max().item() > 1e-3 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_prefill_then_steps_equal_forward(name, dtype):
    """forward_with_state on 7 tokens, then step() one token at a time, equals forward()."""
    layer = build(name, dtype)
    x = make_x(dtype)
    with torch.no_grad():
        y = layer(x)
        y_head, state = layer.forward_with_state(x[:, :7])
        outputs = [y_head]
        for t in range(7, T):
            y_t, state = layer.step(x[:, t], state)
            outputs.append(y_t[:, None])
    err = (torch.cat(outputs, dim=1) - y).abs().max().item() / y.abs().max().item()
    assert err <= STREAM_TOL[dtype], f"{name}: streaming differs from forward by {err:.2e}"


@pytest.mark.parametrize("name", ["tensor_cache", "streaming_llm", "infini"])
def test_streaming_state_does_not_grow(name):
    layer = build(name)
    x = make_x(length=40)
    sizes = []
    with torch.no_grad():
        state = None
        for t in range(40):
            _, state = layer.step(x[:, t], state)
            sizes.append(state.nbytes())
    assert len(set(sizes[20:])) == 1


def test_softmax_cache_grows_with_the_sequence():
    layer = build("softmax")
    with torch.no_grad():
        _, short = layer.forward_with_state(make_x(length=5))
        _, long = layer.forward_with_state(make_x(length=20))
    assert long.nbytes() == 4 * short.nbytes()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_gradients_reach_every_parameter(name):
    layer = build(name)
    layer(make_x()).square().mean().backward()
    for pname, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, f"{name}.{pname} gets no gradient"


def test_tensor_cache_decay_is_computed_in_float32_log_space():
    """A bf16 module still computes log(lambda) in fp32 (the public code rounded 0.995 in bf16)."""
    layer = TensorCache(D_MODEL, N_HEADS, window=5).to(torch.bfloat16)
    log_decay, rate, gate = layer.memory_parameters()
    assert log_decay.dtype == rate.dtype == gate.dtype == torch.float32
    assert torch.all(log_decay < 0)
    y = layer(make_x(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"d_model \(25\) must be divisible by n_heads \(4\)"):
        SoftmaxAttention(25, 4)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, d_model=24\)"):
        build("softmax")(torch.zeros(2, 5, 23, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"floating-point tensor; got dtype torch.int64"):
        build("softmax")(torch.zeros(2, 5, 24, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x_t must have shape \(B, d_model=24\)"):
        build("tensor_cache").step(torch.zeros(2, 1, 24, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"rule must be one of"):
        TensorCache(D_MODEL, N_HEADS, rule="hebbian")
    with pytest.raises(ValueError, match=r"decay_init must be in \(0, 1\)"):
        TensorCache(D_MODEL, N_HEADS, decay_init=1.0)
    with pytest.raises(ValueError, match=r"normalize=True needs a non-negative feature map"):
        LinearAttention(D_MODEL, N_HEADS, feature_map="identity")
    with pytest.raises(ValueError, match=r"sinks must be >= 1"):
        ATTENTION_LAYERS["streaming_llm"](D_MODEL, N_HEADS, sinks=0)


# --------------------------------------------------------------------------------------------
# Ablation switches of the Tensor Cache and Gated DeltaNet layers
# --------------------------------------------------------------------------------------------


def build_with(cls, options, dtype=torch.float64):
    torch.manual_seed(SEED)
    return cls(D_MODEL, N_HEADS, **options).to(dtype)


def streaming_error(layer, x):
    """max |prefill(7) + steps - forward| / max |forward|, in eval mode without gradients."""
    layer.eval()
    with torch.no_grad():
        y = layer(x)
        y_head, state = layer.forward_with_state(x[:, :7])
        outputs = [y_head]
        for t in range(7, x.shape[1]):
            y_t, state = layer.step(x[:, t], state)
            outputs.append(y_t[:, None])
    return ((torch.cat(outputs, dim=1) - y).abs().max() / y.abs().max()).item()


def assert_every_parameter_learns(layer, x):
    layer.train()
    layer(x).square().mean().backward()
    for pname, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"{pname} gets no gradient"


GDN_CORNERS = [(True, True), (False, True), (True, False), (False, False)]


@pytest.mark.parametrize("use_decay, use_delta", GDN_CORNERS)
def test_gated_deltanet_corners_stream_exactly_and_learn(use_decay, use_delta):
    layer = build_with(GatedDeltaNet, dict(chunk=8, use_decay=use_decay, use_delta=use_delta))
    names = {name for name, _ in layer.named_parameters()}
    assert ("A_log" in names) == ("dt_bias" in names) == ("a_proj.weight" in names) == use_decay
    assert ("b_proj.weight" in names) == use_delta
    assert streaming_error(layer, make_x()) <= STREAM_TOL[torch.float64]
    assert_every_parameter_learns(layer, make_x())


def test_gated_deltanet_default_corner_is_unchanged_by_the_switches():
    """Both switches on (the default) builds the same parameters from the same seed."""
    default, explicit = build("gated_deltanet"), build_with(GatedDeltaNet, dict(chunk=8))
    x = make_x()
    assert torch.equal(default(x), explicit(x))


TC_STREAMING_OPTIONS = {
    "memory_proj": dict(memory_proj=True),
    "query_norm_value_scale": dict(normalize_queries=True, value_scale=0.5),
    "raw_keys": dict(normalize_keys=False),
    "slots": dict(slots=3, slot_top_k=2),
    "two_timescales": dict(two_timescales=True),
    "everything": dict(
        rule="delta", slots=2, slot_top_k=2, two_timescales=True, memory_proj=True,
        normalize_queries=True,
    ),
}


@pytest.mark.parametrize("name", list(TC_STREAMING_OPTIONS))
def test_tensor_cache_switches_stream_exactly_and_learn(name):
    layer = build_with(TensorCache, dict(window=5, chunk=8, **TC_STREAMING_OPTIONS[name]))
    assert streaming_error(layer, make_x()) <= STREAM_TOL[torch.float64]
    assert_every_parameter_learns(layer, make_x())


def test_separate_memory_projection_with_tied_weights_equals_one_projection():
    """W_tc = W_o gives W_o L1 + W_tc (g r) = W_o (L1 + g r): the single-projection layer."""
    one = build_with(TensorCache, dict(window=5, chunk=8))
    two = build_with(TensorCache, dict(window=5, chunk=8, memory_proj=True))
    with torch.no_grad():
        two.memory_out.weight.copy_(two.o_proj.weight)
    x = make_x()
    err = ((one(x) - two(x)).abs().max() / one(x).abs().max()).item()
    assert err <= 1e-14


@pytest.mark.parametrize(
    "options",
    [dict(train_writes="all"), dict(write_mode="chunk_mean"),
     dict(rule="delta", delta_residual="chunk_start")],
)
def test_training_only_switches_change_the_training_forward_only(options):
    """In training mode forward uses the switch; eval forward and streaming are the exact
    inference path, equal to the layer without the switch."""
    base = {"window": 5, "chunk": 8, "rule": options.get("rule", "outer")}
    plain = build_with(TensorCache, base)
    switched = build_with(TensorCache, {**base, **options})
    x = make_x()
    with torch.no_grad():
        plain.train(), switched.train()
        assert (plain(x) - switched(x)).abs().max() > 1e-6
        plain.eval(), switched.eval()
        assert torch.equal(plain(x), switched(x))
    assert streaming_error(switched, x) <= STREAM_TOL[torch.float64]


def test_layer_selection_mask():
    assert tensor_cache_layer_mask(4, "all") == (True,) * 4
    assert tensor_cache_layer_mask(4, "none") == (False,) * 4
    assert tensor_cache_layer_mask(4, 1) == (False, False, False, True)
    assert tensor_cache_layer_mask(4, 0) == tensor_cache_layer_mask(4, "none")
    for bad in (5, -1, "top", True, 1.0):
        message = r"layers must be 'all', 'none' or an int in \[0, n_layers=4\]"
        with pytest.raises(ValueError, match=message):
            tensor_cache_layer_mask(4, bad)


def test_unselected_layers_are_the_window_path_with_the_gate_off():
    """tensor_cache_stack puts SlidingWindowAttention (same window) where the mask is False;
    with the same projections it equals a Tensor Cache whose gate is closed."""
    stack = tensor_cache_stack(D_MODEL, N_HEADS, 3, layers=2, window=5, chunk=8)
    assert [type(layer) for layer in stack] == [SlidingWindowAttention, TensorCache, TensorCache]
    window_layer = stack[0].double()
    assert window_layer.window == stack[1].window == 5
    closed = build_with(TensorCache, dict(window=5, chunk=8))
    with torch.no_grad():
        closed.gate_logit.fill_(-float("inf"))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(window_layer, proj).weight.copy_(getattr(closed, proj).weight)
    x = make_x()
    err = ((window_layer(x) - closed(x)).abs().max() / window_layer(x).abs().max()).item()
    assert err <= 1e-14


def test_switch_options_are_rejected():
    cases = [
        (dict(train_writes="insert"), ValueError,
         r"train_writes must be one of 'evicted', 'all'; got 'insert'"),
        (dict(write_mode="mean"), ValueError,
         r"write_mode must be one of 'token', 'chunk_mean'; got 'mean'"),
        (dict(delta_residual="chunk_start"), ValueError,
         r"delta_residual='chunk_start' needs rule='delta'"),
        (dict(slots=0), ValueError, r"slots must be >= 1"),
        (dict(slots=2, slot_top_k=3), ValueError, r"slot_top_k must be in \[1, slots=2\]"),
        (dict(value_scale=-1.0), ValueError, r"value_scale must be finite and > 0"),
        (dict(two_timescales=True, slow_decay_init=1.0), ValueError,
         r"slow_decay_init must be in \(0, 1\)"),
        (dict(memory_proj=1), TypeError, r"memory_proj must be a bool"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            TensorCache(D_MODEL, N_HEADS, **options)
    with pytest.raises(TypeError, match=r"use_delta must be a bool"):
        GatedDeltaNet(D_MODEL, N_HEADS, use_delta="no")


@pytest.mark.parametrize("cls,options", [(SoftmaxAttention, {}),
                                         (SlidingWindowAttention, {"window": 5})])
def test_qk_norm_is_softmax_over_rms_normalised_queries_and_keys(cls, options):
    """qk_norm=True: o_t = sum_j softmax_j(q^_t . k^_j / sqrt(D)) v_j with q^, k^ of norm
    sqrt(D) (a per-token loop in fp64), and streaming equals the forward."""
    torch.manual_seed(3)
    layer = cls(8, 2, qk_norm=True, **options).double()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    q, k, v = (layer._heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    D, W = layer.head_dim, options.get("window", 11)
    q = q / q.pow(2).mean(-1, keepdim=True).add(torch.finfo(torch.float64).eps).sqrt()
    k = k / k.pow(2).mean(-1, keepdim=True).add(torch.finfo(torch.float64).eps).sqrt()
    rows = []
    for t in range(11):
        lo = max(0, t - W + 1)
        w = torch.softmax(torch.einsum("bhd,bjhd->bhj", q[:, t], k[:, lo:t + 1]) / D ** 0.5, -1)
        rows.append(torch.einsum("bhj,bjhd->bhd", w, v[:, lo:t + 1]))
    expected = layer.o_proj(torch.stack(rows, 1).flatten(-2))
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    plain = cls(8, 2, **options).double()
    plain.load_state_dict(layer.state_dict())
    assert (plain(x) - layer(x)).abs().max() > 1e-3  # the option changes the layer
    y0, state = layer.forward_with_state(x[:, :4])
    y1, _ = layer.forward_with_state(x[:, 4:], state)
    torch.testing.assert_close(torch.cat([y0, y1], 1), layer(x), rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="qk_norm must be a bool"):
        cls(8, 2, qk_norm=1, **options)
