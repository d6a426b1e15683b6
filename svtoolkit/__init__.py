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

from .exact import IncrementalSVDD, MarginSystem, SolverFailure
from .exact._warmup import warmup
from .kernels import rbf_kernel

# --- forgettable memory --------------------------------------------------------------------
from .memory import (
    AddResult,
    BudgetExceededWarning,
    DeletionReceipt,
    DurabilityWarning,
    ForgettableMemory,
    Hit,
    MemoryAuthenticationError,
    MemoryFileError,
    verify_receipt,
)

__version__ = "0.1.0.dev0"

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "rbf_kernel", "warmup",
           "__version__",
           "ForgettableMemory", "DeletionReceipt", "Hit", "MemoryFileError",
           "BudgetExceededWarning", "AddResult", "DurabilityWarning", "MemoryAuthenticationError",
           "verify_receipt"]
