"""TinyLM streaming (init_state / forward_with_state / step), rotary positions with NTK-aware
scaling, and generate().

Every registered attention streams in float64 and must reproduce the full forward to rounding
(the SV layers reproduce their exact-gate forward, ``forward(idx, exact=True)``). Seeds fixed.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from svtoolkit.torch import ATTENTION_LAYERS, TinyLM  # noqa: E402
from svtoolkit.torch.rotary import apply_rotary, ntk_base, rotary_angles  # noqa: E402

SEED = 2027
#: windows / chunks / segments small enough that T = 30 crosses several boundaries
OPTIONS = {
    "softmax": {},
    "sliding_window": {"window": 5},
    "streaming_llm": {"sinks": 2, "window": 5},
    "linear": {"chunk": 8},
    "deltanet": {"chunk": 8},
    "gated_deltanet": {"chunk": 8},
    "tensor_cache": {"window": 5, "chunk": 4},
    "infini": {"segment": 6},
    "sv": {"chunk": 6, "C": 0.25},
    "sv_hybrid": {"chunk": 6, "C": 0.25},
}
ROTARY = ("softmax", "sliding_window", "streaming_llm", "tensor_cache", "infini")
#: max |streamed - forward| / max |forward| in float64 (measured <= 1e-14 on every layer)
STREAM_TOL = 1e-11


def _model(name, positions="learned", block=32, ntk=False, seed=SEED):
    torch.manual_seed(seed)
    return TinyLM(256, 24, 2, 2, block, attn=name, attn_options=OPTIONS[name],
                  positions=positions, ntk=ntk).double().eval()


def _tokens(B=2, T=30, seed=SEED):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _stream(model, idx, pieces, max_length=None):
    """Logits of idx streamed as chunks of the given sizes, then one token at a time."""
    state = model.init_state(idx.shape[0], max_length=max_length)
    out, t = [], 0
    for size in pieces:
        logits, state = model.forward_with_state(idx[:, t:t + size], state)
        out.append(logits)
        t += size
    for s in range(t, idx.shape[1]):
        logits, state = model.step(idx[:, s], state)
        out.append(logits[:, None])
    assert state.position == idx.shape[1]
    return torch.cat(out, dim=1), state


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_options_cover_every_registered_attention():
    assert set(OPTIONS) == set(ATTENTION_LAYERS)


@pytest.mark.parametrize("name", sorted(ATTENTION_LAYERS))
def test_streaming_reproduces_forward_for_every_layer(name):
    model = _model(name)
    idx = _tokens()
    with torch.no_grad():
        full, _ = model(idx, exact=True)
    streamed, state = _stream(model, idx, pieces=(7, 1, 12))
    assert streamed.dtype == torch.float64
    assert _rel(streamed, full) <= STREAM_TOL, name
    assert state.nbytes() > 0


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_streaming_beyond_the_block_reproduces_forward(name):
    model = _model(name, positions="rotary", block=8)
    idx = _tokens(T=30)
    with torch.no_grad():
        full, _ = model(idx)
    streamed, _ = _stream(model, idx, pieces=(5, 9, 3))
    assert _rel(streamed, full) <= STREAM_TOL, name


def test_ntk_stream_uses_the_factor_of_its_declared_length():
    model = _model("softmax", positions="rotary", block=8, ntk=True)
    idx = _tokens(T=24)
    with torch.no_grad():
        full, _ = model(idx)  # factor 24 / 8 = 3
        plain, _ = _model("softmax", positions="rotary", block=8)(idx)
    streamed, state = _stream(model, idx, pieces=(10,), max_length=24)
    assert state.ntk_factor == 3.0
    assert _rel(streamed, full) <= STREAM_TOL
    # within the block NTK changes nothing; beyond it the scaled base changes the logits
    assert torch.equal(full[:, :1], plain[:, :1])
    assert _rel(full[:, 12:], plain[:, 12:]) > 1e-6
    short = model.init_state(2, max_length=8)
    assert short.ntk_factor == 1.0


def test_rotary_scores_depend_only_on_the_offset():
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=gen)
    dots = [float((apply_rotary(q, p + 3) * apply_rotary(k, p)).sum()) for p in (0, 5, 100)]
    assert max(dots) - min(dots) < 1e-12
    assert abs(float((apply_rotary(q, 0) * apply_rotary(k, 0)).sum())
               - float((q * k).sum())) < 1e-12
    # NTK: the top frequency is kept, the lowest one divided by the factor
    base = ntk_base(10_000.0, 4.0, 8)
    plain, scaled = rotary_angles(torch.tensor([1]), 8, 1e4), rotary_angles(torch.tensor([1]), 8,
                                                                            base)
    assert scaled[0, 0] == plain[0, 0] == 1.0
    assert math.isclose(float(scaled[0, -1] * 4.0), float(plain[0, -1]), rel_tol=1e-12)


def test_learned_positions_are_the_default_and_unchanged():
    model = TinyLM(d_model=16, n_layers=1, n_heads=2, block=8)
    assert model.pos_emb is not None and "positions" not in model.config
    assert model.blocks[0].attn.rotary_base is None
    rotary = TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, positions="rotary")
    assert rotary.pos_emb is None and rotary.config["positions"] == "rotary"
    assert rotary.num_params() == model.num_params() - 8 * 16
    none = TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, positions="none", attn="sv_hybrid",
                  attn_options={"chunk": 4})
    assert none.blocks[0].attn.rotary_base is None


def test_position_options_are_checked():
    with pytest.raises(ValueError, match="positions must be one of"):
        TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, positions="alibi")
    with pytest.raises(ValueError, match="has no rotary option"):
        TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, positions="rotary", attn="sv")
    with pytest.raises(ValueError, match="ntk=True needs positions='rotary'"):
        TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, ntk=True)
    with pytest.raises(TypeError, match="ntk must be a bool"):
        TinyLM(d_model=16, n_layers=1, n_heads=2, block=8, positions="rotary", ntk=1)
    with pytest.raises(ValueError, match="ntk_factor needs rotary positions"):
        ATTENTION_LAYERS["softmax"](16, 2)(torch.zeros(1, 3, 16), ntk_factor=2.0)
    with pytest.raises(ValueError, match="factor must be a finite number >= 1"):
        ntk_base(1e4, 0.5, 8)
    with pytest.raises(ValueError, match="start must be a non-negative int"):
        apply_rotary(torch.zeros(1, 2, 1, 4), -1)


def test_stream_input_errors_leave_the_state_unchanged():
    model = _model("sliding_window", block=8)
    idx = _tokens(T=8)
    state = model.init_state(2)
    model.forward_with_state(idx[:, :6], state)
    with pytest.raises(ValueError, match="learned positions end at the block size 8"):
        model.forward_with_state(idx[:, :3], state)
    with pytest.raises(ValueError, match="state holds 2 sequences; idx has 1"):
        model.step(idx[:1, 0], state)
    with pytest.raises(ValueError, match="idx must be an int64 tensor of shape"):
        model.step(idx[:, :1], state)
    with pytest.raises(TypeError, match="state must be a TinyLMState"):
        model.forward_with_state(idx[:, :1], object())
    with pytest.raises(ValueError, match="max_length 9 exceeds the block size 8"):
        model.init_state(2, max_length=9)
    assert state.position == 6
    logits, _ = model.forward_with_state(idx[:, 6:], state)
    with torch.no_grad():
        full, _ = model(idx)
    assert _rel(logits, full[:, 6:]) <= STREAM_TOL


@pytest.mark.parametrize("name", ["softmax", "tensor_cache", "sv_hybrid"])
def test_generate_is_deterministic_and_greedy_at_top_k_1(name):
    model = _model(name, positions="none" if name == "sv_hybrid" else "rotary", block=8)
    prompt = _tokens(T=5)
    draws = [model.generate(prompt, 12, temperature=0.8, top_k=20,
                            generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (2, 17)
    assert torch.equal(draws[0][:, :5], prompt)
    greedy = model.generate(prompt, 12, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 12, top_k=1,
                                              generator=torch.Generator().manual_seed(3)))
    # greedy decoding by hand: arg-max of the full forward, one token at a time
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(seq, exact=True)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, seq)


def test_generate_restores_training_mode_and_checks_arguments():
    model = _model("softmax", block=16).train()
    prompt = _tokens(T=4)
    assert model.generate(prompt, 0).shape == (2, 4)
    assert model.training
    with pytest.raises(ValueError, match="exceeds the block size 16"):
        model.generate(prompt, 13)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0; got -1"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match="temperature must be finite and >= 0.0; got -1.0"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 256\]; got 0"):
        model.generate(prompt, 2, top_k=0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        model.generate(prompt, 2, generator=7)


def test_sv_budget_bounds_the_exact_streams_and_is_refused_without_sv_layers():
    """init_state(sv_budget=B) gives every SV layer a budgeted exact stream: the outputs up to
    the first admission beyond B equal the unbudgeted stream, the admitted keys stay bounded
    where reserve keys exist, and a model without SV layers refuses the option."""
    model = _model("sv_hybrid")
    idx = _tokens(B=1, T=30)
    free, _ = _stream(model, idx, [30])
    state = model.init_state(1, sv_budget=4)
    budgeted, state = model.forward_with_state(idx, state)
    layers = [s for s in state.layers if s is not None]
    assert len(layers) == 2 and all(s.budget == 4 for s in layers)
    # the first admission (t = 6) already exceeds the budget; a certified eviction changes no
    # output until the next admission (t = 12)
    assert _rel(budgeted[:, :12], free[:, :12]) <= STREAM_TOL
    for s in layers:
        summary = s.state_summary()
        assert summary["evicted"] > 0
        if summary["over_budget"] == 0:
            assert summary["admitted"].max() <= 4
    with pytest.raises(ValueError, match="sv_budget needs SV layers"):
        _model("softmax").init_state(1, sv_budget=4)
