"""``benchmarks/gpu.py --smoke``: every part of the GPU run, on the CPU at toy sizes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out",
                    str(out)], check=True, cwd=tmp_path, capture_output=True, timeout=900)
    report = json.loads(out.read_text())
    assert report["smoke"] and report["environment"]["device"] == "cpu"
    layers = report["parts"]["layers"]
    assert [r["layer"] for r in layers] == ["softmax", "sv_hybrid"]
    assert all(r["check"]["passed"] and r["tokens_per_s"] > 0 for r in layers)
    (fista,) = report["parts"]["fista"]
    assert fista["n"] == 16 and fista["problems_per_second"] > 0
    lm = report["parts"]["lm"]
    arms = {r["arm"]: r for r in lm["rows"]}
    assert list(arms) == ["sv_hybrid", "swa", "deltanet", "linear", "softmax"]
    # the window arm gets the SV hybrid's measured state + one chunk, as matched_state.py
    assert arms["swa"]["options"]["window"] == round(arms["sv_hybrid"]["state"]["exact"]) + \
        lm["chunk"]
    assert all(r["tokens_per_s"] > 0 and r["best_val_loss"] > 0 for r in lm["rows"])
    assert set(report["wall_s"]) == {"layers", "fista", "lm", "total"}
