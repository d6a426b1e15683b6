"""Load a script that is not a package module (a benchmark) as a module, for its tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name):
    """``benchmarks/<name>.py`` as a fresh module named ``<name>_benchmark``."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark",
                                                  ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
