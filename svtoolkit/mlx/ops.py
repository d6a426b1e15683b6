"""SV-Attention sequence ops in MLX: the chunked SVDD gate and its two readouts.

The twin of :mod:`svtoolkit.torch.ops.chunked_sv` (layout ``[B, T, H, D]``; Forgetful
Attention (arXiv:2607.12204), §3.5, Fig. 2, App. C): the gate of chunk c is the SVDD dual of the
keys of its causal prefix ``[0, c * chunk)``, read through the multipliers ``a_i / C`` (1 when
the gate is off: warm-up below ``ceil(1/C) + 2`` keys or an invalid batched solve).

* :func:`sv_gate` - the batched **training path** (FISTA partition finder + ridged bordered
  solve, differentiable through its custom VJP; approximate, **no certificate**);
* :func:`exact_sv_gate` - the **exact path** (fp64 :class:`svtoolkit.IncrementalSVDD`, NumPy;
  no gradient through the gate);
* :func:`sv_rbf_readout`, :func:`sv_hybrid_readout` - the chunk-frozen RBF and hybrid readouts.

Only tensor algebra is here: the options, the rules and the exact prefix gates are
framework-neutral (:mod:`svtoolkit._gate_core`), shared with torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .._gate_core import (
    PREFIX_WEIGHTINGS,
    QUERY_BLOCK,
    GateOptions,
    GateResult,
    bad_exclude,
    chunk_ends,
    exact_prefix_gates,
    warmup_size,
)
from .._validation import check_option
from .._rules import BATCHED_PARTITION_TOL, RIDGE
from .batched import fista_svdd, partition_masks, ridged_svdd_solve

__all__ = [
    "MLXSVGate",
    "chunk_ends",
    "warmup_size",
    "rbf_gram",
    "sv_gate",
    "exact_sv_gate",
    "uniform_sv_gate",
    "sv_rbf_readout",
    "sv_hybrid_readout",
]


# ------------------------------------------------------------------------------ gate helpers
def rbf_gram(a, b, sigma):
    """``exp(-||a_i - b_j||^2 / sigma^2)``, (..., T, D) x (..., S, D) -> (..., T, S).

    The expansion ``|a|^2 + |b|^2 - 2 a.b`` of the torch twin
    (:func:`svtoolkit.torch.ops.chunked_sv.rbf_gram`, where the choice is explained).
    """
    return mx.exp(-_sq_dists(a, b) / (sigma * sigma))


def _sq_dists(a, b):
    """``||a_i - b_j||^2`` by the expansion of :func:`rbf_gram` (clamped at 0)."""
    sq = mx.sum(a * a, axis=-1)[..., :, None] + mx.sum(b * b, axis=-1)[..., None, :]
    sq = sq - 2.0 * (a @ mx.swapaxes(b, -1, -2))
    return mx.maximum(sq, 0.0)


def _keep(exclude, B, T):
    if exclude is None:
        return mx.ones((B, T), dtype=mx.bool_)
    if (not isinstance(exclude, mx.array) or exclude.dtype != mx.bool_
            or tuple(exclude.shape) != (B, T)):
        raise bad_exclude(exclude, (B, T))
    return ~exclude


def _prefix_masks(keep, ends):
    """(G, P) keep -> (G, J, P): key i belongs to boundary j's problem iff kept and < ends[j]."""
    P = keep.shape[-1]
    inside = mx.arange(P)[None, :] < mx.array(ends)[:, None]
    return keep[:, None, :] & inside[None]


@dataclass(frozen=True)
class MLXSVGate(GateResult):
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

    def multipliers(self, weighting="normalized"):
        """(B, H, J, P): ``max(a / C, 0)`` (``weighting="raw"``: ``max(a, 0)``) where gated,
        1 where not, 0 beyond each prefix."""
        check_option(weighting, "weighting", PREFIX_WEIGHTINGS)
        B, H, J, P = self.alpha.shape
        inside = (mx.arange(P)[None, :] < mx.array(self.ends)[:, None]).astype(self.alpha.dtype)
        ones = mx.broadcast_to(inside, (B, H, J, P))
        scaled = self.alpha if weighting == "raw" else self.alpha / self.C
        return mx.where(self.gated[..., None], mx.maximum(scaled, 0.0), ones)


def sv_gate(k, *, C, sigma, chunk, iters=80, ridge=RIDGE, tol=BATCHED_PARTITION_TOL,
            exclude=None):
    """Batched, differentiable (approximate) gate coefficients at every chunk boundary.

    Parameters
    ----------
    k : mlx.core.array of shape (B, T, H, D)
    C, sigma : float
    chunk : int
    iters, ridge, tol : see :func:`svtoolkit.mlx.fista_svdd`, :func:`ridged_svdd_solve`,
        :func:`partition_masks` (checked by :class:`svtoolkit._gate_core.GateOptions`).
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
    opts = GateOptions(C=C, sigma=sigma, chunk=chunk, iters=iters, ridge=ridge, tol=tol)
    C, sigma, chunk, iters, ridge, tol = (opts.C, opts.sigma, opts.chunk, opts.iters,
                                          opts.ridge, opts.tol)
    B, T, H, D = k.shape
    ends = chunk_ends(T, chunk)
    J = len(ends)
    if J == 0:
        return MLXSVGate(mx.zeros((B, H, 0, 0), dtype=k.dtype),
                         mx.zeros((B, H, 0), dtype=mx.bool_), ends, C, False)
    P = ends[-1]
    keys = mx.swapaxes(k[:, :P], 1, 2)  # (B, H, P, D)
    gram = rbf_gram(keys, keys, sigma).reshape(B * H, P, P)
    keep = _keep(exclude, B, T)[:, :P]
    keep_g = mx.broadcast_to(keep[:, None, :], (B, H, P)).reshape(B * H, P)
    masks = _prefix_masks(keep_g, ends)  # (G, J, P)
    G = B * H
    stacked = mx.broadcast_to(mx.stop_gradient(gram)[:, None], (G, J, P, P)).reshape(G * J, P, P)
    masks = masks.reshape(G * J, P)
    alpha0 = fista_svdd(stacked, C, mask=masks, iters=iters)
    # every (sequence-head, boundary) problem in one call, each on its sequence-head's Gram
    groups = mx.repeat(mx.arange(G), J)
    margin, error = partition_masks(alpha0, C, tol=tol, mask=masks)
    alpha, _, valid = ridged_svdd_solve(gram, C, margin, error, ridge=ridge, mask=masks,
                                        groups=groups)
    gated = valid & (mx.sum(masks, axis=-1) >= warmup_size(C))
    return MLXSVGate(alpha.reshape(B, H, J, P), gated.reshape(B, H, J), ends, C, False)


def exact_sv_gate(k, *, C, sigma, chunk, exclude=None):
    """Gate coefficients from the exact fp64 solver, one IncrementalSVDD per (sequence, head),
    each chunk admitted at its end (no gradient; :func:`svtoolkit._gate_core.exact_prefix_gates`,
    shared with torch). ``alpha`` is returned in k's dtype."""
    opts = GateOptions(C=C, sigma=sigma, chunk=chunk)
    B, T, H, D = k.shape
    ends = chunk_ends(T, opts.chunk)
    keep = np.array(_keep(exclude, B, T))
    alpha, gated = exact_prefix_gates(as_numpy64(k), keep, opts.C, opts.sigma, ends)
    return MLXSVGate(mx.array(alpha, dtype=k.dtype), mx.array(gated), ends, opts.C, True)


def uniform_sv_gate(k, *, C, chunk, exclude=None):
    """The gate-off ablation (every boundary ungated, every prefix key at multiplier 1; the
    twin of :func:`svtoolkit.torch.ops.chunked_sv.uniform_sv_gate`). Nothing is solved."""
    opts = GateOptions(C=C, sigma=1.0, chunk=chunk)
    B, T, H, _ = k.shape
    _keep(exclude, B, T)
    ends = chunk_ends(T, opts.chunk)
    P = ends[-1] if ends else 0
    return MLXSVGate(mx.zeros((B, H, len(ends), P), dtype=k.dtype),
                     mx.zeros((B, H, len(ends)), dtype=mx.bool_), ends, opts.C, False)


def as_numpy64(x):
    """A detached MLX array as a float64 ndarray (half precision goes through float32)."""
    return np.array(mx.stop_gradient(x).astype(mx.float32 if x.dtype != mx.float64
                                               else mx.float64), dtype=np.float64)


def _padded_rows(table, T):
    """(B, H, J, P) per-boundary rows -> (B, H, J + 1, T): row c is what chunk c's queries
    read (row 0: zeros)."""
    B, H, J, P = table.shape
    if J == 0:
        return mx.zeros((B, H, 1, T), dtype=table.dtype)
    body = mx.pad(table, [(0, 0), (0, 0), (0, 0), (0, T - P)])
    return mx.concatenate([mx.zeros((B, H, 1, T), dtype=table.dtype), body], axis=2)


def _rows_of(table, T, chunk):
    """(B, H, J, P) per-boundary rows -> (B, H, T, T) per query (chunk 0: zeros)."""
    return mx.take(_padded_rows(table, T), mx.arange(T) // chunk, axis=2)


def _safe_ratio(num, den):
    """num / den with 0 where den is 0 (never NaN, also in the backward pass)."""
    ok = den > 0
    safe = mx.where(ok, den, mx.ones_like(den))
    return mx.where(ok[..., None], num / safe[..., None], mx.zeros_like(num))


def sv_rbf_readout(q, k, v, gate, *, sigma, chunk, exclude=None, shift=False):
    """Chunk-frozen RBF readout (q, k (B, T, H, D), v (B, T, H, Dv) -> (B, T, H, Dv)):
    ``o_t = sum m_i k(q_t, k_i) v_i / sum m_i k(q_t, k_i)`` over the prefix of t's chunk.
    ``shift=True`` subtracts each query's smallest squared distance to a readable key inside
    the exponential, as the torch twin (:func:`svtoolkit.torch.ops.chunked_sv.sv_rbf_readout`,
    where the reason is given)."""
    B, T, H, D = q.shape
    qh, kh, vh = (mx.swapaxes(x, 1, 2) for x in (q, k, v))
    mult = _rows_of(gate.multipliers().astype(q.dtype), T, chunk)
    keep = _keep(exclude, B, T)[:, None, None, :].astype(q.dtype)
    if shift:
        sq = _sq_dists(qh, kh)
        readable = (mult * keep) > 0
        inf = mx.array(math.inf, dtype=sq.dtype)
        nearest = mx.min(mx.where(readable, sq, inf), axis=-1, keepdims=True)
        nearest = mx.where(mx.isinf(nearest), mx.zeros_like(nearest), nearest)
        sq = mx.where(readable, sq - mx.stop_gradient(nearest), sq)
        kernel = mx.exp(-sq / (sigma * sigma))
    else:
        kernel = rbf_gram(qh, kh, sigma)
    weights = kernel * mult
    weights = weights * keep
    out = _safe_ratio(weights @ vh, mx.sum(weights, axis=-1))
    return mx.swapaxes(out, 1, 2)


def sv_hybrid_readout(q, k, v, gate, *, chunk, scale=None, exclude=None,
                      prefix_weighting="normalized"):
    """Hybrid readout: causal q.k softmax over [0, t]; prefix keys (before t's chunk) times
    their multipliers (``a / C``, or ``a`` with ``prefix_weighting="raw"``), keys of t's own
    chunk (up to t) read directly. Queries in blocks of ``QUERY_BLOCK``, as torch."""
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qh, kh, vh = (mx.swapaxes(x, 1, 2) for x in (q, k, v))
    table = _padded_rows(gate.multipliers(prefix_weighting).astype(q.dtype), T)
    keep = _keep(exclude, B, T)[:, None, None, :].astype(q.dtype)
    outs = []
    for start in range(0, T, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, T)
        outs.append(_hybrid_block(qh[:, :, start:end], kh[:, :, :end], vh[:, :, :end],
                                  table[..., :end], keep[..., :end], start, chunk, scale))
    return mx.swapaxes(mx.concatenate(outs, axis=2), 1, 2)


def _hybrid_block(q, k, v, table, keep, start, chunk, scale):
    """The hybrid readout of the queries [start, start + L) over the keys [0, e) they see."""
    L, e = q.shape[2], k.shape[2]
    logits = (q @ mx.swapaxes(k, -1, -2)) * scale
    t = mx.arange(start, start + L)[:, None]
    i = mx.arange(e)[None, :]
    causal = i <= t
    local = causal & (i >= (t // chunk) * chunk)
    prefix = mx.take(table, t[:, 0] // chunk, axis=2)
    mult = mx.where(local, mx.ones_like(prefix), prefix) * causal.astype(q.dtype) * keep
    allowed = mult > 0
    neg_inf = mx.array(-math.inf, dtype=logits.dtype)
    top = mx.max(mx.where(allowed, logits, neg_inf), axis=-1, keepdims=True)
    top = mx.stop_gradient(mx.where(mx.isinf(top), mx.zeros_like(top), top))
    weights = mult * mx.exp(mx.where(allowed, logits - top, mx.zeros_like(logits)))
    return _safe_ratio(weights @ v, mx.sum(weights, axis=-1))
