"""``examples/matched_state.py --quick`` as a subprocess: the matched-state protocol end to end
(pipeline, not numbers) - the SV hybrid's state at its chosen learning rate drives the window,
the paired statistics and the confound verdict are recomputed from the rows here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "matched_state.py"
ARGS = ["--quick", "--no-progress", "--corpus", "stdlib", "--seeds", "0", "1", "--methods",
        "sv_hybrid", "swa", "softmax"]


def _run(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run on the zero-install corpus with two seeds, shared by the tests."""
    out = tmp_path_factory.mktemp("matched_state")
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "matched_state_quick.json").read_text())


def _cells(out):
    return [json.loads(line) for line in
            (out / "matched_state_quick.cells.jsonl").read_text().splitlines()]


def test_outputs_record_and_cells(quick):
    out, payload = quick
    config = payload["record"]["config"]
    assert config["corpus"]["name"] == "stdlib" and config["seeds"] == [0, 1]
    assert config["arms"] == ["sv_hybrid", "swa", "softmax"]
    assert payload["record"]["versions"]["torch"]
    # 3 arms x 2 seeds x 2 learning rates
    assert payload["cells_done"] == payload["cells"] == 12 == len(_cells(out))
    assert [r["method"] for r in payload["rows"]] == ["sv_hybrid", "softmax", "swa"]
    for row in payload["rows"]:
        assert row["chosen_lr"] in (0.01, 0.003)
        assert len(row["metrics"]["test_bpb"]["values"]) == 2
    table = (out / "matched_state_quick.md").read_text()
    assert "2.178" in table and "Differences from the published protocol" in table
    assert "SV-vs-window gap:" in table
    assert (out / "matched_state_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_window_is_the_chosen_lr_state_plus_the_chunk(quick):
    out, payload = quick
    chunk = payload["record"]["config"]["chunk"]
    sv = next(r for r in payload["rows"] if r["method"] == "sv_hybrid")
    for seed, state in zip(sv["seeds"], sv["state"], strict=True):
        assert 0 < state["exact"] <= payload["record"]["config"]["model"]["block"]
        assert state["margin"] + state["error"] == pytest.approx(state["exact"])
        window = round(state["exact"]) + chunk
        assert payload["windows"][str(seed)] == window
        swa = [c for c in _cells(out) if c["cell"]["method"] == "swa"
               and c["cell"]["seed"] == seed]
        assert len(swa) == 2 and all(c["cell"]["options"] == {"window": window} for c in swa)
    chosen = [c["result"]["state"] for c in _cells(out) if c["cell"]["method"] == "sv_hybrid"
              and c["cell"]["lr"] == sv["chosen_lr"]]
    assert sorted(s["exact"] for s in chosen) == sorted(s["exact"] for s in sv["state"])


def test_paired_statistics_and_the_confound_verdict_follow_from_the_rows(quick):
    from svtoolkit.experiments.lm_summary import confound_rule

    _, payload = quick
    by = {r["method"]: r for r in payload["rows"]}
    sv = by["sv_hybrid"]["metrics"]["test_bpb"]["values"]
    swa = by["swa"]["metrics"]["test_bpb"]["values"]
    paired = payload["paired"]
    assert paired["mean_difference"] == pytest.approx(sum(w - s for w, s in zip(
        swa, sv, strict=True)) / 2)
    assert paired["wins"] == sum(s < w for s, w in zip(sv, swa, strict=True))
    expected = confound_rule(by["softmax"]["val_loss"], by["swa"]["val_loss"],
                             paper_scale="x")["verdict"]
    assert payload["confound"]["verdict"] == payload["gap_status"] == expected
    assert "--paper" in payload["confound"]["text"] or expected == "read"


def test_rerun_resumes_from_the_cells_file(quick):
    out, payload = quick
    before = (out / "matched_state_quick.cells.jsonl").read_text()
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "matched_state_quick.cells.jsonl").read_text() == before
    again = json.loads((out / "matched_state_quick.json").read_text())
    assert again["paired"] == payload["paired"] and again["rows"] == payload["rows"]
