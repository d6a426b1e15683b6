"""Every ```python block in README.md and docs/*.md runs, and the outputs it shows are right.

A block is self-contained: it runs on its own, in a fresh namespace, in an empty working
directory. A line ``expression  # -> shown`` is checked (the convention is in DEVELOPERS.md):

* ``shown`` a Python literal (numbers, strings, True/False/None, and lists, tuples, dicts of
  them): the value, with NumPy arrays and scalars turned into Python ones by ``.tolist()``,
  equals it, and a float agrees to the digits shown (within half a unit of the last one);
* otherwise ``repr(value)`` matches ``shown`` with ``...`` standing for any text.

Other comments are prose and are not checked.
"""

from __future__ import annotations

import ast
import faulthandler
import io
import random
import re
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SHOWN = re.compile(r"#\s*->\s*(.*?)\s*$")
#: A block runs in the test process; one that hangs ends the run after this many seconds,
#: with every thread's traceback, instead of blocking it.
BLOCK_TIMEOUT_S = 300
#: Imports that need an extra: the block is skipped when the extra is not installed.
NEEDS = {"torch": "torch", "svtoolkit.torch": "torch", "mlx": "mlx.core",
         "svtoolkit.mlx": "mlx.core", "svtoolkit.sklearn": "sklearn", "sklearn": "sklearn",
         "svtoolkit.sweep": "tqdm", "svtoolkit.memory.server": "fastapi"}


def _blocks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the block's first code line
            yield pytest.param(match.group(1), line,
                               id=f"{path.relative_to(ROOT).as_posix()}:{line}")


def _shown_lines(source):
    """{line: shown text} for every ``# -> shown`` comment in ``source``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and (m := SHOWN.match(tok.string)):
            out[tok.start[0]] = m.group(1)
    return out


def _float_tolerance(node, shown):
    """Half a unit in the last digit of the float literal ``node`` written in ``shown``."""
    text = ast.get_source_segment(shown, node).lower()
    mantissa, _, exponent = text.partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _matches(value, node, shown):
    """Does ``value`` equal the literal ``node`` (parsed from ``shown``) to the shown digits?"""
    value = _plain(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
            and isinstance(node.operand, ast.Constant) and isinstance(node.operand.value, float):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and abs(value + node.operand.value) <= _float_tolerance(node.operand, shown))
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and abs(value - node.value) <= _float_tolerance(node, shown))
    if isinstance(node, (ast.List, ast.Tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(node.elts)
                and all(_matches(v, n, shown) for v, n in zip(value, node.elts)))
    if isinstance(node, ast.Dict):
        keys = [ast.literal_eval(k) for k in node.keys]
        return (isinstance(value, dict) and sorted(map(repr, value)) == sorted(map(repr, keys))
                and all(_matches(value[k], n, shown) for k, n in zip(keys, node.values)))
    expected = ast.literal_eval(node)
    return type(value) is type(expected) and value == expected


def _check(value, shown, where):
    try:
        node = ast.parse(shown, mode="eval").body
        ast.literal_eval(node)
    except (SyntaxError, ValueError):
        pattern = ".*".join(map(re.escape, shown.split("...")))
        assert re.fullmatch(pattern, repr(value), re.S), \
            f"{where}: shows {shown}, the code gives {value!r}"
        return
    assert _matches(value, node, shown), f"{where}: shows {shown}, the code gives {value!r}"


class _CheckShown(ast.NodeTransformer):
    """Turn ``expr  # -> shown`` into ``__check__(expr, shown, where)``."""

    def __init__(self, shown, path, first_line):
        self.shown, self.path, self.first_line, self.used = shown, path, first_line, set()

    def visit_Expr(self, node):
        line = node.end_lineno
        if line not in self.shown:
            return node
        self.used.add(line)
        call = ast.Call(ast.Name("__check__", ast.Load()),
                        [node.value, ast.Constant(self.shown[line]),
                         ast.Constant(f"{self.path}:{self.first_line + line - 1}")], [])
        return ast.copy_location(ast.Expr(call), node)


def _needs(tree):
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            for prefix, module in NEEDS.items():
                if name == prefix or name.startswith(prefix + "."):
                    yield module


@pytest.fixture
def global_rngs_kept():
    """A block may seed the global generators (``seed_everything``); later tests see them as
    they were."""
    torch = sys.modules.get("torch")
    states = random.getstate(), np.random.get_state(), torch and torch.random.get_rng_state()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    if torch is not None:  # (a torch the block imported first had no earlier state to keep)
        torch.random.set_rng_state(states[2])


@pytest.mark.usefixtures("global_rngs_kept")
@pytest.mark.parametrize("source, line", list(_blocks()))
def test_python_block_runs_and_shows_what_it_prints(source, line, request, tmp_path,
                                                    monkeypatch):
    path = request.node.callspec.id.rpartition(":")[0]
    tree = ast.parse(source)
    for module in _needs(tree):
        pytest.importorskip(module)
    shown = _shown_lines(source)
    checker = _CheckShown(shown, path, line)
    tree = ast.fix_missing_locations(checker.visit(tree))
    stray = [line + i - 1 for i in sorted(set(shown) - checker.used)]
    assert not stray, f"{path}: '# ->' on lines {stray} does not end an expression statement"
    ast.increment_lineno(tree, line - 1)  # tracebacks name the Markdown file's lines
    monkeypatch.chdir(tmp_path)
    faulthandler.dump_traceback_later(BLOCK_TIMEOUT_S, exit=True)
    try:
        exec(compile(tree, str(ROOT / path), "exec"),
             {"__name__": "__doc_block__", "__check__": _check})
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_the_checker_compares_to_the_digits_shown():
    _check(0.7281, "0.728", "here")
    _check([("a", -1.24)], "[('a', -1.2)]", "here")
    _check(3e-16, "3e-16", "here")
    with pytest.raises(AssertionError, match="shows 0.8, the code gives 0.728"):
        _check(0.728, "0.8", "here")
    with pytest.raises(AssertionError, match="shows 1, the code gives True"):
        _check(True, "1", "here")
    with pytest.raises(AssertionError, match=r"shows Hit\('a', 1.0\), the code gives"):
        _check(("a", 1.0), "Hit('a', 1.0)", "here")
    _check(ValueError("no record 'x'"), "ValueError(...'x'...)", "here")
