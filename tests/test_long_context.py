"""``examples/long_context.py --quick`` as a subprocess (train under the protocol on two
training seeds, stream, resume, outputs) and the streaming measurement of
:mod:`svtoolkit.experiments.lm` against a plain forward."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "long_context.py"
ARGS = ["--quick", "--no-progress", "--corpus", "stdlib"]
METHODS = ("full_kv", "window_kv", "streaming_llm", "infini", "tensor_cache", "sv_hybrid")


def _run(*argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=900)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, json.loads((out / "long_context_quick.json").read_text())


def test_quick_run_writes_every_method_and_length(quick_run):
    out, payload = quick_run
    config = payload["record"]["config"]
    block = config["settings"]["block"]
    lengths = [m * block for m in config["settings"]["lengths"]]
    assert payload["lengths"] == lengths and config["train_seeds"] == [0, 1]
    assert {(r["method"], r["L"]) for r in payload["rows"]} == {
        (m, L) for m in METHODS for L in lengths}
    for row in payload["rows"]:
        nll = row["nll"]
        assert len(nll["values"]) == 2  # one value per training seed
        assert all(math.isfinite(v) and 0 < v < 2 * math.log(256) for v in nll["values"])
        assert nll["bootstrap_ci"][0] <= nll["mean"] <= nll["bootstrap_ci"][1]
        assert row["decode_tok_s_mean"] > 0 and row["state_bytes_mean"] > 0
    state = {(r["method"], r["L"]): r["state_bytes_mean"] for r in payload["rows"]}
    # Full KV keeps every token; the windowed caches and memories stay constant
    assert state[("full_kv", lengths[-1])] == 4 * state[("full_kv", lengths[0])]
    for method in ("window_kv", "streaming_llm", "infini", "tensor_cache"):
        assert state[(method, lengths[0])] == state[(method, lengths[-1])], method
    assert [r["method"] for r in payload["training"]] == list(METHODS)
    assert {p["method"] for p in payload["paired_minus_tensor_cache"]} == set(METHODS) - {
        "tensor_cache"}
    assert payload["record"]["versions"]["torch"]
    text = (out / "long_context_quick.md").read_text()
    assert "Tensor Cache" in text and "Published (Tensor Cache" in text
    assert (out / "long_context_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streams_use_the_chosen_lr_of_every_method(quick_run):
    out, payload = quick_run
    chosen = {r["method"]: r["chosen_lr"] for r in payload["training"]}
    lines = [json.loads(x) for x in
             (out / "long_context_quick.cells.jsonl").read_text().splitlines()]
    streams = [x["cell"] for x in lines if x["cell"]["study"] == "lm_stream"]
    assert len(streams) == len(METHODS) * 2  # 2 training seeds x 1 evaluation seed
    assert all(s["train"]["lr"] == chosen[s["train"]["method"]] for s in streams)
    starts = {x["result"]["start"] for x in lines if x["cell"]["study"] == "lm_stream"}
    assert len(starts) == 1  # every method reads the same bytes


def test_rerun_resumes_from_the_cells_file(quick_run):
    out, payload = quick_run
    cells = out / "long_context_quick.cells.jsonl"
    before = cells.read_text()
    done = _run(*ARGS, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert cells.read_text() == before  # nothing was run again
    again = json.loads((out / "long_context_quick.json").read_text())
    assert again["rows"] == payload["rows"]


def test_streamed_nll_equals_the_forward_loss_within_the_block():
    from svtoolkit.experiments.lm import PeakMemory, build_lm, stream_records

    torch.manual_seed(3)
    block = 16
    model_cfg = {"d_model": 16, "n_layers": 1, "n_heads": 2, "block": block,
                 "positions": "rotary"}
    for layer, options in (("softmax", {}), ("tensor_cache", {"window": 8, "chunk": 4}),
                           ("infini", {"segment": 8})):
        model = build_lm(256, {**model_cfg, "ntk": layer == "softmax"}, layer,
                         options).double().eval()
        tokens = torch.from_numpy(
            np.random.default_rng(5).integers(0, 256, size=(1, 3 * block + 1)))
        records = stream_records(model, tokens, [block, 2 * block], 2,
                                 PeakMemory(torch.device("cpu")), max_length=None)
        with torch.no_grad():
            _, loss = model(tokens[:, :block], targets=tokens[:, 1:block + 1])
        # the same float64 sums in another order: far below 1e-12 of an NLL of ~5.5
        assert abs(records[0]["nll"] - float(loss)) < 1e-12, layer
        assert records[1]["L"] == 2 * block and records[1]["peak_bytes"] >= 0


def test_stream_start_is_seeded_and_checks_the_split():
    from svtoolkit.experiments.lm import stream_start

    val = np.zeros(1000, dtype=np.uint8)
    assert stream_start(val, 0, 100) == stream_start(val, 0, 100)
    assert 0 <= stream_start(val, 1, 100) < 900
    with pytest.raises(ValueError, match="shorter than one evaluation stream"):
        stream_start(val, 0, 1000)
