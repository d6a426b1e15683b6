"""The ``qk_norm`` option of the SV layers: RMS-normalised queries and keys (default) or the
raw learned projections with a fixed width (the layer of Forgetful Attention
(arXiv:2607.12204)), in torch and MLX, on every path."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svtoolkit import IncrementalSVDD  # noqa: E402
from svtoolkit._gate_core import QK_NORMS, RAW_QK_SIGMA, default_sigma  # noqa: E402
from svtoolkit.torch import ATTENTION_LAYERS, TinyLM  # noqa: E402
from svtoolkit.torch.layers.sv import CausalSVAttention, HybridSVAttention  # noqa: E402
from svtoolkit.torch.ops.chunked_sv import SVGate, sv_rbf_readout  # noqa: E402

LAYERS = [CausalSVAttention, HybridSVAttention]
EPS64 = np.finfo(np.float64).eps
BAD_QK_NORM = "qk_norm must be one of 'rms', 'none'"


def _layer(cls, qk_norm="none", seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    opts = dict(chunk=8, C=0.25, qk_norm=qk_norm)
    opts.update(kw)
    return cls(32, 4, **opts).to(dtype)


def _inputs(B=2, T=29, d=32, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=dtype)


def _raw_heads(layer, x):
    """q, k, v of ``layer`` computed here from its weights (no layer code): (B, T, H, D)."""
    B, T, _ = x.shape
    H, D = layer.n_heads, layer.head_dim
    with torch.no_grad():
        q, k, v = (x @ p.weight.T for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    return (a.reshape(B, T, H, D) for a in (q, k, v))


def _readout_bound(layer, x):
    """A bound on |streaming - forward_exact| for the RBF readout of ``layer`` on x (fp64).

    The two paths read the same keys with the same exact-solver coefficients; they differ in
    how ``|q - k|^2`` is rounded: coordinate differences (streaming) against the expansion
    ``|q|^2 + |k|^2 - 2 q.k`` (forward_exact), whose error is at most a few eps (|q|^2 + |k|^2).
    Divided by sigma^2 this is the relative error delta of each kernel weight; a weighted mean
    of values moves by at most 2 delta max|v|, and o_proj multiplies by its largest absolute
    row sum. Factor 8: the handful of roundings of each term. The hybrid's logits (q.k, same
    formula on both paths up to the order of a D-term sum) obey the same bound with sigma^2
    replaced by sqrt(D).
    """
    q, k, v = _raw_heads(layer, x)
    norms = float((q * q).sum(-1).max() + (k * k).sum(-1).max())
    scale = math.sqrt(layer.head_dim) if layer.hybrid else layer.sigma**2
    delta = 8 * EPS64 * max(norms, 1.0) / scale
    w_o = float(layer.o_proj.weight.detach().abs().sum(1).max())
    # the exact coefficients of the two paths: same solver, same admissions, about 1e-13
    # apart at most on well-conditioned prefixes (the contract of the rms-mode tests, 1e-12)
    return 2 * delta * float(v.abs().max()) * w_o + 1e-12


# ------------------------------------------------------------------------------- options
@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("bad", ["RMS", "l2", "", None, True, 0])
def test_qk_norm_is_validated(cls, bad):
    with pytest.raises(ValueError, match=BAD_QK_NORM):
        cls(32, 4, qk_norm=bad)
    with pytest.raises(ValueError, match=BAD_QK_NORM):
        default_sigma(bad, 8)


@pytest.mark.parametrize("cls", LAYERS)
def test_defaults_and_explicit_sigma(cls):
    assert QK_NORMS == ("rms", "none") and RAW_QK_SIGMA == 2.0
    default = cls(32, 4)
    assert default.qk_norm == "rms" and default.sigma == math.sqrt(2 * 8)
    raw = cls(32, 4, qk_norm="none")
    assert raw.qk_norm == "none" and raw.sigma == 2.0 and raw.gate_options.sigma == 2.0
    for qk_norm in QK_NORMS:  # an explicit sigma always wins
        layer = cls(32, 4, qk_norm=qk_norm, sigma=3.5)
        assert layer.sigma == 3.5 and layer.gate_options.sigma == 3.5
    assert "qk_norm='none'" in repr(raw) and "sigma=2" in repr(raw)


@pytest.mark.parametrize("cls", LAYERS)
def test_rms_default_is_unchanged(cls):
    """The default layer equals an explicit qk_norm="rms" bit for bit on every path, and its
    q, k are the RMS-normalised projections; "none" gives the projections themselves."""
    x = _inputs()
    default = _layer(cls, qk_norm="rms")
    torch.manual_seed(0)
    implicit = cls(32, 4, chunk=8, C=0.25).double()
    assert torch.equal(default(x), implicit(x))
    assert torch.equal(default.forward_exact(x), implicit.forward_exact(x))
    assert torch.equal(default.forward_with_state(x)[0], implicit.forward_with_state(x)[0])
    q, k, v = _raw_heads(default, x)
    got = default._qkv(x)
    assert torch.equal(got[0], torch.nn.functional.rms_norm(q, (8,)))
    assert torch.equal(got[1], torch.nn.functional.rms_norm(k, (8,)))
    raw = _layer(cls)
    for mine, theirs in zip(raw._qkv(x), _raw_heads(raw, x)):
        np.testing.assert_allclose(mine.detach(), theirs.detach(), rtol=0, atol=1e-14)


def test_qk_norm_passes_through_the_layer_registry_and_tinylm():
    for name in ("sv", "sv_hybrid"):
        assert ATTENTION_LAYERS[name](32, 4, qk_norm="none").qk_norm == "none"
        model = TinyLM(vocab=16, d_model=32, n_layers=2, n_heads=4, block=16, attn=name,
                       attn_options={"chunk": 4, "qk_norm": "none"})
        assert all(b.attn.qk_norm == "none" and b.attn.sigma == 2.0 for b in model.blocks)
        assert model.config["attn_options"]["qk_norm"] == "none"
        with pytest.raises(ValueError, match=BAD_QK_NORM):
            TinyLM(vocab=16, d_model=32, n_layers=1, n_heads=4, block=16, attn=name,
                   attn_options={"qk_norm": "l2"})


def test_learned_key_extraction_follows_the_layer():
    """The learned-key extractor returns the keys the gate sees: raw under "none"."""
    from svtoolkit.torch.learned_keys import _extract

    torch.manual_seed(0)
    model = TinyLM(vocab=256, d_model=32, n_layers=1, n_heads=4, block=16, attn="sv_hybrid",
                   attn_options={"chunk": 4, "qk_norm": "none"}).double()
    held_out = np.random.default_rng(0).integers(0, 256, size=64).astype(np.uint8)
    cfg = dict(block=16, context=16, contexts_per_head=2, dedup=0.0)
    key_sets, origin = _extract(model, held_out, cfg)
    idx = torch.from_numpy(held_out[:32].astype(np.int64).reshape(2, 16))
    with torch.no_grad():
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(16))
        attn = model.blocks[0].attn
        _, k, _ = _raw_heads(attn, model.blocks[0].ln_1(x))
    layer_number, head, window = origin[0]
    np.testing.assert_allclose(key_sets[0], k[window, :, head].numpy(), rtol=0, atol=1e-13)
    assert not np.allclose(np.linalg.norm(key_sets[0], axis=1), math.sqrt(8))


# ------------------------------------------------------------------------------- "none": paths
@pytest.mark.parametrize("cls", LAYERS)
def test_none_exact_gate_equals_an_independent_solve(cls):
    """forward_exact's gate on the raw projections equals a fresh exact solve of each prefix
    of keys computed here from the weights."""
    layer = _layer(cls, C=0.2)
    x = _inputs(seed=1)
    exclude = torch.zeros(2, 29, dtype=torch.bool)
    exclude[1, 9] = True
    gate = layer.gate(x, exact=True, exclude=exclude)
    _, k, _ = _raw_heads(layer, x)
    k = k.detach()
    checked = 0
    for b in range(2):
        for h in range(4):
            for j, end in enumerate(gate.ends):
                keep = [t for t in range(end) if not exclude[b, t]]
                fresh = IncrementalSVDD(0.2, 2.0)
                fresh.extend(k[b, keep, h].numpy())
                assert bool(gate.gated[b, h, j]) == (fresh.certified and len(keep) >= 6)
                if not fresh.certified:
                    continue
                # Both solvers reach the same partition's bordered system M u = c, each with
                # rounding ~ eps (n + 1) in M and c (kernel entries carry relative error
                # ~ eps (2 + d^2/sigma^2)), so |delta alpha| <= ||M^-1||_inf (n + 1) eps
                # (2 + max d^2 / sigma^2) max(1, |u|) per solver: factor 2 for the two, 8 for
                # the few roundings per entry.
                system = fresh.margin_system()
                keys = k[b, keep, h].numpy()
                d2 = ((keys[:, None] - keys[None]) ** 2).sum(-1).max() / 4.0
                u = max(1.0, abs(system.rho), float(np.abs(system.alpha_margin).max(initial=0)))
                tol = (16 * np.abs(system.inverse).sum(1).max() * (len(keep) + 1) * EPS64
                       * (2 + d2) * u)
                np.testing.assert_allclose(gate.alpha[b, h, j, keep], fresh.alpha, rtol=0,
                                           atol=tol)
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("cls", LAYERS)
def test_none_streaming_and_forget_equal_forward_exact(cls):
    layer = _layer(cls)
    x = _inputs(T=30, seed=2)
    ref = layer.forward_exact(x).detach()
    tol = _readout_bound(layer, x)
    y, state = layer.forward_with_state(x[:, :13])
    y2, state = layer.forward_with_state(x[:, 13:], state)
    np.testing.assert_allclose(torch.cat([y, y2], 1), ref, rtol=0, atol=tol)
    state = layer.init_state(2)
    outs = []
    for t in range(30):
        if t == 21:  # chunk 2 (16..23) is current; chunks 0-1 are admitted
            assert state.forget(0, 5) == "decremented"
            assert state.forget(0, 17) == "masked"
        out, state = layer.step(x[:, t], state)
        outs.append(out)
    outs = torch.stack(outs, 1)
    ex = torch.zeros(2, 30, dtype=torch.bool)
    ex[0, 5] = ex[0, 17] = True
    ref_ex = layer.forward_exact(x, exclude=ex).detach()
    np.testing.assert_allclose(outs[0, 21:], ref_ex[0, 21:], rtol=0, atol=tol)
    np.testing.assert_allclose(outs[1], ref[1], rtol=0, atol=tol)
    assert (outs[0, 21:] - ref[0, 21:]).abs().max() > 1e-6  # the forget did something


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_none_training_path_is_finite_with_gradients(cls, dtype):
    """Training path in "none" mode: finite outputs and finite, non-zero gradients for every
    projection - also when the projections are so large that every kernel value of a query
    underflows (keys and queries hundreds apart at sigma 2)."""
    for scale in (1.0, 30.0):
        layer = _layer(cls, dtype=dtype)
        with torch.no_grad():
            for p in (layer.q_proj, layer.k_proj):
                p.weight.mul_(scale)
        x = _inputs(dtype=dtype, seed=3)
        y = layer(x)
        assert torch.isfinite(y).all()
        y.square().sum().backward()
        for p in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            assert torch.isfinite(p.weight.grad).all()
            assert p.weight.grad.abs().max() > 0, (scale, p)
        if not layer.hybrid:  # every query after the first chunk reads a key
            assert (y[:, 8:].abs().amax(-1) > 0).all()


def test_shift_keeps_far_queries_alive_and_changes_nothing_else():
    """The shifted RBF readout equals the plain one where nothing underflows (the factor
    cancels: rounding only), and is the nearest key's value where everything does."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 16, 1, 3, generator=g, dtype=torch.float64) for _ in range(3))
    gate = SVGate(torch.zeros(1, 1, 1, 8, dtype=torch.float64),
                  torch.zeros(1, 1, 1, dtype=torch.bool), [8], 0.25, False)  # ungated
    plain = sv_rbf_readout(q, k, v, gate, sigma=2.0, chunk=8)
    shifted = sv_rbf_readout(q, k, v, gate, sigma=2.0, chunk=8, shift=True)
    # exponents |q - k|^2 / 4 are O(10) here: a shift changes each weight by a few eps
    # relative, the weighted means by at most that times max|v|
    np.testing.assert_allclose(shifted, plain, rtol=0, atol=64 * EPS64 * float(v.abs().max()))
    far = q + 1e3  # |q - k|^2 / 4 ~ 7.5e5: exp underflows to 0 for every key
    assert torch.all(sv_rbf_readout(far, k, v, gate, sigma=2.0, chunk=8)[:, 8:] == 0)
    alive = sv_rbf_readout(far, k, v, gate, sigma=2.0, chunk=8, shift=True)
    nearest = ((far[0, 8:, 0, None] - k[0, None, :8, 0]) ** 2).sum(-1).argmin(-1)
    # the second nearest key is further by |q - k|^2 differences of order 1e3 (times
    # 1/sigma^2): its weight is below exp(-100) relative, far under fp64 rounding of v
    gaps = ((far[0, 8:, 0, None] - k[0, None, :8, 0]) ** 2).sum(-1).sort(-1).values
    assert (gaps[:, 1] - gaps[:, 0] > 400).all()
    np.testing.assert_allclose(alive[0, 8:, 0], v[0, nearest, 0], rtol=0, atol=1e-15)


# ------------------------------------------------------------------------------- concentration
def _kernel_ratio(layer, x, chunk=8):
    """Largest ratio of two RBF kernel values of the same query (chunk 1 queries against
    the keys of chunk 0), from the layer's own q and k."""
    q, k, _ = layer._qkv(x)
    q, k = q[0, chunk:2 * chunk].detach(), k[0, :chunk].detach()
    sq = ((q[:, None] - k[None]) ** 2).sum(-1)  # (queries, keys, H)
    logk = -sq / layer.sigma**2
    return float((logk.amax(1) - logk.amin(1)).max())  # log of the ratio


def test_none_readout_can_concentrate_rms_cannot():
    """With the same sharp projections (W_q = W_k = 10 I), the raw mode reads the key equal
    to the query almost alone (kernel ratios far beyond e^2, output = that key's value),
    while RMS-normalised keys at sigma = sqrt(2 D) keep every ratio within e^2."""
    d = 8
    x = _inputs(B=1, T=16, d=d, seed=5)
    x[0, 8] = x[0, 3]  # query 8 equals key 3
    layers = {}
    for qk_norm in QK_NORMS:
        torch.manual_seed(0)
        layer = CausalSVAttention(d, 1, chunk=8, C=0.25, qk_norm=qk_norm).double()
        with torch.no_grad():
            for p, s in ((layer.q_proj, 10.0), (layer.k_proj, 10.0), (layer.v_proj, 1.0),
                         (layer.o_proj, 1.0)):
                p.weight.copy_(s * torch.eye(d, dtype=torch.float64))
        layers[qk_norm] = layer
    # rms: |q - k|^2 <= 4 D = 2 sigma^2, so a log-ratio of at most 2 (plus rounding)
    assert _kernel_ratio(layers["rms"], x) <= 2.0 + 1e-12
    assert _kernel_ratio(layers["none"], x) > 100.0
    gate = layers["none"].gate(x, exact=True)
    assert gate.gated[0, 0, 0] and gate.multipliers()[0, 0, 0, 3] > 0
    out = {name: layer.forward_exact(x)[0, 8].detach() for name, layer in layers.items()}
    # none: the other keys' weights relative to key 3 are at most exp(-100 * min|x_i - x_3|^2
    # / 4) times their multiplier ratio (<= 1 / min multiplier), so the mean is x_3 to that
    others = [i for i in range(8) if i != 3]
    d2 = ((x[0, others] - x[0, 3]) ** 2).sum(-1).min().item()
    mult = gate.multipliers()[0, 0, 0, :8]
    bound = 7 * math.exp(-100 * d2 / 4) / float(mult[3]) * float((x[0, :8] - x[0, 3]).abs().max())
    np.testing.assert_allclose(out["none"], x[0, 3], rtol=0, atol=bound + 1e-14)
    assert (out["rms"] - x[0, 3]).abs().max() > 0.1  # a blend, not the key's value


# ------------------------------------------------------------------------------- MLX twin
mx = None
try:  # the twin tests need MLX; the torch tests above do not
    import mlx.core as mx  # noqa: F811
except ImportError:
    pass

needs_mlx = pytest.mark.skipif(mx is None, reason="MLX is not installed")
#: max |torch - MLX| on O(1) layer outputs, the bounds of the twin tests of the rms mode:
#: float32 training paths run the same algorithm in a different summation order (rounding
#: ~1e-7 amplified by the ridged solve); float64 MLX has a float32-accurate exp (MLX 0.32).
TWIN_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}


@needs_mlx
@pytest.mark.parametrize("hybrid", [False, True], ids=["causal", "hybrid"])
@pytest.mark.parametrize("qk_norm", QK_NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_mlx_twin_equals_torch(hybrid, qk_norm, dtype):
    from svtoolkit.mlx import CausalSVAttention as MLXCausal
    from svtoolkit.mlx import HybridSVAttention as MLXHybrid
    from svtoolkit.mlx import from_torch

    cls = HybridSVAttention if hybrid else CausalSVAttention
    layer = _layer(cls, qk_norm=qk_norm, dtype=dtype)
    twin = from_torch(layer)
    assert isinstance(twin, MLXHybrid if hybrid else MLXCausal)
    assert twin.qk_norm == qk_norm and twin.sigma == layer.sigma
    x = _inputs(dtype=dtype, seed=6)
    xm = mx.array(x.numpy(), dtype=mx.float32 if dtype == torch.float32 else mx.float64)
    y, ym = layer(x).detach().numpy(), np.array(twin(xm))
    assert np.abs(y - ym).max() <= TWIN_TOL[dtype]
    if dtype == torch.float64:
        ye, yem = layer.forward_exact(x).detach().numpy(), np.array(twin.forward_exact(xm))
        assert np.abs(ye - yem).max() <= TWIN_TOL[dtype]
        ys = np.array(twin.forward_with_state(xm)[0])
        assert np.abs(ys - ye).max() <= TWIN_TOL[dtype]


@needs_mlx
@pytest.mark.parametrize("bad", ["RMS", None])
def test_mlx_qk_norm_is_validated_and_defaults(bad):
    from svtoolkit.mlx import CausalSVAttention as MLXCausal
    from svtoolkit.mlx import HybridSVAttention as MLXHybrid

    for cls in (MLXCausal, MLXHybrid):
        with pytest.raises(ValueError, match=BAD_QK_NORM):
            cls(32, 4, qk_norm=bad)
        assert cls(32, 4).qk_norm == "rms" and cls(32, 4).sigma == 4.0
        assert cls(32, 4, qk_norm="none").sigma == 2.0
        assert cls(32, 4, qk_norm="none", sigma=3.0).sigma == 3.0
