"""``examples/matched_state.py --quick``: the matched-state protocol end to end (pipeline, not
numbers) - the state drives the window, the statistics are recomputed from the rows here."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")
from scipy import stats as sps  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load():
    spec = importlib.util.spec_from_file_location("example_matched_state",
                                                  EXAMPLES / "matched_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run on the zero-install corpus with two seeds, shared by the tests."""
    out = tmp_path_factory.mktemp("matched_state")
    script = _load()
    argv = ["--quick", "--out", str(out), "--no-progress", "--corpus", "stdlib",
            "--seeds", "0", "1"]
    assert script.main(argv) == 0
    payload = json.loads((out / "matched_state_quick.json").read_text())
    return script, out, argv, payload


def test_outputs_and_cells(quick):
    _, out, _, payload = quick
    assert payload["scale"] == "quick" and payload["corpus"]["name"] == "stdlib"
    assert payload["environment"]["versions"]["torch"]
    methods = sorted((c["method"], c["seed"]) for c in payload["cells"])
    assert methods == sorted([("sv_hybrid", 0), ("sv_hybrid", 1), ("swa", 0), ("swa", 1),
                              ("deltanet", 0), ("linear", 0), ("softmax", 0),
                              ("swa_qk_norm", 0), ("swa_qk_norm", 1), ("softmax_qk_norm", 0)])
    assert len((out / "matched_state_quick.cells.jsonl").read_text().splitlines()) == 10
    table = (out / "matched_state_quick.md").read_text()
    assert "2.178" in table and "Differences from the published protocol" in table
    assert "| DeltaNet | 0 |" in table
    assert (out / "matched_state_quick.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_window_is_the_measured_state_plus_the_chunk(quick):
    _, out, _, payload = quick
    chunk = payload["protocol"]["chunk"]
    cells = {(c["method"], c["seed"]): c for c in payload["cells"]}
    for row in payload["per_seed"]:
        state = cells[("sv_hybrid", row["seed"])]["state"]
        assert 0 < state["exact"] <= payload["protocol"]["block"]
        assert state["margin"] + state["error"] == pytest.approx(state["exact"])
        assert row["window"] == round(state["exact"]) + chunk
        assert cells[("swa", row["seed"])]["attn_options"] == {"window": row["window"]}
        assert cells[("swa_qk_norm", row["seed"])]["attn_options"] == {
            "window": row["window"], "qk_norm": True}
    control = payload["control"]
    assert [r["window"] for r in control["per_seed"]] == [r["window"] for r in payload["per_seed"]]
    assert "Control (not in the paper)" in (out / "matched_state_quick.md").read_text()


def test_statistics_are_recomputed_from_the_rows(quick):
    _, _, _, payload = quick
    cells = {(c["method"], c["seed"]): c for c in payload["cells"]}
    rows = payload["per_seed"]
    swa = np.array([cells[("swa", r["seed"])]["best_val_bpb"] for r in rows])
    sv = np.array([cells[("sv_hybrid", r["seed"])]["best_val_bpb"] for r in rows])
    assert [r["baseline_bpb"] for r in rows] == swa.tolist()
    s = payload["statistics"]
    rel = (swa - sv) / swa
    half = sps.t.ppf(0.975, rel.size - 1) * rel.std(ddof=1) / math.sqrt(rel.size)
    assert s["mean_improvement"] == pytest.approx(rel.mean())
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((rel.mean() - half, rel.mean() + half))
    assert s["t"] == pytest.approx(sps.ttest_rel(swa, sv).statistic)
    assert s["t_p"] == pytest.approx(sps.ttest_rel(swa, sv).pvalue)
    assert s["wilcoxon_p"] == pytest.approx(sps.wilcoxon(swa, sv).pvalue)
    diff = swa - sv
    assert s["cohens_dz"] == pytest.approx(diff.mean() / diff.std(ddof=1))
    assert s["wins"] == int((sv < swa).sum())


def test_best_is_the_minimum_over_the_evaluations(quick):
    _, _, _, payload = quick
    for arm, runs in payload["curves"].items():
        finals = [c["best_val_bpb"] for c in payload["cells"] if c["method"] == arm]
        assert sorted(min(e["val_bpb"] for e in run) for run in runs) == sorted(finals)


def test_rerun_resumes_from_the_cells_file(quick, monkeypatch):
    script, out, argv, payload = quick

    def refuse(cell):
        raise AssertionError("a finished cell was run again")

    monkeypatch.setattr(script, "run_cell", refuse)
    assert script.main(argv) == 0
    again = json.loads((out / "matched_state_quick.json").read_text())
    assert again["per_seed"] == payload["per_seed"]
    assert again["statistics"] == payload["statistics"]


def test_option_errors():
    script = _load()
    with pytest.raises(ValueError, match="matched window"):
        script.attn_options("swa", script.PROTOCOLS["quick"])
    assert script.matched_window(15.6, 32) == 48
    assert script.comparison([]) is None


def test_gpu_benchmark_smoke_runs_every_part_on_the_cpu(tmp_path):
    """``benchmarks/gpu.py --smoke``: layer rows, batched FISTA, matched-state arms, JSON."""
    spec = importlib.util.spec_from_file_location(
        "benchmark_gpu", EXAMPLES.parent / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gpu.json"
    assert module.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["smoke"] and report["environment"]["device"] == "cpu"
    layers = report["parts"]["layers"]
    assert [r["layer"] for r in layers] == ["softmax", "sv_hybrid"]
    assert all(r["check"]["passed"] and r["tokens_per_s"] > 0 for r in layers)
    (fista,) = report["parts"]["fista"]
    assert fista["n"] == 16 and fista["problems_per_second"] > 0
    assert fista["check"]["min_partition_agreement"] >= 0.0
    arms = {r["arm"]: r for r in report["parts"]["lm"]["rows"]}
    assert list(arms) == ["sv_hybrid", "swa", "deltanet", "linear", "softmax"]
    chunk = report["parts"]["lm"]["protocol"]["chunk"]
    assert arms["swa"]["attn_options"]["window"] == round(
        arms["sv_hybrid"]["state"]["exact"]) + chunk
    assert set(report["wall_s"]) == {"layers", "fista", "lm", "total"}


@pytest.mark.slow  # the token-level gate solves once per token: about 90 s of CPU
def test_gate_update_ablation_pairs_chunk_and_token_updates(tmp_path):
    script = _load()
    if not script.gate_update_supported():
        pytest.skip("the installed SV layers have no gate_update option")
    argv = ["--quick", "--ablation", "gate-update", "--out", str(tmp_path), "--no-progress",
            "--corpus", "stdlib", "--seeds", "0", "1"]
    assert script.main(argv) == 0
    payload = json.loads((tmp_path / "matched_state_quick_gate_update.json").read_text())
    options = {c["method"]: c["attn_options"] for c in payload["cells"]}
    assert options["sv_hybrid_token"] == {**options["sv_hybrid"], "gate_update": "token"}
    chunk = np.array([r["baseline_bpb"] for r in payload["per_seed"]])
    token = np.array([r["treatment_bpb"] for r in payload["per_seed"]])
    assert payload["statistics"]["t"] == pytest.approx(sps.ttest_rel(chunk, token).statistic)
    assert "0.04 %" in (tmp_path / "matched_state_quick_gate_update.md").read_text()
