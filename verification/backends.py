"""Where the trials run: in process, on a joblib pool, or on a Dask distributed cluster.

Every backend runs the same tasks through :func:`verification.tasks.run_task` and returns the
results in task order, so a sweep gives identical numbers on every backend.
"""

from __future__ import annotations

import importlib

from tqdm.auto import tqdm

from .tasks import run_task

__all__ = ["map_tasks", "describe_backend"]


def describe_backend(jobs=1, dask_scheduler=None):
    """One line naming the backend (for the report header)."""
    if dask_scheduler:
        return f"dask distributed (scheduler {dask_scheduler})"
    if jobs == 1:
        return "in process (serial)"
    return f"joblib loky, n_jobs={jobs}"


def map_tasks(tasks, *, jobs=1, dask_scheduler=None, progress=True, desc="trials"):
    """Run ``tasks`` and return their results in order.

    Parameters
    ----------
    tasks : list of tuple
        Task tuples for :func:`verification.tasks.run_task`.
    jobs : int, default 1
        1 runs in this process; any other value is joblib's ``n_jobs`` (-1: every core).
    dask_scheduler : str, optional
        Address of a Dask scheduler (e.g. ``tcp://10.0.0.5:8786``); takes precedence over
        ``jobs``. The workers must be able to import ``verification`` and ``svtoolkit``.
    progress : bool, default True
        Show a tqdm progress bar (on stderr).
    desc : str
        Label of the progress bar.

    Returns
    -------
    list of dict
    """
    tasks = list(tasks)
    bar = tqdm(total=len(tasks), desc=desc, disable=not progress, unit="trial")
    try:
        if dask_scheduler:
            return _dask(tasks, dask_scheduler, bar)
        if jobs == 1:
            return [_tick(run_task(task), bar) for task in tasks]
        return _joblib(tasks, jobs, bar)
    finally:
        bar.close()


def _tick(result, bar):
    bar.update(1)
    return result


def _joblib(tasks, jobs, bar):
    from joblib import Parallel, delayed

    results = Parallel(n_jobs=jobs, return_as="generator")(delayed(run_task)(t) for t in tasks)
    return [_tick(result, bar) for result in results]


def _worker_imports():
    """Run on each Dask worker: can it import the task function?"""
    try:
        importlib.import_module("verification.tasks")
    except Exception as exc:  # reported back to the client
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _dask(tasks, address, bar):
    from distributed import Client, as_completed

    with Client(address, timeout="30s") as client:
        status = client.run(_worker_imports)
        bad = {worker: msg for worker, msg in status.items() if msg != "ok"}
        if not status or bad:
            raise RuntimeError(
                f"Dask workers at {address} cannot run the suite ({bad or 'no workers'}); start "
                "them from the svtoolkit repository root or put it on their PYTHONPATH")
        futures = client.map(run_task, tasks, pure=True)
        for _ in as_completed(futures):
            bar.update(1)
        return client.gather(futures)
