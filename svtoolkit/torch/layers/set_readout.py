"""SV-Attention over a given set of keys: the exact gate read out by RBF similarity.

``o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i)`` with the gate ``a`` from the exact fp64
solver (:func:`svtoolkit.torch.svdd_gate`, App. A backward), one independent problem per leading
index: :func:`sv_attention` (function) and :class:`SVAttention` (module, no projections). The
chunked sequence layers are in :mod:`svtoolkit.torch.layers.sv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._rules import feasible
from ..._validation import check_positive
from .._checks import check_keys_shape, check_tensor
from .._gate_autograd import rbf
from ..exact_gate import svdd_gate

__all__ = ["SVAttention", "SVAttentionInfo", "ZERO_DENOMINATOR", "sv_attention"]

#: Readout denominators below this (the smallest normal float64) count as zero.
ZERO_DENOMINATOR = torch.finfo(torch.float64).tiny


@dataclass(frozen=True)
class SVAttentionInfo:
    """Diagnostics of one :func:`sv_attention` call (detached tensors; a frozen dataclass).

    Attributes
    ----------
    alpha : Tensor of shape (..., n)
        Gate coefficients (the uniform 1/n in warm-up).
    rho : Tensor of shape (...)
        NaN in warm-up (no gate).
    warmup : Tensor of shape (...), bool
        True where ``n C < 1``: the readout was ungated.
    zero_denominator : Tensor of shape (..., m), bool
        True where ``sum_i a_i k(q, x_i)`` underflowed to below the smallest normal float64 (a
        query farther than about 26.6 sigma from every support key): the output there is 0.
    """

    alpha: torch.Tensor
    rho: torch.Tensor
    warmup: torch.Tensor
    zero_denominator: torch.Tensor


def _check_attention_inputs(keys, values, queries):
    for x, name, shape in ((keys, "keys", "(..., n, d)"), (values, "values", "(..., n, dv)"),
                           (queries, "queries", "(..., m, d)")):
        check_tensor(x, name)
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(x.shape)}")
    batch = keys.shape[:-2]
    if values.shape[:-2] != batch or queries.shape[:-2] != batch:
        raise ValueError(
            "keys, values and queries must share their leading dimensions; got "
            f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(queries.shape)}"
        )
    if values.shape[-2] != keys.shape[-2]:
        raise ValueError(f"values must have one row per key ({keys.shape[-2]}); "
                         f"got {tuple(values.shape)}")
    if queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"queries must have the key dimension {keys.shape[-1]}; "
                         f"got {tuple(queries.shape)}")
    check_keys_shape(keys)


def _flatten_batch(x):
    """``(..., r, c) -> (B, r, c)``, B the product of the leading sizes (also when B or r*c
    is 0, where ``reshape(-1, r, c)`` is ambiguous)."""
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


def _gate_or_warmup(keys, C, sigma):
    """(alpha, rho, warmup) for one problem; warm-up gives the ungated uniform weights."""
    n = keys.shape[0]
    if not feasible(n, C):
        alpha = torch.full((n,), 1.0 / n, dtype=torch.float64, device=keys.device)
        return alpha, torch.tensor(float("nan"), dtype=torch.float64, device=keys.device), True
    alpha, rho = svdd_gate(keys, C=C, sigma=sigma)
    return alpha, rho, False


def _readout(kq, alpha, values):
    """``o = (kq * a) v / sum(kq * a)`` with the zero-denominator rule (output 0, flagged)."""
    weights = kq * alpha
    den = weights.sum(-1)
    zero = den < ZERO_DENOMINATOR
    safe = torch.where(zero, torch.ones_like(den), den)
    out = (weights @ values) / safe.unsqueeze(-1)
    return torch.where(zero.unsqueeze(-1), torch.zeros_like(out), out), zero


def sv_attention(keys, values, queries, *, C, sigma, return_info=False):
    """SV-Attention readout ``o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i)``.

    Parameters
    ----------
    keys : Tensor of shape (..., n, d)
        ``n >= 1`` keys with ``d >= 1`` features.
    values : Tensor of shape (..., n, dv)
        ``dv = 0`` is allowed (the output is then empty).
    queries : Tensor of shape (..., m, d)
        Leading dimensions must agree; each index is an independent exact problem (a loop).
        ``m = 0`` queries and an empty leading batch are allowed: the outputs are then empty
        tensors of the shapes below.
    C, sigma : float
    return_info : bool, default False
        Also return :class:`SVAttentionInfo`.

    Returns
    -------
    out : Tensor of shape (..., m, dv)
        Computed in float64, returned in the promoted dtype of the inputs.
    info : SVAttentionInfo, only when ``return_info``

    Raises
    ------
    ValueError
        No keys (``n = 0``) or no features (``d = 0``); mismatched shapes; NaN or inf.

    Notes
    -----
    * The gate a comes from :func:`svdd_gate` (exact fp64 forward, App. A backward);
      gradients reach keys through a and through k(q, x), and values and queries directly.
    * **Zero denominator.** With a >= 0 and sum(a) = 1 the denominator is positive in exact
      arithmetic, but ``exp`` underflows for queries far from every support key. Where it is
      below the smallest normal float64 the output is defined as 0, the gradient there is 0
      (never NaN), and ``info.zero_denominator`` flags the query.
    * **Warm-up** (``n C < 1``): the gate is infeasible; the readout is ungated (a = 1/n, the
      normalised RBF readout, docs/design.md, degenerate cases), ``info.warmup`` is True and
      ``info.rho`` NaN.
    """
    C = check_positive(C, "C")
    sigma = check_positive(sigma, "sigma")
    _check_attention_inputs(keys, values, queries)
    out_dtype = torch.promote_types(torch.promote_types(keys.dtype, values.dtype), queries.dtype)
    batch = keys.shape[:-2]
    n, m, dv = keys.shape[-2], queries.shape[-2], values.shape[-1]
    out, alpha, rho, warm, zero = _attend(
        _flatten_batch(keys), _flatten_batch(values).to(torch.float64),
        _flatten_batch(queries).to(torch.float64), C, sigma,
    )
    out = out.reshape(*batch, m, dv).to(out_dtype)
    if not return_info:
        return out
    info = SVAttentionInfo(
        alpha=alpha.reshape(*batch, n),
        rho=rho.reshape(batch),
        warmup=warm.reshape(batch),
        zero_denominator=zero.reshape(*batch, m),
    )
    return out, info


def _attend(k2, v2, q2, C, sigma):
    """One exact problem per row of (B, n, d) keys, (B, n, dv) values, (B, m, d) queries.

    Returns the stacked ``out (B, m, dv)``, ``alpha (B, n)``, ``rho (B,)``, ``warmup (B,)``
    and ``zero_denominator (B, m)``; values and queries are float64 already.
    """
    if k2.shape[0] == 0:
        return _empty_attention(k2, v2, q2)
    outs, alphas, rhos, warm, zeros = [], [], [], [], []
    for b in range(k2.shape[0]):
        alpha, rho, is_warm = _gate_or_warmup(k2[b], C, sigma)
        kq = rbf(q2[b], k2[b].to(torch.float64), sigma=sigma)
        out, zero = _readout(kq, alpha, v2[b])
        outs.append(out)
        alphas.append(alpha.detach())
        rhos.append(rho.detach())
        warm.append(is_warm)
        zeros.append(zero)
    warm = torch.tensor(warm, dtype=torch.bool, device=k2.device)
    return torch.stack(outs), torch.stack(alphas), torch.stack(rhos), warm, torch.stack(zeros)


def _empty_attention(k2, v2, q2):
    """The results of an empty batch (B = 0): zero-size tensors of the right shapes.

    ``out`` is tied to the inputs' graph (by a zero-weighted sum), so a backward through it
    works as for any other batch and gives empty gradients.
    """
    _, n, _ = k2.shape
    m, dv = q2.shape[1], v2.shape[2]
    f64 = dict(dtype=torch.float64, device=k2.device)
    anchor = 0.0 * (k2.sum().to(torch.float64) + v2.sum() + q2.sum())
    out = torch.zeros(0, m, dv, **f64) + anchor
    flags = dict(dtype=torch.bool, device=k2.device)
    return (out, torch.zeros(0, n, **f64), torch.zeros(0, **f64), torch.zeros(0, **flags),
            torch.zeros(0, m, **flags))


class SVAttention(torch.nn.Module):
    """SV-Attention over given keys, values and queries (no projections; exact gate).

    Parameters
    ----------
    C : float
        Box constraint of every gate (fixed).
    sigma : float
        RBF width.

    Attributes
    ----------
    last_info : SVAttentionInfo or None
        Diagnostics of the latest forward (warm-up and zero-denominator flags).

    Notes
    -----
    ``forward(keys (..., n, d), values (..., n, dv), queries (..., m, d)) -> (..., m, dv)``;
    see :func:`sv_attention` for the readout, the zero-denominator rule and warm-up.

    Examples
    --------
    >>> import torch
    >>> from svtoolkit.torch import SVAttention
    >>> g = torch.Generator().manual_seed(0)
    >>> x, v, q = (torch.randn(2, s, k, generator=g, dtype=torch.float64)
    ...            for s, k in ((16, 3), (16, 4), (5, 3)))
    >>> layer = SVAttention(C=0.2, sigma=1.5)
    >>> layer(x, v, q).shape
    torch.Size([2, 5, 4])
    >>> layer.support_mask(x).shape
    torch.Size([2, 16])
    """

    def __init__(self, C, sigma):
        super().__init__()
        self.C = check_positive(C, "C")
        self.sigma = check_positive(sigma, "sigma")
        self.last_info = None

    def forward(self, keys, values, queries):
        out, self.last_info = sv_attention(keys, values, queries, C=self.C, sigma=self.sigma,
                                           return_info=True)
        return out

    @torch.no_grad()
    def support_mask(self, keys):
        """Bool tensor of shape (..., n): True where the gate coefficient is > 0.

        Reserve keys (a = 0 exactly) are False: they are certified inert and can be evicted
        without changing any readout. In warm-up every key is True (the readout is ungated).
        """
        check_tensor(keys, "keys")
        if keys.ndim < 2:
            raise ValueError(f"keys must have shape (..., n, d); got {tuple(keys.shape)}")
        check_keys_shape(keys)
        masks = [_gate_or_warmup(k, self.C, self.sigma)[0] > 0 for k in _flatten_batch(keys)]
        if not masks:  # an empty batch
            return torch.zeros(keys.shape[:-1], dtype=torch.bool, device=keys.device)
        return torch.stack(masks).reshape(keys.shape[:-1])

    def extra_repr(self):
        return f"C={self.C:.6g}, sigma={self.sigma:.6g}"
