"""SV-Attention ablation switches (``gate``, ``gate_update``, ``prefix_weighting``) against a
per-token reference that recomputes every output from the definition in fp64.

The reference (:func:`_per_token`) loops over sequences, heads and tokens: query t reads the
prefix before its gate boundary (``(t // chunk) * chunk``, or t itself with
``gate_update="token"``), with multipliers from a fresh exact solve of that prefix (``a / C``,
or ``a`` with ``prefix_weighting="raw"``; 1 when ungated or with ``gate="uniform"``), and the
hybrid also reads its local tokens ``[boundary, t]`` at multiplier 1.

Tolerances: the exact path against the reference 1e-10 (a fresh solve of each prefix against
exact increments of its chunks: the same optimum, reached by different rounding); streaming
against the exact path 1e-12 (as in tests/test_sv_layers.py); the batched (approximate) gate
against the exact one the bound of tests/test_sv_layers.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svtoolkit import IncrementalSVDD  # noqa: E402
from svtoolkit.torch.layers.sv import CausalSVAttention, HybridSVAttention  # noqa: E402
from svtoolkit.torch.ops.chunked_sv import (  # noqa: E402
    exact_sv_gate,
    sv_hybrid_readout,
    uniform_sv_gate,
    warmup_size,
)

LAYERS = [CausalSVAttention, HybridSVAttention]
#: Batched vs exact gate, layer outputs (the bound of tests/test_sv_layers.py).
BATCHED_VS_EXACT_OUTPUT = 5e-3
#: (layer class, switches) of every tested configuration.
CONFIGS = [
    (CausalSVAttention, {"gate": "uniform"}),
    (CausalSVAttention, {"gate_update": "token"}),
    (CausalSVAttention, {"gate": "uniform", "gate_update": "token"}),
    (HybridSVAttention, {"gate": "uniform"}),
    (HybridSVAttention, {"gate_update": "token"}),
    (HybridSVAttention, {"prefix_weighting": "raw"}),
    (HybridSVAttention, {"prefix_weighting": "raw", "gate_update": "token"}),
]
IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for cls, kw in CONFIGS]


def _inputs(B=2, T=23, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64)


def _layer(cls, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(16, 2, **{"chunk": 5, "C": 0.25, **kw}).double()


def _exclude(B, T, seed=3, rate=0.15):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.random((B, T)) < rate)


def _prefix_multipliers(keys, layer):
    """Multipliers of a prefix's keys (n, D) from a fresh exact solve (the definition)."""
    n = len(keys)
    if layer.gate_mode == "uniform" or n < warmup_size(layer.C):
        return np.ones(n)
    solver = IncrementalSVDD(layer.C, layer.sigma)
    ids = solver.extend(keys)
    if not solver.certified:
        return np.ones(n)
    alpha = dict(zip(solver.ids.tolist(), solver.alpha, strict=True))
    a = np.array([alpha.get(int(i), 0.0) for i in ids])
    return a if layer.prefix_weighting == "raw" else a / layer.C


@torch.no_grad()
def _per_token(layer, x, exclude=None):
    """Every output of ``layer.forward_exact(x, exclude)`` recomputed token by token."""
    q, k, v = (t.numpy() for t in layer._qkv(x))
    B, T, H, D = q.shape
    drop = np.zeros((B, T), bool) if exclude is None else exclude.numpy()
    step = 1 if layer.gate_update == "token" else layer.chunk
    out = np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            start = (t // step) * step
            prefix = [i for i in range(start) if not drop[b, i]]
            local = [i for i in range(start, t + 1) if not drop[b, i]] if layer.hybrid else []
            for h in range(H):
                mult = np.concatenate([_prefix_multipliers(k[b, prefix, h], layer),
                                       np.ones(len(local))])
                keys = k[b, prefix + local, h]
                if layer.hybrid:
                    kernel = np.exp(keys @ q[b, t, h] / math.sqrt(D))
                else:
                    kernel = np.exp(-((keys - q[b, t, h]) ** 2).sum(-1) / layer.sigma**2)
                w = mult * kernel
                if w.sum() > 0:
                    out[b, t, h] = w @ v[b, prefix + local, h] / w.sum()
    return layer.o_proj(torch.from_numpy(out).flatten(-2)).numpy()


# ------------------------------------------------------------------------------- reference
@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("with_exclude", [False, True])
def test_exact_path_matches_the_per_token_reference(cls, switches, with_exclude):
    layer = _layer(cls, **switches)
    x = _inputs()
    exclude = _exclude(2, 23) if with_exclude else None
    got = layer.forward_exact(x, exclude=exclude).detach().numpy()
    np.testing.assert_allclose(got, _per_token(layer, x, exclude), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cls", LAYERS)
def test_uniform_gate_training_path_is_the_reference_exactly(cls):
    """Nothing is solved with the gate off, so the batched path is the exact one."""
    layer = _layer(cls, gate="uniform")
    x = _inputs()
    np.testing.assert_allclose(layer(x).detach().numpy(), _per_token(layer, x), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
def test_batched_path_agrees_with_the_exact_path(cls, switches):
    layer = _layer(cls, **switches)
    x = _inputs()
    gap = (layer(x) - layer.forward_exact(x)).abs().max().item()
    assert gap <= BATCHED_VS_EXACT_OUTPUT


def test_the_switches_change_the_output():
    """Each switch does something on a gated input (a reference test cannot show this)."""
    x = _inputs()
    base = {cls: _layer(cls).forward_exact(x) for cls in LAYERS}
    for cls, switches in CONFIGS:
        other = _layer(cls, **switches).forward_exact(x)
        assert (other - base[cls]).abs().max() > 1e-3, switches


def test_uniform_gate_is_the_ungated_readout_of_the_same_keys():
    """gate="uniform" reads the same prefix as the SVDD gate with every multiplier 1: the
    hybrid is plain causal softmax over [0, t] (for every token, the first chunk included)."""
    layer = _layer(HybridSVAttention, gate="uniform")
    x = _inputs()
    q, k, v = layer._qkv(x)
    T, D = x.shape[1], layer.head_dim
    logits = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    plain = torch.einsum("bhts,bshd->bthd", logits.softmax(-1), v)
    np.testing.assert_allclose(layer(x).detach(), layer.o_proj(plain.flatten(-2)).detach(),
                               rtol=0, atol=1e-12)


def test_token_update_is_the_chunk_one_gate():
    x = _inputs()
    for cls in LAYERS:
        token = _layer(cls, gate_update="token", chunk=5)
        one = _layer(cls, chunk=1)
        assert token.gate_chunk == 1
        np.testing.assert_allclose(token.forward_exact(x).detach(),
                                   one.forward_exact(x).detach(), rtol=0, atol=0)


def test_raw_weighting_of_the_ops_multiplies_by_the_raw_coefficients():
    """Op level: raw multipliers are C times the normalised ones where gated."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 20, 1, 3, generator=g, dtype=torch.float64)
    gate = exact_sv_gate(keys, C=0.25, sigma=1.5, chunk=5)
    assert gate.gated.any()
    raw, normalized = gate.multipliers("raw"), gate.multipliers()
    on = gate.gated[..., None].expand_as(raw)
    np.testing.assert_allclose(raw[on], 0.25 * normalized[on], rtol=1e-15, atol=0)
    np.testing.assert_array_equal(raw[~on], normalized[~on])
    q = torch.randn(1, 20, 1, 3, generator=g, dtype=torch.float64)
    a = sv_hybrid_readout(q, keys, keys, gate, chunk=5, prefix_weighting="raw")
    b = sv_hybrid_readout(q, keys, keys, gate, chunk=5)
    assert (a - b).abs().max() > 1e-3


# ------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
def test_streaming_reproduces_the_exact_forward(cls, switches):
    layer = _layer(cls, **switches)
    x = _inputs(T=19)
    y, state = layer.forward_with_state(x[:, :8])
    y2, _ = layer.forward_with_state(x[:, 8:], state)
    np.testing.assert_allclose(torch.cat([y, y2], 1), layer.forward_exact(x).detach(), rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
def test_forget_equals_a_run_without_the_token(cls, switches):
    layer = _layer(cls, **switches)
    x = _inputs(T=22)
    state = layer.init_state(2)
    outs = []
    for t in range(22):
        if t == 12:
            state.forget(0, 3)
            state.forget(1, 11)
        out, state = layer.step(x[:, t], state)
        outs.append(out)
    ex = torch.zeros(2, 22, dtype=torch.bool)
    ex[0, 3] = ex[1, 11] = True
    ref = layer.forward_exact(x, exclude=ex).detach()
    np.testing.assert_allclose(torch.stack(outs, 1)[:, 12:], ref[:, 12:], rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------- gradients
@pytest.mark.slow
@pytest.mark.parametrize("switches", [{"gate_update": "token"}, {"prefix_weighting": "raw"},
                                      {"gate": "uniform"}])
def test_gradcheck_of_the_switched_training_path(switches):
    """fp64 gradcheck of the hybrid's training path with each switch (tiny size; the FISTA
    partition is held fixed under the perturbation, as in tests/test_sv_layers.py). About
    15 s each on one core: slow."""
    torch.manual_seed(0)
    layer = HybridSVAttention(8, 2, chunk=4, C=0.3, fista_iters=400, **switches).double()
    x = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    masks0 = layer.gate(x).alpha > 1e-3 * 0.3

    def fn(inp):
        assert torch.equal(layer.gate(inp).alpha > 1e-3 * 0.3, masks0)
        return layer(inp)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
def test_every_parameter_gets_a_finite_gradient(cls, switches):
    layer = _layer(cls, **switches).float()
    layer(_inputs().float()).square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("option", "value"), [("gate", "none"), ("gate", None),
                                               ("gate_update", "chunked"),
                                               ("gate_update", 1)])
def test_bad_switch_values_are_refused(option, value):
    for cls in LAYERS:
        with pytest.raises(ValueError, match=f"{option} must be one of"):
            cls(16, 2, **{option: value})


def test_bad_prefix_weighting_is_refused():
    with pytest.raises(ValueError, match="prefix_weighting must be one of 'normalized', 'raw'"):
        HybridSVAttention(16, 2, prefix_weighting="a/C")
    with pytest.raises(TypeError, match="prefix_weighting"):
        CausalSVAttention(16, 2, prefix_weighting="raw")
    gate = uniform_sv_gate(torch.zeros(1, 12, 1, 2), C=0.25, chunk=4)
    with pytest.raises(ValueError, match="weighting must be one of"):
        gate.multipliers("sum")


def test_a_budget_needs_the_svdd_gate():
    layer = _layer(CausalSVAttention, gate="uniform")
    with pytest.raises(ValueError, match="budget needs gate='svdd'"):
        layer.init_state(1, budget=4)


def test_uniform_gate_has_the_gate_shape_and_is_ungated():
    gate = uniform_sv_gate(torch.zeros(2, 13, 3, 4), C=0.25, chunk=4)
    assert gate.alpha.shape == (2, 3, 3, 12) and not gate.gated.any()
    assert gate.ends == [4, 8, 12]
    with pytest.raises(ValueError, match="exclude must be a bool array"):
        uniform_sv_gate(torch.zeros(2, 13, 3, 4), C=0.25, chunk=4,
                        exclude=torch.zeros(2, 5, dtype=torch.bool))


# ------------------------------------------------------------------------------- MLX twin
#: MLX twin vs torch in float32, layer outputs (the bound of tests/test_mlx_layers.py).
MLX_OUTPUT_TOL = 1e-5


@pytest.mark.parametrize(("cls", "switches"), CONFIGS, ids=IDS)
def test_mlx_twin_has_the_same_switches(cls, switches):
    """``from_torch`` carries the switches; the three paths agree with the torch layer."""
    mx = pytest.importorskip("mlx.core")
    from svtoolkit.mlx import from_torch

    layer = _layer(cls, **switches).float()
    twin = from_torch(layer)
    assert (twin.gate_mode, twin.gate_update, twin.prefix_weighting) == (
        layer.gate_mode, layer.gate_update, layer.prefix_weighting)
    x = _inputs(T=19).float()
    xm = mx.array(x.numpy())
    exact = layer.forward_exact(x).detach().numpy()
    pairs = [(layer(x).detach().numpy(), np.array(twin(xm))),
             (exact, np.array(twin.forward_exact(xm))),
             (exact, np.array(twin.forward_with_state(xm)[0]))]
    for ours, theirs in pairs:
        assert np.abs(ours - theirs).max() <= MLX_OUTPUT_TOL


def test_mlx_twin_refuses_bad_switches():
    pytest.importorskip("mlx.core")
    from svtoolkit.mlx import CausalSVAttention as MLXCausal
    from svtoolkit.mlx import HybridSVAttention as MLXHybrid

    with pytest.raises(ValueError, match="gate_update must be one of 'chunk', 'token'"):
        MLXCausal(16, 2, gate_update="tokens")
    with pytest.raises(ValueError, match="prefix_weighting must be one of"):
        MLXHybrid(16, 2, prefix_weighting=None)
