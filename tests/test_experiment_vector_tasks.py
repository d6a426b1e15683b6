"""``--quick`` runs of the continuous-token studies (selective copying, capacity): they prove
the pipeline of :mod:`svtoolkit.experiments` (cells, protocol, summary, outputs), not the
numbers."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: script stem -> the --quick sweep
SCRIPTS = {"selective_copying": [8, 16], "capacity": [8, 16]}
METHODS = ["sv", "sv_rms", "softmax", "deltanet", "linear", "gated_deltanet"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def quick_run(request, tmp_path_factory):
    """One script's --quick with two seeds; return (stem, its JSON, the output dir)."""
    from svtoolkit.experiments.cli import main

    stem = request.param
    out = tmp_path_factory.mktemp(stem)
    script = _load(stem)
    assert main(script.STUDY, "", ["--quick", "--no-progress", "--seeds", "0", "1",
                                   "--out", str(out)]) == 0
    return stem, json.loads((out / f"{stem}_quick.json").read_text()), out


def test_quick_json_has_the_run_record_and_protocol(quick_run):
    stem, payload, _ = quick_run
    assert payload["experiment"] == stem and payload["scale"] == "quick"
    assert payload["cells_done"] == payload["cells"] == len(METHODS) * 2 * 2 * 2
    record = payload["record"]
    assert record["config"]["methods"] == METHODS and record["config"]["seeds"] == [0, 1]
    assert record["versions"]["torch"] and record["cpu_count"] >= 1
    assert record["config"]["method_options"]["sv"]["qk_norm"] == "none"
    assert record["config"]["method_options"]["sv_rms"]["qk_norm"] == "rms"
    assert "lr grid" in payload["protocol_text"]
    assert len(payload["differences_from_paper"]) >= 6


def test_quick_rows_cover_the_grid_with_validation_chosen_lrs(quick_run):
    stem, payload, _ = quick_run
    rows = payload["rows"]
    assert sorted((r["method"], r["sweep_value"]) for r in rows) == sorted(
        (m, n) for m in METHODS for n in SCRIPTS[stem])
    for row in rows:
        assert row["chosen_lr"] in (1e-2, 3e-3)
        assert set(row["curves"]) == {"0.01", "0.003"}
        assert all(len(c) >= 1 for by_seed in row["curves"].values() for c in by_seed.values())
        assert len(row["test"]) == 2 and all(0.0 <= v <= 1.0 for v in row["test"])
        low, high = row["bootstrap_ci"]
        assert min(row["test"]) <= low <= row["mean"] <= high <= max(row["test"])
        assert row["success"]["trials"] == 2 and row["success"]["threshold"] == 0.9
        assert 0.0 < row["chance"] < 1.0


def test_quick_sv_rows_have_exact_recall_and_support(quick_run):
    _, payload, _ = quick_run
    for row in payload["rows"]:
        if row["method"] in ("sv", "sv_rms"):
            assert all(0.0 <= v <= 1.0 for v in row["recall_at_1_exact"])
            assert 0.0 <= row["support_informative_mean_mean"] <= row["support_mean_mean"]
        else:
            assert "support_mean" not in row


def test_quick_paired_comparisons_of_sv_against_each_main_baseline(quick_run):
    stem, payload, _ = quick_run
    comps = payload["comparisons"]
    assert sorted((c["baseline"], c["sweep_value"]) for c in comps) == sorted(
        (m, n) for m in ("softmax", "deltanet", "linear") for n in SCRIPTS[stem])
    for c in comps:
        assert c["n"] == 2 and c["wins"] + c["ties"] <= 2
        assert math.isclose(c["mean_difference"], sum(c["differences"]) / 2)


def test_quick_writes_table_figures_and_cells(quick_run):
    stem, payload, out = quick_run
    table = (out / f"{stem}_quick.md").read_text()
    assert "SV-Attention, exact fp64 gate" in table and "SV (rms-normalised) (ablation)" in table
    assert "pub." in table and "Paired comparisons" in table
    for name in (f"{stem}_quick.png", f"{stem}_quick_curves.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / f"{stem}_quick.cells.jsonl").read_text().splitlines()
    assert len(lines) == payload["cells"]


@pytest.mark.parametrize("stem", sorted(SCRIPTS))
def test_protocols_state_the_published_sweep_and_one_grid(stem):
    from svtoolkit.tasks import CAPACITY_ITEMS_SWEEP, SELECTIVE_COPYING_FILLER_SWEEP

    study = _load(stem).STUDY
    published = {"selective_copying": SELECTIVE_COPYING_FILLER_SWEEP,
                 "capacity": CAPACITY_ITEMS_SWEEP}[stem]
    assert study.sweep["paper"] == published
    for scale in ("default", "paper"):
        assert study.protocol[scale].n_test == 300  # the paper's held-out instances
        assert study.protocol[scale].lr_grid == (3e-4, 1e-3, 3e-3, 1e-2)
        assert len(study.seeds[scale]) >= 3
        assert set(study.sweep[scale]) <= set(published)
