"""Checks of torch inputs shared by the exact gate and the set-level readout."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["check_tensor", "check_keys_shape", "as_numpy64"]


def check_tensor(x, name, ndim=None, shape_text=""):
    """``x`` itself, after checking it is a finite floating-point tensor of ``ndim`` dimensions.

    Parameters
    ----------
    x : Tensor
    name : str
        The argument's name, for the error message.
    ndim : int, optional
        The required number of dimensions (any when None).
    shape_text : str
        The required shape as the message writes it, e.g. ``"(n, d)"``.

    Raises
    ------
    TypeError
        ``x`` is not a tensor, or not of a floating-point dtype.
    ValueError
        ``x`` has another number of dimensions, or holds NaN or inf.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape_text}; got {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return x


def check_keys_shape(keys):
    """At least one key and one feature in ``keys`` of shape (..., n, d); raises ValueError."""
    if keys.shape[-2] == 0:
        raise ValueError(f"keys must hold at least one key; got shape {tuple(keys.shape)}")
    if keys.shape[-1] == 0:
        raise ValueError(f"keys must have at least one feature; got shape {tuple(keys.shape)}")


def as_numpy64(x):
    """A detached C-contiguous float64 NumPy copy of tensor ``x`` (on the CPU), same shape."""
    return np.ascontiguousarray(x.detach().to(device="cpu", dtype=torch.float64).numpy())
