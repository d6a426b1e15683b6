"""Result tables copied into README.md and docs/ from the studies' generated markdown.

Every study script writes ``<out>/<study>.md`` from its result JSON. A document shows one of
its tables by a pair of marker lines::

    <!-- table: examples/results/tensor_cache_recall.md "Table 1: matched-gap recall" -->
    ...
    <!-- end of table -->

and :func:`embed` replaces what lies between them with the table under the heading of that
title (``## Table 1: matched-gap recall``) in that file: its lines that start with ``|``.
So a result table in README.md or docs/ is never typed by hand; ``python -m svtoolkit.experiments.ledger``
rewrites every block, and its ``--check`` (run by the tests) fails when a document is stale.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["documents", "embed", "section_table"]

END = "<!-- end of table -->"
_BEGIN = re.compile(r'^<!-- table: (?P<file>\S+) "(?P<title>[^"]+)" -->$')


def documents(root):
    """The documents whose marked blocks are regenerated: README.md and every docs/*.md."""
    root = Path(root)
    return [path for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
            if path.exists()]


def section_table(markdown, title):
    """The table lines (those starting with ``|``) of the section headed ``title``.

    Parameters
    ----------
    markdown : str
        A generated study document.
    title : str
        The heading's text, without the leading ``#`` marks.

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        No heading has that title, or its section holds no table.
    """
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines)
              if line.startswith("#") and line.lstrip("#").strip() == title]
    if not starts:
        raise ValueError(f"no section {title!r}")
    table = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    if not table:
        raise ValueError(f"the section {title!r} holds no table")
    return table


def embed(text, root):
    """``text`` with every marked block replaced by its table, read under ``root``.

    Parameters
    ----------
    text : str
        A document (README.md or a page of docs/).
    root : str or Path
        The repository root the markers' file names are relative to.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        A block without its end marker, or a file or section that does not exist.
    """
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        match = _BEGIN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not match:
            continue
        try:
            end = lines.index(END, i)
        except ValueError:
            raise ValueError(f"{match['file']} {match['title']!r}: no {END!r} line") from None
        path = Path(root) / match["file"]
        if not path.exists():
            raise ValueError(f"{match['file']}: no such file")
        try:
            out += section_table(path.read_text(), match["title"])
        except ValueError as exc:
            raise ValueError(f"{match['file']}: {exc}") from None
        out.append(END)
        i = end + 1
    return "\n".join(out)
