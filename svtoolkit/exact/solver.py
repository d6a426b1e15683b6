"""IncrementalSVDD: the exact maintained fp64 solver of the SVDD dual.

The Python class holds NumPy state and validates input; the event loop runs in the Numba
kernels of :mod:`svtoolkit.exact._walk` (one crossing per add/remove).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .._rules import BOUND_SNAP
from .._validation import as_key, as_keys, check_positive, check_sigma, largest_violation
from . import _bulk as B
from . import _walk as W
from ._rest import remove_and_settle, settle, sum_rounding
from ._state import (
    INT64_MAX,
    check_state,
    shifted_inverse,
    steering_fields,
    state_int,
    state_ints,
    unshifted_inverse,
)

__all__ = ["IncrementalSVDD", "MarginSystem", "SolverFailure", "Audit", "Consistency"]

#: Fresh gradients switch from the Numba loop to blocked matrix products above this much work
#: (n * |support| * d multiply-adds) for keys of at least BLAS_FRESH_MIN_DIM dimensions (below
#: that the vectorised Numba loop was measured faster).
BLAS_FRESH_WORK = 20_000_000
BLAS_FRESH_MIN_DIM = 128
#: The matrix-product path is taken only while every key, centred on the support's mean, has
#: ||x - c||^2 / sigma^2 at most this: the expansion |x|^2 + |y|^2 - 2 x.y then loses at most
#: ~eps * 2 * BLAS_FRESH_MAX_SPREAD ~ 5e-14 of a scaled squared distance. Keys spread wider (or
#: far from the origin without centring: a translated problem, or huge finite keys) take the
#: coordinate-wise loop, which is exact for any finite keys.
BLAS_FRESH_MAX_SPREAD = 100.0
#: ``extend`` of at least BULK_MIN_KEYS keys into an empty solver takes the bulk path (SMO, then
#: an exact landing; ``svtoolkit.exact._bulk``): on the shifted Gram matrix up to BULK_MAX_KEYS
#: keys (128 MiB at 4096), Gram-free above. Other batches replay the walk.
BULK_MIN_KEYS = 64
BULK_MAX_KEYS = 4096
#: The Gram-free SMO keeps at most this many bytes of kernel columns (an LRU cache; 335
#: columns at n = 10^5) ...
BULK_CACHE_BYTES = 256 * 2**20
#: ... starts from the partition of an evenly spaced subsample of this many keys (at most
#: n / 8: a subsample near n costs what the whole build costs) ...
BULK_GUESS_KEYS = 4096
#: ... and gives up (the walk replays the batch) after this many iterations per key.
BULK_SMO_ITERATIONS = 50
#: SMO coefficients within this fraction of C of a bound are read as at the bound.
BULK_PARTITION_SNAP = 1e-9
#: The bulk landing is accepted when its KKT residual (fresh) is at most this; otherwise the
#: batch is replayed by the walk, so the bulk path never returns a worse state.
BULK_KKT_TOL = 1e-12
#: A landing above BULK_KKT_TOL is first polished (a fresh inverse and gradients, then the
#: walk's rest state from its partition) up to this many times before the batch is replayed.
#: Measured: landings rejected at 9e-11 (150 collinear keys) and 3.7e-12 (2,048 heavy-tailed
#: keys) came from maintained gradients that had drifted from a fresh evaluation.
BULK_POLISH_ROUNDS = 2
#: Audit thresholds: maintained gradients vs a fresh evaluation, and ||R M - I||_max.
#: AUDIT_GRAD_TOL also bounds rho's offset from a fresh solve's choice (units of f as well:
#: it moves every f by that much).
AUDIT_GRAD_TOL = 1e-10
AUDIT_INVERSE_TOL = 1e-8


class SolverFailure(RuntimeError):
    """The exact walk could not finish (event limit or no admissible event).

    Raised after the solver has been rebuilt from the keys it held before the operation, so
    the state is that of a fresh solve of those keys.
    """


@dataclass(frozen=True)
class Consistency:
    """What :meth:`IncrementalSVDD.consistency` measured (NaN anywhere reads as ``inf``).

    Attributes
    ----------
    kkt_residual : float
        As :meth:`IncrementalSVDD.kkt_residual`, from fresh gradients.
    grad_drift : float
        ``max |g maintained - g fresh|`` over every key (on the margin set both are ~0).
    inverse_residual : float
        ||R M - I||_max for the maintained bordered inverse R.
    margin_rows_drift : float
        ``max |K_S maintained - K_S fresh|`` over the margin set's kernel rows (0.0 when not
        recomputed).
    rho_offset : float
        ``|rho - the rho a fresh solve reports|`` when no margin coefficient is free (every one
        within a rounding residue of a bound, or none at all; rho is then optimal anywhere in
        an interval and a fresh solve reports its midpoint), from fresh gradients; 0.0 while
        a free margin key fixes rho. Every f is off a fresh solve's by this much. Nonzero
        after :meth:`IncrementalSVDD.evict_reserve` with an empty margin set (rho is kept
        there) or in a state whose rho a residue pinned (also a KKT term then).
    """

    kkt_residual: float
    grad_drift: float
    inverse_residual: float
    margin_rows_drift: float
    rho_offset: float = 0.0


@dataclass(frozen=True)
class Audit:
    """What :meth:`IncrementalSVDD.audit` found and did.

    Attributes
    ----------
    grad_drift, inverse_residual : float
        As in :class:`Consistency`, before any repair.
    kkt_residual : float
        After any repair.
    refactorized : bool
        Whether the drift exceeded the audit thresholds and the state was refactorised.
    rho_offset : float
        As in :class:`Consistency`, before any repair (above AUDIT_GRAD_TOL it is repaired).
    """

    grad_drift: float
    inverse_residual: float
    kkt_residual: float
    refactorized: bool
    rho_offset: float = 0.0


@dataclass(frozen=True)
class MarginSystem:
    """Read-only view of the maintained bordered KKT system (see
    :meth:`IncrementalSVDD.margin_system`)."""

    margin_ids: np.ndarray
    error_ids: np.ndarray
    inverse: np.ndarray
    rho: float
    alpha_margin: np.ndarray
    C: float


class IncrementalSVDD:
    r"""Exact incremental/decremental SVDD (one-class SVM) with a fixed box constraint C.

    Maintains the exact optimum of

    .. math:: \min_a\; a^T K a - \operatorname{diag}(K)^T a
              \quad\text{s.t.}\quad \textstyle\sum_i a_i = 1,\; 0 \le a_i \le C,

    with :math:`K_{ij} = \exp(-\|x_i - x_j\|^2/\sigma^2)`, under single-key admissions and
    deletions, by the Cauwenberghs-Poggio adiabatic walk with rank-one growth/shrink of the
    bordered KKT inverse (Cauwenberghs & Poggio, NeurIPS 2000; Forgetful Attention,
    arXiv:2607.12204, §3.2; docs/design.md §1).

    Parameters
    ----------
    C : float
        Box constraint, fixed for the life of the solver (``> 0``). The keys can satisfy
        ``sum(a) = 1`` only once ``n * C >= 1``; before that the solver is in warm-up
        (:attr:`certified` is False).
    sigma : float
        RBF kernel width (``> 0``).
    audit_every : int, default 1000
        Every this many operations the maintained gradients and inverse are checked against a
        fresh evaluation and refactorised if they drifted (see :meth:`audit`). 0 disables.

    Attributes
    ----------
    ids, keys, alpha : ndarray
        Live keys in insertion (id) order, shapes (n,), (n, d), (n,).
    rho : float
        Multiplier of ``sum(a) = 1``; ``f(x) = 2 sum_i a_i k(x, x_i) - k(x, x) + rho``.
    margin_ids, error_ids, reserve_ids : ndarray of int
        The partition S (0 < a < C, f = 0), E (a = C, f <= 0), R (a = 0, f >= 0).

    Notes
    -----
    * **Certificate.** A reserve key has a coefficient of exactly 0.0: evicting it changes no
      coefficient, no rho and no readout (:meth:`evict_reserve`).
    * **Exact unlearning.** :meth:`remove` walks the victim's coefficient to 0; the result is
      the optimum of the retained keys under the same C, i.e. what a fresh solve gives.
    * **Degenerate cases** (docs/design.md §4): an empty margin set moves rho alone and reports the
      midpoint of rho's optimal interval at rest; simultaneous events are executed one at a
      time, ties broken by smallest id; a key numerically dependent on the margin set
      (Schur complement below ``KAPPA_TOL``) never enters it; warm-up uses a virtual anchor.
    * When the margin set is empty rho is not unique. :meth:`remove` reports the midpoint
      (what a fresh solve reports); :meth:`evict_reserve` keeps rho where it is, so that the
      decision function is unchanged.

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit import IncrementalSVDD
    >>> X = np.random.default_rng(0).standard_normal((40, 3))
    >>> svdd = IncrementalSVDD.from_nu(0.5, n0=40, sigma=1.5)
    >>> ids = svdd.extend(X)
    >>> svdd.certified, bool(abs(svdd.alpha.sum() - 1.0) < 1e-12)
    (True, True)
    >>> svdd.remove(ids[3])
    >>> len(svdd)
    39
    >>> bool(svdd.kkt_residual() < 1e-12)
    True
    """

    def __init__(self, C, sigma, *, audit_every=1000):
        self._C = check_positive(C, "C")
        self._sigma = check_sigma(sigma)
        if isinstance(audit_every, bool) or not isinstance(audit_every, numbers.Integral):
            raise TypeError(f"audit_every must be an int; got {type(audit_every).__name__}")
        if audit_every < 0:
            raise ValueError(f"audit_every must be >= 0; got {audit_every}")
        self.audit_every = int(audit_every)
        self.max_events = None  # None: 50 n + 1000 events per walk
        self._rebuilding = False
        self._d = None
        self._next_id = 0
        self._slot_of = {}
        self._ops_since_audit = 0
        self.n_refactorizations = 0
        self.n_polishes = 0
        self.n_bulk_builds = 0
        self.n_bulk_fallbacks = 0
        self.bulk_fallback_reason = None
        self._probe_tol = W.PROBE_TOL
        self.n_rebuilds = 0
        self._allocate(d=1, cap=16, mcap=8)
        self._d = None

    @classmethod
    def from_nu(cls, nu, n0, sigma, **kwargs):
        """Build with ``C = 1 / (nu * n0)``, computed once at the reference size ``n0``.

        Parameters
        ----------
        nu : float in (0, 1]
            Fraction of outliers at the reference size.
        n0 : int >= 1
            Reference number of keys. C is never recomputed as the number of keys changes.
        sigma : float
            RBF kernel width.
        """
        nu = check_positive(nu, "nu")
        if nu > 1.0:
            raise ValueError(f"nu must be in (0, 1]; got {nu}")
        if isinstance(n0, bool) or not isinstance(n0, numbers.Integral) or n0 < 1:
            raise ValueError(f"n0 must be an integer >= 1; got {n0!r}")
        C = 1.0 / (nu * int(n0))
        if not np.isfinite(C):
            raise ValueError(f"nu * n0 = {nu * int(n0)!r} is too small: C = 1 / (nu n0) "
                             "is not a finite float")
        return cls(C, sigma, **kwargs)

    # ------------------------------------------------------------------ state and allocation
    def _allocate(self, d, cap, mcap):
        self._Xt = np.zeros((d, cap))
        self._ids = np.full(cap, -2, dtype=np.int64)
        self._alpha = np.zeros(cap)
        self._grad = np.zeros(cap)
        self._status = np.zeros(cap, dtype=np.int8)
        self._spos = np.full(cap, -1, dtype=np.int64)
        self._blocked = np.full(cap, -1, dtype=np.int64)
        self._kc = np.zeros(cap)
        self._gam = np.zeros(cap)
        self._S = np.zeros(mcap, dtype=np.int64)
        self._KSt = np.zeros((mcap, cap))
        self._R = np.zeros((mcap + 1, mcap + 1))
        self._beta = np.zeros(mcap + 1)
        self._bk = np.zeros(mcap + 1)
        self._vbuf = np.zeros(mcap + 1)
        self._fs = np.array([0.0, self._C, 1.0 / self._sigma**2, np.inf])
        self._order_cache = None
        self._ist = np.zeros(W.IST_SIZE, dtype=np.int64)
        self._ist[[W._ANCHOR, W._LAST_LEFT, W._LAST_JOINED, W._CUR_C, W._SETTLED]] = -1

    def _ensure_slots(self, needed):
        cap = self._Xt.shape[1]
        if needed <= cap:
            return
        new = max(needed, 2 * cap)
        n = self._n

        def grow(a, fill):
            out = np.full((new,) + a.shape[1:], fill, dtype=a.dtype)
            out[:n] = a[:n]
            return out

        Xt = np.zeros((self._Xt.shape[0], new))
        Xt[:, :n] = self._Xt[:, :n]
        self._Xt = Xt
        self._ids = grow(self._ids, -2)
        self._alpha = grow(self._alpha, 0.0)
        self._grad = grow(self._grad, 0.0)
        self._status = grow(self._status, 0)
        self._spos = grow(self._spos, -1)
        self._blocked = grow(self._blocked, -1)
        self._kc = np.zeros(new)
        self._gam = np.zeros(new)
        KSt = np.zeros((self._KSt.shape[0], new))
        KSt[:, :n] = self._KSt[:, :n]
        self._KSt = KSt

    def _grow_margin(self):
        mcap = self._S.shape[0]
        new = 2 * mcap
        m = self._m
        S = np.zeros(new, dtype=np.int64)
        S[:m] = self._S[:m]
        KSt = np.zeros((new, self._KSt.shape[1]))
        KSt[:m] = self._KSt[:m]
        R = np.zeros((new + 1, new + 1))
        R[: m + 1, : m + 1] = self._R[: m + 1, : m + 1]
        self._S, self._KSt, self._R = S, KSt, R
        self._beta = np.zeros(new + 1)
        self._bk = np.zeros(new + 1)
        self._vbuf = np.zeros(new + 1)

    @property
    def _n(self):
        return int(self._ist[W._N])

    @property
    def _m(self):
        return int(self._ist[W._M])

    @property
    def _anchor(self):
        return int(self._ist[W._ANCHOR])

    # ------------------------------------------------------------------ the walk
    def _event_limit(self):
        if self.max_events is None or self._rebuilding:
            return 50 * self._n + 1000
        return self.max_events

    def _arrays(self):
        return (
            self._Xt, self._ids, self._alpha, self._grad, self._status, self._spos, self._S,
            self._KSt, self._R, self._kc, self._gam, self._beta, self._bk, self._vbuf,
            self._blocked, self._fs, self._ist,
        )

    def _check(self, code):
        """True when the kernel asked for more margin capacity (granted); raise on failure."""
        if code == W.DONE:
            return False
        if code == W.NEED_MARGIN_CAPACITY:
            self._grow_margin()
            return True
        self._ist[W._CUR_C] = -1
        reason = {
            W.TOO_MANY_EVENTS: f"more than {self._event_limit()} events in one walk",
            W.NO_EVENT: "no admissible event (numerically infeasible step)",
            W.INCONSISTENT: "the state at rest violates sum(a) = 1 or the box "
                            "(numerically degenerate keys)",
        }[code]
        raise SolverFailure(reason)

    def _walk(self, c, mode, kc_ready=False):
        """Run one exact walk of slot c, then relax any sign violators (see _rest.repair)."""
        code = W.walk(*self._arrays(), c, mode, kc_ready, self._event_limit())
        while self._check(code):
            code = W.walk(*self._arrays(), c, mode, False, self._event_limit())

    def _insert(self, x, new_id, is_anchor=False):
        self._ensure_slots(self._n + 1)
        slot = W.insert_slot(
            x, new_id, self._Xt, self._ids, self._alpha, self._grad, self._status, self._spos,
            self._S, self._KSt, self._blocked, self._kc, self._fs, self._ist, is_anchor,
        )
        if self._order_cache is not None and not is_anchor:
            if len(self._sorted_ids) and new_id < self._sorted_ids[-1]:
                self._order_cache = None  # a rebuild re-admitting old ids out of order
            else:
                self._order_cache = np.append(self._order_cache, slot)
                self._sorted_ids = np.append(self._sorted_ids, new_id)
        return slot

    def _delete(self, slot):
        deleted_id = int(self._ids[slot])
        moved = W.delete_slot(
            slot, self._Xt, self._ids, self._alpha, self._grad, self._status, self._spos,
            self._S, self._KSt, self._blocked, self._ist,
        )
        self._after_delete(slot, deleted_id, moved)

    def _after_delete(self, slot, deleted_id, moved):
        """The Python side of ``_walk.delete_slot``: id -> slot map and the id-order cache."""
        moved_id = int(self._ids[slot]) if moved >= 0 else -1
        if moved_id >= 0:
            self._slot_of[moved_id] = slot
        if self._order_cache is not None:
            if deleted_id >= 0:  # close the gap in place (no new arrays per deletion)
                pos = int(self._sorted_ids.searchsorted(deleted_id))
                order, sorted_ids = self._order_cache, self._sorted_ids
                order[pos:-1] = order[pos + 1:]
                sorted_ids[pos:-1] = sorted_ids[pos + 1:]
                self._order_cache, self._sorted_ids = order[:-1], sorted_ids[:-1]
            if moved_id >= 0:
                self._order_cache[int(self._sorted_ids.searchsorted(moved_id))] = slot

    def _start(self):
        """Empty -> {anchor} holding all the mass: a_anchor = 1, S = {anchor}, rho = -1."""
        slot = self._insert(np.zeros(self._d), -1, is_anchor=True)
        self._alpha[slot] = 1.0
        self._grad[slot] = 0.0
        self._status[slot] = W.MARGIN
        self._spos[slot] = 0
        self._S[0] = slot
        self._KSt[0, slot] = 0.0  # K'(anchor, anchor) = k - 1 = 0
        self._R[:2, :2] = [[0.0, 1.0], [1.0, 0.0]]
        self._ist[W._M] = 1
        self._fs[W._RHO] = 0.0  # g_anchor = 2 K'_aa a_a + rho' = rho' = 0, i.e. rho = -1

    def _feasible(self, n_real):
        return n_real * self._C >= 1.0 - W.FEASIBILITY_TOL

    def _on_vertex(self, n_real):
        """True when n_real keys have a single feasible point: n C = 1 to FEASIBILITY_TOL
        (from either side), where a = C for every key is the only way to sum to one."""
        return abs(n_real * self._C - 1.0) <= W.FEASIBILITY_TOL

    def _admit_anchor(self):
        slot = self._insert(np.zeros(self._d), -1, is_anchor=True)
        self._walk(slot, W.ADMIT, kc_ready=True)

    def _drop_anchor(self):
        """Warm-up ends: the anchor's mass goes back to the keys by an exact decrement.

        When n C = 1 (to FEASIBILITY_TOL) the only feasible point is a = C for every key, with
        S empty: it is set directly instead of walked to, since the walk would have to end on
        a rounding residue of the anchor's mass.
        """
        slot = self._anchor
        if not self._on_vertex(len(self)):
            self._walk(slot, W.REMOVE)
            self._delete(slot)
            return
        self._land_on_vertex(slot)

    def _land_on_vertex(self, slot):
        """Delete ``slot`` (the anchor, or a key whose deletion leaves n C = 1) and put every
        other key at a = C with S empty: the only feasible point of what remains.

        The gradients are evaluated from the keys and the caller's :meth:`_settle` puts rho
        in its optimal interval (its upper end, since no key has a = 0). A fresh solve of the
        same keys ends warm-up here too (:meth:`_drop_anchor`), so a deletion that lands on
        the vertex and a fresh solve take the same steps from the same coefficients.
        """
        n = self._n
        self._ist[W._M] = 0
        self._spos[:n] = -1
        self._status[:n] = W.ERROR
        self._alpha[:n] = self._C
        self._alpha[slot] = 0.0
        self._status[slot] = W.MOVING
        self._delete(slot)
        n = self._n
        self._grad[:n] = self._fresh_gradients()
        self._ist[W._SETTLED] = -1

    def _settle(self, polish_allowed=True):
        """Bring the state to rest in canonical form (see ``_rest.settle``); a caller that has
        just factorised the inverse and evaluated every gradient passes polish_allowed=False
        (a polish would recompute the same)."""
        limit, repairs = self._event_limit(), 10 * self._n + 10
        while True:
            code = settle(*self._arrays(), limit, repairs, polish_allowed, self._probe_tol)
            if code == W.NEED_POLISH:
                self._polish()
                polish_allowed = False
            elif not self._check(code):
                return

    def _reset(self):
        d = self._d
        self._allocate(d=d, cap=self._Xt.shape[1], mcap=self._S.shape[0])
        self._slot_of = {}
        self._probe_tol = W.PROBE_TOL

    # ------------------------------------------------------------------ public operations
    def add(self, x):
        """Admit one key by exact increment.

        Parameters
        ----------
        x : array_like of shape (d,)

        Returns
        -------
        int
            A stable id (insertion counter) for the key.

        Raises
        ------
        ValueError
            Wrong shape or dimension, NaN or inf. The state is unchanged.
        TypeError
            Non-numeric input. The state is unchanged.
        SolverFailure
            The exact walk could not finish; the solver was rebuilt from the keys it held
            before (a fresh exact solve of them) and the key was not admitted.
        """
        x = as_key(x, "x", d=self._d)
        return int(self._admit_rows(x[None, :])[0])

    def _admit_rows(self, X):
        """Admit validated rows in order; on a failed walk rebuild from the keys held before
        the first row (so a batch is all or nothing) and raise SolverFailure."""
        first_id, fresh = self._next_id, self._d is None
        if fresh:
            self._d = X.shape[1]
            self._allocate(d=self._d, cap=self._Xt.shape[1], mcap=self._S.shape[0])
        ids = np.arange(first_id, first_id + len(X), dtype=np.int64)
        if self._n == 0 and self._bulk_admit(X, ids):
            return ids
        try:
            for new_id, x in zip(ids, X, strict=True):
                self._add_checked(x, int(new_id))
                self._after_operation()
        except SolverFailure as exc:
            self._recover(exc, first_new_id=first_id, forget_dimension=fresh)
        return ids

    def _bulk_admit(self, X, ids):
        """Build from empty by SMO + exact landing; False (state empty again) if not taken.

        Up to BULK_MAX_KEYS keys the SMO runs on the shifted Gram matrix (:meth:`_land_bulk`);
        above, it is Gram-free, with a kernel-column cache (:meth:`_land_bulk_cached`). The
        landing: the SMO partition (coefficients within BULK_PARTITION_SNAP C of a bound are
        put at it), the bordered inverse grown over the margin keys from the most interior one
        on (a key dependent on the margin set - Schur complement below KAPPA_TOL - is put at
        its nearer bound, as the walk would keep it), the gradients, and then the walk's own
        rest state (``_rest.settle``: polish if needed, relaxation of sign violators,
        correction walk), which ends on the exact optimum. Accepted only if the KKT residual
        from a fresh evaluation of the keys is at most BULK_KKT_TOL; a landing above it is
        first polished (:meth:`_polish_landing`, up to BULK_POLISH_ROUNDS times). One still not
        accepted is counted in ``n_bulk_fallbacks`` and ``bulk_fallback_reason`` names why
        (the batch is then replayed key by key, which can take far longer).
        """
        n = len(X)
        if n < BULK_MIN_KEYS or not self._feasible(n) or self.max_events is not None:
            return False
        try:
            if n <= BULK_MAX_KEYS:
                converged = self._land_bulk(X, ids)
                kkt = self.kkt_residual()
            else:
                converged, kkt = True, self._land_bulk_cached(X, ids)
            for _ in range(BULK_POLISH_ROUNDS if kkt > BULK_KKT_TOL else 0):
                kkt = self._polish_landing()
                if kkt <= BULK_KKT_TOL:
                    break
            reason = None if kkt <= BULK_KKT_TOL else (
                f"the landing's KKT residual {kkt:.2g} is above BULK_KKT_TOL")
            if reason is not None and not converged:
                reason += " (the SMO stopped at its iteration limit)"
        except (SolverFailure, np.linalg.LinAlgError) as exc:  # e.g. a singular polish
            reason = f"the landing failed: {exc}"
        if reason is None:
            self._next_id = int(ids[-1]) + 1
            self.n_bulk_builds += 1
            return True
        self.n_bulk_fallbacks += 1
        self.bulk_fallback_reason = reason
        self._reset()
        return False

    def _polish_landing(self):
        """Warm start from a landing whose certificate failed: keep its partition, refresh
        the inverse and every gradient from the keys (:meth:`_polish`) and let the walk's rest
        state repair only what the fresh evaluation shows (equality residuals, sign
        violators; the usual per-walk event limit). Returns the fresh KKT residual."""
        self._polish()
        self._settle(polish_allowed=False)
        return self.kkt_residual()

    def _place_keys(self, X, ids):
        n = len(X)
        self._ensure_slots(n + 1)
        self._Xt[:, :n] = X.T
        self._ids[:n] = ids
        self._ist[W._N] = n

    def _land_bulk(self, X, ids):
        """The bulk landing with the n x n shifted Gram matrix (O(n^2) memory); True when the
        SMO met its tolerance (the landing proceeds from its last iterate either way)."""
        n, C = len(X), self._C
        self._place_keys(X, ids)
        Kp = B.shifted_gram(self._Xt, n, self._fs[W._INV_SIGMA2])
        a = B.feasible_start(n, C)
        grad = 2.0 * (Kp @ a)
        converged = B.smo(Kp, C, B.SMO_TOL, 200 * n + 10_000, a, grad) >= 0
        order = self._snap_partition(a)
        factorised = self._margin_from_rows(Kp[order], order, a)
        self._rest_from_field(a, 2.0 * (Kp @ a), ids, factorised)
        return converged

    def _land_bulk_cached(self, X, ids):
        """The Gram-free bulk landing; returns the KKT residual of its certificate.

        SMO (``_bulk.smo_cached``) from a start guessed on a subsample, its kernel columns in
        an LRU cache of BULK_CACHE_BYTES. The gradients at the start, g0 = 2 K' a0, are
        evaluated from the keys; the SMO maintains them; after the landing the certificate is
        again an evaluation from the keys, g0 + 2 K' (a - a0) over the keys whose
        coefficient moved (the same sums a full evaluation computes, grouped by linearity).
        Memory O(n (d + cache columns + m)) with m the margin set.
        """
        n, C = len(X), self._C
        self._place_keys(X, ids)
        inv_s2 = self._fs[W._INV_SIGMA2]
        a = B.guess_start(self._Xt, n, inv_s2, C, min(BULK_GUESS_KEYS, n // 8))
        a0 = a.copy()
        g0 = self._kernel_sums(a0)
        grad = g0.copy()
        cache = B.column_cache(n, BULK_CACHE_BYTES // (8 * n))
        if B.smo_cached(self._Xt, n, inv_s2, C, B.SMO_TOL, BULK_SMO_ITERATIONS * n + 10_000,
                        a, grad, *cache) < 0:
            raise SolverFailure("the bulk SMO did not converge")
        del cache
        a_smo = a.copy()
        order = self._snap_partition(a)
        rows = np.empty((len(order), n))
        for p, k in enumerate(order):
            W.kernel_column(self._Xt, n, k, -1, inv_s2, rows[p])
        factorised = self._margin_from_rows(rows, order, a)
        del rows
        grad += self._kernel_sums(a - a_smo)  # the snaps and the keys kept at a bound
        self._rest_from_field(a, grad, ids, factorised)
        fresh = g0 + self._kernel_sums(self._alpha[:n] - a0) + self._fs[W._RHO]
        return self._kkt_from(fresh)

    def _kernel_sums(self, coef):
        """2 K' coef over the first n slots, from the keys, summing only coef's nonzeros."""
        idx = np.flatnonzero(coef)
        return 2.0 * B.kernel_sums(self._Xt, self._n, self._fs[W._INV_SIGMA2], idx, coef[idx])

    def _snap_partition(self, a):
        """Read the partition off SMO coefficients (in place); the margin keys, most interior
        first."""
        n, C = len(a), self._C
        snap = BULK_PARTITION_SNAP * C
        at_c, at_0 = a >= C - snap, a <= snap
        a[at_c], a[at_0] = C, 0.0
        self._status[:n] = np.where(at_c, W.ERROR, W.RESERVE)
        inner = np.flatnonzero(~at_c & ~at_0)
        while self._S.shape[0] <= len(inner) + 1:
            self._grow_margin()
        return inner[np.argsort(-np.minimum(a[inner], C - a[inner]), kind="stable")]

    def _margin_from_rows(self, rows, order, a):
        """Margin set from ``order`` (rows[p] = K'[order[p], :n]); True when factorised."""
        m = self._factor_margin(rows, order) if len(order) > 1 else 0
        factorised = m > 0
        if not factorised:
            m = self._grow_margin_from(rows, order, a)
        self._ist[W._M] = m
        return factorised

    def _rest_from_field(self, a, field, ids, factorised):
        """Coefficients a, gradients field + rho' (field = 2 K' a), then the walk's rest."""
        n = len(a)
        self._alpha[:n] = a
        m = self._m
        margin = self._S[:m]
        self._fs[W._RHO] = -float(field[margin].mean()) if m else -float(field.max())
        self._grad[:n] = field + self._fs[W._RHO]
        if not np.isfinite(self._fs[W._MIN_PIVOT]) or self._fs[W._MIN_PIVOT] >= W.POLISH_PIVOT:
            self._fs[W._MIN_PIVOT] = np.inf
        self._ist[W._SETTLED] = -1
        self._slot_of = {int(i): slot for slot, i in enumerate(ids)}
        self._order_cache = None
        self._settle(polish_allowed=not factorised)

    def _grow_margin_from(self, rows, order, a):
        """Grow S over ``order`` key by key (rank-one updates); dependent keys go to a bound."""
        n, C, m = rows.shape[1], self._C, 0
        for p, k in enumerate(order):
            if m == 0:
                W._grow(self._R, 0, self._bk, 0.0)
            else:
                kappa = W._schur(m, self._S, self._KSt, self._R, k, self._bk, self._vbuf)
                if kappa < W.KAPPA_TOL:  # dependent on S: the walk keeps it at a bound
                    a[k] = C if a[k] > 0.5 * C else 0.0
                    self._status[k] = W.ERROR if a[k] == C else W.RESERVE
                    continue
                W._grow(self._R, m, self._bk, kappa)
                self._fs[W._MIN_PIVOT] = min(self._fs[W._MIN_PIVOT], kappa)
            self._KSt[m, :n] = rows[p]
            self._S[m] = k
            self._spos[k] = m
            self._status[k] = W.MARGIN
            m += 1
        return m

    def _factor_margin(self, rows, order):
        """Margin set = ``order`` by one factorisation, when no key in it is dependent.

        ``rows[p]`` is K'[order[p], :n]. Returns len(order), or 0 (nothing written) when some
        key's Schur complement against the others, 1 / |R_kk|, is below KAPPA_TOL - the
        caller then grows S key by key. That complement is the smallest any order of growth
        would see for k, so passing it means the walk would have admitted every key.
        """
        m = len(order)
        M = B.bordered_margin_matrix(rows, np.ascontiguousarray(order, dtype=np.int64))
        try:
            R = np.linalg.inv(M)
        except np.linalg.LinAlgError:
            return 0
        if not np.isfinite(R).all() or np.min(1.0 / np.abs(np.diag(R)[1:])) < W.KAPPA_TOL:
            return 0
        self._R[: m + 1, : m + 1] = R
        self._KSt[:m, : rows.shape[1]] = rows
        self._S[:m] = order
        self._ist[W._M] = m
        self._calibrate_probe()
        self._spos[order] = np.arange(m)
        self._status[order] = W.MARGIN
        return m  # a factorised inverse is what a polish would compute: no small-pivot flag

    def _add_checked(self, x, new_id):
        if self._n == 0:
            self._start()
        slot = self._insert(x, new_id)
        self._next_id = new_id + 1
        self._slot_of[new_id] = slot
        self._walk(slot, W.ADMIT, kc_ready=True)
        if self._anchor >= 0 and self._feasible(len(self)):
            self._settle()
            self._drop_anchor()
        self._settle()

    def extend(self, X):
        """Admit the rows of ``X`` one at a time, all or nothing.

        The batch is validated as a whole first; if an exact walk fails part-way, the
        solver is rebuilt from the keys it held before the batch and no row is admitted.
        Into an empty solver, a batch of at least BULK_MIN_KEYS keys with n C >= 1 is solved
        by the bulk path instead (SMO and an exact landing, Gram-free above BULK_MAX_KEYS
        keys; docs/exact_solver.md), accepted only with a fresh KKT residual of at most
        BULK_KKT_TOL, else replayed by the walk.

        Parameters
        ----------
        X : array_like of shape (k, d)

        Returns
        -------
        ndarray of shape (k,), int64
            The ids of the admitted keys, in row order.

        Raises
        ------
        ValueError, TypeError
            Bad input (any row). The state is unchanged.
        SolverFailure
            A walk failed; the state is that of a fresh solve of the keys held before.
        """
        X = as_keys(X, "X", d=self._d)
        return self._admit_rows(X)

    def remove(self, id):
        """Delete one key by exact decrement (exact unlearning).

        Afterwards the state is the optimum of the retained keys under the same C - what a
        fresh solve of them gives. Deletion is never refused: if the retained keys can no
        longer satisfy ``sum(a) = 1`` the solver returns to warm-up.

        Raises
        ------
        KeyError
            Unknown id, or an id that was already removed. The state is unchanged.
        """
        slot = self._lookup(id)
        if len(self) == 1:
            self._reset()
            self._after_operation()
            return
        try:
            if self._anchor < 0 and self._alpha[slot] > 0.0 and self._on_vertex(len(self) - 1):
                # the retained keys have one feasible point: land on it (a walk would have to
                # end on the rounding residue of the victim's mass; see _land_on_vertex)
                del self._slot_of[int(id)]
                self._land_on_vertex(slot)
                self._settle()
            else:
                if (
                    self._anchor < 0
                    and self._alpha[slot] > 0.0
                    and not self._feasible(len(self) - 1)
                ):
                    self._admit_anchor()
                self._remove_slot(slot, int(id))
        except SolverFailure as exc:
            self._recover(exc)
        self._after_operation()

    def _remove_slot(self, slot, key_id):
        """Walk slot to 0, delete it and settle: one kernel call (``_rest.remove_and_settle``)
        unless the walk needs more margin capacity or the settle a polish."""
        moved, code = remove_and_settle(*self._arrays(), slot, self._event_limit(),
                                          10 * self._n, self._probe_tol)
        if moved == -2:  # the walk stopped: resume it the usual way
            self._check(code)
            self._walk(slot, W.REMOVE)
            del self._slot_of[key_id]
            self._delete(slot)
            self._settle()
            return
        del self._slot_of[key_id]
        self._after_delete(slot, key_id, moved)
        if code == W.NEED_POLISH:
            self._polish()
            self._settle(polish_allowed=False)
        elif code != W.DONE and self._check(code):
            self._settle()

    def evict_reserve(self):
        """Remove every reserve key (coefficient exactly 0): the certified eviction.

        No coefficient and no rho changes, so the decision function and every readout are
        unchanged (up to the order of floating-point summation). The certificate covers the
        current problem: a later admission can make an evicted key matter again.

        Returns
        -------
        ndarray of int64
            The removed ids, ascending.
        """
        n = self._n
        mask = (self._status[:n] == W.RESERVE) & (self._ids[:n] >= 0)
        evicted = np.sort(self._ids[:n][mask])
        for key_id in evicted:
            slot = self._slot_of.pop(int(key_id))
            self._delete(slot)
        return evicted

    def _lookup(self, id):
        if isinstance(id, bool) or not isinstance(id, (numbers.Integral, np.integer)):
            raise KeyError(f"ids are integers; got {id!r}")
        key = int(id)
        slot = self._slot_of.get(key)
        if slot is None:
            if 0 <= key < self._next_id:
                raise KeyError(f"id {key} is not held by the solver: it was removed")
            raise KeyError(f"unknown id {key}")
        return slot

    # ------------------------------------------------------------------ failure handling
    def _recover(self, exc, first_new_id=None, forget_dimension=False):
        """After a failed walk: rebuild from the keys held before the operation, then raise.

        The keys (and their ids) are intact - a walk never touches them - so the rebuilt
        state is a fresh exact solve of exactly the keys the solver held before. Keys with
        ids from ``first_new_id`` on (the failed admissions) are left out and their ids are
        not consumed.
        """
        order = self._order()
        ids = self._ids[order]
        keep = ids < first_new_id if first_new_id is not None else np.ones(len(ids), bool)
        ids, keys = ids[keep].copy(), self._Xt[:, order].T[keep].copy()
        if first_new_id is not None:
            self._next_id = first_new_id
        self._rebuild(ids, keys)
        if forget_dimension and len(self) == 0:
            self._d = None  # the failed first key fixed no dimension
        raise SolverFailure(
            f"{exc}; the solver was rebuilt from the {len(ids)} keys it held before the "
            "operation (a fresh exact solve of them)"
        ) from exc

    def _rebuild(self, ids, keys):
        """Fresh solve of the given keys, keeping their ids (used after a failed walk).

        If a walk of the rebuild fails too, the solver keeps the exact solve of the keys
        admitted so far and a SolverFailure names the ids that were dropped; their keys are
        on the exception (``dropped_ids``, ``dropped_keys``), so nothing is lost silently.
        """
        next_id = self._next_id
        self._reset()
        self._rebuilding = True  # with the default event limit, not a user override
        done = 0
        try:
            for key_id, x in zip(ids, keys, strict=True):
                self._add_checked(x, int(key_id))
                done += 1
        except SolverFailure as exc:
            self._reset()  # the failed walk left a partial state: redo the admitted prefix
            for key_id, x in zip(ids[:done], keys[:done], strict=True):
                self._add_checked(x, int(key_id))
            failure = SolverFailure(
                f"{exc}; rebuilding after a failed walk failed too: the solver holds an exact "
                f"solve of its first {done} of {len(ids)} keys; the other {len(ids) - done} "
                f"(ids {ids[done]} on) were dropped - their ids and keys are on this "
                "exception as dropped_ids and dropped_keys")
            failure.dropped_ids, failure.dropped_keys = ids[done:].copy(), keys[done:].copy()
            raise failure from exc
        finally:
            self._rebuilding = False
            self._next_id = next_id
        self.n_rebuilds += 1

    def _after_operation(self):
        self._ops_since_audit += 1
        if self.audit_every and self._ops_since_audit >= self.audit_every:
            self.audit()

    # ------------------------------------------------------------------ read-only views
    def _order(self):
        """Slots of the keys in id (insertion) order.

        Cached with the sorted ids and kept up to date by ``_insert`` / ``_delete`` in O(n)
        memory moves (ids only grow, so an admission appends); rebuilt by a sort when unset.
        """
        if self._order_cache is None:
            n = self._n
            real = np.flatnonzero(self._ids[:n] >= 0)
            self._order_cache = real[np.argsort(self._ids[real], kind="stable")]
            self._sorted_ids = self._ids[self._order_cache]
        return self._order_cache

    def __len__(self):
        return len(self._slot_of)

    @property
    def C(self):
        """The box constraint (fixed)."""
        return self._C

    @property
    def sigma(self):
        """The RBF kernel width."""
        return self._sigma

    @property
    def n_features(self):
        """Dimension d of the keys (None before the first key)."""
        return self._d

    @property
    def ids(self):
        """ndarray of shape (n,): live ids in insertion order."""
        return self._ids[self._order()].copy()

    @property
    def keys(self):
        """ndarray of shape (n, d): live keys, aligned with :attr:`ids`."""
        order = self._order()
        if self._d is None:
            return np.zeros((0, 0))
        return np.ascontiguousarray(self._Xt[:, order].T)

    @property
    def alpha(self):
        """ndarray of shape (n,): coefficients aligned with :attr:`ids` (reserve keys: 0.0)."""
        return self._alpha[self._order()].copy()

    @property
    def rho(self):
        """The multiplier of sum(a) = 1 (the decision function's offset)."""
        return float(self._fs[W._RHO] - 1.0)  # the walk keeps rho' = rho + 1 (shifted kernel)

    def _ids_with(self, status):
        order = self._order()
        return self._ids[order][self._status[order] == status].copy()

    @property
    def margin_ids(self):
        """Ids of the margin set S (0 < a < C, f = 0)."""
        return self._ids_with(W.MARGIN)

    @property
    def error_ids(self):
        """Ids of the error set E (a = C, f <= 0)."""
        return self._ids_with(W.ERROR)

    @property
    def reserve_ids(self):
        """Ids of the reserve set R (a = 0 exactly, f >= 0)."""
        return self._ids_with(W.RESERVE)

    @property
    def certified(self):
        """True when the keys alone hold the optimum (n C >= 1; no warm-up anchor)."""
        return len(self) > 0 and self._anchor < 0

    @property
    def warmup_mass(self):
        """Mass held by the virtual anchor during warm-up (0.0 once certified)."""
        return float(self._alpha[self._anchor]) if self._anchor >= 0 else 0.0

    @property
    def n_events(self):
        """Total number of walk events executed so far."""
        return int(self._ist[W._EVENTS])

    @property
    def n_refused_joins(self):
        """Times a key was kept out of S as numerically dependent on it (near duplicates)."""
        return int(self._ist[W._REFUSED])

    def __repr__(self):
        return (
            f"IncrementalSVDD(C={self._C:.6g}, sigma={self._sigma:.6g}, n={len(self)}, "
            f"margin={len(self.margin_ids)}, error={len(self.error_ids)}, "
            f"reserve={len(self.reserve_ids)}, certified={self.certified})"
        )

    # ------------------------------------------------------------------ exact state export
    def margin_system(self):
        """The maintained bordered system of the margin set, for the exact backward.

        Returns
        -------
        MarginSystem
            ``margin_ids`` in bordered-system order (row/column p+1 of the inverse belongs to
            ``margin_ids[p]``), ``error_ids``, ``inverse`` R = M^{-1} of shape (m+1, m+1) with
            M = [[0, 1^T], [1, 2 K_SS]], ``rho`` and ``alpha_margin`` (aligned with
            ``margin_ids``). So ``[rho; a_S] = R [1 - |E| C; diag(K)_S - 2 C K_SE 1]``.

        Raises
        ------
        RuntimeError
            During warm-up (the anchor is part of the system; nothing is certified).
        """
        if not self.certified:
            raise RuntimeError("margin_system needs a certified solver (n * C >= 1)")
        m = self._m
        S = self._S[:m]
        return MarginSystem(
            margin_ids=self._ids[S].copy(),
            error_ids=self.error_ids,
            inverse=unshifted_inverse(self._R[: m + 1, : m + 1]),
            rho=self.rho,
            alpha_margin=self._alpha[S].copy(),
            C=self._C,
        )

    #: 2: the walk's arrays hold the shifted kernel (KSt = K' = K - 1, R = M'^{-1},
    #: fs[0] = rho + 1); format-1 states (unshifted) are converted on load.
    #: 3: also the settings that steer later operations (the calibrated inverse-probe
    #: tolerance, the operations since the last audit, the event limit and the margin
    #: capacity, at which a walk pauses to grow its arrays); states of formats 1 and 2 load
    #: with their defaults (PROBE_TOL, 0, None, the smallest capacity that holds them).
    _STATE_FORMAT = 3

    def state_dict(self):
        """Everything needed to restore this solver bit for bit (plain arrays and numbers):
        the state and every setting that steers later operations, so that a restored solver
        takes the same steps as this one."""
        n, m = self._n, self._m
        return {
            "format": self._STATE_FORMAT,
            "C": self._C,
            "sigma": self._sigma,
            "d": -1 if self._d is None else self._d,
            "next_id": self._next_id,
            "audit_every": self.audit_every,
            "ops_since_audit": self._ops_since_audit,
            "max_events": self.max_events,
            "probe_tol": self._probe_tol,
            "margin_capacity": int(self._S.shape[0]),
            "Xt": self._Xt[:, :n].copy(),
            "ids": self._ids[:n].copy(),
            "alpha": self._alpha[:n].copy(),
            "grad": self._grad[:n].copy(),
            "status": self._status[:n].copy(),
            "spos": self._spos[:n].copy(),
            "S": self._S[:m].copy(),
            "KSt": self._KSt[:m, :n].copy(),
            "R": self._R[: m + 1, : m + 1].copy(),
            "fs": self._fs.copy(),
            "ist": self._ist.copy(),
        }

    @classmethod
    def from_state_dict(cls, state):
        """Rebuild a solver from :meth:`state_dict` output, validated structurally.

        Every field the kernels index with or divide by is checked before use (integer
        fields and ranges, finite floats, the anchor, partition codes against the
        coefficients, the margin list, ``sum(a) = 1``, the constants derived from C and
        sigma), so a damaged state is refused rather than crashing a kernel. Whether the
        numbers are an optimum and agree with the keys is :meth:`consistency`'s check
        (``O(n |support| d)``); run it on a state from an untrusted source.

        Raises
        ------
        ValueError
            Unknown format, or fields whose types, shapes or contents contradict each other.
        """
        version = state.get("format")
        if version not in (1, 2, cls._STATE_FORMAT):
            raise ValueError(f"unknown solver state format {version!r}")
        solver = cls(state["C"], state["sigma"],
                     audit_every=state_int(state, "audit_every", 0, INT64_MAX))
        d = state_int(state, "d", -1, INT64_MAX)
        ist = state_ints(state, "ist", (W.IST_SIZE,))
        n, m = int(ist[W._N]), int(ist[W._M])
        if not 0 <= m <= n:
            raise ValueError(f"state sizes are inconsistent: n={n}, m={m} (need 0 <= m <= n)")
        mcap = max(8, m + 1)
        if version >= 3:
            ops, solver.max_events, solver._probe_tol, mcap = steering_fields(state)
            solver._ops_since_audit = ops
            # at least 8 and never below m; it grows with S but never shrinks with the keys
            if not max(m, 8) <= mcap <= 2**40:
                raise ValueError(f"state['margin_capacity'] = {mcap} is outside "
                                 f"[max(8, m) = {max(m, 8)}, 2**40]")
        if d < 0 or n == 0:
            if n:
                raise ValueError("state holds keys but no dimension")
            if d == 0:
                raise ValueError("state dimension d must be >= 1 (or -1 before any key)")
            if ist[W._ANCHOR] != -1 or ist[W._CUR_C] != -1:
                raise ValueError("an empty state cannot hold an anchor or a current slot")
            solver._next_id = state_int(state, "next_id", 0, INT64_MAX)
            if d > 0:
                solver._d = d
                solver._allocate(d=d, cap=16, mcap=mcap)
                solver._ist[:] = ist
            return solver
        check_state(state, n, m, d, solver)
        solver._d = d
        solver._allocate(d=d, cap=max(16, n + 1), mcap=mcap)
        solver._Xt[:, :n] = state["Xt"]
        solver._ids[:n] = state["ids"]
        solver._alpha[:n] = state["alpha"]
        solver._grad[:n] = state["grad"]
        solver._status[:n] = state["status"]
        solver._spos[:n] = state["spos"]
        solver._S[:m] = state["S"]
        solver._KSt[:m, :n] = state["KSt"]
        solver._R[: m + 1, : m + 1] = state["R"]
        solver._fs[:] = state["fs"]
        if version == 1:  # unshifted kernel: K' = K - 1, R' = T R, rho' = rho + 1
            solver._KSt[:m, :n] -= 1.0
            solver._R[: m + 1, : m + 1] = shifted_inverse(solver._R[: m + 1, : m + 1])
            solver._fs[W._RHO] += 1.0
        solver._ist[:] = ist
        solver._next_id = state_int(state, "next_id", 0, INT64_MAX)
        ids = solver._ids[:n]
        real = ids[ids >= 0]
        if len(np.unique(real)) != len(real) or (len(real) and real.max() >= solver._next_id):
            raise ValueError("state ids are duplicated or not below next_id")
        solver._slot_of = {int(i): slot for slot, i in enumerate(ids) if i >= 0}
        return solver

    def copy(self):
        """An independent copy with identical state and settings (everything
        :meth:`state_dict` holds); the diagnostic counters start from zero."""
        return type(self).from_state_dict(self.state_dict())

    # ------------------------------------------------------------------ evaluation
    def decision_function(self, X):
        """f(x) = 2 sum_i a_i k(x, x_i) - k(x, x) + rho for each row of X.

        f = 0 on the margin, f > 0 inside the description, f < 0 outside (scikit-learn's sign
        convention). During warm-up the anchor contributes nothing.

        Parameters
        ----------
        X : array_like of shape (m, d)

        Returns
        -------
        ndarray of shape (m,)
        """
        if len(self) == 0:
            raise ValueError("decision_function needs at least one key in the solver")
        Qt = np.ascontiguousarray(as_keys(X, "X", d=self._d).T)
        out = np.empty(Qt.shape[1])
        W.decision(Qt, self._Xt, self._alpha, self._n, self._anchor, self._fs[W._INV_SIGMA2], self._fs[W._RHO],
                   out)
        return out

    def _fresh_gradients(self):
        """g_i = 2 sum_j a_j K'_ij + rho' (= 2 sum_j a_j k(x_i, x_j) - 1 + rho) for every slot.

        Small problems use the coordinate-wise Numba loop (above ``_bulk.SUM_PARALLEL_PAIRS``
        key pairs split over threads, with the same bits). Large ones with wide keys
        (``n |support| d`` above ``BLAS_FRESH_WORK``, d >= ``BLAS_FRESH_MIN_DIM``) take the squared
        distances from one matrix product per block of rows, |x|^2 + |y|^2 - 2 x.y on keys
        centred on the support's mean (measured 2.3x faster at n = 10^4, d = 384). The
        expansion loses ~eps (|x - c|^2 + |y - c|^2) of a squared distance, so it is used only
        while every key has ||x - c||^2 / sigma^2 <= ``BLAS_FRESH_MAX_SPREAD`` (a loss below
        5e-14 in units of sigma^2); wider keys take the loop, which has no cancellation.
        """
        n, anchor = self._n, self._anchor
        support = np.flatnonzero(self._alpha[:n] != 0.0)
        support = support[support != anchor]
        out = np.empty(n)
        if (self._d or 1) < BLAS_FRESH_MIN_DIM or n * len(support) * self._d < BLAS_FRESH_WORK \
                or not self._blas_distances_accurate(support):
            if n * len(support) < B.SUM_PARALLEL_PAIRS:
                W.fresh_gradients(self._Xt, self._alpha, n, anchor, self._fs[W._INV_SIGMA2], self._fs[W._RHO],
                                  out)
                return out
            # the same sums in the same order, over disjoint ranges of keys in threads
            out = B.kernel_sums(self._Xt, n, self._fs[W._INV_SIGMA2], support, self._alpha[support])
            W.anchor_terms(self._alpha, n, anchor, out)
            return 2.0 * out + self._fs[W._RHO]
        X = self._Xt[:, :n].T
        centre = X[support].mean(axis=0)
        S = X[support] - centre
        coef = self._alpha[support]
        sq_s = np.einsum("ij,ij->i", S, S)
        for start in range(0, n, 1024):
            block = X[start:start + 1024] - centre
            d2 = np.einsum("ij,ij->i", block, block)[:, None] + sq_s[None, :] - 2.0 * block @ S.T
            np.maximum(d2, 0.0, out=d2)
            out[start:start + 1024] = np.expm1(-d2 * self._fs[W._INV_SIGMA2]) @ coef
        W.anchor_terms(self._alpha, n, anchor, out)
        return 2.0 * out + self._fs[W._RHO]

    def _blas_distances_accurate(self, support):
        """True when every key is within BLAS_FRESH_MAX_SPREAD sigma^2 of the support's mean."""
        if len(support) == 0:
            return False
        X = self._Xt[:, : self._n]
        with np.errstate(over="ignore", invalid="ignore"):
            centre = X[:, support].mean(axis=1)
            spread = np.einsum("ij,ij->j", X - centre[:, None], X - centre[:, None])
            return bool(np.all(spread * self._fs[W._INV_SIGMA2] <= BLAS_FRESH_MAX_SPREAD))

    def kkt_residual(self):
        """Largest violation of the KKT conditions, recomputed from the keys.

        The terms: ``|sum(a) - 1|``, box violations, ``|f|`` on the margin set, ``max(f, 0)``
        on the error set and ``max(-f, 0)`` on the reserve set. The sum and box terms are
        multiplied by 2 (the most a unit of coefficient can move f), so every term is in units
        of f. During warm-up it is the residual of the anchored problem. A NaN anywhere gives
        ``inf``.

        Returns
        -------
        float
        """
        if self._n == 0:
            return 0.0
        return self._kkt_from(self._fresh_gradients())

    def _kkt_from(self, g):
        """The KKT residual of the current coefficients, given their fresh gradients g (n,)."""
        n = self._n
        a = self._alpha[:n]
        st = self._status[:n]
        ub = np.full(n, self._C)
        if self._anchor >= 0:
            ub[self._anchor] = np.inf
        terms = [
            2.0 * abs(a.sum() - 1.0),
            2.0 * float(np.max(np.maximum(-a, 0.0))),
            2.0 * float(np.max(np.maximum(a - ub, 0.0))),
        ]
        for status, violation in (
            (W.MARGIN, np.abs(g)),
            (W.ERROR, np.maximum(g, 0.0)),
            (W.RESERVE, np.maximum(-g, 0.0)),
        ):
            terms.append(float(np.max(violation[st == status], initial=0.0)))
        pinned, offset = self._rho_offset(g)
        if pinned:  # a margin set of residues only fixes nothing: rho must be a fresh solve's
            terms.append(offset)
        return largest_violation(terms)

    def _rho_offset(self, g):
        """``(pinned, |rho - the rho a fresh solve reports|)`` for gradients g (n,).

        The margin coefficients are read as a fresh solve's rest state reads them (within a
        rounding residue of a bound they are at it: ``_rest.at_upper_bound`` /
        ``at_lower_bound``). While one is free, rho is fixed by f = 0 on it and the offset is
        0. Otherwise rho is optimal anywhere in [max_R (rho - g_i), min_E (rho - g_i)] (the
        residues in the set of their bound) and a fresh solve reports its midpoint, or its
        finite end (``_rest.recenter_rho``). ``pinned``: the state holds margin keys, all of
        them residues - rho then sits where the residue fixed it, not where it belongs.
        During warm-up there is nothing to compare: ``(False, 0.0)``.
        """
        n = self._n
        if n == 0 or self._anchor >= 0:
            return False, 0.0
        a, st, C = self._alpha[:n], self._status[:n], self._C
        sum_tol = sum_rounding(self._alpha, n)
        margin = st == W.MARGIN
        upper = margin & ((a >= C * (1.0 - BOUND_SNAP)) | (C - a <= sum_tol))
        lower = margin & ~upper & ((a <= C * BOUND_SNAP) | (a <= sum_tol))
        if (margin & ~upper & ~lower).any():
            return False, 0.0
        h = self._fs[W._RHO] - g
        lo = float(np.max(h[(st == W.RESERVE) | lower], initial=-np.inf))
        hi = float(np.min(h[(st == W.ERROR) | upper], initial=np.inf))
        if lo == -np.inf and hi == np.inf:
            return bool(margin.any()), 0.0
        choice = hi if lo == -np.inf else lo if hi == np.inf else 0.5 * (lo + hi)
        return bool(margin.any()), largest_violation([abs(self._fs[W._RHO] - choice)])

    def consistency(self, *, margin_rows=True):
        """Compare the maintained state with a fresh evaluation from the keys; change nothing.

        What :meth:`audit` measures before it decides to repair, and what a loader checks
        before it trusts a stored state: the coefficients' optimality and every maintained
        quantity the next exact walk will build on. Cost ``O(n |support| d + m n d + m^3)``.

        Parameters
        ----------
        margin_rows : bool, default True
            Also recompute the margin set's kernel rows (the O(m n d) term; they are written
            once when a key joins S and never updated, so only a stored state can disagree).

        Returns
        -------
        Consistency
            ``kkt_residual``, ``grad_drift``, ``inverse_residual`` and ``margin_rows_drift``
            (a frozen dataclass).
        """
        n, m = self._n, self._m
        if n == 0:
            return Consistency(0.0, 0.0, 0.0, 0.0, 0.0)
        fresh = self._fresh_gradients()
        drift = largest_violation(np.abs(self._grad[:n] - fresh))
        inv_res = rows_drift = 0.0
        if m > 0:
            inv_res = largest_violation(
                np.abs(self._R[: m + 1, : m + 1] @ self._bordered() - np.eye(m + 1)).ravel())
            column = np.empty(n)
            for p, slot in enumerate(self._S[:m] if margin_rows else ()):
                W.kernel_column(self._Xt, n, slot, self._anchor, self._fs[W._INV_SIGMA2], column)
                rows_drift = max(rows_drift,
                                 largest_violation(np.abs(self._KSt[p, :n] - column)))
        return Consistency(kkt_residual=self._kkt_from(fresh), grad_drift=drift,
                           inverse_residual=inv_res, margin_rows_drift=rows_drift,
                           rho_offset=self._rho_offset(fresh)[1])

    def _bordered(self):
        m = self._m
        S = self._S[:m]
        M = np.zeros((m + 1, m + 1))
        M[0, 1:] = 1.0
        M[1:, 0] = 1.0
        M[1:, 1:] = 2.0 * self._KSt[:m][:, S]
        return M

    def audit(self):
        """Check the maintained state against a fresh evaluation; refactorise on drift.

        Also repaired: a rho away from the one a fresh solve reports while no margin key is
        free (``rho_offset`` above AUDIT_GRAD_TOL: every f is off by it; after
        :meth:`evict_reserve` with an empty margin set this re-centres rho, as the next
        operation would).

        Returns
        -------
        Audit
            ``grad_drift``, ``inverse_residual``, ``kkt_residual`` (after any repair),
            ``refactorized`` and ``rho_offset`` (a frozen dataclass).
        """
        self._ops_since_audit = 0
        if self._n == 0:
            return Audit(0.0, 0.0, 0.0, False, 0.0)
        found = self.consistency(margin_rows=False)
        drift, inv_res = found.grad_drift, found.inverse_residual
        repaired = (drift > AUDIT_GRAD_TOL or inv_res > AUDIT_INVERSE_TOL
                    or not found.rho_offset <= AUDIT_GRAD_TOL)
        if repaired:
            self._refactorize()
        return Audit(grad_drift=drift, inverse_residual=inv_res,
                     kkt_residual=self.kkt_residual() if repaired else found.kkt_residual,
                     refactorized=repaired, rho_offset=found.rho_offset)

    def _polish(self):
        """Refresh the state of the current partition from scratch.

        A fresh inverse of the bordered matrix and every gradient from the keys (the margin
        gradients then hold the true equality residuals, which ``_rest.correct`` removes by a
        walk that respects the bounds). Used when a step ran on small pivots, whose rounding
        (~eps / pivot) the maintained state inherited. Cost O(m^3 + n |support| d).
        """
        self._fs[W._MIN_PIVOT] = np.inf
        self._ist[W._SETTLED] = -1  # the refreshed state must be settled in full
        m, n = self._m, self._n
        self.n_polishes += 1
        if m > 0:
            self._R[: m + 1, : m + 1] = np.linalg.inv(self._bordered())
            self._calibrate_probe()
        self._grad[:n] = self._fresh_gradients()

    def _calibrate_probe(self):
        """Set the inverse probe's threshold from a freshly factorised inverse: 4x its own probe
        (the factorisation's rounding floor), within [PROBE_TOL, PROBE_TOL_MAX]. Without it a
        large margin set whose fresh inverse already probes above PROBE_TOL (1.1e-11 at
        m = 2048) would polish after every operation without improving anything."""
        m = self._m
        floor = W.inverse_probe_residual(self._R, m, self._S, self._KSt, self._vbuf, self._bk)
        self._probe_tol = min(W.PROBE_TOL_MAX, max(W.PROBE_TOL, 4.0 * floor))

    def _refactorize(self):
        """After a failed audit: polish, then restore the canonical resting state."""
        self._polish()
        self._settle()
        self.n_refactorizations += 1
