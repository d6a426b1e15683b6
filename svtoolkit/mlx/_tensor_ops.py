"""The MLX array operations that the framework-neutral layer control flow runs on.

:mod:`svtoolkit._layer_core` drives the SV layers of :mod:`svtoolkit.mlx.layers` through this
namespace; :mod:`svtoolkit.torch.layers._tensor_ops` is its torch twin, with the same names.
Where the two differ it is for MLX's sake: no autograd tape to switch off (``no_grad``), no
``F.rms_norm`` (``rms_norm`` written out with torch's default eps), keys stored as NumPy
arrays (``stored_keys``; MLX has float64 on the CPU only).
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import numpy as np

from .._gate_core import dtype_name
from .ops import (
    as_numpy64,
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
array_type = mx.array
#: dtypes of the inputs and weights the SV layers compute in (as the torch layers).
SUPPORTED_DTYPES = (mx.float32, mx.float64)

exp = mx.exp
stack = mx.stack
where = mx.where


def is_floating(x):
    return mx.issubdtype(x.dtype, mx.floating)


def dtype_text(dtype):
    """The dtype without its framework (``int64``)."""
    return dtype_name(dtype)


def split_heads(y, n_heads, head_dim):
    """(B, T, H*D) -> (B, T, H, D)."""
    return y.reshape(*y.shape[:-1], n_heads, head_dim)


def merge_heads(o):
    """(..., H, D) -> (..., H*D)."""
    return o.reshape(*o.shape[:-2], o.shape[-2] * o.shape[-1])


def rms_norm(y):
    """Per-head RMS normalisation, ``y / sqrt(mean(y^2) + eps)``, eps the dtype's machine
    epsilon (torch's ``F.rms_norm`` default)."""
    eps = mx.finfo(y.dtype).eps
    return y * mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True) + eps)


def no_grad():
    """Nothing to switch off: MLX differentiates functions, it records no tape (the stored
    values are cut from any graph by :func:`stored_values`)."""
    return contextlib.nullcontext()


def stored_keys(k):
    """(B, H, D) keys -> a float64 ndarray, indexed by sequence."""
    return as_numpy64(k)


def stored_values(v):
    return mx.stop_gradient(v)


def stack_keys(keys, dtype):
    """Stored float64 keys (each of one shape) -> one array of ``dtype``, stacked on axis 0."""
    return mx.array(np.stack(keys), dtype=dtype)


def array(values, dtype):
    return mx.array(values, dtype=dtype)


def concat(arrays, axis):
    return mx.concatenate(arrays, axis)


def heads_first(a):
    """(n, H, ...) -> (H, n, ...)."""
    return mx.swapaxes(a, 0, 1)


# sum: the name of torch's and MLX's reduction (the builtin is not used here)
def sum(a, axis=None):
    return mx.sum(a, axis=axis)


def masked_max(a, mask):
    """Largest entry of each row of ``a`` (last axis) where ``mask`` holds, shape (..., 1);
    -inf on a row without one."""
    return mx.max(mx.where(mask, a, -math.inf), axis=-1, keepdims=True)


def masked_min(a, mask):
    """Smallest entry of each row of ``a`` (last axis) where ``mask`` holds, shape (..., 1);
    +inf on a row without one."""
    return mx.min(mx.where(mask, a, math.inf), axis=-1, keepdims=True)
