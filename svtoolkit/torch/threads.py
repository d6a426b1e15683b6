"""Thread control for torch, Numba and BLAS that avoids torch 2.13's batched-solve thread bug."""

from __future__ import annotations

import torch

__all__ = ["set_threads"]


def set_threads(n: int):
    """Use ``n`` threads for torch's OpenMP/BLAS work, for Numba and for the BLAS libraries NumPy
    and SciPy load, for the rest of the process.

    Three traps make ``torch.set_num_threads(n)`` alone the wrong call (both measured here):

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
    * NumPy's OpenBLAS (the exact solver's dense inverses) keeps its own pool, which
      ``torch.set_num_threads(1)`` does not reach: with a second CPU-bound process on a 2-core
      machine its two threads made the SV hybrid's streaming decode 1.5-4x slower (measured in
      ``benchmarks/decode.py``). n = 1 limits the BLAS pools through threadpoolctl too. A
      library loaded after the call keeps its own count, so SciPy (which bundles a second
      OpenBLAS) is imported first.

    Parameters
    ----------
    n : int
        Threads, >= 1. Numba's share is capped at ``numba.config.NUMBA_NUM_THREADS``.

    Returns
    -------
    threadpoolctl.threadpool_limits
        The limiter (already applied; keep it or drop it, the limit stays until changed): of
        every pool for n >= 2, of the BLAS pools for n = 1.
    """
    import numba

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1; got {n!r}")
    import scipy.linalg  # noqa: F401 - loads SciPy's own OpenBLAS, so that the limit reaches it
    from threadpoolctl import threadpool_limits

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if n == 1:
        torch.set_num_threads(1)
        return threadpool_limits(limits=1, user_api="blas")
    return threadpool_limits(limits=n)
