"""How long OpenMP threads spin before they sleep: a default that holds up on shared cores.

GNU OpenMP (libgomp: torch's CPU wheel bundles one, Numba's ``omp`` threading layer loads the
system's) keeps a worker that waits for the next parallel region spinning for
``GOMP_SPINCOUNT`` iterations before it sleeps - 300,000 when neither that variable nor
``OMP_WAIT_POLICY`` is set. The SV layers run many short parallel regions, with serial work
(Numba kernels, Python) between them, so two idle-spinning pools and a busy neighbour take the
cores from the thread that has work. Measured on a 2-core Intel Xeon (``python
benchmarks/threads.py``): beside one CPU-bound process the SV hybrid's training step took
3.1-6.5 s with the default spin and 2.4-2.6 s with 10,000 (one thread per pool: 1.7 s), its
ratio to the softmax step 2.5-4.0x against 2.3x (1.8x); on idle cores 0.99 s either way.
``OMP_WAIT_POLICY=PASSIVE`` (no spin) did as well beside a neighbour but made the idle step
23-32 % slower.

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
