"""The API reference (docs/api, Sphinx autodoc + numpydoc) builds with warnings as errors.

And it is complete: every name in the ``__all__`` of every module that has a page reaches the
objects inventory under that module's name, and every public top-level module has a page, so
a new public name (or module) without documentation fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)\s*$", re.M)
#: Command-line entry points: their options are documented in the guides and in ``--help``.
NO_PAGE = {"cli", "__main__"}


def _page_modules():
    return sorted({m for page in API.glob("*.rst") for m in AUTOMODULE.findall(page.read_text())})


def _read_inventory(path):
    """``{(role, name)}`` of a Sphinx objects.inv (version 2: 4 header lines, zlib body)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    assert data[:header_end].startswith(b"# Sphinx inventory version 2"), data[:60]
    entries = set()
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        # name domain:role priority uri dispname; only a name may contain spaces (not ours).
        name, role = line.split(" ")[:2]
        entries.add((role, name))
    return entries


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    for name, extra in (("sphinx", "docs"), ("numpydoc", "docs"), ("torch", "torch"),
                        ("mlx.core", "mlx"), ("fastapi", "serve"), ("sklearn", "sklearn")):
        pytest.importorskip(name, reason=f"the API reference needs {name}: "
                                         f"pip install 'svtoolkit[{extra}]'")
    out = tmp_path_factory.mktemp("api")
    # A fresh process: autodoc imports every public module, the optional backends included.
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(out / "doctrees"), str(API), str(out / "html")],
        capture_output=True, text=True, cwd=ROOT,
    )
    return proc, out / "html"


def test_builds_without_warnings(built):
    proc, _ = built
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_public_name_is_in_the_inventory(built):
    proc, html = built
    assert (html / "objects.inv").is_file(), proc.stdout + proc.stderr
    entries = _read_inventory(html / "objects.inv")
    names = {name for _, name in entries}
    missing = []
    for modname in _page_modules():
        module = importlib.import_module(modname)
        assert ("py:module", modname) in entries, modname
        for name in module.__all__:
            full = f"{modname}.{name}"
            if isinstance(getattr(module, name), types.ModuleType):
                # a submodule in __all__ is documented on its own page
                if ("py:module", full) not in entries:
                    missing.append(f"{full} (module: add a page)")
            elif full not in names:
                missing.append(full)
    assert not missing, "public names without documentation: " + ", ".join(missing)


def test_every_public_module_has_a_page():
    import svtoolkit

    public = {f"svtoolkit.{info.name}" for info in pkgutil.iter_modules(svtoolkit.__path__)
              if not info.name.startswith("_") and info.name not in NO_PAGE}
    missing = sorted(public - set(_page_modules()))
    assert not missing, f"public modules without a page in docs/api: {missing}"


def test_the_inventory_holds_public_names_only(built):
    # Re-exported classes are documented under their public names, not their private homes.
    _, html = built
    private = sorted(name for _, name in _read_inventory(html / "objects.inv")
                     if any(part.startswith("_") and not part.startswith("__")
                            for part in name.split(".")))
    assert not private, private[:10]
