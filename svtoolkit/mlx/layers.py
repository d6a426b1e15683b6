"""SV-Attention sequence layers in MLX: the twin of :mod:`svtoolkit.torch.layers.sv`.

``CausalSVAttention`` and ``HybridSVAttention`` are ``mlx.nn.Module``s with the parameters,
defaults and semantics of the torch layers (paper 000 §3.5, Fig. 2, App. C): per-head
RMS-normalised queries and keys, ``sigma = sqrt(2 D)`` by default, the gate of chunk ``c`` fit
on the causal prefix ``[0, c * chunk)``, multipliers ``a_i / C`` (1 when the gate is off: warm-up
below ``ceil(1/C) + 2`` keys or an invalid batched solve), the first chunk of the pure gate
outputting 0, and ``exclude`` removing tokens from gates and readouts.

* ``layer(x, exclude=None)`` - **training path**: all (sequence, head, chunk) problems in one
  batched call of :func:`svtoolkit.mlx.fista_svdd` (partition finder), then
  :func:`svtoolkit.mlx.ridged_svdd_solve` per boundary (differentiable through its custom
  VJP; the partition is held fixed). Approximate, **no certificate**.
* ``layer.forward_exact(x, exclude=None)`` - the same readout on coefficients from the exact
  fp64 solver (:class:`svtoolkit.IncrementalSVDD`, NumPy; no gradient through the gate).

Weights come from a torch layer with :func:`from_torch` (or ``Class.from_torch``). The exact
streaming API (``step``, ``forget``, certified eviction) is torch-only.

MLX notes: ``mx.linalg.solve`` runs on the CPU stream, so the ridged solve runs there on every
device; float64 exists on the CPU only, and MLX 0.32's float64 ``exp`` is float32-accurate
(docs/batched.md), so float64 MLX layers agree with torch to about 1e-7, not 1e-12.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..exact import IncrementalSVDD
from .batched import fista_svdd, partition_masks, ridged_svdd_solve

__all__ = [
    "CausalSVAttention",
    "HybridSVAttention",
    "MLXSVGate",
    "from_torch",
    "sv_gate",
    "exact_sv_gate",
    "sv_rbf_readout",
    "sv_hybrid_readout",
]


# ------------------------------------------------------------------------------ gate helpers
def _warmup_size(C):
    """Smallest gated prefix: ``ceil(1 / C) + 2`` keys (as the torch op)."""
    return math.ceil(1.0 / C - 1e-12) + 2


def _chunk_ends(T, chunk):
    return list(range(chunk, T, chunk))


def _rbf_gram(a, b, sigma):
    """``exp(-||a_i - b_j||^2 / sigma^2)``, (..., T, D) x (..., S, D) -> (..., T, S)."""
    sq = mx.sum(a * a, axis=-1)[..., :, None] + mx.sum(b * b, axis=-1)[..., None, :]
    sq = sq - 2.0 * (a @ mx.swapaxes(b, -1, -2))
    return mx.exp(-mx.maximum(sq, 0.0) / (sigma * sigma))


def _keep(exclude, B, T):
    if exclude is None:
        return mx.ones((B, T), dtype=mx.bool_)
    if not isinstance(exclude, mx.array) or exclude.dtype != mx.bool_ or tuple(
        exclude.shape
    ) != (B, T):
        desc = (f"{exclude.dtype} {tuple(exclude.shape)}" if isinstance(exclude, mx.array)
                else type(exclude).__name__)
        raise ValueError(f"exclude must be a bool array of shape (B, T) = {(B, T)}; got {desc}")
    return ~exclude


def _prefix_masks(keep, ends):
    """(G, P) keep -> (G, J, P): key i belongs to boundary j's problem iff kept and < ends[j]."""
    P = keep.shape[-1]
    inside = mx.arange(P)[None, :] < mx.array(ends)[:, None]
    return keep[:, None, :] & inside[None]


class MLXSVGate:
    """Gate coefficients at every chunk boundary (the MLX twin of ``SVGate``).

    Attributes
    ----------
    alpha : mlx.core.array of shape (B, H, J, P)
        Coefficients of boundary j over the keys ``[0, ends[j])`` (0 beyond), P = ends[-1].
    gated : mlx.core.array of shape (B, H, J), bool
        False where the gate is off (warm-up, invalid problem).
    ends : list of int
    C : float
    exact : bool
    """

    def __init__(self, alpha, gated, ends, C, exact):
        self.alpha, self.gated, self.ends, self.C, self.exact = alpha, gated, ends, C, exact

    def multipliers(self):
        """(B, H, J, P): ``max(a / C, 0)`` where gated, 1 where not, 0 beyond each prefix."""
        B, H, J, P = self.alpha.shape
        inside = (mx.arange(P)[None, :] < mx.array(self.ends)[:, None]).astype(self.alpha.dtype)
        ones = mx.broadcast_to(inside, (B, H, J, P))
        return mx.where(self.gated[..., None], mx.maximum(self.alpha / self.C, 0.0), ones)


def sv_gate(k, *, C, sigma, chunk, iters=80, ridge=1e-3, tol=1e-3, exclude=None):
    """Batched, differentiable (approximate) gate coefficients at every chunk boundary.

    Parameters
    ----------
    k : mlx.core.array of shape (B, T, H, D)
    C, sigma : float
    chunk : int
    iters, ridge, tol : see :func:`svtoolkit.mlx.fista_svdd`, :func:`ridged_svdd_solve`,
        :func:`partition_masks`.
    exclude : mlx.core.array of shape (B, T), bool, optional

    Returns
    -------
    MLXSVGate
        ``alpha`` differentiable in k through the ridged solve (partition held fixed).

    Notes
    -----
    The B * H * J prefix problems share one Gram matrix per (sequence, head); they are
    packed into one FISTA call of B * H * J problems padded to P keys, masked by prefix (each
    problem's result depends only on its own prefix, so the layer is exactly causal).
    """
    B, T, H, D = k.shape
    ends = _chunk_ends(T, chunk)
    J = len(ends)
    if J == 0:
        return MLXSVGate(mx.zeros((B, H, 0, 0), dtype=k.dtype),
                         mx.zeros((B, H, 0), dtype=mx.bool_), ends, C, False)
    P = ends[-1]
    keys = mx.swapaxes(k[:, :P], 1, 2)  # (B, H, P, D)
    gram = _rbf_gram(keys, keys, sigma).reshape(B * H, P, P)
    keep = _keep(exclude, B, T)[:, :P]
    keep_g = mx.broadcast_to(keep[:, None, :], (B, H, P)).reshape(B * H, P)
    masks = _prefix_masks(keep_g, ends)  # (G, J, P)
    G = B * H
    stacked = mx.broadcast_to(mx.stop_gradient(gram)[:, None], (G, J, P, P)).reshape(G * J, P, P)
    alpha0 = fista_svdd(stacked, C, mask=masks.reshape(G * J, P), iters=iters).reshape(G, J, P)
    alphas, gated = [], []
    for j in range(J):
        margin, error = partition_masks(alpha0[:, j], C, tol=tol, mask=masks[:, j])
        a, _, valid = ridged_svdd_solve(gram, C, margin, error, ridge=ridge, mask=masks[:, j])
        count = mx.sum(masks[:, j], axis=-1)
        alphas.append(a)
        gated.append(valid & (count >= _warmup_size(C)))
    alpha = mx.stack(alphas, axis=1).reshape(B, H, J, P)
    return MLXSVGate(alpha, mx.stack(gated, axis=1).reshape(B, H, J), ends, C, False)


def exact_sv_gate(k, *, C, sigma, chunk, exclude=None):
    """Gate coefficients from the exact fp64 solver, one IncrementalSVDD per (sequence, head),
    each chunk admitted at its end (no gradient). ``alpha`` is returned in k's dtype."""
    B, T, H, D = k.shape
    ends = _chunk_ends(T, chunk)
    J = len(ends)
    P = ends[-1] if J else 0
    keep = np.array(_keep(exclude, B, T))
    keys = np.array(mx.stop_gradient(k).astype(mx.float32 if k.dtype != mx.float64
                                                 else mx.float64), dtype=np.float64)
    alpha = np.zeros((B, H, J, P))
    gated = np.zeros((B, H, J), dtype=bool)
    for b in range(B):
        for h in range(H):
            solver = IncrementalSVDD(C, sigma)
            position = {}
            start = 0
            for j, end in enumerate(ends):
                for t in range(start, end):
                    if keep[b, t]:
                        position[solver.add(keys[b, t, h])] = t
                start = end
                if solver.certified and len(solver) >= _warmup_size(C):
                    gated[b, h, j] = True
                    alpha[b, h, j, [position[i] for i in solver.ids]] = solver.alpha
    return MLXSVGate(mx.array(alpha, dtype=k.dtype), mx.array(gated), ends, C, True)


def _rows_of(table, T, chunk):
    """(B, H, J, P) per-boundary rows -> (B, H, T, T) per query (chunk 0: zeros)."""
    B, H, J, P = table.shape
    if J == 0:
        return mx.zeros((B, H, T, T), dtype=table.dtype)
    body = mx.pad(table, [(0, 0), (0, 0), (0, 0), (0, T - P)])
    padded = mx.concatenate([mx.zeros((B, H, 1, T), dtype=table.dtype), body], axis=2)
    return mx.take(padded, mx.arange(T) // chunk, axis=2)


def _safe_ratio(num, den):
    """num / den with 0 where den is 0 (never NaN, also in the backward pass)."""
    ok = den > 0
    safe = mx.where(ok, den, mx.ones_like(den))
    return mx.where(ok[..., None], num / safe[..., None], mx.zeros_like(num))


def sv_rbf_readout(q, k, v, gate, *, sigma, chunk, exclude=None):
    """Chunk-frozen RBF readout (q, k (B, T, H, D), v (B, T, H, Dv) -> (B, T, H, Dv)):
    ``o_t = sum m_i k(q_t, k_i) v_i / sum m_i k(q_t, k_i)`` over the prefix of t's chunk."""
    B, T, H, D = q.shape
    qh, kh, vh = (mx.swapaxes(x, 1, 2) for x in (q, k, v))
    weights = _rbf_gram(qh, kh, sigma) * _rows_of(gate.multipliers().astype(q.dtype), T, chunk)
    weights = weights * _keep(exclude, B, T)[:, None, None, :].astype(q.dtype)
    out = _safe_ratio(weights @ vh, mx.sum(weights, axis=-1))
    return mx.swapaxes(out, 1, 2)


def sv_hybrid_readout(q, k, v, gate, *, chunk, scale=None, exclude=None):
    """Hybrid readout: causal q.k softmax over [0, t]; prefix keys (before t's chunk) times
    their multipliers, keys of t's own chunk (up to t) read directly."""
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qh, kh, vh = (mx.swapaxes(x, 1, 2) for x in (q, k, v))
    logits = (qh @ mx.swapaxes(kh, -1, -2)) * scale
    t = mx.arange(T)
    causal = t[None, :] <= t[:, None]
    local = causal & (t[None, :] >= (t[:, None] // chunk) * chunk)
    prefix = _rows_of(gate.multipliers().astype(q.dtype), T, chunk)
    mult = mx.where(local, mx.ones_like(prefix), prefix) * causal.astype(q.dtype)
    mult = mult * _keep(exclude, B, T)[:, None, None, :].astype(q.dtype)
    allowed = mult > 0
    neg_inf = mx.array(-math.inf, dtype=logits.dtype)
    top = mx.max(mx.where(allowed, logits, neg_inf), axis=-1, keepdims=True)
    top = mx.stop_gradient(mx.where(mx.isinf(top), mx.zeros_like(top), top))
    weights = mult * mx.exp(mx.where(allowed, logits - top, mx.zeros_like(logits)))
    out = _safe_ratio(weights @ vh, mx.sum(weights, axis=-1))
    return mx.swapaxes(out, 1, 2)


# ------------------------------------------------------------------------------ modules
def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return value


class CausalSVAttention(nn.Module):
    """Chunk-frozen SV-Attention (MLX): each chunk's queries read the SVDD gate of the causal
    prefix. Parameters and defaults as :class:`svtoolkit.torch.CausalSVAttention`.

    Parameters
    ----------
    d_model, n_heads : int
    C : float, default 0.25
    sigma : float, optional
        RBF width on RMS-normalised keys; default ``sqrt(2 D)``.
    chunk : int, default 64
    fista_iters : int, default 80
    ridge : float, default 1e-3
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

    def __init__(self, d_model, n_heads, *, C=0.25, sigma=None, chunk=64, fista_iters=80,
                 ridge=1e-3, head_dim=None, bias=False):
        super().__init__()
        _positive_int("d_model", d_model)
        _positive_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads "
                                 f"({n_heads}), or pass head_dim=")
            head_dim = d_model // n_heads
        _positive_int("head_dim", head_dim)
        if isinstance(C, bool) or not isinstance(C, (int, float)) or not (
            math.isfinite(C) and C > 0
        ):
            raise ValueError(f"C must be a finite number > 0; got {C!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.C = float(C)
        self.sigma = math.sqrt(2.0 * head_dim) if sigma is None else float(sigma)
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"sigma must be finite and > 0; got {sigma!r}")
        self.chunk = _positive_int("chunk", chunk)
        self.fista_iters = _positive_int("fista_iters", fista_iters)
        if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge >= 0):
            raise ValueError(f"ridge must be a finite number >= 0; got {ridge!r}")
        self.ridge = float(ridge)
        inner = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(d_model, inner, bias=bias)
        self.v_proj = nn.Linear(d_model, inner, bias=bias)
        self.o_proj = nn.Linear(inner, d_model, bias=bias)

    # ------------------------------------------------------------------ projections
    def _check_input(self, x):
        if not isinstance(x, mx.array) or x.dtype not in (mx.float32, mx.float64, mx.float16,
                                                           mx.bfloat16):
            raise TypeError(f"x must be a floating-point mlx array; got {type(x).__name__}")
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, T, d_model={self.d_model}); got "
                             f"{tuple(x.shape)}")

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
        return self._rms(q), self._rms(k), v

    def _readout(self, q, k, v, gate, exclude):
        if self.hybrid:
            return sv_hybrid_readout(q, k, v, gate, chunk=self.chunk, exclude=exclude)
        return sv_rbf_readout(q, k, v, gate, sigma=self.sigma, chunk=self.chunk,
                              exclude=exclude)

    def _project_out(self, o):
        B, T = o.shape[:2]
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))

    # ------------------------------------------------------------------ the two paths
    def __call__(self, x, exclude=None):
        """Training path: x (B, T, d_model) -> (B, T, d_model), batched approximate gate."""
        q, k, v = self._qkv(x)
        gate = sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.chunk, iters=self.fista_iters,
                       ridge=self.ridge, exclude=exclude)
        return self._project_out(self._readout(q, k, v, gate, exclude))

    def forward_exact(self, x, exclude=None):
        """Exact-gate path: the same readout on coefficients from the fp64 exact solver."""
        q, k, v = self._qkv(x)
        gate = exact_sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.chunk, exclude=exclude)
        return self._project_out(self._readout(q, k, v, gate, exclude))

    def gate(self, x, *, exact=False, exclude=None):
        """The gate coefficients of every chunk boundary (:class:`MLXSVGate`) for input x."""
        _, k, _ = self._qkv(x)
        if exact:
            return exact_sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.chunk,
                                 exclude=exclude)
        return sv_gate(k, C=self.C, sigma=self.sigma, chunk=self.chunk, iters=self.fista_iters,
                       ridge=self.ridge, exclude=exclude)

    @classmethod
    def from_torch(cls, module):
        """An MLX layer with the options and a copy of the weights of a torch SV layer
        (float64 weights stay float64 - CPU only in MLX - everything else becomes float32)."""
        if bool(module.hybrid) != bool(cls.hybrid):
            raise TypeError(f"{cls.__name__}.from_torch needs a "
                            f"{'hybrid' if cls.hybrid else 'chunk-frozen'} torch SV layer; got "
                            f"{type(module).__name__}")
        layer = cls(module.d_model, module.n_heads, C=module.C, sigma=module.sigma,
                    chunk=module.chunk, fista_iters=module.fista_iters, ridge=module.ridge,
                    head_dim=module.head_dim, bias=module.q_proj.bias is not None)
        weights = [(name, _mlx_weight(tensor)) for name, tensor in module.state_dict().items()]
        layer.load_weights(weights, strict=True)
        return layer


class HybridSVAttention(CausalSVAttention):
    """SV-Attention with a dense local path (MLX): learned q.k softmax over [0, t], prefix keys
    times their gate multiplier ``a_i / C``, keys of t's own chunk read directly. Same
    parameters as :class:`CausalSVAttention`."""

    hybrid = True


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
