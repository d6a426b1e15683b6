"""svtoolkit: forgettable attention memory.

An exact fp64 incremental/decremental SVDD (one-class SVM) gate over attention keys, with
certified selection (reserve tokens have weight exactly zero) and exact unlearning (a deletion
leaves the state a fresh solve without the token would have, under the same fixed C).

Public API (re-exports only):

* :func:`rbf_kernel` - RBF Gram / cross-kernel matrices (Numba, fp64).
* :class:`IncrementalSVDD` - the exact maintained solver.
* :mod:`svtoolkit.reference` - cvxpy interior-point reference with exact polish.
* :mod:`svtoolkit.torch`, :mod:`svtoolkit.mlx` - optional framework layers (lazy imports).
"""

from ._jit import warmup
from .exact import IncrementalSVDD, MarginSystem, SolverFailure
from .kernels import rbf_kernel

# --- forgettable memory --------------------------------------------------------------------
from .memory import BudgetExceededWarning, DeletionReceipt, ForgettableMemory, Hit, MemoryFileError

__version__ = "0.1.0.dev0"

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "rbf_kernel", "warmup",
           "__version__",
           "ForgettableMemory", "DeletionReceipt", "Hit", "MemoryFileError",
           "BudgetExceededWarning"]
