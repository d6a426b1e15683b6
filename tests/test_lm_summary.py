"""The summaries of the language-model studies (:mod:`svtoolkit.experiments.lm_summary`) on
synthetic numbers: the lr choice on validation loss, success counts of bimodal seeds, the
confound rule of the matched-state study, paired loss differences."""

from __future__ import annotations

import pytest

from svtoolkit.experiments.lm_summary import (READ, confound_rule, paired_loss_differences,
                                              rows, success_summary)
from svtoolkit.stats import clopper_pearson, mean_with_ci


def _result(val_loss, accuracy):
    return {"best_val_loss": val_loss, "stopped_at": 10, "stop_reason": "plateau",
            "curve": [{"step": 10, "train_loss": 1.0, "val_loss": val_loss}], "train_s": 1.0,
            "accuracy": accuracy}


def test_rows_choose_the_lowest_mean_validation_loss_and_report_its_test_numbers():
    seeds = (0, 1, 2)
    cells, results = [], []
    # lr 1e-3: lower validation loss on average; its seeds are bimodal (one learns)
    table = {1e-3: [(0.5, 1.0), (2.7, 0.06), (2.6, 0.07)],
             3e-3: [(2.0, 0.2), (2.0, 0.2), (2.0, 0.2)]}
    for lr, per_seed in table.items():
        for seed, (val, acc) in zip(seeds, per_seed, strict=True):
            cells.append({"method": "tensor_cache", "sweep_value": 24, "lr": lr,
                          "seed": seed})
            results.append(_result(val, acc))
    (row,) = rows(cells, results, seeds=seeds, metrics=lambda r: {"accuracy": r["accuracy"]})
    assert row["chosen_lr"] == 1e-3  # mean 1.933 < 2.0
    acc = row["metrics"]["accuracy"]
    assert acc["values"] == [1.0, 0.06, 0.07]
    assert acc["mean"] == pytest.approx(1.13 / 3)
    low, high = acc["bootstrap_ci"]
    assert 0.06 <= low <= acc["mean"] <= high <= 1.0
    assert row["val_loss"] == [0.5, 2.7, 2.6]


def test_rows_wait_for_every_lr_and_seed():
    cells = [{"method": "m", "sweep_value": 1, "lr": lr, "seed": 0} for lr in (1e-3, 3e-3)]
    assert rows(cells, [_result(1.0, 0.5), None], seeds=(0,), metrics=dict) == []


def test_a_diverged_lr_loses_to_any_finite_one():
    cells = [{"method": "m", "sweep_value": 1, "lr": lr, "seed": 0} for lr in (1e-3, 3e-3)]
    (row,) = rows(cells, [_result(None, 0.0), _result(5.0, 0.1)], seeds=(0,),
                  metrics=lambda r: {"accuracy": r["accuracy"]})
    assert row["chosen_lr"] == 3e-3


def test_bimodal_seeds_are_a_success_count_with_the_exact_interval():
    s = success_summary([0.0625, 1.0, 0.06], 0.5)
    assert (s["successes"], s["trials"]) == (1, 3)
    assert (s["low"], s["high"]) == pytest.approx(clopper_pearson(1, 3))
    assert s["text"] == "1 of 3 seeds learn"
    assert success_summary([1.0, 0.99, 0.5], 0.5)["text"] == "3 of 3 seeds learn"


def test_confound_rule_marks_a_run_where_full_softmax_is_worse_than_the_window():
    # full softmax 0.1 bits per byte worse than the matched window on every seed
    full, window = [3.22, 3.25, 3.21, 3.24], [3.12, 3.14, 3.13, 3.13]
    verdict = confound_rule(full, window, paper_scale="--paper")
    assert verdict["verdict"] == "confounded: under-trained"
    assert "under-trained" in verdict["text"] and "--paper" in verdict["text"]
    mean, low, high = mean_with_ci([f - w for f, w in zip(full, window, strict=True)])
    assert verdict["mean_difference"] == pytest.approx(mean)
    assert verdict["ci"] == pytest.approx([low, high]) and low > 0


def test_confound_rule_reads_the_gap_in_the_known_ordering():
    full, window = [2.10, 2.12, 2.11], [2.30, 2.28, 2.33]
    assert confound_rule(full, window, paper_scale="--paper")["verdict"] == READ


def test_confound_rule_reads_a_tie_within_the_seed_interval():
    # full softmax slightly worse on average, but the interval reaches below zero
    full, window = [2.28, 2.20, 2.24], [2.18, 2.25, 2.20]
    verdict = confound_rule(full, window, paper_scale="--paper")
    assert verdict["mean_difference"] > 0 and verdict["ci"][0] <= 0
    assert verdict["verdict"] == READ


def test_confound_rule_with_one_seed_reads_the_point():
    assert confound_rule([3.2], [3.1], paper_scale="x")["verdict"] != READ
    assert confound_rule([3.0], [3.1], paper_scale="x")["verdict"] == READ
    with pytest.raises(ValueError, match="paired"):
        confound_rule([3.0, 3.1], [3.1], paper_scale="x")


def test_paired_loss_differences_are_positive_when_the_treatment_is_lower():
    d = paired_loss_differences([3.0, 3.2, 3.1], [2.8, 3.0, 3.0])
    assert d["mean_difference"] == pytest.approx((0.2 + 0.2 + 0.1) / 3)
    assert d["wins"] == 3
    assert paired_loss_differences([3.0], [2.0]) is None


@pytest.mark.parametrize("stem", ["tensor_cache_recall", "matched_state", "long_context"])
def test_help_imports_neither_torch_nor_matplotlib(stem):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import runpy, sys\n"
            f"sys.argv = ['{stem}.py', '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(root / 'examples' / (stem + '.py'))!r}, "
            "run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(root)), cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "--paper" in out.stdout and "--jobs" in out.stdout and "--methods" in out.stdout


def test_curves_figure_draws_every_lr_and_seed(tmp_path):
    """One panel per row, one line per (lr, seed); the chosen lr is drawn solid."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from svtoolkit.experiments.lm_summary import curves_figure

    curve = [{"step": 10, "val_loss": 3.0}, {"step": 20, "val_loss": 2.5}]
    rows = [{"label": name, "chosen_lr": 0.003,
             "curves": {"0.001": {"0": curve, "1": curve}, "0.003": {"0": curve, "1": curve}}}
            for name in ("SV hybrid", "DeltaNet")]
    drawn = []
    real_savefig = plt.Figure.savefig

    def spy(fig, path, **kw):
        drawn.append([[(line.get_linestyle(), line.get_xdata().tolist()) for line in ax.lines]
                      for ax in fig.axes])
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = spy
    try:
        curves_figure(rows, tmp_path / "c.png", "title")
    finally:
        plt.Figure.savefig = real_savefig
    assert (tmp_path / "c.png").stat().st_size > 0
    (panels,) = drawn
    assert len(panels) == 2 and all(len(lines) == 4 for lines in panels)
    assert sorted(style for style, _ in panels[0]) == ["-", "-", "--", "--"]
    assert panels[0][0][1] == [10, 20]
