"""Shared helpers for the benchmarks: machine description, timing statistics, JSON output."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from svtoolkit.experiments import record

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """CPU model name (the one the experiments' run record gives), ``"unknown"`` if none."""
    return record.cpu_model() or platform.machine() or "unknown"


def machine_info(packages=("numpy", "numba", "scipy", "cvxpy", "clarabel", "scikit-learn",
                           "torch", "mlx")):
    """CPU model, core count, Python and package versions, and the checkout's commit (with its
    dirty flag, as the experiments' run record gives it)."""
    cpu = cpu_model()
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git": record.git_state(Path(__file__).resolve().parent),
    }


def median_distance(X):
    """Median Euclidean distance over the distinct pairs of rows of ``X`` (n, d).

    Memory O(n^2) (SciPy's ``pdist``), not the O(n^2 d) of broadcast differences: 805 MB at
    n = 512, d = 384.
    """
    from scipy.spatial.distance import pdist

    return float(np.median(pdist(np.asarray(X, dtype=np.float64))))


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call with the garbage collector paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, time.perf_counter() - t0
    finally:
        if enabled:
            gc.enable()


def stats(seconds):
    """Median, min, max and count of a list of durations (seconds), or None when empty."""
    if not len(seconds):
        return None
    arr = np.asarray(seconds, dtype=float)
    return {"median": float(np.median(arr)), "min": float(arr.min()),
            "max": float(arr.max()), "count": int(arr.size)}


def write_json(name, payload):
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def write_text(name, text):
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path


def fmt_us(seconds):
    return "—" if seconds is None else f"{seconds * 1e6:,.1f}"


def fmt_ms(seconds):
    return "—" if seconds is None else f"{seconds * 1e3:,.2f}"


@contextlib.contextmanager
def competing_process(enabled=True):
    """Run one CPU-bound process (a Python busy loop) for the duration of the block, when
    ``enabled``: the load of a shared machine, which spinning thread pools react to."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it reach the CPU before the measurement starts
        yield proc
    finally:
        proc.kill()
        proc.wait()
