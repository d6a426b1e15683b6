"""The exact maintained fp64 solver (Cauwenberghs-Poggio walk on the SVDD dual)."""

from .solver import IncrementalSVDD

__all__ = ["IncrementalSVDD"]
