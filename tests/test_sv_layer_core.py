"""The SV layers' control flow lives once, in svtoolkit._layer_core, for torch and MLX alike.

The neutral module imports no framework; both backends' layers run their checks, paths and
streaming through it; and the two namespaces of tensor operations it runs on offer the same
names, every one the core uses.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import svtoolkit._layer_core as core

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "svtoolkit" / "_layer_core.py"
FRAMEWORKS = ("torch", "mlx")


def test_the_core_imports_no_framework():
    tree = ast.parse(CORE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert not imported & {"torch", "mlx"}, imported
    # nor does anything it imports (a fresh process: the test session has both loaded)
    code = ("import sys, svtoolkit._layer_core; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'mlx'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]", out


def _names_the_core_calls():
    """Every ``ops.<name>`` and ``self.ops.<name>`` the core reads."""
    names = set()
    for node in ast.walk(ast.parse(CORE.read_text())):
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == "ops":
                names.add(node.attr)
            if isinstance(base, ast.Attribute) and base.attr == "ops":
                names.add(node.attr)
    return names


def _namespace(framework):
    if framework == "torch":
        pytest.importorskip("torch")
        from svtoolkit.torch.layers import _tensor_ops
    else:
        pytest.importorskip("mlx.core")
        from svtoolkit.mlx import _tensor_ops
    return _tensor_ops


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_namespace_has_every_operation_the_core_calls(framework):
    ops = _namespace(framework)
    called = _names_the_core_calls()
    assert {"split_heads", "sv_gate", "stored_keys", "masked_min"} <= called  # the parse works
    assert called <= set(ops.__all__), sorted(called - set(ops.__all__))
    assert all(hasattr(ops, name) for name in ops.__all__)


def test_the_two_namespaces_are_twins():
    torch_ops, mlx_ops = _namespace("torch"), _namespace("mlx")
    assert set(torch_ops.__all__) == set(mlx_ops.__all__)


def test_the_operations_agree_across_the_namespaces():
    """Each operation computes the same numbers in both frameworks (float64 on the CPU)."""
    torch, mx = pytest.importorskip("torch"), pytest.importorskip("mlx.core")
    t, m = _namespace("torch"), _namespace("mlx")
    y = np.random.default_rng(0).standard_normal((2, 3, 8))
    yt, ym = torch.from_numpy(y.copy()), mx.array(y, dtype=mx.float64)
    np.testing.assert_array_equal(t.split_heads(yt, 2, 4).numpy(),
                                  np.array(m.split_heads(ym, 2, 4)))
    np.testing.assert_array_equal(t.merge_heads(t.split_heads(yt, 2, 4)).numpy(), y)
    np.testing.assert_array_equal(np.array(m.merge_heads(m.split_heads(ym, 2, 4))), y)
    np.testing.assert_allclose(t.rms_norm(yt).numpy(), np.array(m.rms_norm(ym)), rtol=1e-12)
    mask = y[0] > 0
    mask[1] = False  # a row without a True entry
    mt, mm = torch.from_numpy(mask.copy()), mx.array(mask)
    for name, reduce, empty in (("masked_min", np.min, np.inf), ("masked_max", np.max, -np.inf)):
        want = np.array([[reduce(row[keep]) if keep.any() else empty]
                         for row, keep in zip(y[0], mask)])
        np.testing.assert_array_equal(getattr(t, name)(yt[0], mt).numpy(), want)
        np.testing.assert_array_equal(np.array(getattr(m, name)(ym[0], mm)), want)
    np.testing.assert_array_equal(t.heads_first(yt).numpy(), y.swapaxes(0, 1))
    np.testing.assert_array_equal(np.array(m.heads_first(ym)), y.swapaxes(0, 1))
    np.testing.assert_array_equal(t.concat([yt, yt], 1).numpy(), np.concatenate([y, y], 1))
    np.testing.assert_array_equal(np.array(m.concat([ym, ym], 1)), np.concatenate([y, y], 1))
    keys = [y[0, 0], y[0, 1]]
    assert t.stack_keys([torch.from_numpy(k.copy()) for k in keys], torch.float32).dtype \
        == torch.float32
    assert m.stack_keys(keys, mx.float32).dtype == mx.float32
    stored_t, stored_m = t.stored_keys(yt.float()), m.stored_keys(ym.astype(mx.float32))
    assert stored_t[1].dtype == torch.float64 and stored_m[1].dtype == np.float64
    np.testing.assert_array_equal(stored_t[1].numpy(), stored_m[1])


def _layers(framework, hybrid):
    """A small layer of each framework and an input for it."""
    x = np.random.default_rng(1).standard_normal((2, 9, 16)).astype(np.float32)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from svtoolkit.torch import CausalSVAttention, HybridSVAttention

        torch.manual_seed(0)
        layer = (HybridSVAttention if hybrid else CausalSVAttention)(16, 2, chunk=4)
        return layer, torch.from_numpy(x)
    mx = pytest.importorskip("mlx.core")
    from svtoolkit.mlx import CausalSVAttention, HybridSVAttention

    return (HybridSVAttention if hybrid else CausalSVAttention)(16, 2, chunk=4), mx.array(x)


@pytest.mark.parametrize("hybrid", [False, True], ids=["causal", "hybrid"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_path_of_both_backends_runs_through_the_core(framework, hybrid, monkeypatch):
    layer, x = _layers(framework, hybrid)
    assert isinstance(layer, core.SVLayerCore)
    calls = []

    def spy(cls, name):
        original = getattr(cls, name)

        def recorded(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    for name in ("_check_input", "_qkv", "_gate_of", "_readout", "_forward", "_stream"):
        spy(core.SVLayerCore, name)
    spy(core.SVStreamCore, "_read")
    for call, expected in (
        (lambda: layer(x), ["_forward", "_qkv", "_check_input", "_gate_of", "_readout"]),
        (lambda: layer.forward_exact(x),
         ["_forward", "_qkv", "_check_input", "_gate_of", "_readout"]),
        (lambda: layer.gate(x), ["_qkv", "_check_input", "_gate_of"]),
        (lambda: layer.step(x[:, 0]), ["_stream", "_check_input", "_qkv", "_check_input"]
         + ["_read"] * 2),
    ):
        calls.clear()
        call()
        assert calls == expected
    # the streaming state is the core's, and so are the heads' checks
    state = layer.init_state(2)
    assert isinstance(state, core.SVStreamCore)
    with pytest.raises(ValueError, match=r"x_t must have shape \(B, d_model=16\)"):
        layer.step(x, state)
