"""The exact maintained fp64 solver (Cauwenberghs-Poggio walk on the SVDD dual)."""

from .solver import Audit, Consistency, IncrementalSVDD, MarginSystem, SolverFailure

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "Audit", "Consistency"]
