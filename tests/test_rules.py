"""The shared rules (svtoolkit._rules), the scalar validators and the ahead-of-time warm-up."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from svtoolkit import _rules
from svtoolkit._validation import check_bool, check_int, check_option, check_positive, check_real

PACKAGE = Path(__file__).resolve().parent.parent / "svtoolkit"
DESIGN = PACKAGE.parent / "docs" / "design.md"
TABLE_HEADER = "| name | module | value | reason |"


# ------------------------------------------------------------------------------ rules module
def test_rules_module_has_constants_only_and_no_imports():
    tree = ast.parse((PACKAGE / "_rules.py").read_text())
    for node in tree.body:
        assert not isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef)), \
            ast.dump(node)[:80]
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions == ["feasible", "sums_to_one"]
    names = [n for n in vars(_rules) if n.isupper()]
    assert {"FEASIBILITY_TOL", "FEASIBLE_FROM", "ERRORS_OVERFLOW_ABOVE", "BATCHED_PARTITION_TOL",
            "IPM_PARTITION_TOL", "RIDGE", "POWER_ITERS", "PROJECTION_MAX_ITER"} <= set(names)


def test_every_rule_has_a_reason_comment():
    """Each constant is preceded by a ``#:`` comment (its reason), in the source."""
    lines = (PACKAGE / "_rules.py").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and line[0].isupper() and " = " in line:
            assert lines[i - 1].startswith("#:"), line


def test_feasibility_tolerance_is_one_home():
    """No module retypes the feasibility tolerance or imports it from the private walk."""
    from svtoolkit.exact import _walk

    assert _walk.FEASIBILITY_TOL is _rules.FEASIBILITY_TOL
    assert _rules.FEASIBLE_FROM == 1.0 - _rules.FEASIBILITY_TOL
    users = ["_fista.py", "_gate_core.py", "reference.py", "torch/batched.py",
             "torch/exact_gate.py", "mlx/batched.py", "mlx/ops.py", "torch/ops/chunked_sv.py"]
    for name in users:
        text = (PACKAGE / name).read_text()
        assert "_walk import FEASIBILITY_TOL" not in text, name
        for literal in ("1.0 - 1e-12", "> 1e-12", "1e-12) + 2"):
            assert literal not in text, (name, literal)


def test_the_rules_of_the_dual_are_not_written_out_again():
    """Modules that decide feasibility, |E| C = 1 or the error overflow call the rule by name."""
    users = ["reference.py", "torch/exact_gate.py", "torch/batched.py", "mlx/batched.py",
             "_gate_core.py", "selection.py"]
    for name in users:
        text = (PACKAGE / name).read_text()
        for literal in ("1.0 - FEASIBILITY_TOL", "1.0 + FEASIBILITY_TOL", "- 1.0) > FEASIB",
                        "- 1.0) <= FEASIB"):
            assert literal not in text, (name, literal)


@pytest.mark.parametrize("n", [1, 2, 49, 54, 98, 103, 1000])
def test_feasible_is_the_float64_rule_at_and_around_one(n):
    """``feasible`` is ``n C >= 1 - FEASIBILITY_TOL`` in float64, on both sides of n C = 1."""
    C = 1.0 / n
    assert _rules.feasible(n, C) and _rules.feasible(n, np.float64(C))
    assert _rules.feasible(np.int64(n), C)
    assert _rules.feasible(n, np.nextafter(C, 0.0))          # a few ulps below: still feasible
    assert not _rules.feasible(n, C * (1.0 - 1e-13))         # a real shortfall: warm-up
    assert not _rules.feasible(n - 1, C)
    assert not _rules.feasible(0, 1.0)


@pytest.mark.parametrize("n", [1, 49, 54, 98, 103, 1000])
def test_sums_to_one_is_the_feasibility_slack_on_both_sides(n):
    """``|n C - 1| <= FEASIBILITY_TOL``: C = 1/n and its neighbouring floats sum to one, a
    real excess or shortfall does not."""
    C = 1.0 / n
    for c in (C, np.nextafter(C, 0.0), np.nextafter(C, 1.0)):
        assert _rules.sums_to_one(n, c)
    assert not _rules.sums_to_one(n, C * (1.0 + 1e-13))
    assert not _rules.sums_to_one(n, C * (1.0 - 1e-13))
    assert not _rules.sums_to_one(n + 1, C) and not _rules.sums_to_one(0, C)


def test_error_overflow_starts_where_sums_to_one_ends():
    """A count whose product with C is just above 1 but sums to one does not overflow."""
    assert _rules.ERRORS_OVERFLOW_ABOVE == 1.0 + _rules.FEASIBILITY_TOL
    for n in range(1, 2000):
        for C in (1.0 / n, np.nextafter(1.0 / n, 1.0)):
            overflow = n * C > _rules.ERRORS_OVERFLOW_ABOVE
            assert not overflow and _rules.sums_to_one(n, C)
            assert (n + 1) * C > _rules.ERRORS_OVERFLOW_ABOVE


def _literal(text):
    """The number a table cell's Python expression (``1e-15``, ``1 - 1e-15``, ``2**-53``)
    stands for; only numbers and + - * / ** are allowed."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__,
                   ast.Div: float.__truediv__, ast.Pow: float.__pow__}
            return ops[type(node.op)](float(value(node.left)), float(value(node.right)))
        raise ValueError(f"not a numeric expression: {text!r}")

    return value(ast.parse(text, mode="eval").body)


def _tolerance_table():
    """{name: (module, value)} from the one table of tolerances in docs/design.md."""
    lines = DESIGN.read_text().splitlines()
    start = lines.index(TABLE_HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        name, module, value = (cell.strip("`") for cell in cells[:3])
        assert name not in rows, f"{name} listed twice"
        rows[name] = (module, _literal(value))
    return rows


def test_the_tolerance_table_lists_every_rule_with_its_value():
    """docs/design.md's table holds every constant of _rules, and each value it gives
    (module-local tolerances of the exact solver too) is the one its module defines."""
    import importlib

    rows = _tolerance_table()
    constants = {n for n in vars(_rules) if n.isupper()}
    assert constants <= set(rows), sorted(constants - set(rows))
    for name, (module, value) in rows.items():
        defined = getattr(importlib.import_module(module), name)
        assert defined == value, (name, module, defined, value)
    listed = {m for m, _ in rows.values()}
    for module in listed - {"svtoolkit._rules"}:  # each listed module's tolerances, all of them
        mod = importlib.import_module(module)
        tolerances = {n for n in vars(mod) if n.isupper() and n.endswith(("_TOL", "_SNAP"))
                      and getattr(mod, n) is not getattr(_rules, n, None)}
        assert tolerances <= set(rows), (module, sorted(tolerances - set(rows)))


def test_the_table_parser_reads_values_and_refuses_other_text():
    assert _literal("1 - 1e-15") == _rules.FEASIBLE_FROM and _literal("2**-53") == 2.0**-53
    with pytest.raises(ValueError, match="not a numeric expression: 'C \\* 1e-12'"):
        _literal("C * 1e-12")


def test_the_two_partition_thresholds_have_different_names():
    assert _rules.BATCHED_PARTITION_TOL == 1e-3 and _rules.IPM_PARTITION_TOL == 1e-6


def test_feasibility_slack_covers_the_rounding_of_one_over_n():
    """``n * (1 / n)`` rounds below 1 for some n; the rule still calls C = 1/n feasible."""
    short = [n for n in range(1, 250) if n * (1.0 / n) < 1.0]
    assert short[:3] == [49, 98, 103]
    assert all(n * (1.0 / n) >= _rules.FEASIBLE_FROM for n in range(1, 10_000))


# ------------------------------------------------------------------------------ validators
@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: check_int(True, "chunk", min=1), TypeError, "chunk must be an int; got bool"),
    (lambda: check_int(2.0, "chunk", min=1), TypeError, "chunk must be an int; got float"),
    (lambda: check_int(0, "chunk", min=1), ValueError, "chunk must be >= 1; got 0"),
    (lambda: check_int(9, "k", max=8), ValueError, "k must be <= 8; got 9"),
    (lambda: check_int(0, "top_k", min=1, max=8), ValueError, r"top_k must be in \[1, 8\]; got 0"),
    (lambda: check_bool(1, "ntk"), TypeError, "ntk must be a bool; got int"),
    (lambda: check_real("a", "C"), TypeError, "C must be a real number; got str"),
    (lambda: check_real(math.nan, "ridge", min=0), ValueError,
     "ridge must be finite and >= 0; got nan"),
    (lambda: check_real(0.5, "tol", min=0.0, max=0.5, include_max=False), ValueError,
     r"tol must be finite and in \[0.0, 0.5\); got 0.5"),
    (lambda: check_positive(0, "C"), ValueError, "C must be finite and > 0; got 0.0"),
    (lambda: check_option("gpu", "backend", ("auto", "torch")), ValueError,
     "backend must be one of 'auto', 'torch'; got 'gpu'"),
])
def test_validators_name_the_argument_and_the_constraint(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_validators_accept_and_convert():
    assert check_int(np.int64(3), "n", min=1) == 3 and type(check_int(np.int64(3), "n")) is int
    assert check_real(np.float32(0.25), "C", min=0) == 0.25
    assert check_real(0.0, "tol", min=0.0, max=0.5, include_max=False) == 0.0
    assert check_option("auto", "backend", ("auto", "torch")) == "auto"
    assert check_int(8, "top_k", min=1, max=8) == 8
    assert check_bool(np.bool_(True), "ntk") is True


# ------------------------------------------------------------------------------ warm-up
def _dispatchers(module):
    import numba

    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, numba.core.registry.CPUDispatcher)
            and obj.__module__ == module.__name__}


def _module_name(path):
    """(module, package) of a file of the package, e.g. ("svtoolkit.exact._walk",
    "svtoolkit.exact")."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), ".".join(parts[:-1])
    return ".".join(parts), ".".join(parts[:-1])


def _absolute(package, node):
    """The absolute module of ``from <node.module> import ...`` in a module of ``package``."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_kernel(func):
    return any("njit" in ast.unparse(d) for d in func.decorator_list)


def _python_calls(path, kernels):
    """Kernels called from plain Python code (outside any @njit function) in one file."""
    module, package = _module_name(path)
    tree = ast.parse(path.read_text())
    aliases, names = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(package, node)
            for a in node.names:
                target = f"{source}.{a.name}"
                if target in kernels:
                    names[a.asname or a.name] = target
                else:
                    aliases[a.asname or a.name] = target
    own = {f"{module}.{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = set()

    def visit(node):
        if isinstance(node, ast.FunctionDef) and _is_kernel(node):
            return
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                target = f"{aliases.get(f.value.id, '')}.{f.attr}"
                if target in kernels:
                    found.add(target)
            elif isinstance(f, ast.Name):
                target = names.get(f.id, f"{module}.{f.id}")
                if target in kernels and (f.id in names or target in own):
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _entry_points():
    """Kernels that plain Python code of the package calls (the warm-up must compile those;
    kernels called only from other kernels are compiled with their callers)."""
    from svtoolkit._warmup import kernel_modules

    kernels = {f"{m.__name__}.{name}" for m in kernel_modules() for name in _dispatchers(m)}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        found |= _python_calls(path, kernels)
    return sorted(found)


def test_kernel_modules_list_every_module_with_a_kernel():
    from svtoolkit._warmup import kernel_modules

    listed = {m.__file__ for m in kernel_modules()}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and _is_kernel(n) for n in ast.walk(tree)):
            assert str(path) in listed, path


def test_warmup_compiles_every_entry_point_in_a_fresh_process():
    """In a new interpreter, after ``svtoolkit.warmup()`` every kernel that Python code calls
    has a compiled signature (cache loads count), and the top-level name still works."""
    entry = _entry_points()
    for name in ("svtoolkit.exact._walk.walk", "svtoolkit._fista.fista_batch",
                 "svtoolkit._fista.fista_prefix_batch", "svtoolkit.kernels._gram"):
        assert name in entry, name
    script = (
        "import importlib, json, svtoolkit\n"
        "svtoolkit.warmup()\n"
        f"names = {entry!r}\n"
        "bad = []\n"
        "for full in names:\n"
        "    mod, name = full.rsplit('.', 1)\n"
        "    d = getattr(importlib.import_module(mod), name)\n"
        "    sigs = [str(s) for s in d.signatures]\n"
        "    if not sigs: bad.append(full)\n"
        "    if name.startswith('fista') and not ("
        "any('float32' in s for s in sigs) and any('float64' in s for s in sigs)):\n"
        "        bad.append(full + ' (both dtypes)')\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=900)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_jit_module_imports_no_kernel_module():
    tree = ast.parse((PACKAGE / "_jit.py").read_text())
    top_imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(getattr(node, "level", 0) == 0 for node in top_imports)
