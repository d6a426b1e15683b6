"""``--quick`` runs of the experiment scripts: they prove the pipeline (task, trainer, sweep
backend, outputs, resume), not the numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mqar_quick(tmp_path_factory):
    """One ``--quick`` run on three rows (the SV layer included), shared by the tests."""
    out = tmp_path_factory.mktemp("mqar")
    script = _load("mqar")
    argv = ["--quick", "--out", str(out), "--no-progress", "--methods", "sv", "softmax",
            "deltanet"]
    assert script.main(argv) == 0
    return script, out, argv


def test_mqar_quick_writes_json_markdown_and_figure(mqar_quick):
    script, out, _ = mqar_quick
    payload = json.loads((out / "mqar_quick.json").read_text())
    assert payload["scale"] == "quick" and payload["pairs"] == [4, 8]
    assert payload["environment"]["versions"]["torch"]
    assert payload["backend"] == "in process (serial)"
    rows = payload["rows"]
    assert [(r["method"], r["n_pairs"]) for r in rows] == [
        (m, n) for m in ("sv", "softmax", "deltanet") for n in (4, 8)]
    for row in rows:
        assert row["seeds"] == [0] and 0.0 <= row["mean"] <= 1.0
        assert row["chance"] == pytest.approx(1 / 16)  # value alphabet of vocabulary 32
    assert rows[0]["attn_options"] == {"chunk": 8, "C": 0.25, "fista_iters": 80}
    table = (out / "mqar_quick.md").read_text()
    assert "| SV-Attention |" in table and "(0.87)" in table  # softmax's published 8-pair cell
    assert "SV (no gate) is not reported" in table
    assert (out / "mqar_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "mqar_quick.cells.jsonl").read_text().splitlines()
    assert len(lines) == 6


def test_mqar_rerun_resumes_from_the_cells_file(mqar_quick, monkeypatch):
    script, out, argv = mqar_quick
    before = json.loads((out / "mqar_quick.json").read_text())["rows"]

    def must_not_run(cell):
        raise AssertionError(f"cell {cell} was run again")

    monkeypatch.setattr(script, "run_cell", must_not_run)
    assert script.main(argv) == 0
    assert json.loads((out / "mqar_quick.json").read_text())["rows"] == before
    # a new seed runs only its own cells
    ran = []
    monkeypatch.setattr(script, "run_cell", lambda cell: ran.append(cell) or {
        "recall_at_1": 0.5, "heldout_loss": 1.0, "scored_queries": 32, "chance": 1 / 16,
        "final_train_loss": 1.0, "params": 1, "attn_options": {}, "train_s": 0.0,
        "step_time_median_s": 0.0, "device": "cpu"})
    assert script.main([*argv, "--seeds", "0", "1"]) == 0
    assert {c["seed"] for c in ran} == {1} and len(ran) == 6
    rows = json.loads((out / "mqar_quick.json").read_text())["rows"]
    assert all(r["seeds"] == [0, 1] for r in rows)


def test_mqar_protocols_state_the_published_settings():
    script = _load("mqar")
    paper = script.PROTOCOLS["paper"]
    assert (paper["d_model"], paper["n_layers"], paper["n_heads"]) == (256, 4, 4)
    assert paper["pairs"] == (8, 16, 32, 64) and paper["n_heldout"] == 400
    assert paper["n_queries"] == 8 and paper["chunk"] == 64 and paper["batch_size"] == 16
    default = script.PROTOCOLS["default"]
    assert default["n_heldout"] == 400 and default["n_queries"] == 8
    for protocol in script.PROTOCOLS.values():
        assert protocol["seq_len"] >= 2 * max(protocol["pairs"]) + 2 * protocol["n_queries"]
    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error
        script.parse_args(["--quick", "--paper"])
