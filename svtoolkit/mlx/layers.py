"""SV-Attention sequence layers in MLX: the twin of :mod:`svtoolkit.torch.layers.sv`.

``CausalSVAttention`` and ``HybridSVAttention`` are ``mlx.nn.Module``s with the parameters,
defaults, checks and semantics of the torch layers (Forgetful Attention (arXiv:2607.12204),
§3.5, Fig. 2, App. C): per-head RMS-normalised queries and keys with ``sigma = sqrt(2 D)`` by
default (``qk_norm="rms"``) or the raw projections with ``sigma = 2`` (``qk_norm="none"``),
the gate of chunk ``c`` fit on the causal prefix ``[0, c * chunk)``, multipliers ``a_i / C``
(1 when the gate is off: warm-up below ``ceil(1/C) + 2`` keys or an invalid batched solve),
the first chunk of the pure gate outputting 0, and ``exclude`` removing tokens from
gates and readouts. The ops are in :mod:`svtoolkit.mlx.ops`.

* ``layer(x, exclude=None)`` - **training path**: all (sequence, head, chunk) problems in one
  batched call of :func:`svtoolkit.mlx.fista_svdd` (partition finder), then
  one :func:`svtoolkit.mlx.ridged_svdd_solve` call over every boundary (``groups=``:
  each problem on its sequence-head's Gram; differentiable through its custom VJP; the
  partition is held fixed). Approximate, **no certificate**.
* ``layer.forward_exact(x, exclude=None)`` - the same readout on coefficients from the exact
  fp64 solver (:class:`svtoolkit.IncrementalSVDD`, NumPy; no gradient through the gate).
* ``layer.forward_with_state(x, state)`` / ``layer.step(x_t, state)`` - **exact streaming
  inference** (:class:`SVStreamState`): keys are admitted at chunk boundaries, certified
  reserve keys are evicted under an optional budget, and ``state.forget(b, position)`` deletes a
  token, with the deletion semantics of the torch layers (every later output equals
  ``forward_exact`` with the token excluded). The bookkeeping is the framework-neutral
  :class:`svtoolkit._gate_core.ExactStream` the torch state uses.

The control flow of the checks, the three paths and the streaming readout is written once, for
both frameworks, in :mod:`svtoolkit._layer_core`; this module supplies the MLX array operations
(:mod:`svtoolkit.mlx._tensor_ops`), the projections and the public methods.

Weights come from a torch layer with :func:`from_torch` (or ``Class.from_torch``).

MLX notes: ``mx.linalg.solve`` runs on the CPU stream, so the ridged solve runs there on every
device; float64 exists on the CPU only, and MLX 0.32's float64 ``exp`` is float32-accurate
(docs/batched.md), so float64 MLX layers agree with torch to about 1e-7, not 1e-12.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .._layer_core import (
    HybridSVLayerCore,
    SVLayerCore,
    SVStreamCore,
    check_heads,
    check_switches,
    gate_spacing,
    step_token,
)
from . import _tensor_ops

__all__ = ["CausalSVAttention", "HybridSVAttention", "SVStreamState", "from_torch"]


class CausalSVAttention(SVLayerCore, nn.Module):
    """Chunk-frozen SV-Attention (MLX): each chunk's queries read the SVDD gate of the causal
    prefix. Parameters, defaults and checks as :class:`svtoolkit.torch.CausalSVAttention`.

    Parameters
    ----------
    d_model, n_heads : int
    C : float, default 0.25
    sigma : float, optional
        RBF width; default ``sqrt(2 D)`` with ``qk_norm="rms"``, ``2.0`` with
        ``qk_norm="none"`` (an explicit value always wins).
    chunk : int, default 64
    fista_iters : int, default 80
    ridge : float, default 1e-3
    gate : {"svdd", "uniform"}, default "svdd"
    gate_update : {"chunk", "token"}, default "chunk"
        The ablation switches of the torch layer (see there).
    qk_norm : {"rms", "none"}, default "rms"
        Per-head RMS-normalised queries and keys, or the raw learned projections (the
        paper's layer; see the torch layer).
    head_dim : int, optional
        Default ``d_model // n_heads``.
    bias : bool, default False
        Bias in the q/k/v/o projections.

    Examples
    --------
    >>> import mlx.core as mx
    >>> from svtoolkit.mlx import HybridSVAttention
    >>> layer = HybridSVAttention(16, 2, chunk=4)
    >>> layer(mx.random.normal((1, 10, 16), key=mx.random.key(0))).shape
    (1, 10, 16)
    """

    # the control flow is svtoolkit._layer_core's; these are the array operations it runs on
    ops = _tensor_ops

    def __init__(self, d_model, n_heads, *, C=0.25, sigma=None, chunk=64, fista_iters=80,
                 ridge=1e-3, gate="svdd", gate_update="chunk", qk_norm="rms", head_dim=None,
                 bias=False):
        super().__init__()
        switches = check_switches(gate, gate_update, qk_norm)
        head_dim = check_heads(d_model, n_heads, head_dim)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self._set_gate_options(switches, C=C, sigma=sigma, chunk=chunk,
                               fista_iters=fista_iters, ridge=ridge)
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)

    @property
    def gate_chunk(self):
        """Spacing of the gate boundaries: ``chunk``, or 1 with ``gate_update="token"``."""
        return gate_spacing(self.gate_update, self.chunk)

    # ------------------------------------------------------------------ the three paths
    def __call__(self, x, exclude=None):
        """Training path: x (B, T, d_model) -> (B, T, d_model), batched approximate gate."""
        return self._forward(x, False, exclude)

    def forward_exact(self, x, exclude=None):
        """Exact-gate path: the same readout on coefficients from the fp64 exact solver."""
        return self._forward(x, True, exclude)

    def gate(self, x, *, exact=False, exclude=None):
        """The gate coefficients of every gate boundary (:class:`MLXSVGate`) for input x."""
        return self._gate_for(x, exact, exclude)

    def init_state(self, batch_size, *, budget=None):
        """A fresh exact streaming state for ``batch_size`` sequences (see SVStreamState)."""
        return SVStreamState(self, batch_size, budget=budget)

    def forward_with_state(self, x, state=None):
        """Exact streaming: continue the sequences of ``state`` with x (B, T, d_model).

        Inference only (the outputs are not meant to be differentiated).
        """
        return self._stream(x, state)

    def step(self, x_t, state=None):
        """One token: x_t (B, d_model) -> (y_t (B, d_model), state)."""
        return step_token(self, x_t, state, self.ops)

    @classmethod
    def from_torch(cls, module):
        """An MLX layer with the options and a copy of the weights of a torch SV layer
        (float64 weights stay float64 - CPU only in MLX - everything else becomes float32)."""
        if bool(module.hybrid) != bool(cls.hybrid):
            raise TypeError(f"{cls.__name__}.from_torch needs a "
                            f"{'hybrid' if cls.hybrid else 'chunk-frozen'} torch SV layer; got "
                            f"{type(module).__name__}")
        switches = {"gate": module.gate_mode, "gate_update": module.gate_update,
                    "qk_norm": module.qk_norm}
        if cls.hybrid:
            switches["prefix_weighting"] = module.prefix_weighting
        layer = cls(module.d_model, module.n_heads, C=module.C, sigma=module.sigma,
                    chunk=module.chunk, fista_iters=module.fista_iters, ridge=module.ridge,
                    head_dim=module.head_dim, bias=module.q_proj.bias is not None, **switches)
        weights = [(name, _mlx_weight(tensor)) for name, tensor in module.state_dict().items()]
        layer.load_weights(weights, strict=True)
        return layer


class HybridSVAttention(HybridSVLayerCore, CausalSVAttention):
    """SV-Attention with a dense local path (MLX): learned q.k softmax over [0, t], prefix keys
    times their gate multiplier ``a_i / C``, keys of t's own chunk read directly. Same
    parameters as :class:`CausalSVAttention`, plus ``prefix_weighting`` ("normalized" or
    "raw", as the torch layer)."""


class SVStreamState(SVStreamCore):
    """Exact streaming state of one MLX SV layer for ``batch_size`` sequences.

    The twin of :class:`svtoolkit.torch.layers.SVStreamState`: the same framework-neutral
    bookkeeping (:class:`svtoolkit._gate_core.ExactStream`: admission at chunk boundaries,
    certified eviction under ``budget``, ``forget``) and readout (:mod:`svtoolkit._layer_core`),
    run on MLX arrays. Keys are stored as float64 ndarrays of shape (H, D), values as MLX arrays
    of shape (H, Dv).

    Parameters
    ----------
    layer : CausalSVAttention or HybridSVAttention
    batch_size : int
    budget : int, optional
        Admitted keys per (sequence, head) above which certified reserve keys are evicted at a
        boundary (see the torch state).
    """

    def forget(self, b, position):
        """Delete token ``position`` of sequence ``b`` from the memory.

        Parameters
        ----------
        b, position : int
            Any integer (Python, NumPy or a 0-d integer MLX array).

        Returns
        -------
        str
            ``"decremented"``, ``"masked"`` or ``"evicted"``, as the torch state.

        Raises
        ------
        TypeError
            ``b`` or ``position`` is not an integer.
        IndexError
            ``b`` out of range, or ``position`` not seen yet.
        KeyError
            ``position`` already forgotten.

        Notes
        -----
        A refused call changes nothing: every check runs before the first change.
        """
        return super().forget(b, position)


def _mlx_weight(tensor):
    """A torch weight as an MLX array: float64 stays float64, every other floating dtype
    (float32, float16, bfloat16 - NumPy has no bfloat16) becomes float32."""
    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        raise TypeError(f"from_torch copies floating-point weights; got dtype {tensor.dtype}")
    wide = tensor.element_size() == 8
    array = (tensor.double() if wide else tensor.float()).numpy()
    return mx.array(array, dtype=mx.float64 if wide else mx.float32)


def from_torch(module):
    """The MLX twin (:class:`CausalSVAttention` or :class:`HybridSVAttention`) of a torch SV
    layer, with a copy of its weights."""
    if not hasattr(module, "hybrid") or not hasattr(module, "fista_iters"):
        raise TypeError(f"from_torch needs a torch CausalSVAttention or HybridSVAttention; got "
                        f"{type(module).__name__}")
    cls = HybridSVAttention if module.hybrid else CausalSVAttention
    return cls.from_torch(module)
