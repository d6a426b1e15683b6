"""Projections and the streaming API shared by every attention layer.

A layer maps x of shape (B, T, d_model) to (B, T, d_model): project to per-head q, k, v in the
ops' layout [B, T, H, D], mix them with a pure op, merge the heads and project back. Each layer
also exposes the op's carried state:

* ``forward_with_state(x, state=None) -> (y, state)`` -- prefill / continue a sequence;
* ``step(x_t, state=None) -> (y_t, state)`` -- one token, x_t of shape (B, d_model).

Splitting a sequence into pieces (or single tokens) gives the same outputs as one forward.
The head and input checks and ``step`` are the framework-neutral ones of
:mod:`svtoolkit._layer_core` (shared with the MLX twins of the SV layers).

Rotary positions (:mod:`svtoolkit.torch.rotary`) are an explicit option of the layers whose
class sets ``supports_rotary`` (the softmax family, Infini-attention, Tensor Cache):
``enable_rotary(base)`` rotates q and k by their absolute positions before the op, the
position of a chunk's first token being the ``seen`` counter of the carried state. Every path
then sees rotated keys (a cache stores them rotated, as in any RoPE KV cache). The keyword
``ntk_factor`` of the three calls applies NTK-aware base scaling (evaluation beyond the
trained block); without ``enable_rotary`` a layer has no positional encoding of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from ..._layer_core import check_heads, check_sequence, step_token
from ..rotary import DEFAULT_BASE, apply_rotary, ntk_base
from . import _tensor_ops

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

    #: whether ``enable_rotary`` is available (the carried state has a ``seen`` counter and
    #: q, k enter the op through ``_run``)
    supports_rotary = False

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None, bias: bool = False
    ):
        super().__init__()
        head_dim = check_heads(d_model, n_heads, head_dim)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)
        #: RoPE base, or None (no rotary; the default)
        self.rotary_base: float | None = None

    def enable_rotary(self, base: float = DEFAULT_BASE) -> None:
        """Rotate q and k by their positions from now on (RoPE with this ``base``).

        Raises
        ------
        ValueError
            The layer does not support rotary positions, its head width is odd, or ``base``
            is not a finite number > 1.
        """
        if not self.supports_rotary:
            raise ValueError(f"{type(self).__name__} does not support rotary positions")
        if self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim; got {self.head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (
            1.0 < base < float("inf")
        ):
            raise ValueError(f"base must be a finite number > 1; got {base!r}")
        self.rotary_base = float(base)

    def _rotate(self, q, k, state, ntk_factor):
        """q, k rotated by their absolute positions (unchanged without rotary)."""
        if self.rotary_base is None:
            if ntk_factor != 1.0:
                raise ValueError("ntk_factor needs rotary positions (call enable_rotary)")
            return q, k
        base = self.rotary_base
        if ntk_factor != 1.0:
            base = ntk_base(base, ntk_factor, self.head_dim)
        start = 0 if state is None else int(state.seen)
        return apply_rotary(q, start, base), apply_rotary(k, start, base)

    def _heads(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T, H*D) -> (B, T, H, D)."""
        return _tensor_ops.split_heads(y, self.n_heads, self.head_dim)

    def _check_input(self, x: torch.Tensor) -> None:
        """Check x is a floating-point (B, T, d_model) tensor with T >= 1."""
        check_sequence(x, self.d_model, _tensor_ops)

    def _run(self, x, state, want_state, ntk_factor=1.0):
        self._check_input(x)
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self._rotate(q, k, state, ntk_factor)
        o, state = self._mix(x, q, k, v, state, want_state)
        return self.o_proj(o.to(x.dtype).flatten(-2)), state

    def _mix(self, x, q, k, v, state, want_state):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor, *, ntk_factor: float = 1.0) -> torch.Tensor:
        """Causal mixing of x (B, T, d_model) -> (B, T, d_model).

        ``ntk_factor`` >= 1: NTK-aware scaling of the rotary base (rotary layers only).
        """
        return self._run(x, None, False, ntk_factor)[0]

    def forward_with_state(self, x: torch.Tensor, state=None, *, ntk_factor: float = 1.0):
        """Like ``forward`` but continuing from ``state`` and returning the new state."""
        return self._run(x, state, True, ntk_factor)

    def step(self, x_t: torch.Tensor, state=None, *, ntk_factor: float = 1.0):
        """One token: x_t (B, d_model) -> (y_t (B, d_model), state)."""
        # subclasses without rotary (the SV layers) take no ntk_factor keyword
        options = {} if ntk_factor == 1.0 else {"ntk_factor": ntk_factor}
        return step_token(self, x_t, state, _tensor_ops, **options)
