"""The package's metadata as a user meets it: version, ``--version``, missing-extra hints."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys

import pytest

import svtoolkit
from svtoolkit.cli import main


def test_version_comes_from_the_installed_metadata():
    assert svtoolkit.__version__ == importlib.metadata.version("svtoolkit")


def test_cli_prints_the_version(capsys):
    with pytest.raises(SystemExit, match="^0$") as exc:  # argparse's version action exits 0
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"svtoolkit {importlib.metadata.version('svtoolkit')}\n"


@pytest.mark.parametrize("module, missing, extra", [
    ("svtoolkit.sklearn", ("sklearn",), "svtoolkit[sklearn]"),
    ("svtoolkit.sweep", ("tqdm", "tqdm.auto"), "svtoolkit[verify]"),
])
def test_a_missing_extra_names_what_to_install(monkeypatch, module, missing, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    hint = f"{module} needs '{missing[0]}', which is not installed: pip install '{extra}'"
    with pytest.raises(ImportError, match=f"^{re.escape(hint)}$"):
        importlib.import_module(module)
