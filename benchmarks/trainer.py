"""Overhead of the trainer's loop: its step time against the bare forward+backward step of
``benchmarks/layers.py`` for the same layer and shape, measured in one run.

Bare step: ``benchmarks/layers.py``'s ``train_step`` - gradients reset, TinyLM forward,
cross-entropy, backward. Trainer step: one step of :func:`svtoolkit.torch.training.train` -
batch lookup, forward, cross-entropy with ``ignore_index``, backward, gradient clipping, AdamW
update and scheduler step (what a training run actually pays per step). The ratio trainer /
bare is therefore an upper bound on the loop's own overhead: it includes the optimiser, which
the bare step leaves out.

Method: ``--runs`` interleaved rounds; in each round every layer is timed both ways, after
``--warmup`` steps (excluded), over ``--steps`` steps; a round's value is the median step of
that round. Reported: the median and min/max of the round values, and the ratio of medians.
Goal: trainer step <= 1.5 x bare step for every layer.

Usage::

    python benchmarks/trainer.py                       # small shape (d_model 64, block 64)
    python benchmarks/trainer.py --d-model 256 --n-layers 4 --block 256 --batch 16
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json, write_text  # noqa: E402
from layers import LAYER_OPTIONS, train_step  # noqa: E402

from svtoolkit.torch import TinyLM  # noqa: E402
from svtoolkit.torch.threads import set_threads  # noqa: E402
from svtoolkit.torch.training import TrainConfig, train  # noqa: E402

#: Trainer step / bare forward+backward step, at most.
GOAL_RATIO = 1.5
DEFAULT_LAYERS = ("softmax", "deltanet", "sv_hybrid")


def build(layer, args):
    torch.manual_seed(0)
    options = dict(LAYER_OPTIONS.get(layer, {}))
    if "chunk" in options:
        options["chunk"] = min(options["chunk"], args.block // 2)
    for key in ("window", "segment"):
        if key in options:
            options[key] = min(options[key], args.block // 2)
    model = TinyLM(args.vocab, args.d_model, args.n_layers, args.n_heads, args.block,
                   attn=layer, attn_options=options)
    return model, options


def bare_median(model, tokens, warmup, steps):
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        train_step(model, tokens)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainer_median(model, tokens, warmup, steps):
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def batch_at(step):
        return x, y

    result = train(model, batch_at, TrainConfig(steps=warmup + steps, lr=1e-4))
    return statistics.median(result.step_times[warmup:])


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", nargs="+", default=list(DEFAULT_LAYERS))
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=2)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.block + 1), generator=gen)
    models = {layer: build(layer, args) for layer in args.layers}
    bare = {layer: [] for layer in args.layers}
    loop = {layer: [] for layer in args.layers}
    for _ in range(args.runs):
        for layer, (model, _) in models.items():
            bare[layer].append(bare_median(model, tokens, args.warmup, args.steps))
            loop[layer].append(trainer_median(model, tokens, args.warmup, args.steps))
    rows = []
    for layer, (_, options) in models.items():
        b, t = summary(bare[layer]), summary(loop[layer])
        ratio = t["median"] / b["median"]
        rows.append({"layer": layer, "options": options, "bare_step_s": b,
                     "trainer_step_s": t, "ratio": ratio, "goal_met": ratio <= GOAL_RATIO})
    lines = ["| layer | bare fwd+bwd s/step (min-max) | trainer s/step (min-max) | ratio |",
             "|---|---:|---:|---:|"]
    for r in rows:
        b, t = r["bare_step_s"], r["trainer_step_s"]
        lines.append(f"| {r['layer']} | {b['median']:.4f} ({b['min']:.4f}-{b['max']:.4f}) | "
                     f"{t['median']:.4f} ({t['min']:.4f}-{t['max']:.4f}) | "
                     f"{r['ratio']:.2f}x |")
    lines.append(f"\nTinyLM d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} "
                 f"heads, block {args.block}, batch {args.batch}, fp32, CPU ({args.threads} "
                 f"thread(s)); {args.runs} runs x {args.steps} steps after {args.warmup} "
                 f"warm-up steps. Goal: trainer step <= {GOAL_RATIO}x bare step "
                 f"({'met' if all(r['goal_met'] for r in rows) else 'NOT met'} for every "
                 "layer). The trainer step includes clipping and the AdamW update.")
    table = "\n".join(lines)
    print(table)
    write_json("trainer", {
        "benchmark": "trainer step vs bare forward+backward step (benchmarks/layers.py)",
        "command": "python benchmarks/trainer.py " + " ".join(argv or sys.argv[1:]),
        "config": vars(args), "goal_ratio": GOAL_RATIO, "machine": machine_info(),
        "load_average_1_5_15min": list(__import__("os").getloadavg()), "rows": rows})
    write_text("trainer.md", table + "\n")
    return 0 if all(r["goal_met"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
