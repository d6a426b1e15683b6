"""Projections and the streaming API shared by every attention layer.

A layer maps x of shape (B, T, d_model) to (B, T, d_model): project to per-head q, k, v in the
ops' layout [B, T, H, D], mix them with a pure op, merge the heads and project back. Each layer
also exposes the op's carried state:

* ``forward_with_state(x, state=None) -> (y, state)`` -- prefill / continue a sequence;
* ``step(x_t, state=None) -> (y_t, state)`` -- one token, x_t of shape (B, d_model).

Splitting a sequence into pieces (or single tokens) gives the same outputs as one forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops._common import check_positive_int

__all__ = ["HeadsAttention"]


class HeadsAttention(nn.Module):
    """Base class: q/k/v/o projections around a per-head sequence op.

    Parameters
    ----------
    d_model : int
        Model width.
    n_heads : int
        Number of heads H.
    head_dim : int, optional
        Per-head width D; default ``d_model // n_heads`` (then ``d_model`` must divide evenly).
    bias : bool, default False
        Bias in the projections.

    Subclasses implement ``_mix(x, q, k, v, state, want_state) -> (o [B, T, H, D], state)``.
    """

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None, bias: bool = False
    ):
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                    "or pass head_dim="
                )
            head_dim = d_model // n_heads
        check_positive_int("head_dim", head_dim)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, H*D) -> (B, T, H, D)."""
        return y.unflatten(-1, (self.n_heads, self.head_dim))

    def _check_input(self, x: torch.Tensor) -> None:
        """Check x is a floating-point (B, T, d_model) tensor with T >= 1."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a floating-point tensor; got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor; got dtype {x.dtype}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (B, T, d_model={self.d_model}); got {tuple(x.shape)}"
            )
        if x.shape[1] == 0:
            raise ValueError("the sequence is empty (T = 0); pass at least one token")

    def _run(self, x, state, want_state):
        self._check_input(x)
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        o, state = self._mix(x, q, k, v, state, want_state)
        return self.o_proj(o.to(x.dtype).flatten(-2)), state

    def _mix(self, x, q, k, v, state, want_state):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Causal mixing of x (B, T, d_model) -> (B, T, d_model)."""
        return self._run(x, None, False)[0]

    def forward_with_state(self, x: torch.Tensor, state=None):
        """Like ``forward`` but continuing from ``state`` and returning the new state."""
        return self._run(x, state, True)

    def step(self, x_t: torch.Tensor, state=None):
        """One token: x_t (B, d_model) -> (y_t (B, d_model), state)."""
        if not isinstance(x_t, torch.Tensor) or x_t.ndim != 2:
            shape = tuple(x_t.shape) if isinstance(x_t, torch.Tensor) else type(x_t).__name__
            raise ValueError(f"x_t must have shape (B, d_model={self.d_model}); got {shape}")
        y, state = self.forward_with_state(x_t[:, None], state)
        return y[:, 0], state
