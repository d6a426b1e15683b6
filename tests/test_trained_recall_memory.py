"""The trained recall-memory experiment (examples/trained_recall_memory.py) and the recall
model's learned keys (svtoolkit.torch.learned_keys.recall_key_sets, the verification suite's
``learned_recall`` regime).

The --quick run proves the pipeline, not the numbers: its model is barely trained. What does
not depend on training is checked on it anyway - the exact decrement and the exact edit equal
a fresh solve of the retained (edited) facts to machine precision, and certified eviction
keeps every token the gated readout reads, so it changes no gated answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "trained_recall_memory.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
           NUMBA_NUM_THREADS="1")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained_recall_memory")
    result = _run("--quick", "--no-progress", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"results: {out / 'trained_recall_memory_quick.json'}" in result.stdout
    return out


def test_quick_run_writes_json_markdown_and_figure(quick):
    stem = quick / "trained_recall_memory_quick"
    for suffix in (".json", ".md", ".png"):
        assert stem.with_suffix(suffix).stat().st_size > 0
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["scale"] == "quick" and payload["seeds"] == [0]
    record = payload["record"]
    assert record["versions"]["torch"] and record["config"]["scale"] == "quick"
    assert record["config"]["protocol"] == {"steps": 60, "scenes": 8, "trials": 8}
    assert payload["seeds_done"] == 1
    assert payload["model"]["C"] == 0.2 and payload["protocol"]["steps"] == 60
    rows = {r["row"]: r for r in payload["rows"]}
    for policy in ("certified", "h2o_prob", "h2o_mass", "recency", "random"):
        assert f"evict.{policy}.uniform" in rows
    assert rows["edit.residual_decay_paper_0.01"]["published"] == 1.15
    assert "| (b) old binding's residual influence, exact edit (max) |" in \
        stem.with_suffix(".md").read_text()


def test_exact_forgetting_and_editing_are_at_machine_precision(quick):
    payload = json.loads((quick / "trained_recall_memory_quick.json").read_text())
    seed = payload["per_seed"][0]
    for panel, key in (("forget", "readout_dev_exact.max"), ("forget", "decision_dev_exact.max"),
                       ("edit", "residual_exact.max"), ("edit", "decision_dev_exact.max")):
        assert seed[panel][key] <= 1e-12, (panel, key)
    # decay leaves the old binding in memory: its influence is far above rounding
    assert seed["edit"]["residual_decay_paper_0.01.median"] > 1e-3


def test_certified_eviction_changes_no_gated_answer(quick):
    evict = json.loads((quick / "trained_recall_memory_quick.json").read_text())["per_seed"][0][
        "evict"]
    assert evict["certified.gated"] == evict["full.gated"]
    assert evict["budget"] < evict["n"]


def test_rerun_skips_finished_seeds(quick):
    """Each seed is a cell appended to the cells file when it finishes; the same command run
    again reads it back instead of training again, and writes the same rows."""
    stem = quick / "trained_recall_memory_quick"
    before = json.loads(stem.with_suffix(".json").read_text())
    cells = stem.with_suffix(".cells.jsonl").read_text().splitlines()
    assert len(cells) == 1 and json.loads(cells[0])["cell"]["seed"] == 0
    again = _run("--quick", "--no-progress", "--out", str(quick))
    assert again.returncode == 0, again.stderr
    after = json.loads(stem.with_suffix(".json").read_text())
    assert stem.with_suffix(".cells.jsonl").read_text().splitlines() == cells
    assert after["per_seed"] == before["per_seed"] and after["rows"] == before["rows"]


def test_rejects_two_scales():
    result = _run("--quick", "--paper")
    assert result.returncode == 2 and "not allowed with argument" in result.stderr


def test_recall_key_sets_are_the_trained_models_keys():
    from svtoolkit.torch.learned_keys import recall_key_sets, train_recall_model

    trained = train_recall_model(steps=20)
    keys = recall_key_sets(trained, steps=20, contexts=2, context=12)
    assert len(keys.key_sets) == 2 and keys.origin == [(0, 0, 0), (0, 0, 1)]
    assert keys.head_dim == 32 and keys.sigma == 2.0 and keys.C == 0.2
    for ks in keys.key_sets:
        assert ks.dtype == np.float64 and ks.shape[1] == 32 and 2 <= len(ks) <= 12
        np.testing.assert_allclose(np.linalg.norm(ks, axis=1), np.sqrt(32), rtol=1e-6)
    again = recall_key_sets(train_recall_model(steps=20), steps=20, contexts=2, context=12)
    for a, b in zip(keys.key_sets, again.key_sets, strict=True):
        np.testing.assert_array_equal(a, b)  # deterministic


def test_recall_model_options_are_checked():
    from svtoolkit.torch.learned_keys import train_recall_model

    with pytest.raises(ValueError, match=r"unknown option\(s\) \['stepz'\]"):
        train_recall_model(stepz=3)


@pytest.mark.slow
def test_learned_recall_regime_forgets_exactly():
    from verification.forgetting import REGIMES, run_trial

    assert "learned_recall" in REGIMES and "learned" in REGIMES
    trial = run_trial("learned_recall", 0)
    assert trial["status"] == "ok" and trial["n"] >= 30
    assert trial["dev"] <= 1e-9
