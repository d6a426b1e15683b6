"""SV-Attention sequence layers: the batched gate against per-prefix references, the readouts
against per-token loops, the exact gate against fresh solves, causality, warm-up, streaming,
deletion semantics, certified eviction and gradients.

Tolerances: two fp64 computations of the same quantity are compared within the forward error
bounds of ``tests/bounds.py`` (a posteriori residual bounds of the SVDD coefficients, first-order
bounds of the readouts), never within a fixed number; the batched (ridged, FISTA) gate against
the exact gate is approximate (documented bound below).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bounds import (  # noqa: E402
    assert_within,
    exact_layer_bound,
    readout_bound,
    svdd_coefficient_bound,
)

from svtoolkit import IncrementalSVDD  # noqa: E402
from svtoolkit._rules import RIDGE  # noqa: E402
from svtoolkit.torch import fista_svdd, partition_masks, ridged_svdd_solve  # noqa: E402
from svtoolkit.torch.layers.sv import CausalSVAttention, HybridSVAttention  # noqa: E402
from svtoolkit.torch.ops.chunked_sv import (  # noqa: E402
    SVGate,
    chunk_ends,
    exact_sv_gate,
    rbf_gram,
    sv_gate,
    sv_hybrid_readout,
    sv_rbf_readout,
    warmup_size,
)

LAYERS = [CausalSVAttention, HybridSVAttention]
#: Batched (80 FISTA iterations, ridge 1e-3) vs exact gate at this size: layer outputs.
BATCHED_VS_EXACT_OUTPUT = 5e-3


def _inputs(B=2, T=29, d=32, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=dtype)


def _layer(cls, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    opts = dict(chunk=8, C=0.25)
    opts.update(kw)
    return cls(32, 4, **opts).to(dtype)


def _keys(B=2, T=29, H=2, D=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, D, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------------------- the gates
def test_chunk_ends_and_warmup_size():
    assert chunk_ends(29, 8) == [8, 16, 24]
    assert chunk_ends(24, 8) == [8, 16]
    assert chunk_ends(5, 8) == []
    assert warmup_size(0.25) == 6 and warmup_size(0.1) == 12 and warmup_size(0.3) == 6


def test_batched_gate_equals_each_prefix_solved_alone():
    k = _keys()
    C, sigma, chunk = 0.2, 2.0, 8
    exclude = torch.zeros(2, 29, dtype=torch.bool)
    exclude[0, 3] = exclude[1, 12] = True
    gate = sv_gate(k, C=C, sigma=sigma, chunk=chunk, exclude=exclude)
    for b in range(2):
        for h in range(2):
            for j, end in enumerate(gate.ends):
                keep = [t for t in range(end) if not exclude[b, t]]
                x = k[b, keep, h][None, None]
                K = rbf_gram(x, x, sigma)[0]
                a0 = fista_svdd(K, C, iters=80)
                margin, error = partition_masks(a0, C)
                a, _, valid = ridged_svdd_solve(K, C, margin, error)
                expected = torch.zeros(gate.alpha.shape[-1], dtype=torch.float64)
                expected[keep] = a[0]
                keys, S = k[b, keep, h].numpy(), margin[0].numpy()
                tol = sum(svdd_coefficient_bound(keys, coef, C, sigma, ridge=RIDGE, margin=S)
                          for coef in (gate.alpha[b, h, j, keep].numpy(), a[0].numpy()))
                np.testing.assert_allclose(gate.alpha[b, h, j], expected, rtol=0, atol=tol)
                on = bool(valid[0]) and len(keep) >= warmup_size(C)
                assert bool(gate.gated[b, h, j]) == on


def test_exact_gate_equals_a_fresh_solve_of_each_prefix():
    k = _keys(seed=2)
    C, sigma = 0.2, 2.0
    exclude = torch.zeros(2, 29, dtype=torch.bool)
    exclude[1, 9] = True
    gate = exact_sv_gate(k, C=C, sigma=sigma, chunk=8, exclude=exclude)
    assert gate.exact and gate.alpha.dtype == torch.float64
    for b in range(2):
        for h in range(2):
            for j, end in enumerate(gate.ends):
                keep = [t for t in range(end) if not exclude[b, t]]
                fresh = IncrementalSVDD(C, sigma)
                fresh.extend(k[b, keep, h].numpy())
                assert bool(gate.gated[b, h, j]) == (fresh.certified and len(keep) >= 6)
                if fresh.certified:
                    keys, ours = k[b, keep, h].numpy(), gate.alpha[b, h, j, keep].numpy()
                    tol = (svdd_coefficient_bound(keys, ours, C, sigma)
                           + svdd_coefficient_bound(keys, fresh.alpha, C, sigma))
                    np.testing.assert_allclose(ours, fresh.alpha, rtol=0, atol=tol)


def test_warmup_boundaries_are_ungated():
    # C = 0.25: gated from ceil(1/C) + 2 = 6 keys; chunk 4 -> boundaries at 4 (off), 8, 12 (on)
    k = _keys(T=14, seed=3)
    gate = sv_gate(k, C=0.25, sigma=2.0, chunk=4)
    assert gate.ends == [4, 8, 12]
    assert not gate.gated[:, :, 0].any() and gate.gated[:, :, 1:].all()
    m = gate.multipliers()
    assert torch.all(m[:, :, 0, :4] == 1) and torch.all(m[:, :, 0, 4:] == 0)


# ------------------------------------------------------------------------------- readouts
def _loop_readout(q, k, v, gate, *, sigma, chunk, hybrid, exclude):
    """Per-token reference: query t reads its prefix with the gate multipliers (and, hybrid,
    its own chunk up to t with weight 1)."""
    B, T, H, D = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    mult = gate.multipliers()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                c = t // chunk
                idx, w = [], []
                for i in range(c * chunk):
                    if not exclude[b, i] and mult[b, h, c - 1, i] > 0:
                        idx.append(i)
                        w.append(float(mult[b, h, c - 1, i]))
                if hybrid:
                    for i in range(c * chunk, t + 1):
                        if not exclude[b, i]:
                            idx.append(i)
                            w.append(1.0)
                if not idx:
                    continue
                w = torch.tensor(w, dtype=q.dtype)
                keys = k[b, idx, h]
                if hybrid:
                    logits = keys @ q[b, t, h] / math.sqrt(D)
                    w = w * torch.exp(logits - logits.max())
                else:
                    w = w * torch.exp(-((keys - q[b, t, h]) ** 2).sum(-1) / sigma**2)
                out[b, t, h] = w @ v[b, idx, h] / w.sum()
    return out


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("T, chunk", [(29, 8), (150, 8), (150, 1)])
def test_readouts_match_the_per_token_loop(hybrid, T, chunk):
    """T = 150 spans three query blocks of the hybrid readout (QUERY_BLOCK = 64); chunk 1 is
    the token-level gate (a boundary per query)."""
    q, k, v = _keys(T=T, seed=4), _keys(T=T, seed=5), _keys(T=T, seed=6)
    exclude = torch.zeros(2, T, dtype=torch.bool)
    exclude[0, 2] = exclude[1, 20] = True
    if T > 64:
        exclude[0, 64] = exclude[1, 100:110] = True
    gate = sv_gate(k, C=0.2, sigma=2.0, chunk=chunk, exclude=exclude)
    if hybrid:
        got = sv_hybrid_readout(q, k, v, gate, chunk=chunk, exclude=exclude)
    else:
        got = sv_rbf_readout(q, k, v, gate, sigma=2.0, chunk=chunk, exclude=exclude)
    ref = _loop_readout(q, k, v, gate, sigma=2.0, chunk=chunk, hybrid=hybrid, exclude=exclude)
    B, T, H, D = q.shape
    mult = gate.multipliers()
    bound = readout_bound(*(_fold_heads(t)[:, :, 0] for t in (q, k, v)),
                          mult.reshape(B * H, *mult.shape[2:]),
                          torch.zeros(B * H, len(gate.ends), dtype=torch.float64),
                          exclude[:, None].expand(B, H, T).reshape(B * H, T),
                          hybrid=hybrid, sigma=2.0, chunk=chunk)  # same multipliers: dm = 0
    assert_within(got, ref, bound.reshape(B, H, T).transpose(1, 2)[..., None])


def test_first_chunk_of_the_pure_gate_outputs_zero_and_is_never_nan():
    q, k, v = _keys(seed=7), _keys(seed=8), _keys(seed=9)
    gate = sv_gate(k, C=0.2, sigma=2.0, chunk=8)
    out = sv_rbf_readout(q, k, v, gate, sigma=2.0, chunk=8)
    assert torch.all(out[:, :8] == 0) and torch.isfinite(out).all()
    far = sv_rbf_readout(q + 1e3, k, v, gate, sigma=2.0, chunk=8)  # every weight underflows
    assert torch.isfinite(far).all() and torch.all(far == 0)


# ------------------------------------------------------------------------------- layers
@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layers_are_exactly_causal(cls, dtype):
    layer = _layer(cls, dtype=dtype)
    x = _inputs(dtype=dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype
    for cut in (5, 8, 17, 28):
        x2 = x.clone()
        x2[:, cut:] = _inputs(seed=9, dtype=dtype)[:, cut:]
        assert torch.equal(layer(x2)[:, :cut], y[:, :cut])
        assert torch.equal(layer.forward_exact(x2)[:, :cut], layer.forward_exact(x)[:, :cut])


@pytest.mark.parametrize("cls", LAYERS)
def test_batched_layer_agrees_with_the_exact_layer(cls):
    layer = _layer(cls)
    x = _inputs()
    gap = (layer(x) - layer.forward_exact(x)).abs().max().item()
    assert gap <= BATCHED_VS_EXACT_OUTPUT


@pytest.mark.parametrize("cls", LAYERS)
def test_streaming_reproduces_the_exact_forward(cls):
    layer = _layer(cls)
    x = _inputs(T=27)
    y, state = layer.forward_with_state(x[:, :13])
    y2, state = layer.forward_with_state(x[:, 13:], state)
    steps = []
    state2 = layer.init_state(2)
    for t in range(27):
        out, state2 = layer.step(x[:, t], state2)
        steps.append(out)
    ref, bound = layer.forward_exact(x), _bound(layer, x)
    assert_within(torch.cat([y, y2], 1), ref, bound, "forward_with_state")
    assert_within(torch.stack(steps, 1), ref, bound, "step")


@pytest.mark.parametrize("cls", LAYERS)
def test_forget_equals_a_run_without_the_token(cls):
    layer = _layer(cls)
    x = _inputs(T=30)
    state = layer.init_state(2)
    outs = []
    for t in range(30):
        if t == 21:  # stream is in chunk 2 (positions 16..23); chunks 0-1 are admitted
            assert state.forget(0, 5) == "decremented"
            assert state.forget(0, 17) == "masked"
            assert state.forget(1, 20) == "masked"
        if t == 26:
            assert state.forget(1, 11) == "decremented"
        out, state = layer.step(x[:, t], state)
        outs.append(out)
    outs = torch.stack(outs, 1).detach()
    ex = torch.zeros(2, 30, dtype=torch.bool)
    ex[0, 5] = ex[0, 17] = ex[1, 20] = True
    ref, bound = layer.forward_exact(x, exclude=ex).detach(), _bound(layer, x, ex)
    assert_within(outs[0, 21:], ref[0, 21:], bound[0, 21:])
    assert_within(outs[1, 21:26], ref[1, 21:26], bound[1, 21:26])
    ex[1, 11] = True
    ref, bound = layer.forward_exact(x, exclude=ex).detach(), _bound(layer, x, ex)
    assert_within(outs[1, 26:], ref[1, 26:], bound[1, 26:])
    assert (outs[0, 8:21] - ref[0, 8:21]).abs().max() > 1e-6  # history is not rewritten


@pytest.mark.parametrize("cls", LAYERS)
def test_a_forgotten_token_leaves_no_copy_in_the_readout_cache(cls):
    """The readout's cached prefix tensors hold no copy of a forgotten token: a forget of an
    admitted token drops them, and their padding is zeros, not the key of the token being
    read (which a forget of the current chunk removes without touching the cache)."""
    layer = _layer(cls)
    x = _inputs(T=20)
    state = layer.init_state(2)
    for t in range(20):
        _, state = layer.step(x[:, t], state)
        if t in (0, 5, 11):  # the cache was just built (t = 0: an empty prefix, all padding)
            assert state.forget(0, t) == "masked"
        if t == 17:
            assert state.forget(0, 3) == "decremented"
            assert state.read_cache[0] is None
        cached = state.read_cache[0]
        if cached is None:
            continue
        rows = torch.cat([a.reshape(-1, a.shape[-1]) for a in cached[1:3]], 1)
        for p in sorted(state.forgotten[0]):
            for h in range(layer.n_heads):
                forgotten = torch.cat([layer._qkv(x[:, p:p + 1])[1][0, 0, h],
                                       layer._qkv(x[:, p:p + 1])[2][0, 0, h]]).detach()
                assert not (rows == forgotten).all(1).any(), (t, p, h)


def _snapshot(state):
    """Everything a forget could change, as plain comparable data."""
    return dict(
        position=state.position,
        prefix=list(state.prefix_size),
        forgotten=[set(f) for f in state.forgotten],
        local=[list(positions) for positions in state.local],
        ids=[[dict(ids) for ids in row] for row in state.ids],
        multipliers=[[dict(m) for m in row] for row in state.multipliers],
        keys=[{p: key.tolist() for p, key in keys.items()} for keys in state.keys],
        values=[{p: value.tolist() for p, value in values.items()} for values in state.values],
        alpha=[[solver.alpha.tolist() for solver in row] for row in state.solvers],
        counters=(state.evicted, state.over_budget),
    )


def test_forget_rejects_bad_requests_and_changes_nothing():
    layer = _layer(HybridSVAttention)
    _, state = layer.forward_with_state(_inputs(T=10))  # 0..7 admitted, 8..9 current chunk
    state.forget(0, 1)
    before = _snapshot(state)
    bad = [
        (IndexError, "position 10 has not been seen", (0, 10)),
        (IndexError, "position -1 has not been seen", (0, -1)),
        (IndexError, "sequence 2 out of range", (2, 1)),
        (KeyError, "position 1 of sequence 0 was already forgotten", (0, 1)),
        (KeyError, "position 1 of sequence 0 was already forgotten", (0, torch.tensor(1))),
        (TypeError, "position must be an integer", (0, 3.0)),
        (TypeError, "position must be an integer", (0, torch.tensor(3.0))),
        (TypeError, "position must be an integer", (0, True)),
        (TypeError, "b must be an integer", (0.0, 3)),
    ]
    for error, message, args in bad:
        with pytest.raises(error, match=message):
            state.forget(*args)
        assert _snapshot(state) == before, args


@pytest.mark.parametrize("kind", [np.int64, torch.tensor])
def test_forget_takes_numpy_and_tensor_integers(kind):
    """A 0-d tensor position was looked up by identity: "evicted", the prefix size decremented,
    the token left in the gate, and a second forget of it accepted."""
    layer = _layer(HybridSVAttention)
    x = _inputs(T=24)
    ex = torch.zeros(2, 24, dtype=torch.bool)
    ex[0, 2] = ex[1, 9] = True
    _, state = layer.forward_with_state(x[:, :10])
    assert state.forget(kind(0), kind(2)) == "decremented"
    assert state.forget(kind(1), kind(9)) == "masked"
    with pytest.raises(KeyError, match="already forgotten"):
        state.forget(0, kind(2))
    y, state = layer.forward_with_state(x[:, 10:], state)
    ref = layer.forward_exact(x, exclude=ex)
    assert_within(y, ref[:, 10:], _bound(layer, x, ex)[:, 10:])


@pytest.mark.parametrize("cls", LAYERS)
def test_certified_eviction_changes_no_output(cls):
    """Evicting reserve keys (weight exactly 0) changes no output - until the next admission,
    which solves a problem without them (the certificate's scope)."""
    layer = _layer(cls, C=0.2)
    x = _inputs(T=40, seed=3)
    free = layer.init_state(2)
    tight = layer.init_state(2, budget=6)
    first_eviction, bound = None, _bound(layer, x)
    for t in range(40):
        y_free, free = layer.step(x[:, t], free)
        y_tight, tight = layer.step(x[:, t], tight)
        if first_eviction is None and tight.evicted:
            first_eviction = t
        if first_eviction is None or t < first_eviction + layer.chunk:
            assert_within(y_tight, y_free, bound[:, t], f"t = {t}")
    assert first_eviction is not None and first_eviction % layer.chunk == 0
    summary = tight.state_summary()
    assert (summary["admitted"] < free.state_summary()["admitted"]).any()


@pytest.mark.parametrize("cls", LAYERS)
def test_lengths_that_are_not_a_multiple_of_the_chunk(cls):
    layer = _layer(cls)
    for T in (1, 7, 8, 9, 23):
        x = _inputs(T=T)
        y = layer(x)
        assert y.shape == (2, T, 32) and torch.isfinite(y).all()
        assert_within(layer.forward_with_state(x)[0], layer.forward_exact(x), _bound(layer, x),
                      f"T = {T}")


@pytest.mark.parametrize("cls", LAYERS)
def test_gradcheck_of_the_layer(cls):
    """fp64 gradcheck of the training path on a tiny size. The FISTA partition is held fixed
    under the perturbation (the test asserts it does not change); gradients flow through the
    ridged solve and the readout."""
    torch.manual_seed(0)
    layer = cls(8, 2, chunk=4, C=0.3, fista_iters=400).double()
    x = torch.randn(1, 10, 8, dtype=torch.float64, requires_grad=True)
    gate0 = layer.gate(x)
    masks0 = (gate0.alpha > 1e-3 * 0.3)

    def fn(inp):
        gate = layer.gate(inp)
        assert torch.equal(gate.alpha > 1e-3 * 0.3, masks0)  # partition locally stable
        return layer(inp)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="C must be finite and > 0"):
        CausalSVAttention(32, 4, C=0.0)
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        CausalSVAttention(32, 4, sigma=-1.0)
    with pytest.raises(ValueError, match="chunk"):
        CausalSVAttention(32, 4, chunk=0)
    with pytest.raises(ValueError, match=r"exclude must be a bool array of shape \(B, T\)"):
        _layer(CausalSVAttention)(_inputs(), exclude=torch.zeros(2, 3, dtype=torch.bool))


def test_gate_object_shapes():
    gate = sv_gate(_keys(), C=0.2, sigma=2.0, chunk=8)
    assert isinstance(gate, SVGate) and gate.alpha.shape == (2, 2, 3, 24)
    assert gate.gated.shape == (2, 2, 3) and not gate.exact


# ------------------------------------------------------------------------------- budgeted memory
def _bound(layer, x, exclude=None):
    """(B, T, 1): how far two exact-path computations of the layer's outputs may differ."""
    if exclude is None:
        exclude = torch.zeros(x.shape[:2], dtype=torch.bool)
    return exact_layer_bound(layer, x, exclude)


def _fold_heads(t):
    """(B, T, H, D) -> (B * H, T, 1, D): every head becomes a one-head sequence."""
    B, T, H, D = t.shape
    return t.transpose(1, 2).reshape(B * H, T, 1, D)


def _exact_with_head_exclusions(layer, x, exclude):
    """``forward_exact`` with an exclusion mask per (sequence, head), ``exclude`` (B, H, T).

    The heads of an SV layer are independent until ``o_proj``, so folding them into the batch
    runs the exact gate and the readout of each head on its own key set.
    """
    q, k, v = layer._qkv(x)
    B, T, H, _ = q.shape
    ex = exclude.reshape(B * H, T)
    gate = exact_sv_gate(_fold_heads(k), C=layer.C, sigma=layer.sigma, chunk=layer.chunk,
                         exclude=ex)
    o = layer._readout(_fold_heads(q), _fold_heads(k), _fold_heads(v), gate, ex)
    return layer.o_proj(o.reshape(B, H, T, -1).transpose(1, 2).flatten(-2))


def _recurring_inputs(T, P=12, noise=0.02, seed=11):
    """P base tokens repeated with small noise: the support set stays small, so a budget can
    bound the memory while the stream grows without end."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, P, 8, generator=g, dtype=torch.float64)
    return base[:, torch.arange(T) % P] + noise * torch.randn(2, T, 8, generator=g,
                                                                dtype=torch.float64)


def _stream_coefficient_bounds(state, layer):
    """(B, H): the a posteriori coefficient bound of each head's streaming solver, now."""
    return torch.tensor([[svdd_coefficient_bound(solver.keys, solver.alpha, layer.C, layer.sigma)
                          if solver.certified else 0.0 for solver in row]
                         for row in state.solvers], dtype=torch.float64)


def _needed_positions(state, b):
    """Positions whose key and value a later read or admission can still use."""
    held = set().union(*(ids.keys() for ids in state.ids[b]))
    return held | (set(state.local[b]) - state.forgotten[b])


@pytest.mark.parametrize("cls", LAYERS)
def test_budgeted_stream_stores_bounded_keys_and_equals_the_exact_reference(cls):
    """Under a budget the stored keys and values are exactly those some head holds or the
    current chunk needs (they were all kept for ever), and every output still equals the exact
    gate of the keys each head holds, minus the forgotten tokens."""
    torch.manual_seed(0)
    layer = cls(8, 2, chunk=8, C=0.25).double()
    T, chunk, w = 320, 8, warmup_size(0.25)
    x = _recurring_inputs(T)
    state = layer.init_state(2, budget=8)
    forgets = {96: [(0, 90, "masked"), (1, 20, "decremented")],
               200: [(1, 195, "masked"), (0, 41, "evicted")]}
    outs, excluded, theirs, split, peak = [], {}, {}, False, 0
    for t in range(T):
        for b, p, outcome in forgets.get(t, []):
            assert state.forget(b, p) == outcome
        y, state = layer.step(x[:, t], state)
        outs.append(y)
        for b in range(2):
            assert set(state.keys[b]) == set(state.values[b]) == _needed_positions(state, b)
        peak = max(peak, *state.state_summary()["stored"])
        if t % chunk == 0:  # the boundary at t has just been admitted (and evicted)
            exclude = torch.ones(2, 2, T, dtype=torch.bool)
            for b in range(2):
                held = [set(ids) for ids in state.ids[b]]
                split |= bool(held[0] ^ held[1])  # evicted from one head, held by the other
                for h in range(2):
                    exclude[b, h, sorted(held[h])] = False
                    assert (state.prefix_size[b] >= w) == (len(held[h]) >= w)  # same warm-up
            exclude[:, :, t:] = False
            excluded[t // chunk] = exclude
            theirs[t // chunk - 1] = _stream_coefficient_bounds(state, layer)
    assert split and state.evicted > 0
    assert peak <= 40  # every one of the T = 320 was kept before
    outs = torch.stack(outs, 1)
    for c, exclude in excluded.items():
        for b, p, _ in (f for when, fs in forgets.items() if when <= c * chunk for f in fs):
            exclude[b, :, p] = True
        end = min(T, (c + 1) * chunk)
        ref = _exact_with_head_exclusions(layer, x[:, :end], exclude[:, :, :end]).detach()
        bound = exact_layer_bound(layer, x[:, :end], exclude[:, :, :end],
                                  other={c - 1: theirs[c - 1]} if c else None)
        assert_within(outs[:, c * chunk:end], ref[:, c * chunk:], bound[:, c * chunk:],
                      f"chunk {c}")


# ------------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("path", ["forward", "forward_exact", "forward_with_state"])
def test_empty_sequence_is_refused_like_every_other_layer(cls, path):
    layer = _layer(cls)
    with pytest.raises(ValueError, match=r"the sequence is empty \(T = 0\)"):
        getattr(layer, path)(_inputs(T=0))


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["forward", "forward_exact", "forward_with_state"])
def test_half_precision_is_refused_naming_the_supported_dtypes(cls, dtype, path):
    layer = _layer(cls, dtype=dtype)
    name = str(dtype).split(".")[-1]
    with pytest.raises(TypeError, match=r"supports float32 and float64 only.*" + name):
        getattr(layer, path)(_inputs(T=9, dtype=dtype))


@pytest.mark.parametrize("cls", LAYERS)
def test_streaming_keeps_no_autograd_graph(cls):
    """The state stored v with its graph (every step's graph kept alive by the state)."""
    layer = _layer(cls)
    x = _inputs(T=12).requires_grad_()
    y, state = layer.forward_with_state(x)
    y_t, state = layer.step(x[:, 0].detach(), state)
    assert not y.requires_grad and not y_t.requires_grad
    stored = [t for d in state.keys + state.values for t in d.values()]
    assert stored and not any(t.requires_grad or t.grad_fn is not None for t in stored)
