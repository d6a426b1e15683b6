"""``--quick`` run of ``examples/tensor_cache_recall.py``: the pipeline (task, trainer, sweep,
state counting, outputs, resume), not the numbers."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROW_NAMES = ("table1", "filler", "table4", "table5", "table6", "table9")


def _load():
    path = EXAMPLES / "tensor_cache_recall.py"
    spec = importlib.util.spec_from_file_location("example_tensor_cache_recall", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run of every table, shared by the tests."""
    out = tmp_path_factory.mktemp("tensor_cache_recall")
    script = _load()
    argv = ["--quick", "--out", str(out), "--no-progress"]
    assert script.main(argv) == 0
    return script, out, argv


def test_quick_json_has_every_table_and_finite_numbers(quick):
    script, out, _ = quick
    payload = json.loads((out / "tensor_cache_recall_quick.json").read_text())
    assert payload["scale"] == "quick" and payload["tables"] == list(ROW_NAMES)
    assert payload["environment"]["versions"]["torch"]
    assert payload["backend"] == "in process (serial)"
    assert payload["window"] == 12 and payload["seeds"] == [0]
    rows = payload["rows"]
    assert {r["table"] for r in rows} == set(ROW_NAMES)
    for row in rows:
        for field in ("accuracy_mean", "accuracy_std", "nll_mean", "nll_std", "state_kB"):
            assert math.isfinite(row[field]), (row["table"], row["row"], field)
        assert 0.0 <= row["accuracy_mean"] <= 1.0 and row["nll_mean"] > 0.0
        assert row["state_kB"] > 0.0 and row["seeds"] == [0]
        assert row["chance"] == pytest.approx(1 / 16)
    table1 = [(r["row"], r["x"]) for r in rows if r["table"] == "table1"]
    assert table1 == [(m, 24) for m in script.METHODS]
    table4 = {(r["row"], r["x"]) for r in rows if r["table"] == "table4"}
    assert table4 == {(f, c) for f in script.TC_FORMS for c in (8, 64)}
    assert {r["row"] for r in rows if r["table"] == "table9"} == {"outer", "delta", "wedge"}


def test_quick_writes_markdown_figure_and_cells(quick):
    _, out, _ = quick
    payload = json.loads((out / "tensor_cache_recall_quick.json").read_text())
    table = (out / "tensor_cache_recall_quick.md").read_text()
    assert "## Table 1: matched-gap recall" in table and "## Table 9" in table
    assert "| Infini-attention | 24 |" in table and "(0.396)" in table  # published cell
    assert (out / "tensor_cache_recall_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "tensor_cache_recall_quick.cells.jsonl").read_text().splitlines()
    assert len(lines) == payload["cells"]


def test_shared_cells_are_trained_once(quick):
    _, out, _ = quick
    payload = json.loads((out / "tensor_cache_recall_quick.json").read_text())
    # 5 (Table 1) + 6 (Table 4) + 3 (Table 5) + 5 (Table 6) + 3 (Table 9) rows; the
    # Tensor Cache at gap 24 with the outer rule and chunk 32 is one cell of Tables 1 and 9
    assert payload["cells"] == 5 + 6 + 3 + 5 + 3 - 1


def test_rerun_resumes_from_the_cells_file(quick, monkeypatch):
    script, out, argv = quick
    before = json.loads((out / "tensor_cache_recall_quick.json").read_text())["rows"]

    def must_not_run(cell):
        raise AssertionError(f"cell {cell} was run again")

    monkeypatch.setattr(script, "run_cell", must_not_run)
    assert script.main([*argv, "--table", "1"]) == 0
    rows = json.loads((out / "tensor_cache_recall_quick.json").read_text())["rows"]
    assert rows == [r for r in before if r["table"] in ("table1", "filler")]


def _tiny(script, method):
    from svtoolkit.torch import TinyLM

    torch.manual_seed(0)
    _, attn, options = script.METHODS[method]
    return TinyLM(40, 16, 2, 2, 64, attn=attn, attn_options=dict(options))


@pytest.mark.parametrize(("method", "per_block"), [
    ("full_kv", lambda L: L * 2 * 8 * 2 * 4),               # L tokens x H x D x (k, v) fp32
    ("window_kv", lambda L: 11 * 2 * 8 * 2 * 4),            # the last W - 1 tokens
    ("streaming_llm", lambda L: (4 + 11) * 2 * 8 * 2 * 4),  # 4 sinks + W - 1
    ("tensor_cache", lambda L: 12 * 2 * 8 * 2 * 4 + 2 * 8 * 8 * 4),  # ring W + D x D memory
    # segment buffer N = 12, memory D x D and normaliser D per head
    ("infini", lambda L: 12 * 2 * 8 * 2 * 4 + 2 * 8 * 8 * 4 + 2 * 8 * 4),
])
def test_counted_state_matches_the_layer_formula(method, per_block):
    script = _load()
    model = _tiny(script, method)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 40, size=(1, 50)))
    assert script.streaming_state_bytes(model, tokens) == 2 * per_block(50)


def test_filler_sweep_keeps_to_the_trained_positions():
    script = _load()
    length = script.sequence_length("matched", 24)
    assert length == 181
    evals = script.filler_evals((12, 24, 48, 96, 192), length)
    assert [(e["gap"], e["n_episodes"]) for e in evals] == [(12, 6), (24, 6), (48, 3),
                                                            (96, 1)]


def test_protocols_state_the_scaling():
    script = _load()
    default = script.PROTOCOLS["default"]
    assert len(default["seeds"]) >= 3 and script.DEFAULT_TABLES == (1, 4)
    paper = script.PROTOCOLS["paper"]
    assert paper["gaps"] == (24, 36, 48) and paper["long_gaps"] == (128, 256, 512, 1024)
    assert paper["steps"] == 300 and 64 in paper["chunks"]
    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error
        script.parse_args(["--table", "2"])
