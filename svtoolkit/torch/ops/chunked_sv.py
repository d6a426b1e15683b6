r"""SV-Attention sequence ops: the chunk-frozen SVDD gate and its two readouts.

Layout ``[B, T, H, D]`` (as every op in :mod:`svtoolkit.torch.ops`). Forgetful Attention
(arXiv:2607.12204), §3.5, Fig. 2, App. C. The sequence is cut into chunks of ``chunk``
tokens; chunk ``c`` starts at ``s_c = c * chunk``. The gate of chunk ``c`` (c >= 1) is the
SVDD dual of the keys of its causal prefix ``[0, s_c)``:

.. math:: \min_a a^T K a - \operatorname{diag}(K)^T a,\quad \sum_i a_i = 1,\ 0 \le a_i \le C,
          \qquad K_{ij} = \exp(-\|k_i - k_j\|^2 / \sigma^2).

Its coefficients enter the readouts as the *multipliers* ``m_i = a_i / C`` in [0, 1]: error
(atypical) keys are read at full weight, margin keys partly, reserve (redundant) keys not at
all. Dividing by the fixed C, not by the prefix length, keeps a certified eviction (which
removes keys with ``a_i = 0``) from changing any multiplier. While a prefix holds fewer than
``ceil(1/C) + 2`` keys (warm-up), or when the batched solve flags a problem invalid, the gate is
off and every multiplier is 1.

* **Chunk-frozen RBF readout** (:func:`sv_rbf_readout`): query t of chunk c reads its prefix,
  ``o_t = sum_i m_i k(q_t, k_i) v_i / sum_i m_i k(q_t, k_i)`` over ``i < s_c``; chunk 0 (empty
  prefix) outputs 0.
* **Hybrid readout** (:func:`sv_hybrid_readout`): a learned q.k softmax over all of ``[0, t]``;
  prefix keys are multiplied by their gate multiplier, keys of the query's own chunk (up to t)
  by 1 - ``o_t = sum_i w_i v_i / sum_i w_i``, ``w_i = m_i exp(q_t . k_i / sqrt(D))``.

Two ways to get the coefficients:

* :func:`sv_gate` - the batched **training path** (FISTA partition finder + 1e-3-ridged
  bordered solve, differentiable by autograd; approximate, **no certificate**);
* :func:`exact_sv_gate` - the **exact path**: one :class:`svtoolkit.IncrementalSVDD` per
  (sequence, head), admitting each chunk's keys at its boundary (fp64; certified; no gradient).

``exclude`` (B, T) bool removes tokens from everything: they are never admitted to a gate and
never read (the semantics of deleting a token, see :mod:`svtoolkit.torch.layers.sv`).

Ablation switches (``docs/layers.md``): :func:`uniform_sv_gate` is the gate switched off
(every multiplier 1, nothing solved); ``SVGate.multipliers("raw")`` and
``sv_hybrid_readout(..., prefix_weighting="raw")`` weight the hybrid's prefix by the raw
coefficients ``a_i``; the token-level gate update is ``chunk=1`` (a gate per token).

Only the tensor algebra is here: the options, the rules (chunk ends, warm-up size) and the exact
prefix gates are framework-neutral (:mod:`svtoolkit._gate_core`) and shared with the MLX twin
(:mod:`svtoolkit.mlx.ops`). The function :func:`svtoolkit.torch.sv_attention` is another thing
(the set-level readout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..._gate_core import (
    PREFIX_WEIGHTINGS,
    QUERY_BLOCK,
    GateOptions,
    GateResult,
    bad_exclude,
    chunk_ends,
    exact_prefix_gates,
    warmup_size,
)
from ..._validation import check_option
from ..._rules import BATCHED_PARTITION_TOL, POWER_ITERS, RIDGE
from ..batched import fista_svdd, partition_masks, ridged_svdd_solve

__all__ = [
    "SVGate",
    "chunk_ends",
    "warmup_size",
    "rbf_gram",
    "sv_gate",
    "exact_sv_gate",
    "uniform_sv_gate",
    "sv_rbf_readout",
    "sv_hybrid_readout",
]


@dataclass(frozen=True)
class SVGate(GateResult):
    """Gate coefficients at every chunk boundary (torch tensors).

    Attributes
    ----------
    alpha : Tensor of shape (B, H, J, P)
        Coefficients of boundary j over the keys ``[0, ends[j])`` (0 beyond), P = ends[-1].
    gated : Tensor of shape (B, H, J), bool
        False where the gate is off (warm-up, invalid problem): multipliers are then 1.
    ends : list of int
        Prefix ends ``s_c = c * chunk`` of the chunks c = 1 .. J.
    C : float
    exact : bool
        True when the coefficients come from the exact fp64 solver.
    """

    def multipliers(self, weighting="normalized"):
        """(B, H, J, P): ``a / C`` where gated, 1 where not, 0 beyond each prefix.

        ``weighting="raw"`` gives the raw coefficients ``a`` where gated instead (they sum to
        1 over each prefix; ungated boundaries stay at 1).
        """
        check_option(weighting, "weighting", PREFIX_WEIGHTINGS)
        B, H, J, P = self.alpha.shape
        inside = torch.arange(P, device=self.alpha.device)[None, :] < torch.tensor(
            self.ends, device=self.alpha.device
        )[:, None]
        ones = inside.to(self.alpha.dtype).expand(B, H, J, P)
        scaled = self.alpha if weighting == "raw" else self.alpha / self.C
        # the ridged (approximate) coefficients can dip below 0: such keys are not read
        return torch.where(self.gated[..., None], scaled.clamp_min(0.0), ones)


def rbf_gram(a, b, sigma):
    """``exp(-||a_i - b_j||^2 / sigma^2)`` for a (..., T, D), b (..., S, D) -> (..., T, S).

    Uses ``|a|^2 + |b|^2 - 2 a.b`` (one matrix product; clamped at 0) - fast and differentiable
    everywhere, accurate to the dtype's rounding of the squared norms. This is deliberately not
    the coordinate-wise kernel of :func:`svtoolkit.rbf_kernel`: the training path runs in
    float32 on (B H, P, P) blocks, where the expansion is one batched matrix product and its
    rounding (about eps |k|^2 / sigma^2) is far below the batched gate's own approximation.
    The RBF readout uses it for the query-key weights too, on the exact path as well (its
    coefficients are exact; its readout weights are at this rounding).
    """
    return torch.exp(-_sq_dists(a, b) / (sigma * sigma))


def _sq_dists(a, b):
    """``||a_i - b_j||^2`` by the expansion of :func:`rbf_gram` (clamped at 0)."""
    sq = (a * a).sum(-1)[..., :, None] + (b * b).sum(-1)[..., None, :]
    sq = sq - 2.0 * (a @ b.transpose(-1, -2))
    return sq.clamp_min(0.0)


def _keep(exclude, B, T, device):
    if exclude is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    if (not isinstance(exclude, torch.Tensor) or tuple(exclude.shape) != (B, T)
            or exclude.dtype != torch.bool):
        raise bad_exclude(exclude, (B, T))
    return ~exclude.to(device)


def _prefix_fista(K, keep, ends, C, iters):
    """FISTA on every (sequence-head, boundary) prefix problem. K (G, P, P) detached, keep
    (G, P) bool -> alpha (G, J, P). Fused Numba kernel on CPU (reads K in place)."""
    G, P, _ = K.shape
    J = len(ends)
    if K.device.type == "cpu":
        from ..._fista import fista_prefix_batch

        K_np = K.contiguous().numpy()
        out = np.empty((G, J, P), dtype=K_np.dtype)
        fista_prefix_batch(K_np, keep.contiguous().numpy(), np.asarray(ends, dtype=np.int64),
                           C, iters, POWER_ITERS, False, out)
        return torch.from_numpy(out)
    masks = _prefix_masks(keep, ends)  # (G, J, P)
    alpha = fista_svdd(K[:, None].expand(G, J, P, P).reshape(G * J, P, P), C,
                       mask=masks.reshape(G * J, P), iters=iters, backend="torch")
    return alpha.view(G, J, P)


def _prefix_masks(keep, ends):
    P = keep.shape[-1]
    inside = torch.arange(P, device=keep.device)[None, :] < torch.tensor(
        ends, device=keep.device)[:, None]
    return keep[:, None, :] & inside[None]


def sv_gate(k, *, C, sigma, chunk, iters=80, ridge=RIDGE, tol=BATCHED_PARTITION_TOL,
            exclude=None):
    """Batched, differentiable (approximate) gate coefficients at every chunk boundary.

    Parameters
    ----------
    k : Tensor of shape (B, T, H, D)
        Keys (float32 or float64).
    C, sigma : float
        Box and RBF width of the gate.
    chunk : int
        Chunk length.
    iters, ridge, tol : see :func:`svtoolkit.torch.fista_svdd`, :func:`ridged_svdd_solve`,
        :func:`partition_masks` (checked by :class:`svtoolkit._gate_core.GateOptions`).
    exclude : Tensor of shape (B, T), bool, optional

    Returns
    -------
    SVGate
        ``alpha`` differentiable in k through the ridged bordered solve (the partition found by
        FISTA is held fixed); nothing here is certified.

    Notes
    -----
    All B * H * J problems are solved in one batched call per stage; each problem's result
    depends only on its own prefix (per-problem step sizes and stopping), so the layer is
    exactly causal.
    """
    opts = GateOptions(C=C, sigma=sigma, chunk=chunk, iters=iters, ridge=ridge, tol=tol)
    C, sigma, chunk, iters, ridge, tol = (opts.C, opts.sigma, opts.chunk, opts.iters,
                                          opts.ridge, opts.tol)
    B, T, H, D = k.shape
    ends = chunk_ends(T, chunk)
    J = len(ends)
    if J == 0:
        empty = k.new_zeros(B, H, 0, 0)
        return SVGate(empty, torch.zeros(B, H, 0, dtype=torch.bool, device=k.device), ends, C,
                      False)
    P = ends[-1]
    keys = k[:, :P].transpose(1, 2)  # (B, H, P, D)
    gram = rbf_gram(keys, keys, sigma).reshape(B * H, P, P)
    keep = _keep(exclude, B, T, k.device)[:, :P]
    keep_g = keep[:, None, :].expand(B, H, P).reshape(B * H, P)
    alpha0 = _prefix_fista(gram.detach(), keep_g, ends, C, iters).reshape(B * H * J, P)
    masks = _prefix_masks(keep_g, ends).reshape(B * H * J, P)
    # every (sequence-head, boundary) problem in one call, each on its sequence-head's Gram
    groups = torch.arange(B * H, device=k.device).repeat_interleave(J)
    margin, error = partition_masks(alpha0, C, tol=tol, mask=masks)
    alpha, _, valid = ridged_svdd_solve(gram, C, margin, error, ridge=ridge, mask=masks,
                                        groups=groups)
    gated = valid & (masks.sum(-1) >= warmup_size(C))
    return SVGate(alpha.view(B, H, J, P), gated.view(B, H, J), ends, C, False)


def exact_sv_gate(k, *, C, sigma, chunk, exclude=None):
    """Gate coefficients from the exact fp64 solver (one IncrementalSVDD per sequence and head).

    Each chunk's keys are admitted at its end by exact increments; the coefficients at every
    boundary are the exact optimum of the prefix (certified once ``n C >= 1``). No gradient.

    Returns
    -------
    SVGate
        ``alpha`` in float64 on k's device; ``exact=True``.

    Notes
    -----
    The solves are :func:`svtoolkit._gate_core.exact_prefix_gates` (NumPy), shared with MLX.
    """
    opts = GateOptions(C=C, sigma=sigma, chunk=chunk)
    B, T, H, D = k.shape
    ends = chunk_ends(T, opts.chunk)
    keep = _keep(exclude, B, T, k.device).cpu().numpy()
    keys = k.detach().to(dtype=torch.float64, device="cpu").numpy()
    alpha, gated = exact_prefix_gates(keys, keep, opts.C, opts.sigma, ends)
    return SVGate(torch.from_numpy(alpha).to(k.device), torch.from_numpy(gated).to(k.device),
                  ends, opts.C, True)


def uniform_sv_gate(k, *, C, chunk, exclude=None):
    """The gate-off ablation: every boundary ungated, so every prefix key has multiplier 1.

    The readouts then read the same keys as with the SVDD gate (the non-excluded prefix of
    each chunk) at uniform weight: the RBF readout becomes plain RBF kernel attention over the
    prefix and the hybrid plain causal softmax - the "SV (no gate)" ablation of Forgetful
    Attention (arXiv:2607.12204), §5, Table 2. Nothing is solved.

    Parameters
    ----------
    k : Tensor of shape (B, T, H, D)
        Keys (only their shape, dtype and device are used).
    C : float
        Box (checked and recorded; unused otherwise).
    chunk : int
    exclude : Tensor of shape (B, T), bool, optional
        Checked; the readouts apply it.

    Returns
    -------
    SVGate
        ``alpha`` zeros of shape (B, H, J, P), ``gated`` all False, ``exact=False``.
    """
    opts = GateOptions(C=C, sigma=1.0, chunk=chunk)
    B, T, H, _ = k.shape
    _keep(exclude, B, T, k.device)
    ends = chunk_ends(T, opts.chunk)
    P = ends[-1] if ends else 0
    return SVGate(k.new_zeros(B, H, len(ends), P),
                  torch.zeros(B, H, len(ends), dtype=torch.bool, device=k.device), ends,
                  opts.C, False)


def _padded_rows(table, T):
    """(B, H, J, P) per-boundary rows -> (B, H, J + 1, T): row c is what chunk c's queries
    read (row 0, the first chunk's: zeros)."""
    B, H, J, P = table.shape
    padded = table.new_zeros(B, H, J + 1, T)
    padded[:, :, 1:, :P] = table
    return padded


def _rows_of(table, T, chunk):
    """(B, H, J, P) per-boundary rows -> (B, H, T, T) per query (chunk 0: zeros)."""
    chunk_of = torch.arange(T, device=table.device) // chunk
    return _padded_rows(table, T).index_select(2, chunk_of)


def _safe_ratio(num, den):
    """num / den with 0 where den is 0 (never NaN, also in the backward pass)."""
    ok = den > 0
    return torch.where(ok[..., None], num / torch.where(ok, den, torch.ones_like(den))[..., None],
                       torch.zeros_like(num))


def sv_rbf_readout(q, k, v, gate, *, sigma, chunk, exclude=None, shift=False):
    """Chunk-frozen RBF readout: query t reads the gate of its prefix (chunk 0 outputs 0).

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, D)
    v : Tensor of shape (B, T, H, Dv)
    gate : SVGate
    sigma : float
    chunk : int
    exclude : Tensor of shape (B, T), bool, optional
    shift : bool, default False
        Subtract, per query, the smallest squared distance to a key it reads (multiplier > 0,
        not excluded) inside the exponential. The ratio is unchanged (the factor cancels), but
        the nearest readable key then has kernel value 1, so the weights of a query far from
        every key cannot all underflow to 0 (in float32 ``exp(-d^2 / sigma^2)`` is 0 beyond
        ``d^2 / sigma^2`` of about 104), which would leave the output 0 and its gradient 0.
        The layers set it for unnormalised keys (``qk_norm="none"``); on RMS-normalised keys
        ``d^2 / sigma^2 <= 2`` and it is not needed.

    Returns
    -------
    Tensor of shape (B, T, H, Dv)
    """
    B, T, H, D = q.shape
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    mult = _rows_of(gate.multipliers().to(q.dtype), T, chunk)
    keep = _keep(exclude, B, T, q.device)[:, None, None, :].to(q.dtype)
    if shift:
        sq = _sq_dists(qh, kh)
        readable = (mult * keep) > 0
        nearest = torch.where(readable, sq, torch.full_like(sq, math.inf)).amin(-1, keepdim=True)
        nearest = torch.where(torch.isfinite(nearest), nearest, torch.zeros_like(nearest))
        # unreadable keys keep their unshifted distance: their weight is 0 either way, and
        # exp of a negative shifted distance could overflow (inf * 0 = nan)
        sq = torch.where(readable, sq - nearest.detach(), sq)
        kernel = torch.exp(-sq / (sigma * sigma))
    else:
        kernel = rbf_gram(qh, kh, sigma)
    weights = kernel * mult
    weights = weights * keep
    out = _safe_ratio(weights @ vh, weights.sum(-1))
    return out.transpose(1, 2)


def sv_hybrid_readout(q, k, v, gate, *, chunk, scale=None, exclude=None,
                      prefix_weighting="normalized"):
    """Hybrid readout: causal q.k softmax over [0, t], prefix keys times their multipliers.

    Parameters
    ----------
    q, k : Tensor of shape (B, T, H, D)
    v : Tensor of shape (B, T, H, Dv)
    gate : SVGate
    chunk : int
    scale : float, optional
        Logit scale (default ``1 / sqrt(D)``).
    exclude : Tensor of shape (B, T), bool, optional
    prefix_weighting : {"normalized", "raw"}, default "normalized"
        Multipliers of a gated prefix: ``a / C`` (an ungated boundary then equals plain
        softmax, and a prefix key of the error set weighs as much as a local key), or the raw
        coefficients ``a`` as Forgetful Attention (arXiv:2607.12204), §3.5 writes the hybrid
        (they sum to 1, so the gated prefix weighs about ``1/|prefix|`` of a local key).

    Returns
    -------
    Tensor of shape (B, T, H, Dv)

    Notes
    -----
    ``w_ti = m_ti exp(q_t . k_i * scale)`` with ``m_ti`` the gate multiplier of key i at the
    boundary of t's chunk for ``i < s_c`` and 1 for ``s_c <= i <= t``; ``o_t = sum w v / sum w``.
    The first chunk and ungated boundaries are plain causal softmax. Queries are read in
    blocks of :data:`svtoolkit._gate_core.QUERY_BLOCK`, each against the keys it can see (about
    half the work and memory of a (T, T) weight matrix, never materialised whole).
    """
    B, T, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    table = _padded_rows(gate.multipliers(prefix_weighting).to(q.dtype), T)
    keep = _keep(exclude, B, T, q.device)[:, None, None, :].to(q.dtype)
    outs = []
    for start in range(0, T, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, T)
        outs.append(_hybrid_block(qh[:, :, start:end], kh[:, :, :end], vh[:, :, :end],
                                  table[..., :end], keep[..., :end], start, chunk, scale))
    return torch.cat(outs, 2).transpose(1, 2)


def _hybrid_block(q, k, v, table, keep, start, chunk, scale):
    """The hybrid readout of the queries [start, start + L) over the keys [0, e) they can see:
    q (B, H, L, D), k (B, H, e, D), v (B, H, e, Dv), table (B, H, J + 1, e), keep (B, 1, 1, e).
    """
    L, e = q.shape[2], k.shape[2]
    logits = (q @ k.transpose(-1, -2)) * scale
    t = torch.arange(start, start + L, device=q.device)[:, None]
    i = torch.arange(e, device=q.device)[None, :]
    causal = i <= t
    local = causal & (i >= (t // chunk) * chunk)
    prefix = table.index_select(2, t[:, 0] // chunk)
    mult = torch.where(local, torch.ones_like(prefix), prefix) * causal.to(q.dtype) * keep
    allowed = mult > 0
    top = torch.where(allowed, logits, torch.full_like(logits, -math.inf)).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    weights = mult * torch.exp(torch.where(allowed, logits - top, torch.zeros_like(logits)))
    return _safe_ratio(weights @ v, weights.sum(-1))
