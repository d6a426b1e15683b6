"""One place for Numba options.

Every kernel in svtoolkit is compiled through :func:`njit` from this module so that the options
are decided once:

* ``cache=True``: compiled kernels are written to Numba's cache and reused by later processes.
  The cache lives next to the source (``__pycache__``) when the package directory is writable;
  otherwise in a per-user directory, ``$XDG_CACHE_HOME/svtoolkit/numba`` (default
  ``~/.cache/svtoolkit/numba``). A ``NUMBA_CACHE_DIR`` set by the user is always respected.
  The choice is made when this module is imported, before any kernel compiles (Numba reads it
  then), and is passed on to child processes through the environment.
* **no fastmath**: the exact solver relies on IEEE semantics (guarded divisions by tiny Schur
  complements, comparisons against exact zeros, NaN propagation in input checks). ``fastmath``
  would let LLVM reassociate and drop those guards.
* ``error_model="numpy"``: a division by zero gives inf/nan instead of raising inside a kernel;
  the kernels test the denominators they divide by.
* **one specialisation per argument type**: when a kernel calls another with a constant
  (``_leave(..., 0, ...)``), Numba compiles the callee for the constant's *literal* type, a
  separate compilation for each constant and, through the literal, for the callees it passes
  it on to. A kernel of svtoolkit is compiled for the plain type instead (Numba's literal
  typing is still tried when the plain type does not compile), which gives the same machine
  arithmetic and compiles each kernel once per plain signature: on the first change of a
  memory store, 55 compilations instead of 67 (48 s of CPU time instead of 68).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

__all__ = ["njit", "numba_cache_dir"]

_OPTIONS = {"cache": True, "fastmath": False, "error_model": "numpy", "nogil": True}


def _writable(directory):
    """Whether a ``__pycache__`` folder can be made in ``directory`` and written to (tried, as
    Numba itself does: permission bits say nothing for root or on a read-only mount)."""
    cache = Path(directory) / "__pycache__"
    try:
        cache.mkdir(exist_ok=True)
        with tempfile.TemporaryFile(dir=cache):
            pass
    except OSError:
        return False
    return True


def numba_cache_dir(package_dir, environ):
    """The ``NUMBA_CACHE_DIR`` svtoolkit sets, or None to leave Numba's choice alone.

    Parameters
    ----------
    package_dir : str or Path
        The directory of svtoolkit's source files.
    environ : Mapping[str, str]
        The process environment.

    Returns
    -------
    str or None
        None when the user set ``NUMBA_CACHE_DIR`` (respected) or ``package_dir`` is writable
        (Numba caches next to the source); else ``$XDG_CACHE_HOME/svtoolkit/numba``, with
        ``~/.cache`` when ``XDG_CACHE_HOME`` is unset or not an absolute path (the XDG rule).
    """
    if environ.get("NUMBA_CACHE_DIR") or _writable(package_dir):
        return None
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "svtoolkit", "numba")


def _configure_cache():
    chosen = numba_cache_dir(Path(__file__).resolve().parent, os.environ)
    if chosen is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = chosen
    if "numba" in sys.modules:  # imported before svtoolkit: have it read the variable again
        sys.modules["numba"].config.reload_config()


_configure_cache()

import numba  # noqa: E402  (after the cache directory is decided)
from numba.core import types as _types  # noqa: E402
from numba.core.errors import TypingError  # noqa: E402
from numba.core.registry import CPUDispatcher  # noqa: E402


class _Dispatcher(CPUDispatcher):
    """A CPU dispatcher that types a call from another kernel with the arguments' plain types
    (see the module docstring); nothing else differs."""

    def get_call_template(self, args, kws):
        plain = [_types.unliteral(a) for a in args]
        plain_kws = {k: _types.unliteral(v) for k, v in kws.items()}
        if plain == list(args) and plain_kws == kws:
            return super().get_call_template(args, kws)
        try:
            return super().get_call_template(plain, plain_kws)
        except TypingError:  # a kernel that needs the literal value
            return super().get_call_template(args, kws)


def _compile(func, options):
    dispatcher = numba.njit(**options)(func)
    if type(dispatcher) is CPUDispatcher:  # not, e.g., with NUMBA_DISABLE_JIT
        dispatcher.__class__ = _Dispatcher
    return dispatcher


def njit(func=None, **overrides):
    """Compile ``func`` with the project's Numba options (see module docstring)."""
    options = {**_OPTIONS, **overrides}
    if func is None:
        return lambda f: _compile(f, options)
    return _compile(func, options)
