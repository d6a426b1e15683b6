"""Study tables shown in README.md and docs/ are copies of the generated study markdown."""

from __future__ import annotations

import pytest

from svtoolkit.experiments import ledger
from svtoolkit.experiments.embed import END, embed, section_table

STUDY = """# A study

Scale: default.

## Table 1: recall

| row | acc |
|---|---:|
| SV | 0.91 |

Some text after the table.

## Table 2: state

| row | kB |
|---|---:|
| SV | 10 |
"""


def _root(tmp_path):
    (tmp_path / "examples" / "results").mkdir(parents=True)
    (tmp_path / "examples" / "results" / "s.md").write_text(STUDY)
    return tmp_path


def test_section_table_takes_only_the_table_of_that_section():
    assert section_table(STUDY, "Table 1: recall") == ["| row | acc |", "|---|---:|",
                                                       "| SV | 0.91 |"]
    assert section_table(STUDY, "Table 2: state")[-1] == "| SV | 10 |"


@pytest.mark.parametrize("title, message", [("Table 3", "no section"),
                                            ("A study", "holds no table")])
def test_section_table_refuses_a_missing_section_or_table(title, message):
    with pytest.raises(ValueError, match=message):
        section_table(STUDY, title)


def test_embed_replaces_a_stale_block_and_keeps_the_rest(tmp_path):
    root = _root(tmp_path)
    text = ('intro\n<!-- table: examples/results/s.md "Table 2: state" -->\n| old | 9 |\n'
            f"{END}\nrest\n")
    new = embed(text, root)
    assert new == ('intro\n<!-- table: examples/results/s.md "Table 2: state" -->\n'
                   f"| row | kB |\n|---|---:|\n| SV | 10 |\n{END}\nrest\n")
    assert embed(new, root) == new  # generated once, stable


@pytest.mark.parametrize("text, message", [
    ('<!-- table: examples/results/s.md "Table 1: recall" -->\n| x |\n', "no '<!-- end"),
    (f'<!-- table: examples/results/none.md "Table 1: recall" -->\n{END}\n', "no such file"),
    (f'<!-- table: examples/results/s.md "Table 9" -->\n{END}\n', "no section"),
])
def test_embed_names_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        embed(text, _root(tmp_path))


def test_the_ledger_command_regenerates_and_checks_the_embedded_tables(tmp_path):
    root = _root(tmp_path)
    (root / "examples" / "results" / "claims.json").write_text('{"record": null, "claims": []}')
    (root / "docs").mkdir()
    block = '<!-- table: examples/results/s.md "Table 1: recall" -->\n| stale |\n' + END
    (root / "README.md").write_text(f"{ledger.README_BEGIN}\n{ledger.README_END}\n{block}\n")
    (root / "docs" / "long_context.md").write_text(block + "\n")
    assert ledger.main(["--root", str(root)]) == 0
    for name in ("README.md", "docs/long_context.md"):
        text = (root / name).read_text()
        assert "| SV | 0.91 |" in text and "stale" not in text
    assert ledger.main(["--root", str(root), "--check"]) == 0
    (root / "examples" / "results" / "s.md").write_text(STUDY.replace("0.91", "0.93"))
    assert ledger.main(["--root", str(root), "--check"]) == 1
