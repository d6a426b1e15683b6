"""The sweep backend: stable cell keys, resumable JSON-lines results, identical results on the
in-process, joblib and Dask backends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from svtoolkit.sweep import cell_key, describe_backend, grid, map_calls, read_results, run_cells

ROOT = Path(__file__).resolve().parents[1]
SEED = 20261201


def noisy_cell(cell):
    """A cell result that is a pure function of the cell (module level: picklable)."""
    rng = np.random.default_rng([SEED, cell["seed"], len(cell["method"])])
    return {"value": float(rng.normal()), "n": cell["setting"]["n"] * 2,
            "array": np.arange(3), "scalar": np.float64(0.5)}


class Boom(RuntimeError):
    pass


def failing_after(limit, calls):
    """A cell function that raises once ``limit`` cells have run (an interrupted sweep)."""

    def fn(cell):
        if len(calls) >= limit:
            raise Boom("interrupted")
        calls.append(cell_key(cell))
        return noisy_cell(cell)

    return fn


CELLS = grid(["softmax", "sv"], [{"n": 8}, {"n": 16}], seeds=[0, 1])


def test_cell_key_is_canonical_and_checked():
    assert cell_key({"b": 1, "a": [1, 2]}) == cell_key({"a": (1, 2), "b": 1}) == \
        '{"a":[1,2],"b":1}'
    assert cell_key({"x": np.int64(3)}) == '{"x":3}'
    with pytest.raises(TypeError, match="cell must be JSON-serialisable"):
        cell_key({"x": object()})


def test_grid_orders_settings_then_methods_then_seeds_and_refuses_empty_axes():
    assert len(CELLS) == 8
    assert CELLS[0] == {"method": "softmax", "setting": {"n": 8}, "seed": 0}
    assert CELLS[1]["seed"] == 1 and CELLS[2]["method"] == "sv"
    assert CELLS[4]["setting"] == {"n": 16}
    with pytest.raises(ValueError, match="seeds must not be empty"):
        grid(["a"], [{}], seeds=[])


def test_results_are_appended_and_a_finished_sweep_runs_nothing(tmp_path):
    path = tmp_path / "out" / "sweep.jsonl"
    first = run_cells(noisy_cell, CELLS, results=path, progress=False)
    assert first[0]["array"] == [0, 1, 2] and first[0]["scalar"] == 0.5  # as JSON reads it
    lines = path.read_text().splitlines()
    assert len(lines) == len(CELLS)
    assert [json.loads(line)["key"] for line in lines] == [cell_key(c) for c in CELLS]
    calls = []
    again = run_cells(failing_after(0, calls), CELLS, results=path, progress=False)
    assert again == first and calls == []


def test_an_interrupted_sweep_resumes_with_the_remaining_cells(tmp_path):
    path = tmp_path / "sweep.jsonl"
    calls = []
    with pytest.raises(Boom, match="interrupted"):
        run_cells(failing_after(3, calls), CELLS, results=path, progress=False)
    assert len(read_results(path)) == 3
    with open(path, "a") as fh:  # a write cut short by the interruption
        fh.write('{"key": "trunc')
    resumed_calls = []
    resumed = run_cells(failing_after(100, resumed_calls), CELLS, results=path,
                        progress=False)
    assert len(resumed_calls) == len(CELLS) - 3
    assert set(resumed_calls).isdisjoint(calls)
    reference = run_cells(noisy_cell, CELLS, results=tmp_path / "fresh.jsonl", progress=False)
    assert resumed == reference
    assert len(path.read_text().splitlines()) == len(CELLS)


def test_bad_arguments_and_bad_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cells must be unique"):
        run_cells(noisy_cell, [CELLS[0], dict(CELLS[0])], progress=False)
    with pytest.raises(ValueError, match="jobs must be a non-zero int"):
        map_calls(abs, [1], jobs=0, progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a", "cell": 1, "result": 2}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not a results record"):
        read_results(bad)
    before = bad.read_bytes()
    with pytest.raises(ValueError, match="line 2"):
        run_cells(noisy_cell, CELLS, results=bad, progress=False)
    assert bad.read_bytes() == before
    assert read_results(tmp_path / "missing.jsonl") == {}


def test_describe_backend_names_each_backend():
    assert describe_backend() == "in process (serial)"
    assert describe_backend(jobs=2) == "joblib loky, n_jobs=2"
    assert describe_backend(jobs=2, dask_scheduler="tcp://x:1") == \
        "dask distributed (scheduler tcp://x:1)"


def test_joblib_backend_gives_the_serial_results_in_cell_order(tmp_path):
    serial = run_cells(noisy_cell, CELLS, progress=False)
    pooled = run_cells(noisy_cell, CELLS, jobs=2, results=tmp_path / "j.jsonl",
                       progress=False)
    assert pooled == json.loads(json.dumps(serial, default=lambda a: a.tolist()))
    assert map_calls(abs, [-3, 2, -1], jobs=2, progress=False) == [3, 2, 1]


def test_dask_backend_gives_the_serial_results(monkeypatch, tmp_path):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                      os.environ.get("PYTHONPATH", "")]))
    serial = run_cells(noisy_cell, CELLS, results=tmp_path / "s.jsonl", progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        remote = run_cells(noisy_cell, CELLS, results=tmp_path / "d.jsonl",
                           dask_scheduler=cluster.scheduler_address, progress=False)
        with pytest.raises(RuntimeError, match="cannot run these cells"):
            map_calls(abs, [1], dask_scheduler=cluster.scheduler_address, progress=False,
                      worker_modules=("no_such_module_here",))
    assert remote == serial
