"""The import graph of svtoolkit runs one way: no cycle between modules, no arrow up a floor.

Read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ... import``
anywhere in a module (function-level imports too, since a lazy import is still a dependency) and
every ``importlib.import_module("svtoolkit...")`` with a literal name. ``from package import
name`` counts as an arrow to the submodule when ``name`` is one, else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "svtoolkit"

#: The floors of docs/design.md (section 8), lowest first: a module may import only from its own
#: floor or those below. Each entry is a top-level module or subpackage of svtoolkit.
FLOORS = (
    ("_rules", "_validation", "_optional", "_jit", "_openmp"),
    ("kernels", "_fista", "data", "corpora", "tasks", "stats", "sweep", "embeddings",
     "_minilm"),
    ("exact",),
    ("memory", "reference", "sklearn", "_gate_core", "_layer_core"),
    ("torch", "mlx", "selection"),
    ("experiments",),
    ("_warmup", "cli", "__main__", "__init__"),
)


def _modules():
    """{dotted name: (path, is_package)} of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _graph():
    """{module: set of svtoolkit modules it imports}."""
    modules = _modules()

    def owner(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    edges = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    targets.add(f"{source}.{a.name}" if f"{source}.{a.name}" in modules
                                else owner(source))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                targets.add(owner(node.args[0].value))
        edges[module] = {t for t in targets if t.startswith("svtoolkit") and t != module}
    return edges


def _cycles(edges):
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _floor(module):
    unit = module.split(".")[1] if "." in module else "__init__"
    for level, units in enumerate(FLOORS):
        if unit in units:
            return level
    raise AssertionError(f"{module} is on no floor: add its top-level unit to FLOORS")


def test_the_graph_sees_function_level_and_literal_dynamic_imports():
    edges = _graph()
    # a function-level import (the memory server's warm-up) and a package-level re-export
    assert "svtoolkit.exact._warmup" in edges["svtoolkit.memory.server"]
    assert "svtoolkit.exact.solver" in edges["svtoolkit.exact"]


def test_no_import_cycle():
    edges = _graph()
    cycles = _cycles(edges)
    detail = [[f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c] for c in cycles]
    assert cycles == [], detail


def test_no_import_goes_up_a_floor():
    edges = _graph()
    upward = [f"{a} (floor {_floor(a)}) -> {b} (floor {_floor(b)})"
              for a in sorted(edges) for b in sorted(edges[a]) if _floor(b) > _floor(a)]
    assert upward == []
