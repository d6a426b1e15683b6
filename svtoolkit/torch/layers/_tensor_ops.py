"""The torch tensor operations that the framework-neutral layer control flow runs on.

:mod:`svtoolkit._layer_core` drives the SV layers of :mod:`svtoolkit.torch.layers.sv` (and the
head and input checks and ``step`` of :class:`svtoolkit.torch.layers.HeadsAttention`) through
this namespace; :mod:`svtoolkit.mlx._tensor_ops` is its MLX twin, with the same names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.chunked_sv import (
    exact_sv_gate,
    sv_gate,
    sv_hybrid_readout,
    sv_rbf_readout,
    uniform_sv_gate,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "array",
    "array_type",
    "concat",
    "dtype_text",
    "exact_sv_gate",
    "exp",
    "heads_first",
    "is_floating",
    "masked_max",
    "masked_min",
    "merge_heads",
    "no_grad",
    "rms_norm",
    "split_heads",
    "stack",
    "stack_keys",
    "stored_keys",
    "stored_values",
    "sum",
    "sv_gate",
    "sv_hybrid_readout",
    "sv_rbf_readout",
    "uniform_sv_gate",
    "where",
]

#: the framework's array class
array_type = torch.Tensor
#: dtypes of the inputs and weights the SV layers compute in (the exact gate is fp64 inside).
SUPPORTED_DTYPES = (torch.float32, torch.float64)

exp = torch.exp
stack = torch.stack
where = torch.where


def is_floating(x):
    return x.is_floating_point()


def dtype_text(dtype):
    """The dtype as torch prints it (``torch.int64``): the messages of every torch layer."""
    return str(dtype)


def split_heads(y, n_heads, head_dim):
    """(B, T, H*D) -> (B, T, H, D)."""
    return y.unflatten(-1, (n_heads, head_dim))


def merge_heads(o):
    """(..., H, D) -> (..., H*D)."""
    return o.flatten(-2)


def rms_norm(y):
    """Per-head RMS normalisation over the last dimension (eps: the dtype's machine epsilon)."""
    return F.rms_norm(y, (y.shape[-1],))


def no_grad():
    """Streaming runs without autograd: its outputs carry no graph."""
    return torch.no_grad()


def stored_keys(k):
    """(B, H, D) keys -> per sequence a detached (H, D) float64 CPU tensor."""
    return [k[b].detach().to("cpu", torch.float64) for b in range(k.shape[0])]


def stored_values(v):
    return v.detach()


def stack_keys(keys, dtype):
    """Stored float64 keys (each of one shape) -> one array of ``dtype``, stacked on axis 0."""
    return torch.stack(keys).to(dtype)


def array(values, dtype):
    return torch.tensor(values, dtype=dtype)


def concat(arrays, axis):
    return torch.cat(arrays, axis)


def heads_first(a):
    """(n, H, ...) -> (H, n, ...)."""
    return a.transpose(0, 1)


# sum: the name of torch's and MLX's reduction (the builtin is not used here)
def sum(a, axis=None):
    return a.sum() if axis is None else a.sum(axis)


def masked_max(a, mask):
    """Largest entry of each row of ``a`` (last axis) where ``mask`` holds, shape (..., 1);
    -inf on a row without one."""
    return a.masked_fill(~mask, -math.inf).amax(-1, keepdim=True)


def masked_min(a, mask):
    """Smallest entry of each row of ``a`` (last axis) where ``mask`` holds, shape (..., 1);
    +inf on a row without one."""
    return a.masked_fill(~mask, math.inf).amin(-1, keepdim=True)
