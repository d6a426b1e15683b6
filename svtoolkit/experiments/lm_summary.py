"""From finished language-model cells to rows, success counts, paired comparisons, the
confound rule of the matched-state study, a markdown table and a figure.

Pure Python and NumPy/SciPy (through :mod:`svtoolkit.stats`); matplotlib is imported only by
:func:`figure`. The validation metric of every language-model cell is a loss (lower is
better), so the learning rate is chosen by :func:`~.protocol.choose_lr` on its negation.
"""

from __future__ import annotations

import math

from .protocol import choose_lr
from .summary import _group

__all__ = ["READ", "confound_rule", "curves_figure", "figure", "metric_summary",
           "paired_loss_differences", "rows", "success_summary", "table"]

#: The verdict of :func:`confound_rule` when the gap may be read.
READ = "read"


def metric_summary(values):
    """``{"values", "mean", "bootstrap_ci"}`` of per-seed values (95 % percentile bootstrap
    of the mean)."""
    from svtoolkit.stats import bootstrap_mean_ci

    mean, low, high = bootstrap_mean_ci(values)
    return {"values": list(values), "mean": mean, "bootstrap_ci": [low, high]}


def success_summary(values, threshold):
    """Bimodal per-seed outcomes as a count: ``{"successes", "trials", "threshold", "low",
    "high", "confidence", "text"}``, the exact (Clopper-Pearson) interval of the rate and the
    sentence "k of n seeds learn"."""
    from svtoolkit.stats import success_count

    s = success_count(values, threshold)
    return {**s.to_dict(), "text": f"{s.successes} of {s.trials} seeds learn"}


def rows(cells, results, *, seeds, metrics):
    """One row per (method, sweep value) whose every (lr, seed) cell has finished.

    Parameters
    ----------
    cells : list of dict
        The cells (with ``method``, ``sweep_value``, ``lr``, ``seed``).
    results : list of dict or None
        Their results (``best_val_loss``, ``stopped_at``, ``stop_reason``, ``curve``,
        ``train_s``; None: not finished yet).
    seeds : sequence of int
    metrics : callable
        ``metrics(result) -> {name: float}``, the test numbers of one cell.

    Returns
    -------
    list of dict
        ``method``, ``sweep_value``, ``seeds``, ``chosen_lr`` (the lowest mean best
        validation loss over seeds; a diverged run loses), ``val_loss_by_lr``, ``val_loss``
        (per seed at the chosen lr), ``metrics`` (``{name: metric_summary}`` at the chosen
        lr), ``stopped_at``, ``stop_reason``, ``train_s`` (every lr), ``curves``
        (``{lr: {seed: curve}}``) and ``chosen`` (the chosen lr's results, in seed order; for
        the caller, not for the JSON).
    """
    grouped = _group(cells, results)
    lrs_of = {}
    for cell in cells:
        lrs_of.setdefault((cell["method"], cell["sweep_value"]), set()).add(cell["lr"])
    out = []
    for method, value in dict.fromkeys((c["method"], c["sweep_value"]) for c in cells):
        by_lr = grouped.get((method, value), {})
        if not all(len(by_lr.get(lr, {})) == len(seeds) for lr in lrs_of[(method, value)]):
            continue
        val = {lr: [by_lr[lr][s]["best_val_loss"] for s in seeds] for lr in sorted(by_lr)}
        lr = choose_lr({k: [None if v is None else -v for v in vs] for k, vs in val.items()})
        chosen = [by_lr[lr][s] for s in seeds]
        per_metric = {}
        for r in chosen:
            for name, v in metrics(r).items():
                per_metric.setdefault(name, []).append(v)
        out.append({
            "method": method, "sweep_value": value, "seeds": list(seeds), "chosen_lr": lr,
            "val_loss_by_lr": {str(k): v for k, v in val.items()}, "val_loss": val[lr],
            "metrics": {k: metric_summary(v) for k, v in per_metric.items()},
            "stopped_at": [r["stopped_at"] for r in chosen],
            "stop_reason": [r["stop_reason"] for r in chosen],
            "train_s": sum(r["train_s"] for runs in by_lr.values() for r in runs.values()),
            "curves": {str(k): {str(s): by_lr[k][s]["curve"] for s in seeds} for k in by_lr},
            "chosen": chosen})
    return out


def paired_loss_differences(baseline, treatment):
    """Paired comparison over seeds of a loss (lower is better): ``stats.paired_differences``
    of the negated losses, so a positive ``mean_difference`` means the treatment's loss is
    lower (``baseline - treatment``). None with fewer than 2 pairs."""
    from svtoolkit.stats import paired_differences

    if len(baseline) < 2:
        return None
    return paired_differences([-b for b in baseline], [-t for t in treatment]).to_dict()


def confound_rule(full_softmax_val, window_val, *, paper_scale):
    """Whether the SV-vs-window gap of the matched-state study may be read.

    At a scale where full softmax (which sees everything the window sees) is worse than the
    matched window, the models are under-trained and the gap measures training speed, not
    memory. The gap is read only when full softmax's validation loss is at or below the
    matched window's within the seed interval: with per-seed differences
    ``d_s = full_s - window_s`` (paired: the same data order), read when the lower end of the
    t-based 95 % interval of their mean is <= 0 (with one seed: when ``d <= 0``).

    Parameters
    ----------
    full_softmax_val, window_val : sequence of float
        Best validation loss per seed (same seeds, same order), lower is better.
    paper_scale : str
        The scale at which to read the gap instead, named in the verdict.

    Returns
    -------
    dict
        ``verdict`` (:data:`READ` or "confounded: under-trained"), ``mean_difference``,
        ``ci`` (None with one seed), ``n``, ``text``.
    """
    from svtoolkit.stats import mean_with_ci

    if len(full_softmax_val) != len(window_val) or not full_softmax_val:
        raise ValueError("full_softmax_val and window_val must be non-empty and paired; got "
                         f"{len(full_softmax_val)} and {len(window_val)} values")
    d = [f - w for f, w in zip(full_softmax_val, window_val, strict=True)]
    if len(d) >= 2:
        mean, low, high = mean_with_ci(d)
        ci = [low, high]
    else:
        mean, low, ci = d[0], d[0], None
    ok = low <= 0.0
    where = (f"full softmax minus matched window, validation loss: {mean:+.4f}"
             + (f" (95 % CI [{ci[0]:+.4f}, {ci[1]:+.4f}], {len(d)} seeds)" if ci else
                " (one seed)"))
    if ok:
        text = (f"read: full softmax is at least as good as the matched window within the "
                f"seed interval ({where})")
    else:
        text = (f"confounded: under-trained - full softmax is worse than the matched window "
                f"beyond the seed interval ({where}), so the models have not reached the known "
                f"ordering and the SV-vs-window gap is not read; it needs {paper_scale}")
    return {"verdict": READ if ok else "confounded: under-trained", "mean_difference": mean,
            "ci": ci, "n": len(d), "text": text}


def _fmt(summary, digits=3):
    low, high = summary["bootstrap_ci"]
    return f"{summary['mean']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def table(table_rows, *, label, column, metric, extra=None, digits=3):
    """A markdown table: one line per method, one column per sweep value, each cell the
    chosen lr's mean [bootstrap interval] of ``metric`` (``extra(row) -> str`` appended).

    Parameters
    ----------
    table_rows : list of dict
        Rows of :func:`rows`.
    label : callable
        method -> row label.
    column : callable
        sweep value -> column heading.
    metric : str
    extra : callable, optional
    digits : int, default 3
    """
    sweep = list(dict.fromkeys(r["sweep_value"] for r in table_rows))
    methods = list(dict.fromkeys(r["method"] for r in table_rows))
    by = {(r["method"], r["sweep_value"]): r for r in table_rows}
    lines = ["| method | " + " | ".join(str(column(v)) for v in sweep) + " |",
             "|---|" + "---:|" * len(sweep)]
    for m in methods:
        cells = []
        for v in sweep:
            r = by.get((m, v))
            if r is None or metric not in r["metrics"]:
                cells.append("-")
                continue
            text = _fmt(r["metrics"][metric], digits)
            cells.append(text + (extra(r) if extra else ""))
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return lines


def figure(panels, path, title):
    """One panel per ``(panel title, xlabel, ylabel, {series label: [(x, mean, low, high)]},
    log_x)``: the mean with its interval against x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.8), squeeze=False)
    for ax, (name, xlabel, ylabel, series, log_x) in zip(axes[0], panels, strict=False):
        for i, (label, points) in enumerate(series.items()):
            points = sorted(points, key=lambda p: p[0])
            xs = [p[0] for p in points]
            means = [p[1] for p in points]
            err = [[max(0.0, m - p[2]) for m, p in zip(means, points, strict=True)],
                   [max(0.0, p[3] - m) for m, p in zip(means, points, strict=True)]]
            ax.errorbar(xs if all(isinstance(x, (int, float)) for x in xs)
                        else [str(x) for x in xs], means, yerr=err, marker="o", capsize=3,
                        color=f"C{i}", label=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



def curves_figure(rows, path, title, *, ylabel="validation loss", label=None, ncols=6):
    """Validation curves of trained rows: one panel per row, one line per (lr, seed).

    Parameters
    ----------
    rows : list of dict
        Rows of :func:`rows` (``label`` or ``method``, ``chosen_lr``, ``curves``:
        ``{lr: {seed: [{"step", "val_loss", ...}]}}``), as the result JSON holds them.
    path : str or Path
        The PNG to write.
    title : str
    ylabel : str
        What ``val_loss`` measures (e.g. bits per byte).
    label : callable, optional
        A row's panel title (default: its ``label``, else its ``method``).
    ncols : int
        Panels per figure row; more rows are added as needed.

    The chosen learning rate's lines are solid, the others dashed; a line ends where the
    plateau rule (or the step cap) stopped that run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(rows))
    cols = min(n, ncols)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.2 * nrows), squeeze=False,
                             sharey=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows, strict=False):
        lrs = sorted(row["curves"], key=float)
        for i, lr in enumerate(lrs):
            chosen = float(lr) == float(row["chosen_lr"])
            for j, (seed, curve) in enumerate(sorted(row["curves"][lr].items())):
                ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve],
                        color=f"C{i}", lw=1.4 if chosen else 0.8, ls="-" if chosen else "--",
                        alpha=0.9 if chosen else 0.6,
                        label=f"lr {float(lr):g}" + (" (chosen)" if chosen else "")
                        if j == 0 else None)
        ax.set_title(label(row) if label else row.get("label", row.get("method", "")),
                     fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
