"""The exact maintained fp64 solver (Cauwenberghs-Poggio walk on the SVDD dual)."""

from ._consistency import Audit, AuditSlice, Consistency
from ._driver import BulkFallbackWarning, SolverFailure
from .solver import IncrementalSVDD, MarginSystem

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "BulkFallbackWarning", "Audit",
           "AuditSlice", "Consistency"]
