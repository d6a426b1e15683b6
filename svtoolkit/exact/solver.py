"""IncrementalSVDD: the exact maintained fp64 solver of the SVDD dual (the public API).

The class validates input and holds the ids, the operations, the bulk build, the views,
persistence and the audit. Its maintained state and the crossings into the Numba kernels of
:mod:`svtoolkit.exact._walk` and :mod:`svtoolkit.exact._rest` (one per add/remove) are its base,
:class:`svtoolkit.exact._driver.WalkDriver`; the bulk landing's array work is
:mod:`svtoolkit.exact._landing`, the fresh evaluations behind the audit
:mod:`svtoolkit.exact._consistency`, and stored states :mod:`svtoolkit.exact._state`.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass

import numpy as np

from .._validation import (as_key, as_keys, check_int, check_positive, check_sigma,
                           largest_violation)
from . import _active_set as AS
from . import _bulk as B
from . import _consistency as CS
from . import _landing as L
from . import _walk as W
from ._consistency import Audit, AuditSlice, Consistency
from ._driver import BulkFallbackWarning, SolverFailure, WalkDriver
from ._factor import bordered_inverse
from ._state import export_state, restore_state, unshifted_inverse

__all__ = ["IncrementalSVDD", "MarginSystem"]

#: ``extend`` of at least BULK_MIN_KEYS keys into an empty solver takes the bulk path (SMO, then
#: an exact landing; ``svtoolkit.exact._bulk``): on the shifted Gram matrix up to BULK_MAX_KEYS
#: keys (128 MiB at 4096), Gram-free above. Other batches replay the walk.
BULK_MIN_KEYS = 64
BULK_MAX_KEYS = 4096
# (the landing's own sizes, BULK_CACHE_BYTES, BULK_GUESS_KEYS, BULK_SMO_ITERATIONS and
# BULK_PARTITION_SNAP, are in svtoolkit.exact._landing)
#: The bulk landing is accepted when its KKT residual (fresh) is at most this; otherwise the
#: batch is replayed by the walk, so the bulk path never returns a worse state.
BULK_KKT_TOL = 1e-12
#: A landing above BULK_KKT_TOL is first polished (a fresh inverse and gradients, then the
#: walk's rest state from its partition) up to this many times before the batch is replayed.
#: Measured: landings rejected at 9e-11 (150 collinear keys) and 3.7e-12 (2,048 heavy-tailed
#: keys) came from maintained gradients that had drifted from a fresh evaluation.
BULK_POLISH_ROUNDS = 2
#: A landing of up to ACTIVE_SET_MAX_KEYS keys whose rest state is not accepted - or takes
#: more than BULK_LANDING_EVENTS_PER_KEY events per key plus BULK_LANDING_MIN_EVENTS in all
#: (dense keys in one or two dimensions at a small sigma: there the walk's inverse falls apart
#: and its walks need not end; ``WalkDriver._settle`` bounds them) - is solved by the primal
#: active-set method of ``svtoolkit.exact._active_set`` from the SMO iterate, in at most
#: ACTIVE_SET_ITERATIONS_PER_KEY iterations per key plus BULK_LANDING_MIN_EVENTS. Measured
#: (2-core Intel Xeon): a well-posed landing's rest state takes 10 events at n = 2,000; 500
#: collinear keys take 310 active-set iterations (the build 1.1 s), 3,000 2-D Gaussian keys
#: 334 (O(m^3) each, up to 1,609 free keys; the build 163 s, the landing's budget included).
BULK_LANDING_EVENTS_PER_KEY = 0.5
BULK_LANDING_MIN_EVENTS = 1000
ACTIVE_SET_ITERATIONS_PER_KEY = 4
#: Above BULK_MAX_KEYS (the Gram-free landing) the same budget and last resort apply up to this
#: many keys: the active set then forms the shifted Gram matrix once (512 MiB at 8192). Above
#: it a landing that is not accepted is replayed key by key.
ACTIVE_SET_MAX_KEYS = 8192
#: An admission or deletion that refused a join as dependent on the margin set is checked from
#: the keys (``IncrementalSVDD._settle_degenerate``) while that check, n |support| d
#: multiply-adds, is at most this (about 20-50 ms on the 2-core machines); one that polished
#: the inverse always is (the polish evaluated as much). On near-duplicate keys such joins are
#: common (28 of 2,016 operations on the far-cluster grid refused one without polishing), and
#: at 8,192 sentence embeddings (d = 384) with 2,500 support keys one check costs seconds.
DEGENERATE_CHECK_WORK = 50_000_000
#: A batch change is a fresh bulk solve of the keys it leaves (ids kept) when the batch is at
#: least BULK_BATCH_FRACTION of the keys held and the margin set at least
#: BULK_BATCH_MARGIN_SHARE of them (:meth:`IncrementalSVDD.remove_many`, and ``extend`` into
#: a solver that holds keys): a walk of a key against a large margin set costs O(n m) per
#: event, so it is there that a batch of walks outgrows one build. Measured for deletions
#: (digits, d = 64, n = 1,797; benchmarks/forget.py): with 645-1,260 margin keys the rebuild
#: took 0.14-0.56 s against 1.1-7.6 s of decrements for 5-30 % of the keys, while at 2 % the
#: two were within a factor 0.7-5 of each other; with 10-40 margin keys the decrements took
#: 0.002-0.06 s against a 0.06-0.13 s rebuild. For admissions (the digits with a third of
#: the rows held twice, gamma = 1: every kernel value between distinct rows underflows to
#: 0): 479 rows into 959 held (871 on the margin) took 20 s of walks, hundreds of zero-length
#: events each, against a 1.3 s build of all 1,438. ``extend`` asks before each key, since its
#: walks can grow the margin set (479 rows into 480 held: 2 margin keys before, 871 after;
#: 14.5 s of walks, 0.6 s with the switch). A switch that waited for the walks' events to
#: reach the keys held took 4.5-14 s per chunk there instead of 1.1-2.9 s.
BULK_BATCH_FRACTION = 0.04
BULK_BATCH_MARGIN_SHARE = 0.25
#: An admission's or deletion's walk is tried first within about the work of one rebuild,
#: O(n^2 d + m^3) against O(n (m + d) + m^2) per event: at most FIRST_TRY_FACTOR times that
#: many events per walk (at least FIRST_TRY_MIN_EVENTS) and FIRST_TRY_REPAIRS repair walks;
#: past them the keys are solved afresh, and only where that is not accepted is the operation
#: walked again from the state before under the full limits (50 n + 1000 events, 10 n + 10
#: repairs), so that nothing is refused that those limits would have completed. On 1,000 keys
#: in tight clusters in d = 6 (469 on the margin) a deletion under the full limits took
#: 441,000 events and 136 s, and admissions 13-161 s each, before their rest states failed
#: the check from the keys and a fresh solve of about a second replaced them.
FIRST_TRY_FACTOR = 4
FIRST_TRY_MIN_EVENTS = 1000
FIRST_TRY_REPAIRS = 10
#: Audit thresholds: maintained gradients vs a fresh evaluation, and ||R M - I||_max.
#: AUDIT_GRAD_TOL also bounds rho's offset from a fresh solve's choice (units of f as well:
#: it moves every f by that much).
AUDIT_GRAD_TOL = 1e-10
AUDIT_INVERSE_TOL = 1e-8


def _inverse_residual(R, M):
    """||R M - I||_max (NaN-aware: ``largest_violation``)."""
    return largest_violation(np.abs(R @ M - np.eye(M.shape[0])).ravel())


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


class IncrementalSVDD(WalkDriver):
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
    n_admission_fallbacks : int
        Admissions (``add``, ``extend``) whose exact walk failed and that were taken by a
        fresh bulk solve of every key instead (see :meth:`extend`).
    n_active_set_builds : int
        Bulk builds whose landing was not accepted and that the primal active-set method
        solved instead (``svtoolkit.exact._active_set``; see :meth:`extend`).
    n_active_set_polishes : int
        Admissions and deletions on numerically degenerate keys whose rest state was above
        BULK_KKT_TOL and that the active-set method solved from there (docs/exact_solver.md,
        "The active-set polish of a degenerate operation").

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
        C = check_positive(C, "C")
        sigma = check_sigma(sigma)
        audit_every = check_int(audit_every, "audit_every", min=0)
        super().__init__(C, sigma)
        self.audit_every = audit_every
        self._ops_since_audit = 0
        self.n_bulk_builds = 0
        self.n_bulk_fallbacks = 0
        self.n_admission_fallbacks = 0
        self.n_active_set_builds = 0
        self.n_active_set_polishes = 0
        self.bulk_fallback_reason = None

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
        n0 = check_int(n0, "n0", min=1)
        C = 1.0 / (nu * n0)
        if not np.isfinite(C):
            raise ValueError(f"nu * n0 = {nu * n0!r} is too small: C = 1 / (nu n0) "
                             "is not a finite float")
        return cls(C, sigma, **kwargs)

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
            The exact walk could not finish and neither could a fresh solve of every key
            (the fallback, see :meth:`extend`); the key was not admitted and the solver
            holds the state it had before the call.
        """
        x = as_key(x, "x", d=self._d)
        return int(self._admit_rows(x[None, :])[0])

    def _admit_rows(self, X):
        """Admit validated rows in order. Each walk is first bounded by about the work of one
        rebuild (:meth:`_first_try_limits`); when a walk fails, the state becomes a fresh bulk
        solve of the keys held and the whole batch (:meth:`_admit_afresh`); if that is not
        accepted either, the batch is walked again from the state held before it under the
        full limits, and only if that fails too is that state restored (so a batch is all or
        nothing; :meth:`_restore`) and SolverFailure raised."""
        first_id, fresh = self._next_id, self._d is None
        before, ops_before = self._snapshot(), self._ops_since_audit
        marks = self._degenerate_marks()
        if fresh:
            self._d = X.shape[1]
            self._allocate(d=self._d, cap=self._Xt.shape[1], mcap=self._S.shape[0])
        ids = np.arange(first_id, first_id + len(X), dtype=np.int64)
        fallbacks = self.n_bulk_fallbacks
        if self._n == 0 and self._bulk_admit(X, ids):
            return ids
        if self.n_bulk_fallbacks > fallbacks:
            warnings.warn(f"extend: the bulk build of {len(X)} keys was not accepted "
                          f"({self.bulk_fallback_reason}); replaying them key by key through "
                          "the exact walk, which reaches the same optimum but can take far "
                          "longer", BulkFallbackWarning, stacklevel=3)  # <- extend <- caller
        bulk_tried = self.n_bulk_fallbacks > fallbacks
        try:
            # a fresh solve of a heavy batch: one try, none after its bulk build was refused
            self._walk_rows(X, ids, afresh=not bulk_tried, first_try=True)
        except SolverFailure as exc:
            held_ids, held_keys = self._held_keys(lambda held: held < first_id)
            if not (bulk_tried and len(held_ids) == 0) and self._admit_afresh(
                    np.concatenate([held_ids, ids]), np.concatenate([held_keys, X])):
                return ids
            self._ops_since_audit = ops_before
            if self.max_events is not None:  # the user's limit: no first try was bounded
                self._recover(exc, before, held_ids, held_keys)
            # neither the first tries nor the fresh solve: the batch again from the state
            # before it, under the walks' full limits (what every walk had before the first try)
            self._restore(before, held_ids, held_keys)
            if fresh:
                self._d = X.shape[1]
                self._allocate(d=self._d, cap=self._Xt.shape[1], mcap=self._S.shape[0])
            try:
                self._walk_rows(X, ids, afresh=False, first_try=False)
            except SolverFailure as again:
                self._ops_since_audit = ops_before
                self._recover(again, before, held_ids, held_keys)
        self._settle_degenerate(marks)
        return ids

    def _walk_rows(self, X, ids, *, afresh, first_try):
        """Admit rows ``X`` (ids ``ids``) by walks, in order; with ``afresh``, once the rows
        left make a heavy batch (:meth:`_batch_is_heavy`) they and the keys held are solved
        afresh instead (one try). With ``first_try``, each walk and its rest state are bounded
        by about the work of one rebuild (:meth:`_first_try_limits`). SolverFailure from a
        walk leaves a partial state for the caller."""
        for i, (new_id, x) in enumerate(zip(ids, X, strict=True)):
            if afresh and self._batch_is_heavy(len(X) - i, len(self) + len(X) - i):
                afresh = False
                if self._batch_afresh(X[i:], ids[i:]):
                    return
            self._first_try = self._first_try_limits() if first_try and self._n else None
            try:
                self._add_checked(x, int(new_id))
            finally:
                self._first_try = None
            self._after_operation()

    def _batch_is_heavy(self, k, kept):
        """Whether a batch of ``k`` keys to admit or delete goes to a fresh solve of the
        ``kept`` keys it leaves (ids kept) instead of k walks: the batch is at least
        BULK_BATCH_FRACTION of the keys held, the margin set holds at least
        BULK_BATCH_MARGIN_SHARE of them, and a bulk build of the kept keys applies (at least
        BULK_MIN_KEYS, n C >= 1 out of warm-up, no user event limit). ``extend`` asks before
        each walk (its walks can grow the margin set), ``remove_many`` once."""
        n = len(self)
        return bool(n and k >= BULK_BATCH_FRACTION * n and self._m >= BULK_BATCH_MARGIN_SHARE * n
                    and kept >= BULK_MIN_KEYS and self._feasible(kept) and self._anchor < 0
                    and self.max_events is None)

    def _batch_afresh(self, X, ids):
        """The rows ``X`` (ids ``ids``) of a batch not yet admitted and the keys held, solved
        afresh by the bulk build, ids kept: True when taken. A solve that is not accepted
        puts the state back (its inverse factorised afresh, :meth:`_restore`) for the walks
        to go on."""
        before = self._snapshot()
        held_ids, held_keys = self._held_keys(lambda held: np.ones(len(held), dtype=bool))
        if self._solve_afresh(np.concatenate([held_ids, ids]), np.vstack([held_keys, X])):
            return True
        self._restore(before, held_ids, held_keys)
        return False

    def _admit_afresh(self, ids, keys):
        """The fallback of an admission whose walk failed: :meth:`_solve_afresh` of ``keys``
        (the keys held before and the batch, ``ids`` kept) at any size from one key on. True
        when taken; False leaves the solver empty for the caller's recovery (neither build
        applies with an event limit set by the user)."""
        if not self._solve_afresh(ids, keys, min_keys=1):
            return False
        self.n_admission_fallbacks += 1
        return True

    def _solve_afresh(self, ids, keys, min_keys=None):
        """:meth:`_replace_by_fresh_solve`, counted as an operation when taken."""
        if self._replace_by_fresh_solve(ids, keys, min_keys):
            self._after_operation()
            return True
        return False

    def _replace_by_fresh_solve(self, ids, keys, min_keys=None):
        """Replace the state by a bulk build of ``keys`` with their ``ids`` - or, while they
        cannot hold the mass (n C < 1), by the active-set solve of the anchored problem
        (:meth:`_build_anchored`) - taken only at its exact certificate; the next id never
        goes back. True when taken, else False with the solver empty."""
        next_id = self._next_id
        self._reset()
        if self._bulk_admit(keys, ids, min_keys) or self._build_anchored(keys, ids):
            self._next_id = max(self._next_id, next_id)
            return True
        self._next_id = next_id
        return False

    def _build_anchored(self, X, ids):
        """A fresh solve in warm-up: the keys ``X`` (ids ``ids``) with the virtual anchor
        (``K'(anchor, x) = -1``, no upper bound; docs/design.md §3.8) by the active-set method
        from every key at C and the anchor holding the rest, accepted at BULK_KKT_TOL. Only
        while n C < 1, up to ACTIVE_SET_MAX_KEYS keys and without a user event limit (as the
        bulk build); True when taken, else False with the solver empty."""
        n = len(X)
        if (n == 0 or self._feasible(n) or n > ACTIVE_SET_MAX_KEYS
                or self.max_events is not None):
            return False
        self._place_keys(X, ids)  # n + 1 slots: the last is the anchor's
        self._Xt[:, n] = 0.0
        self._ids[n] = -1
        self._ist[W._N] = n + 1
        self._ist[W._ANCHOR] = n
        Kp = self._slots_gram()
        a = np.full(n + 1, self._C)
        a[n] = 1.0 - a[:n].sum()
        if self._install_active_set(Kp, a) is None and self.kkt_residual() <= BULK_KKT_TOL:
            self._next_id = int(ids[-1]) + 1
            self.n_active_set_builds += 1
            return True
        self._reset()
        return False

    def _bulk_admit(self, X, ids, min_keys=None):
        """Build from empty by SMO + exact landing; False (state empty again) if not taken.

        Up to BULK_MAX_KEYS keys the SMO runs on the shifted Gram matrix (:meth:`_land_bulk`);
        above, it is Gram-free, with a kernel-column cache (:meth:`_land_bulk_cached`). The
        landing (array work in ``_landing``): the SMO partition (coefficients within
        BULK_PARTITION_SNAP C of a bound are put at it), the bordered inverse grown over the
        margin keys from the most interior one on (a key dependent on the margin set - Schur
        complement below KAPPA_TOL - is put at its nearer bound, as the walk would keep it), the
        gradients, and then the walk's own rest state (``_rest.settle``: polish if needed,
        relaxation of sign violators, correction walk), which ends on the exact optimum.
        Accepted only if the KKT residual from a fresh evaluation of the keys is at most
        BULK_KKT_TOL; a landing above it is first polished (:meth:`_polish_landing`, up to
        BULK_POLISH_ROUNDS times). Up to ACTIVE_SET_MAX_KEYS keys each of the landing's rest
        states may take BULK_LANDING_EVENTS_PER_KEY events per key plus
        BULK_LANDING_MIN_EVENTS (about; ``WalkDriver._settle``), and a landing that is not
        accepted is solved by the primal active-set method from the SMO iterate
        (:meth:`_land_active_set`; on the Gram-free path the Gram matrix is formed for it).
        One still not accepted is counted in ``n_bulk_fallbacks``,
        ``bulk_fallback_reason`` names why, and a :class:`BulkFallbackWarning` says so (the
        batch is then replayed key by key, which can take far longer).
        """
        n = len(X)
        min_keys = BULK_MIN_KEYS if min_keys is None else min_keys
        if n < min_keys or not self._feasible(n) or self.max_events is not None:
            return False
        Kp = start = None  # the Gram matrix (if formed) and the SMO iterate, for the last resort
        if n <= ACTIVE_SET_MAX_KEYS:  # a landing that would not end can hand over
            self._event_budget = int(BULK_LANDING_EVENTS_PER_KEY * n) + BULK_LANDING_MIN_EVENTS
        try:
            self._place_keys(X, ids)
            inv_s2 = self._fs[W._INV_SIGMA2]
            if n <= BULK_MAX_KEYS:
                Kp, start, converged = L.smo_on_gram(self._Xt, n, inv_s2, self._C)
                self._land_bulk(Kp, start.copy())
                kkt = self.kkt_residual()
            else:
                cached = L.smo_gram_free(self._Xt, n, inv_s2, self._C)
                start = cached[0].copy()
                if not cached[4]:
                    raise SolverFailure("the bulk SMO did not converge")
                converged, kkt = True, self._land_bulk_cached(*cached[:4])
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
        finally:
            self._event_budget = None
        if reason is not None and start is not None and n <= ACTIVE_SET_MAX_KEYS:
            if Kp is None:  # the Gram-free landing: the active set needs the matrix
                Kp = self._slots_gram()
            reason = self._land_active_set(X, ids, Kp, start, reason)
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
        """Put keys ``X`` with ``ids`` in the first slots of an empty solver (one slot spare),
        with their id -> slot map."""
        n = len(X)
        self._ensure_slots(n + 1)
        self._Xt[:, :n] = X.T
        self._ids[:n] = ids
        self._ist[W._N] = n
        self._slot_of = {int(i): slot for slot, i in enumerate(ids)}
        self._order_cache = None

    def _land_bulk(self, Kp, a):
        """The bulk landing from ``_landing.smo_on_gram``'s shifted Gram matrix ``Kp`` and
        iterate ``a`` (changed in place), the keys placed; it proceeds from the SMO's last
        iterate whether or not the SMO met its tolerance."""
        order = self._snap_partition(a)
        factorised = self._margin_from_rows(Kp[order], order, a)
        self._rest_from_field(a, 2.0 * (Kp @ a), factorised)

    def _land_active_set(self, X, ids, Kp, a, reason):
        """The last resort of a landing (of up to ACTIVE_SET_MAX_KEYS keys, ``Kp`` their
        shifted Gram matrix) that was not accepted (``reason`` says why): the primal
        active-set method from the SMO iterate ``a`` (snapped to the bounds it nearly meets,
        ``_active_set.snapped_start``), installed as the state
        (:meth:`_install_active_set`) and accepted at BULK_KKT_TOL like any landing; where
        that start is not accepted (the method can cycle on a numerically singular free set
        near the optimum: tight clusters), once more from the centre of the box, every
        a = 1 / n (when n C >= 1). Returns None when accepted, else ``reason`` extended."""
        n = len(X)
        starts = [AS.snapped_start(a, self._C, AS.ACTIVE_SET_START_SNAP)]
        if self._feasible(n):
            starts.append(np.full(n, 1.0 / n))  # inside the box: n C >= 1
        for start in starts:
            self._reset()
            self._place_keys(X, ids)
            failure = self._install_active_set(Kp, start)
            if failure is None:
                kkt = self.kkt_residual()
                if kkt <= BULK_KKT_TOL:
                    self.n_active_set_builds += 1
                    return None
                failure = f"the active-set fallback ended at a KKT residual of {kkt:.2g}"
            reason = f"{reason}; {failure}"
        return reason

    def _install_active_set(self, Kp, a):
        """Solve the placed keys by the primal active-set method
        (``_active_set.active_set``) from feasible coefficients ``a`` (slot order; ``Kp`` the
        shifted Gram matrix of the first n slots, the warm-up anchor's entries included) and
        install the result in place - its free keys the margin set, the inverse factorised
        afresh, every gradient from the keys, at rest. Returns None when installed, else why
        not (the state is then partly written)."""
        n, C = len(a), self._C
        upper = np.full(n, C)
        if self._anchor >= 0:
            upper[self._anchor] = np.inf  # the anchor takes any mass the keys cannot
        a = a.copy()
        free, rho_shifted, converged = AS.active_set(
            Kp, upper, a, W.REPAIR_MIN_TOL * max(C, 1.0),
            ACTIVE_SET_ITERATIONS_PER_KEY * n + BULK_LANDING_MIN_EVENTS)
        if not converged:
            return "the active-set fallback did not converge"
        AS.merge_twins(self._Xt[:, :n], a, free, upper)
        inside = (a > 0.0) & (a < upper)
        ended = free & ~inside  # ended on a bound: held there
        a[ended] = np.where(a[ended] <= 0.0, 0.0, upper[ended])
        order = np.flatnonzero(free & inside)
        m = len(order)
        self._ensure_margin(m)
        self._alpha[:n] = a
        self._status[:n] = np.where(a == 0.0, W.RESERVE, W.ERROR)
        self._status[order] = W.MARGIN
        self._spos[:n] = -1
        self._spos[order] = np.arange(m)
        self._S[:m] = order
        self._KSt[:m, :n] = Kp[order]
        self._ist[W._M] = m
        self._fs[W._RHO] = rho_shifted
        try:
            self._polish()  # the inverse factorised, every gradient from the keys
        except SolverFailure as exc:
            return f"the active-set state: {exc}"
        self._ist[W._SETTLED] = self._ist[W._EVENTS]  # at rest: nothing left to settle
        return None

    def _land_bulk_cached(self, a, a0, g0, grad):
        """The Gram-free bulk landing from ``_landing.smo_gram_free``'s iterate ``a`` (changed
        in place), start ``a0``, start gradients ``g0`` and maintained gradients ``grad``, the
        keys placed; returns the KKT residual of its certificate.

        After the landing the certificate is an evaluation from the keys, g0 + 2 K' (a - a0)
        over the keys whose coefficient moved since the start a0 (the same sums a full
        evaluation computes, grouped by linearity). Memory O(n (d + cache columns + m)) with m
        the margin set.
        """
        n, inv_s2 = len(a), self._fs[W._INV_SIGMA2]
        a_smo = a.copy()
        order = self._snap_partition(a)
        factorised = self._margin_from_rows(L.margin_rows(self._Xt, n, inv_s2, order), order, a)
        # the snaps and the keys kept at a bound
        grad += L.kernel_sums(self._Xt, n, inv_s2, a - a_smo)
        self._rest_from_field(a, grad, factorised)
        fresh = g0 + L.kernel_sums(self._Xt, n, inv_s2, self._alpha[:n] - a0) + self._fs[W._RHO]
        return self._kkt_from(fresh)

    def _snap_partition(self, a):
        """The partition of SMO coefficients (``_landing.snap_partition``), with margin
        capacity for it; returns the margin candidates, most interior first."""
        order = L.snap_partition(a, self._C, self._status)
        self._ensure_margin(len(order))
        return order

    def _margin_from_rows(self, rows, order, a):
        """Margin set from ``order`` (rows[p] = K'[order[p], :n]); True when factorised."""
        m = L.factor_margin(rows, order, self._S, self._spos, self._status, self._KSt,
                            self._R, self._ist) if len(order) > 1 else 0
        factorised = m > 0
        if factorised:
            self._calibrate_probe()
        else:
            m = L.grow_margin_from(rows, order, a, self._C, self._S, self._spos, self._status,
                                   self._KSt, self._R, self._bk, self._vbuf, self._fs)
        self._ist[W._M] = m
        return factorised

    def _rest_from_field(self, a, field, factorised):
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
        self._settle(polish_allowed=not factorised)

    def extend(self, X):
        """Admit the rows of ``X`` one at a time, all or nothing.

        The batch is validated as a whole first. Into an empty solver, a batch of at least
        BULK_MIN_KEYS keys with n C >= 1 is solved by the bulk path instead (SMO and an exact
        landing, Gram-free above BULK_MAX_KEYS keys; docs/exact_solver.md), accepted only
        with a fresh KKT residual of at most BULK_KKT_TOL; a landing of up to
        ACTIVE_SET_MAX_KEYS keys that is not accepted is solved by a primal active-set method
        instead (``n_active_set_builds``), and only what that does not certify is replayed by
        the walk. Into a solver that holds keys, the rows not yet admitted are solved afresh
        with the keys held (the bulk path, ids kept, the same certificate) once they are at
        least BULK_BATCH_FRACTION of the keys held while the margin set holds at least
        BULK_BATCH_MARGIN_SHARE of them - asked before each walk, as the walks can grow the
        margin set; tried once per batch, and a solve not accepted leaves the walks to go on.
        Each walk is first bounded by about the work of one rebuild (``FIRST_TRY_FACTOR``). If
        an exact walk fails part-way, the keys held and the whole batch are solved
        afresh by the bulk path at any size, ids kept, and taken at the same certificate
        (``n_admission_fallbacks`` counts these); where that solve does not apply (n C < 1,
        a user's ``max_events``) or is not accepted, the batch is walked again from the state
        before it under the full limits (not under a user's ``max_events``), and only if that
        fails too is the batch refused: the solver then holds
        the state it had before the call (its coefficients, gradients, rho and partition to
        the bit, the inverse factorised afresh), with no row admitted.

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
            A walk failed and so did the fresh solve of every key; the state is the one held
            before the call.
        """
        X = as_keys(X, "X", d=self._d)
        return self._admit_rows(X)

    def remove(self, id):
        """Delete one key by exact decrement (exact unlearning).

        Afterwards the state is the optimum of the retained keys under the same C - what a
        fresh solve of them gives. A deletion is not refused for want of a walk: if the
        retained keys can no longer satisfy ``sum(a) = 1`` the solver returns to warm-up, and
        if the exact decrement cannot finish (a walk past its event limit, or a rest state
        that drifted from the keys on numerically degenerate keys) the state is replaced by a
        fresh solve of the retained keys - the same optimum, reached another way
        (``n_bulk_builds`` or ``n_rebuilds`` counts it).

        Raises
        ------
        KeyError
            Unknown id, or an id that was already removed. The state is unchanged.
        SolverFailure
            Only if that fresh solve fails too: then the deletion is refused and the solver
            holds the state it had before the call (nothing lost; never observed but with
            failures forced in the tests).
        """
        slot = self._lookup(id)
        if len(self) == 1:
            self._reset()
            self._after_operation()
            return
        marks = self._degenerate_marks()
        if self._alpha[slot] == 0.0:
            # a key with a = 0 leaves without a step: nothing moves, no walk runs
            self._remove_slot(slot, int(id))
            self._after_operation()
            self._settle_degenerate(marks)
            return
        # the removal walks, at O(n m) per event, beside which this O(n + m) copy is small
        before = self._deletion_snapshot(slice(slot, slot + 1))
        try:
            self._first_try = self._first_try_limits()
            self._decrement(slot, int(id))
        except SolverFailure:
            # the right to be forgotten does not depend on the walk: solve the rest afresh,
            # and where that is not accepted walk again under the full limits
            self._first_try = None
            if self._solve_afresh_without([int(id)], "remove", before, refuse=False):
                return
            slot = self._slot_of[int(id)]
            before = self._deletion_snapshot(slice(slot, slot + 1))
            try:
                self._decrement(slot, int(id))
            except SolverFailure as exc:  # the fresh solve failed already: not again
                ids, keys = self._held_keys(lambda held: held != int(id))
                self._put_back(before, ids, keys)
                raise SolverFailure(
                    f"{exc}; remove: the fresh solve of the {len(ids)} retained keys failed "
                    "too, so the deletion was refused and the solver holds the state it had "
                    "before it (nothing lost)") from exc
        finally:
            self._first_try = None
        self._after_operation()
        self._settle_degenerate(marks)

    def _first_try_limits(self):
        """(events per walk, repair walks) of an admission's or deletion's first try: about
        the work of one rebuild (FIRST_TRY_FACTOR, FIRST_TRY_MIN_EVENTS, FIRST_TRY_REPAIRS)."""
        n, m, d = self._n, self._m, self._d
        events = FIRST_TRY_FACTOR * (n * n * d + m**3) // (n * (m + d) + m * m)
        return max(FIRST_TRY_MIN_EVENTS, events), FIRST_TRY_REPAIRS

    def _decrement(self, slot, key_id):
        """The exact decrement of the key in ``slot`` (a > 0) and the rest state after it."""
        if self._anchor < 0 and self._on_vertex(len(self) - 1):
            # the retained keys have one feasible point: land on it (a walk would have to end
            # on the rounding residue of the victim's mass; see _land_on_vertex)
            del self._slot_of[key_id]
            self._land_on_vertex(slot)
            self._settle()
        else:
            if self._anchor < 0 and not self._feasible(len(self) - 1):
                self._admit_anchor()
            self._remove_slot(slot, key_id)

    def _degenerate_marks(self):
        """The counts :meth:`_settle_degenerate` compares after an operation: the joins
        refused as dependent on S and the polishes so far."""
        return int(self._ist[W._REFUSED]), self.n_polishes

    def _settle_degenerate(self, marks):
        """After an admission or deletion, the active-set polish of a degenerate state.

        The walk's rest state tolerates sign violations of keys nearly dependent on S (up to
        REPAIR_FACTOR C kappa), and a badly conditioned margin set lets the maintained
        gradients drift from the keys: on tight clusters farther apart than the kernel
        width, states ended up to 1e-6 above the optimum with ``certified`` True. Where the
        operation polished the inverse, or refused a join as dependent on S, or its rest
        state tolerated a sign violation above BULK_KKT_TOL on a key nearly dependent on S
        (read off the maintained gradients, O(n): 2-D tight clusters at sigma = 0.1 x the
        median distance ended admissions at KKT 2.6e-11 and 8.8e-11 without any other mark),
        the last two while that costs at most DEGENERATE_CHECK_WORK (``marks``,
        :meth:`_degenerate_marks` before it), the
        state is checked from the keys, one O(n |support| d) evaluation - after a polish as
        much as the polish's own - and nothing otherwise;
        above BULK_KKT_TOL the keys are solved by the active-set method from the walk's
        coefficients (up to ACTIVE_SET_MAX_KEYS keys, the warm-up anchor included), and that
        state is kept where it reaches BULK_KKT_TOL; else a fresh solve of the keys (ids kept)
        is taken where it reaches its exact certificate, and else the lower of the walk's and
        the active set's KKT residuals is kept. (2-D tight clusters at sigma = 0.1 x the median
        distance: deletions ended at KKT 8.6e-9 after their polishes where the active set from
        there was not accepted, and at 3.2e-11 where it only improved the walk's state; a
        fresh solve of the same keys is at 1.8e-15 and 2.9e-15.)
        """
        refused, polishes = self._degenerate_marks()
        if self._n == 0 or self._n > ACTIVE_SET_MAX_KEYS:
            return
        if polishes == marks[1]:
            tolerated = CS.sign_violation(self._grad, self._status, self._n) > BULK_KKT_TOL
            if refused == marks[0] and not tolerated:
                return  # nothing to check
            if self._n * self.support_size * self._d > DEGENERATE_CHECK_WORK:
                return  # a check that would cost too much
        kkt = self.kkt_residual()
        if kkt <= BULK_KKT_TOL:
            return
        best = before = self._snapshot()
        ids, keys = self._held_keys(lambda held: np.ones(len(held), dtype=bool))
        Kp = self._slots_gram()
        if self._install_active_set(Kp, self._alpha[:self._n]) is None:
            found = self.kkt_residual()
            if found <= BULK_KKT_TOL:
                self.n_active_set_polishes += 1
                return
            if found < kkt:  # better, not exact: kept unless a fresh solve is exact
                best = self._snapshot()
        if self._replace_by_fresh_solve(ids, keys, min_keys=1):
            return
        self._restore(best, ids, keys)
        if best is not before:
            self.n_active_set_polishes += 1

    def _slots_gram(self):
        """The shifted Gram matrix K' of the n slots, shape (n, n), the warm-up anchor's
        entries as docs/design.md §3.8 defines them (``K'(anchor, x) = -1``,
        ``K'(anchor, anchor) = 0``)."""
        Kp = B.shifted_gram(self._Xt, self._n, self._fs[W._INV_SIGMA2])
        anchor = self._anchor
        if anchor >= 0:
            Kp[anchor, :] = Kp[:, anchor] = -1.0
            Kp[anchor, anchor] = 0.0
        return Kp

    def remove_many(self, ids):
        """Delete several keys exactly: afterwards the state is the optimum of the retained
        keys under the same C, what a fresh solve of them gives (and what :meth:`remove` of
        each in turn gives, to rounding).

        Where decrements are expensive - a batch of at least :data:`BULK_BATCH_FRACTION` of
        the keys held while the margin set holds at least :data:`BULK_BATCH_MARGIN_SHARE` of
        them - and the retained keys can be bulk-built (at least BULK_MIN_KEYS of them,
        n C >= 1), the batch is not walked key by key: the retained keys are solved afresh
        by the bulk build, their ids kept - the same optimum at the cost of one build (a
        landing that is not accepted is replayed by the walk, with a
        :class:`BulkFallbackWarning`). Otherwise the keys are removed one decrement at a
        time.

        Parameters
        ----------
        ids : array_like of int
            Distinct ids of held keys. An empty batch changes nothing.

        Raises
        ------
        KeyError
            An id that is not an integer, unknown, or already removed. Nothing is removed.
        ValueError
            Repeated ids. Nothing is removed.
        SolverFailure
            Only if a fresh solve of the retained keys, the fallback of a decrement that
            cannot finish, fails too (see :meth:`remove`).
        """
        wanted = list(np.asarray(ids, dtype=object).ravel())
        for key_id in wanted:
            self._lookup(key_id)  # every id is checked before anything is removed
        wanted = [int(key_id) for key_id in wanted]
        if len(set(wanted)) != len(wanted):
            raise ValueError("ids must be distinct; got a repeated id")
        if wanted and self._batch_is_heavy(len(wanted), len(self) - len(wanted)):
            before = self._deletion_snapshot([self._slot_of[key_id] for key_id in wanted])
            self._solve_afresh_without(wanted, "remove_many", before)
            return
        for key_id in wanted:
            self.remove(key_id)

    def _deletion_snapshot(self, slots):
        """:meth:`_snapshot` with the keys in ``slots`` (the ones to delete: a list of slots,
        or a slice - basic indexing, which a single deletion takes because it costs a few
        microseconds less than a fancy index) and their ids: what a refused deletion needs to
        put back, its victims included."""
        return self._snapshot(), self._ids[slots].copy(), self._Xt[:, slots].T.copy()

    def _solve_afresh_without(self, wanted, caller, before, refuse=True):
        """Replace the state by a fresh solve of the keys not in ``wanted`` (ids and the next
        id kept): the bulk build, or the walk's rebuild when its landing is not accepted (a
        :class:`BulkFallbackWarning` names ``caller`` then); True when taken. If that rebuild
        fails too, the state of ``before`` (:meth:`_deletion_snapshot`) is restored and
        SolverFailure raised - a refused deletion, with nothing lost - or, with
        ``refuse=False``, False returned."""
        wanted = np.asarray(wanted, dtype=np.int64)
        ids, keys = self._held_keys(lambda held: ~np.isin(held, wanted))
        fallbacks = self.n_bulk_fallbacks
        if self._solve_afresh(ids, keys, min_keys=1):
            return True
        if self.n_bulk_fallbacks > fallbacks:  # a landing was tried and not accepted
            warnings.warn(f"{caller}: the bulk rebuild of the {len(ids)} retained keys was "
                          f"not accepted ({self.bulk_fallback_reason}); rebuilding them key "
                          "by key through the exact walk, which reaches the same optimum but "
                          "can take far longer", BulkFallbackWarning, stacklevel=3)
        try:
            self._rebuild(ids, keys)
        except SolverFailure as exc:
            self._put_back(before, ids, keys)
            if not refuse:
                return False
            raise SolverFailure(
                f"{exc}; {caller}: the fresh solve of the {len(ids)} retained keys failed too, "
                "so the deletion was refused and the solver holds the state it had before it "
                "(nothing lost)") from exc
        self._after_operation()
        return True

    def _put_back(self, before, ids, keys):
        """After a deletion failed part-way: the state of ``before``
        (:meth:`_deletion_snapshot`) from the retained keys ``ids``, ``keys`` (ascending ids)
        and the victims' copies."""
        snapshot, victim_ids, victim_keys = before
        all_ids = np.concatenate([ids, victim_ids])
        order = np.argsort(all_ids, kind="stable")
        self._restore(snapshot, all_ids[order], np.concatenate([keys, victim_keys])[order])

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
        if type(id) is int:  # the common case, without the ABC checks below (a microsecond)
            slot = self._slot_of.get(id)
            if slot is not None:
                return slot
        if isinstance(id, bool) or not isinstance(id, (numbers.Integral, np.integer)):
            raise KeyError(f"ids are integers; got {id!r}")
        key = int(id)
        slot = self._slot_of.get(key)
        if slot is None:
            if 0 <= key < self._next_id:
                raise KeyError(f"id {key} is not held by the solver: it was removed")
            raise KeyError(f"unknown id {key}")
        return slot

    def _after_operation(self):
        self._ops_since_audit += 1
        if self.audit_every and self._ops_since_audit >= self.audit_every:
            self.audit()

    # ------------------------------------------------------------------ read-only views
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
    def support_size(self):
        """Keys with a > 0 (the margin and error sets): the kernel terms of one decision value
        (the warm-up anchor is not a key and not counted)."""
        count = int(np.count_nonzero(self._alpha[: self._n]))
        if self._anchor >= 0 and self._alpha[self._anchor] != 0.0:
            count -= 1
        return count

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

    def state_dict(self, compact=False):
        """Everything needed to restore this solver bit for bit (plain arrays and numbers):
        the state and every setting that steers later operations, so that a restored solver
        takes the same steps as this one (format ``_state.STATE_FORMAT``).

        Parameters
        ----------
        compact : bool, default False
            Leave out the keys ``Xt`` (shape (d, n)), the margin kernel rows ``KSt`` (m, n)
            and the margin positions ``spos``: for a caller that stores the keys itself and
            puts ``Xt`` back before :meth:`from_state_dict`, which recomputes the other two
            from the keys, bit for bit what this solver holds (a store then writes
            ``O(n)`` numbers per operation instead of ``O(n (m + d))``).

        Returns
        -------
        dict
            The state's arrays (copies) and settings; :meth:`from_state_dict` reads it.
        """
        return export_state(self, compact)

    @classmethod
    def from_state_dict(cls, state):
        """Rebuild a solver from :meth:`state_dict` output, validated structurally.

        Every field the kernels index with or divide by is checked before use (integer
        fields and ranges, finite floats, the anchor, partition codes against the
        coefficients, the margin list, ``sum(a) = 1``, the constants derived from C and
        sigma), so a damaged state is refused rather than crashing a kernel. Whether the
        numbers are an optimum and agree with the keys is :meth:`consistency`'s check
        (``O(n |support| d)``); run it on a state from an untrusted source. States of the
        earlier formats 1 and 2 load too (``_state.STATE_FORMAT``).

        Raises
        ------
        ValueError
            Unknown format, or fields whose types, shapes or contents contradict each other.
        """
        return restore_state(cls, state)
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
        W.decision(Qt, self._Xt, self._alpha, self._n, self._anchor, self._fs[W._INV_SIGMA2],
                   self._fs[W._RHO], out)
        return out

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
        return CS.kkt_residual_from(g, self._alpha, self._status, self._n, self._anchor,
                                    self._C, self._fs[W._RHO])

    def _rho_offset(self, g):
        """``(pinned, |rho - the rho a fresh solve reports|)`` for gradients g (n,)
        (``_consistency.rho_offset``)."""
        return CS.rho_offset(g, self._alpha, self._status, self._n, self._anchor, self._C,
                             self._fs[W._RHO])

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
            inv_res = _inverse_residual(self._R[: m + 1, : m + 1], self._bordered())
            if margin_rows:
                rows_drift = CS.margin_rows_drift(self._Xt, n, self._S, self._KSt, m,
                                                  self._anchor, self._fs[W._INV_SIGMA2])
        return Consistency(kkt_residual=self._kkt_from(fresh), grad_drift=drift,
                           inverse_residual=inv_res, margin_rows_drift=rows_drift,
                           rho_offset=self._rho_offset(fresh)[1])

    def fresh_inverse_residual(self):
        """``||R M - I||_max`` of a freshly factorised inverse R of the current bordered margin
        matrix M (O(m^3)): the floor that the maintained inverse's residual
        (:meth:`consistency`'s ``inverse_residual``) can be judged against. About u cond(M);
        above 1e-6 only on a numerically singular margin set (an active-set build,
        ``n_active_set_builds``). 0.0 with an empty margin set."""
        m = self._m
        if m == 0:
            return 0.0
        M = self._bordered()
        return _inverse_residual(bordered_inverse(M, np.empty_like(M)), M)

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

    @property
    def margin_size(self):
        """m, the keys in the margin block of the maintained bordered system (the margin set;
        during warm-up the virtual anchor too): the system and its inverse are (m + 1)-square."""
        return self._m

    def audit_slice(self, ids, columns):
        """Maintained quantities beside their fresh evaluation, for chosen keys and columns.

        What :meth:`consistency` compares all at once, for a slice: the maintained gradients
        of the keys ``ids`` and the same evaluated from the keys (``O(k |support| d)``), the
        maintained inverse times the chosen columns of the bordered matrix (O((m + 1)^2 c)),
        and rho's offset from a fresh solve's choice on the maintained gradients (O(n)). The
        memory's rolling audit cycles through every key and column this way. Changes nothing.

        Parameters
        ----------
        ids : array_like of int, shape (k,)
            Held ids.
        columns : array_like of int, shape (c,)
            Columns of the (m + 1)-square bordered system, each in ``[0, margin_size]``
            (0 is the border); none while the margin set is empty.

        Returns
        -------
        AuditSlice
            ``maintained_gradients`` and ``fresh_gradients`` of shape (k,),
            ``inverse_columns`` of shape (m + 1, c) and ``rho_offset`` (a frozen dataclass).

        Raises
        ------
        KeyError
            An id that is not held.
        ValueError
            A column outside ``[0, margin_size]``, or any column while the margin set is empty.
        """
        slots = np.fromiter((self._lookup(i) for i in ids), dtype=np.int64)
        cols = np.asarray(columns, dtype=np.int64).reshape(-1)
        m, n = self._m, self._n
        if len(cols) and (m == 0 or cols.min() < 0 or cols.max() > m):
            raise ValueError(f"columns must be in [0, margin_size = {m}] with margin keys held")
        # at a key the decision function is its gradient g = 2 sum_j a_j k(x, x_j) - 1 + rho
        fresh = self.decision_function(self._Xt[:, slots].T) if len(slots) else np.empty(0)
        size = m + 1
        S = self._S[:m]
        block = np.empty((size, len(cols)))
        for j, c in enumerate(cols):
            if c == 0:
                block[0, j] = 0.0
                block[1:, j] = 1.0
            else:
                block[0, j] = 1.0
                block[1:, j] = 2.0 * self._KSt[:m, S[c - 1]]
        return AuditSlice(maintained_gradients=self._grad[slots], fresh_gradients=fresh,
                          inverse_columns=self._R[:size, :size] @ block,
                          rho_offset=self._rho_offset(self._grad[:n])[1] if n else 0.0)
