"""Run the cells of a sweep in process, on a joblib pool or on a Dask cluster, resumably.

A *cell* is one unit of a sweep - typically one (method, setting, seed) - given as a
JSON-serialisable value (a dict, list, str, number). Its *key* is the canonical JSON text of
the cell (sorted keys, no spaces), so the same cell has the same key in every process and
every session.

:func:`run_cells` calls ``fn(cell)`` for every cell and, when given a results file, appends
one JSON line ``{"key": ..., "cell": ..., "result": ...}`` as soon as each cell finishes. A
later call with the same file skips the cells whose key is already there and returns their
stored results: an interrupted sweep resumes where it stopped. :func:`map_calls` is the same
machinery without the file (results in order, nothing skipped).

Backends:

* ``jobs=1`` (default) - in this process, in order;
* ``jobs=n`` (n != 1) - a joblib (loky) pool, joblib's ``n_jobs`` (-1: every core);
* ``dask_scheduler="tcp://host:8786"`` - a Dask distributed cluster (takes precedence over
  ``jobs``). Functions defined in a script's ``__main__`` are shipped by value; the modules
  named in ``worker_modules`` must be importable on the workers (checked before submitting).

Examples
--------
>>> import tempfile, os
>>> from svtoolkit.sweep import grid, run_cells
>>> cells = grid(["a", "b"], [{"n": 1}], seeds=[0])
>>> path = os.path.join(tempfile.mkdtemp(), "results.jsonl")
>>> run_cells(lambda c: {"twice": 2 * c["seed"]}, cells, results=path, progress=False)
[{'twice': 0}, {'twice': 0}]
>>> run_cells(lambda c: 1 / 0, cells, results=path, progress=False)  # both already done
[{'twice': 0}, {'twice': 0}]
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
from pathlib import Path

import numpy as np

from ._optional import require

tqdm = require("tqdm.auto", feature="svtoolkit.sweep").tqdm

__all__ = ["cell_key", "describe_backend", "grid", "map_calls", "read_results", "run_cells"]


def cell_key(cell):
    """Stable key of a cell: its canonical JSON (sorted keys, compact separators).

    Raises
    ------
    TypeError
        If the cell is not JSON-serialisable.
    """
    try:
        return json.dumps(cell, sort_keys=True, separators=(",", ":"), default=_plain)
    except TypeError as exc:
        raise TypeError(f"cell must be JSON-serialisable: {exc}") from None


def grid(methods, settings, seeds):
    """Every (method, setting, seed) cell: ``{"method": m, "setting": s, "seed": r}``.

    Parameters
    ----------
    methods : iterable of str
    settings : iterable of dict
    seeds : iterable of int

    Returns
    -------
    list of dict
        In the order setting, then method, then seed (the slowest-varying first), so that a
        partial sweep has complete rows.
    """
    methods, settings, seeds = list(methods), list(settings), [int(s) for s in seeds]
    for name, values in (("methods", methods), ("settings", settings), ("seeds", seeds)):
        if not values:
            raise ValueError(f"{name} must not be empty")
    return [{"method": m, "setting": dict(s), "seed": r}
            for s, m, r in itertools.product(settings, methods, seeds)]


def describe_backend(jobs=1, dask_scheduler=None):
    """One line naming the backend (for report headers)."""
    if dask_scheduler:
        return f"dask distributed (scheduler {dask_scheduler})"
    if jobs == 1:
        return "in process (serial)"
    return f"joblib loky, n_jobs={jobs}"


def _plain(value):
    """JSON fallback for NumPy scalars and arrays (and anything with ``tolist``)."""
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


# ------------------------------------------------------------------------------ results file
def read_results(path):
    """The records of a results file, by key: ``{key: {"key", "cell", "result"}}``.

    A missing file reads as empty. An incomplete last line (a sweep killed mid-write) is
    ignored; an unreadable line elsewhere raises ``ValueError`` naming its line number.
    """
    path = Path(path)
    if not path.exists():
        return {}
    complete = path.read_text().split("\n")[:-1]  # text after the last newline is incomplete
    records = {}
    for number, line in enumerate(complete, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            records[record["key"]] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}: line {number} is not a results record") from None
    return records


def _drop_incomplete_tail(path):
    """Cut text after the last newline (an interrupted write) so that appends stay lines."""
    if not path.exists():
        return
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(end)


class _Appender:
    """Appends one JSON line per finished cell, flushed and synced at once."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_incomplete_tail(self.path)

    def __call__(self, key, cell, result):
        line = json.dumps({"key": key, "cell": cell, "result": result}, default=_plain)
        with open(self.path, "a") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


# ------------------------------------------------------------------------------ running
def run_cells(fn, cells, *, results=None, jobs=1, dask_scheduler=None, progress=True,
              desc="cells", worker_modules=(), on_result=None):
    """``[fn(cell) for cell in cells]`` on the chosen backend, skipping finished cells.

    Parameters
    ----------
    fn : callable
        ``fn(cell) -> result``; the result must be JSON-serialisable when ``results`` is
        given (NumPy scalars and arrays are converted).
    cells : iterable
        JSON-serialisable cells (see :func:`grid`); keys must be unique.
    results : str or Path, optional
        JSON-lines file: cells already in it are skipped (their stored result is returned)
        and every finished cell is appended as it completes.
    jobs, dask_scheduler : see the module docstring.
    progress : bool, default True
        tqdm progress bar on stderr (counts the cells run now, not the skipped ones).
    desc : str
        Label of the bar.
    worker_modules : tuple of str
        Modules every Dask worker must import (checked before submitting).
    on_result : callable, optional
        ``on_result(done)`` after every cell that finishes now, with ``done`` the
        ``{key: result}`` of every finished cell so far (stored ones included), e.g. to
        rewrite a summary as a sweep progresses.

    Returns
    -------
    list
        The results, in the order of ``cells``.

    Raises
    ------
    ValueError
        If two cells have the same key, or the results file has an unreadable line.
    """
    cells = list(cells)
    keys = [cell_key(c) for c in cells]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"cells must be unique; {dup} appears more than once")
    done = read_results(results) if results is not None else {}
    out = {k: done[k]["result"] for k in keys if k in done}
    todo = [i for i, k in enumerate(keys) if k not in done]
    append = _Appender(results) if results is not None and todo else None

    def finished(i, result):
        if append is not None:
            append(keys[i], cells[i], result)
            result = json.loads(json.dumps(result, default=_plain))  # what a resume returns
        out[keys[i]] = result
        if on_result is not None:
            on_result(dict(out))

    _dispatch(fn, [(i, cells[i]) for i in todo], finished, jobs=jobs,
              dask_scheduler=dask_scheduler, progress=progress, desc=desc, unit="cell",
              worker_modules=worker_modules)
    return [out[k] for k in keys]


def map_calls(fn, items, *, jobs=1, dask_scheduler=None, progress=True, desc="tasks",
              unit="task", worker_modules=()):
    """``[fn(item) for item in items]`` on the chosen backend, results in order.

    Same backends and arguments as :func:`run_cells`, without a results file; items need not
    be JSON-serialisable (they must be picklable for the pools).
    """
    items = list(items)
    out = [None] * len(items)

    def finished(i, result):
        out[i] = result

    _dispatch(fn, list(enumerate(items)), finished, jobs=jobs, dask_scheduler=dask_scheduler,
              progress=progress, desc=desc, unit=unit, worker_modules=worker_modules)
    return out


def _dispatch(fn, indexed, finished, *, jobs, dask_scheduler, progress, desc, unit,
              worker_modules):
    """Run ``fn`` on every ``(index, item)`` and call ``finished(index, result)`` as each
    completes (in any order)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs == 0:
        raise ValueError(f"jobs must be a non-zero int (joblib's n_jobs; -1: every core); "
                         f"got {jobs!r}")
    bar = tqdm(total=len(indexed), desc=desc, disable=not progress, unit=unit)
    try:
        if not indexed:
            return
        if dask_scheduler:
            _dask(fn, indexed, finished, dask_scheduler, worker_modules, bar)
        elif jobs == 1:
            for i, item in indexed:
                finished(i, fn(item))
                bar.update(1)
        else:
            _joblib(fn, indexed, finished, jobs, bar)
    finally:
        bar.close()


def _indexed_call(fn, i, item):
    return i, fn(item)


def _joblib(fn, indexed, finished, jobs, bar):
    joblib = require("joblib", feature="svtoolkit.sweep with jobs != 1")
    Parallel, delayed = joblib.Parallel, joblib.delayed

    calls = (delayed(_indexed_call)(fn, i, item) for i, item in indexed)
    for i, result in Parallel(n_jobs=jobs, return_as="generator_unordered")(calls):
        finished(i, result)
        bar.update(1)


def _worker_imports(modules):
    """Run on each Dask worker: can it import the modules the cells need?"""
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception as exc:  # reported back to the client
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _dask(fn, indexed, finished, address, worker_modules, bar):
    distributed = require("distributed", feature="svtoolkit.sweep on a Dask cluster")
    Client, as_completed = distributed.Client, distributed.as_completed

    modules = tuple(worker_modules)
    if getattr(fn, "__module__", "__main__") not in ("__main__", None):
        modules += (fn.__module__,)
    with Client(address, timeout="30s") as client:
        status = client.run(_worker_imports, modules)
        bad = {worker: msg for worker, msg in status.items() if msg != "ok"}
        if not status or bad:
            raise RuntimeError(
                f"Dask workers at {address} cannot run these cells ({bad or 'no workers'}); "
                "start them from the svtoolkit repository root or put it on their PYTHONPATH")
        futures = client.map(_indexed_call, [fn] * len(indexed), [i for i, _ in indexed],
                             [item for _, item in indexed], pure=False)
        for future in as_completed(futures):
            i, result = future.result()
            finished(i, result)
            bar.update(1)
