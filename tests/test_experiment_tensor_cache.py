"""``examples/tensor_cache_recall.py --quick`` as a subprocess: the pipeline (task, protocol,
state counting, success counts, outputs, resume) through :mod:`svtoolkit.experiments.lm`, not
the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tensor_cache_recall.py"
ARGS = ["--quick", "--no-progress", "--table", "1", "9"]


def _run(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run of Tables 1 and 9, shared by the tests."""
    out = tmp_path_factory.mktemp("tensor_cache_recall")
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "tensor_cache_recall_quick.json").read_text())


def test_quick_json_records_the_run_and_reports_success_counts(quick):
    _, payload = quick
    assert payload["scale"] == "quick" and payload["tables"] == ["table1", "filler", "table9"]
    config = payload["record"]["config"]
    assert config["window"] == 12 and config["seeds"] == [0]
    assert config["protocol"]["lr_grid"] == [0.01, 0.003]
    assert payload["record"]["versions"]["torch"]
    assert payload["cells_done"] == payload["cells"]
    for row in payload["rows"]:
        acc = row["metrics"]["accuracy"]
        assert len(acc["values"]) == 1 and 0.0 <= acc["mean"] <= 1.0
        assert acc["bootstrap_ci"] == [acc["mean"], acc["mean"]]  # one seed
        s = row["success"]
        assert s["trials"] == 1 and s["successes"] == int(acc["values"][0] >= 0.5)
        assert s["text"] == f"{s['successes']} of 1 seeds learn"
        assert row["chosen_lr"] in (0.01, 0.003) and set(row["val_loss_by_lr"]) == {
            "0.01", "0.003"}
        assert row["chance"] == pytest.approx(1 / 16)
        assert row["metrics"]["state_kB"]["mean"] > 0 and "accuracy_std" not in row
    table1 = [(r["row"], r["x"]) for r in payload["rows"] if r["table"] == "table1"]
    assert table1 == [(m, 24) for m in ("full_kv", "window_kv", "streaming_llm", "infini",
                                        "tensor_cache")]
    assert {r["row"] for r in payload["rows"] if r["table"] == "table9"} == {
        "outer", "delta", "wedge"}


def test_quick_writes_markdown_figure_and_cells(quick):
    out, payload = quick
    table = (out / "tensor_cache_recall_quick.md").read_text()
    assert "## Table 1: matched-gap recall" in table and "## Table 9" in table
    assert "| Infini-attention | 24 |" in table and "(0.396)" in table  # published cell
    assert "of 1 seeds learn" in table and "accuracy mean [bootstrap CI]" in table
    assert (out / "tensor_cache_recall_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "tensor_cache_recall_quick.cells.jsonl").read_text().splitlines()
    assert len(lines) == payload["cells"]


def test_shared_cells_are_trained_once(quick):
    _, payload = quick
    # (5 rows of Table 1 + 3 of Table 9, the Tensor Cache outer rule at gap 24 being one cell
    # of both) x 2 learning rates x 1 seed
    assert payload["cells"] == (5 + 3 - 1) * 2


def test_rerun_resumes_from_the_cells_file(quick):
    out, payload = quick
    cells = out / "tensor_cache_recall_quick.cells.jsonl"
    before = cells.read_text()
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert cells.read_text() == before  # nothing was run again
    again = json.loads((out / "tensor_cache_recall_quick.json").read_text())
    assert [r["metrics"] for r in again["rows"]] == [r["metrics"] for r in payload["rows"]]


def test_unknown_table_is_refused():
    done = _run("--quick", "--table", "2")
    assert done.returncode == 2 and "invalid choice" in done.stderr


@pytest.mark.parametrize(("layer", "options", "per_block"), [
    ("softmax", {}, lambda L: L * 2 * 8 * 2 * 4),               # L tokens x H x D x (k, v)
    ("sliding_window", {"window": 12}, lambda L: 11 * 2 * 8 * 2 * 4),  # the last W - 1
    ("streaming_llm", {"window": 12, "sinks": 4},
     lambda L: (4 + 11) * 2 * 8 * 2 * 4),                         # 4 sinks + W - 1
    ("tensor_cache", {"window": 12, "chunk": 32, "rule": "outer"},
     lambda L: 12 * 2 * 8 * 2 * 4 + 2 * 8 * 8 * 4),               # ring W + D x D memory
    # segment buffer N = 12, memory D x D and normaliser D per head
    ("infini", {"segment": 12}, lambda L: 12 * 2 * 8 * 2 * 4 + 2 * 8 * 8 * 4 + 2 * 8 * 4),
])
def test_counted_state_matches_the_layer_formula(layer, options, per_block):
    from svtoolkit.experiments.lm import build_lm, streaming_state_bytes

    torch.manual_seed(0)
    model = build_lm(40, {"d_model": 16, "n_layers": 2, "n_heads": 2, "block": 64}, layer,
                     options)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 40, size=(1, 50)))
    assert streaming_state_bytes(model, tokens) == 2 * per_block(50)


def test_filler_sweep_keeps_to_the_trained_positions():
    from svtoolkit.experiments.lm import filler_evals, recall_sequence_length

    length = recall_sequence_length("matched", 24)
    assert length == 181
    evals = filler_evals((12, 24, 48, 96, 192), length)
    assert [(e["gap"], e["n_episodes"]) for e in evals] == [(12, 6), (24, 6), (48, 3),
                                                            (96, 1)]
