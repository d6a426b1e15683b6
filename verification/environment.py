"""Hardware, versions and provenance for the report header."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from svtoolkit.experiments.record import git_state

__all__ = ["environment"]

#: Distributions whose versions the report lists.
PACKAGES = ("svtoolkit", "numpy", "numba", "scipy", "cvxpy", "clarabel", "osqp", "scikit-learn",
            "river", "joblib", "dask", "distributed", "matplotlib", "tqdm", "threadpoolctl")


def _version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _blas():
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown"
    libs = [f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads)"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(libs) or "unknown"


def environment():
    """A dict describing where and with what the suite ran."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "blas": _blas(),
        # {"commit", "dirty"} of the checkout (the experiments' run record reads it the same way)
        "git": git_state(Path(__file__).resolve().parents[1]),
        "versions": {name: _version(name) for name in PACKAGES},
    }
