"""Where the trials run: in process, on a joblib pool, or on a Dask distributed cluster.

Every backend runs the same tasks through :func:`verification.tasks.run_task` and returns the
results in task order, so a sweep gives identical numbers on every backend. The backends
themselves live in :mod:`svtoolkit.sweep` (the one home of the toolkit's sweep machinery);
this module only binds them to the suite's task function.
"""

from __future__ import annotations

from svtoolkit.sweep import describe_backend, map_calls

from .tasks import run_task

__all__ = ["map_tasks", "describe_backend"]


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
    return map_calls(run_task, tasks, jobs=jobs, dask_scheduler=dask_scheduler,
                     progress=progress, desc=desc, unit="trial",
                     worker_modules=("verification.tasks",))
