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
    """Compile every exact-path kernel on tiny inputs.

    Call this once before timing anything: the first call of each kernel in a fresh process
    pays its compilation (or cache load). Benchmarks and the verification suite call it.
    """
    import numpy as np

    from .exact.solver import IncrementalSVDD
    from .kernels import rbf_kernel

    rng = np.random.default_rng(0)
    X = rng.standard_normal((12, 3))
    rbf_kernel(X, sigma=1.0)
    rbf_kernel(X, X[:2], sigma=1.0)
    solver = IncrementalSVDD(C=0.25, sigma=1.0)
    ids = solver.extend(X)
    solver.decision_function(X[:3])
    solver.kkt_residual()
    solver.remove(ids[0])
    solver.remove(int(solver.margin_ids[0]) if len(solver.margin_ids) else int(solver.ids[0]))
    solver.evict_reserve()
    solver.audit()
