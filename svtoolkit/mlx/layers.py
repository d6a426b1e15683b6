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
  :func:`svtoolkit.mlx.ridged_svdd_solve` per boundary (differentiable through its custom
  VJP; the partition is held fixed). Approximate, **no certificate**.
* ``layer.forward_exact(x, exclude=None)`` - the same readout on coefficients from the exact
  fp64 solver (:class:`svtoolkit.IncrementalSVDD`, NumPy; no gradient through the gate).
* ``layer.forward_with_state(x, state)`` / ``layer.step(x_t, state)`` - **exact streaming
  inference** (:class:`SVStreamState`): keys are admitted at chunk boundaries, certified
  reserve keys are evicted under an optional budget, and ``state.forget(b, position)`` deletes a
  token, with the deletion semantics of the torch layers (every later output equals
  ``forward_exact`` with the token excluded). The bookkeeping is the framework-neutral
  :class:`svtoolkit._gate_core.ExactStream` the torch state uses.

Weights come from a torch layer with :func:`from_torch` (or ``Class.from_torch``).

MLX notes: ``mx.linalg.solve`` runs on the CPU stream, so the ridged solve runs there on every
device; float64 exists on the CPU only, and MLX 0.32's float64 ``exp`` is float32-accurate
(docs/batched.md), so float64 MLX layers agree with torch to about 1e-7, not 1e-12.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .._gate_core import (
    GATE_MODES,
    GATE_UPDATES,
    PREFIX_WEIGHTINGS,
    QK_NORMS,
    ExactStream,
    GateOptions,
    default_sigma,
    dtype_name,
    unsupported_dtype,
)
from .._validation import check_int, check_option
from .ops import (
    MLXSVGate,
    as_numpy64,
    exact_sv_gate,
    sv_gate,
    sv_hybrid_readout,
    sv_rbf_readout,
    uniform_sv_gate,
)

__all__ = [
    "CausalSVAttention",
    "HybridSVAttention",
    "SVStreamState",
    "from_torch",
    # the ops, re-exported from svtoolkit.mlx.ops (their old home)
    "MLXSVGate",
    "sv_gate",
    "exact_sv_gate",
    "sv_rbf_readout",
    "sv_hybrid_readout",
]

#: dtypes of the inputs and weights the SV layers compute in (as the torch layers).
SUPPORTED_DTYPES = (mx.float32, mx.float64)


class CausalSVAttention(nn.Module):
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

    hybrid = False
    prefix_weighting = "normalized"

    def __init__(self, d_model, n_heads, *, C=0.25, sigma=None, chunk=64, fista_iters=80,
                 ridge=1e-3, gate="svdd", gate_update="chunk", qk_norm="rms", head_dim=None,
                 bias=False):
        super().__init__()
        self.gate_mode = check_option(gate, "gate", GATE_MODES)
        self.gate_update = check_option(gate_update, "gate_update", GATE_UPDATES)
        self.qk_norm = check_option(qk_norm, "qk_norm", QK_NORMS)
        check_int(d_model, "d_model", min=1)
        check_int(n_heads, "n_heads", min=1)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads "
                                 f"({n_heads}), or pass head_dim=")
            head_dim = d_model // n_heads
        check_int(head_dim, "head_dim", min=1)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        gate_options = GateOptions(
            C=C, sigma=default_sigma(self.qk_norm, head_dim) if sigma is None else sigma,
            chunk=chunk, ridge=ridge)
        fista_iters = check_int(fista_iters, "fista_iters", min=1)
        #: the checked options of the gate (framework-neutral, as in the torch layers)
        self.gate_options = dataclasses.replace(gate_options, iters=fista_iters)
        self.C, self.sigma, self.chunk = gate_options.C, gate_options.sigma, gate_options.chunk
        self.fista_iters, self.ridge = fista_iters, gate_options.ridge
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)

    # ------------------------------------------------------------------ projections
    def _check_input(self, x):
        """x is a float32/float64 (B, T, d_model) array with T >= 1 (the torch checks)."""
        if not isinstance(x, mx.array) or not mx.issubdtype(x.dtype, mx.floating):
            got = f"dtype {dtype_name(x.dtype)}" if isinstance(x, mx.array) else type(x).__name__
            raise TypeError(f"x must be a floating-point tensor; got {got}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, T, d_model={self.d_model}); got "
                             f"{tuple(x.shape)}")
        if x.shape[1] == 0:
            raise ValueError("the sequence is empty (T = 0); pass at least one token")
        weight = self.q_proj.weight.dtype
        if x.dtype not in SUPPORTED_DTYPES or weight not in SUPPORTED_DTYPES:
            raise TypeError(unsupported_dtype(type(self).__name__, x.dtype, weight))

    def _rms(self, y):
        """Per-head RMS normalisation, ``y / sqrt(mean(y^2) + eps)``, eps the dtype's machine
        epsilon (torch's ``F.rms_norm`` default)."""
        eps = mx.finfo(y.dtype).eps
        return y * mx.rsqrt(mx.mean(y * y, axis=-1, keepdims=True) + eps)

    def _qkv(self, x):
        self._check_input(x)
        B, T, _ = x.shape
        shape = (B, T, self.n_heads, self.head_dim)
        q = self.q_proj(x).reshape(shape)
        k = self.k_proj(x).reshape(shape)
        v = self.v_proj(x).reshape(shape)
        if self.qk_norm == "none":
            return q, k, v
        return self._rms(q), self._rms(k), v

    @property
    def gate_chunk(self):
        """Spacing of the gate boundaries: ``chunk``, or 1 with ``gate_update="token"``."""
        return 1 if self.gate_update == "token" else self.chunk

    def _readout(self, q, k, v, gate, exclude):
        if self.hybrid:
            return sv_hybrid_readout(q, k, v, gate, chunk=self.gate_chunk, exclude=exclude,
                                     prefix_weighting=self.prefix_weighting)
        return sv_rbf_readout(q, k, v, gate, sigma=self.sigma, chunk=self.gate_chunk,
                              exclude=exclude, shift=self.qk_norm == "none")

    def _gate_of(self, k, exact, exclude):
        if self.gate_mode == "uniform":
            return uniform_sv_gate(k, C=self.C, chunk=self.gate_chunk, exclude=exclude)
        if exact:
            return exact_sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.gate_chunk,
                                 exclude=exclude)
        return sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.gate_chunk,
                       iters=self.fista_iters, ridge=self.ridge, exclude=exclude)

    def _project_out(self, o):
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))

    # ------------------------------------------------------------------ the three paths
    def __call__(self, x, exclude=None):
        """Training path: x (B, T, d_model) -> (B, T, d_model), batched approximate gate."""
        q, k, v = self._qkv(x)
        gate = self._gate_of(k, False, exclude)
        return self._project_out(self._readout(q, k, v, gate, exclude))

    def forward_exact(self, x, exclude=None):
        """Exact-gate path: the same readout on coefficients from the fp64 exact solver."""
        q, k, v = self._qkv(x)
        gate = self._gate_of(k, True, exclude)
        return self._project_out(self._readout(q, k, v, gate, exclude))

    def gate(self, x, *, exact=False, exclude=None):
        """The gate coefficients of every gate boundary (:class:`MLXSVGate`) for input x."""
        _, k, _ = self._qkv(x)
        return self._gate_of(k, exact, exclude)

    def init_state(self, batch_size, *, budget=None):
        """A fresh exact streaming state for ``batch_size`` sequences (see SVStreamState)."""
        return SVStreamState(self, batch_size, budget=budget)

    def forward_with_state(self, x, state=None):
        """Exact streaming: continue the sequences of ``state`` with x (B, T, d_model).

        Inference only (the outputs are not meant to be differentiated).
        """
        self._check_input(x)
        if state is None:
            state = self.init_state(x.shape[0])
        if state.layer is not self or state.batch_size != x.shape[0]:
            raise ValueError("state belongs to another layer or batch size")
        outs = [state._push(self, x[:, t]) for t in range(x.shape[1])]
        return mx.stack(outs, axis=1), state

    def step(self, x_t, state=None):
        """One token: x_t (B, d_model) -> (y_t (B, d_model), state)."""
        if not isinstance(x_t, mx.array) or x_t.ndim != 2:
            shape = tuple(x_t.shape) if isinstance(x_t, mx.array) else type(x_t).__name__
            raise ValueError(f"x_t must have shape (B, d_model={self.d_model}); got {shape}")
        y, state = self.forward_with_state(x_t[:, None], state)
        return y[:, 0], state

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


class HybridSVAttention(CausalSVAttention):
    """SV-Attention with a dense local path (MLX): learned q.k softmax over [0, t], prefix keys
    times their gate multiplier ``a_i / C``, keys of t's own chunk read directly. Same
    parameters as :class:`CausalSVAttention`, plus ``prefix_weighting`` ("normalized" or
    "raw", as the torch layer)."""

    hybrid = True

    def __init__(self, d_model, n_heads, *, prefix_weighting="normalized", **options):
        prefix_weighting = check_option(prefix_weighting, "prefix_weighting",
                                        PREFIX_WEIGHTINGS)
        super().__init__(d_model, n_heads, **options)
        self.prefix_weighting = prefix_weighting


class SVStreamState(ExactStream):
    """Exact streaming state of one MLX SV layer for ``batch_size`` sequences.

    The twin of :class:`svtoolkit.torch.layers.SVStreamState`: the same framework-neutral
    bookkeeping (:class:`svtoolkit._gate_core.ExactStream`: admission at chunk boundaries,
    certified eviction under ``budget``, ``forget``) with an MLX readout. Keys are stored as
    float64 ndarrays of shape (H, D), values as MLX arrays of shape (H, Dv).

    Parameters
    ----------
    layer : CausalSVAttention or HybridSVAttention
    batch_size : int
    budget : int, optional
        Admitted keys per (sequence, head) above which certified reserve keys are evicted at a
        boundary (see the torch state).
    """

    def __init__(self, layer, batch_size, *, budget=None):
        super().__init__(layer.C, layer.sigma, layer.gate_chunk, layer.n_heads, batch_size,
                         budget=budget, gate=layer.gate_mode,
                         prefix_weighting=layer.prefix_weighting)
        self.layer = layer

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

    def _push(self, layer, x_t):
        """Process one token for every sequence: x_t (B, d_model) -> y_t (B, d_model)."""
        q, k, v = layer._qkv(x_t[:, None])
        q, k, v = q[:, 0], k[:, 0], mx.stop_gradient(v[:, 0])  # (B, H, D)
        keys = as_numpy64(k)
        t = self.begin_token()
        outs = []
        for b in range(self.batch_size):
            self.store(b, t, keys[b], v[b])
            outs.append(self._read(layer, b, q[b]))
        self.end_token()
        B = self.batch_size
        return layer.o_proj(mx.stack(outs).reshape(B, layer.n_heads * layer.head_dim))

    def _read(self, layer, b, q):
        """Readout of one query (H, D) of sequence b -> (H, Dv), as the torch state (RBF
        weights from coordinate differences, as there)."""
        outs = []
        for h in range(layer.n_heads):
            prefix, mult = self.read_sets(b, h, layer.hybrid)
            if not prefix:
                outs.append(mx.zeros_like(self.values[b][self.position][h]))
                continue
            keys = mx.array(np.stack([self.keys[b][p][h] for p in prefix]), dtype=q.dtype)
            values = mx.stack([self.values[b][p][h] for p in prefix])
            weight = mx.array(mult, dtype=q.dtype)
            if layer.hybrid:
                logits = keys @ q[h] / math.sqrt(layer.head_dim)
                weight = weight * mx.exp(logits - mx.max(logits))
            else:
                sq = mx.sum((keys - q[h]) ** 2, axis=-1)
                readable = weight > 0
                if layer.qk_norm == "none" and mx.any(readable).item():
                    # the readout's shift (see sv_rbf_readout); unreadable keys unshifted
                    inf = mx.array(math.inf, dtype=sq.dtype)
                    sq = mx.where(readable, sq - mx.min(mx.where(readable, sq, inf)), sq)
                weight = weight * mx.exp(-sq / layer.sigma**2)
            total = mx.sum(weight)
            outs.append(weight @ values / total if total.item() > 0
                        else mx.zeros_like(values[0]))
        return mx.stack(outs)


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
