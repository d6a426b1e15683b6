"""Forward error bounds for the fp64 comparisons of the tests.

Two fp64 computations of one exact quantity - the same SVDD optimum reached by another path
(incremental, decremental, a fresh solve), the same weighted average summed in another order,
or the same product on another CPU's BLAS kernel - agree only to rounding, and how far depends
on the length of the sums and on the conditioning of the problem, not on the machine that ran
the test. These helpers turn that dependence into a tolerance, so that a test holds on every
CPU and still fails by orders of magnitude when a path is wrong.

Model (N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002):
``u = eps / 2`` is the unit roundoff and ``gamma(n) = n u / (1 - n u)`` bounds the relative
error of a sum or dot product of length n (§3.1). The SVDD coefficients are bounded a
posteriori, from the residual of the coefficients a path actually produced (Higham §7.2:
``||x - x*|| <= ||M^{-1}|| ||M x - b||``), because the incremental solver's error depends on
its history (rank-one updates, maintained gradients), which no a priori bound of one solve
covers. Readouts and projections are bounded to first order in the perturbations.
"""

from __future__ import annotations

import math

import numpy as np
import torch

UNIT_ROUNDOFF = float(np.finfo(np.float64).eps) / 2


def gamma(n):
    """``n u / (1 - n u)``: the relative error bound of a length-n sum (Higham §3.1)."""
    nu = n * UNIT_ROUNDOFF
    if nu >= 0.5:
        raise ValueError(f"a sum of length {n} has no useful fp64 bound")
    return nu / (1.0 - nu)


def rbf_relative_error(D, radius, sigma):
    """Relative perturbation of one RBF kernel value ``exp(-||a - b||^2 / sigma^2)``.

    The squared distance is a length-D sum (or ``|a|^2 + |b|^2 - 2 a.b``, whose cancellation
    leaves an absolute error of ``gamma(D + 2) 4 r^2`` for norms at most r); dividing by
    ``sigma^2`` turns it into a relative error of the exponential, plus one rounding of exp.
    """
    return gamma(D + 2) * (1.0 + 4.0 * radius**2 / sigma**2) + UNIT_ROUNDOFF


def svdd_coefficient_bound(keys, alpha, C, sigma, *, ridge=0.0, margin=None):
    """A posteriori bound on ``max |a - a*|`` for coefficients a computed for ``keys``.

    ``a*`` is the exact-arithmetic optimum with the partition read off a (error keys at
    exactly C, reserve keys at exactly 0 - a second computation that reads another partition
    fails the comparison by far more than any rounding). On that partition the margin
    coefficients and the offset solve the bordered system ``M x = b`` with
    ``M = [[0, 1^T], [1, 2 K_SS]]`` and ``x = (rho, a_S)``, so any candidate x with residual
    ``r = M x - b`` lies within ``||M^{-1}||_2 ||r||_2`` of x*. The residual is recomputed here in
    fp64 from the keys: ``r_0 = sum(a) - 1`` and ``r_S = g_S - rho`` with the gradient
    ``g = 2 K a - 1`` and rho the mean of ``g_S``; its own rounding (length-n sums of terms at
    most ``K_ij a_j``, ``sum a = 1``) and the kernel's are added in full.

    Two computations of one optimum differ by at most the sum of their bounds. The bound is
    evaluated from the coefficients a path produced, so an incremental path's drift (which
    no a priori bound of a single solve covers) shows in it.

    Parameters
    ----------
    keys : ndarray of shape (n, D)
    alpha : ndarray of shape (n,)
    C, sigma : float
    ridge : float, default 0
        The batched path's ridge: the system is then ``M + diag(0, ridge I)`` (its exact
        solution is what the ridged solve computes, not the SVDD optimum).
    margin : ndarray of shape (n,), bool, optional
        The partition's margin set; default ``0 < alpha < C`` (ridged coefficients may leave
        the box, so pass the mask the solve used).

    Returns
    -------
    float
        0 when the margin set is empty (every coefficient is then exactly 0 or C).
    """
    keys = np.asarray(keys, dtype=np.float64)
    alpha = np.asarray(alpha, dtype=np.float64)
    n, D = keys.shape
    S = np.flatnonzero((alpha > 0) & (alpha < C) if margin is None else np.asarray(margin))
    m = len(S)
    if m == 0:
        return 0.0
    d2 = ((keys[:, None, :] - keys[None, :, :]) ** 2).sum(-1)
    K = np.exp(-d2 / sigma**2)
    g = 2.0 * (K @ alpha) - 1.0
    g[S] += ridge * alpha[S]
    rho = g[S].mean()
    r = np.concatenate([[alpha.sum() - 1.0], g[S] - rho])
    radius = float(np.sqrt((keys**2).sum(-1).max()))
    evaluation = 2.0 * (gamma(n + 1) + rbf_relative_error(D, radius, sigma)) + gamma(n)
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[np.ix_(S, S)] + ridge * np.eye(m)
    smallest = np.linalg.svd(M, compute_uv=False)[-1]
    return float((np.linalg.norm(r) + math.sqrt(m + 1) * evaluation) / smallest)


def weighted_average_bound(weights, mult, dmult, values, weight_error):
    """Bound on ``|o - o'|`` for ``o = sum_i m_i w_i v_i / sum_i m_i w_i`` computed twice.

    First order in the perturbations: a multiplier off by ``dm_i`` or a weight off by a
    relative ``omega`` moves o by ``(dm_i + 2 omega m_i) w_i |v_i - o| / sum_j m_j w_j``
    (the derivative of a weighted average), and the two length-n sums add
    ``2 gamma(n)`` of ``sum m w |v| / sum m w`` each, in the numerator and the denominator.

    Parameters
    ----------
    weights, mult, dmult : Tensor of shape (..., n)
        Kernel or softmax weights w (0 where a key is not read), multipliers m and the bound
        on each multiplier's error.
    values : Tensor of shape (..., n, D)
    weight_error : float or Tensor broadcastable to (..., n)
        Relative error bound of each weight.

    Returns
    -------
    Tensor of shape (...)
        The bound on ``max_d |o_d - o'_d|``; 0 where nothing is read.
    """
    mw = mult * weights
    den = mw.sum(-1)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = (mw[..., None] * values).sum(-2) / safe[..., None]
    spread = (values - out[..., None, :]).abs().amax(-1)
    sums = 4.0 * gamma(weights.shape[-1]) * (mw * values.abs().amax(-1)).sum(-1) / safe
    first = ((dmult + 2.0 * weight_error * mult) * weights * spread).sum(-1) / safe
    return torch.where(den > 0, first + sums, torch.zeros_like(den))


def exact_layer_bound(layer, x, exclude, other=None):
    """Bound on ``|y - y'|`` for two fp64 exact-path computations of an SV layer's outputs.

    The reference is ``forward_exact`` with an exclusion mask per (sequence, head); the other
    computation (streaming, ``step``, another chunking) reaches the same gates along another
    path. Each gated boundary's coefficients are bounded by :func:`svdd_coefficient_bound`,
    each query's readout by :func:`weighted_average_bound`, and ``o_proj`` adds its row sums
    ``|W_o| |do|`` and a length-``H D`` product rounded twice.

    Parameters
    ----------
    layer : CausalSVAttention or HybridSVAttention, float64
    x : Tensor of shape (B, T, d_model)
    exclude : Tensor of shape (B, T) or (B, H, T), bool
    other : dict of int to Tensor of shape (B, H), optional
        The other computation's coefficient bounds (:func:`svdd_coefficient_bound` of its
        own coefficients) at boundary ``gate.ends[j]``. A boundary missing here is assumed
        to be as accurate as the reference's, which the comparison then checks.

    Returns
    -------
    Tensor of shape (B, T, 1)
        The bound for every output of a position (broadcasts against ``y``).
    """
    from svtoolkit.torch.ops.chunked_sv import exact_sv_gate

    with torch.no_grad():
        q, k, v = layer._qkv(x)
        B, T, H, D = q.shape
        if exclude.dim() == 2:
            exclude = exclude[:, None, :].expand(B, H, T)
        fold = lambda t: t.transpose(1, 2).reshape(B * H, T, 1, -1)  # noqa: E731
        qf, kf, vf, ex = fold(q), fold(k), fold(v), exclude.reshape(B * H, T)
        chunk = layer.gate_chunk
        gate = exact_sv_gate(kf, C=layer.C, sigma=layer.sigma, chunk=chunk, exclude=ex)
        weighting = getattr(layer, "prefix_weighting", "normalized")
        scale = 1.0 if (layer.hybrid and weighting == "raw") else 1.0 / layer.C
        mult = gate.multipliers(weighting if layer.hybrid else "normalized")[:, 0]
        dalpha = torch.zeros(B * H, len(gate.ends), dtype=torch.float64)
        for g in range(B * H):
            for j, end in enumerate(gate.ends):
                if gate.gated[g, 0, j]:
                    keep = np.flatnonzero(~ex[g, :end].numpy())
                    dalpha[g, j] = svdd_coefficient_bound(
                        kf[g, keep, 0].numpy(), gate.alpha[g, 0, j, keep].numpy(),
                        layer.C, layer.sigma)
        theirs = dalpha.clone()
        for j, bound in (other or {}).items():
            theirs[:, j] = torch.as_tensor(bound, dtype=torch.float64).reshape(B * H)
        dalpha = torch.where(gate.gated[:, 0], dalpha + theirs, 0.0)
        do = readout_bound(qf[:, :, 0], kf[:, :, 0], vf[:, :, 0], mult, dalpha * scale, ex,
                           hybrid=layer.hybrid, sigma=layer.sigma, chunk=chunk)
        do = do.reshape(B, H, T).transpose(1, 2)  # (B, T, H)
        Dv = v.shape[-1]
        W = layer.o_proj.weight.detach().abs().reshape(-1, H, Dv).sum(-1)  # (d_model, H)
        # |o| <= max |v| (o is an average of values); o_proj rounded twice, length H Dv
        rounding = 2.0 * gamma(H * Dv) * W.sum(-1).max() * v.abs().amax((1, 2, 3))  # (B,)
        per_row = (do[..., None, :] * W).sum(-1).amax(-1)  # (B, T)
        return (per_row + rounding[:, None])[..., None]


def readout_bound(q, k, v, mult, dmult, exclude, *, hybrid, sigma, chunk):
    """Bound on ``max_d |o_td - o'_td|`` for two computations of a chunked SV readout.

    Parameters
    ----------
    q, k, v : Tensor of shape (G, T, D)
        One head's queries, keys and values per row g (heads folded into G).
    mult : Tensor of shape (G, J, P)
        Multipliers of the J chunk boundaries (``SVGate.multipliers`` of one head).
    dmult : Tensor of shape (G, J)
        Bound on the error of every multiplier of a boundary (0: the same multipliers).
    exclude : Tensor of shape (G, T), bool
    hybrid : bool
        The hybrid readout (q.k softmax, own chunk at multiplier 1) or the RBF readout.
    sigma : float
    chunk : int

    Returns
    -------
    Tensor of shape (G, T)
    """
    G, T, D = q.shape
    pos = torch.arange(T)
    c = pos // chunk
    prefix = pos[None, :] < (c * chunk)[:, None]  # (T query, T key)
    own = ~prefix & (pos[None, :] <= pos[:, None])
    radius = float(torch.cat([q, k], 1).norm(dim=-1).max())
    if hybrid:
        logits = q @ k.transpose(-1, -2) / math.sqrt(D)
        read = (prefix | own)[None] & ~exclude[:, None, :]
        top = torch.where(read, logits, torch.full_like(logits, -math.inf)).amax(-1, True)
        weights = torch.where(read, torch.exp(logits - top.clamp_min(-1e300)), 0.0)
        # a logit is a length-D dot product, off by gamma(D) |q| |k| / sqrt(D); so is the max
        weight_error = 2.0 * gamma(D + 2) * radius**2 / math.sqrt(D) + UNIT_ROUNDOFF
    else:
        read = prefix[None] & ~exclude[:, None, :]
        d2 = ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1)
        weights = torch.where(read, torch.exp(-d2 / sigma**2), 0.0)
        weight_error = rbf_relative_error(D, radius, sigma)
    # multiplier of key i for query t: the gate of t's chunk boundary (chunk 0: none)
    J = max(mult.shape[1], 1)
    mult = torch.nn.functional.pad(mult, (0, T - mult.shape[-1], 0, J - mult.shape[1]))
    dmult = torch.nn.functional.pad(dmult, (0, J - dmult.shape[1]))
    row = (c - 1).clamp_min(0)
    m_q = torch.where(prefix[None], mult[:, row], 1.0) * read
    dm_q = torch.where(prefix[None], dmult[:, row][..., None], 0.0) * read
    return weighted_average_bound(weights, m_q, dm_q, v[:, None, :, :], weight_error)


def assert_within(got, ref, bound, what=""):
    """``|got - ref| <= bound`` elementwise, reporting the worst error/bound ratio."""
    got, ref = torch.as_tensor(got).detach(), torch.as_tensor(ref).detach()
    bound = torch.as_tensor(bound).detach().expand_as(ref)
    err = (got - ref).abs()
    ratio = float((err / bound.clamp_min(torch.finfo(torch.float64).tiny)).max())
    assert bool((err <= bound).all()), (
        f"{what}: max |got - ref| = {float(err.max()):.3g}, {ratio:.3g} x its bound "
        f"(the bound there is {float(bound.flatten()[int((err - bound).argmax())]):.3g})")
    return ratio
