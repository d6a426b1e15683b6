"""Input checks and small helpers shared by the sequence ops.

Every op uses one layout: queries, keys and values are ``[B, T, H, D]`` (batch, time, heads,
head dimension); per-token scalars (gates, rates) are ``[B, T, H]``; matrix states are
``[B, H, K, V]``. Checks raise ``ValueError`` naming the argument and what was wrong.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_qkv",
    "check_per_token",
    "check_per_head",
    "check_state",
    "compute_dtype",
    "gate_weight",
    "l2_normalize",
    "pad_time",
]

L2_EPS = 1e-6
"""Floor on the norm in :func:`l2_normalize` (an all-zero key stays zero instead of NaN)."""


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype the ops compute in: the promotion of all inputs and float32.

    Low-precision inputs (bf16, fp16) are therefore computed in fp32, and fp64 stays fp64.
    """
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {x.dtype}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Check the ``[B, T, H, D]`` layout; return ``(B, T, H, K, V)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must have layout [B, T, H, D]; got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must share [B, T, H] with q; got v {tuple(v.shape)} and q {tuple(q.shape)}"
        )
    batch, length, heads, key_dim = q.shape
    if length == 0:
        raise ValueError("the sequence is empty (T = 0); pass at least one token")
    return batch, length, heads, key_dim, v.shape[-1]


def check_per_token(name: str, x: torch.Tensor, batch: int, length: int, heads: int) -> None:
    """Check a per-token scalar (gate, rate) has shape ``[B, T, H]``."""
    _check_float(name, x)
    if tuple(x.shape) != (batch, length, heads):
        raise ValueError(
            f"{name} must have shape [B, T, H] = {(batch, length, heads)}; got {tuple(x.shape)}"
        )


def check_per_head(name: str, x: torch.Tensor, heads: int) -> None:
    """Check a per-head parameter has shape ``[H]``."""
    _check_float(name, x)
    if tuple(x.shape) != (heads,):
        raise ValueError(f"{name} must have shape [H] = ({heads},); got {tuple(x.shape)}")


def gate_weight(gate: torch.Tensor, batch: int, length: int, heads: int) -> torch.Tensor:
    """Check a gate of shape ``[H]`` or ``[B, T, H]``; return it broadcastable to [B, T, H, 1]."""
    if gate.ndim == 1:
        check_per_head("gate", gate, heads)
        return gate[None, None, :, None]
    if tuple(gate.shape) != (batch, length, heads):
        raise ValueError(
            f"gate must have shape [H] or [B, T, H] = {(batch, length, heads)}; "
            f"got {tuple(gate.shape)}"
        )
    return gate[..., None]


def check_state(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check a state tensor has the expected shape."""
    _check_float(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(x.shape)}")


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / max(||x||, eps)`` over the last dimension."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def pad_time(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dimension 1 (time) of ``x`` up to ``length``."""
    missing = length - x.shape[1]
    if missing == 0:
        return x
    pad_shape = (x.shape[0], missing, *x.shape[2:])
    return torch.cat([x, x.new_zeros(pad_shape)], dim=1)
