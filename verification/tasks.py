"""The unit of parallel work: one task, a pure function of its arguments.

A task is a tuple ``("forget", regime, seed)`` or ``("secret", seed)``. :func:`run_task` runs it
with the BLAS thread pool pinned to one thread, so that a trial computes bit-for-bit the same
numbers in the main process, in a joblib worker and on a Dask worker.
"""

from __future__ import annotations

from threadpoolctl import threadpool_limits

from .forgetting import run_trial
from .secret import run_secret_trial

__all__ = ["run_task"]


def run_task(task):
    """Run one task (see module docstring) and return its record (a plain dict)."""
    kind, *args = task
    with threadpool_limits(limits=1):
        if kind == "forget":
            return run_trial(*args)
        if kind == "secret":
            return run_secret_trial(*args)
    raise ValueError(f"unknown task kind {kind!r}")
