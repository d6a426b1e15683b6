"""Pipeline tests of the continuous-token experiments (selective copying, capacity).

Each runs its script with ``--quick`` into a temporary directory and checks that the JSON has
the configuration, the package versions and one finite row per (method, sweep value), that the
SV rows carry the exact-gate recall and support size, and that the table and the figure are
written. The numbers of a quick run mean nothing; only their structure is tested.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: script stem -> (sweep key in the rows, the --quick sweep)
SCRIPTS = {"selective_copying": ("n_filler", [8, 16]), "capacity": ("n_items", [8, 16])}
METHODS = ["sv", "softmax", "deltanet", "linear", "gated_deltanet"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def quick_run(request, tmp_path_factory):
    """Run one script with --quick once; return (stem, its JSON payload, the output dir)."""
    stem = request.param
    out = tmp_path_factory.mktemp(stem)
    assert _load(stem).main(["--quick", "--no-progress", "--out", str(out)]) == 0
    return stem, json.loads((out / f"{stem}_quick.json").read_text()), out


def test_quick_json_has_configuration_and_versions(quick_run):
    stem, payload, _ = quick_run
    assert payload["experiment"] == stem
    assert payload["scale"] == "quick"
    assert payload["seeds"] == [0]
    assert payload["methods"] == METHODS
    assert payload["protocol"]["n_heldout"] > 0
    assert payload["environment"]["versions"]["torch"]
    assert payload["fixed"]["C"] == 0.25
    assert len(payload["differences_from_paper"]) >= 7


def test_quick_rows_cover_the_grid_and_are_finite(quick_run):
    stem, payload, _ = quick_run
    key, sweep = SCRIPTS[stem]
    cells = sorted((r["method"], r[key]) for r in payload["rows"])
    assert cells == sorted((m, n) for m in METHODS for n in sweep)
    for row in payload["rows"]:
        assert 0.0 <= row["mean"] <= 1.0
        assert math.isfinite(row["std"])
        assert math.isfinite(row["heldout_mse_mean"])
        assert 0.0 < row["chance"] < 1.0


def test_quick_sv_rows_have_exact_recall_and_support(quick_run):
    stem, payload, _ = quick_run
    _, sweep = SCRIPTS[stem]
    sv_rows = [r for r in payload["rows"] if r["method"] == "sv"]
    assert len(sv_rows) == len(sweep)  # one SV row per swept setting
    for row in sv_rows:
        assert 0.0 <= row["recall_at_1_exact_mean"] <= 1.0
        assert 0.0 <= row["support_informative_mean_mean"] <= row["support_mean_mean"]
    assert all("support_mean_mean" not in r for r in payload["rows"] if r["method"] != "sv")


def test_quick_writes_table_figure_and_cells(quick_run):
    stem, payload, out = quick_run
    table = (out / f"{stem}_quick.md").read_text()
    assert "SV-Attention, exact fp64 gate" in table
    assert "(published)" in table
    assert (out / f"{stem}_quick.png").stat().st_size > 0
    lines = (out / f"{stem}_quick.cells.jsonl").read_text().splitlines()
    assert len(lines) == len(METHODS) * len(SCRIPTS[stem][1])


def test_quick_rerun_resumes_from_the_cells_file(quick_run, monkeypatch):
    stem, payload, out = quick_run
    script = _load(stem)

    def must_not_run(cell):
        raise AssertionError(f"cell {cell} was run again")

    monkeypatch.setattr(script, "run_cell", must_not_run)
    assert script.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    assert json.loads((out / f"{stem}_quick.json").read_text())["rows"] == payload["rows"]


@pytest.mark.parametrize("stem", sorted(SCRIPTS))
def test_protocols_state_the_published_settings(stem):
    from svtoolkit.tasks import CAPACITY_ITEMS_SWEEP, SELECTIVE_COPYING_FILLER_SWEEP

    script = _load(stem)
    sweep_name = {"selective_copying": "fillers", "capacity": "items"}[stem]
    published = {"selective_copying": SELECTIVE_COPYING_FILLER_SWEEP,
                 "capacity": CAPACITY_ITEMS_SWEEP}[stem]
    assert script.PROTOCOLS["paper"][sweep_name] == published
    for scale in ("default", "paper"):
        assert script.PROTOCOLS[scale]["n_heldout"] == 300
        assert len(script.PROTOCOLS[scale]["seeds"]) >= 3
        assert set(script.PROTOCOLS[scale][sweep_name]) <= set(published)
    with pytest.raises(SystemExit, match="2"):  # argparse: --quick and --paper exclude
        script.parse_args(["--quick", "--paper"])
