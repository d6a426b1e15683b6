"""``benchmarks/run_all.py``: the plan covers every benchmark and every committed result file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import ROOT, load_benchmark


def _module():
    return load_benchmark("run_all")


def _committed_results():
    """The result files git tracks (what a local run left untracked is not the plan's concern);
    every file in the folder outside a git checkout (an sdist)."""
    folder = ROOT / "benchmarks" / "results"
    done = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode == 0 and done.stdout.strip():
        return [ROOT / line for line in done.stdout.splitlines()]
    return [p for p in folder.iterdir() if "_quick" not in p.name]


def test_every_benchmark_script_is_in_the_plan():
    """A new benchmark script that the plan does not run would leave its JSON stale."""
    run_all = _module()
    planned = {Path(args[0]).name for _, args, _ in run_all.PLAN}
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")
               if not p.name.startswith("_") and p.name != "run_all.py"}
    assert scripts - planned == {"gpu.py"}  # needs CUDA: NOT_REGENERATED says so
    assert "gpu.json" in run_all.NOT_REGENERATED


def test_every_committed_result_file_is_written_by_a_step_or_named_as_not_regenerated():
    run_all = _module()
    written = [f for _, _, outputs in run_all.PLAN for f in outputs]
    assert len(written) == len(set(written)), "two steps write the same file"
    committed = {p.name for p in _committed_results() if p.suffix in (".json", ".md")}
    unaccounted = committed - set(written) - set(run_all.NOT_REGENERATED)
    assert not unaccounted, f"result files no step writes: {sorted(unaccounted)}"


def test_select_and_unknown_names():
    run_all = _module()
    assert [s[0] for s in run_all.select(["memory_server", "forget"])] == ["forget",
                                                                           "memory_server"]
    names = [s[0] for s in run_all.PLAN]
    assert [s[0] for s in run_all.select(start="memory")] == names[names.index("memory"):]
    with pytest.raises(ValueError, match="no benchmark step 'nope'"):
        run_all.select(["nope"])


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/run_all.py", "--dry-run", "--only",
                           "forget", "decode_default_threads_competitor"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines == [
        "forget: python benchmarks/forget.py  -> forget.json, forget.md",
        "decode_default_threads_competitor: python benchmarks/decode.py --threads 0 "
        "--competitor --out decode_default_threads_competitor  -> "
        "decode_default_threads_competitor.json, decode_default_threads_competitor.md",
        "ledger: python -m svtoolkit.experiments.ledger  -> README.md, docs/*.md"]


def test_a_step_that_does_not_rewrite_its_outputs_fails(tmp_path, monkeypatch):
    """The record of one step: a process that exits 0 but writes nothing is not ok."""
    run_all = _module()
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    (tmp_path / "old.json").write_text("{}")
    record = run_all.run_step("noop", ["-c", "pass"], ["old.json"])
    assert record["returncode"] == 0 and not record["ok"]
    assert record["outputs_not_rewritten"] == ["old.json"]
    assert len(record["load_average_before"]) == 3 and "OMP_NUM_THREADS" in record["thread_env"]
    script = f"open({str(tmp_path / 'old.json')!r}, 'w').write('{{}}')"
    record = run_all.run_step("writes", ["-c", script], ["old.json"])
    assert record["ok"] and json.dumps(record)
