"""Experiments as a library: the fair training protocol of the synthetic studies of
Forgetful Attention (arXiv:2607.12204), §5 (MQAR, selective copying, capacity).

* :mod:`~svtoolkit.experiments.protocol` - :class:`Protocol` (learning-rate grid, step cap,
  validation interval, plateau rule), :func:`plateau_reached`, :func:`choose_lr`, the split
  seeds;
* :mod:`~svtoolkit.experiments.methods` - the table rows; the SV rows use the paper's layer
  (:data:`SV_PAPER`, defined there once);
* :mod:`~svtoolkit.experiments.engine` - one cell (method, setting, seed, lr) trained
  single-threaded and seeded (imports torch);
* :mod:`~svtoolkit.experiments.summary` - rows with success counts and intervals, paired
  comparisons, the markdown table and figures;
* :mod:`~svtoolkit.experiments.record` - :func:`run_record`, written into every result JSON;
* :mod:`~svtoolkit.experiments.cli` - the shared command line (:class:`Study`, :func:`main`).

Importing this package imports neither torch nor matplotlib.
"""

from .methods import METHODS, SV_PAPER, Method
from .protocol import Protocol, choose_lr, plateau_reached, split_seed
from .record import run_record

__all__ = ["METHODS", "SV_PAPER", "Method", "Protocol", "choose_lr", "plateau_reached",
           "run_record", "split_seed"]
