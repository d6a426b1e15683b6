"""Comparison helpers for testing the ops against their per-token references.

The metric is the relative Frobenius error ``||got - ref|| / ||ref||`` (fla's relative-RMS
metric without its absolute escape hatch); NaN or inf anywhere fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FP64_TOL", "FP32_TOL", "rel_error", "assert_close", "vjp", "cotangents_like"]

FP64_TOL = {"output": 1e-11, "state": 1e-11, "grad": 1e-10}
"""Float64 fast-vs-reference tolerances (observed errors are ~1e-15)."""

FP32_TOL = {"output": 2e-5, "state": 2e-5, "grad": 1e-4}
"""Float32 fast path vs float64 reference (observed errors are ~1e-7 to 1e-6)."""


def rel_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """``||got - ref||_F / ||ref||_F`` in float64 (absolute error when ref is exactly zero)."""
    ref64, got64 = ref.detach().double(), got.detach().double()
    if not torch.isfinite(got64).all() or not torch.isfinite(ref64).all():
        return float("inf")
    scale = ref64.norm().item()
    diff = (got64 - ref64).norm().item()
    return diff / scale if scale > 0 else diff


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    """Fail with the name and the error unless shapes agree and ``rel_error <= tol``."""
    assert tuple(ref.shape) == tuple(got.shape), (
        f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    )
    err = rel_error(ref, got)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def cotangents_like(
    tensors: Sequence[torch.Tensor], generator: torch.Generator
) -> list[torch.Tensor]:
    """Random upstream gradients, one per tensor."""
    return [
        torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=generator) for t in tensors
    ]


def vjp(
    outputs: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``sum_i <outputs_i, cotangents_i>`` with respect to every input."""
    loss = sum((o * c).sum() for o, c in zip(outputs, cotangents, strict=True))
    return torch.autograd.grad(loss, list(inputs))
