"""The run record: what produced a result (code, machine, threads, configuration).

Written into every result JSON of :mod:`svtoolkit.experiments`, so that two results can be
told apart by their environment when their numbers differ.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

__all__ = ["THREAD_ENV", "cpu_model", "git_state", "run_record", "thread_state"]

#: Environment variables that set thread counts of the native pools.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
              "NUMBA_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "ATEN_CPU_CAPABILITY",
              "NUMBA_CPU_NAME", "OPENBLAS_CORETYPE")

_PACKAGES = ("svtoolkit", "numpy", "numba", "scipy", "torch", "threadpoolctl", "joblib",
             "matplotlib", "tqdm")


def git_state(path=None):
    """``{"commit": sha, "dirty": bool}`` of the checkout holding ``path``, None outside one.

    ``dirty`` is True when tracked files differ from the commit (untracked files ignored).
    """
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=where, capture_output=True, text=True, timeout=10,
                                check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or None."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_flags():
    """The vector extensions that decide which native kernels run (AVX2, AVX-512, ...)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return sorted(f for f in flags if f.startswith(("avx", "fma", "sse4")))
    except OSError:
        pass
    return None


def thread_state():
    """Thread counts of the pools now: torch (only if already imported), Numba, threadpoolctl.

    Never imports torch (the ``--help`` path must not); Numba and threadpoolctl are imported.
    """
    out = {"env": {name: os.environ.get(name) for name in THREAD_ENV}}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch_threads"] = torch.get_num_threads()
        out["torch_interop_threads"] = torch.get_num_interop_threads()
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    try:
        import numba

        out["numba_threads"] = numba.get_num_threads()
        out["numba_threading_layer_config"] = numba.config.THREADING_LAYER
        out["numba_cpu_name"] = numba.config.CPU_NAME or "host"
    except ImportError:  # pragma: no cover - numba is a dependency
        out["numba_threads"] = None
    try:
        from threadpoolctl import threadpool_info

        out["threadpools"] = [
            {k: info.get(k) for k in ("user_api", "internal_api", "prefix", "num_threads",
                                      "architecture", "threading_layer")}
            for info in threadpool_info()]
    except ImportError:  # pragma: no cover
        out["threadpools"] = None
    return out


def run_record(config, *, jobs=1, argv=None):
    """Everything that identifies a run: code, machine, threads, workers, versions, config.

    Parameters
    ----------
    config : dict
        The full configuration (JSON-serialisable).
    jobs : int
        Cells run in parallel (``--jobs``).
    argv : list of str, optional
        Defaults to ``sys.argv``.

    Returns
    -------
    dict
        ``git`` ({"commit", "dirty"} or None outside a git checkout), ``cpu_model``,
        ``cpu_flags``, ``cpu_count``, ``threads`` (:func:`thread_state`), ``jobs``,
        ``python``, ``platform``, ``versions``, ``config``, ``argv``, ``date`` (UTC, ISO 8601).
    """
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"git": git_state(), "cpu_model": cpu_model(), "cpu_flags": _cpu_flags(),
            "cpu_count": os.cpu_count(), "threads": thread_state(), "jobs": jobs,
            "python": platform.python_version(), "platform": platform.platform(),
            "versions": versions, "config": config,
            "argv": list(sys.argv if argv is None else argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
