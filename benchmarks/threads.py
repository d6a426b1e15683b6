"""Thread pools on shared cores: the layers benchmark's SV hybrid and softmax steps under each
OpenMP wait setting, idle and beside one CPU-bound process.

Each cell runs ``benchmarks/layers.py --layers softmax sv_hybrid`` (T = 256, B = 16, 4 layers
of d_model 256: the layers benchmark's own row) in a fresh process, so that every OpenMP
runtime reads its settings when it loads:

* ``libgomp default`` - ``GOMP_SPINCOUNT=300000``, what libgomp spins for when neither it nor
  ``OMP_WAIT_POLICY`` is set (the environment before svtoolkit set a default);
* ``svtoolkit default`` - neither variable set: ``import svtoolkit`` sets
  ``GOMP_SPINCOUNT=10000`` (``svtoolkit/_openmp.py``) before torch loads its runtime;
* ``OMP_WAIT_POLICY=PASSIVE`` - threads sleep at once;
* ``one thread per pool`` - ``--threads 1`` (``svtoolkit.torch.set_threads(1)``): the
  reference the goal compares with.

The settings alternate within each round, idle rounds first, then the same beside one busy
Python loop. The figure of merit is the ratio of the SV hybrid's step to the softmax step and
how far it moves from its one-thread value (goal: at most 1.3x) - and the step times
themselves.

Usage::

    python benchmarks/threads.py            # 2 rounds (about 15 minutes on 2 cores)
    python benchmarks/threads.py --rounds 1
"""

from __future__ import annotations

import svtoolkit  # noqa: F401  (first: its OpenMP spin default precedes torch's runtime)

# isort: split
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import competing_process, machine_info, write_json, write_text  # noqa: E402

#: (name, environment changes, extra arguments of layers.py)
SETTINGS = (
    ("libgomp default", {"GOMP_SPINCOUNT": "300000"}, []),
    ("svtoolkit default", {}, []),
    ("OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"}, []),
    ("one thread per pool", {}, ["--threads", "1"]),
)
REFERENCE = "one thread per pool"
TABLE_TITLE = "Steps and ratios by thread setting"
GOAL = 1.3
LAYERS = ("softmax", "sv_hybrid")


def run_cell(env_changes, extra):
    """Median step times (s) of the two layers from one layers.py run in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_changes)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layers.json"
        subprocess.run([sys.executable, str(HERE / "layers.py"), "--layers", *LAYERS,
                        "--out", str(out), *extra], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        rows = {r["layer"]: r for r in json.loads(out.read_text())["results"]}
    return {name: rows[name]["median_s"] for name in LAYERS}


def summarise(cells):
    """Per load and setting: the median over rounds of each step, the ratio, and the ratio
    over the one-thread ratio of the same load."""
    out = {}
    for load in ("idle", "competitor"):
        rows = {}
        for name, _, _ in SETTINGS:
            runs = [c for c in cells if c["load"] == load and c["setting"] == name]
            if not runs:
                continue
            med = {layer: statistics.median(r["seconds"][layer] for r in runs)
                   for layer in LAYERS}
            ratios = [r["seconds"]["sv_hybrid"] / r["seconds"]["softmax"] for r in runs]
            rows[name] = {"softmax_s": med["softmax"], "sv_hybrid_s": med["sv_hybrid"],
                          "ratio": statistics.median(ratios), "ratios": ratios,
                          "ratio_range": [min(ratios), max(ratios)]}
        if REFERENCE in rows:
            for row in rows.values():
                row["ratio_over_one_thread"] = row["ratio"] / rows[REFERENCE]["ratio"]
        out[load] = rows
    return out


def markdown(payload):
    m = payload["machine"]
    lines = ["# Thread pools on shared cores", "",
             f"{m['cpu']}, {m['cores']} cores; `{payload['command']}`; "
             f"{payload['config']['rounds']} round(s); the layers benchmark's softmax and SV "
             "hybrid training steps (T = 256, B = 16), median seconds over rounds; ratio: "
             "SV hybrid / softmax, median [min-max] over rounds; last column: that ratio over "
             f"the one-thread ratio of the same load (goal <= {GOAL}x).", "",
             f"## {TABLE_TITLE}", "",
             "| load | setting | softmax step (s) | SV hybrid step (s) | ratio "
             "| ratio / one-thread ratio |",
             "|---|---|---:|---:|---:|---:|"]
    for load, rows in payload["summary"].items():
        for name, row in rows.items():
            low, high = row["ratio_range"]
            lines.append(f"| {load} | {name} | {row['softmax_s']:.3f} | {row['sv_hybrid_s']:.3f} "
                         f"| {row['ratio']:.2f} [{low:.2f}-{high:.2f}] "
                         f"| {row.get('ratio_over_one_thread', 0):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="threads", help="result name (default: threads)")
    args = parser.parse_args(argv)
    cells = []
    load_before = os.getloadavg()
    for load in ("idle", "competitor"):
        with competing_process(load == "competitor"):
            for r in range(args.rounds):
                for name, env_changes, extra in SETTINGS:
                    seconds = run_cell(env_changes, extra)
                    cells.append({"load": load, "round": r, "setting": name,
                                  "seconds": seconds})
                    print(load, r, name, {k: round(v, 3) for k, v in seconds.items()},
                          flush=True)
    payload = {
        "benchmark": "thread pools: SV hybrid and softmax training steps by OpenMP setting",
        "command": " ".join(["python", "benchmarks/threads.py", *(argv or sys.argv[1:])]),
        "config": {"rounds": args.rounds, "layers": list(LAYERS),
                   "settings": {name: {"env": env, "args": extra}
                                for name, env, extra in SETTINGS},
                   "layers_benchmark": "benchmarks/layers.py defaults (T = 256, B = 16)"},
        "machine": {**machine_info(packages=("numpy", "numba", "torch")),
                    "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "cells": cells,
        "summary": summarise(cells),
        "goal": f"with one competing process, ratio within {GOAL}x of the one-thread ratio",
    }
    busy = payload["summary"].get("competitor", {})
    payload["goal_met"] = {name: row["ratio_over_one_thread"] <= GOAL
                           for name, row in busy.items() if "ratio_over_one_thread" in row}
    write_json(args.out, payload)
    write_text(f"{args.out}.md", markdown(payload))
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    main()
