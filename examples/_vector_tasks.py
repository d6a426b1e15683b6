"""Shared pieces of the two continuous-token experiments (selective copying, capacity).

Forgetful Attention (arXiv:2607.12204), §5, Tables 3 and 5 feed every (key, value) pair to the
sequence model as ONE continuous token ``[key; value]`` (query tokens ``[query; 0]``) and decode
the output at a query to the nearest candidate value. This module holds what both experiments
share:

* :class:`VectorRecallModel` - a linear token embedding, one attention layer of
  :data:`svtoolkit.torch.ATTENTION_LAYERS`, a linear value head;
* :func:`train_vector_model` - the toolkit's one trainer (:func:`svtoolkit.torch.training.train`)
  with a mean-squared-error loss on the query positions in place of the token cross-entropy;
* :func:`score_model` - recall@1 (nearest value) on held-out instances and, for the SV row, the
  certified support size ``|S u E|`` of the exact fp64 gate;
* :func:`summarise`, :func:`markdown`, :func:`figure` - the outputs, in the format of
  ``examples/mqar.py``.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import torch
from torch import nn

from svtoolkit.torch import ATTENTION_LAYERS

#: Table rows: key -> (label, ATTENTION_LAYERS name, extra row?), in table order.
METHODS = {
    "sv": ("SV-Attention", "sv", False),
    "softmax": ("softmax", "softmax", False),
    "deltanet": ("DeltaNet", "deltanet", False),
    "linear": ("linear attention", "linear", False),
    "gated_deltanet": ("Gated DeltaNet", "gated_deltanet", True),
}

#: Fixed for every protocol: the paper's optimiser and SV gate settings (as in
#: ``examples/mqar.py``).
FIXED = dict(weight_decay=0.1, grad_clip=1.0, min_lr_ratio=0.1, warmup_fraction=0.05, C=0.25,
             fista_iters=80)


#: Differences from Forgetful Attention (arXiv:2607.12204), §5, Tables 3 and 5 shared by both
#: experiments (written into their JSON; ``docs/experiments.md`` explains each).
DIFFERENCES = (
    "model: the paper does not state the model of these tables; here a linear token "
    "embedding, ONE attention layer and a linear value head (no MLP, no norm, no residual, no "
    "positional encoding: the tasks are content-addressed)",
    "loss: the paper does not state it; here the mean-squared error of the query outputs "
    "against their values, through a thin loop over the pieces of the toolkit's trainer "
    "(train() takes token batches and cross-entropy only)",
    "steps, batch, learning rate, width and seeds are not stated in the paper; the "
    "protocols' values are choices (the default is scaled to one shared CPU core)",
    "the SV chunk is the context length, so the queries read one gate fit on the whole "
    "context (the block gate); C = 0.25 (the paper's language-model value), sigma = "
    "sqrt(2 D) on RMS-normalised keys, FISTA 80 iterations, ridge 1e-3",
    "SV state = mean over held-out instances and heads of |S u E| (alpha > 0) of the exact "
    "fp64 gate on the trained model's keys; the paper does not say whether its size is per "
    "head or how it averages",
    "state is not matched: each recurrence carries n_heads matrices of head_dim x head_dim "
    "(2 x 16 x 16 in the default), the paper reports a matched-state comparison",
    "one evaluation after the last step (no best-checkpoint selection)",
)

#: Scan block of the chunked recurrences (a speed setting only: their outputs do not depend
#: on it; 32 was the fastest of 16 / 32 / 128 at length 129 on one CPU thread).
RECURRENT_SCAN_CHUNK = 32


def attn_options(layer, context_len):
    """Options of one attention layer; the SV chunk is the context length (see Notes of
    :func:`run_vector_cell`)."""
    if layer in ("sv", "sv_hybrid"):
        return {"chunk": context_len, "C": FIXED["C"], "fista_iters": FIXED["fista_iters"]}
    if layer in ("linear", "deltanet", "gated_deltanet"):
        return {"chunk": RECURRENT_SCAN_CHUNK}
    return {}


class VectorRecallModel(nn.Module):
    """Linear embedding -> one attention layer -> linear value head.

    Parameters
    ----------
    d_in : int
        Token width ``d_key + d_value``.
    d_value : int
        Output width.
    d_model, n_heads : int
        Width and heads of the attention layer.
    attn : str
        Name in :data:`svtoolkit.torch.ATTENTION_LAYERS`.
    attn_options : dict

    Notes
    -----
    ``forward(x)`` maps x (B, T, d_in) to (B, T, d_value); ``forward(x, exact=True)`` runs the
    SV layers' exact fp64 gate (``forward_exact``) instead of the batched one.
    """

    def __init__(self, d_in, d_value, d_model, n_heads, attn, attn_options):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        self.attn = ATTENTION_LAYERS[attn](d_model, n_heads, **attn_options)
        self.head = nn.Linear(d_model, d_value)

    def forward(self, x, exact=False):
        h = self.embed(x)
        y = self.attn.forward_exact(h) if exact else self.attn(h)
        return self.head(y)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())


def build_model(task, protocol, layer, options):
    """A :class:`VectorRecallModel` for ``task`` (a VectorTask) under ``protocol``."""
    d_in = task.inputs.shape[-1]
    return VectorRecallModel(d_in, task.targets.shape[-1], protocol["d_model"],
                             protocol["n_heads"], layer, options)


def train_vector_model(model, task, config, device="cpu"):
    """Train ``model`` on ``task`` with the MSE of the query outputs against the targets.

    The step is the one of :func:`svtoolkit.torch.training.train` (forward, backward, global
    gradient-norm clipping, AdamW with decay on ``ndim >= 2`` parameters, warm-up + cosine
    :func:`~svtoolkit.torch.training.lr_factor`), with this loss in place of cross-entropy.

    Parameters
    ----------
    model : nn.Module
        Maps float32 (B, T, d_in) to (B, T, d_value).
    task : VectorTask
        ``config.steps * config.batch_size`` training instances, each used once in order.
    config : TrainConfig
    device : str or torch.device, default "cpu"
        Where the model and the batches live (the model must already be there).

    Returns
    -------
    dict
        ``losses`` (list of float per step), ``step_time_median_s``, ``wall_s``.

    Raises
    ------
    ValueError
        If the task holds fewer instances than the steps need, or a loss is not finite.
    """
    from svtoolkit.torch.training import train

    need = config.steps * config.batch_size
    if task.inputs.shape[0] < need:
        raise ValueError(f"task must hold steps * batch_size = {need} instances; got "
                         f"{task.inputs.shape[0]}")
    inputs = torch.from_numpy(task.inputs).float()
    targets = torch.from_numpy(task.targets).float()
    qpos = torch.from_numpy(task.query_positions).to(device)

    def batch_at(step):
        rows = slice(step * config.batch_size, (step + 1) * config.batch_size)
        return inputs[rows], targets[rows]

    def query_mse(output, target):
        return torch.nn.functional.mse_loss(output[:, qpos], target)

    config = dataclasses.replace(config, device=torch.device(device).type)
    result = train(model, batch_at, config, loss=query_mse)
    if not all(np.isfinite(result.losses)):
        raise ValueError("the training loss is not finite")
    return {"losses": result.losses, "step_time_median_s": result.step_time["median"],
            "wall_s": result.wall_s}


def _device(model):
    return next(model.parameters()).device


def _outputs(model, task, exact, batch_size=100):
    qpos = torch.from_numpy(task.query_positions)
    outs = []
    model.eval()
    with torch.no_grad():
        for start in range(0, task.inputs.shape[0], batch_size):
            x = torch.from_numpy(task.inputs[start:start + batch_size]).float()
            out = model(x.to(_device(model)), exact=exact).cpu()
            outs.append(out[:, qpos].double().numpy())
    return np.concatenate(outs)


def support_sizes(model, task, batch_size=100):
    """Certified support size ``|S u E|`` of the exact fp64 gate the queries read.

    The queries sit in the chunk after the context (chunk = context length), so they read the
    gate of boundary 0, fit on the whole context. Per instance and head: the number of context
    keys with ``alpha > 0`` (exact fp64 :class:`svtoolkit.IncrementalSVDD` via
    ``CausalSVAttention.gate(..., exact=True)``); an ungated head (warm-up) reads every key.

    Returns
    -------
    support : ndarray of shape (N, H)
    informative : ndarray of shape (N, H)
        How many of those are non-filler tokens (a nonzero value part).
    """
    n_ctx = int(task.query_positions[0])
    informative_tok = np.abs(task.values[:, :n_ctx]).sum(-1) > 0  # (N, n_ctx)
    sizes, info = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, task.inputs.shape[0], batch_size):
            x = torch.from_numpy(task.inputs[start:start + batch_size]).float()
            gate = model.attn.gate(model.embed(x.to(_device(model))), exact=True)
            alpha = gate.alpha[:, :, 0, :n_ctx].cpu().numpy()  # (b, H, n_ctx)
            held = np.where(gate.gated[:, :, 0].cpu().numpy()[..., None], alpha > 0, True)
            sizes.append(held.sum(-1))
            info.append((held & informative_tok[start:start + batch_size, None, :]).sum(-1))
    return np.concatenate(sizes), np.concatenate(info)


def score_model(model, heldout, layer):
    """recall@1 (nearest value) on ``heldout``; for SV also the exact-gate recall and support.

    Returns
    -------
    dict
        ``recall_at_1`` (the path the model trained on: batched gate for SV), ``heldout_mse``;
        for SV layers ``recall_at_1_exact`` (exact fp64 gate), ``support_mean`` (mean over
        instances and heads of the exact ``|S u E|``), ``support_std``,
        ``support_informative_mean`` and ``context_len``.
    """
    from svtoolkit.tasks import nearest_value_accuracy

    out = _outputs(model, heldout, exact=False)
    scores = {"recall_at_1": nearest_value_accuracy(heldout, out),
              "heldout_mse": float(np.mean((out - heldout.targets) ** 2))}
    if layer in ("sv", "sv_hybrid"):
        scores["recall_at_1_exact"] = nearest_value_accuracy(
            heldout, _outputs(model, heldout, exact=True))
        support, informative = support_sizes(model, heldout)
        scores.update(support_mean=float(support.mean()), support_std=float(support.std()),
                      support_informative_mean=float(informative.mean()),
                      context_len=int(heldout.query_positions[0]))
    return scores


def run_vector_cell(cell, make_task):
    """Train and score one (method, setting, seed) cell of a continuous-token experiment.

    Parameters
    ----------
    cell : dict
        ``{"method": key of METHODS, "setting": {"protocol": {...}, "device": str,
        "threads": int, ...task keywords...}, "seed": int}``.
    make_task : callable
        ``make_task(n_examples, setting, seed) -> VectorTask``.

    Returns
    -------
    dict
        JSON-serialisable scores and bookkeeping.

    Notes
    -----
    The SV chunk is the context length, so the SV queries (the last tokens, all in
    the chunk after the context) read the gate fit on the whole context - the block gate the
    paper's tables describe - and no query reads another query through the gate. The exact
    fp64 gate runs in NumPy on the CPU whatever ``setting["device"]`` is.
    """
    from svtoolkit.tasks import heldout_seed
    from svtoolkit.torch.threads import set_threads
    from svtoolkit.torch.training import TrainConfig, resolve_device, seed_everything

    setting, seed = cell["setting"], cell["seed"]
    protocol = setting["protocol"]
    set_threads(setting["threads"])
    device = resolve_device(setting["device"])
    layer = METHODS[cell["method"]][1]
    train_task = make_task(protocol["steps"] * protocol["batch_size"], setting, seed)
    heldout = make_task(protocol["n_heldout"], setting, heldout_seed(seed))
    options = attn_options(layer, int(train_task.query_positions[0]))
    seed_everything(seed)
    model = build_model(train_task, protocol, layer, options).to(device)
    config = TrainConfig(
        steps=protocol["steps"], batch_size=protocol["batch_size"], lr=protocol["lr"],
        min_lr_ratio=FIXED["min_lr_ratio"],
        warmup_steps=max(1, int(FIXED["warmup_fraction"] * protocol["steps"])),
        weight_decay=FIXED["weight_decay"], grad_clip=FIXED["grad_clip"], seed=seed)
    trained = train_vector_model(model, train_task, config, device)
    scores = score_model(model, heldout, layer)
    return {**scores, "chance": heldout.chance,
            "final_train_loss": float(np.mean(trained["losses"][-10:])),
            "params": model.num_params(), "attn_options": options,
            "train_s": trained["wall_s"], "step_time_median_s": trained["step_time_median_s"],
            "device": str(device)}


# ------------------------------------------------------------------------------ outputs
def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(cells, results, methods, sweep_key, sweep, published):
    """One row per (method, sweep value): per-seed values, mean and std, published value."""
    rows = []
    for method in methods:
        for n in sweep:
            got = [(c["seed"], r) for c, r in zip(cells, results, strict=True)
                   if c["method"] == method and c["setting"][sweep_key] == n]
            if not got:
                continue
            row = {"method": method, "label": METHODS[method][0], "attn": METHODS[method][1],
                   "extra_row": METHODS[method][2], sweep_key: n, "seeds": [s for s, _ in got],
                   "chance": got[0][1]["chance"], "params": got[0][1]["params"],
                   "attn_options": got[0][1]["attn_options"],
                   "train_s_mean": statistics.fmean(r["train_s"] for _, r in got)}
            for key in ("recall_at_1", "recall_at_1_exact", "support_mean",
                        "support_informative_mean", "heldout_mse", "final_train_loss"):
                values = [r.get(key) for _, r in got]
                if all(v is None for v in values):
                    continue
                row[key] = values
                row[key + "_mean"], row[key + "_std"] = _mean_std(values)
            row["mean"], row["std"] = row["recall_at_1_mean"], row["recall_at_1_std"]
            pub = published.get(method, {}).get(n, {})
            row["published"] = pub.get("recall")
            row["published_support"] = pub.get("support")
            rows.append(row)
    return rows


def _ms(mean, std, n_seeds, digits=3):
    if mean is None:
        return "-"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if n_seeds > 1 else f"{mean:.{digits}f}"


def _pub(value):
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.2f}"


def markdown(rows, sweep_key, sweep, column, published, notes, scale_line):
    """The recall table (one row per method, SV also on the exact gate) and the SV state row."""
    by = {(r["method"], r[sweep_key]): r for r in rows}
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    lines = ["| method | " + " | ".join(f"{column(n)} (published)" for n in sweep) + " |",
             "|---|" + "---:|" * len(sweep)]

    def line(label, key, pub_key, digits=3, only=None):
        cells = []
        for n in sweep:
            r = by.get((only, n))
            ours = "not run" if r is None else _ms(r.get(key + "_mean"), r.get(key + "_std"),
                                                    len(r["seeds"]), digits)
            cells.append(f"{ours} ({_pub(published.get(only, {}).get(n, {}).get(pub_key))})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for m in methods:
        label = METHODS[m][0] + (" (extra row)" if METHODS[m][2] else "")
        if m == "sv":
            label += ", batched gate"
        line(label, "recall_at_1", "recall", only=m)
        if m == "sv":
            line("SV-Attention, exact fp64 gate", "recall_at_1_exact", "-", only=m)
            line("SV state: mean certified \\|S ∪ E\\| (exact fp64)", "support_mean",
                 "support", digits=1, only=m)
            line("of which informative tokens", "support_informative_mean", "-", digits=1,
                 only=m)
    chance = ", ".join(f"{column(n)}: {by[(methods[0], n)]['chance']:.3f}" for n in sweep
                       if (methods[0], n) in by) if methods else "-"
    lines += ["", "recall@1 (nearest value) on the held-out instances, mean ± std over seeds; "
              f"chance (one over the candidate values) {chance}. {scale_line}", "", notes]
    return "\n".join(lines) + "\n"


def figure(rows, sweep_key, sweep, published, path, title, xlabel):
    """recall@1 per method against the sweep (left) and the SV support size (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for i, m in enumerate(m for m in METHODS if any(r["method"] == m for r in rows)):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r[sweep_key])
        xs = [r[sweep_key] for r in mine]
        color = f"C{i}"
        ax.errorbar(xs, [r["mean"] for r in mine], yerr=[r["std"] for r in mine], marker="o",
                    color=color, capsize=3, label=METHODS[m][0],
                    ls="--" if METHODS[m][2] else "-")
        pub = [(n, v["recall"]) for n, v in published.get(m, {}).items()
               if isinstance(v.get("recall"), float)]
        if pub:
            ax.plot(*zip(*pub, strict=True), marker="s", mfc="none", ls="none", color=color,
                    ms=9)
        if m == "sv":
            ax.errorbar(xs, [r["recall_at_1_exact_mean"] for r in mine],
                        yerr=[r["recall_at_1_exact_std"] for r in mine], marker="^",
                        color=color, ls=":", capsize=3, label="SV-Attention (exact gate)")
            ax2.errorbar(xs, [r["support_mean_mean"] for r in mine],
                         yerr=[r["support_mean_std"] for r in mine], marker="o", color=color,
                         capsize=3, label="mean |S ∪ E| (exact fp64)")
            ax2.plot(xs, [r["attn_options"]["chunk"] for r in mine], color="0.5", ls=":",
                     label="context length")
            pub_s = [(n, v["support"]) for n, v in published.get(m, {}).items()
                     if isinstance(v.get("support"), float)]
            if pub_s:
                ax2.plot(*zip(*pub_s, strict=True), marker="s", mfc="none", ls="none",
                         color=color, ms=9, label="published (text)")
    chance = sorted({(r[sweep_key], r["chance"]) for r in rows})
    if chance:
        ax.plot(*zip(*chance, strict=True), color="0.5", lw=0.8, ls=":", label="chance")
    ax.plot([], [], marker="s", mfc="none", ls="none", color="0.3", label="published (text)")
    for a in (ax, ax2):
        a.set_xlabel(xlabel)
        a.set_xticks(list(sweep), [str(n) for n in sweep])
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("recall@1 (held-out, nearest value)")
    ax.set_ylim(-0.03, 1.03)
    ax2.set_ylabel("SV state (tokens)")
    ax.set_title(title, fontsize=9)
    ax2.set_title("SV-Attention certified support size", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sweep(args, *, experiment, sweep_key, sweep_name, sweep, run_cell, protocols, task,
              published, published_notes, scale_differences, labels):
    """Run one experiment's sweep (method x setting x seed) and write its JSON, table, figure.

    Parameters
    ----------
    args : argparse.Namespace
        From ``experiment_parser`` plus ``--methods`` (the experiment's own sweep option is
        passed as ``sweep``).
    experiment : str
        File stem and the ``experiment`` field of the JSON.
    sweep_key, sweep_name : str
        The cell setting swept (``"n_filler"``) and its name in a protocol and the JSON
        (``"fillers"``).
    sweep : sequence of int or None
        Values given on the command line; None takes the protocol's.
    run_cell : callable
        The experiment's module-level cell function (picklable for joblib and Dask).
    protocols, task, published, published_notes, scale_differences : dict
        The experiment's constants.
    labels : dict
        ``column`` (value -> column label), ``title`` (markdown heading), ``figure_title``,
        ``xlabel``, ``target`` (what the MSE is on) and ``sweep_text`` (value list -> text).
    """
    import json
    import time

    from _common import environment

    from svtoolkit.sweep import describe_backend, grid, run_cells

    scale = "quick" if args.quick else "paper" if args.paper else "default"
    protocol = dict(protocols[scale])
    seeds = tuple(args.seeds) if args.seeds else protocol["seeds"]
    protocol.pop("seeds")
    values = tuple(sweep) if sweep else protocol[sweep_name]
    protocol.pop(sweep_name)
    settings = [{sweep_key: v, "protocol": protocol, "device": args.device,
                 "threads": args.threads} for v in values]
    cells = grid(args.methods, settings, seeds)
    suffix = "" if scale == "default" else f"_{scale}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{experiment}{suffix}"
    start = time.perf_counter()
    results = run_cells(run_cell, cells, results=stem.with_suffix(".cells.jsonl"),
                        jobs=args.jobs, dask_scheduler=args.dask_scheduler,
                        progress=not args.no_progress,
                        desc=f"{experiment.replace('_', ' ')} ({scale})")
    rows = summarise(cells, results, args.methods, sweep_key, values, published)
    scale_line = (f"Scale '{scale}': embedding + one attention layer (d_model "
                  f"{protocol['d_model']}, {protocol['n_heads']} heads) + value head, "
                  f"{protocol['steps']} steps x batch {protocol['batch_size']} (MSE on the "
                  f"{labels['target']}), lr {protocol['lr']}, {protocol['n_heldout']} held-out "
                  f"instances, seeds {list(seeds)}, {labels['sweep_text'](list(values))}; "
                  f"torch layers on {args.device}, SV support from the exact fp64 gate.")
    payload = {"experiment": experiment, "scale": scale, "protocol": protocol,
               "fixed": FIXED, "task": task, sweep_name: list(values), "seeds": list(seeds),
               "methods": args.methods,
               "backend": describe_backend(args.jobs, args.dask_scheduler),
               "wall_s_this_call": time.perf_counter() - start, "scale_note": scale_line,
               "published": published, "published_note": published_notes,
               "differences_from_paper": [*DIFFERENCES, *scale_differences[scale]],
               "rows": rows,
               "environment": environment()}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown(rows, sweep_key, values, labels["column"], published, published_notes,
                     scale_line)
    stem.with_suffix(".md").write_text(labels["title"] + "\n\n" + table)
    figure(rows, sweep_key, values, published, stem.with_suffix(".png"),
           labels["figure_title"].format(scale=scale), labels["xlabel"])
    print(table)
    return 0
