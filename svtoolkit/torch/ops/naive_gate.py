"""Slow reference of the exact gate: autograd through a fresh dense bordered solve.

The naive counterpart of :mod:`svtoolkit.torch.exact_gate` (as :mod:`svtoolkit.torch.ops.naive`
is for the sequence ops): the tests, the verification suite and the backward benchmark compare
the inverse-reusing backward against it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["bordered_solve_gate"]


def bordered_solve_gate(K, margin, error, C):
    """Slow reference: (alpha, rho) by autograd through a fresh ``torch.linalg.solve``.

    Builds M and c of the given partition from K with differentiable torch ops and solves; the
    gradient is standard autograd (a second solve in the backward). Used by the tests, the
    verification check and the benchmark as the dense implicit-function reference; it does not
    check that the partition is optimal.

    Returns
    -------
    alpha : Tensor of shape (n,)
    rho : Tensor of shape ()

    Raises
    ------
    ValueError
        Empty margin set (the bordered matrix is then singular).
    """
    if len(margin) == 0:
        raise ValueError("bordered_solve_gate needs a non-empty margin set")
    margin = torch.as_tensor(np.asarray(margin, dtype=np.int64), device=K.device)
    error = torch.as_tensor(np.asarray(error, dtype=np.int64), device=K.device)
    n, m = K.shape[0], margin.numel()
    ones = torch.ones(m, dtype=K.dtype, device=K.device)
    top = torch.cat([K.new_zeros(1), ones]).unsqueeze(0)
    bottom = torch.cat([ones.unsqueeze(1), 2.0 * K[margin][:, margin]], dim=1)
    M = torch.cat([top, bottom], dim=0)
    c = torch.cat([
        K.new_tensor([1.0 - error.numel() * C]),
        torch.diagonal(K)[margin] - 2.0 * C * K[margin][:, error].sum(1),
    ])
    u = torch.linalg.solve(M, c)
    alpha = K.new_zeros(n).index_put((error,), K.new_full((error.numel(),), C))
    alpha = alpha.index_put((margin,), u[1:])
    return alpha, u[0]
