"""The MLX twins of the SV-Attention layers against the torch layers on the same weights.

Both training paths are approximate (FISTA partition + ridged solve) but run the same algorithm,
so they are compared with each other: outputs, gate coefficients, gate flags and the gradients
of every projection. Tolerances (named below) are what float32 on a CPU reaches honestly:
measured 1e-6 on outputs and 6e-6 relative on gradients at this size; float64 MLX is limited by
MLX 0.32's float32-accurate float64 ``exp`` (measured 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from svtoolkit.mlx import CausalSVAttention, HybridSVAttention, SVStreamState  # noqa: E402
from svtoolkit.mlx import from_torch  # noqa: E402
from svtoolkit.torch import CausalSVAttention as TorchCausal  # noqa: E402
from svtoolkit.torch import HybridSVAttention as TorchHybrid  # noqa: E402

SEED = 2024
PAIRS = [(TorchCausal, CausalSVAttention), (TorchHybrid, HybridSVAttention)]
IDS = ["causal", "hybrid"]
DTYPES = {torch.float32: mx.float32, torch.float64: mx.float64}
#: max |torch - MLX| on layer outputs (O(1) values), per dtype
OUTPUT_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
#: max |torch - MLX| on the gate coefficients (C = 0.25)
ALPHA_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
#: max |grad_torch - grad_MLX| / max |grad_torch| per projection weight
GRAD_TOL = {torch.float32: 5e-5, torch.float64: 5e-6}


def _pair(torch_cls, dtype=torch.float32, **options):
    torch.manual_seed(SEED)
    opts = {"chunk": 8, "C": 0.25, **options}
    layer = torch_cls(32, 4, **opts).to(dtype)
    return layer, from_torch(layer)


def _x(B=2, T=29, dtype=torch.float32, seed=SEED):
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = x.to(dtype)
    return x, mx.array(x.numpy(), dtype=DTYPES[dtype])


def _np(a):
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.array(a)


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_training_paths_agree(pair, dtype):
    layer, twin = _pair(pair[0], dtype)
    assert isinstance(twin, pair[1])
    x, xm = _x(dtype=dtype)
    y, ym = _np(layer(x)), _np(twin(xm))
    assert ym.dtype == y.dtype and ym.shape == y.shape
    assert np.abs(y - ym).max() <= OUTPUT_TOL[dtype]


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gate_coefficients_and_flags_agree(pair, dtype):
    layer, twin = _pair(pair[0], dtype)
    x, xm = _x(dtype=dtype)
    gate, gate_m = layer.gate(x), twin.gate(xm)
    assert gate.ends == gate_m.ends == [8, 16, 24]
    assert np.array_equal(_np(gate.gated), _np(gate_m.gated)) and _np(gate.gated).all()
    alpha, alpha_m = _np(gate.alpha), _np(gate_m.alpha)
    assert np.abs(alpha - alpha_m).max() <= ALPHA_TOL[dtype]
    # the same estimated partition (reserve / margin / error at the layer's thresholds)
    C = layer.C
    assert np.array_equal(alpha > 1e-3 * C, alpha_m > 1e-3 * C)
    np.testing.assert_allclose(_np(gate.multipliers()), _np(gate_m.multipliers()), rtol=0,
                               atol=ALPHA_TOL[dtype] / C)


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_exact_paths_agree(pair):
    layer, twin = _pair(pair[0], torch.float64)
    x, xm = _x(dtype=torch.float64)
    gate, gate_m = layer.gate(x, exact=True), twin.gate(xm, exact=True)
    assert gate_m.exact and np.array_equal(_np(gate.gated), _np(gate_m.gated))
    assert np.abs(_np(gate.alpha) - _np(gate_m.alpha)).max() <= ALPHA_TOL[torch.float64]
    y, ym = _np(layer.forward_exact(x)), _np(twin.forward_exact(xm))
    assert np.abs(y - ym).max() <= OUTPUT_TOL[torch.float64]
    # the batched path is approximate in both frameworks by the same amount
    gap_torch = np.abs(_np(layer(x)) - y).max()
    gap_mlx = np.abs(_np(twin(xm)) - ym).max()
    assert gap_torch <= 5e-3 and abs(gap_torch - gap_mlx) <= 1e-6


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_exclude_agrees(pair):
    layer, twin = _pair(pair[0])
    x, xm = _x()
    exclude = torch.zeros(2, 29, dtype=torch.bool)
    exclude[0, 3] = exclude[1, 12] = exclude[1, 25] = True
    y = _np(layer(x, exclude=exclude))
    ym = _np(twin(xm, exclude=mx.array(exclude.numpy())))
    assert np.abs(y - ym).max() <= OUTPUT_TOL[torch.float32]
    assert np.abs(ym - _np(twin(xm))).max() > 1e-4  # excluding tokens changes the output


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_mlx_layers_are_exactly_causal(pair):
    _, twin = _pair(pair[0])
    x, xm = _x()
    y = _np(twin(xm))
    _, other = _x(seed=SEED + 1)
    for cut in (5, 8, 17, 28):
        changed = mx.concatenate([xm[:, :cut], other[:, cut:]], axis=1)
        after = _np(twin(changed))
        assert np.array_equal(after[:, :cut], y[:, :cut]), cut
        assert np.abs(after[:, cut:] - y[:, cut:]).max() > 0


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_lengths_that_are_not_a_multiple_of_the_chunk(pair):
    layer, twin = _pair(pair[0])
    for T in (1, 7, 8, 9, 23):
        x, xm = _x(T=T)
        ym = _np(twin(xm))
        assert ym.shape == (2, T, 32) and np.isfinite(ym).all()
        assert np.abs(_np(layer(x)) - ym).max() <= OUTPUT_TOL[torch.float32]
    # three query blocks of the hybrid readout, 18 boundaries; float64, where the ridged
    # solves' rounding (amplified by their conditioning, about 1 / ridge) stays far below 1e-6
    layer, twin = _pair(pair[0], torch.float64)
    x, xm = _x(T=150, dtype=torch.float64)
    assert np.abs(_np(layer(x)) - _np(twin(xm))).max() <= OUTPUT_TOL[torch.float64]
    if not twin.hybrid:  # the pure gate's first chunk has no prefix: 0 before o_proj
        _, xm = _x(T=7)
        np.testing.assert_allclose(_np(twin(xm)), 0.0, atol=0)


def test_warmup_boundaries_are_ungated():
    # C = 0.25: gated from ceil(1/C) + 2 = 6 keys; chunk 4 -> boundaries at 4 (off), 8, 12 (on)
    layer, twin = _pair(TorchHybrid, chunk=4)
    x, xm = _x(T=14)
    gate = twin.gate(xm)
    gated = _np(gate.gated)
    assert gate.ends == [4, 8, 12] and not gated[:, :, 0].any() and gated[:, :, 1:].all()
    mult = _np(gate.multipliers())
    assert (mult[:, :, 0, :4] == 1).all() and (mult[:, :, 0, 4:] == 0).all()
    assert np.array_equal(gated, _np(layer.gate(x).gated))
    # C = 0.1 needs 12 keys: with chunk 4 the boundaries at 4 and 8 are warm-up
    _, twin = _pair(TorchHybrid, chunk=4, C=0.1)
    gated = _np(twin.gate(xm).gated)
    assert not gated[:, :, :2].any() and gated[:, :, 2].all()


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gradients_exist_and_match_torch(pair, dtype):
    layer, twin = _pair(pair[0], dtype)
    x, xm = _x(dtype=dtype)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(SEED + 2),
                    dtype=torch.float64).to(dtype)
    wm = mx.array(w.numpy(), dtype=DTYPES[dtype])
    (layer(x) * w).sum().backward()
    loss, grads = nn.value_and_grad(twin, lambda mod, inp: mx.sum(mod(inp) * wm))(twin, xm)
    assert np.isfinite(_np(loss))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        g_torch = _np(getattr(layer, name).weight.grad)
        g_mlx = _np(grads[name]["weight"])
        assert np.isfinite(g_mlx).all() and np.abs(g_mlx).max() > 0, name
        assert np.abs(g_torch - g_mlx).max() / np.abs(g_torch).max() <= GRAD_TOL[dtype], name


def test_defaults_and_from_torch_copy_everything():
    layer = HybridSVAttention(64, 4)
    assert (layer.C, layer.chunk, layer.fista_iters, layer.ridge) == (0.25, 64, 80, 1e-3)
    assert layer.sigma == pytest.approx(np.sqrt(2 * 16))
    torch.manual_seed(SEED)
    source = TorchCausal(24, 3, C=0.3, sigma=1.7, chunk=5, fista_iters=40, ridge=1e-2,
                         bias=True)
    twin = CausalSVAttention.from_torch(source)
    assert (twin.C, twin.sigma, twin.chunk, twin.fista_iters, twin.ridge) == (0.3, 1.7, 5, 40,
                                                                             1e-2)
    for name, tensor in source.state_dict().items():
        module, attr = name.split(".")
        np.testing.assert_array_equal(_np(getattr(twin, module)[attr]), tensor.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_from_torch_converts_half_precision_weights_to_float32(dtype):
    """NumPy has no bfloat16: a bf16 torch layer failed inside ``Tensor.numpy()``."""
    torch.manual_seed(SEED)
    source = TorchHybrid(32, 4, chunk=8).to(dtype)
    twin = from_torch(source)
    for name, tensor in source.state_dict().items():
        module, attr = name.split(".")
        weight = getattr(twin, module)[attr]
        assert weight.dtype == mx.float32, name
        np.testing.assert_array_equal(_np(weight), tensor.float().numpy())


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="C must be finite and > 0"):
        CausalSVAttention(32, 4, C=0.0)
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        CausalSVAttention(32, 4, sigma=-1.0)
    with pytest.raises(ValueError, match="chunk must be >= 1; got 0"):
        CausalSVAttention(32, 4, chunk=0)
    with pytest.raises(ValueError, match="must be divisible by n_heads"):
        CausalSVAttention(30, 4)
    layer = CausalSVAttention(32, 4, chunk=8)
    with pytest.raises(ValueError, match="x must have shape"):
        layer(mx.zeros((2, 5, 31)))
    with pytest.raises(ValueError, match="exclude must be a bool array"):
        layer(mx.zeros((2, 9, 32)), exclude=mx.zeros((2, 3), dtype=mx.bool_))
    with pytest.raises(TypeError, match="from_torch needs a torch CausalSVAttention"):
        from_torch(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="needs a hybrid torch SV layer"):
        HybridSVAttention.from_torch(TorchCausal(32, 4))


# ------------------------------------------------------------------------------ exact streaming
#: max |torch - MLX| of streamed outputs (float64 layers; MLX's float64 exp is float32-accurate)
STREAM_TOL = 1e-6


def _stream(layer, x, forgets=(), budget=None):
    """Step through x, calling ``state.forget(b, p)`` for each (t, b, p) before step t."""
    state = layer.init_state(x.shape[0], budget=budget)
    outs, outcomes = [], []
    for t in range(x.shape[1]):
        outcomes += [state.forget(b, p) for when, b, p in forgets if when == t]
        out, state = layer.step(x[:, t], state)
        outs.append(_np(out))
    return np.stack(outs, 1), outcomes, state


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_streaming_reproduces_forward_exact_and_torch(pair):
    layer, twin = _pair(pair[0], torch.float64)
    x, xm = _x(T=27, dtype=torch.float64)
    y, state = twin.forward_with_state(xm[:, :13])
    y2, state = twin.forward_with_state(xm[:, 13:], state)
    assert isinstance(state, SVStreamState) and state.position == 27
    streamed = np.concatenate([_np(y), _np(y2)], 1)
    stepped, _, _ = _stream(twin, xm)
    np.testing.assert_allclose(stepped, streamed, rtol=0, atol=1e-12)
    np.testing.assert_allclose(streamed, _np(twin.forward_exact(xm)), rtol=0, atol=STREAM_TOL)
    torch_y, _ = layer.forward_with_state(x)
    np.testing.assert_allclose(streamed, _np(torch_y), rtol=0, atol=STREAM_TOL)


@pytest.mark.parametrize("pair", PAIRS, ids=IDS)
def test_forget_agrees_with_torch_and_with_a_run_without_the_token(pair):
    """The schedule of the torch test: decrements of admitted tokens, masks of current-chunk
    tokens; MLX and torch return the same outcomes and the same later outputs."""
    layer, twin = _pair(pair[0], torch.float64)
    x, xm = _x(T=30, dtype=torch.float64)
    forgets = [(21, 0, 5), (21, 0, 17), (21, 1, 20), (26, 1, 11)]
    outs, outcomes, _ = _stream(twin, xm, forgets)
    outs_t, outcomes_t, _ = _stream(layer, x, forgets)
    assert outcomes == outcomes_t == ["decremented", "masked", "masked", "decremented"]
    np.testing.assert_allclose(outs, outs_t, rtol=0, atol=STREAM_TOL)
    ex = np.zeros((2, 30), dtype=bool)
    ex[0, 5] = ex[0, 17] = ex[1, 20] = True
    ref = _np(twin.forward_exact(xm, exclude=mx.array(ex)))
    np.testing.assert_allclose(outs[0, 21:], ref[0, 21:], rtol=0, atol=STREAM_TOL)
    np.testing.assert_allclose(outs[1, 21:26], ref[1, 21:26], rtol=0, atol=STREAM_TOL)
    ex[1, 11] = True
    ref = _np(twin.forward_exact(xm, exclude=mx.array(ex)))
    np.testing.assert_allclose(outs[1, 26:], ref[1, 26:], rtol=0, atol=STREAM_TOL)
    assert np.abs(outs[0, 8:21] - ref[0, 8:21]).max() > 1e-6  # history is not rewritten


@pytest.mark.parametrize("kind", [np.int64, mx.array])
def test_forget_takes_numpy_and_mlx_integers(kind):
    _, twin = _pair(TorchHybrid, torch.float64)
    _, xm = _x(T=10, dtype=torch.float64)
    _, state = twin.forward_with_state(xm)
    assert state.forget(kind(0), kind(2)) == "decremented"
    assert state.forget(kind(1), kind(9)) == "masked"
    with pytest.raises(KeyError, match="already forgotten"):
        state.forget(0, kind(2))
    with pytest.raises(TypeError, match="position must be an integer"):
        state.forget(0, mx.array(3.0))


def test_budgeted_stream_evicts_like_torch():
    """Certified eviction under a budget: the same admitted and stored counts and evictions as
    the torch state, and outputs that still agree."""
    layer, twin = _pair(TorchCausal, torch.float64, C=0.25)
    x, xm = _x(T=48, dtype=torch.float64)
    outs, _, state = _stream(twin, xm, budget=8)
    outs_t, _, state_t = _stream(layer, x, budget=8)
    summary, summary_t = state.state_summary(), state_t.state_summary()
    assert summary["evicted"] == summary_t["evicted"] > 0
    np.testing.assert_array_equal(summary["admitted"], summary_t["admitted"])
    np.testing.assert_array_equal(summary["stored"], summary_t["stored"])
    np.testing.assert_allclose(outs, outs_t, rtol=0, atol=STREAM_TOL)
