"""The framework-neutral control flow of the attention layers, written once for torch and MLX.

The SV-Attention layers of Forgetful Attention (arXiv:2607.12204), §3.5 exist twice, as
:mod:`svtoolkit.torch.layers.sv` and :mod:`svtoolkit.mlx.layers`. What they do is here: the
argument and input checks, the head split and merge, the composition of gate and readout in the
three paths, and the streaming step (one token: project, store, read every head, merge); the
torch base class of every layer (:class:`svtoolkit.torch.layers.HeadsAttention`) takes its
head and input checks and its ``step`` from here too. Each backend supplies its tensor
operations as a namespace ``ops`` (a module of functions, set as the class attribute ``ops``)
and keeps its public methods, which call the methods below. The rules the ops follow
(warm-up, chunk boundaries, the exact streaming bookkeeping) are in :mod:`svtoolkit._gate_core`.

Nothing here touches a tensor except through ``ops`` and the Python operators that torch
tensors and MLX arrays share (``@``, ``*``, ``-``, ``/``, ``**``, ``>``, indexing). ``ops``
provides:

* checks: ``array_type`` (the framework's array class), ``is_floating(x)``,
  ``dtype_text(dtype)`` (a dtype as the messages name it), ``SUPPORTED_DTYPES``;
* projections: ``split_heads(y, n_heads, head_dim)`` ((B, T, H*D) -> (B, T, H, D)),
  ``merge_heads(o)`` ((..., H, D) -> (..., H*D)), ``rms_norm(y)`` (over the last dimension);
* the gate and its readouts: ``sv_gate``, ``exact_sv_gate``, ``uniform_sv_gate``,
  ``sv_rbf_readout``, ``sv_hybrid_readout`` (the framework's ops);
* streaming: ``no_grad()`` (a context), ``stored_keys(k)`` ((B, H, D) -> per sequence a
  detached (H, D) float64 CPU key, as :class:`svtoolkit._gate_core.ExactStream` stores it),
  ``stored_values(v)`` (detached, indexed by sequence), ``stack(arrays, axis=0)``,
  ``stack_keys(keys, dtype)`` (stored keys -> one array), ``array(values, dtype)``,
  ``concat(arrays, axis)``, ``heads_first(a)`` ((n, H, ...) -> (H, n, ...)), ``exp``,
  ``sum(a, axis=None)``, ``where``, and the row reductions ``masked_max(a, mask)`` and
  ``masked_min(a, mask)`` (over the last axis, kept as an axis of length 1).
"""

from __future__ import annotations

import dataclasses
import math

from ._gate_core import (
    GATE_MODES,
    GATE_UPDATES,
    PREFIX_WEIGHTINGS,
    QK_NORMS,
    ExactStream,
    GateOptions,
    default_sigma,
    unsupported_dtype,
)
from ._validation import check_int, check_option

__all__ = [
    "HybridSVLayerCore",
    "SVLayerCore",
    "SVStreamCore",
    "check_heads",
    "check_sequence",
    "check_switches",
    "gate_spacing",
    "step_token",
]


# --------------------------------------------------------------------------------------------
# checks shared by every layer of both frameworks
# --------------------------------------------------------------------------------------------


def check_heads(d_model, n_heads, head_dim=None):
    """The head width D of ``n_heads`` heads over ``d_model`` (``d_model // n_heads`` unless
    ``head_dim`` is given); every value an int >= 1."""
    check_int(d_model, "d_model", min=1)
    check_int(n_heads, "n_heads", min=1)
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                             "or pass head_dim=")
        head_dim = d_model // n_heads
    check_int(head_dim, "head_dim", min=1)
    return head_dim


def check_sequence(x, d_model, ops):
    """Check x is a floating-point (B, T, d_model) array of the framework, with T >= 1."""
    if not isinstance(x, ops.array_type):
        raise TypeError(f"x must be a floating-point tensor; got {type(x).__name__}")
    if not ops.is_floating(x):
        raise TypeError(f"x must be a floating-point tensor; got dtype {ops.dtype_text(x.dtype)}")
    if x.ndim != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape (B, T, d_model={d_model}); got {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError("the sequence is empty (T = 0); pass at least one token")


def step_token(layer, x_t, state, ops, **options):
    """One token through ``layer.forward_with_state``: x_t (B, d_model) -> (y_t, state)."""
    if not isinstance(x_t, ops.array_type) or x_t.ndim != 2:
        shape = tuple(x_t.shape) if isinstance(x_t, ops.array_type) else type(x_t).__name__
        raise ValueError(f"x_t must have shape (B, d_model={layer.d_model}); got {shape}")
    y, state = layer.forward_with_state(x_t[:, None], state, **options)
    return y[:, 0], state


# --------------------------------------------------------------------------------------------
# the SV layers
# --------------------------------------------------------------------------------------------


def check_switches(gate, gate_update, qk_norm):
    """The checked ablation switches ``(gate, gate_update, qk_norm)`` of an SV layer."""
    return (check_option(gate, "gate", GATE_MODES),
            check_option(gate_update, "gate_update", GATE_UPDATES),
            check_option(qk_norm, "qk_norm", QK_NORMS))


def gate_spacing(gate_update, chunk):
    """Spacing of the gate boundaries: ``chunk``, or 1 with ``gate_update="token"``."""
    return 1 if gate_update == "token" else chunk


class SVLayerCore:
    """The control flow of ``CausalSVAttention`` (mixed into each framework's class).

    The class using it sets ``ops``, ``d_model``, ``n_heads``, ``head_dim`` (before
    :meth:`_set_gate_options`), the q/k/v/o projections (callables on the framework's arrays),
    the public property ``gate_chunk`` (by :func:`gate_spacing`) and ``init_state``; its public
    methods call the paths below (they stay in the framework's class, where the API reference
    documents them).
    """

    #: the backend's tensor operations (see the module docstring)
    ops = None
    hybrid = False
    prefix_weighting = "normalized"

    def _set_gate_options(self, switches, *, C, sigma, chunk, fista_iters, ridge):
        """Check the gate's options and set them (``head_dim`` must be set)."""
        gate, gate_update, qk_norm = switches
        gate_options = GateOptions(
            C=C, sigma=default_sigma(qk_norm, self.head_dim) if sigma is None else sigma,
            chunk=chunk, ridge=ridge)
        fista_iters = check_int(fista_iters, "fista_iters", min=1)
        self.gate_mode, self.gate_update, self.qk_norm = gate, gate_update, qk_norm
        #: the checked options of the gate (framework-neutral, shared by torch and MLX)
        self.gate_options = dataclasses.replace(gate_options, iters=fista_iters)
        self.C, self.sigma, self.chunk = gate_options.C, gate_options.sigma, gate_options.chunk
        self.fista_iters, self.ridge = fista_iters, gate_options.ridge

    # ------------------------------------------------------------------ projections
    def _check_input(self, x):
        """x is a float32/float64 (B, T, d_model) array with T >= 1, and so are the weights."""
        check_sequence(x, self.d_model, self.ops)
        weight = self.q_proj.weight.dtype
        if x.dtype not in self.ops.SUPPORTED_DTYPES or weight not in self.ops.SUPPORTED_DTYPES:
            raise TypeError(unsupported_dtype(type(self).__name__, x.dtype, weight))

    def _qkv(self, x):
        """Per-head q, k, v of x, each (B, T, H, D); q and k RMS-normalised unless
        ``qk_norm="none"``."""
        self._check_input(x)
        split = self.ops.split_heads
        q, k, v = (split(proj(x), self.n_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm == "none":
            return q, k, v
        return self.ops.rms_norm(q), self.ops.rms_norm(k), v

    # ------------------------------------------------------------------ gate and readout
    def _gate_of(self, k, exact, exclude):
        ops, chunk = self.ops, self.gate_chunk
        if self.gate_mode == "uniform":
            return ops.uniform_sv_gate(k, C=self.C, chunk=chunk, exclude=exclude)
        if exact:
            return ops.exact_sv_gate(k, C=self.C, sigma=self.sigma, chunk=chunk,
                                     exclude=exclude)
        return ops.sv_gate(k, C=self.C, sigma=self.sigma, chunk=chunk,
                           iters=self.fista_iters, ridge=self.ridge, exclude=exclude)

    def _readout(self, q, k, v, gate, exclude):
        ops, chunk = self.ops, self.gate_chunk
        if self.hybrid:
            return ops.sv_hybrid_readout(q, k, v, gate, chunk=chunk, exclude=exclude,
                                         prefix_weighting=self.prefix_weighting)
        return ops.sv_rbf_readout(q, k, v, gate, sigma=self.sigma, chunk=chunk,
                                  exclude=exclude, shift=self.qk_norm == "none")

    # ------------------------------------------------------------------ the paths
    def _forward(self, x, exact, exclude):
        """The training (``exact=False``) or exact-gate path: x (B, T, d_model) -> same."""
        q, k, v = self._qkv(x)
        gate = self._gate_of(k, exact, exclude)
        return self.o_proj(self.ops.merge_heads(self._readout(q, k, v, gate, exclude)))

    def _gate_for(self, x, exact, exclude):
        """The gate of every gate boundary for input x."""
        _, k, _ = self._qkv(x)
        return self._gate_of(k, exact, exclude)

    def _stream(self, x, state):
        """Exact streaming of x (B, T, d_model) from ``state`` (a fresh one if None)."""
        self._check_input(x)
        if state is None:
            state = self.init_state(x.shape[0])
        if state.layer is not self or state.batch_size != x.shape[0]:
            raise ValueError("state belongs to another layer or batch size")
        with self.ops.no_grad():
            outs = [state._push(self, x[:, t]) for t in range(x.shape[1])]
        return self.ops.stack(outs, 1), state


class HybridSVLayerCore:
    """The hybrid's option (mixed in before the framework's ``CausalSVAttention``)."""

    hybrid = True

    def __init__(self, d_model, n_heads, *, prefix_weighting="normalized", **options):
        prefix_weighting = check_option(prefix_weighting, "prefix_weighting",
                                        PREFIX_WEIGHTINGS)
        super().__init__(d_model, n_heads, **options)
        self.prefix_weighting = prefix_weighting


class SVStreamCore(ExactStream):
    """Exact streaming state of one SV layer: :class:`svtoolkit._gate_core.ExactStream`'s
    bookkeeping, and the readout of one token (through the layer's ``ops``)."""

    def __init__(self, layer, batch_size, *, budget=None):
        super().__init__(layer.C, layer.sigma, layer.gate_chunk, layer.n_heads, batch_size,
                         budget=budget, gate=layer.gate_mode,
                         prefix_weighting=layer.prefix_weighting)
        self.layer = layer

    def _push(self, layer, x_t):
        """Process one token for every sequence: x_t (B, d_model) -> y_t (B, d_model)."""
        ops = layer.ops
        q, k, v = (a[:, 0] for a in layer._qkv(x_t[:, None]))  # (B, H, D)
        keys, values = ops.stored_keys(k), ops.stored_values(v)
        t = self.begin_token()
        outs = []
        for b in range(self.batch_size):
            self.store(b, t, keys[b], values[b])
            outs.append(self._read(layer, b, q[b]))
        self.end_token()
        return layer.o_proj(ops.merge_heads(ops.stack(outs)))

    def nbytes(self):
        """Bytes this state retains for future tokens: the stored keys and values, and the
        cached prefix tensors of the readout (see :meth:`_prefix_tensors`)."""
        stored = (a.nbytes for per_seq in (*self.keys, *self.values) for a in per_seq.values())
        cached = (a.nbytes for entry in self.read_cache if entry is not None
                  for a in entry[1:])
        return int(sum(stored) + sum(cached))

    def _read(self, layer, b, q):
        """Readout of one query (H, D) of sequence b -> (H, Dv), every head at once.

        The RBF weights are computed here from coordinate differences of the stored keys (one
        query against a short list; no Gram block to expand): equal to the ``forward_exact``
        readout to rounding (tested to 1e-12 in float64 torch). Entries of weight 0 (the
        padding of heads with fewer keys) are read as absent.
        """
        ops = layer.ops
        keys, values, weight = self._read_set(layer, b, q.dtype)  # (H, P, D), (H, P, Dv), (H, P)
        readable = weight > 0
        if layer.hybrid:
            logits = (keys @ q[:, :, None])[:, :, 0] / math.sqrt(layer.head_dim)
            scaled = weight * ops.exp(logits - ops.masked_max(logits, readable))
            weight = ops.where(readable, scaled, 0.0)
        else:
            sq = ops.sum((keys - q[:, None, :]) ** 2, axis=-1)
            if layer.qk_norm == "none":  # the readout's shift (see sv_rbf_readout)
                sq = ops.where(readable, sq - ops.masked_min(sq, readable), sq)
            weight = weight * ops.exp(-sq / layer.sigma**2)
        total = ops.sum(weight, axis=-1)[:, None]
        out = (weight[:, None, :] @ values)[:, 0]
        return ops.where(total > 0, out / total, 0.0)

    def _read_set(self, layer, b, dtype):
        """Keys (H, P, D), values (H, P, Dv) and multipliers (H, P) read by sequence b's query:
        the gated prefix (cached until the multipliers change), then, for the hybrid, the
        current chunk's tokens at multiplier 1."""
        ops = layer.ops
        entry = self.read_cache[b]
        if entry is None or entry[0] != dtype:
            entry = self.read_cache[b] = (dtype, *self._prefix_tensors(layer, b, dtype))
        keys, values, weight = entry[1:]
        local = [p for p in self.local[b] if p not in self.forgotten[b]] if layer.hybrid else []
        if not local:
            return keys, values, weight
        local_keys = ops.heads_first(ops.stack_keys([self.keys[b][p] for p in local], dtype))
        local_values = ops.heads_first(ops.stack([self.values[b][p] for p in local]))
        ones = ops.array([[1.0] * len(local)] * layer.n_heads, dtype)
        return (ops.concat([keys, local_keys], 1), ops.concat([values, local_values], 1),
                ops.concat([weight, ones], 1))

    def _prefix_tensors(self, layer, b, dtype):
        """The gated prefix of sequence b as contiguous per-head tensors.

        Head h's keys of multiplier > 0, padded to the longest head (and to one entry at
        least) with zeros at multiplier 0 (zeros, not a stored key: the tensors must hold no
        copy of a token a later ``forget`` of the current chunk removes). Rebuilt only when
        the multipliers change (a chunk boundary, a ``forget`` of an admitted token), not at
        every token.
        """
        ops = layer.ops
        rows = [[(p, m) for p, m in self.multipliers[b][h].items() if m > 0]
                for h in range(layer.n_heads)]
        width = max(1, *(len(row) for row in rows))
        zero_key = self.keys[b][self.position][0] * 0.0  # this token is stored: shapes, dtypes
        zero_value = self.values[b][self.position][0] * 0.0

        def padded(table, zero):
            return [[table[p][h] for p, _ in row] + [zero] * (width - len(row))
                    for h, row in enumerate(rows)]

        keys = ops.stack([ops.stack_keys(row, dtype) for row in padded(self.keys[b], zero_key)])
        values = ops.stack([ops.stack(row) for row in padded(self.values[b], zero_value)])
        weight = ops.array([[m for _, m in row] + [0.0] * (width - len(row)) for row in rows],
                           dtype)
        return keys, values, weight
