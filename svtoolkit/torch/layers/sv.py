"""SV-Attention sequence layers: chunk-frozen gate and hybrid, trainable, with exact inference.

``CausalSVAttention`` and ``HybridSVAttention`` map x (B, T, d_model) -> (B, T, d_model),
exactly causally (Forgetful Attention (arXiv:2607.12204), §3.5, Fig. 2). Two modes for the
queries and keys (``qk_norm``):

* ``"rms"`` (default): per head, keys and queries are RMS-normalised (``||k|| = sqrt(D)``), and
  the default RBF width ``sigma = sqrt(2 D)`` puts typical kernel values near exp(-1) whatever
  the scale of the projections. Since ``||q - k||^2 <= 4 D = 2 sigma^2``, every RBF readout
  weight ``exp(-||q - k||^2 / sigma^2)`` lies in ``[e^-2, 1]``: two keys' kernel values differ
  by at most a factor e^2, so the readout cannot concentrate on one token (only the gate can
  zero keys).
* ``"none"``: the raw learned projections, with a fixed width (default ``sigma = 2``, the
  bandwidth of the paper's reference implementation): the projections set the scale, so the
  kernel can be made as sharp as training wants (the paper's layer, §3.1).

The RBF readout is the paper's equation 1,
``o(q) = sum_i a_i k(q, k_i) v_i / sum_i a_i k(q, k_i)``, in both modes: it is computed with
the multipliers ``a_i / C`` (the factor 1/C cancels in the ratio; an ungated warm-up boundary
reads every key at weight 1). With ``qk_norm="none"`` the squared distances are shifted by
each query's nearest readable key before the exponential (the ratio is unchanged; see
:func:`svtoolkit.torch.ops.chunked_sv.sv_rbf_readout`), so that far keys underflowing to 0 in
float32 cannot leave a query with no weight at all.

Three ways to run the same weights (see :mod:`svtoolkit.torch.ops.chunked_sv` for the math):

* ``forward(x, exclude=None)`` - **training**: the batched gate (FISTA partition finder +
  ridged bordered solve, differentiable; approximate, no certificate).
* ``forward_exact(x, exclude=None)`` - **exact gate**: one fp64 ``IncrementalSVDD`` per
  (sequence, head) admitting each chunk at its boundary; no gradient through the gate.
* ``forward_with_state(x, state)`` / ``step(x_t, state)`` - **exact streaming inference**
  (:class:`SVStreamState`): keys are admitted at chunk boundaries, certified reserve keys are
  evicted under an optional budget, and ``state.forget(b, position)`` deletes a token -
  by exact decrement if it was admitted to the long-range gate, by masking (and
  renormalisation) if it is still in the current chunk. Streaming reproduces
  ``forward_exact(x, exclude)`` for every output computed after the deletions.

Deletion semantics (the paper's, made precise): after ``forget(b, p)`` every later output of
sequence b equals the output of ``forward_exact`` on the same tokens with p excluded
(``exclude[b, p] = True``) - for a long-range token because the gate is re-solved exactly
without it (same C), for a current-chunk token because it is masked out of the local read and
of future admission. Outputs emitted before the call are history and are not recomputed.
Certified eviction changes no output until the next admission (reserve keys carry weight
exactly 0; a later admission may have made them matter again - the certificate's scope).
Under a budget the stored keys and values are bounded too: a position's key and value are
dropped once no head holds it and it is not in the current chunk.

Ablation switches (defaults are the layer above; ``docs/layers.md`` has the table):
``gate="uniform"`` reads every prefix key at weight 1 ("SV (no gate)"), ``gate_update="token"``
re-solves the gate at every token (the chunk-1 gate; one solve per token), and the hybrid's
``prefix_weighting="raw"`` weights gated prefix keys by ``a_i`` instead of ``a_i / C``. All
three paths and the streaming state honour them.

Streaming inference is not differentiable: ``forward_with_state`` and ``step`` run without
autograd and the state stores detached keys and values (train with ``forward``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..._gate_core import (
    GATE_MODES,
    GATE_UPDATES,
    PREFIX_WEIGHTINGS,
    QK_NORMS,
    ExactStream,
    GateOptions,
    default_sigma,
    unsupported_dtype,
)
from ..._validation import check_int, check_option
from ..ops.chunked_sv import (
    exact_sv_gate,
    sv_gate,
    sv_hybrid_readout,
    sv_rbf_readout,
    uniform_sv_gate,
)
from ._base import HeadsAttention

__all__ = ["CausalSVAttention", "HybridSVAttention", "SVStreamState"]

#: dtypes of the inputs and weights the SV layers compute in (the exact gate is fp64 inside).
SUPPORTED_DTYPES = (torch.float32, torch.float64)


class CausalSVAttention(HeadsAttention):
    """Chunk-frozen SV-Attention: each chunk's queries read the SVDD gate of the causal prefix.

    Parameters
    ----------
    d_model, n_heads : int
        Width and number of heads H (head width D = d_model // n_heads unless ``head_dim``).
    C : float, default 0.25
        Box of the gate, fixed (the paper's language-model value).
    sigma : float, optional
        RBF width of the gate and of the RBF readout. Default ``sqrt(2 D)`` with
        ``qk_norm="rms"``, ``2.0`` with ``qk_norm="none"``; an explicit value always wins.
    chunk : int, default 64
        Chunk length L; the gate of chunk c is fit on the keys [0, c L).
    fista_iters : int, default 80
        FISTA iterations of the batched partition finder (training path).
    ridge : float, default 1e-3
        Ridge of the batched bordered solve (training path).
    gate : {"svdd", "uniform"}, default "svdd"
        ``"uniform"`` switches the gate off: every prefix key is read at multiplier 1 (same
        keys, same readout; nothing is solved) - the "SV (no gate)" ablation of Forgetful
        Attention (arXiv:2607.12204), §5, Table 2.
    gate_update : {"chunk", "token"}, default "chunk"
        ``"chunk"``: chunk-frozen, query t reads the gate fit on the prefix before its chunk
        (the paper's layer). ``"token"``: the gate is re-solved at every token and query t
        reads the gate of ``[0, t)`` (the token-level ablation of §3.5); the hybrid's local
        path is then the token itself. This is the chunk-1 gate: ``chunk`` is not used, and
        every path costs one gate solve per token (T - 1 batched ridged solves in training,
        one exact increment per token at inference).
    qk_norm : {"rms", "none"}, default "rms"
        ``"rms"``: per-head RMS-normalised queries and keys (every RBF readout weight in
        ``[e^-2, 1]`` at the default width). ``"none"``: the raw learned projections, as
        Forgetful Attention (arXiv:2607.12204) writes the layer (the readout can concentrate).
        Values are never normalised.
    head_dim, bias : see :class:`svtoolkit.torch.layers.HeadsAttention`.

    Notes
    -----
    Warm-up: a prefix with fewer than ``ceil(1/C) + 2`` keys is read ungated. The first chunk
    (empty prefix) outputs 0 before ``o_proj``; the hybrid variant fixes that blind spot.
    Inputs and weights must be float32 or float64 (``TypeError`` otherwise; the batched gate
    has no half-precision kernels).
    """

    hybrid = False

    prefix_weighting = "normalized"

    def __init__(self, d_model, n_heads, *, C=0.25, sigma=None, chunk=64, fista_iters=80,
                 ridge=1e-3, gate="svdd", gate_update="chunk", qk_norm="rms", **options):
        gate = check_option(gate, "gate", GATE_MODES)
        gate_update = check_option(gate_update, "gate_update", GATE_UPDATES)
        qk_norm = check_option(qk_norm, "qk_norm", QK_NORMS)
        super().__init__(d_model, n_heads, **options)
        gate_options = GateOptions(
            C=C, sigma=default_sigma(qk_norm, self.head_dim) if sigma is None else sigma,
            chunk=chunk, ridge=ridge)
        fista_iters = check_int(fista_iters, "fista_iters", min=1)
        self.gate_mode, self.gate_update, self.qk_norm = gate, gate_update, qk_norm
        #: the checked options of the gate (framework-neutral, shared with the MLX layers)
        self.gate_options = dataclasses.replace(gate_options, iters=fista_iters)
        self.C, self.sigma, self.chunk = gate_options.C, gate_options.sigma, gate_options.chunk
        self.fista_iters, self.ridge = fista_iters, gate_options.ridge

    # ------------------------------------------------------------------ projections
    def _check_input(self, x):
        """The base checks, then float32/float64 for x and the weights."""
        super()._check_input(x)
        weight = self.q_proj.weight.dtype
        if x.dtype not in SUPPORTED_DTYPES or weight not in SUPPORTED_DTYPES:
            raise TypeError(unsupported_dtype(type(self).__name__, x.dtype, weight))

    def _qkv(self, x):
        self._check_input(x)
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm == "none":
            return q, k, v
        return F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,)), v

    def extra_repr(self):
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"C={self.C:.6g}, sigma={self.sigma:.6g}, chunk={self.chunk}, "
                f"qk_norm={self.qk_norm!r}")

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

    # ------------------------------------------------------------------ the three paths
    def forward(self, x, exclude=None):
        """Training path: x (B, T, d_model) -> (B, T, d_model), batched approximate gate.

        ``exclude`` (B, T) bool removes tokens from the gates and the readout.
        """
        q, k, v = self._qkv(x)
        gate = self._gate_of(k, False, exclude)
        return self.o_proj(self._readout(q, k, v, gate, exclude).flatten(-2))

    def forward_exact(self, x, exclude=None):
        """Exact-gate path: the same readout on coefficients from the fp64 exact solver."""
        q, k, v = self._qkv(x)
        gate = self._gate_of(k, True, exclude)
        return self.o_proj(self._readout(q, k, v, gate, exclude).flatten(-2))

    def gate(self, x, *, exact=False, exclude=None):
        """The gate coefficients of every gate boundary (:class:`SVGate`) for input x."""
        _, k, _ = self._qkv(x)
        return self._gate_of(k, exact, exclude)

    def init_state(self, batch_size, *, budget=None):
        """A fresh exact streaming state for ``batch_size`` sequences (see SVStreamState)."""
        return SVStreamState(self, batch_size, budget=budget)

    def forward_with_state(self, x, state=None):
        """Exact streaming: continue the sequences of ``state`` with x (B, T, d_model).

        Inference only: runs without autograd (the outputs carry no graph).
        """
        self._check_input(x)
        if state is None:
            state = self.init_state(x.shape[0])
        if state.layer is not self or state.batch_size != x.shape[0]:
            raise ValueError("state belongs to another layer or batch size")
        with torch.no_grad():
            outs = [state._push(self, x[:, t]) for t in range(x.shape[1])]
        return torch.stack(outs, 1), state


class HybridSVAttention(CausalSVAttention):
    """SV-Attention with a dense local path (paper Fig. 2b).

    A query at t attends with a learned q.k softmax over all of [0, t]: keys of the long-range
    prefix (before t's chunk) are multiplied by their gate multiplier ``a_i / C``, keys of t's
    own chunk (up to t) are read directly. Same parameters as :class:`CausalSVAttention`,
    plus:

    Parameters
    ----------
    prefix_weighting : {"normalized", "raw"}, default "normalized"
        ``"normalized"``: gated prefix keys weigh ``a_i / C`` (an ungated boundary is plain
        softmax). ``"raw"``: they weigh the raw coefficient ``a_i`` (summing to 1), as
        Forgetful Attention (arXiv:2607.12204), §3.5 writes the hybrid. Ungated boundaries
        (warm-up, ``gate="uniform"``) read every key at 1 in both. ``qk_norm`` does not
        change this choice: the hybrid as §3.5 writes it ("the long-range prefix is weighted
        by the gate coefficient") is ``qk_norm="none", prefix_weighting="raw"``.
    """

    hybrid = True

    def __init__(self, d_model, n_heads, *, prefix_weighting="normalized", **options):
        prefix_weighting = check_option(prefix_weighting, "prefix_weighting",
                                        PREFIX_WEIGHTINGS)
        super().__init__(d_model, n_heads, **options)
        self.prefix_weighting = prefix_weighting


class SVStreamState(ExactStream):
    """Exact streaming state of one SV layer for ``batch_size`` sequences.

    Per (sequence, head): an :class:`svtoolkit.IncrementalSVDD` over the admitted long-range
    keys (fp64) and the gate multipliers. Per sequence: the current chunk's tokens (read
    directly by the hybrid; admitted at the next boundary) and the key and value of every
    position still needed - held by some head's solver or in the current chunk and not
    forgotten. Keys and values are stored detached: streaming is inference only. The
    bookkeeping (admission, eviction, ``forget``) is framework-neutral
    (:class:`svtoolkit._gate_core.ExactStream`, shared with the MLX layers); this class adds
    the torch readout.

    Parameters
    ----------
    layer : CausalSVAttention or HybridSVAttention
    batch_size : int
    budget : int, optional
        Admitted keys per (sequence, head) above which certified reserve keys are evicted at a
        boundary. Keys with weight > 0 are never evicted (the certificate would not hold), so a
        support set larger than the budget keeps the memory above it (``over_budget`` counts
        such boundaries). A key evicted from every head is dropped from the stored keys and
        values, so the memory stays bounded over an unbounded stream.
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
            Any integer (Python, NumPy or a one-element integer torch tensor), converted with
            ``operator.index`` before anything changes.

        Returns
        -------
        str
            ``"decremented"`` (it was in the long-range gate: exact decrement, gate re-solved),
            ``"masked"`` (it was in the current chunk: masked out of the local read and of
            future admission), or ``"evicted"`` (a certified eviction had already removed it
            from every head: nothing carried its weight).

        Raises
        ------
        TypeError
            ``b`` or ``position`` is not an integer (a float, a float tensor, a bool).
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
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # (B, H, D)
        t = self.begin_token()
        outs = []
        for b in range(self.batch_size):
            self.store(b, t, k[b].detach().to("cpu", torch.float64), v[b].detach())
            outs.append(self._read(layer, b, q[b]))
        self.end_token()
        return layer.o_proj(torch.stack(outs).flatten(-2))

    def _read(self, layer, b, q):
        """Readout of one query (H, D) of sequence b -> (H, Dv).

        The RBF weights are computed here from coordinate differences of the stored keys (one
        query against a short list; no Gram block to expand), not by ``rbf_gram``: equal to the
        ``forward_exact`` readout to rounding (tested to 1e-12 in float64).
        """
        outs = []
        for h in range(layer.n_heads):
            prefix, mult = self.read_sets(b, h, layer.hybrid)
            if not prefix:
                outs.append(torch.zeros_like(self.values[b][self.position][h]))
                continue
            keys = torch.stack([self.keys[b][p][h] for p in prefix]).to(q.dtype)
            values = torch.stack([self.values[b][p][h] for p in prefix])
            weight = torch.tensor(mult, dtype=q.dtype)
            if layer.hybrid:
                logits = keys @ q[h] / math.sqrt(layer.head_dim)
                weight = weight * torch.exp(logits - logits.max())
            else:
                sq = ((keys - q[h]) ** 2).sum(-1)
                readable = weight > 0
                if layer.qk_norm == "none" and bool(readable.any()):
                    # the readout's shift (see sv_rbf_readout); unreadable keys unshifted
                    sq = torch.where(readable, sq - sq[readable].min(), sq)
                weight = weight * torch.exp(-sq / layer.sigma**2)
            total = weight.sum()
            outs.append(weight @ values / total if total > 0 else torch.zeros_like(values[0]))
        return torch.stack(outs)
