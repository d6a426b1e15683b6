"""From finished cells to rows, paired comparisons, a markdown table and figures.

Pure Python and NumPy/SciPy (through :mod:`svtoolkit.stats`); matplotlib is imported only by
:func:`figures`.
"""

from __future__ import annotations

import math

from .methods import METHODS
from .protocol import choose_lr

__all__ = ["comparisons", "figures", "markdown", "rows"]


def _group(cells, results):
    """``{(method, sweep value): {lr: {seed: result}}}``."""
    out = {}
    for cell, result in zip(cells, results, strict=True):
        if result is None:
            continue
        key = (cell["method"], cell["sweep_value"])
        out.setdefault(key, {}).setdefault(cell["lr"], {})[cell["seed"]] = result
    return out


def rows(cells, results, *, seeds, threshold, published=None):
    """One row per (method, sweep value) whose every (lr, seed) cell has finished.

    Parameters
    ----------
    cells : list of dict
        The sweep's cells (with ``method``, ``sweep_value``, ``lr``, ``seed``).
    results : list of dict or None
        Their results (None: not finished yet).
    seeds : sequence of int
    threshold : float
        The stated success level of the test metric (fixed before the run).
    published : dict, optional
        ``{method: {sweep value: published value or text}}``.

    Returns
    -------
    list of dict
        ``chosen_lr`` (by validation only), per-seed ``test`` recall at that lr, ``mean``,
        ``bootstrap_ci``, ``success`` (count with its Clopper-Pearson interval), the
        validation best of every lr, stop steps and reasons, the SV exact-gate recall and
        support where present.
    """
    from svtoolkit.stats import bootstrap_mean_ci, success_count

    published = published or {}
    grouped = _group(cells, results)
    lrs_of = {}
    for cell in cells:
        lrs_of.setdefault((cell["method"], cell["sweep_value"]), set()).add(cell["lr"])
    out = []
    order = list(dict.fromkeys((c["method"], c["sweep_value"]) for c in cells))
    for method, value in order:
        by_lr = grouped.get((method, value), {})
        complete = all(len(by_lr.get(lr, {})) == len(seeds) for lr in lrs_of[(method, value)])
        if not complete:
            continue
        best_val = {lr: [by_lr[lr][s]["best_val"] for s in seeds] for lr in sorted(by_lr)}
        lr = choose_lr(best_val)
        chosen = [by_lr[lr][s] for s in seeds]
        test = [r["test"]["recall_at_1"] for r in chosen]
        mean, low, high = bootstrap_mean_ci(test)
        row = {
            "method": method, "label": METHODS[method].label, "kind": METHODS[method].kind,
            "sweep_value": value, "seeds": list(seeds), "chosen_lr": lr,
            "val_best_by_lr": {str(k): v for k, v in best_val.items()},
            "test": test, "mean": mean, "bootstrap_ci": [low, high],
            "success": success_count(test, threshold).to_dict(),
            "stopped_at": [r["stopped_at"] for r in chosen],
            "stop_reason": [r["stop_reason"] for r in chosen],
            "chance": chosen[0]["chance"], "params": chosen[0]["params"],
            "train_s": sum(r["train_s"] for lr_runs in by_lr.values()
                           for r in lr_runs.values()),
            "published": published.get(method, {}).get(value),
            "curves": {str(k): {str(s): by_lr[k][s]["curve"] for s in seeds} for k in by_lr},
        }
        for key in ("recall_at_1_exact", "support_mean", "support_informative_mean"):
            if key in chosen[0]["test"]:
                values = [r["test"][key] for r in chosen]
                row[key] = values
                row[key + "_mean"] = sum(values) / len(values)
        out.append(row)
    return out


def comparisons(table_rows, *, treatment="sv"):
    """Paired comparisons (over seeds) of ``treatment`` against every other main row.

    Returns
    -------
    list of dict
        ``{"baseline", "sweep_value", **PairedDifference.to_dict()}`` for every sweep value
        where both rows exist with at least 2 common seeds.
    """
    from svtoolkit.stats import paired_differences

    by = {(r["method"], r["sweep_value"]): r for r in table_rows}
    out = []
    for (method, value), base in by.items():
        if method == treatment or base["kind"] != "main" or (treatment, value) not in by:
            continue
        treat = by[(treatment, value)]
        seeds = [s for s in treat["seeds"] if s in base["seeds"]]
        if len(seeds) < 2:
            continue
        b = [base["test"][base["seeds"].index(s)] for s in seeds]
        t = [treat["test"][treat["seeds"].index(s)] for s in seeds]
        out.append({"baseline": method, "sweep_value": value,
                    **paired_differences(b, t).to_dict()})
    return out


def _published_text(value):
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.2f}"


def markdown(table_rows, comps, *, title, sweep, column, methods, threshold, protocol_text,
             differences, notes, scale):
    """The result table (test recall@1 of the validation-chosen lr) with the published values
    beside, the paired comparisons and every difference from the paper."""
    by = {(r["method"], r["sweep_value"]): r for r in table_rows}
    head = "| method | " + " | ".join(column(v) for v in sweep) + " |"
    lines = [title, "", f"Scale: {scale}.", "", head,
             "|---|" + "---|" * len(sweep)]
    for m in methods:
        label = METHODS[m].label + {"main": "", "ablation": " (ablation)",
                                    "extra": " (extra row)"}[METHODS[m].kind]
        cells = []
        for v in sweep:
            r = by.get((m, v))
            if r is None:
                cells.append("not run yet")
                continue
            s = r["success"]
            cells.append(f"{r['mean']:.3f} [{r['bootstrap_ci'][0]:.2f}, "
                         f"{r['bootstrap_ci'][1]:.2f}]; {s['successes']}/{s['trials']} "
                         f"(pub. {_published_text(r['published'])})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if any("recall_at_1_exact_mean" in by.get((m, v), {}) for v in sweep):
            lines.append(f"| {METHODS[m].label}, exact fp64 gate | " + " | ".join(
                f"{by[(m, v)]['recall_at_1_exact_mean']:.3f}" if (m, v) in by else "-"
                for v in sweep) + " |")
            lines.append(f"| {METHODS[m].label}: mean certified \\|S ∪ E\\| | " + " | ".join(
                f"{by[(m, v)]['support_mean_mean']:.1f}" if (m, v) in by else "-"
                for v in sweep) + " |")
    lines += ["", f"Cells: test recall@1 of the learning rate chosen on validation, mean over "
              f"seeds [95 % percentile-bootstrap interval of the mean]; k/n = seeds with test "
              f"recall@1 >= {threshold:g} (the exact interval of that rate is in the JSON); "
              "pub. = the published value.", "", "Chosen learning rates (validation only): "
              + "; ".join(f"{r['label']} {column(r['sweep_value'])}: {r['chosen_lr']:g}"
                          for r in table_rows), ""]
    if comps:
        lines += ["Paired comparisons over seeds (SV-Attention minus baseline, test recall@1):",
                  "", "| baseline | setting | mean difference | wins/ties of n | paired t p | "
                  "Wilcoxon p |", "|---|---|---|---|---|---|"]
        for c in comps:
            lines.append(f"| {METHODS[c['baseline']].label} | {column(c['sweep_value'])} | "
                         f"{c['mean_difference']:+.3f} | {c['wins']}/{c['ties']} of {c['n']} | "
                         f"{_p(c['t_p'])} | {_p(c['wilcoxon_p'])} |")
        lines.append("")
    lines += ["Protocol (the same for every method): " + protocol_text, "",
              "Differences from the paper:", ""]
    lines += [f"* {d}" for d in differences]
    lines += ["", notes, ""]
    return "\n".join(lines)


def _p(p):
    return "-" if p is None or (isinstance(p, float) and math.isnan(p)) else f"{p:.3g}"


def figures(table_rows, *, sweep, methods, published_numbers, path, curves_path, title,
            xlabel):
    """Test recall@1 against the sweep (``path``) and validation curves of every lr
    (``curves_path``: one panel per sweep value, one colour per method, the chosen lr solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, m in enumerate(methods):
        mine = sorted((r for r in table_rows if r["method"] == m),
                      key=lambda r: sweep.index(r["sweep_value"]))
        if not mine:
            continue
        xs = [sweep.index(r["sweep_value"]) for r in mine]
        ax.errorbar(xs, [r["mean"] for r in mine],
                    yerr=[[r["mean"] - r["bootstrap_ci"][0] for r in mine],
                          [r["bootstrap_ci"][1] - r["mean"] for r in mine]],
                    marker="o", capsize=3, color=f"C{i}", label=METHODS[m].label,
                    ls="-" if METHODS[m].kind == "main" else "--")
        pub = [(sweep.index(v), p) for v, p in published_numbers.get(m, {}).items()
               if v in sweep and isinstance(p, float)]
        if pub:
            ax.plot(*zip(*pub, strict=True), marker="s", mfc="none", ls="none",
                    color=f"C{i}", ms=9)
    ax.plot([], [], marker="s", mfc="none", ls="none", color="0.3", label="published")
    ax.plot([], [], color="0.5", ls=":", label="chance")
    ax.set_xticks(range(len(sweep)), [str(v) for v in sweep])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test recall@1 (chosen lr)")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(sweep), figsize=(4 * len(sweep), 3.6), squeeze=False)
    for ax, v in zip(axes[0], sweep, strict=True):
        for i, m in enumerate(methods):
            row = next((r for r in table_rows if r["method"] == m and r["sweep_value"] == v),
                       None)
            if row is None:
                continue
            for lr, by_seed in row["curves"].items():
                chosen = float(lr) == row["chosen_lr"]
                for s, curve in by_seed.items():
                    ax.plot([p["step"] for p in curve], [p["val"] for p in curve],
                            color=f"C{i}", lw=1.4 if chosen else 0.5,
                            alpha=0.9 if chosen else 0.35,
                            label=METHODS[m].label if chosen and s == str(row["seeds"][0])
                            else None)
        ax.set_title(f"{xlabel} = {v}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("validation recall@1")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    fig.suptitle("validation curves, every lr and seed (chosen lr bold)", fontsize=9)
    fig.tight_layout()
    fig.savefig(curves_path, dpi=110)
    plt.close(fig)
