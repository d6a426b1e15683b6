"""How long OpenMP threads spin before they sleep: a default that holds up on shared cores.

GNU OpenMP (libgomp: torch's CPU wheel bundles one, Numba's ``omp`` threading layer loads the
system's) keeps a worker that waits for the next parallel region spinning for
``GOMP_SPINCOUNT`` iterations before it sleeps - 300,000 when neither that variable nor
``OMP_WAIT_POLICY`` is set. The SV layers run many short parallel regions, with serial work
(Numba kernels, Python) between them, so two idle-spinning pools and a busy neighbour take the
cores from the thread that has work. Measured on a 2-core Intel Xeon (``python
benchmarks/threads.py``, two rounds, each setting in a fresh process): beside one CPU-bound
process the SV hybrid's training step took 4.8-6.4 s with the default spin and 2.6 s with
10,000 (one thread per pool: 1.8-1.9 s), its ratio to the softmax step 2.9-4.2x against 2.3x
(1.8x); on idle cores 1.01-1.05 s against 1.08-1.09 s. ``OMP_WAIT_POLICY=PASSIVE`` (no spin)
did better beside a neighbour (2.1-2.3 s) but made the idle step 30 % slower (1.31-1.40 s).

libgomp reads the variable once, when it is loaded, so the default reaches the runtimes loaded
after ``import svtoolkit``: torch's when svtoolkit is imported first, Numba's always (it loads
at the first parallel kernel). A value of either variable set by the user is left alone.
"""

from __future__ import annotations

import os

__all__ = ["SPIN_COUNT", "default_spin"]

#: ``GOMP_SPINCOUNT`` set at import when the user set neither it nor ``OMP_WAIT_POLICY`` (the
#: module docstring has the measurements behind the value).
SPIN_COUNT = 10_000


def default_spin(environ=os.environ):
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``environ`` unless the user chose a wait
    policy or a spin count; returns whether it did."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
