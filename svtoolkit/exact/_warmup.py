"""The exact walk's own warm-up (:func:`warm_walk`), for a long-running process.

The full warm-up of every layer's kernels is :func:`svtoolkit.warmup` (:mod:`svtoolkit._warmup`,
on the top floor: it imports the exact path, the memory and the batched path, which this
package must not).
"""

from __future__ import annotations

import numpy as np

__all__ = ["warm_walk"]


def warm_walk():
    """Load the kernels of the exact walk's everyday operations (add, remove, KKT residual).

    About a second in a fresh process once Numba's cache holds them, most of it Numba's one-time
    initialisation; a long-running process (the memory server) calls it at start so that its
    first change does not pay it.

    Returns
    -------
    IncrementalSVDD
        The small solver it ran (12 keys of dimension 3, two removed), for a fuller warm-up to
        go on with.
    """
    from .solver import IncrementalSVDD

    X = np.random.default_rng(0).standard_normal((12, 3))
    solver = IncrementalSVDD(C=0.25, sigma=1.0)
    ids = solver.extend(X)
    solver.decision_function(X[:3])
    solver.kkt_residual()
    solver.remove(ids[0])
    solver.remove(int(solver.margin_ids[0]) if len(solver.margin_ids) else int(solver.ids[0]))
    return solver
