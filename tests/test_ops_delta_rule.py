"""Chunked linear attention, decay-only, DeltaNet and Gated DeltaNet vs per-token references.

Seeds are fixed per test (torch.Generator); tolerances are the named tables FP64_TOL / FP32_TOL.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from svtoolkit.torch.ops import (
    decayed_linear_attention,
    delta_rule,
    gated_delta_rule,
    linear_attention,
    naive,
)
from svtoolkit.torch.ops._testing import FP32_TOL, FP64_TOL, assert_close, cotangents_like, vjp

SEED = 20240607
B, H, K, V = 2, 2, 12, 10  # K, V not powers of two

# op name -> (chunked op, per-token reference, names of its per-token gates)
OPS = {
    "linear": (linear_attention, naive.naive_linear_attention, ()),
    "decay": (decayed_linear_attention, naive.naive_decayed_linear_attention, ("g",)),
    "delta": (delta_rule, naive.naive_delta_rule, ("beta",)),
    "gated_delta": (gated_delta_rule, naive.naive_gated_delta_rule, ("g", "beta")),
}


def make_inputs(op: str, length: int, dtype=torch.float64, seed: int = SEED):
    """q, k (unit norm), v, gates and an initial state; every tensor requires grad."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = {
        "q": randn(B, length, H, K),
        "k": F.normalize(randn(B, length, H, K), dim=-1),
        "v": randn(B, length, H, V),
        "initial_state": randn(B, H, K, V) * 0.5,
    }
    gates = OPS[op][2]
    if "g" in gates:
        g = F.logsigmoid(randn(B, length, H) + 2.0)
        g[:, ::7] = 0.0  # exact no-decay steps
        tensors["g"] = g
    if "beta" in gates:
        tensors["beta"] = torch.sigmoid(randn(B, length, H))
    return {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}


def run_chunked(op, inputs, chunk_size):
    fast = OPS[op][0]
    kwargs = {name: inputs[name] for name in OPS[op][2]}
    return fast(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        chunk_size=chunk_size,
        initial_state=inputs["initial_state"],
        output_final_state=True,
        **kwargs,
    )


def run_naive(op, inputs):
    reference = OPS[op][1]
    kwargs = {name: inputs[name] for name in OPS[op][2]}
    return reference(
        inputs["q"], inputs["k"], inputs["v"], initial_state=inputs["initial_state"], **kwargs
    )


@pytest.mark.parametrize("length", [50, 9])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("op", list(OPS))
def test_chunked_matches_per_token_reference(op, chunk_size, length):
    """Outputs, final state and the gradients of every input, fp64; T not a multiple of C."""
    inputs = make_inputs(op, length)
    o, state = run_chunked(op, inputs, chunk_size)
    o_ref, state_ref = run_naive(op, inputs)
    assert_close("o", o_ref, o, FP64_TOL["output"])
    assert_close("final_state", state_ref, state, FP64_TOL["state"])

    cotangents = cotangents_like([o_ref, state_ref], torch.Generator().manual_seed(SEED + 1))
    names = list(inputs)
    grads = vjp([o, state], cotangents, inputs.values())
    grads_ref = vjp([o_ref, state_ref], cotangents, inputs.values())
    for name, got, ref in zip(names, grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


@pytest.mark.parametrize("op", list(OPS))
def test_split_sequence_with_carried_state_equals_full(op):
    """Pieces of 17, 1, 20 and 12 tokens, carrying the state, equal one call on all 50."""
    inputs = make_inputs(op, 50)
    gate_names = OPS[op][2]
    o_full, state_full = run_chunked(op, inputs, 16)
    state, outputs, start = inputs["initial_state"], [], 0
    for piece in (17, 1, 20, 12):
        part = {
            name: inputs[name][:, start : start + piece] for name in ("q", "k", "v", *gate_names)
        }
        part["initial_state"] = state
        o, state = run_chunked(op, part, 16)
        outputs.append(o)
        start += piece
    assert_close("o", o_full, torch.cat(outputs, dim=1), FP64_TOL["output"])
    assert_close("final_state", state_full, state, FP64_TOL["state"])


@pytest.mark.parametrize("op", list(OPS))
def test_float32_chunked_close_to_float64_reference(op):
    """The fp32 chunked path stays within the fp32 tolerance of the fp64 per-token reference."""
    inputs64 = make_inputs(op, 50)
    inputs32 = {name: t.detach().float() for name, t in inputs64.items()}
    o32, state32 = run_chunked(op, inputs32, 32)
    assert o32.dtype == torch.float32
    o_ref, state_ref = run_naive(op, inputs64)
    assert_close("o", o_ref, o32, FP32_TOL["output"])
    assert_close("final_state", state_ref, state32, FP32_TOL["state"])


def test_strong_decay_stays_finite_and_exact():
    """g in [-30, -10] per token (cumulative below -640 in a chunk of 64): exp of g-sums <= 0 only.

    Exponentiating gamma_i - gamma_j for i < j, or dividing by exp(gamma_j), overflows here
    (exp(+640) = inf even in float64, and inf * 0 = NaN).
    """
    inputs = make_inputs("gated_delta", 70)
    gen = torch.Generator().manual_seed(SEED + 2)
    g = -(10.0 + 20.0 * torch.rand(B, 70, H, generator=gen, dtype=torch.float64))
    g[:, ::9] = 0.0
    inputs["g"] = g.requires_grad_()
    o, state = run_chunked("gated_delta", inputs, 64)
    o_ref, state_ref = run_naive("gated_delta", inputs)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert_close("o", o_ref, o, FP64_TOL["output"])
    assert_close("final_state", state_ref, state, FP64_TOL["state"])
    grads = vjp([o], [torch.ones_like(o)], [inputs["g"], inputs["k"]])
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_delta_rule_is_gated_delta_rule_without_decay():
    inputs = make_inputs("gated_delta", 30)
    kwargs = dict(chunk_size=16, initial_state=inputs["initial_state"], output_final_state=True)
    q, k, v, beta = inputs["q"], inputs["k"], inputs["v"], inputs["beta"]
    o_gated, s_gated = gated_delta_rule(q, k, v, g=torch.zeros_like(beta), beta=beta, **kwargs)
    o_delta, s_delta = delta_rule(q, k, v, beta=beta, **kwargs)
    assert_close("o", o_gated, o_delta, FP64_TOL["output"])
    assert_close("final_state", s_gated, s_delta, FP64_TOL["state"])


def test_no_final_state_unless_asked():
    inputs = make_inputs("linear", 10)
    _, state = linear_attention(inputs["q"], inputs["k"], inputs["v"])
    assert state is None


def test_positive_log_decay_is_rejected():
    inputs = make_inputs("gated_delta", 10)
    g = inputs["g"].detach().clone()
    g[0, 3, 1] = 0.25
    with pytest.raises(ValueError, match=r"g must be <= 0"):
        gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], g=g, beta=inputs["beta"])


def test_bad_shapes_are_rejected():
    inputs = make_inputs("gated_delta", 10)
    q, k, v, g, beta = (inputs[n].detach() for n in ("q", "k", "v", "g", "beta"))
    with pytest.raises(ValueError, match=r"q and k must have the same shape"):
        delta_rule(q, k[..., :5], v, beta=beta)
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):
        delta_rule(q, k, v, beta=beta[:, :5])
    with pytest.raises(ValueError, match=r"layout \[B, T, H, D\]"):
        linear_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match=r"initial_state must have shape"):
        gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=torch.zeros(B, H, K, K))
    with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
        linear_attention(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match=r"v must be a floating-point tensor"):
        linear_attention(q, k, v.long())


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_zero_decay_forgets_exactly_and_stays_finite(chunk_size):
    """g = -inf (a_t = 0, allowed by g <= 0) resets the state: chunked equals the reference.

    The cumulative sums met -inf - (-inf) = NaN here, and the NaN spread to earlier tokens of
    the chunk. Resets at a chunk start, mid-chunk, twice in a row and at the last token.
    """
    inputs = make_inputs("gated_delta", 40)
    g = inputs["g"].detach().clone()
    g[0, [0, 5, 6, 16, 39], 0] = -float("inf")
    g[1, [3, 31], 1] = -float("inf")
    inputs["g"] = g.requires_grad_()
    o, state = run_chunked("gated_delta", inputs, chunk_size)
    o_ref, state_ref = run_naive("gated_delta", inputs)
    assert_close("o", o_ref, o, FP64_TOL["output"])
    assert_close("final_state", state_ref, state, FP64_TOL["state"])
    names = ("q", "k", "v", "g", "beta", "initial_state")
    cotangents = cotangents_like([o_ref], torch.Generator().manual_seed(SEED + 3))
    grads = vjp([o], cotangents, [inputs[n] for n in names])
    grads_ref = vjp([o_ref], cotangents, [inputs[n] for n in names])
    for name, got, ref in zip(names, grads, grads_ref, strict=True):
        assert_close(f"d{name}", ref, got, FP64_TOL["grad"])


def test_float32_decay_that_underflows_is_a_reset():
    """fp32 g = -200 (exp underflows to 0) behaves like the fp64 reference with g = -inf."""
    inputs64 = make_inputs("gated_delta", 30)
    g = inputs64["g"].detach().clone()
    g[:, [2, 13, 14]] = -200.0
    inputs32 = {name: t.detach().float() for name, t in inputs64.items()}
    inputs32["g"] = g.float()
    inputs64["g"] = torch.where(g == -200.0, -float("inf"), g)
    o32, state32 = run_chunked("gated_delta", inputs32, 16)
    o_ref, state_ref = run_naive("gated_delta", inputs64)
    assert_close("o", o_ref, o32, FP32_TOL["output"])
    assert_close("final_state", state_ref, state32, FP32_TOL["state"])


def test_nan_log_decay_is_rejected():
    inputs = make_inputs("gated_delta", 10)
    g = inputs["g"].detach().clone()
    g[1, 4, 0] = float("nan")
    with pytest.raises(ValueError, match=r"g must not contain NaN"):
        gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], g=g, beta=inputs["beta"])


CORNER_TOL = 1e-12  # fp64; observed errors are ~1e-16


def test_corners_of_the_gated_delta_rule():
    """The (a, b) corners against the other ops' per-token references, fp64 to 1e-12.

    a = 1 with the additive write is linear attention; a = 1 with the delta write is DeltaNet;
    the decay with the additive write is the decay-only op; both is the gated delta rule.
    """
    inputs = {n: t.detach() for n, t in make_inputs("gated_delta", 30).items()}
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    state0 = inputs["initial_state"]
    kwargs = dict(chunk_size=8, initial_state=state0, output_final_state=True)
    no_decay = torch.zeros_like(g)
    corners = {
        "linear attention": (
            decayed_linear_attention(q, k, v, g=no_decay, **kwargs),
            naive.naive_linear_attention(q, k, v, initial_state=state0),
        ),
        "DeltaNet": (
            gated_delta_rule(q, k, v, g=no_decay, beta=beta, **kwargs),
            naive.naive_delta_rule(q, k, v, beta=beta, initial_state=state0),
        ),
        "decay only": (
            decayed_linear_attention(q, k, v, g=g, **kwargs),
            naive.naive_decayed_linear_attention(q, k, v, g=g, initial_state=state0),
        ),
        "gated delta": (
            gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs),
            naive.naive_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state0),
        ),
    }
    for name, ((o, state), (o_ref, state_ref)) in corners.items():
        assert_close(f"{name} o", o_ref, o, CORNER_TOL)
        assert_close(f"{name} state", state_ref, state, CORNER_TOL)
    # the naive references agree among themselves at the corners
    o_gated, _ = naive.naive_gated_delta_rule(q, k, v, g=no_decay, beta=beta, initial_state=state0)
    o_delta, _ = naive.naive_delta_rule(q, k, v, beta=beta, initial_state=state0)
    assert_close("naive gated at a = 1", o_delta, o_gated, CORNER_TOL)
    o_decay, _ = naive.naive_decayed_linear_attention(q, k, v, g=no_decay, initial_state=state0)
    o_linear, _ = naive.naive_linear_attention(q, k, v, initial_state=state0)
    assert_close("naive decay-only at a = 1", o_linear, o_decay, CORNER_TOL)


@pytest.mark.parametrize("op", list(OPS))
def test_gradcheck(op):
    """torch.autograd.gradcheck of outputs and final state on tiny fp64 inputs (T = 7, C = 3)."""
    inputs = make_inputs(op, 7)
    names = list(inputs)
    tiny = [inputs[n].detach()[:1, :, :, :3] if inputs[n].ndim == 4 else inputs[n].detach()[:1]
            for n in names]
    tiny = [t[..., :3, :3] if n == "initial_state" else t for n, t in zip(names, tiny)]
    # finite differences step both ways: keep g away from its bound g <= 0
    tiny = [t - 0.05 if n == "g" else t for n, t in zip(names, tiny)]
    tiny = [t.clone().requires_grad_() for t in tiny]

    def run(*values):
        return run_chunked(op, dict(zip(names, values, strict=True)), 3)

    assert torch.autograd.gradcheck(run, tiny, fast_mode=True)


def test_decayed_linear_attention_checks_its_decay():
    inputs = make_inputs("decay", 10)
    q, k, v, g = (inputs[n].detach() for n in ("q", "k", "v", "g"))
    bad = g.clone()
    bad[0, 2, 1] = 0.5
    with pytest.raises(ValueError, match=r"g must be <= 0"):
        decayed_linear_attention(q, k, v, g=bad)
    bad[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"g must not contain NaN"):
        decayed_linear_attention(q, k, v, g=bad)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\]"):
        decayed_linear_attention(q, k, v, g=g[:, :4])
