"""Tensor Cache measurements ("Tensor Cache: Eviction-conditioned Associative Memory for
Transformers"), with svtoolkit's implementation.

Three parts, each written to ``benchmarks/results/tensor_cache_<part>.json`` and ``.md``:

state
    Streaming state bytes per sequence after T tokens (T = 1k .. 32k) for the 3.22M model shape
    (4 layers, d_model 256, 4 heads of 64, fp32): Full KV against the bounded layers (sliding
    window, StreamingLLM, Infini-attention, Tensor Cache), all with the same local context W.
    Measured from the state objects the layers return after ``forward_with_state`` on T tokens
    (one layer, times the number of layers). Full KV is measured up to ``--full-kv-max`` tokens
    and extrapolated linearly (bytes/token measured) beyond, which the table marks.

capacity
    The raw associative capacity of one fast-weight head (Tensor Cache, §4.5, Table 3): sequential
    writes until the oldest item's relative reconstruction error exceeds 1.0, per head dim, for
    the orthonormal-prefix, random and decayed (lambda 0.995, eta 0.05) regimes, mean over five
    seeds. Writes go through ``tensor_cache_paths`` (rule "outer", window 1, every query = the
    oldest key), so the read at step n is ``k_0^T A_n`` with A_n holding n writes. The
    reconstruction is gain-corrected: ``v_hat = k_0^T A_n / (eta lambda^(n-1))`` (our reading of
    the paper's definition; without the correction a decayed memory could never reconstruct).

equivalence
    Relative error of the chunked scan against per-token writes in fp32, for every rule, on
    the memory read ``q_t^T A_t`` and the final A (B 4, T 128 and 1024, H 4, D 64, W 64, C 32,
    lambda 0.995, eta 0.05). Also each against the fp64 per-token reference (the truth), which
    shows how much of the difference is the sequential fp32 writes' own rounding.

Usage::

    python benchmarks/tensor_cache.py                 # all three parts
    python benchmarks/tensor_cache.py --parts capacity equivalence
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

from svtoolkit.experiments.record import git_state  # noqa: E402
from svtoolkit.torch.layers import (  # noqa: E402
    InfiniAttention,
    SlidingWindowAttention,
    SoftmaxAttention,
    StreamingLLMAttention,
    TensorCache,
)
from svtoolkit.torch.ops import RULES, tensor_cache_paths
from svtoolkit.torch.ops._testing import rel_error
from svtoolkit.torch.ops.naive import naive_tensor_cache_paths

RESULTS = Path(__file__).with_name("results")
MODEL = dict(n_layers=4, d_model=256, n_heads=4)


def environment() -> dict:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "load_average_1_5_15min": os.getloadavg(),
        "git": git_state(Path(__file__).resolve().parent),
    }


def save(part: str, payload: dict, table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "environment": environment()}
    (RESULTS / f"tensor_cache_{part}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"tensor_cache_{part}.md").write_text(table + "\n")
    print(table)


# --- state bytes -----------------------------------------------------------------------------


def state_rows(window: int) -> dict:
    d, h = MODEL["d_model"], MODEL["n_heads"]
    return {
        "full_kv": lambda: SoftmaxAttention(d, h),
        "sliding_window": lambda: SlidingWindowAttention(d, h, window=window),
        "streaming_llm": lambda: StreamingLLMAttention(d, h, sinks=4, window=window),
        "infini": lambda: InfiniAttention(d, h, segment=window),
        "tensor_cache": lambda: TensorCache(d, h, window=window),
    }


def measure_state_bytes(make_layer, length: int) -> int:
    torch.manual_seed(0)
    layer = make_layer()
    x = torch.randn(1, length, MODEL["d_model"], generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        _, state = layer.forward_with_state(x)
    return state.nbytes() * MODEL["n_layers"]


def run_state(lengths: list[int], window: int, full_kv_max: int) -> None:
    table = {}
    for name, make_layer in state_rows(window).items():
        table[name] = {}
        for length in lengths:
            if name == "full_kv" and length > full_kv_max:
                per_token = table[name][full_kv_max]["bytes"] / full_kv_max
                table[name][length] = {"bytes": int(per_token * length), "measured": False}
                continue
            start = time.perf_counter()
            nbytes = measure_state_bytes(make_layer, length)
            table[name][length] = {"bytes": nbytes, "measured": True}
            print(f"state {name} T={length}: {nbytes} B ({time.perf_counter() - start:.1f} s)")
    header = "| T | " + " | ".join(table) + " | TC / Full KV |"
    lines = [header, "|---:|" + "---:|" * (len(table) + 1)]
    for length in lengths:
        cells = []
        for name in table:
            entry = table[name][length]
            cells.append(f"{entry['bytes'] / 1024:,.0f} KiB" + ("" if entry["measured"] else " *"))
        ratio = table["tensor_cache"][length]["bytes"] / table["full_kv"][length]["bytes"]
        lines.append(f"| {length:,} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    lines.append(
        f"\nper sequence, fp32, {MODEL['n_layers']} layers x {MODEL['n_heads']} heads x "
        f"{MODEL['d_model'] // MODEL['n_heads']} dims, W = {window} (StreamingLLM 4 sinks + W; "
        f"Infini segment W). * extrapolated from the measured bytes per token."
    )
    payload = {"part": "state", "window": window, "model": MODEL, "bytes": table}
    save("state", payload, "\n".join(lines))


# --- capacity ----------------------------------------------------------------------------------

REGIMES = {  # name -> (orthonormal prefix, lambda, eta)
    "orthonormal_prefix": (True, 1.0, 1.0),
    "random": (False, 1.0, 1.0),
    "decayed": (False, 0.995, 0.05),
}


def unit_rows(n: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def capacity_once(dim: int, regime: str, seed: int, max_writes: int) -> int | None:
    """Writes n at which the oldest item's relative error first exceeds 1.0 (None: never)."""
    orthonormal, decay, rate = REGIMES[regime]
    gen = torch.Generator().manual_seed(seed)
    keys = unit_rows(max_writes, dim, gen)
    if orthonormal:
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
        keys[:dim] = basis.T
    values = unit_rows(max_writes, dim, gen)
    length = max_writes + 1  # query t reads the t writes of tokens 0 .. t-1 (window 1)
    k = torch.cat([keys, keys[:1]])[None, :, None]
    v = torch.cat([values, values[:1]])[None, :, None]
    q = keys[:1].expand(length, dim)[None, :, None]
    _, read, _ = tensor_cache_paths(
        q,
        k,
        v,
        window=1,
        log_decay=torch.tensor([math.log(decay)], dtype=torch.float64),
        rate=torch.tensor([rate], dtype=torch.float64),
        rule="outer",
    )
    writes = torch.arange(1, length, dtype=torch.float64)
    gain = rate * decay ** (writes - 1)
    error = (read[0, 1:, 0] / gain[:, None] - values[0]).norm(dim=-1)  # ||v_0|| = 1
    exceeded = (error > 1.0).nonzero()
    return int(writes[exceeded[0, 0]]) if exceeded.numel() else None


def predicted_capacity(dim: int, regime: str) -> float:
    """Writes n where the expected squared crosstalk of the oldest item reaches 1.

    Random unit keys give E (k_0 . k_i)^2 = 1/D; after gain correction the i-th later write
    carries weight lambda^(-i): solve sum_{i=1}^{n-1} lambda^(-2i) / D = 1 (+ D clean writes
    for the orthonormal prefix).
    """
    orthonormal, decay, _ = REGIMES[regime]
    total, n = 0.0, 1
    while total < dim:
        total += decay ** (-2 * n) if not orthonormal or n >= dim else 0.0
        n += 1
    return n


def run_capacity(dims: list[int], seeds: int) -> None:
    results = {}
    for regime in REGIMES:
        results[regime] = {}
        for dim in dims:
            runs = [capacity_once(dim, regime, seed, 8 * dim + 64) for seed in range(seeds)]
            if any(r is None for r in runs):
                raise RuntimeError(f"{regime} D={dim}: error never exceeded 1.0; raise max_writes")
            results[regime][dim] = {
                "mean": statistics.mean(runs),
                "std": statistics.pstdev(runs),
                "runs": runs,
                "predicted": predicted_capacity(dim, regime),
            }
    lines = [
        "| regime | " + " | ".join(f"D={d}" for d in dims) + " |",
        "|---|" + "---:|" * len(dims),
    ]
    for regime, row in results.items():
        cells = [
            f"{row[d]['mean']:.1f} ± {row[d]['std']:.1f} (pred. {row[d]['predicted']})"
            for d in dims
        ]
        lines.append(f"| {regime} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nnumber of writes (the oldest item's included) at which its gain-corrected relative "
        f"reconstruction error first exceeds 1.0, mean ± std over "
        f"{seeds} seeds; pred. = expected-crosstalk estimate (see predicted_capacity). The "
        "paper's Table 3 values are not in our copy of the paper (its tables were lost in "
        "extraction), so they cannot be printed beside these."
    )
    payload = {
        "part": "capacity",
        "regimes": {k: list(v) for k, v in REGIMES.items()},
        "results": results,
    }
    save("capacity", payload, "\n".join(lines))


# --- equivalence -------------------------------------------------------------------------------


def equivalence_inputs(rule: str, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (4, length, 4, 64)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    params = dict(
        window=64,
        log_decay=torch.full((4,), math.log(0.995), dtype=torch.float64),
        rate=torch.full((4,), 0.05, dtype=torch.float64),
        rule=rule,
    )
    return q, k, v, params


def as32(params: dict) -> dict:
    return {n: p.float() if torch.is_tensor(p) else p for n, p in params.items()}


def equivalence_errors(rule: str, length: int, chunk_size: int) -> dict:
    """Chunked fp32, per-token fp32 and per-token fp64 (the truth), compared pairwise."""
    q, k, v, params = equivalence_inputs(rule, length)
    q32, k32, v32 = q.float(), k.float(), v.float()
    _, chunk_read, chunk_state = tensor_cache_paths(
        q32, k32, v32, chunk_size=chunk_size, output_final_state=True, **as32(params)
    )
    _, token_read, token_memory = naive_tensor_cache_paths(q32, k32, v32, **as32(params))
    _, exact_read, exact_memory = naive_tensor_cache_paths(q, k, v, **params)
    pairs = {
        "chunk32_vs_token32": (token_read, token_memory, chunk_read, chunk_state.memory),
        "chunk32_vs_token64": (exact_read, exact_memory, chunk_read, chunk_state.memory),
        "token32_vs_token64": (exact_read, exact_memory, token_read, token_memory),
    }
    return {
        name: {"read": rel_error(ref_read, read), "memory": rel_error(ref_memory, memory)}
        for name, (ref_read, ref_memory, read, memory) in pairs.items()
    }


def run_equivalence(lengths: list[int], chunk_size: int) -> None:
    results = {rule: {} for rule in RULES}
    lines = [
        "| rule | T | chunked vs per-token, both fp32 (read / final A) | chunked fp32 vs fp64 "
        "| per-token fp32 vs fp64 | < 1e-7 |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for rule in RULES:
        for length in lengths:
            r = equivalence_errors(rule, length, chunk_size)
            results[rule][length] = r
            a, b, c = (
                r[k] for k in ("chunk32_vs_token32", "chunk32_vs_token64", "token32_vs_token64")
            )
            ok = "yes" if max(a["read"], a["memory"]) < 1e-7 else "no"
            lines.append(
                f"| {rule} | {length} | {a['read']:.1e} / {a['memory']:.1e} | {b['read']:.1e} / "
                f"{b['memory']:.1e} | {c['read']:.1e} / {c['memory']:.1e} | {ok} |"
            )
    lines.append(
        f"\nrelative Frobenius error; B 4, H 4, D 64, W 64, C {chunk_size}, lambda 0.995, "
        "eta 0.05, keys L2-normalised for the writes. fp32 unit roundoff is 6e-8."
    )
    payload = {"part": "equivalence", "chunk_size": chunk_size, "results": results}
    save("equivalence", payload, "\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="*", default=["state", "capacity", "equivalence"])
    parser.add_argument(
        "--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--full-kv-max", type=int, default=8192)
    parser.add_argument("--dims", type=int, nargs="*", default=[16, 32, 64, 128, 256])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--equivalence-lengths", type=int, nargs="*", default=[128, 1024])
    args = parser.parse_args(argv)
    if "state" in args.parts:
        run_state(args.lengths, args.window, args.full_kv_max)
    if "capacity" in args.parts:
        run_capacity(args.dims, args.seeds)
    if "equivalence" in args.parts:
        run_equivalence(args.equivalence_lengths, args.chunk_size)


if __name__ == "__main__":
    main()
