"""The reproduction ledger: in step with the committed result files, and its checks bite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from svtoolkit.experiments import ledger

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_ledger_and_its_documents_are_in_step():
    """claims.json's measured values are those of the result files, every verdict is
    consistent, and docs/reproduction.md and the README section are what it generates."""
    assert ledger.main(["--root", str(ROOT), "--check"]) == 0


def test_every_claim_of_both_papers_has_a_verdict():
    entries = ledger.load(ROOT)
    assert {e["paper"] for e in entries} == {"Forgetful Attention", "Tensor Cache"}
    assert all(e["verdict"] in ledger.VERDICTS for e in entries)
    assert len({e["id"] for e in entries}) == len(entries)


def _tree(tmp_path, entries, result):
    (tmp_path / "examples" / "results").mkdir(parents=True)
    (tmp_path / "examples" / "results" / "r.json").write_text(json.dumps(result))
    (tmp_path / "examples" / "results" / "claims.json").write_text(
        json.dumps({"record": None, "claims": entries}))
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"intro\n{ledger.README_BEGIN}\nold\n"
                                        f"{ledger.README_END}\nrest\n")
    return tmp_path


def _entry(**kw):
    entry = dict(id="c1", paper="Forgetful Attention", where="Table 2", claim="SV recalls",
                 metric="recall@1", published=0.96, study="mqar", script="examples/mqar.py",
                 source={"file": "examples/results/r.json", "pointer": "/rows/0/mean",
                         "lo": "/rows/0/ci/0", "hi": "/rows/0/ci/1"},
                 measured=None, interval=None, source_commit=None, verdict="reproduces",
                 evidence="3 seeds")
    entry.update(kw)
    return entry


RESULT = {"rows": [{"mean": 0.95, "ci": [0.93, 0.97]}], "record": {"git": {"commit": "abc123"}}}


@pytest.mark.parametrize("record", [{"machine": {"git": {"commit": "abc123"}}},
                                    {"environment": {"git": {"commit": "abc123"}}}])
def test_a_benchmarks_run_record_names_the_commit_too(tmp_path, record):
    """The benchmarks keep the commit in ``machine`` or ``environment``, not ``record``."""
    result = {"rows": RESULT["rows"], **record}
    root = _tree(tmp_path, [_entry()], result)
    assert ledger.main(["--root", str(root)]) == 0
    assert ledger.load(root)[0]["source_commit"] == "abc123"


def test_refresh_reads_the_measured_value_and_writes_both_documents(tmp_path):
    root = _tree(tmp_path, [_entry()], RESULT)
    assert ledger.main(["--root", str(root), "--check"]) == 1  # measured not filled in yet
    assert ledger.main(["--root", str(root)]) == 0
    entry = ledger.load(root)[0]
    assert entry["measured"] == 0.95 and entry["interval"] == [0.93, 0.97]
    assert entry["source_commit"] == "abc123"  # the result file's run record, read not typed
    assert "| Table 2 | SV recalls |" in (root / "docs" / "reproduction.md").read_text()
    readme = (root / "README.md").read_text()
    assert readme.startswith("intro\n") and readme.endswith("rest\n") and "old" not in readme
    assert ledger.main(["--root", str(root), "--check"]) == 0


@pytest.mark.parametrize("change, message", [
    (dict(measured=0.5, interval=[0.93, 0.97]), r"differ from the source's 0\.95"),
    (dict(source_commit="def456"), r"stored source_commit 'def456' differs from the source's "
                                   r"'abc123'"),
    (dict(verdict="holds"), r"verdict 'holds' is not one of"),
    (dict(evidence=""), r"no evidence line"),
    (dict(published=0.99, measured=0.95, interval=[0.93, 0.97]),
     r"'reproduces', but the published 0\.99 is outside the measured \[0\.93, 0\.97\]"),
    (dict(verdict="not run", measured=0.95, interval=[0.93, 0.97]),
     r"verdict 'not run' with measured 0\.95"),
    (dict(source={"file": "examples/results/r.json", "pointer": "/rows/1/mean"}),
     r"source does not resolve \(IndexError"),
    (dict(source={"file": "examples/results/r.json", "pointer": "/rows/0"}),
     r"the source is dict, not a number"),
])
def test_problems_name_each_inconsistency(tmp_path, change, message):
    import re

    root = _tree(tmp_path, [], RESULT)
    base = _entry(measured=0.95, interval=[0.93, 0.97], source_commit="abc123")
    base.update(change)
    found = ledger.problems([base], root)
    assert any(re.search(message, line) for line in found), found


def test_a_published_range_that_overlaps_the_interval_reproduces(tmp_path):
    root = _tree(tmp_path, [], RESULT)
    entry = _entry(published="0.96-0.99", measured=0.95, interval=[0.93, 0.97],
                   source_commit="abc123")
    assert ledger.problems([entry], root) == []
    entry = _entry(published="0.98\u20130.99", measured=0.95, interval=[0.93, 0.97],
                   source_commit="abc123")
    assert any("outside the measured" in p for p in ledger.problems([entry], root))


def test_a_rate_of_trials_gets_its_exact_binomial_interval(tmp_path):
    root = _tree(tmp_path, [], {"secret": {"after": 0.0, "before": 25 / 30, "trials": 30}})
    source = {"file": "examples/results/r.json", "pointer": "/secret/after",
              "trials": "/secret/trials"}
    measured, interval, _ = ledger.resolve({"source": source}, root)
    # 0 of 30: the Clopper-Pearson upper limit is 1 - 0.025**(1/30), in closed form.
    assert measured == 0.0 and interval[0] == 0.0
    assert interval[1] == pytest.approx(1 - 0.025 ** (1 / 30), rel=1e-12)
    entry = _entry(published=0.07, source=source, measured=measured, interval=interval)
    assert ledger.problems([entry], root) == []  # 0.07 lies inside [0, 0.116]; no record: None
    source["pointer"] = "/secret/before"
    assert ledger.resolve({"source": source}, root)[1][0] < 0.8 < ledger.resolve(
        {"source": source}, root)[1][1]


def test_a_rate_that_is_not_a_count_of_its_trials_is_refused(tmp_path):
    root = _tree(tmp_path, [], {"rate": 0.5, "trials": 7})
    entry = _entry(source={"file": "examples/results/r.json", "pointer": "/rate",
                           "trials": "/trials"}, measured=0.5, interval=None)
    assert any("not a whole number of successes" in p for p in ledger.problems([entry], root))


def test_a_readme_without_the_markers_is_refused(tmp_path):
    root = _tree(tmp_path, [_entry()], RESULT)
    (root / "README.md").write_text("no markers\n")
    with pytest.raises(ValueError, match="README.md has no generated ledger section"):
        ledger.main(["--root", str(root)])


def test_the_ledger_records_the_checkout_its_values_were_collected_from(tmp_path):
    """``record.git`` names the commit at which the claims' values last changed: written
    when a refresh changes them, kept when it does not (so a later commit leaves it be)."""
    import subprocess

    root = _tree(tmp_path, [_entry()], RESULT)

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "a")
    first = git("rev-parse", "HEAD")
    assert ledger.main(["--root", str(root)]) == 0
    record = json.loads((root / ledger.LEDGER).read_text())["record"]
    assert record["git"]["commit"] == first
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "b")
    assert ledger.main(["--root", str(root)]) == 0  # nothing changed: the record stays
    assert json.loads((root / ledger.LEDGER).read_text())["record"] == record
    assert ledger.main(["--root", str(root), "--check"]) == 0
