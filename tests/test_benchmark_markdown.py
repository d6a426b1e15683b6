"""The benchmarks' committed markdown is what their committed JSON renders to, under the
headings that README.md's generated blocks name (no timing is checked here).

So a README table of a benchmark is never typed by hand: ``python -m
svtoolkit.experiments.ledger`` copies it from the markdown, and the markdown is a function of
the JSON the benchmark wrote.
"""

import json

import pytest
from _scripts import ROOT, load_benchmark

RESULTS = ROOT / "benchmarks" / "results"


def _render(bench, payload):
    return bench.markdown(payload)


def _render_batched(bench, payload):
    return bench.markdown(payload["rows"], payload["meta"])


# (script, result files, its renderer, the titles README.md shows, modules it imports)
CASES = [
    ("exact_solver", ["exact_solver"], _render, lambda b: list(b.TITLES),
     ["cvxpy", "sklearn"]),
    ("backward", ["backward"], _render, lambda b: [b.TABLE_TITLE], ["torch"]),
    ("batched", ["batched"], _render_batched, lambda b: [b.RATES_TITLE], ["torch"]),
    ("layers", ["layers", "layers_block1024"], _render, lambda b: [b.TABLE_TITLE],
     ["torch"]),
]


@pytest.mark.parametrize("script, results, render, titles, needs", CASES,
                         ids=[case[0] for case in CASES])
def test_the_committed_markdown_is_rendered_from_the_committed_json(script, results, render,
                                                                     titles, needs):
    for module in needs:  # the benchmarks import their peers at module level
        pytest.importorskip(module)
    bench = load_benchmark(script)
    readme = (ROOT / "README.md").read_text()
    for name in results:
        text = render(bench, json.loads((RESULTS / f"{name}.json").read_text()))
        assert text == (RESULTS / f"{name}.md").read_text(), name
        for title in titles(bench):
            assert f"\n## {title}\n" in text, (name, title)
    for title in titles(bench):  # README shows each table by its heading
        assert f'<!-- table: benchmarks/results/{results[0]}.md "{title}" -->' in readme


def test_the_threads_summary_and_markdown_follow_the_recorded_cells():
    """benchmarks/threads.py: the summary (medians over rounds, ratios over the one-thread
    ratio) is a function of the recorded cells, the markdown of the JSON, and docs/design.md
    shows the table by its heading."""
    bench = load_benchmark("threads")
    payload = json.loads((RESULTS / "threads.json").read_text())
    assert bench.summarise(payload["cells"]) == payload["summary"]
    assert bench.markdown(payload) == (RESULTS / "threads.md").read_text()
    busy = payload["summary"]["competitor"]
    assert busy[bench.REFERENCE]["ratio_over_one_thread"] == 1.0
    design = (ROOT / "docs" / "design.md").read_text()
    assert f'<!-- table: benchmarks/results/threads.md "{bench.TABLE_TITLE}" -->' in design
