"""Multi-query associative recall (MQAR): recall@1 of every memory layer as the number of
distinct key-value pairs grows (Forgetful Attention (arXiv:2607.12204), §5, Table 2).

Task: Zoology's token MQAR (Arora et al., "Zoology: Measuring and Improving Recall in
Efficient Language Models", ICLR 2024) from :func:`svtoolkit.tasks.mqar` - ``n`` distinct
key-value pairs, then 8 queries of distinct context keys among random fill tokens; the model
reads a query key and must emit its value. recall@1 = the fraction of the 8 x 400 held-out
queries whose arg-max logit is the bound value (chance: one over the value alphabet).

Model: :class:`svtoolkit.torch.TinyLM` (token + learned positional embeddings, pre-norm
blocks, weight-tied head) with one attention layer of
:data:`svtoolkit.torch.ATTENTION_LAYERS` per block; every row of the table shares the
backbone, optimiser, schedule, data and seeds, and differs only in the attention. Training:
:func:`svtoolkit.torch.training.train` (AdamW 0.9/0.95, weight decay 0.1, clip 1.0, warm-up +
cosine), one fresh training sequence per example (no repetition), then one evaluation on 400
held-out sequences (:func:`svtoolkit.tasks.heldout_seed`) after the last step. The SV rows
train on the batched path (FISTA partition finder + ridged bordered solve, torch autograd);
every number here comes from that torch training path.

Rows: SV-Attention (``sv``, the chunk-frozen RBF readout), its gate-off ablation "SV (no
gate)" (the same layer with ``gate="uniform"``: every prefix key at weight 1, same readout),
softmax, DeltaNet, linear attention, plus Gated DeltaNet, Tensor Cache and the SV hybrid as
extra rows.

Scales (``docs/experiments.md`` lists every difference from the paper):

* ``--quick`` - a pipeline check (seconds per cell; the numbers mean nothing);
* default - the protocol scaled to a 2-core CPU (see ``PROTOCOLS["default"]``);
* ``--paper`` - the published backbone and optimiser (3.22M configuration) with the steps,
  seeds and data sizes the paper does not state chosen as in ``PROTOCOLS["paper"]``.

Every finished cell (method x pairs x seed) is appended to ``<out>/mqar<suffix>.cells.jsonl``
as it completes; rerunning the same command skips the cells already there, so an interrupted
sweep resumes. Outputs: ``<out>/mqar<suffix>.json`` (configuration, package versions, rows),
``.md`` (table with the published numbers) and ``.png``; the suffix is ``_quick`` or
``_paper`` for those scales, empty for the default.

Run::

    python examples/mqar.py --quick
    nice -n 10 python examples/mqar.py                 # the scaled protocol, resumable
    python examples/mqar.py --jobs 2                   # cells on a joblib pool
    python examples/mqar.py --dask-scheduler tcp://host:8786 --paper --device cuda
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, experiment_parser  # noqa: E402

from svtoolkit.sweep import describe_backend, grid, run_cells  # noqa: E402

#: Table rows: key -> (label, ATTENTION_LAYERS name, extra row?). Order of the table.
METHODS = {
    "sv": ("SV-Attention", "sv", False),
    "sv_no_gate": ("SV (no gate)", "sv", False),
    "softmax": ("softmax", "softmax", False),
    "deltanet": ("DeltaNet", "deltanet", False),
    "linear": ("linear attention", "linear", False),
    "gated_deltanet": ("Gated DeltaNet", "gated_deltanet", True),
    "tensor_cache": ("Tensor Cache", "tensor_cache", True),
    "sv_hybrid": ("SV hybrid", "sv_hybrid", True),
}

#: What the paper's text states for Table 2 (Forgetful Attention, §5): recall@1 by number of
#: pairs where a cell is named; "chance" where the text says the row collapses to chance.
PUBLISHED = {
    "sv": {64: 0.88},
    "sv_no_gate": {64: 0.99},
    "softmax": {8: 0.87, 64: 0.14},
    "deltanet": {64: "chance"},
    "linear": {64: "chance"},
}
PUBLISHED_NOTES = (
    "Published values are those stated in the text of Forgetful Attention (arXiv:2607.12204), "
    "§5: the distance-kernel readout holds recall@1 at 0.96-0.99, softmax decays from 0.87 to "
    "0.14 (8 to 64 pairs), DeltaNet and linear attention collapse to chance, and at 64 items "
    "the gate-off ablation reaches 0.99 vs 0.88 for SV-Attention. Other cells are not given "
    "in the text (-). The paper trains on the continuous (vector) form of MQAR; these rows are "
    "the token form, so the comparison is of trends, not of values."
)

#: Protocols. ``pairs``: the Table 2 sweep (or a subset); ``n_queries`` 8 and 400 held-out
#: sequences as published. ``chunk`` is the SV chunk (and the chunk of the chunked scans);
#: ``window`` the Tensor Cache window. Every sequence is ``seq_len`` tokens whatever the pairs.
PROTOCOLS = {
    "quick": dict(pairs=(4, 8), n_queries=2, n_heldout=16, vocab_size=32, seq_len=32,
                  d_model=16, n_layers=1, n_heads=2, chunk=8, window=8, steps=6,
                  batch_size=8, lr=3e-3, seeds=(0,)),
    "default": dict(pairs=(8, 16, 32), n_queries=8, n_heldout=400, vocab_size=128,
                    seq_len=80, d_model=64, n_layers=2, n_heads=2, chunk=16, window=16,
                    steps=300, batch_size=16, lr=3e-3, seeds=(0, 1, 2)),
    "paper": dict(pairs=(8, 16, 32, 64), n_queries=8, n_heldout=400, vocab_size=8192,
                  seq_len=256, d_model=256, n_layers=4, n_heads=4, chunk=64, window=64,
                  steps=6000, batch_size=16, lr=1e-3, seeds=(0, 1, 2)),
}
#: Fixed for every protocol: the paper's optimiser and SV gate settings.
FIXED = dict(weight_decay=0.1, grad_clip=1.0, min_lr_ratio=0.1, warmup_fraction=0.05, C=0.25,
             fista_iters=80)


#: Options a row adds to its layer's (the gate-off ablation of the SV row).
METHOD_OPTIONS = {"sv_no_gate": {"gate": "uniform"}}


def attn_options(layer, protocol):
    """Options of one attention layer under a protocol (chunk / window as in the protocol)."""
    chunk, window = protocol["chunk"], protocol["window"]
    if layer in ("sv", "sv_hybrid"):
        return {"chunk": chunk, "C": FIXED["C"], "fista_iters": FIXED["fista_iters"]}
    if layer in ("linear", "deltanet", "gated_deltanet"):
        return {"chunk": chunk}
    if layer == "tensor_cache":
        return {"window": window, "chunk": chunk}
    return {}


def run_cell(cell):
    """Train one (method, n_pairs, seed) cell and score it on the held-out sequences.

    ``cell = {"method": key of METHODS, "setting": {"n_pairs": n, "protocol": {...},
    "device": str, "threads": int}, "seed": int}``; returns a JSON-serialisable dict.
    """
    import torch

    from svtoolkit.tasks import heldout_seed, mqar
    from svtoolkit.torch import TinyLM
    from svtoolkit.torch.threads import set_threads
    from svtoolkit.torch.training import TrainConfig, evaluate_tokens, seed_everything, train

    setting, seed = cell["setting"], cell["seed"]
    protocol, n_pairs = setting["protocol"], setting["n_pairs"]
    set_threads(setting["threads"])
    layer = METHODS[cell["method"]][1]
    options = {**attn_options(layer, protocol), **METHOD_OPTIONS.get(cell["method"], {})}
    task_args = dict(n_pairs=n_pairs, n_queries=protocol["n_queries"],
                     vocab_size=protocol["vocab_size"], seq_len=protocol["seq_len"])
    n_train = protocol["steps"] * protocol["batch_size"]
    train_task = mqar(n_train, seed=seed, **task_args)
    heldout = mqar(protocol["n_heldout"], seed=heldout_seed(seed), **task_args)
    seed_everything(seed)
    model = TinyLM(protocol["vocab_size"], protocol["d_model"], protocol["n_layers"],
                   protocol["n_heads"], protocol["seq_len"], attn=layer, attn_options=options)
    config = TrainConfig(
        steps=protocol["steps"], batch_size=protocol["batch_size"], lr=protocol["lr"],
        min_lr_ratio=FIXED["min_lr_ratio"],
        warmup_steps=max(1, int(FIXED["warmup_fraction"] * protocol["steps"])),
        weight_decay=FIXED["weight_decay"], grad_clip=FIXED["grad_clip"], seed=seed,
        device=setting["device"])
    start = time.perf_counter()
    result = train(model, (torch.from_numpy(train_task.inputs),
                           torch.from_numpy(train_task.targets)), config)
    train_s = time.perf_counter() - start
    scores = evaluate_tokens(model, torch.from_numpy(heldout.inputs),
                             torch.from_numpy(heldout.targets))
    return {"recall_at_1": scores["accuracy"], "heldout_loss": scores["loss"],
            "scored_queries": scores["scored"], "chance": heldout.chance,
            "final_train_loss": float(np.mean(result.losses[-10:])),
            "params": model.num_params(), "attn_options": options, "train_s": train_s,
            "step_time_median_s": result.step_time["median"], "device": result.device}


# ------------------------------------------------------------------------------ outputs
def summarise(cells, results, methods, pairs):
    """One row per (method, n_pairs): mean / std / per-seed recall@1 and the published one."""
    rows = []
    for method in methods:
        for n in pairs:
            got = [(c["seed"], r) for c, r in zip(cells, results, strict=True)
                   if c["method"] == method and c["setting"]["n_pairs"] == n]
            if not got:
                continue
            recalls = [r["recall_at_1"] for _, r in got]
            rows.append({
                "method": method, "label": METHODS[method][0], "attn": METHODS[method][1],
                "extra_row": METHODS[method][2], "n_pairs": n, "seeds": [s for s, _ in got],
                "recall_at_1": recalls, "mean": statistics.fmean(recalls),
                "std": statistics.stdev(recalls) if len(recalls) > 1 else 0.0,
                "chance": got[0][1]["chance"], "params": got[0][1]["params"],
                "attn_options": got[0][1]["attn_options"],
                "train_s_mean": statistics.fmean(r["train_s"] for _, r in got),
                "published": PUBLISHED.get(method, {}).get(n)})
    return rows


def _published_text(value):
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.2f}"


def markdown(rows, pairs, scale_line):
    by = {(r["method"], r["n_pairs"]): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    head = "| method | " + " | ".join(f"{n} pairs (published)" for n in pairs) + " |"
    lines = [head, "|---|" + "---:|" * len(pairs)]
    for m in methods:
        cells = []
        for n in pairs:
            r = by.get((m, n))
            ours = "not run" if r is None else (
                f"{r['mean']:.3f} ± {r['std']:.3f}" if len(r["seeds"]) > 1 else f"{r['mean']:.3f}")
            cells.append(f"{ours} ({_published_text(PUBLISHED.get(m, {}).get(n))})")
        label = METHODS[m][0] + (" (extra row)" if METHODS[m][2] else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    chance = rows[0]["chance"] if rows else float("nan")
    lines += ["", f"recall@1 on the held-out queries, mean ± std over seeds; chance "
              f"{chance:.4f} (a uniform guess over the value alphabet; a model that emits one "
              f"of the n context values at random scores 1/n). {scale_line}", "",
              PUBLISHED_NOTES]
    if "sv_no_gate" not in methods:
        lines.append("SV (no gate) is not reported in this run (not among --methods).")
    return "\n".join(lines) + "\n"


def figure(rows, pairs, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, m in enumerate(m for m in METHODS if any(r["method"] == m for r in rows)):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["n_pairs"])
        color = f"C{i}"
        ax.errorbar([r["n_pairs"] for r in mine], [r["mean"] for r in mine],
                    yerr=[r["std"] for r in mine], marker="o", color=color, capsize=3,
                    label=METHODS[m][0], ls="--" if METHODS[m][2] else "-")
        published = [(n, v) for n, v in PUBLISHED.get(m, {}).items() if not isinstance(v, str)]
        if published:
            ax.plot(*zip(*published, strict=True), marker="s", mfc="none", ls="none",
                    color=color, ms=9)
    if rows:
        ax.axhline(rows[0]["chance"], color="0.5", lw=0.8, ls=":", label="chance")
    ax.plot([], [], marker="s", mfc="none", ls="none", color="0.3", label="published (text)")
    ax.set_xscale("log", base=2)
    ticks = sorted({*pairs, *(n for r in rows for n in PUBLISHED.get(r["method"], {}))})
    ax.set_xticks(ticks, [str(n) for n in ticks])
    ax.set_xlabel("distinct key-value pairs")
    ax.set_ylabel("recall@1 (held-out)")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = experiment_parser(__doc__, default_seeds=list(PROTOCOLS["default"]["seeds"]))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--pairs", type=int, nargs="+", default=None,
                        help="numbers of key-value pairs (default: the protocol's)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    scale = "quick" if args.quick else "paper" if args.paper else "default"
    protocol = dict(PROTOCOLS[scale])
    seeds = tuple(args.seeds) if args.seeds else protocol["seeds"]
    pairs = tuple(args.pairs) if args.pairs else protocol["pairs"]
    protocol.pop("seeds")
    protocol.pop("pairs")
    settings = [{"n_pairs": n, "protocol": protocol, "device": args.device,
                 "threads": args.threads} for n in pairs]
    cells = grid(args.methods, settings, seeds)
    suffix = "" if scale == "default" else f"_{scale}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"mqar{suffix}"
    start = time.perf_counter()
    results = run_cells(run_cell, cells, results=stem.with_suffix(".cells.jsonl"),
                        jobs=args.jobs, dask_scheduler=args.dask_scheduler,
                        progress=not args.no_progress, desc=f"mqar ({scale})")
    rows = summarise(cells, results, args.methods, pairs)
    scale_line = (f"Scale '{scale}': TinyLM d_model {protocol['d_model']}, "
                  f"{protocol['n_layers']} layers, {protocol['n_heads']} heads, "
                  f"{protocol['steps']} steps x batch {protocol['batch_size']}, vocabulary "
                  f"{protocol['vocab_size']}, length {protocol['seq_len']}, "
                  f"{protocol['n_heldout']} held-out sequences x {protocol['n_queries']} "
                  f"queries, seeds {list(seeds)}; torch training path on {args.device}.")
    payload = {"experiment": "mqar", "scale": scale, "protocol": protocol, "fixed": FIXED,
               "pairs": list(pairs), "seeds": list(seeds), "methods": args.methods,
               "backend": describe_backend(args.jobs, args.dask_scheduler),
               "wall_s_this_call": time.perf_counter() - start,
               "train_s_all_cells": sum(r["train_s"] for r in results),
               "scale_note": scale_line,
               "published_note": PUBLISHED_NOTES,
               "rows": rows, "environment": environment()}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown(rows, pairs, scale_line)
    stem.with_suffix(".md").write_text("# MQAR recall@1 (Forgetful Attention, Table 2)\n\n"
                                       + table)
    figure(rows, pairs, stem.with_suffix(".png"), f"MQAR recall@1 ({scale} scale)")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
