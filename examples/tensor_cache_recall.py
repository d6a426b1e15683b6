"""Tensor Cache associative recall: answer accuracy, answer NLL and per-sequence streaming
state of five memory layers on store-filler-query episodes (Tensor Cache, §4.3, §4.6, App. B;
Tables 1, 4, 5, 6, 9).

Task: :func:`svtoolkit.tasks.tensor_cache_recall` - ``BOS`` then episodes ``STORE k v``,
``g`` filler tokens, ``QUERY k``; the model must emit ``v`` at the query key. Every gap puts
the store outside the ``W = 12`` window at query time. Scored: the answer position of every
episode; accuracy = arg-max over the vocabulary equals the stored value (chance 1/16), NLL =
mean cross-entropy (nats) at those positions (``log 16 ~ 2.77`` for a uniform guess over the
values).

Rows (Tensor Cache, §4.1): Full KV (causal softmax over everything), Window KV (sliding
window, W = 12), StreamingLLM (4 sinks + W = 12), Infini-attention (segments of 12, linear
memory) and Tensor Cache (W = 12, outer rule, chunk 32, write on eviction). Each is a
:class:`svtoolkit.torch.TinyLM` with that attention in every block; backbone, optimiser,
schedule, data and seeds are shared. Training: :func:`svtoolkit.torch.training.train`, one
fresh sequence per example; evaluation: :func:`svtoolkit.torch.training.evaluate_tokens` on
held-out sequences (:func:`svtoolkit.tasks.heldout_seed`) in ``eval()`` mode, where every
layer runs its inference semantics (the Tensor Cache writes on eviction, per token; the
layers document that this full-sequence forward equals their streaming ``step`` path).
Every number comes from the torch layers.

Per-sequence streaming state (kB = 1024 bytes, the unit the paper's figures imply: its Full-KV
values 398/542/686 are exactly 2048 bytes per token of ``1 + 6 (g + 9)``-token sequences, in
units of 1024 bytes): *counted* from the layers' streaming state
tensors - one held-out sequence is run through every block's ``forward_with_state`` (batch
1) and the bytes of the floating-point tensors of the returned states (KV cache, ring buffer,
fast-weight memory, normaliser) are summed over the blocks; integer bookkeeping (positions,
token counters) is not counted. Full KV's state is its whole cache at the end of the sequence.

Tables (``--table``; default: those that fit the default budget, ``DEFAULT_TABLES``):

* 1 - matched gaps (train and evaluate at the same gap), plus the evaluation filler sweep of
  the gap-24 models (``F_eval``);
* 4 - Tensor Cache chunk size x write rule at gap 24: the exact parallel scan (outer), the
  delta rule with the chunk-start residual, and the chunk-mean shortcut (outer);
* 5 - long gap, single episode, single store (Full KV, Infini-attention, Tensor Cache);
* 6 - multistore (two stored pairs per episode) at gap 24;
* 9 - the write rule (outer, delta, wedge) at gap 24.

Cells that are the same training run in two tables (e.g. the Tensor Cache at gap 24 in
Tables 1, 4 and 9) are trained once. Every finished cell (method x setting x seed) is appended
to ``<out>/tensor_cache_recall<suffix>.cells.jsonl`` as it completes; rerunning skips the cells
already there. Outputs: ``<out>/tensor_cache_recall<suffix>.json`` (configuration, package
versions, rows), ``.md`` (tables with the published numbers beside ours) and ``.png``; the
suffix is ``_quick`` or ``_paper`` for those scales, empty for the default.

Run::

    python examples/tensor_cache_recall.py --quick
    nice -n 10 python examples/tensor_cache_recall.py            # Tables 1 and 4, scaled
    python examples/tensor_cache_recall.py --table 5 6 9 --jobs 2
    python examples/tensor_cache_recall.py --paper --device cuda --dask-scheduler tcp://h:8786
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, experiment_parser  # noqa: E402

from svtoolkit.sweep import cell_key, describe_backend, run_cells  # noqa: E402

#: Window of every bounded method (Tensor Cache, §4.3: W = 12).
WINDOW = 12
#: Row key -> (label, ATTENTION_LAYERS name, attention options).
METHODS = {
    "full_kv": ("Full KV", "softmax", {}),
    "window_kv": ("Window KV", "sliding_window", {"window": WINDOW}),
    "streaming_llm": ("StreamingLLM", "streaming_llm", {"window": WINDOW, "sinks": 4}),
    "infini": ("Infini-attention", "infini", {"segment": WINDOW}),
    "tensor_cache": ("Tensor Cache", "tensor_cache",
                     {"window": WINDOW, "chunk": 32, "rule": "outer"}),
}
#: Tensor Cache training forms of Table 4: key -> (label, option overrides).
TC_FORMS = {
    "outer_scan": ("outer, parallel scan", {"rule": "outer"}),
    "delta_chunk_start": ("delta, chunk-start residual",
                          {"rule": "delta", "delta_residual": "chunk_start"}),
    "outer_chunk_mean": ("outer, chunk-mean shortcut",
                         {"rule": "outer", "write_mode": "chunk_mean"}),
}
#: Write rules of Table 9: key -> option overrides (delta trained as in Table 4).
TC_RULES = {
    "outer": {"rule": "outer"},
    "delta": {"rule": "delta", "delta_residual": "chunk_start"},
    "wedge": {"rule": "wedge"},
}
TABLES = (1, 4, 5, 6, 9)
DEFAULT_TABLES = (1, 4)
LONG_GAP_METHODS = ("full_kv", "infini", "tensor_cache")

#: What the text of Tensor Cache states (§4.3, §4.6, App. B). acc / nll / kB are numbers, or
#: a string where the text gives only a qualitative statement; missing = not in the text.
PUBLISHED = {
    "table1": {
        ("full_kv", 24): {"kB": 398}, ("full_kv", 36): {"kB": 542},
        ("full_kv", 48): {"kB": 686},
        ("tensor_cache", 24): {"acc": "= Full KV", "kB": 112},
        ("tensor_cache", 36): {"acc": "= Full KV", "kB": 112},
        ("tensor_cache", 48): {"acc": "= Full KV", "kB": 112},
        ("window_kv", 24): {"acc": "~0.06"}, ("window_kv", 36): {"acc": "~0.06"},
        ("window_kv", 48): {"acc": "~0.06"},
        ("streaming_llm", 24): {"acc": "~0.06"}, ("streaming_llm", 36): {"acc": "~0.06"},
        ("streaming_llm", 48): {"acc": "~0.06"},
        ("infini", 24): {"acc": 0.396, "kB": 114}, ("infini", 36): {"kB": 114},
        ("infini", 48): {"acc": 0.119, "kB": 114},
    },
    "filler": {
        ("infini", 12): {"acc": 0.046, "nll": 14.3},
        ("tensor_cache", 12): {"acc": 0.254, "nll": 6.4, "kB": 112},
        ("tensor_cache", 192): {"acc": "Full KV - 5 pp", "kB": 112},
        ("full_kv", 12): {"kB": 254}, ("full_kv", 192): {"kB": 2414},
    },
    "table4": {
        **{(form, c): {"acc": 1.0} for form in ("outer_scan", "delta_chunk_start")
           for c in (1, 2, 4, 8, 16, 32)},
        ("outer_chunk_mean", 64): {"acc": 0.265},
    },
    "table5": {
        **{(m, g): {"acc": 1.0} for m in ("full_kv", "infini") for g in (128, 256, 512)},
        ("full_kv", 128): {"acc": 1.0, "kB": 286}, ("full_kv", 512): {"acc": 1.0, "kB": 1054},
        ("infini", 1024): {"acc": "0.872 ± 0.106"},
        **{("tensor_cache", g): {"acc": 1.0, "kB": 112} for g in (128, 256, 512)},
        ("tensor_cache", 1024): {"acc": "0.959 ± 0.058", "kB": 112},
    },
    "table6": {
        ("tensor_cache", 24): {"acc": "0.563 ± 0.003"},
        ("full_kv", 24): {"acc": "0.558 ± 0.004"},
        ("infini", 24): {"acc": "0.464 ± 0.118"},
        ("window_kv", 24): {"acc": "near chance"},
        ("streaming_llm", 24): {"acc": "near chance"},
    },
    "table9": {
        ("outer", 24): {"acc": 0.998, "nll": 0.021},
        ("delta", 24): {"acc": 1.000, "nll": 0.001},
        ("wedge", 24): {"acc": 0.979, "nll": 0.150},
    },
}
PUBLISHED_NOTES = (
    "Published values are those stated in the text of Tensor Cache: Eviction-conditioned "
    "Associative Memory for Transformers (§4.3, §4.6, App. B.1, B.2, B.4); other cells are "
    "not given in the text (-). Its state figures are for its own (larger, unstated) model "
    "and episode layout, so only their trend (Full KV grows with the gap, the bounded "
    "methods stay constant) is comparable, not the kB values."
)

#: Protocols. ``gaps``: Table 1 matched gaps; ``filler``: evaluation filler lengths of the
#: gap-24 models; ``chunks``: Table 4; ``long_gaps``: Table 5. ``paper``: the published gaps,
#: chunk sizes, 300 steps and 3 seeds (App. B.4); the text does not state the backbone, whose
#: 2 layers x d_model 128 are inferred from its Full-KV state (2048 bytes per token in fp32 is
#: n_layers x d_model = 256), and heads, batch, lr and held-out size are choices of ours.
#: ``default``: scaled to about 15-20 minutes on one shared CPU core (docs/experiments.md).
PROTOCOLS = {
    "quick": dict(gaps=(24,), filler=(12, 48), chunks=(8, 64), long_gaps=(128,),
                  d_model=16, n_layers=1, n_heads=2, steps=3, batch_size=4, lr=3e-3,
                  n_heldout=8, seeds=(0,)),
    "default": dict(gaps=(24, 48), filler=(12, 24, 48, 96), chunks=(32, 64),
                    long_gaps=(128, 256), d_model=32, n_layers=2, n_heads=2, steps=300,
                    batch_size=16, lr=3e-3, n_heldout=200, seeds=(0, 1, 2)),
    "paper": dict(gaps=(24, 36, 48), filler=(12, 24, 48, 96, 192),
                  chunks=(1, 2, 4, 8, 16, 32, 64), long_gaps=(128, 256, 512, 1024),
                  d_model=128, n_layers=2, n_heads=4, steps=300, batch_size=32, lr=1e-3,
                  n_heldout=500, seeds=(0, 1, 2)),
}
#: Fixed for every protocol (the toolkit's standard AdamW recipe).
FIXED = dict(weight_decay=0.1, grad_clip=1.0, min_lr_ratio=0.1, warmup_fraction=0.05,
             n_episodes=6)
TRAIN_GAP = 24
#: Bytes per kB in the state column (see the module docstring).
KB = 1024
#: The protocol entries that define one training run (the sweep lists do not belong in a
#: cell, so that a cell is reused by any run that contains it).
TRAINING_KEYS = ("d_model", "n_layers", "n_heads", "steps", "batch_size", "lr", "n_heldout")


def options_of(method, overrides=None):
    """Attention options of a row: the method's, updated by ``overrides`` (Tensor Cache)."""
    return {**METHODS[method][2], **(overrides or {})}


def sequence_length(variant, gap):
    """Tokens per sequence of a named variant at ``gap`` (see the task's docstring)."""
    if variant == "long_gap":
        return 1 + gap + 6
    stores = 2 if variant == "multistore" else 1
    return 1 + FIXED["n_episodes"] * (3 * stores + gap + 3)


def filler_evals(fillers, train_length):
    """Evaluation sets of the filler sweep that fit the trained positions.

    TinyLM's positions are learned, so a sequence longer than the training one would read
    untrained position embeddings; each ``F_eval`` keeps as many of the six episodes as fit
    in the training length (fewer for long fillers) and is dropped if not even one fits.
    """
    evals = []
    for f in fillers:
        episodes = min(FIXED["n_episodes"], (train_length - 1) // (f + 6))
        if episodes >= 1:
            evals.append({"name": f"filler_{f}", "variant": "filler_sweep", "gap": f,
                          "n_episodes": episodes})
    return evals


def setting(method, variant, gap, overrides, protocol, args):
    """One cell's setting; the gap-24 matched cells also score the filler sweep."""
    evals = [{"name": "main", "variant": variant, "gap": gap}]
    if variant == "matched" and gap == TRAIN_GAP:
        evals += filler_evals(protocol["filler"], sequence_length(variant, gap))
    return {"method": method, "setting": {
        "variant": variant, "gap": gap, "attn_options": options_of(method, overrides),
        "evals": evals, "protocol": {k: protocol[k] for k in TRAINING_KEYS},
        "device": args.device, "threads": args.threads}}


def table_specs(table, protocol, args):
    """Rows of one table: ``[(row key, x, cell without seed, eval name)]``."""
    specs = []
    if table == 1:
        for m in METHODS:
            for g in protocol["gaps"]:
                specs.append((m, g, setting(m, "matched", g, None, protocol, args), "main"))
    elif table == "filler":
        base = {m: setting(m, "matched", TRAIN_GAP, None, protocol, args) for m in METHODS}
        for m in METHODS:
            for e in base[m]["setting"]["evals"][1:]:
                specs.append((m, e["gap"], base[m], e["name"]))
    elif table == 4:
        for form, (_, over) in TC_FORMS.items():
            for c in protocol["chunks"]:
                cell = setting("tensor_cache", "matched", TRAIN_GAP, {**over, "chunk": c},
                               protocol, args)
                specs.append((form, c, cell, "main"))
    elif table == 5:
        for m in LONG_GAP_METHODS:
            for g in protocol["long_gaps"]:
                specs.append((m, g, setting(m, "long_gap", g, None, protocol, args), "main"))
    elif table == 6:
        for m in METHODS:
            specs.append((m, TRAIN_GAP, setting(m, "multistore", TRAIN_GAP, None, protocol,
                                                args), "main"))
    elif table == 9:
        for rule, over in TC_RULES.items():
            specs.append((rule, TRAIN_GAP, setting("tensor_cache", "matched", TRAIN_GAP, over,
                                                   protocol, args), "main"))
    return specs


# ------------------------------------------------------------------------------ one cell
def _float_bytes(obj):
    """Bytes of the floating-point tensors in a (nested) streaming state."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.is_floating_point() else 0
    if dataclasses.is_dataclass(obj):
        return sum(_float_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(_float_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_float_bytes(x) for x in obj.values())
    return 0


def streaming_state_bytes(model, tokens):
    """Streaming-state bytes after one sequence, summed over the blocks.

    Parameters
    ----------
    model : TinyLM
    tokens : LongTensor of shape (1, L)

    Returns
    -------
    int
        Bytes of the floating-point tensors of every block's ``forward_with_state`` state.
    """
    import torch

    was_training = model.training
    model.eval()
    total = 0
    with torch.no_grad():
        x = model.tok_emb(tokens) + model.pos_emb(torch.arange(tokens.shape[1],
                                                               device=tokens.device))
        for block in model.blocks:
            y, state = block.attn.forward_with_state(block.ln_1(x))
            total += _float_bytes(state)
            x = x + y
            x = x + block.mlp(block.ln_2(x))
    model.train(was_training)
    return total


def _task(spec, n, seed):
    from svtoolkit.tasks import tensor_cache_recall

    extra = {"n_episodes": spec["n_episodes"]} if "n_episodes" in spec else {}
    return tensor_cache_recall(n, variant=spec["variant"], gap=spec["gap"], seed=seed,
                               **extra)


def run_cell(cell):
    """Train one (method, setting, seed) cell and score it on every evaluation set.

    ``cell = {"method": key of METHODS, "setting": {"variant", "gap", "attn_options",
    "evals", "protocol", "device", "threads"}, "seed": int}``; returns a JSON-serialisable
    dict with one entry per evaluation set (accuracy, NLL, state bytes).
    """
    import torch

    from svtoolkit.tasks import heldout_seed
    from svtoolkit.torch import TinyLM
    from svtoolkit.torch.threads import set_threads
    from svtoolkit.torch.training import TrainConfig, evaluate_tokens, seed_everything, train

    s, seed = cell["setting"], cell["seed"]
    protocol = s["protocol"]
    set_threads(s["threads"])
    n_train = protocol["steps"] * protocol["batch_size"]
    train_task = _task({"variant": s["variant"], "gap": s["gap"]}, n_train, seed)
    seed_everything(seed)
    model = TinyLM(train_task.vocab_size, protocol["d_model"], protocol["n_layers"],
                   protocol["n_heads"], train_task.inputs.shape[1],
                   attn=METHODS[cell["method"]][1], attn_options=dict(s["attn_options"]))
    config = TrainConfig(
        steps=protocol["steps"], batch_size=protocol["batch_size"], lr=protocol["lr"],
        min_lr_ratio=FIXED["min_lr_ratio"],
        warmup_steps=max(1, int(FIXED["warmup_fraction"] * protocol["steps"])),
        weight_decay=FIXED["weight_decay"], grad_clip=FIXED["grad_clip"], seed=seed,
        device=s["device"])
    start = time.perf_counter()
    result = train(model, (torch.from_numpy(train_task.inputs),
                           torch.from_numpy(train_task.targets)), config)
    train_s = time.perf_counter() - start
    scores = {}
    for spec in s["evals"]:
        task = _task(spec, protocol["n_heldout"], heldout_seed(seed))
        inputs = torch.from_numpy(task.inputs)
        got = evaluate_tokens(model, inputs, torch.from_numpy(task.targets))
        first = inputs[:1].to(next(model.parameters()).device)
        scores[spec["name"]] = {
            "accuracy": got["accuracy"], "nll": got["loss"], "scored": got["scored"],
            "length": int(inputs.shape[1]), "n_episodes": task.config["n_episodes"],
            "state_bytes": streaming_state_bytes(model, first)}
    return {"evals": scores, "chance": train_task.chance, "train_length":
            int(train_task.inputs.shape[1]), "final_train_loss":
            float(np.mean(result.losses[-10:])), "params": model.num_params(),
            "train_s": train_s, "step_time_median_s": result.step_time["median"],
            "device": result.device}


# ------------------------------------------------------------------------------ outputs
def _stats(values):
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(table_name, specs, seeds, results_by_key):
    """One row per (row key, x): per-seed and mean / std accuracy, NLL and state kB."""
    rows = []
    published = PUBLISHED[table_name]
    for key, x, cell, eval_name in specs:
        got = [(seed, results_by_key[cell_key({**cell, "seed": seed})]) for seed in seeds]
        scores = [r["evals"][eval_name] for _, r in got]
        acc, nll = [e["accuracy"] for e in scores], [e["nll"] for e in scores]
        kb = [e["state_bytes"] / KB for e in scores]
        (acc_m, acc_s), (nll_m, nll_s), (kb_m, kb_s) = _stats(acc), _stats(nll), _stats(kb)
        rows.append({
            "table": table_name, "row": key, "x": x, "method": cell["method"],
            "attn": METHODS[cell["method"]][1], "attn_options": cell["setting"]["attn_options"],
            "variant": cell["setting"]["variant"], "train_gap": cell["setting"]["gap"],
            "eval": eval_name, "eval_length": scores[0]["length"],
            "eval_episodes": scores[0]["n_episodes"], "seeds": list(seeds),
            "accuracy": acc, "accuracy_mean": acc_m, "accuracy_std": acc_s,
            "nll": nll, "nll_mean": nll_m, "nll_std": nll_s,
            "state_kB": kb_m, "state_kB_std": kb_s, "chance": got[0][1]["chance"],
            "params": got[0][1]["params"],
            "train_s_mean": statistics.fmean(r["train_s"] for _, r in got),
            "published": published.get((key, x))})
    return rows


TITLES = {
    "table1": ("Table 1: matched-gap recall", "gap"),
    "filler": ("Table 1 (OOD): evaluation filler sweep, models trained at gap 24", "F_eval"),
    "table4": ("Table 4: Tensor Cache chunk size x training form (gap 24)", "chunk C"),
    "table5": ("Table 5: long gap, single episode, single store", "gap"),
    "table6": ("Table 6: multistore (two stored pairs per episode), gap 24", "gap"),
    "table9": ("Table 9: Tensor Cache write rule (gap 24)", "gap"),
}


def row_label(table_name, key):
    if table_name == "table4":
        return TC_FORMS[key][0]
    if table_name == "table9":
        return f"Tensor Cache, {key}"
    return METHODS[key][0]


def _pub(published, field):
    value = (published or {}).get(field)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.3f}" if field == "acc" else f"{value:g}"


def markdown_table(table_name, rows):
    title, x_name = TITLES[table_name]
    xs = sorted({r["x"] for r in rows})
    by = {(r["row"], r["x"]): r for r in rows}
    keys = list(dict.fromkeys(r["row"] for r in rows))
    lines = [f"## {title}", "",
             "| row | " + x_name + " | accuracy (published) | answer NLL (published) | "
             "state kB (published) |", "|---|---:|---:|---:|---:|"]
    for key in keys:
        for x in xs:
            r = by.get((key, x))
            if r is None:
                continue
            pub = r["published"]
            lines.append(
                f"| {row_label(table_name, key)} | {x} | {r['accuracy_mean']:.3f} ± "
                f"{r['accuracy_std']:.3f} ({_pub(pub, 'acc')}) | {r['nll_mean']:.3f} ± "
                f"{r['nll_std']:.3f} ({_pub(pub, 'nll')}) | {r['state_kB']:.2f} "
                f"({_pub(pub, 'kB')}) |")
    if table_name == "filler" and rows:
        lengths = sorted({(r["x"], r["eval_episodes"], r["eval_length"]) for r in rows})
        lines += ["", "Episodes / tokens per evaluation sequence: " + ", ".join(
            f"F_eval {x}: {e} / {n}" for x, e, n in lengths) + "."]
    return "\n".join(lines) + "\n"


def markdown(tables, scale_line):
    chance = next(r["chance"] for rows in tables.values() for r in rows)
    parts = ["# Tensor Cache associative recall (Tensor Cache, Tables 1, 4, 5, 6, 9)", "",
             f"Mean ± std over seeds of the answer accuracy (chance {chance:.4f}) and the "
             f"answer NLL (nats; uniform over the values: {math.log(1 / chance):.2f}); "
             "per-sequence streaming state in kB (1024 bytes), counted from the layers' "
             f"state tensors. {scale_line}", ""]
    for name, rows in tables.items():
        parts.append(markdown_table(name, rows))
    parts.append(PUBLISHED_NOTES + "\n")
    return "\n".join(parts)


def figure(tables, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(tables)
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        rows = tables[name]
        for j, key in enumerate(dict.fromkeys(r["row"] for r in rows)):
            i = list(METHODS).index(key) if key in METHODS else j  # one colour per method
            mine = sorted((r for r in rows if r["row"] == key), key=lambda r: r["x"])
            ax.errorbar([str(r["x"]) for r in mine], [r["accuracy_mean"] for r in mine],
                        yerr=[r["accuracy_std"] for r in mine], marker="o", capsize=3,
                        color=f"C{i}", label=row_label(name, key))
            pub = [(str(r["x"]), r["published"]["acc"]) for r in mine
                   if r["published"] and isinstance(r["published"].get("acc"), float)]
            if pub:
                ax.plot(*zip(*pub, strict=True), marker="s", mfc="none", ls="none",
                        color=f"C{i}", ms=9)
        ax.axhline(rows[0]["chance"], color="0.5", lw=0.8, ls=":")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel(TITLES[name][1])
        ax.set_ylabel("answer accuracy")
        ax.set_title(TITLES[name][0], fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title + " (squares: published, dotted: chance)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = experiment_parser(__doc__, default_seeds=list(PROTOCOLS["default"]["seeds"]))
    parser.add_argument("--table", type=int, nargs="+", choices=list(TABLES), default=None,
                        help=f"tables to run (default: {list(DEFAULT_TABLES)}; all with "
                        "--quick)")
    return parser.parse_args(argv)


def table_names(tables):
    names = []
    for t in tables:
        names.append(f"table{t}")
        if t == 1:
            names.append("filler")
    return names


def main(argv=None):
    args = parse_args(argv)
    scale = "quick" if args.quick else "paper" if args.paper else "default"
    protocol = dict(PROTOCOLS[scale])
    seeds = tuple(args.seeds) if args.seeds else protocol["seeds"]
    tables = tuple(args.table) if args.table else (TABLES if args.quick else DEFAULT_TABLES)
    names = table_names(sorted(set(tables)))
    specs = {n: table_specs(int(n[5:]) if n != "filler" else "filler", protocol, args)
             for n in names}
    cells, seen = [], set()
    for spec in specs.values():
        for _, _, cell, _ in spec:
            for seed in seeds:
                full = {**cell, "seed": int(seed)}
                if cell_key(full) not in seen:
                    seen.add(cell_key(full))
                    cells.append(full)
    suffix = "" if scale == "default" else f"_{scale}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"tensor_cache_recall{suffix}"
    start = time.perf_counter()
    results = run_cells(run_cell, cells, results=stem.with_suffix(".cells.jsonl"),
                        jobs=args.jobs, dask_scheduler=args.dask_scheduler,
                        progress=not args.no_progress, desc=f"tensor cache recall ({scale})")
    by_key = {cell_key(c): r for c, r in zip(cells, results, strict=True)}
    out_tables = {n: summarise(n, specs[n], seeds, by_key) for n in names}
    p = protocol
    scale_line = (f"Scale '{scale}': TinyLM d_model {p['d_model']}, {p['n_layers']} layers, "
                  f"{p['n_heads']} heads, {p['steps']} steps x batch {p['batch_size']}, lr "
                  f"{p['lr']}, {p['n_heldout']} held-out sequences, seeds {list(seeds)}; "
                  f"torch layers on {args.device}.")
    payload = {"experiment": "tensor_cache_recall", "scale": scale, "tables": list(names),
               "protocol": {k: v for k, v in protocol.items() if k != "seeds"},
               "fixed": FIXED, "window": WINDOW, "seeds": list(seeds),
               "methods": {k: {"label": v[0], "attn": v[1], "attn_options": v[2]}
                           for k, v in METHODS.items()},
               "state_count": "bytes of the floating-point tensors of every block's "
                              "forward_with_state state after one held-out sequence "
                              "(batch 1), summed over blocks; kB = 1024 bytes",
               "backend": describe_backend(args.jobs, args.dask_scheduler),
               "cells": len(cells), "wall_s_this_call": time.perf_counter() - start,
               "scale_note": scale_line, "published_note": PUBLISHED_NOTES,
               "rows": [r for rows in out_tables.values() for r in rows],
               "environment": environment()}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    text = markdown(out_tables, scale_line)
    stem.with_suffix(".md").write_text(text)
    figure(out_tables, stem.with_suffix(".png"), f"Tensor Cache recall ({scale} scale)")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
