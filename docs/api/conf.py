"""Sphinx configuration of the API reference (autodoc + numpydoc; no network access).

Build: ``python -m sphinx -W --keep-going -b html docs/api docs/_build/api``. Each page under
``docs/api/`` documents one public module with ``automodule :members:``, which follows the
module's ``__all__`` (and its order); ``tests/test_api_docs.py`` builds it with warnings as
errors and checks that every name in every public ``__all__`` reached the objects inventory.
"""

import importlib.metadata
import inspect
import sys

from sphinx.domains.python import PyClasslike
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

_LOGGER = logging.getLogger(__name__)

project = "svtoolkit"
author = "svtoolkit developers"
copyright = "svtoolkit developers"
try:
    release = importlib.metadata.version("svtoolkit")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    release = "0+unknown"
version = release

extensions = ["sphinx.ext.autodoc", "numpydoc"]

# The optional backends (torch, mlx, fastapi) are imported for real: a page that cannot import
# its module fails the build instead of rendering empty.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "none"  # the numpydoc Parameters sections carry the types
autodoc_inherit_docstrings = False  # torch.nn.Module's forward docstring is not ours

# Members are documented by autodoc under the class; numpydoc's member tables would list them
# twice (and cost build time).
numpydoc_show_class_members = False

default_role = "py:obj"  # a single-backtick name is a cross-reference, as in NumPy's docs

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_copy_source = False
html_show_sourcelink = False


class _PublicClass(PyClasslike):
    """A class documented under its public name only.

    autodoc adds ``:canonical: <defining module>.<name>`` to a re-exported class, and a class
    exported by two public modules (``svtoolkit.IncrementalSVDD``, ``svtoolkit.exact.
    IncrementalSVDD``) would then describe its private defining name twice. The private module
    is not API, so the alias is dropped; the inventory holds public names only.
    """

    def run(self):
        self.options.pop("canonical", None)
        return super().run()


def _defining_comment(name, obj):
    """The ``#:`` comment of the module that binds ``name`` to ``obj`` (a re-exported constant).

    autodoc reads ``#:`` comments from the source of the module being documented, and a
    constant imported into a package's ``__init__`` has its comment where it is defined.
    """
    for modname, module in sorted(sys.modules.items()):
        if modname.partition(".")[0] != "svtoolkit" or getattr(module, name, None) is not obj:
            continue
        try:
            doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", name))
        except PycodeError:  # a module without Python source
            continue
        if doc:
            return list(doc)
    return []


def _is_type_doc(lines, obj):
    """Whether autodoc fell back to the docstring of the constant's type (``float``, ``dict``)."""
    text = "\n".join(lines).strip()
    return not text or text == inspect.cleandoc(type(obj).__doc__ or "").strip()


def _check_documented(app, what, name, obj, options, lines):
    """Fill a re-exported constant's docstring from its definition; warn if a name has none.

    autodoc leaves out a function or class without a docstring (the test then finds its name
    missing from the inventory); an explicit ``autodata`` falls back to its type's docstring.
    """
    parent, _, short = name.rpartition(".")
    if parent not in sys.modules:  # a class member: autodoc's own rules apply
        return
    if what == "data" and _is_type_doc(lines, obj):
        lines[:] = _defining_comment(short, obj)
    if not any(line.strip() for line in lines):
        _LOGGER.warning("public name %s has no docstring (or #: comment)", name,
                        type="svtoolkit", subtype="undocumented")


def setup(app):
    app.connect("autodoc-process-docstring", _check_documented, priority=400)
    app.add_directive_to_domain("py", "class", _PublicClass, override=True)
    app.add_directive_to_domain("py", "exception", _PublicClass, override=True)
