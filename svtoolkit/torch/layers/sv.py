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

from ..._layer_core import (
    HybridSVLayerCore,
    SVLayerCore,
    SVStreamCore,
    check_switches,
    gate_spacing,
)
from . import _tensor_ops
from ._base import HeadsAttention

__all__ = ["CausalSVAttention", "HybridSVAttention", "SVStreamState"]


class CausalSVAttention(SVLayerCore, HeadsAttention):
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

    # the control flow is svtoolkit._layer_core's; these are the tensor operations it runs on
    ops = _tensor_ops

    def __init__(self, d_model, n_heads, *, C=0.25, sigma=None, chunk=64, fista_iters=80,
                 ridge=1e-3, gate="svdd", gate_update="chunk", qk_norm="rms", **options):
        switches = check_switches(gate, gate_update, qk_norm)
        super().__init__(d_model, n_heads, **options)
        self._set_gate_options(switches, C=C, sigma=sigma, chunk=chunk,
                               fista_iters=fista_iters, ridge=ridge)

    def extra_repr(self):
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"C={self.C:.6g}, sigma={self.sigma:.6g}, chunk={self.chunk}, "
                f"qk_norm={self.qk_norm!r}")

    @property
    def gate_chunk(self):
        """Spacing of the gate boundaries: ``chunk``, or 1 with ``gate_update="token"``."""
        return gate_spacing(self.gate_update, self.chunk)

    # ------------------------------------------------------------------ the three paths
    def forward(self, x, exclude=None):
        """Training path: x (B, T, d_model) -> (B, T, d_model), batched approximate gate.

        ``exclude`` (B, T) bool removes tokens from the gates and the readout.
        """
        return self._forward(x, False, exclude)

    def forward_exact(self, x, exclude=None):
        """Exact-gate path: the same readout on coefficients from the fp64 exact solver."""
        return self._forward(x, True, exclude)

    def gate(self, x, *, exact=False, exclude=None):
        """The gate coefficients of every gate boundary (:class:`SVGate`) for input x."""
        return self._gate_for(x, exact, exclude)

    def init_state(self, batch_size, *, budget=None):
        """A fresh exact streaming state for ``batch_size`` sequences (see SVStreamState)."""
        return SVStreamState(self, batch_size, budget=budget)

    def forward_with_state(self, x, state=None):
        """Exact streaming: continue the sequences of ``state`` with x (B, T, d_model).

        Inference only: runs without autograd (the outputs carry no graph).
        """
        return self._stream(x, state)


class HybridSVAttention(HybridSVLayerCore, CausalSVAttention):
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


class SVStreamState(SVStreamCore):
    """Exact streaming state of one SV layer for ``batch_size`` sequences.

    Per (sequence, head): an :class:`svtoolkit.IncrementalSVDD` over the admitted long-range
    keys (fp64) and the gate multipliers. Per sequence: the current chunk's tokens (read
    directly by the hybrid; admitted at the next boundary) and the key and value of every
    position still needed - held by some head's solver or in the current chunk and not
    forgotten. Keys and values are stored detached: streaming is inference only. The
    bookkeeping (admission, eviction, ``forget``, :class:`svtoolkit._gate_core.ExactStream`) and
    the readout of each token (:mod:`svtoolkit._layer_core`) are framework-neutral, shared with
    the MLX layers; this class runs them on torch tensors.

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
