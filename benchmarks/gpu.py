"""Every GPU measurement of the project in one run (within 8 minutes on one GPU): JSON out.

Three parts, each timed with CUDA synchronised around every measured call:

1. **Layer step throughput** at the 3.22M configuration of Forgetful Attention
   (arXiv:2607.12204), §7, Table 8 (TinyLM d_model 256, 4 layers, 4 heads, block 256,
   batch 16): forward + cross-entropy + backward per row, three warm-ups, median of seven
   (:func:`layers.measure_rows`, the rows of ``benchmarks/layers.py``), tokens/s and the
   ratio to unfused softmax; each model passes the finite-gradient and causality check first.
2. **Batched FISTA path** problems/s at n = 64 and n = 256 keys (d = 6, C = 1 / (0.2 n)):
   ``fista_svdd`` (80 iterations) + ``partition_masks`` + ``ridged_svdd_solve`` on a Gram batch
   already on the device (``benchmarks/batched.py``'s problems and timing), each answer checked
   on 8 problems against the exact fp64 solver.
3. **Matched-state arms for a few hundred steps** (``examples/matched_state.py``'s cells at the
   published model size, ``--lm-steps`` steps, one seed): the SV hybrid, the sliding window at
   the hybrid's measured state + chunk, DeltaNet, linear attention and full softmax - step
   time, tokens/s and the validation bits per byte reached (a throughput check, not the
   protocol's numbers).

``--smoke`` runs the same code on the CPU at toy sizes in seconds (what the tests run); it
writes ``gpu_smoke.json`` so that it never overwrites a GPU result.

Usage::

    python benchmarks/gpu.py                   # on a CUDA machine: benchmarks/results/gpu.json
    python benchmarks/gpu.py --smoke           # CPU, seconds
    python benchmarks/gpu.py --parts layers fista --lm-steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
RESULTS = HERE / "results"
PARTS = ("layers", "fista", "lm")

#: Sizes of a full (GPU) run and of ``--smoke`` (CPU).
SCALES = {
    "gpu": dict(layer_rows=("softmax", "sliding_window", "linear", "deltanet", "gated_deltanet",
                            "tensor_cache", "infini", "sv", "sv_hybrid"),
                config=None, batch=16, warmup=3, reps=7,
                fista=((64, 1024), (64, 8192), (256, 1024), (256, 8192)), fista_repeats=5,
                lm_scale="paper", lm_steps=300, lm_windows=256),
    "smoke": dict(layer_rows=("softmax", "sv_hybrid"),
                  config=dict(vocab=256, d_model=16, n_layers=1, n_heads=2, block=32),
                  batch=2, warmup=1, reps=1, fista=((16, 8),), fista_repeats=1,
                  lm_scale="quick", lm_steps=4, lm_windows=4),
}


def _sync(device):
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _load(directory, name):
    """Module ``name`` from ``directory`` (``benchmarks/`` or ``examples/``), imported with that
    directory's own ``_common`` helper module - the two directories each have one, and
    whichever was imported first would otherwise shadow the other."""
    import importlib.util

    saved = sys.modules.pop("_common", None)
    sys.path.insert(0, str(directory))
    try:
        spec = importlib.util.spec_from_file_location(f"_gpu_bench_{name}",
                                                      directory / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop("_common", None)
        if saved is not None:
            sys.modules["_common"] = saved
    return module


# ------------------------------------------------------------------------------ parts
def layer_part(scale, device, log):
    """Table 8 rows: one dict per layer (see ``layers.measure_rows``)."""
    layers = _load(HERE, "layers")
    LAYER_OPTIONS, measure_rows = layers.LAYER_OPTIONS, layers.measure_rows
    rows = list(scale["layer_rows"])
    options = dict(LAYER_OPTIONS)
    if scale["config"] is not None:  # toy sizes: chunks and windows must fit the block
        block = scale["config"]["block"]
        options = {r: {k: (min(v, block // 4) if k in ("chunk", "window", "segment") else v)
                       for k, v in LAYER_OPTIONS.get(r, {}).items()} for r in rows}
    results, _, _ = measure_rows(rows, {r: options.get(r, {}) for r in rows},
                                 batch=scale["batch"], warmup=scale["warmup"],
                                 reps=scale["reps"], device=device, config=scale["config"],
                                 log=log)
    for r in results:
        log(f"  {r['layer']:16s} {r['median_s'] * 1e3:8.1f} ms/step  "
            f"{r['tokens_per_s']:10,.0f} tokens/s  {r['ratio_vs_softmax']:.2f}x softmax")
    return results


def fista_part(scale, device, log):
    """Batched-path problems/s at each (n, G) of the scale, with the exact-solver check."""
    batched = _load(HERE, "batched")
    check_answers, make_problems, row = batched.check_answers, batched.make_problems, batched.row
    timed, torch_path = batched.timed, batched.torch_path
    rows = []
    for n, G in scale["fista"]:
        keys, sigmas, K, C = make_problems(G, n, 20261201 + G + n)
        timing, out = timed(torch_path(K.to(device), C, _sync(device)), scale["fista_repeats"])
        check = check_answers(keys, sigmas, K, C, out[0].cpu().numpy(), out[1].cpu().numpy())
        rows.append(row(f"torch {device} float32", G, n, timing, check=check))
        log(f"  n={n:4d} G={G:5d}: {timing['full']['median_s']:.4f} s/call, "
            f"{G / timing['full']['median_s']:,.0f} problems/s; check {check}")
    return rows


def lm_part(scale, device, log, corpus="auto", corpus_file=None):
    """The matched-state arms at the scale's model size for ``lm_steps`` steps, one seed
    (``examples/matched_state.py``'s cells, :func:`svtoolkit.experiments.lm.run_bytes_cell`,
    with a fixed step count instead of the plateau rule: a throughput check)."""
    from dataclasses import replace

    from svtoolkit.corpora import resolve_name
    from svtoolkit.experiments.lm import run_bytes_cell

    ms = _load(EXAMPLES, "matched_state")
    lm_scale, steps = scale["lm_scale"], scale["lm_steps"]
    protocol = replace(ms.PROTOCOLS[lm_scale], lr_grid=(ms.PROTOCOLS[lm_scale].lr_grid[0],),
                       max_steps=steps, min_steps=steps, eval_interval=steps,
                       warmup_steps=min(ms.PROTOCOLS[lm_scale].warmup_steps, steps - 1),
                       n_validation=scale["lm_windows"], n_test=scale["lm_windows"])
    spec = ({"file": str(corpus_file), "max_bytes": None} if corpus_file else
            {"name": resolve_name(corpus), "max_bytes": ms.MAX_BYTES[lm_scale]})
    chunk = ms.CHUNKS[lm_scale]
    rows, window = [], None
    for arm in ("sv_hybrid", "swa", "deltanet", "linear", "softmax"):
        cell = {"study": "lm_bytes", "corpus": spec, "model": ms.MODELS[lm_scale],
                "method": arm, "layer": ms.ARMS[arm][1],
                "options": ms.attn_options(arm, chunk, window),
                "protocol": protocol.to_dict(), "lr": protocol.lr_grid[0], "seed": 0,
                "device": device}
        if arm == "sv_hybrid":
            cell["state_windows"] = min(16, ms.STATE_WINDOWS[lm_scale])
        start = time.perf_counter()
        result = run_bytes_cell(cell)
        wall = time.perf_counter() - start
        if arm == "sv_hybrid":
            window = ms.matched_window(result["state"]["exact"], chunk)
        step_s = result["step_time_median_s"]
        tokens_per_s = protocol.batch_size * ms.MODELS[lm_scale]["block"] / step_s
        rows.append({"arm": arm, "options": cell["options"], "wall_s": wall,
                     "tokens_per_s": tokens_per_s,
                     **{k: v for k, v in result.items() if k != "curve"}})
        log(f"  {arm:10s} {step_s * 1e3:8.1f} ms/step  {tokens_per_s:10,.0f} tokens/s  "
            f"val {result['best_val_loss']:.3f} b/B after {steps} steps ({wall:.0f} s)")
    return {"protocol": protocol.to_dict(), "model": ms.MODELS[lm_scale], "chunk": chunk,
            "corpus": spec, "rows": rows}


# ------------------------------------------------------------------------------ main
def environment(device):
    versions = {}
    for name in ("svtoolkit", "torch", "numpy", "numba", "scipy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_gib": props.total_memory / 2**30,
               "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}
    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "device": device, "gpu": gpu, "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on the CPU (seconds): proves the script")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="default: cuda, or cpu with --smoke")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--lm-steps", type=int, default=None,
                        help="training steps of each matched-state arm (default 300)")
    parser.add_argument("--corpus", default="auto", help="offline corpus of the LM part")
    parser.add_argument("--corpus-file", type=Path, default=None,
                        help="a local byte corpus for the LM part (e.g. enwik8)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default results/gpu.json (--smoke: results/gpu_smoke.json)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on a GPU machine, or use --smoke on a CPU")
    scale = dict(SCALES["smoke" if args.smoke else "gpu"])
    if args.lm_steps is not None:
        scale["lm_steps"] = args.lm_steps
    out = args.out or RESULTS / ("gpu_smoke.json" if args.smoke else "gpu.json")
    if device == "cpu":
        from svtoolkit.torch.threads import set_threads

        set_threads(1)
    log = print if not args.smoke else (lambda *a, **k: None)
    report = {"benchmark": "benchmarks/gpu.py", "smoke": args.smoke,
              "command": "python benchmarks/gpu.py " + " ".join(argv or sys.argv[1:]),
              "environment": environment(device), "scale": scale, "parts": {}, "wall_s": {}}
    start = time.perf_counter()
    for part in args.parts:
        t0 = time.perf_counter()
        log(f"[{part}]")
        if part == "layers":
            report["parts"][part] = layer_part(scale, device, log)
        elif part == "fista":
            report["parts"][part] = fista_part(scale, device, log)
        else:
            report["parts"][part] = lm_part(scale, device, log, args.corpus, args.corpus_file)
        report["wall_s"][part] = time.perf_counter() - t0
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")  # after every part
    report["wall_s"]["total"] = time.perf_counter() - start
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    checks = [r["check"]["passed"] for r in report["parts"].get("layers", [])]
    if not all(checks):
        raise SystemExit("a layer failed its correctness check; its timing is not trustworthy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
