"""examples/long_context.py: the --quick pipeline end to end (train, stream, resume, outputs)
and the streaming measurement against a plain forward. Seeds fixed by the script's protocol.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "long_context.py"


def _load():
    spec = importlib.util.spec_from_file_location("long_context_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lc = _load()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    assert lc.main(["--quick", "--out", str(out), "--no-progress", "--corpus", "stdlib"]) == 0
    return out


def test_quick_run_writes_every_method_and_length(quick_run):
    payload = json.loads((quick_run / "long_context_quick.json").read_text())
    protocol = lc.PROTOCOLS["quick"]
    lengths = [m * protocol["block"] for m in protocol["lengths"]]
    assert payload["lengths"] == lengths
    got = {(r["method"], r["L"]) for r in payload["rows"]}
    assert got == {(m, L) for m in lc.METHODS for L in lengths}
    for row in payload["rows"]:
        assert len(row["nll"]) == len(protocol["eval_seeds"])
        assert all(math.isfinite(v) and 0 < v < 2 * math.log(256) for v in row["nll"])
        assert row["decode_tok_s_mean"] > 0 and row["state_bytes_mean"] > 0
    state = {(r["method"], r["L"]): r["state_bytes_mean"] for r in payload["rows"]}
    # Full KV keeps every token; the windowed caches and memories stay constant
    assert state[("full_kv", lengths[-1])] == 4 * state[("full_kv", lengths[0])]
    for method in ("window_kv", "streaming_llm", "infini", "tensor_cache"):
        assert state[(method, lengths[0])] == state[(method, lengths[-1])], method
    assert set(payload["training"]) == set(lc.METHODS)
    assert payload["environment"]["versions"]["torch"]
    text = (quick_run / "long_context_quick.md").read_text()
    assert "Tensor Cache" in text and "Published (Tensor Cache" in text
    assert (quick_run / "long_context_quick.png").stat().st_size > 0


def test_rerun_resumes_from_the_cells_file(quick_run):
    cells = quick_run / "long_context_quick.cells.jsonl"
    before = cells.read_text()
    first = json.loads((quick_run / "long_context_quick.json").read_text())["rows"]
    assert lc.main(["--quick", "--out", str(quick_run), "--no-progress", "--corpus",
                    "stdlib"]) == 0
    assert cells.read_text() == before  # nothing was run again
    again = json.loads((quick_run / "long_context_quick.json").read_text())["rows"]
    assert [r["nll"] for r in again] == [r["nll"] for r in first]


def test_streamed_nll_equals_the_forward_loss_within_the_block():
    torch.manual_seed(3)
    protocol = dict(lc.PROTOCOLS["quick"])
    block = protocol["block"]
    for method in ("full_kv", "tensor_cache", "infini"):
        model = lc.build_model(method, protocol).double().eval()
        tokens = torch.from_numpy(
            np.random.default_rng(5).integers(0, 256, size=(1, 3 * block + 1)))
        memory = lc.PeakMemory(torch.device("cpu"))
        records = lc._stream(model, tokens, [block, 2 * block], 2, memory, max_length=None)
        with torch.no_grad():
            _, loss = model(tokens[:, :block], targets=tokens[:, 1:block + 1])
        assert abs(records[0]["nll"] - float(loss)) < 1e-12, method
        assert records[1]["L"] == 2 * block and records[1]["peak_bytes"] >= 0


def test_stream_start_is_seeded_and_checks_the_split():
    val = np.zeros(1000, dtype=np.uint8)
    assert lc.stream_start(val, 0, 100) == lc.stream_start(val, 0, 100)
    assert 0 <= lc.stream_start(val, 1, 100) < 900
    with pytest.raises(ValueError, match="shorter than one evaluation stream"):
        lc.stream_start(val, 0, 1000)


def test_every_method_is_one_of_the_six_of_the_paper_plus_the_sv_hybrid():
    labels = [v[0] for v in lc.METHODS.values()]
    assert labels == ["Full KV (+NTK)", "Window KV", "StreamingLLM", "Infini-attention",
                      "Tensor Cache", "SV hybrid"]
    # NTK scaling is the Full-KV baseline's only
    assert [m for m, v in lc.METHODS.items() if v[3]] == ["full_kv"]
