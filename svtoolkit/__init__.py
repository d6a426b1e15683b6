"""svtoolkit: forgettable attention memory.

An exact fp64 incremental/decremental SVDD (one-class SVM) gate over attention keys, with
certified selection (reserve tokens have weight exactly zero) and exact unlearning (a deletion
leaves the state a fresh solve without the token would have, under the same fixed C).

Public API re-exported here:

* :func:`rbf_kernel` - RBF Gram / cross-kernel matrices (Numba, fp64).
* :class:`IncrementalSVDD` (with :class:`MarginSystem`, :class:`SolverFailure`) - the exact
  maintained solver; :func:`warmup` compiles its kernels ahead of time.
* :class:`ForgettableMemory` (with :class:`DeletionReceipt`, :class:`Hit`,
  :class:`MemoryFileError`, :class:`BudgetExceededWarning`) - the key-value memory with exact
  deletion and certified eviction.

Submodules imported explicitly (``import svtoolkit.torch``): :mod:`svtoolkit.reference` (cvxpy
interior-point reference, extra ``verify``), :mod:`svtoolkit.torch` and :mod:`svtoolkit.mlx`
(framework layers, extras ``torch`` / ``mlx``), :mod:`svtoolkit.selection`,
:mod:`svtoolkit.data`, :mod:`svtoolkit.corpora`, :mod:`svtoolkit.embeddings` (extra ``text``),
:mod:`svtoolkit.sklearn` (the scikit-learn estimator ``IncrementalOneClassSVM``, extra
``verify``), :mod:`svtoolkit.tasks` (the papers' synthetic tasks), :mod:`svtoolkit.sweep`
(sweeps in process, on joblib or on Dask, resumable).
"""

import importlib

from ._openmp import default_spin

# before any OpenMP runtime is loaded (torch's, Numba's): see svtoolkit/_openmp.py
default_spin()

# Imported on first use (PEP 562): the solver and kernels load Numba (about half a second), which
# a command that only talks to a memory server does not need.
_EXPORTS = {
    "IncrementalSVDD": ".exact", "MarginSystem": ".exact", "SolverFailure": ".exact",
    "warmup": "._warmup", "rbf_kernel": ".kernels",
    "ForgettableMemory": ".memory", "DeletionReceipt": ".memory", "Hit": ".memory",
    "MemoryFileError": ".memory", "BudgetExceededWarning": ".memory", "AddResult": ".memory",
    "DurabilityWarning": ".memory", "MemoryAuthenticationError": ".memory",
    "verify_receipt": ".memory",
}


#: Subpackages that ``import svtoolkit`` made available as attributes before imports were lazy.
_SUBMODULES = ("exact", "kernels", "memory")


def _version():
    """The installed distribution's version: pyproject.toml is its only home."""
    # importlib.metadata costs ~50 ms to import, so it loads on first use of __version__.
    import importlib.metadata

    try:
        return importlib.metadata.version(__name__)
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def __getattr__(name):
    if name == "__version__":
        return _version()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "rbf_kernel", "warmup",
           "__version__",
           "ForgettableMemory", "DeletionReceipt", "Hit", "MemoryFileError",
           "BudgetExceededWarning", "AddResult", "DurabilityWarning", "MemoryAuthenticationError",
           "verify_receipt"]
