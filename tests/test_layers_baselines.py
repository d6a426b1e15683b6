"""The baseline attention modules: registry, causality, dtypes, streaming, gradients, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from svtoolkit.torch import ATTENTION_LAYERS, LinearAttention, SoftmaxAttention, TensorCache

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
