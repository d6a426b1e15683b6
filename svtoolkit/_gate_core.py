"""The framework-neutral part of the chunked SV gate: options, rules, exact prefix gates.

The SV-Attention layers of Forgetful Attention (arXiv:2607.12204), §3.5, exist twice, in
torch (:mod:`svtoolkit.torch`) and in MLX (:mod:`svtoolkit.mlx`). Everything about them that is
not tensor algebra lives here, once, so that the twins cannot drift:

* the option checks (:func:`check_box`, :func:`check_iters`, :func:`check_partition_tol`,
  :func:`check_ridge`) and the layer options (:class:`GateOptions`), with one message per bad
  value whatever the framework;
* the rules: chunk boundaries (:func:`chunk_ends`), the warm-up size (:func:`warmup_size`),
  the feasibility and error-overflow count thresholds (:func:`count_threshold`), the padded
  widths of the batched solve (:func:`bucket_width`);
* the exact prefix gates on NumPy arrays (:func:`exact_prefix_gates`, fp64 exact solver);
* the gate result's fields (:class:`GateResult`, subclassed by each framework for its
  multipliers) and the exact streaming bookkeeping (:class:`ExactStream`).

The conventions (sign of rho, warm-up, the paths) are those of ``docs/design.md``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._rules import BATCHED_PARTITION_TOL, FEASIBILITY_TOL, FEASIBLE_FROM, RIDGE
from ._validation import check_int, check_option, check_positive, check_real
from .exact import IncrementalSVDD

__all__ = [
    "COUNT_MAX",
    "ExactStream",
    "GATE_MODES",
    "GATE_UPDATES",
    "GateOptions",
    "GateResult",
    "PREFIX_WEIGHTINGS",
    "QK_NORMS",
    "QUERY_BLOCK",
    "RAW_QK_SIGMA",
    "as_index",
    "bad_exclude",
    "bucket_width",
    "check_box",
    "check_iters",
    "check_partition_tol",
    "check_ridge",
    "chunk_ends",
    "count_threshold",
    "default_sigma",
    "dtype_name",
    "exact_prefix_gates",
    "unsupported_dtype",
    "warmup_size",
]


# --------------------------------------------------------------------------------------------
# option checks (one message per bad value, for torch and MLX alike)
# --------------------------------------------------------------------------------------------


def check_box(C):
    """The box C of the dual: a finite real ``> 0``."""
    return check_positive(C, "C")


def check_iters(iters):
    """FISTA iterations: an int ``>= 0``."""
    return check_int(iters, "iters", min=0)


def check_partition_tol(tol):
    """Relative partition threshold: a real in ``[0, 0.5)``."""
    return check_real(tol, "tol", min=0.0, max=0.5, include_max=False)


def check_ridge(ridge):
    """Ridge of the bordered system: a finite real ``>= 0``."""
    return check_real(ridge, "ridge", min=0)


#: ``gate=``: the SVDD gate (default) or the gate-off ablation (every prefix key at weight 1,
#: the "SV (no gate)" row of Forgetful Attention (arXiv:2607.12204), §5, Table 2).
GATE_MODES = ("svdd", "uniform")
#: ``gate_update=``: one gate per chunk (default, chunk-frozen) or one per token (§3.5).
GATE_UPDATES = ("chunk", "token")
#: ``prefix_weighting=`` of the hybrid: multipliers ``a / C`` (default) or the raw ``a``.
PREFIX_WEIGHTINGS = ("normalized", "raw")
#: ``qk_norm=``: per-head RMS-normalised queries and keys (default; ``||q|| = ||k|| = sqrt(D)``)
#: or the raw learned projections (the layer of Forgetful Attention (arXiv:2607.12204), §3.1).
QK_NORMS = ("rms", "none")
#: Default RBF width with ``qk_norm="none"``: the fixed bandwidth 2 of Forgetful Attention's
#: reference implementation (its ``kpar``, in the same ``exp(-|a - b|^2 / sigma^2)`` convention).
RAW_QK_SIGMA = 2.0


def default_sigma(qk_norm, head_dim):
    """The RBF width of an SV layer built with ``sigma=None``.

    ``sqrt(2 D)`` for ``qk_norm="rms"`` (on keys of norm ``sqrt(D)`` typical kernel values are
    then near ``exp(-1)``), :data:`RAW_QK_SIGMA` for ``qk_norm="none"`` (a fixed width: the
    learned projections set the scale, so they can sharpen the kernel).
    """
    qk_norm = check_option(qk_norm, "qk_norm", QK_NORMS)
    return math.sqrt(2.0 * head_dim) if qk_norm == "rms" else RAW_QK_SIGMA


@dataclass(frozen=True)
class GateOptions:
    """Options of a chunked SV gate, checked once (torch and MLX layers hold one).

    Attributes
    ----------
    C : float
        Box of every gate, fixed, ``> 0``.
    sigma : float
        RBF width, ``> 0``.
    chunk : int
        Chunk length, ``>= 1``.
    iters : int
        FISTA iterations of the batched path, ``>= 0`` (the layers ask for ``>= 1``).
    ridge : float
        Ridge of the batched bordered solve, ``>= 0``.
    tol : float
        Partition threshold of the batched path, a fraction of C in ``[0, 0.5)``.
    """

    C: float
    sigma: float
    chunk: int
    iters: int = 80
    ridge: float = RIDGE
    tol: float = BATCHED_PARTITION_TOL

    def __post_init__(self):
        checked = {
            "C": check_box(self.C),
            "sigma": check_positive(self.sigma, "sigma"),
            "chunk": check_int(self.chunk, "chunk", min=1),
            "iters": check_iters(self.iters),
            "ridge": check_ridge(self.ridge),
            "tol": check_partition_tol(self.tol),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)


# --------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------


def chunk_ends(T, chunk):
    """Prefix ends ``[chunk, 2 chunk, ...]`` of the chunks that have a prefix (start < T)."""
    return list(range(chunk, T, chunk))


def warmup_size(C):
    """Smallest prefix that is gated: ``ceil(1 / C) + 2`` keys (Forgetful Attention
    (arXiv:2607.12204), App. C). ``1 / C`` is rounded down by FEASIBILITY_TOL first, so that a
    C such as ``1 / 4`` computed with rounding does not add a key."""
    return math.ceil(1.0 / C - FEASIBILITY_TOL) + 2


#: Largest count an int32 count array (MLX's) can hold; thresholds above it are never reached.
COUNT_MAX = 2**31 - 1


def count_threshold(C, *, level=FEASIBLE_FROM, strict=False, limit=COUNT_MAX):
    """Smallest integer count k >= 1 with ``k C >= level`` (``> level`` when ``strict``), or
    None if no count up to ``limit`` reaches it.

    Decided in float64 (the products ``k C`` are those torch evaluates). The real threshold
    ``level / C`` is within 2 of the integer one for every k up to 2**31 (exact in float64),
    so five candidates around its ceiling settle it without an open-ended search. With the
    defaults it is the feasibility rule (:func:`svtoolkit._rules.feasible`); with
    ``level = ERRORS_OVERFLOW_ABOVE, strict=True`` the error-overflow rule ``|E| C > 1 + tol``.
    """
    def reaches(k):
        return k * C > level if strict else k * C >= level

    if not reaches(limit):
        return None
    start = max(1, min(math.ceil(level / C), limit) - 2)
    for k in range(start, start + 5):
        if reaches(k):
            return k
    raise AssertionError(f"no count threshold found near {level / C!r}")  # unreachable


def dtype_name(dtype):
    """A dtype's name without its framework: ``torch.float32``, ``mlx.core.float32`` and
    ``float32`` all give ``"float32"`` (so that messages read the same in torch and MLX)."""
    return str(dtype).rsplit(".", 1)[-1]


def bad_exclude(exclude, shape):
    """The ``ValueError`` for an ``exclude`` that is not a bool array of shape ``(B, T)``."""
    if hasattr(exclude, "dtype") and hasattr(exclude, "shape"):
        got = f"{dtype_name(exclude.dtype)} {tuple(exclude.shape)}"
    else:
        got = type(exclude).__name__
    return ValueError(f"exclude must be a bool array of shape (B, T) = {tuple(shape)}; got {got}")


def unsupported_dtype(layer_name, x_dtype, weight_dtype):
    """The message of the ``TypeError`` for inputs or weights outside float32/float64."""
    return (f"{layer_name} supports float32 and float64 only; got x of dtype "
            f"{dtype_name(x_dtype)} and weights of dtype {dtype_name(weight_dtype)} (convert "
            "the input and the layer to float32 or float64)")


#: Queries per block of the hybrid readout on the training path: each block reads only the
#: keys up to its last query, so the readout costs about half of a (T, T) weight matrix and
#: never holds one; 64 keeps the per-block tensor operations few at T = 1024 and each block's
#: (B, H, 64, e) weights small.
QUERY_BLOCK = 64


#: The bordered system of a padded margin block, of size w + 1, is padded to a multiple of this
#: many rows (:func:`bucket_width`).
BORDERED_ALIGN = 8


def bucket_width(n_margin):
    """Padded size w of one problem's margin block in the batched solve.

    The bordered system's size ``w + 1`` is the smallest ``m 2^e >= |S| + 1`` with m in
    {4, 5, 6, 7}, raised to a multiple of :data:`BORDERED_ALIGN` (which it already is above
    32): w = 7 for |S| <= 7, 15 for 8 to 15, 23 for 16 to 23, 31 for 24 to 31, then quarter
    octaves (39, 47, 55, 63, 79, ...). Quarter-octave steps pad a system by at most 1.25x (an
    LU by at most 1.95x) where the next power of two could double it, and keep the number of
    distinct widths, so of batched calls, at four per octave. The alignment keeps a problem's
    bits independent of where it sits in its batch: a batch of systems of size ``8 k`` starts
    every matrix on a 64-byte boundary (and every float64 right-hand side), and MKL's LU,
    without conditional numerical reproducibility (``MKL_CBWR`` unset, the default), rounds
    differently on differently aligned input - measured on an AMD EPYC: the same 17 x 17 system
    solved at places 3 and 4 of a batch differed by 1.7e-16, enough to break the layers' exact
    causality (a boundary's bucket also holds later prefixes, whose count decides the place).
    w may exceed the number of keys (the extra slots are padding). It depends on the
    problem's own |S| only.
    """
    size = max(int(n_margin), 1) + 1  # the bordered system
    step = 1 << max(size.bit_length() - 3, 0)  # a quarter of the octave below size
    size = -(-size // step) * step
    return -(-size // BORDERED_ALIGN) * BORDERED_ALIGN - 1


# --------------------------------------------------------------------------------------------
# exact prefix gates (NumPy, fp64 exact solver)
# --------------------------------------------------------------------------------------------


def exact_prefix_gates(keys, keep, C, sigma, ends):
    """Exact gate coefficients at every chunk boundary, one solver per (sequence, head).

    Parameters
    ----------
    keys : ndarray of shape (B, T, H, D), float64
    keep : ndarray of shape (B, T), bool
        Tokens admitted to the gates (False: excluded).
    C, sigma : float
    ends : list of int
        Prefix ends (:func:`chunk_ends`).

    Returns
    -------
    alpha : ndarray of shape (B, H, J, P), float64
        Coefficients of boundary j over the positions ``[0, ends[j])`` (0 beyond and on
        excluded positions), P = ends[-1] (0 when there is no boundary).
    gated : ndarray of shape (B, H, J), bool
        True where the solver is certified and the prefix holds at least
        :func:`warmup_size` keys.

    Notes
    -----
    Each chunk's keys are admitted at its end by exact increments
    (:class:`svtoolkit.IncrementalSVDD`), so the coefficients at every boundary are the exact
    optimum of the prefix (certified once ``n C >= 1``).
    """
    B, _, H, _ = keys.shape
    J = len(ends)
    P = ends[-1] if J else 0
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
                if solver.certified and len(solver) >= warmup_size(C):
                    gated[b, h, j] = True
                    alpha[b, h, j, [position[i] for i in solver.ids]] = solver.alpha
    return alpha, gated


# --------------------------------------------------------------------------------------------
# gate result
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GateResult:
    """Gate coefficients at every chunk boundary (fields shared by the torch and MLX gates).

    Attributes
    ----------
    alpha : array of shape (B, H, J, P)
        Coefficients of boundary j over the keys ``[0, ends[j])`` (0 beyond), P = ends[-1];
        a torch tensor or an MLX array.
    gated : array of shape (B, H, J), bool
        False where the gate is off (warm-up, invalid batched problem): multipliers are 1.
    ends : list of int
        Prefix ends ``s_c = c * chunk`` of the chunks c = 1 .. J.
    C : float
        Box of the gates.
    exact : bool
        True when the coefficients come from the exact fp64 solver.

    Subclasses add ``multipliers(weighting="normalized")``: ``max(a / C, 0)`` (``"raw"``:
    ``max(a, 0)``) where gated, 1 where not, 0 beyond each prefix, of shape (B, H, J, P).
    """

    alpha: Any
    gated: Any
    ends: list
    C: float
    exact: bool


# --------------------------------------------------------------------------------------------
# exact streaming bookkeeping
# --------------------------------------------------------------------------------------------


def as_index(name, value):
    """``operator.index(value)`` with a clear error (bools refused, and anything that is not
    an integer: floats, float tensors or arrays)."""
    is_bool = isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", ""))
    if not is_bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")


class ExactStream:
    """Exact streaming gates of ``batch_size`` sequences with ``n_heads`` heads (no tensor ops).

    Per (sequence, head): an :class:`svtoolkit.IncrementalSVDD` over the admitted long-range
    keys (fp64) and the gate multipliers of the admitted positions. Per sequence: the current
    chunk's positions, and the key and value of every position still needed, stored as the
    framework's arrays (detached; keys of shape (H, D) in float64 on the CPU, so that
    ``np.asarray`` reads them exactly). The framework layers own one of these (as a base
    class) and add the readout, which may keep what it derives from the multipliers in
    ``read_cache[b]``: cleared here whenever sequence b's multipliers change.

    Parameters
    ----------
    C, sigma : float
        Box and RBF width of the gates.
    chunk : int
        Chunk length: keys are admitted to the gates at every multiple of it.
    n_heads, batch_size : int
    budget : int, optional
        Admitted keys per (sequence, head) above which certified reserve keys are evicted at a
        boundary (see the layers' ``init_state``).
    gate : {"svdd", "uniform"}, default "svdd"
        ``"uniform"``: every admitted key is read at multiplier 1 (the gate-off ablation; the
        solvers are still kept, so that ``forget`` works the same way). No key is certified
        inert then, so a ``budget`` is refused.
    prefix_weighting : {"normalized", "raw"}, default "normalized"
        Multipliers of a gated prefix: ``a / C`` or the raw coefficients ``a``.
    """

    def __init__(self, C, sigma, chunk, n_heads, batch_size, *, budget=None, gate="svdd",
                 prefix_weighting="normalized"):
        self.C, self.sigma, self.chunk = C, sigma, chunk
        self.gate = check_option(gate, "gate", GATE_MODES)
        self.prefix_weighting = check_option(prefix_weighting, "prefix_weighting",
                                             PREFIX_WEIGHTINGS)
        self.batch_size = check_int(batch_size, "batch_size", min=1)
        if budget is not None:
            budget = check_int(budget, "budget", min=1)
            if self.gate == "uniform":
                raise ValueError("budget needs gate='svdd': a uniform gate certifies no key "
                                 "as inert, so nothing can be evicted without changing outputs")
        self.budget = budget
        self.position = 0
        H = n_heads
        self.solvers = [[IncrementalSVDD(C, sigma) for _ in range(H)]
                        for _ in range(batch_size)]
        self.ids = [[{} for _ in range(H)] for _ in range(batch_size)]  # position -> solver id
        self.keys = [{} for _ in range(batch_size)]  # position -> (H, D) float64 key
        self.values = [{} for _ in range(batch_size)]  # position -> (H, Dv)
        self.local = [[] for _ in range(batch_size)]  # current-chunk positions
        # admitted, not forgotten positions - evicted ones included: the warm-up rule counts
        # the prefix, so that a certified eviction cannot switch the gate off
        self.prefix_size = [0] * batch_size
        self.forgotten = [set() for _ in range(batch_size)]
        self.multipliers = [[{} for _ in range(H)] for _ in range(batch_size)]
        # per sequence: what the framework layer derived from the multipliers for its readout
        # (None: to be rebuilt); cleared whenever they change
        self.read_cache = [None] * batch_size
        self.evicted = 0
        self.over_budget = 0

    # ------------------------------------------------------------------ deletion
    def forget(self, b, position):
        """Delete token ``position`` of sequence ``b`` (see the layers' ``forget``).

        Returns ``"decremented"``, ``"masked"`` or ``"evicted"``; raises TypeError (not an
        integer), IndexError (out of range, not seen) or KeyError (already forgotten) before
        anything changes.
        """
        b, position = as_index("b", b), as_index("position", position)
        self._check_forget(b, position)
        self.forgotten[b].add(position)
        if position in self.local[b]:
            self._drop(b, position)  # never read nor admitted again
            return "masked"
        self.prefix_size[b] -= 1
        outcome = "evicted"
        for h, solver in enumerate(self.solvers[b]):
            key_id = self.ids[b][h].pop(position, None)
            if key_id is not None:
                solver.remove(key_id)
                outcome = "decremented"
            self._refresh(b, h)
        self._drop(b, position)
        return outcome

    def _check_forget(self, b, position):
        """Raise unless token ``position`` of sequence ``b`` can be forgotten now."""
        if not 0 <= b < self.batch_size:
            raise IndexError(f"sequence {b} out of range for batch size {self.batch_size}")
        if not 0 <= position < self.position:
            raise IndexError(f"position {position} has not been seen (stream is at "
                             f"{self.position})")
        if position in self.forgotten[b]:
            raise KeyError(f"position {position} of sequence {b} was already forgotten")

    # ------------------------------------------------------------------ one token
    def begin_token(self):
        """Admit the finished chunk of every sequence when the next position starts a new
        chunk; returns the position of the token being pushed."""
        t = self.position
        if t > 0 and t % self.chunk == 0:
            for b in range(self.batch_size):
                self._admit_chunk(b)
        return t

    def store(self, b, t, key, value):
        """Store the key ((H, D), float64, CPU) and value (H, Dv) of token t of sequence b."""
        self.keys[b][t] = key
        self.values[b][t] = value
        self.local[b].append(t)

    def end_token(self):
        """Move the stream to the next position (after every sequence stored its token)."""
        self.position += 1

    # ------------------------------------------------------------------ internals
    def _drop(self, b, position):
        """Forget the stored key and value of a position no head and no later read needs."""
        self.keys[b].pop(position, None)
        self.values[b].pop(position, None)

    def _refresh(self, b, h):
        """Multipliers of the admitted keys: a / C (or a, raw weighting) when the gate is on,
        else 1 (warm-up, uncertified, or the uniform gate)."""
        solver = self.solvers[b][h]
        mult = {}
        gated = self.gate == "svdd" and solver.certified
        if gated and self.prefix_size[b] >= warmup_size(self.C):
            divisor = 1.0 if self.prefix_weighting == "raw" else self.C
            position_of = {i: p for p, i in self.ids[b][h].items()}
            for key_id, a in zip(solver.ids, solver.alpha, strict=True):
                mult[position_of[int(key_id)]] = a / divisor
        else:
            mult = {p: 1.0 for p in self.ids[b][h]}
        self.multipliers[b][h] = mult
        self.read_cache[b] = None

    def _admit_chunk(self, b):
        """Admit the finished chunk of sequence b, evict over the budget, drop unheld keys."""
        for p in self.local[b]:
            if p in self.forgotten[b]:
                self._drop(b, p)
                continue
            for h, solver in enumerate(self.solvers[b]):
                self.ids[b][h][p] = solver.add(np.asarray(self.keys[b][p][h]))
            self.prefix_size[b] += 1
        self.local[b] = []
        evicted = set()
        for h in range(len(self.solvers[b])):
            evicted.update(self._evict(b, h))
            self._refresh(b, h)
        for p in evicted:  # a key evicted from one head may still be held by another
            if not any(p in ids for ids in self.ids[b]):
                self._drop(b, p)

    def _evict(self, b, h):
        """Certified eviction of head h's reserve keys above the budget; their positions."""
        solver = self.solvers[b][h]
        if self.budget is None or len(solver) <= self.budget:
            return []
        position_of = {i: p for p, i in self.ids[b][h].items()}
        positions = [position_of[int(key_id)] for key_id in solver.evict_reserve()]
        for p in positions:
            del self.ids[b][h][p]
        self.evicted += len(positions)
        if len(solver) > self.budget:
            self.over_budget += 1
        return positions

    def state_summary(self):
        """Admitted keys per (sequence, head), stored keys per sequence, evictions and budget
        overruns."""
        return {
            "position": self.position,
            "admitted": np.array([[len(s) for s in row] for row in self.solvers]),
            "stored": np.array([len(keys) for keys in self.keys]),
            "evicted": self.evicted,
            "over_budget": self.over_budget,
        }
