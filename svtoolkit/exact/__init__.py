"""The exact maintained fp64 solver (Cauwenberghs-Poggio walk on the SVDD dual)."""

from .solver import IncrementalSVDD, MarginSystem, SolverFailure

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure"]
