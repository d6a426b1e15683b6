"""``benchmarks/exact_solver.py``: its committed markdown is what its committed JSON renders to,
under the headings README.md's generated blocks name (no timing checked)."""

import json

import pytest
from _scripts import ROOT, load_benchmark

RESULTS = ROOT / "benchmarks" / "results"


def _module():
    return load_benchmark("exact_solver")


def test_the_committed_markdown_is_rendered_from_the_committed_json():
    pytest.importorskip("cvxpy")  # the benchmark imports its peers at module level
    pytest.importorskip("sklearn")
    bench = _module()
    payload = json.loads((RESULTS / "exact_solver.json").read_text())
    text = bench.markdown(payload)
    assert text == (RESULTS / "exact_solver.md").read_text()
    for title in bench.TITLES:
        assert f"\n## {title}\n" in text
    readme = (ROOT / "README.md").read_text()
    for title in bench.TITLES:  # README shows each table by its heading
        assert f'<!-- table: benchmarks/results/exact_solver.md "{title}" -->' in readme
