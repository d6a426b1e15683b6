"""svtoolkit's verification suite: an independent audit of exactness against the QP reference.

Run it with ``python -m verification`` (``--help`` for the options). See docs/verification.md.

The package imports nothing heavy on its own, so that extension modules
(``verification/check_*.py``, each exposing ``run(quick: bool = True) -> list[dict]``) can
import :mod:`verification.records` cheaply.
"""

__all__ = ["main"]


def main(argv=None):
    """Run the suite; returns the exit status (see :func:`verification.suite.main`)."""
    from .suite import main as _main

    return _main(argv)
