"""Thread control for torch and Numba that avoids torch 2.13's batched-solve thread bug."""

from __future__ import annotations

import torch

__all__ = ["set_threads"]


def set_threads(n: int):
    """Use ``n`` threads for torch's OpenMP/BLAS work and for Numba, for the rest of the process.

    Two traps make ``torch.set_num_threads(n)`` alone the wrong call (both measured here):

    * In torch 2.13 CPU builds, ``torch.set_num_threads(k)`` with k >= 2 makes batched
      ``torch.linalg.solve`` (the SV layers' ridged solve) of matrices larger than about 150
      return wrong results, raise "Pivots given to lu_solve must all be greater or equal to 1" or
      hang (pytorch/pytorch#142815). k >= 2 is therefore applied through threadpoolctl
      (``omp_set_num_threads`` and the BLAS setter), which does not trigger it; k = 1 through
      torch.
    * Numba's parallel kernels (the batched path's fused FISTA) run on Numba's own pool: its
      ``omp`` threading layer loads the system libgomp, a runtime separate from the one in
      torch's wheel, whose thread count does not follow torch's. So Numba's count is set too
      (docs/design.md, "Thread pools").

    Parameters
    ----------
    n : int
        Threads, >= 1. Numba's share is capped at ``numba.config.NUMBA_NUM_THREADS``.

    Returns
    -------
    threadpoolctl.threadpool_limits or None
        The limiter for n >= 2 (already applied; keep it or drop it, the limit stays until
        changed), None for n = 1.
    """
    import numba

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1; got {n!r}")
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if n == 1:
        torch.set_num_threads(1)
        return None
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n)
