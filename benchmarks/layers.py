"""Forward+backward step time of every attention layer in one small language model.

The model is :class:`svtoolkit.torch.TinyLM` at the 3.22M configuration of Forgetful Attention
(arXiv:2607.12204), §7 and App. C: a pre-norm decoder, 4 layers, d_model 256,
4 heads, block 256, byte vocabulary (256), learned positional embeddings, weight-tied head,
GELU MLP of width 4 d_model. Only the attention module changes between rows; it is looked up
by name in ``svtoolkit.torch.layers.ATTENTION_LAYERS`` (options via ``LAYER_OPTIONS`` or
``--options``). The SV rows use the paper's setting: chunk 64, C 0.25, 80 FISTA iterations
(batched training path: Numba FISTA partition finder on the CPU, ridged bordered solve,
autograd).

Goal (the project's CPU target): the SV hybrid step at most 2x the unfused softmax step on a
CPU (published, Table 8: 6.11x the unfused PyTorch CPU softmax step and 9,125 tokens/s for the
mixed PyTorch-CPU + MLX-GPU hybrid path on an Apple M3 Ultra). ``--device cuda`` times the same
rows on a GPU (every step synchronised); ``benchmarks/gpu.py`` runs it with the project's other
GPU measurements.

Method: rows are timed in interleaved rounds (round r times every layer once), after warm-up
steps, so slow drifts of the machine hit all rows alike. One step = forward, cross-entropy,
backward (gradients reset to None before each step; no optimiser update, as in Table 8). We
report median, min and max seconds per step, tokens/s (``batch * block / median``) and the
ratio of medians to unfused softmax attention measured in the same run. ``--paper`` uses the
published timing protocol (three warm-ups, median of seven steps); ``--quick`` a short
check of three rows (softmax, sliding window, SV hybrid; two timed steps) written to
``layers_quick.json``. The parameter column gives both counts: with the positional table and
without it (nanoGPT's count, the paper's "3.22M"). Before timing, every model is checked:
finite loss and gradients, and causal logits (changing token 200 leaves logits 0..199
unchanged).

Usage::

    python benchmarks/layers.py                       # every row of LAYER_OPTIONS, batch 16
    python benchmarks/layers.py --batch 16 --layers softmax tensor_cache
    python benchmarks/layers.py --layers sv_hybrid --profile sv_hybrid   # where the time goes
    python benchmarks/layers.py --quick                # three rows, two timed steps
    python benchmarks/layers.py --block 1024 --batch 4 --layers softmax sv_hybrid
    python benchmarks/layers.py --paper --device cuda  # Table 8 protocol on a GPU
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

from svtoolkit.experiments.record import git_state  # noqa: E402
from svtoolkit.torch import TinyLM  # noqa: E402
from svtoolkit.torch.threads import set_threads  # noqa: E402

CONFIG = dict(vocab=256, d_model=256, n_layers=4, n_heads=4, block=256)

# options per registry name; names missing here are built with their defaults
LAYER_OPTIONS: dict[str, dict] = {
    "softmax": {},
    "sliding_window": {"window": 64},
    "streaming_llm": {"sinks": 4, "window": 64},
    "linear": {"chunk": 64},
    "deltanet": {"chunk": 64},
    "gated_deltanet": {"chunk": 64},
    "tensor_cache": {"window": 64, "rule": "outer", "chunk": 32},
    "tensor_cache_delta": {"window": 64, "rule": "delta", "chunk": 32},
    "infini": {"segment": 64},
    "sv_hybrid": {"chunk": 64, "C": 0.25, "fista_iters": 80},
    "sv": {"chunk": 64, "C": 0.25, "fista_iters": 80},
}
#: The project's CPU target: SV hybrid step / softmax step on a CPU, at most.
SV_HYBRID_GOAL = 2.0
#: Forgetful Attention (arXiv:2607.12204), §7, Table 8 (3.22M configuration, batch 16,
#: Apple M3 Ultra): the hybrid's mixed PyTorch-CPU + MLX-GPU path and its step-time ratios.
PUBLISHED_TABLE8 = {"sv_hybrid_tokens_per_s": 9125, "ratio_vs_cpu_softmax": 6.11,
                    "ratio_vs_mps_softmax": 35.80}
#: Rows and timing of ``--quick``.
QUICK_LAYERS = ("softmax", "sliding_window", "sv_hybrid")
# extra rows that reuse a registered class with other options: row name -> registry name
ALIASES = {"tensor_cache_delta": "tensor_cache"}
RESULTS = Path(__file__).with_name("results")


def build_model(row: str, options: dict, config: dict | None = None) -> TinyLM:
    """TinyLM of one row (``config``: TinyLM sizes, default :data:`CONFIG`), seed 0."""
    torch.manual_seed(0)
    return TinyLM(**(config or CONFIG), attn=ALIASES.get(row, row), attn_options=options)


def train_step(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item()


def check_model(model: torch.nn.Module, tokens: torch.Tensor, position: int = 200) -> dict:
    """The answer behind the timing: finite loss and gradients, causal logits (changing
    token ``position`` leaves the logits before it unchanged)."""
    loss = train_step(model, tokens)
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters())
    with torch.no_grad():
        x = tokens[:1, :-1]
        changed = x.clone()
        changed[0, position] = (changed[0, position] + 1) % model.vocab
        leak = (model(changed)[0][0, :position] - model(x)[0][0, :position]).abs().max().item()
    ok = bool(np.isfinite(loss) and grads_finite and leak == 0.0)
    return {"loss": loss, "grads_finite": grads_finite, "causal_leak": leak, "passed": ok}


def time_rows(models: dict, tokens: torch.Tensor, warmup: int, reps: int,
              sync=lambda: None) -> dict:
    """Seconds of ``reps`` steps of every model, in interleaved rounds after ``warmup``
    rounds; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before and after each timed step."""
    for _ in range(warmup):
        for model in models.values():
            train_step(model, tokens)
    times = {row: [] for row in models}
    for _ in range(reps):
        for row, model in models.items():
            sync()
            start = time.perf_counter()
            train_step(model, tokens)
            sync()
            times[row].append(time.perf_counter() - start)
    return times


# ------------------------------------------------------------------------------ profile
#: Functions of the SV forward pass timed by ``--profile`` (module, attribute, label).
PROFILED = (
    ("svtoolkit.torch.ops.chunked_sv", "rbf_gram", "gram (RBF kernel)"),
    ("svtoolkit.torch.ops.chunked_sv", "_prefix_fista", "FISTA partition finder (Numba)"),
    ("svtoolkit.torch.ops.chunked_sv", "partition_masks", "partition masks"),
    ("svtoolkit.torch.ops.chunked_sv", "ridged_svdd_solve", "ridged bordered solve"),
    ("svtoolkit.torch.layers._tensor_ops", "sv_hybrid_readout", "readout (hybrid)"),
    ("svtoolkit.torch.layers._tensor_ops", "sv_rbf_readout", "readout (RBF)"),
    ("svtoolkit.torch.layers._tensor_ops", "sv_gate", "sv_gate (other work)"),
)


class _ExclusiveTimer:
    """Wraps functions so that each call adds its *exclusive* wall time (nested timed calls
    subtracted) to a bucket; ``restore()`` puts the originals back."""

    def __init__(self, targets):
        import importlib

        self.seconds, self._stack, self._patched = {}, [], []
        for module_name, attr, label in targets:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            self._patched.append((module, attr, original))
            setattr(module, attr, self._wrap(original, label))
            self.seconds.setdefault(label, 0.0)

    def _wrap(self, fn, label):
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                nested = self._stack.pop()
                self.seconds[label] += total - nested
                if self._stack:
                    self._stack[-1] += total

        return timed

    def restore(self):
        for module, attr, original in self._patched:
            setattr(module, attr, original)


def profile_row(model, tokens, reps=3):
    """Where one training step of ``model`` spends its time.

    Forward: exclusive wall time of the SV op functions (:data:`PROFILED`), the rest of the
    forward (projections, LayerNorm, MLP, head, loss) as the remainder. Backward: autograd
    nodes grouped by name with ``torch.profiler`` (self CPU time). Medians over ``reps``
    steps after one warm-up step.
    """
    from torch.profiler import ProfilerActivity, profile

    train_step(model, tokens)
    forward_s, backward_s, parts = [], [], []
    for _ in range(reps):
        for p in model.parameters():
            p.grad = None
        timer = _ExclusiveTimer(PROFILED)
        try:
            start = time.perf_counter()
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            mid = time.perf_counter()
        finally:
            timer.restore()
        loss.backward()
        end = time.perf_counter()
        forward_s.append(mid - start)
        backward_s.append(end - mid)
        parts.append(timer.seconds)
    forward = statistics.median(forward_s)
    breakdown = {label: statistics.median(p[label] for p in parts) for label in parts[0]}
    breakdown = {k: v for k, v in breakdown.items() if v > 0}
    breakdown["rest of the forward (projections, MLP, LayerNorm, head, loss)"] = (
        forward - sum(breakdown.values()))
    for p in model.parameters():
        p.grad = None
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    nodes = {}
    for event in prof.key_averages():
        if event.key.startswith("autograd::engine::evaluate_function: "):
            name = event.key.split(": ", 1)[1]
            nodes[name] = nodes.get(name, 0.0) + event.cpu_time_total / 1e6
    top = dict(sorted(nodes.items(), key=lambda kv: -kv[1])[:12])
    return {"forward_s": forward, "backward_s": statistics.median(backward_s),
            "forward_breakdown_s": breakdown,
            "backward_top_autograd_nodes_s (inclusive, one profiled step)": top}


def environment(threads: int, device: str = "cpu") -> dict:
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": threads,
        "numba_num_threads": numba.get_num_threads(),
        "numba_threading_layer": numba.threading_layer(),
        "device": device,
        "gpu": gpu,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "load_average_1_5_15min": os.getloadavg(),
        "git": git_state(Path(__file__).resolve().parent),
    }


#: The heading of the step-time table (README.md shows it by this title).
TABLE_TITLE = "Step time against unfused softmax (same run)"


def markdown(report: dict) -> str:
    """The benchmark's markdown, from its JSON report alone (so it can be re-rendered)."""
    env, config = report["environment"], report["config"]
    block = config["block"]
    device_line = (f"GPU {env['gpu']} (synchronised steps)" if env["device"] == "cuda"
                   else f"CPU ({env['torch_num_threads']} threads); GPU rows: not measured")
    lines = [f"# Memory layers: forward + backward step (batch {config['batch']}, block {block})",
             "", f"## {TABLE_TITLE}", "",
             "| layer | options | params (without positions) | median s/step (min-max) "
             "| tokens/s | vs softmax |",
             "|---|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
        no_pos = r.get("params_without_positions")
        lines.append(
            f"| {r['layer']} | {opts} | {r['params'] / 1e6:.2f}M"
            + (f" ({no_pos / 1e6:.2f}M)" if no_pos is not None else "")
            + f" | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
            f"{r['tokens_per_s']:,.0f} | {r['ratio_vs_softmax']:.2f}x |"
        )
    lines.append(f"\nbatch {config['batch']} x block {block}, fp32, {device_line}")
    published = report["published_table8"]
    lines.append(f"\nPublished (Forgetful Attention, Table 8, Apple M3 Ultra): SV hybrid "
                 f"{published['sv_hybrid_tokens_per_s']:,} tokens/s on the mixed PyTorch-CPU + "
                 f"MLX-GPU path, {published['ratio_vs_cpu_softmax']}x the unfused CPU softmax "
                 f"step, {published['ratio_vs_mps_softmax']}x the MPS softmax step.")
    goal = report["goal"]
    if goal is not None:
        lines.append(f"\nGoal (CPU target): {goal['goal']} - measured {goal['ratio']:.2f}x: "
                     f"{'met' if goal['met'] else 'NOT met'} (published: "
                     f"{goal['published_ratio']}x)")
    for row, prof in report["profiles"].items():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in prof["forward_breakdown_s"].items())
        lines.append(f"\nProfile of one {row} step (s): forward {prof['forward_s']:.3f} "
                     f"({parts}); backward {prof['backward_s']:.3f}")
    return "\n".join(lines) + "\n"


def measure_rows(rows, options, *, batch, warmup, reps, device="cpu", config=None,
                 log=print):
    """Check and time the TinyLM of every row; softmax (the reference) must be among them.

    Parameters
    ----------
    rows : list of str
        Row names (keys of :data:`LAYER_OPTIONS` or registry names).
    options : dict
        Row -> attention options.
    batch, warmup, reps : int
    device : {"cpu", "cuda"}
    config : dict, optional
        TinyLM sizes (default :data:`CONFIG`, the 3.22M configuration).

    Returns
    -------
    results : list of dict
        One per row: options, both parameter counts, median/min/max seconds per step,
        tokens/s, ratio to softmax, the correctness check and every step time.
    models : dict
        Row -> the model (on ``device``).
    """
    config = config or CONFIG
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab"], (batch, config["block"] + 1),
                           generator=gen).to(device)
    position = min(200, config["block"] * 3 // 4)
    models, checks = {}, {}
    for row in rows:
        models[row] = build_model(row, options[row], config).to(device)
        checks[row] = check_model(models[row], tokens, position)
        log(f"{row}: check {'passed' if checks[row]['passed'] else 'FAILED'} {checks[row]}")
    times = time_rows(models, tokens, warmup, reps, sync)
    reference = statistics.median(times["softmax"])
    results = []
    for row in rows:
        median = statistics.median(times[row])
        results.append({
            "layer": row, "options": options[row],
            "params": models[row].num_params(),
            "params_without_positions": models[row].num_params(positions=False),
            "median_s": median, "min_s": min(times[row]), "max_s": max(times[row]),
            "tokens_per_s": batch * config["block"] / median,
            "ratio_vs_softmax": median / reference, "check": checks[row],
            "times_s": times[row]})
    return results, models, tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="*", default=None,
                        help="rows (default: every row of LAYER_OPTIONS; --quick: three)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=CONFIG["block"],
                        help="context length T (default 256; another value writes "
                             "layers_block<T>.json)")
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--quick", action="store_true",
                       help=f"rows {', '.join(QUICK_LAYERS)}, 1 warm-up, 2 timed steps, "
                            "no profile, written to layers_quick.json")
    scale.add_argument("--paper", action="store_true",
                       help="the published timing protocol: 3 warm-ups, median of 7 steps")
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (--paper 3)")
    parser.add_argument("--reps", type=int, default=None, help="default 5 (--paper 7)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and Numba (default: leave them as they are)")
    parser.add_argument("--options", type=json.loads, default={}, help='{"row": {"opt": value}}')
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default results/layers.json, --quick layers_quick.json)")
    parser.add_argument("--profile", nargs="*", default=None,
                        help="rows to profile after timing (default sv_hybrid; none on --quick "
                             "or cuda)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    warmup_default, reps_default = (1, 2) if args.quick else (3, 7) if args.paper else (2, 5)
    args.warmup = warmup_default if args.warmup is None else args.warmup
    args.reps = reps_default if args.reps is None else args.reps
    if args.layers is None:
        args.layers = list(QUICK_LAYERS if args.quick else LAYER_OPTIONS)
    if args.profile is None:
        args.profile = [] if args.quick or args.device == "cuda" else ["sv_hybrid"]
    config = {**CONFIG, "block": args.block}
    if args.out is None:
        name = ("layers_quick" if args.quick else "layers" if args.block == CONFIG["block"]
                else f"layers_block{args.block}")
        args.out = RESULTS / f"{name}.json"
    if args.threads is not None:
        set_threads(args.threads)
    args.threads = torch.get_num_threads()
    rows = ["softmax"] + [r for r in args.layers if r != "softmax"]  # softmax is the reference
    options = {row: {**LAYER_OPTIONS.get(row, {}), **args.options.get(row, {})} for row in rows}
    results, models, tokens = measure_rows(rows, options, batch=args.batch, warmup=args.warmup,
                                           reps=args.reps, device=args.device, config=config)
    checks = {r["layer"]: r["check"] for r in results}
    times = {r["layer"]: r["times_s"] for r in results}
    reference = statistics.median(times["softmax"])
    profiles = {row: profile_row(models[row], tokens) for row in args.profile if row in models}
    goal = None
    if "sv_hybrid" in models and args.device == "cpu":
        ratio = statistics.median(times["sv_hybrid"]) / reference
        goal = {"goal": f"sv_hybrid step <= {SV_HYBRID_GOAL}x softmax step (CPU)",
                "ratio": ratio, "met": ratio <= SV_HYBRID_GOAL,
                "published_ratio": PUBLISHED_TABLE8["ratio_vs_cpu_softmax"]}
    report = {
        "benchmark": "layers: forward+backward step of a 4-layer d256 h4 block-256 decoder",
        "command": "python benchmarks/layers.py " + " ".join(argv or sys.argv[1:]),
        "config": {**config, "batch": args.batch, "warmup": args.warmup, "reps": args.reps},
        "environment": environment(args.threads, args.device),
        "results": results,
        "goal": goal,
        "profiles": profiles,
        "published_table8": PUBLISHED_TABLE8,
    }
    text = markdown(report)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(text)
    if not all(c["passed"] for c in checks.values()):
        raise SystemExit("a model failed its correctness check; timings are not trustworthy")


if __name__ == "__main__":
    main()
