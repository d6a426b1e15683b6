"""Matrix-state recurrent layers: linear attention, DeltaNet, Gated DeltaNet."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..._validation import check_bool, check_int, check_option
from ..ops import decayed_linear_attention, delta_rule, gated_delta_rule, linear_attention
from ..ops._common import compute_dtype, l2_normalize
from ._base import HeadsAttention

__all__ = ["LinearAttention", "DeltaNet", "GatedDeltaNet"]

_FEATURE_MAPS = {
    "elu": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
    "identity": lambda x: x,
}


class _RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` on the last dim (nn.RMSNorm needs torch >= 2.4)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + self.eps) * self.weight


class LinearAttention(HeadsAttention):
    """Causal linear attention (Katharopoulos et al., 2020).

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    feature_map : {"elu", "relu", "identity"}, default "elu"
        phi applied to q and k ("elu" is ELU + 1).
    normalize : bool, default True
        Divide by ``phi(q_t) . sum_{j<=t} phi(k_j)``; needs a non-negative feature map.
    chunk : int, default 64
        Chunk size of the scan.
    eps : float, default 1e-6
        Floor of the normaliser.

    Notes
    -----
    ``o_t = sum_{j<=t} (phi(q_t).phi(k_j)) v_j / sum_{j<=t} phi(q_t).phi(k_j)``. The normaliser is
    computed by the same scan on a value column of ones, so the carried state is [B, H, D, D+1].
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        feature_map: str = "elu",
        normalize: bool = True,
        chunk: int = 64,
        eps: float = 1e-6,
        **options,
    ):
        super().__init__(d_model, n_heads, **options)
        check_option(feature_map, "feature_map", tuple(_FEATURE_MAPS))
        if normalize and feature_map == "identity":
            raise ValueError("normalize=True needs a non-negative feature map ('elu' or 'relu')")
        self.feature_map, self.normalize, self.eps = feature_map, normalize, eps
        self.chunk = check_int(chunk, "chunk", min=1)

    def _mix(self, x, q, k, v, state, want_state):
        phi = _FEATURE_MAPS[self.feature_map]
        q, k = phi(q), phi(k)
        if self.normalize:
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        o, state = linear_attention(
            q, k, v, chunk_size=self.chunk, initial_state=state, output_final_state=want_state
        )
        if self.normalize:
            o = o[..., :-1] / o[..., -1:].clamp_min(self.eps)
        return o, state


class DeltaNet(HeadsAttention):
    """DeltaNet (Yang et al., 2024): the delta rule with a per-token write strength.

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    chunk : int, default 64
        Chunk size of the WY scan.

    Notes
    -----
    ``k_t = l2norm(silu(W_k x_t))``, likewise q; ``b_t = sigmoid(w_b . x_t)`` per head;
    ``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``;
    output ``W_o RMSNorm(S_t^T q_t / sqrt(D))``.
    fla's short causal convolution is left out (a pure token mixer here).
    """

    def __init__(self, d_model: int, n_heads: int, *, chunk: int = 64, **options):
        super().__init__(d_model, n_heads, **options)
        self.chunk = check_int(chunk, "chunk", min=1)
        self.b_proj = nn.Linear(d_model, n_heads, bias=True)
        self.o_norm = _RMSNorm(self.head_dim)

    def _mix(self, x, q, k, v, state, want_state):
        q, k = l2_normalize(F.silu(q)), l2_normalize(F.silu(k))
        beta = torch.sigmoid(self.b_proj(x))
        o, state = delta_rule(
            q,
            k,
            v,
            beta=beta,
            chunk_size=self.chunk,
            initial_state=state,
            output_final_state=want_state,
        )
        return self.o_norm(o), state


class GatedDeltaNet(HeadsAttention):
    """Gated DeltaNet (Yang et al., 2025): delta rule plus a data-dependent decay.

    Parameters
    ----------
    d_model, n_heads, head_dim, bias
        See :class:`HeadsAttention`.
    chunk : int, default 64
        Chunk size of the WY scan.
    use_decay : bool, default True
        The decay a_t; False fixes a_t = 1 (the DeltaNet corner, no ``a_proj``, ``A_log``,
        ``dt_bias``).
    use_delta : bool, default True
        The delta correction; False writes ``k_t v_t^T`` at full strength (no ``b_proj``):
        with decay the gated-linear-attention / Mamba-2 corner ``S_t = a_t S_{t-1} + k_t v_t^T``,
        without it linear attention.

    Notes
    -----
    ``g_t = -exp(A_log) softplus(w_a . x_t + dt_bias)`` (<= 0, computed in fp32 or wider),
    ``b_t = sigmoid(w_b . x_t)``, ``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
    output ``W_o (RMSNorm(S_t^T q_t / sqrt(D)) * silu(W_g x_t))``. Initialisation as fla:
    ``A ~ U(1, 16)``, ``dt ~ logU(1e-3, 0.1)`` with ``dt_bias = softplus^{-1}(dt)``. No short
    convolution. The two switches are the ablation corners of the gated delta rule paper
    (Yang, Kautz & Hatamizadeh, ICLR 2025); q, k normalisation, output norm and gate stay.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        chunk: int = 64,
        use_decay: bool = True,
        use_delta: bool = True,
        **options,
    ):
        super().__init__(d_model, n_heads, **options)
        use_decay, use_delta = check_bool(use_decay, "use_decay"), check_bool(use_delta, "use_delta")
        self.chunk = check_int(chunk, "chunk", min=1)
        self.use_decay, self.use_delta = use_decay, use_delta
        if use_decay:
            self.a_proj = nn.Linear(d_model, n_heads, bias=False)
        if use_delta:
            self.b_proj = nn.Linear(d_model, n_heads, bias=True)
        self.g_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.o_norm = _RMSNorm(self.head_dim)
        if use_decay:
            self.A_log = nn.Parameter(torch.empty(n_heads).uniform_(1.0, 16.0).log())
            dt = torch.empty(n_heads).uniform_(math.log(1e-3), math.log(0.1)).exp()
            dt = dt.clamp_min(1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def _log_decay(self, x):
        gate_in = self.a_proj(x)
        dtype = compute_dtype(gate_in)
        return -self.A_log.to(dtype).exp() * F.softplus(gate_in.to(dtype) + self.dt_bias.to(dtype))

    def _mix(self, x, q, k, v, state, want_state):
        q, k = l2_normalize(F.silu(q)), l2_normalize(F.silu(k))
        common = dict(chunk_size=self.chunk, initial_state=state, output_final_state=want_state)
        if self.use_delta:
            beta = torch.sigmoid(self.b_proj(x))
            if self.use_decay:
                o, state = gated_delta_rule(q, k, v, g=self._log_decay(x), beta=beta, **common)
            else:
                o, state = delta_rule(q, k, v, beta=beta, **common)
        elif self.use_decay:
            o, state = decayed_linear_attention(q, k, v, g=self._log_decay(x), **common)
        else:
            o, state = linear_attention(q, k, v, **common)
        return self.o_norm(o) * F.silu(self._heads(self.g_proj(x))), state
