"""``--quick`` run of ``examples/mqar.py``: both tables (the vector form of Table 2 and the
token form) through :mod:`svtoolkit.experiments`; they prove the pipeline, not the numbers."""

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
    from svtoolkit.experiments.cli import main

    out = tmp_path_factory.mktemp("mqar")
    script = _load("mqar")
    argv = ["--quick", "--out", str(out), "--no-progress", "--methods", "sv", "softmax",
            "deltanet"]
    assert main((script.VECTOR, script.TOKEN), "", argv) == 0
    return script, out


def test_mqar_quick_writes_both_tables(mqar_quick):
    _, out = mqar_quick
    vector = json.loads((out / "mqar_quick.json").read_text())
    token = json.loads((out / "mqar_tokens_quick.json").read_text())
    assert vector["record"]["config"]["generator"] == "mqar_vectors"
    assert token["record"]["config"]["generator"] == "mqar"
    for payload in (vector, token):
        assert [(r["method"], r["sweep_value"]) for r in payload["rows"]] == [
            (m, n) for n in (4, 8) for m in ("sv", "softmax", "deltanet")]
        assert payload["cells_done"] == payload["cells"] == 3 * 2 * 2
    for row in vector["rows"]:
        assert row["chance"] == pytest.approx(1 / row["sweep_value"])  # nearest of n values
    for row in token["rows"]:
        assert row["chance"] == pytest.approx(1 / 16)  # value alphabet of vocabulary 32
    sv = next(r for r in vector["rows"] if r["method"] == "sv")
    assert vector["record"]["config"]["method_options"]["sv"] == {
        "qk_norm": "none", "sigma": None, "C": 0.25, "fista_iters": 80, "chunk": 4}
    assert "recall_at_1_exact" in sv
    table = (out / "mqar_quick.md").read_text()
    assert "| SV-Attention |" in table and "pub. 0.87" in table  # softmax's 8-pair cell
    for stem in ("mqar_quick", "mqar_tokens_quick"):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mqar_protocols_state_the_published_settings():
    script = _load("mqar")
    assert script.VECTOR.sweep["default"] == script.VECTOR.sweep["paper"] == (8, 16, 32, 64)
    assert script.VECTOR.protocol["paper"].n_test == 400
    assert script.VECTOR.task["default"]["n_queries"] == 8
    paper = script.TOKEN.model["paper"]
    assert (paper["d_model"], paper["n_layers"], paper["n_heads"]) == (256, 4, 4)
    assert script.TOKEN.task["paper"]["seq_len"] == 256
    for scale in ("quick", "default", "paper"):
        task = script.TOKEN.task[scale]
        assert task["seq_len"] >= 2 * max(script.TOKEN.sweep[scale]) + 2 * task["n_queries"]
