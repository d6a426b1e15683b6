"""Forward+backward step time of every attention layer in one small language model.

The model is the SV-Attention paper's 3.22M configuration (000_a3469575cc0b2d8e.txt, Sec. 7 and
App. C): a pre-norm decoder, 4 layers, d_model 256, 4 heads, block 256, byte vocabulary (256),
learned positional embeddings, weight-tied head, GELU MLP of width 4 d_model. Only the
attention module changes between rows; it is looked up by name in
``svtoolkit.torch.layers.ATTENTION_LAYERS``, so a layer registered there later (the SV layers)
is benchmarked with ``--layers <name>`` and no other change (options via ``LAYER_OPTIONS`` or
``--options``).

Method: rows are timed in interleaved rounds (round r times every layer once), after warm-up
steps, so slow drifts of the machine hit all rows alike. One step = forward, cross-entropy,
backward (gradients reset to None before each step). We report median, min and max seconds per
step, tokens/s and the ratio of medians to unfused softmax attention measured in the same run.
Before timing, every model is checked: finite loss and gradients, and causal logits (changing
token 200 leaves logits 0..199 unchanged).

Usage::

    python benchmarks/layers.py                       # every row of LAYER_OPTIONS, batch 16
    python benchmarks/layers.py --batch 16 --layers softmax tensor_cache
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from svtoolkit.torch.layers import ATTENTION_LAYERS

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
}
# extra rows that reuse a registered class with other options: row name -> registry name
ALIASES = {"tensor_cache_delta": "tensor_cache"}
RESULTS = Path(__file__).with_name("results")


class Block(nn.Module):
    """Pre-norm block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, attention: nn.Module):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d_model), attention
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BenchLM(nn.Module):
    """Byte-level decoder with a pluggable attention (built by ``make_attention()`` per layer)."""

    def __init__(self, make_attention, vocab, d_model, n_layers, n_heads, block):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, make_attention()) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(row: str, options: dict) -> BenchLM:
    cls = ATTENTION_LAYERS[ALIASES.get(row, row)]
    torch.manual_seed(0)

    def make_attention():
        return cls(CONFIG["d_model"], CONFIG["n_heads"], **options)

    return BenchLM(make_attention, **CONFIG)


def train_step(model: nn.Module, tokens: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item()


def check_model(model: nn.Module, tokens: torch.Tensor) -> dict:
    """The answer behind the timing: finite loss and gradients, causal logits."""
    loss = train_step(model, tokens)
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters())
    with torch.no_grad():
        x = tokens[:1, :-1]
        changed = x.clone()
        changed[0, 200] = (changed[0, 200] + 1) % CONFIG["vocab"]
        leak = (model(changed)[0, :200] - model(x)[0, :200]).abs().max().item()
    ok = bool(np.isfinite(loss) and grads_finite and leak == 0.0)
    return {"loss": loss, "grads_finite": grads_finite, "causal_leak": leak, "passed": ok}


def time_rows(models: dict, tokens: torch.Tensor, warmup: int, reps: int) -> dict:
    for _ in range(warmup):
        for model in models.values():
            train_step(model, tokens)
    times = {row: [] for row in models}
    for _ in range(reps):
        for row, model in models.items():
            start = time.perf_counter()
            train_step(model, tokens)
            times[row].append(time.perf_counter() - start)
    return times


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo where available."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int) -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": threads,
        "device": "cpu",
        "load_average_1_5_15min": os.getloadavg(),
    }


def markdown_table(rows: list[dict], batch: int) -> str:
    lines = [
        "| layer | options | params | median s/step (min-max) | tokens/s | vs softmax |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
        lines.append(
            f"| {r['layer']} | {opts} | {r['params'] / 1e6:.2f}M | {r['median_s']:.3f} "
            f"({r['min_s']:.3f}-{r['max_s']:.3f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['ratio_vs_softmax']:.2f}x |"
        )
    lines.append(f"\nbatch {batch} x block {CONFIG['block']}, fp32, CPU")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", nargs="*", default=list(LAYER_OPTIONS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--options", type=json.loads, default={}, help='{"row": {"opt": value}}')
    parser.add_argument("--out", type=Path, default=RESULTS / "layers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = ["softmax"] + [r for r in args.layers if r != "softmax"]  # softmax is the reference

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG["vocab"], (args.batch, CONFIG["block"] + 1), generator=gen)
    models, options, checks = {}, {}, {}
    for row in rows:
        options[row] = {**LAYER_OPTIONS.get(row, {}), **args.options.get(row, {})}
        models[row] = build_model(row, options[row])
        checks[row] = check_model(models[row], tokens)
        print(f"{row}: check {'passed' if checks[row]['passed'] else 'FAILED'} {checks[row]}")
    times = time_rows(models, tokens, args.warmup, args.reps)

    reference = statistics.median(times["softmax"])
    results = []
    for row in rows:
        median = statistics.median(times[row])
        results.append(
            {
                "layer": row,
                "options": options[row],
                "params": sum(p.numel() for p in models[row].parameters()),
                "median_s": median,
                "min_s": min(times[row]),
                "max_s": max(times[row]),
                "tokens_per_s": args.batch * CONFIG["block"] / median,
                "ratio_vs_softmax": median / reference,
                "check": checks[row],
                "times_s": times[row],
            }
        )
    table = markdown_table(results, args.batch)
    print(table)
    report = {
        "benchmark": "layers: forward+backward step of a 4-layer d256 h4 block-256 decoder",
        "command": "python benchmarks/layers.py " + " ".join(argv or sys.argv[1:]),
        "config": {**CONFIG, "batch": args.batch, "warmup": args.warmup, "reps": args.reps},
        "environment": environment(args.threads),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    if not all(c["passed"] for c in checks.values()):
        raise SystemExit("a model failed its correctness check; timings are not trustworthy")


if __name__ == "__main__":
    main()
