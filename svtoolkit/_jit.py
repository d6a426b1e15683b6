"""One place for Numba options.

Every kernel in svtoolkit is compiled through :func:`njit` from this module so that the options
are decided once:

* ``cache=True``: compiled kernels are written next to the source and reused by later processes.
* **no fastmath**: the exact solver relies on IEEE semantics (guarded divisions by tiny Schur
  complements, comparisons against exact zeros, NaN propagation in input checks). ``fastmath``
  would let LLVM reassociate and drop those guards.
* ``error_model="numpy"``: a division by zero gives inf/nan instead of raising inside a kernel;
  the kernels test the denominators they divide by.
"""

from __future__ import annotations

import numba

__all__ = ["njit", "warmup"]

_OPTIONS = {"cache": True, "fastmath": False, "error_model": "numpy", "nogil": True}


def njit(func=None, **overrides):
    """Compile ``func`` with the project's Numba options (see module docstring)."""
    options = {**_OPTIONS, **overrides}
    if func is None:
        return numba.njit(**options)
    return numba.njit(**options)(func)


def warmup() -> None:
    """Forwarder kept for ``from svtoolkit._jit import warmup``: see
    :func:`svtoolkit.exact._warmup.warmup` (this module imports no kernel module itself)."""
    from .exact._warmup import warmup as _warmup

    _warmup()
