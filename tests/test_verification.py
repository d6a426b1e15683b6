"""The verification suite (``python -m verification``) end to end, on a tiny configuration.

Covers: the output files and the results.json schema, the exit status, that a trial is a pure
function of (regime, seed), identical results in process / on joblib / on a local two-worker
Dask cluster, the extension point (``check_*`` modules, missing dependencies, broken modules),
and that the forgetting checks fail when the decrement is wrong.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `verification` lives in the repository, not in the package
    sys.path.insert(0, str(ROOT))

from svtoolkit import IncrementalSVDD  # noqa: E402
from verification import forgetting, suite  # noqa: E402
from verification.backends import map_tasks  # noqa: E402
from verification.extensions import run_extensions  # noqa: E402
from verification.records import make_check  # noqa: E402
from verification.tasks import run_task  # noqa: E402

TINY = ["--trials", "3", "--regimes", "gaussian,shuttle", "--no-progress", "--no-extensions",
        "--seed", "7"]
TASKS = ([("forget", regime, seed) for regime in ("gaussian", "redundant", "shuttle")
          for seed in (0, 1)] + [("secret", 0), ("secret", 1)])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = suite.main([*TINY, "--out", str(out)])
    return status, out, stdout.getvalue()


def test_tiny_run_passes_and_writes_every_output(tiny_run):
    status, out, console = tiny_run
    assert status == 0, console
    for name in ("report.md", "results.json", "forgetting_worst_vs_decay.png",
                 "deviation_vs_condition.png"):
        assert (out / name).stat().st_size > 0
    for name in ("forgetting_worst_vs_decay.png", "deviation_vs_condition.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "PASS  exact.stream" in console


def _strict_json(text):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


def test_results_json_schema(tiny_run):
    _, out, _ = tiny_run
    results = _strict_json((out / "results.json").read_text())
    assert {"checks", "regimes"} <= set(results)
    assert results["checks"]
    for check in results["checks"]:
        assert {"name", "passed", "value", "tolerance"} <= set(check)
        assert check["passed"] in (True, False, None)
    required = {"trials", "partition_match", "dev_median", "dev_p95", "dev_mean", "dev_worst",
                "decay_dev_median"}
    assert set(results["regimes"]) == {"gaussian", "shuttle"}
    for name, regime in results["regimes"].items():
        assert required <= set(regime), name
    assert results["regimes"]["gaussian"]["trials"] == 3
    assert results["meta"]["seeds"]["base"] == 7


def test_report_lists_seeds_hardware_and_published_rows(tiny_run):
    _, out, _ = tiny_run
    report = (out / "report.md").read_text()
    assert "**Seeds**: base: 7" in report
    assert "**Hardware**" in report and "numpy" in report
    assert "published: Gaussian (n=24, d=6)" in report
    assert "![forgetting_worst_vs_decay.png](forgetting_worst_vs_decay.png)" in report


def test_exit_status_is_one_when_any_check_fails(tiny_run):
    _, out, _ = tiny_run
    results = _strict_json((out / "results.json").read_text())
    assert suite.exit_status(results) == 0
    results["checks"].append(make_check("injected", 1.0, 0.0))
    assert suite.exit_status(results) == 1


def test_a_trial_is_a_pure_function_of_regime_and_seed():
    first = run_task(("forget", "gaussian", 11))
    assert first["status"] == "ok"
    assert run_task(("forget", "gaussian", 11)) == first
    assert run_task(("forget", "gaussian", 12)) != first
    assert run_task(("forget", "redundant", 11))["dev"] != first["dev"]


def test_joblib_backend_gives_identical_results():
    serial = map_tasks(TASKS, jobs=1, progress=False)
    assert all(r["status"] == "ok" for r in serial)
    assert map_tasks(TASKS, jobs=2, progress=False) == serial


def test_dask_backend_gives_identical_results(monkeypatch):
    distributed = pytest.importorskip("distributed")
    # the spawned workers import `verification` from the repository root
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    serial = map_tasks(TASKS, jobs=1, progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        remote = map_tasks(TASKS, dask_scheduler=cluster.scheduler_address, progress=False)
    assert remote == serial


class _WrongVictim(IncrementalSVDD):
    """A broken decrement: deletes the next live key instead of the one asked for."""

    def remove(self, id):
        ids = self.ids
        others = ids[ids != id]
        super().remove(int(others[np.searchsorted(others, id) % len(others)]))


def test_forgetting_checks_fail_when_the_decrement_is_wrong(monkeypatch):
    monkeypatch.setattr(forgetting, "IncrementalSVDD", _WrongVictim)
    trials = [forgetting.run_trial("gaussian", seed) for seed in range(6)]
    summary = forgetting.summarize(trials)
    assert summary["dev_worst"] > 1e-3
    checks = {c["name"]: c for c in forgetting.regime_checks("gaussian", summary)}
    assert checks["forget.gaussian.dev_worst"]["passed"] is False
    assert checks["forget.gaussian.dev_worst_vs_reference"]["passed"] is False


def _write_extensions(root):
    package = root / "fake_checks_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    modules = {
        "check_ok": """
            def run(quick=True):
                return [{"name": "ok.one", "passed": True, "value": 1e-16,
                         "tolerance": 1e-12, "detail": f"quick={quick}"}]
        """,
        "check_missing_dependency": """
            import a_module_that_is_not_installed_anywhere
            def run(quick=True):
                return []
        """,
        "check_broken": """
            def run(quick=True):
                raise RuntimeError("boom")
        """,
        "check_malformed": """
            def run(quick=True):
                return [{"name": "no value"}]
        """,
        "helper_not_a_check": """
            raise AssertionError("must not be imported")
        """,
    }
    for name, body in modules.items():
        (package / f"{name}.py").write_text(textwrap.dedent(body))
    return package.name


def test_extension_point(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _write_extensions(tmp_path)
    records, modules = run_extensions(quick=True, package=package)
    assert [m.rsplit(".", 1)[-1] for m in modules] == [
        "check_broken", "check_malformed", "check_missing_dependency", "check_ok"]
    by_source = {r["source"].rsplit(".", 1)[-1]: r for r in records}
    assert by_source["check_ok"]["passed"] is True
    assert by_source["check_ok"]["detail"] == "quick=True"
    assert by_source["check_missing_dependency"]["passed"] is None
    assert by_source["check_missing_dependency"]["skipped"] is True
    assert "a_module_that_is_not_installed_anywhere" in by_source[
        "check_missing_dependency"]["detail"]
    assert by_source["check_broken"]["passed"] is False
    assert "boom" in by_source["check_broken"]["detail"]
    assert by_source["check_malformed"]["passed"] is False


@pytest.mark.parametrize("value, tolerance, op, passed", [
    (1e-13, 1e-12, "<=", True), (1e-11, 1e-12, "<=", False), (7.0, 6.0, ">=", True),
    (0.0, 0.0, "==", True), (0.1, 0.0, ">", True), (float("nan"), 1.0, "<=", False),
    (None, 1.0, "<=", False),
])
def test_make_check(value, tolerance, op, passed):
    assert make_check("x", value, tolerance, op=op)["passed"] is passed


def test_make_check_rejects_unknown_comparison():
    with pytest.raises(ValueError, match="op must be one of"):
        make_check("x", 1.0, 1.0, op="~")


def test_cli_rejects_unknown_regime():
    with pytest.raises(SystemExit, match="unknown regime"):
        suite.config_from_args(["--regimes", "gaussian,nonsense"])


def test_learned_keys_regime_trains_a_model_and_forgets_exactly():
    pytest.importorskip("torch")
    from verification.forgetting import REGIMES, run_trial

    assert "learned" in REGIMES
    trial = run_trial("learned", 0)
    assert trial["status"] == "ok" and trial["n"] >= 30
    assert trial["dev"] <= 1e-9


def test_operation_chains_pass_and_catch_a_state_off_the_optimum(monkeypatch):
    """verification/check_chains.py: a short chain passes every check, and a deletion that
    leaves rho 1e-9 off is caught by the comparison with a fresh solve."""
    from svtoolkit.exact import _walk as W
    from verification import check_chains

    records = check_chains._shape_records("gauss", 1, 12, reference=False)
    assert [r["name"] for r in records] == [
        f"chains.gauss.{c}" for c in ("refused", "fresh", "fresh_flat", "objective", "kkt",
                                      "restored", "reference")]
    assert all(r["passed"] for r in records[:-1]) and records[-1]["passed"] is None
    run = check_chains.run_chain("gauss", 0, 12)
    assert run["states"] == 12 and not run["refused"] and run["restored"] == 0.0

    remove = IncrementalSVDD.remove

    def remove_off(self, id):
        remove(self, id)
        self._fs[W._RHO] += 1e-9

    monkeypatch.setattr(IncrementalSVDD, "remove", remove_off)
    assert check_chains.run_chain("gauss", 0, 12)["worst_ratio"] > 1e3
