"""Every benchmark of the project, one after the other, then every generated table of the docs.

One command regenerates every result file under ``benchmarks/results/`` that a benchmark's own
invocation at this commit writes (:data:`PLAN`), then runs ``python -m
svtoolkit.experiments.ledger``, which rewrites every marked table of README.md and docs/ from
the generated markdown. Each step is a fresh process (its own thread pools and Numba
initialisation), so one step's pools cannot spin against the next one's. What the plan does not
regenerate, and why, is in :data:`NOT_REGENERATED`: the before/after comparisons of two commits
(run by hand, both commits named in the file) and the GPU run (``benchmarks/gpu.py`` on a CUDA
machine).

Each step's record - its command, exit status, wall seconds, the load average (1, 5, 15 min)
before and after it and the thread settings of the environment it ran in - is appended to
``benchmarks/results/run_all.json`` as the step finishes, so a stopped run keeps what it did;
``--from NAME`` continues from a step. A step fails when its process fails or when it did not
rewrite the result files the plan says it writes (a renamed output is caught here, not in a
stale README). The default run takes several hours on the 2-core machine (the 10^5-record
memory rows, the exact solver's five table runs and the layer steps lead); run it with
nothing else of ours on the machine, as every benchmark's figures assume.

Usage::

    python benchmarks/run_all.py                  # everything, then the docs' tables
    python benchmarks/run_all.py --list           # the plan, one step per line
    python benchmarks/run_all.py --only forget memory_server
    python benchmarks/run_all.py --from layers    # continue a stopped run
    python benchmarks/run_all.py --dry-run        # print the commands, run nothing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from svtoolkit.experiments import record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: (step name, arguments after ``python``, result files it writes under benchmarks/results/).
PLAN = (
    ("exact_solver", ["benchmarks/exact_solver.py"], ["exact_solver.json", "exact_solver.md"]),
    ("forget", ["benchmarks/forget.py"], ["forget.json", "forget.md"]),
    ("backward", ["benchmarks/backward.py"], ["backward.json", "backward.md"]),
    ("batched", ["benchmarks/batched.py", "--threads", "1"], ["batched.json", "batched.md"]),
    ("batched_accuracy", ["benchmarks/batched_accuracy.py"],
     ["batched_accuracy.json", "batched_accuracy.md"]),
    ("layers", ["benchmarks/layers.py"], ["layers.json", "layers.md"]),
    ("layers_block1024", ["benchmarks/layers.py", "--block", "1024", "--batch", "4", "--layers",
                          "softmax", "sv_hybrid"],
     ["layers_block1024.json", "layers_block1024.md"]),
    ("threads", ["benchmarks/threads.py"], ["threads.json", "threads.md"]),
    ("trainer", ["benchmarks/trainer.py"], ["trainer.json", "trainer.md"]),
    ("decode", ["benchmarks/decode.py"], ["decode.json", "decode.md"]),
    ("decode_competitor", ["benchmarks/decode.py", "--competitor"],
     ["decode_competitor.json", "decode_competitor.md"]),
    ("decode_default_threads_competitor",
     ["benchmarks/decode.py", "--threads", "0", "--competitor", "--out",
      "decode_default_threads_competitor"],
     ["decode_default_threads_competitor.json", "decode_default_threads_competitor.md"]),
    ("tensor_cache", ["benchmarks/tensor_cache.py"],
     [f"tensor_cache_{part}.{ext}" for part in ("capacity", "equivalence", "state")
      for ext in ("json", "md")]),
    ("memory", ["benchmarks/memory.py"], ["memory.json", "memory.md"]),
    ("memory_query", ["benchmarks/memory.py", "--only-query"],
     ["memory_query.json", "memory_query.md"]),
    ("memory_server", ["benchmarks/memory_server.py"],
     ["memory_server.json", "memory_server.md"]),
)
#: Result files the plan leaves alone, each with the reason.
NOT_REGENERATED = {
    "decode_before.json": "decode before the contiguous per-head keys: another commit",
    "decode_before.md": "decode before the contiguous per-head keys: another commit",
    "decode_before_competitor.json": "the same with a competing process: another commit",
    "decode_before_competitor.md": "the same with a competing process: another commit",
    "memory_server_audit_ab.json": "A/B of two commits (the rolling audit's bound)",
    "memory_server_kkt_ab.json": "A/B of two commits (the one-pass certificate)",
    "gpu.json": "benchmarks/gpu.py needs a CUDA machine",
    "run_all.json": "this script's own record",
}
#: The thread settings recorded with every step (the environment it inherits).
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
              "OPENBLAS_CORETYPE", "NUMBA_NUM_THREADS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")
LEDGER = ("ledger", ["-m", "svtoolkit.experiments.ledger"], [])


def select(only=None, start=None):
    """The plan's steps to run, in order: all, ``only`` those named, or from ``start`` on.

    Raises
    ------
    ValueError
        A name that is not a step of the plan.
    """
    names = [name for name, _, _ in PLAN]
    for name in (only or []) + ([start] if start else []):
        if name not in names:
            raise ValueError(f"no benchmark step {name!r}; the steps: {', '.join(names)}")
    steps = [step for step in PLAN if not only or step[0] in only]
    if start:
        steps = steps[names.index(start):] if not only else \
            [s for s in steps if names.index(s[0]) >= names.index(start)]
    return steps


def run_step(name, args, outputs, python=sys.executable):
    """Run one step in a fresh process from the repository root; its record (a dict)."""
    before = os.getloadavg()
    t0 = time.time()
    done = subprocess.run([python, *args], cwd=ROOT)
    seconds = time.time() - t0
    stale = [f for f in outputs
             if not (RESULTS / f).exists() or (RESULTS / f).stat().st_mtime < t0]
    return {"step": name, "command": "python " + " ".join(args), "returncode": done.returncode,
            "seconds": seconds, "outputs": outputs, "outputs_not_rewritten": stale,
            "ok": done.returncode == 0 and not stale,
            "load_average_before": list(before), "load_average_after": list(os.getloadavg()),
            "thread_env": {k: os.environ.get(k) for k in THREAD_ENV}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the plan and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these steps")
    parser.add_argument("--from", dest="start", metavar="NAME", help="start at this step")
    parser.add_argument("--no-docs", action="store_true",
                        help="do not rewrite the docs' tables at the end")
    args = parser.parse_args(argv)
    try:
        steps = select(args.only, args.start)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.no_docs:
        steps = [*steps, LEDGER]
    if args.list or args.dry_run:
        for name, step_args, outputs in steps:
            print(f"{name}: python {' '.join(step_args)}"
                  + (f"  -> {', '.join(outputs)}" if outputs else "  -> README.md, docs/*.md"))
        return 0
    log_path = RESULTS / "run_all.json"
    log = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "argv": sys.argv[1:] if argv is None else list(argv),
           "git": record.git_state(ROOT), "cpu": record.cpu_model(), "cpu_count": os.cpu_count(),
           "steps": []}
    for name, step_args, outputs in steps:
        print(f"== {name}: python {' '.join(step_args)}", flush=True)
        log["steps"].append(run_step(name, step_args, outputs))
        log_path.write_text(json.dumps(log, indent=1) + "\n")
    failed = [s["step"] for s in log["steps"] if not s["ok"]]
    print("all steps done" if not failed else f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
