"""svtoolkit.torch.set_threads: thread counts for torch, Numba and BLAS without torch's LU
bug."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("threadpoolctl")

_SCRIPT = r"""
import numba, numpy as np, torch
from threadpoolctl import threadpool_info
from svtoolkit.torch import set_threads

limiter = set_threads(2)
omp = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "openmp"]
numba_threads = numba.get_num_threads()
# the workload torch.set_num_threads(2) breaks in torch 2.13 (pytorch#142815): batched LU, n > 150
gen = np.random.default_rng(0)
A = gen.standard_normal((16, 193, 193)) + 193 * np.eye(193)
b = gen.standard_normal((16, 193, 1))
x = torch.linalg.solve(torch.tensor(A), torch.tensor(b)).numpy()
worst = float(np.abs(A @ x - b).max())
set_threads(1)
import scipy.linalg  # its OpenBLAS must have been limited too: set_threads loads it first
blas = max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
print(limiter is not None, min(omp), numba_threads, worst, torch.get_num_threads(), blas)
"""


def test_set_threads_sets_torch_numba_and_blas_and_keeps_batched_solve_correct():
    """Runs in a subprocess: thread counts are process-wide. One thread reaches NumPy's BLAS
    pool too, which torch.set_num_threads does not."""
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=300, check=True)
    limited, omp, numba_threads, worst, torch_threads, blas = out.stdout.split()[-6:]
    assert limited == "True"
    assert int(omp) == 2
    import numba

    assert int(numba_threads) == min(2, numba.config.NUMBA_NUM_THREADS)
    assert float(worst) <= 1e-10
    assert int(torch_threads) == 1
    assert int(blas) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_set_threads_refuses_bad_counts(bad):
    from svtoolkit.torch import set_threads

    with pytest.raises(ValueError, match="n must be an int >= 1"):
        set_threads(bad)
