"""Rotary position embeddings (RoPE) with NTK-aware base scaling.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021): each head
vector is split into D/2 coordinate pairs and pair j of the vector at position p is rotated by
the angle ``p * theta_j`` with ``theta_j = base ** (-2 j / D)``, so that
``<R_p q, R_s k> = <q, R_{s-p} k>`` depends on the positions only through their offset.
Applied to queries and keys (never to values) inside an attention layer.

NTK-aware scaling (the "NTK-aware scaled RoPE" of the LocalLLaMA community, as used for the
Full-KV baseline of Tensor Cache, §4.1 and §4.4): to evaluate at ``factor`` times the trained
context, the base is enlarged to ``base * factor ** (D / (D - 2))``. The highest frequency
(``theta_0 = 1``) is unchanged and the lowest one is divided by ``factor``, so the longest
wavelength stretches over the longer context instead of rotating into angles never seen in
training.

Pair layout: "rotate half" (GPT-NeoX): pair j is coordinates ``(j, j + D/2)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DEFAULT_BASE", "apply_rotary", "ntk_base", "rotary_angles"]

#: The RoFormer base.
DEFAULT_BASE = 10_000.0


def _check_factor(factor) -> float:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
        math.isfinite(factor) and factor >= 1.0
    ):
        raise ValueError(f"factor must be a finite number >= 1; got {factor!r}")
    return float(factor)


def ntk_base(base: float, factor: float, head_dim: int) -> float:
    """NTK-aware base for evaluating at ``factor`` times the trained context.

    Parameters
    ----------
    base : float
        Trained base (> 1).
    factor : float
        Evaluation length over trained length, >= 1 (1 returns ``base`` unchanged).
    head_dim : int
        Even head width D >= 4.

    Returns
    -------
    float
        ``base * factor ** (D / (D - 2))``.
    """
    factor = _check_factor(factor)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 4 or head_dim % 2:
        raise ValueError(f"head_dim must be an even int >= 4 for NTK scaling; got {head_dim!r}")
    return float(base) * factor ** (head_dim / (head_dim - 2))


def rotary_angles(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """Angles ``p * base ** (-2 j / D)`` in float64.

    Parameters
    ----------
    positions : Tensor of shape (T,)
        Absolute positions (integers).
    head_dim : int
        Even D.
    base : float

    Returns
    -------
    Tensor of shape (T, D // 2), float64
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = float(base) ** (-exponents)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def apply_rotary(x: torch.Tensor, start: int, base: float = DEFAULT_BASE) -> torch.Tensor:
    """Rotate per-head vectors by their positions ``start, start + 1, ...``.

    Parameters
    ----------
    x : Tensor of shape (B, T, H, D)
        Queries or keys, D even.
    start : int
        Absolute position of ``x[:, 0]`` (the tokens already streamed).
    base : float, default 10000
        RoPE base (pass :func:`ntk_base` for NTK-aware scaling).

    Returns
    -------
    Tensor of shape (B, T, H, D), dtype of ``x``

    Notes
    -----
    The angles are computed in float64 from integer positions and only then cast, so a token
    gets bit-identical rotations whether it is processed in a long forward, a chunk or alone.
    """
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape (B, T, H, D) with D even; got {tuple(x.shape)}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int; got {start!r}")
    length, dim = x.shape[1], x.shape[-1]
    angles = rotary_angles(torch.arange(start, start + length), dim, base)
    cos = angles.cos().to(x.dtype).to(x.device)[None, :, None, :]
    sin = angles.sin().to(x.dtype).to(x.device)[None, :, None, :]
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
