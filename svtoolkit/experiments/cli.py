"""The shared command line and driver of the synthetic studies.

A study script defines one :class:`Study` (its task, sweep, model and protocol per scale,
rows and published values) and calls :func:`main`. Every script takes the same flags:
``--quick`` (seconds; the tests use it), the default (scaled to a 2-core CPU), ``--paper``
(the published sweep; prints its estimated cost first), ``--out DIR``, ``--jobs N``,
``--device {cpu,cuda}``, ``--seeds``, ``--methods``, ``--no-progress``. ``--help`` imports
neither torch nor matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .methods import METHODS, layer_options

__all__ = ["DEFAULT_OUT", "Study", "build_cells", "estimate_cost", "main", "parser", "refused",
           "scale_of"]

#: Where results go without ``--out`` (relative to the working directory, outside the
#: source tree).
DEFAULT_OUT = Path("svtoolkit-results")
SCALES = ("quick", "default", "paper")
#: The JSON and the table are rewritten after every finished cell, the figures at most this
#: often (and at the end).
FIGURE_INTERVAL_S = 60.0


@dataclass(frozen=True)
class Study:
    """One synthetic study (a table of the paper).

    Attributes
    ----------
    name : str
        File stem of the outputs.
    title : str
        Markdown heading.
    kind : {"vector", "token"}
    generator : str
        Task generator in :mod:`svtoolkit.tasks`.
    task : dict
        Fixed task parameters (per scale: ``{scale: dict}``).
    sweep_key : str
        The task parameter swept (``"n_filler"``).
    sweep : dict
        ``{scale: tuple of values}``.
    model : dict
        ``{scale: dict}`` (``d_model``, ``n_heads``, ...).
    protocol : dict
        ``{scale: Protocol}``.
    seeds : dict
        ``{scale: tuple of int}``.
    methods : tuple of str
        Keys of :data:`svtoolkit.experiments.methods.METHODS`, in table order.
    threshold : float
        The success level of the per-seed test recall@1.
    column : callable
        Sweep value -> column label.
    xlabel : str
    published : dict
        ``{method: {sweep value: value or text}}``.
    published_notes : str
    differences : tuple of str
        Every protocol difference from the paper (shared by the scales).
    scale_differences : dict
        ``{scale: tuple of str}``.
    chunk : callable
        ``chunk(task parameters, model) -> int``: the SV block gate (the context length for
        the continuous tasks, so the queries read one gate fit on the whole context).
    """

    name: str
    title: str
    kind: str
    generator: str
    task: dict
    sweep_key: str
    sweep: dict
    model: dict
    protocol: dict
    seeds: dict
    methods: tuple
    threshold: float
    column: object
    xlabel: str
    published: dict
    published_notes: str
    differences: tuple
    scale_differences: dict
    chunk: object
    extra: dict = field(default_factory=dict)


def parser(doc, methods):
    """The shared command line of a study script (``methods``: the rows ``--methods`` may
    name)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true",
                       help="a pipeline check in seconds (the numbers mean nothing)")
    scale.add_argument("--paper", action="store_true",
                       help="the published sweep; prints its estimated cost before it starts")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results directory (default: ./{DEFAULT_OUT})")
    p.add_argument("--jobs", type=int, default=1,
                   help="cells in parallel on a joblib pool (each cell runs on one thread)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the torch layers run (cuda: refused when no CUDA device is "
                        "present; the exact fp64 gate stays on the CPU)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="training seeds (default: the scale's)")
    p.add_argument("--methods", nargs="+", default=None, choices=list(methods),
                   help="rows (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def scale_of(args):
    """The scale the parsed flags select: "quick", "default" or "paper"."""
    return "quick" if args.quick else "paper" if args.paper else "default"


def refused(args):
    """Why the parsed flags cannot run (``--jobs`` below 1, ``--device cuda`` without a CUDA
    device), printed to stderr, as the exit status 2; None when they can. Imports torch only
    for ``--device cuda``."""
    if args.jobs < 1:
        print(f"--jobs must be >= 1; got {args.jobs}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is available (torch.cuda.is_available() is "
                  "False); nothing was run", file=sys.stderr)
            return 2
    return None


def build_cells(study, scale, *, methods, seeds, device):
    """Every (sweep value, method, seed, lr) cell of one scale, the slowest-varying first."""
    protocol = study.protocol[scale]
    model = study.model[scale]
    cells = []
    for value in study.sweep[scale]:
        task = {"generator": study.generator, **study.task[scale], study.sweep_key: value}
        chunk = study.chunk(task, model)
        for method in methods:
            for seed in seeds:
                for lr in protocol.lr_grid:
                    cells.append({
                        "study": study.kind, "task": task, "model": model, "method": method,
                        "layer": METHODS[method].layer,
                        "options": layer_options(method, chunk),
                        "protocol": protocol.to_dict(), "lr": lr, "seed": int(seed),
                        "device": device, "sweep_value": value})
    return cells


def estimate_cost(cells, *, probe_steps=3, jobs=1, probe=None):
    """Seconds the cells would take at the step cap, from step times measured now.

    For every (method, sweep value) one cell is trained for ``probe_steps`` steps after a
    warm-up step; a cell's cost is ``max_steps`` steps plus its validation passes (a forward
    over ``n_validation`` instances, about a third of a training step per batch). Returns
    ``{"total_s", "wall_s" (total / jobs), "per_cell_s": {...}}``; runs stopped by the
    plateau rule cost less. ``probe(cell, steps) -> seconds per step`` defaults to
    :func:`svtoolkit.experiments.engine.probe_step_time` (the synthetic studies' cells).
    """
    if probe is None:
        from .engine import probe_step_time as probe

    per = {}
    for cell in cells:
        key = f"{cell['method']}@{cell['sweep_value']}"
        if key not in per:
            step = probe(cell, probe_steps)
            p = cell["protocol"]
            evals = math.ceil(p["max_steps"] / p["eval_interval"])
            per[key] = step * (p["max_steps"] + evals * p["n_validation"] / p["batch_size"] / 3)
    total = sum(per[f"{c['method']}@{c['sweep_value']}"] for c in cells)
    return {"total_s": total, "wall_s": total / max(1, jobs), "per_cell_s": per}


def main(studies, doc, argv=None):
    """Run one study (or several in turn, e.g. two forms of a task) from the command line.

    Parameters
    ----------
    studies : Study or sequence of Study
    doc : str
        The script's docstring (``--help``).
    argv : list of str, optional

    Returns
    -------
    int
        The exit status (2 for a refused command: nothing is run).
    """
    studies = (studies,) if isinstance(studies, Study) else tuple(studies)
    all_methods = tuple(dict.fromkeys(m for s in studies for m in s.methods))
    args = parser(doc, all_methods).parse_args(argv)
    scale = scale_of(args)
    status = refused(args)
    if status is not None:
        return status
    plans = []
    for study in studies:
        methods = [m for m in (args.methods or study.methods) if m in study.methods]
        if not methods:
            continue
        seeds = tuple(args.seeds) if args.seeds else study.seeds[scale]
        cells = build_cells(study, scale, methods=methods, seeds=seeds, device=args.device)
        plans.append((study, cells, methods, seeds))
    if scale == "paper":
        for study, cells, _, _ in plans:
            cost = estimate_cost(cells, jobs=args.jobs)
            print(f"{study.name} --paper: {len(cells)} cells; estimated at most "
                  f"{cost['total_s'] / 3600:.1f} CPU-hours at the step cap, about "
                  f"{cost['wall_s'] / 3600:.1f} h with --jobs {args.jobs} (from step times "
                  "measured now; the plateau rule stops most runs earlier)", flush=True)
    for study, cells, methods, seeds in plans:
        _run(study, scale, args, cells, methods, seeds)
    return 0


def _run(study, scale, args, cells, methods, seeds):
    from svtoolkit.sweep import cell_key, run_cells

    from . import summary
    from .engine import run_cell
    from .record import run_record

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (study.name + ("" if scale == "default" else f"_{scale}"))
    protocol = study.protocol[scale]
    sweep = [v for v in study.sweep[scale]]
    config = {"study": study.name, "scale": scale, "kind": study.kind,
              "generator": study.generator, "task": study.task[scale],
              "sweep_key": study.sweep_key, "sweep": sweep, "model": study.model[scale],
              "protocol": protocol.to_dict(), "seeds": list(seeds), "methods": methods,
              "method_options": {m: cells_options(cells, m) for m in methods},
              "threshold": study.threshold, "device": args.device}
    keys = [cell_key(c) for c in cells]
    # taken once, before any cell: the code that runs is the code of this moment, whatever
    # the checkout becomes while the cells run
    record = run_record(config, jobs=args.jobs)
    start = time.perf_counter()
    drawn = [-math.inf]  # when the figures were last drawn

    def write(done, final=False):
        results = [done.get(k) for k in keys]
        table_rows = summary.rows(cells, results, seeds=seeds, threshold=study.threshold,
                                  published=study.published)
        comps = summary.comparisons(table_rows)
        differences = [*study.differences, *study.scale_differences[scale]]
        payload = {"experiment": study.name, "scale": scale,
                   "cells_done": sum(r is not None for r in results), "cells": len(cells),
                   "wall_s_this_call": time.perf_counter() - start,
                   "record": record,
                   "protocol_text": protocol.describe(), "published": _jsonable(study.published),
                   "published_note": study.published_notes,
                   "differences_from_paper": differences, "rows": table_rows,
                   "comparisons": comps}
        stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        table = summary.markdown(
            table_rows, comps, title=study.title, sweep=sweep, column=study.column,
            methods=methods, threshold=study.threshold, protocol_text=protocol.describe(),
            differences=differences, notes=study.published_notes,
            scale=f"{scale} ({payload['cells_done']} of {len(cells)} cells done)")
        stem.with_suffix(".md").write_text(table)
        if not final and time.perf_counter() - drawn[0] < FIGURE_INTERVAL_S:
            return table
        drawn[0] = time.perf_counter()
        summary.figures(table_rows, sweep=sweep, methods=methods,
                        published_numbers=study.published, path=stem.with_suffix(".png"),
                        curves_path=Path(f"{stem}_curves.png"),
                        title=f"{study.title.lstrip('# ')} ({scale})", xlabel=study.xlabel)
        return table

    results = run_cells(run_cell, cells, results=stem.with_suffix(".cells.jsonl"),
                        jobs=args.jobs, progress=not args.no_progress,
                        desc=f"{study.name} ({scale})", on_result=write)
    table = write(dict(zip(keys, results, strict=True)), final=True)
    print(table)
    print(f"results: {stem}.json, .md, .png, _curves.png (cells in {stem}.cells.jsonl)")
    return 0


def cells_options(cells, method):
    """The layer options of ``method``'s cells (the first sweep value's)."""
    return next(c["options"] for c in cells if c["method"] == method)


def _jsonable(published):
    return {m: {str(k): v for k, v in d.items()} for m, d in published.items()}
