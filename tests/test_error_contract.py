"""One error contract for the torch and MLX SV-Attention twins.

Every bad option, input or request raises the same exception type with the same message in
both frameworks (the checks live once, in svtoolkit._validation and svtoolkit._gate_core).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")


class Framework:
    """The SV-Attention API of one framework, with NumPy -> framework array conversion."""

    def __init__(self, name):
        self.name = name
        if name == "torch":
            import svtoolkit.torch as api
            from svtoolkit.torch import ops

            self.api, self.ops = api, ops
            self.bool_, self.float16 = torch.bool, torch.float16
        else:
            mx = pytest.importorskip("mlx.core")
            import svtoolkit.mlx as api

            self.api, self.ops, self.mx = api, api, mx
            self.bool_, self.float16 = mx.bool_, mx.float16

    def array(self, x, dtype=None):
        x = np.asarray(x)
        if self.name == "torch":
            t = torch.from_numpy(x.copy())
            return t if dtype is None else t.to(dtype)
        a = self.mx.array(x)
        return a if dtype is None else a.astype(dtype)

    def x(self, B=2, T=9, d=32, dtype=None):
        data = np.random.default_rng(0).standard_normal((B, T, d)).astype(np.float32)
        return self.array(data, dtype)

    def layer(self, **options):
        if self.name == "torch":
            torch.manual_seed(0)
        return self.api.CausalSVAttention(32, 4, chunk=4, **options)

    def stream(self):
        layer = self.layer()
        _, state = layer.forward_with_state(self.x(T=10))  # 0..7 admitted, 8..9 current chunk
        state.forget(0, 1)
        return state


def _construct(**options):
    def call(fw):
        rest = dict(options)
        d_model, n_heads = rest.pop("d_model", 32), rest.pop("n_heads", 4)
        return fw.api.CausalSVAttention(d_model, n_heads, **rest)

    return call


CASES = {
    # layer options
    "C=0": (_construct(C=0.0), ValueError, "C must be finite and > 0; got 0.0"),
    "C=str": (_construct(C="0.3"), TypeError, "C must be a real number; got str"),
    "sigma<0": (_construct(sigma=-1.0), ValueError, "sigma must be finite and > 0; got -1.0"),
    "chunk=0": (_construct(chunk=0), ValueError, "chunk must be >= 1; got 0"),
    "chunk=float": (_construct(chunk=2.5), TypeError, "chunk must be an int; got float"),
    "fista_iters=0": (_construct(fista_iters=0), ValueError, "fista_iters must be >= 1; got 0"),
    "ridge<0": (_construct(ridge=-1.0), ValueError, "ridge must be finite and >= 0; got -1.0"),
    "ridge=str": (_construct(ridge="a"), TypeError, "ridge must be a real number; got str"),
    "d_model=0": (_construct(d_model=0), ValueError, "d_model must be >= 1; got 0"),
    "n_heads=float": (_construct(n_heads=4.0), TypeError, "n_heads must be an int; got float"),
    "indivisible": (_construct(d_model=30), ValueError,
                    "d_model (30) must be divisible by n_heads (4), or pass head_dim="),
    # inputs
    "x shape": (lambda fw: fw.layer()(fw.x(d=31)), ValueError,
                "x must have shape (B, T, d_model=32); got (2, 9, 31)"),
    "x empty": (lambda fw: fw.layer()(fw.x(T=0)), ValueError,
                "the sequence is empty (T = 0); pass at least one token"),
    "x float16": (lambda fw: fw.layer().forward_exact(fw.x(dtype=fw.float16)), TypeError,
                  "CausalSVAttention supports float32 and float64 only; got x of dtype "
                  "float16 and weights of dtype float32 (convert the input and the layer to "
                  "float32 or float64)"),
    "exclude shape": (lambda fw: fw.layer()(fw.x(), exclude=fw.array(np.zeros((2, 3), bool))),
                      ValueError, "exclude must be a bool array of shape (B, T) = (2, 9); got "
                      "bool (2, 3)"),
    "exclude dtype": (lambda fw: fw.layer()(fw.x(), exclude=fw.array(np.zeros((2, 9),
                                                                              np.float32))),
                      ValueError, "exclude must be a bool array of shape (B, T) = (2, 9); got "
                      "float32 (2, 9)"),
    "step x_t": (lambda fw: fw.layer().step(fw.x(T=1)), ValueError,
                 "x_t must have shape (B, d_model=32); got (2, 1, 32)"),
    # the ops and the batched path
    "sv_gate tol": (lambda fw: fw.ops.sv_gate(fw.x(T=9).reshape(2, 9, 4, 8), C=0.3, sigma=1.0,
                                              chunk=4, tol=0.7), ValueError,
                    "tol must be finite and in [0.0, 0.5); got 0.7"),
    "sv_gate iters": (lambda fw: fw.ops.sv_gate(fw.x(T=9).reshape(2, 9, 4, 8), C=0.3,
                                                sigma=1.0, chunk=4, iters=-1), ValueError,
                      "iters must be >= 0; got -1"),
    "exact gate chunk": (lambda fw: fw.ops.exact_sv_gate(fw.x(T=9).reshape(2, 9, 4, 8), C=0.3,
                                                         sigma=1.0, chunk=0), ValueError,
                         "chunk must be >= 1; got 0"),
    "fista iters": (lambda fw: fw.api.fista_svdd(fw.array(np.eye(3)[None]), 0.5, iters=1.5),
                    TypeError, "iters must be an int; got float"),
    "ridged ridge": (lambda fw: fw.api.ridged_svdd_solve(
        fw.array(np.eye(3)[None]), 0.5, fw.array(np.ones((1, 3), bool)),
        fw.array(np.zeros((1, 3), bool)), ridge=float("nan")), ValueError,
        "ridge must be finite and >= 0; got nan"),
    # streaming state
    "batch_size=0": (lambda fw: fw.layer().init_state(0), ValueError,
                     "batch_size must be >= 1; got 0"),
    "budget=0": (lambda fw: fw.layer().init_state(2, budget=0), ValueError,
                 "budget must be >= 1; got 0"),
    "forget unseen": (lambda fw: fw.stream().forget(0, 10), IndexError,
                      "position 10 has not been seen (stream is at 10)"),
    "forget sequence": (lambda fw: fw.stream().forget(2, 1), IndexError,
                        "sequence 2 out of range for batch size 2"),
    "forget twice": (lambda fw: fw.stream().forget(0, 1), KeyError,
                     "position 1 of sequence 0 was already forgotten"),
    "forget float": (lambda fw: fw.stream().forget(0, 3.0), TypeError,
                     "position must be an integer; got 3.0 (float)"),
    "forget bool": (lambda fw: fw.stream().forget(True, 3), TypeError,
                    "b must be an integer; got True (bool)"),
}


@pytest.mark.parametrize("framework", ["torch", "mlx"])
@pytest.mark.parametrize("case", list(CASES))
def test_same_exception_and_message_in_both_frameworks(framework, case):
    fw = Framework(framework)
    call, error, message = CASES[case]
    with pytest.raises(error, match=re.escape(message)) as info:
        call(fw)
    assert type(info.value) is error
