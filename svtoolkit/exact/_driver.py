"""The exact solver's maintained state and its crossings into the walk's Numba kernels.

:class:`WalkDriver` is the private base of :class:`~svtoolkit.exact.IncrementalSVDD`. It owns
the state arrays (layout: :mod:`svtoolkit.exact._walk`), their allocation and growth, one walk
or one rest state per kernel call (:mod:`svtoolkit.exact._walk`, :mod:`svtoolkit.exact._rest`),
slot insertion and deletion with the id bookkeeping that follows them, the warm-up anchor and
the vertex n C = 1, polish and refactorisation, the restore of a refused admission and the
rebuild after a failed deletion. The public class adds input validation, the operations, the
bulk build, views, persistence and the audit.
"""

from __future__ import annotations

import numpy as np

from .._rules import feasible, sums_to_one
from . import _consistency as CS
from . import _walk as W
from ._factor import bordered_inverse
from ._rest import remove_and_settle, settle
from ._state import fill_kernel_rows

__all__ = ["SolverFailure", "WalkDriver"]


class SolverFailure(RuntimeError):
    """The exact walk could not finish (event limit, no admissible event, or a rest state that
    drifted from the keys), and neither could the fallback.

    A refused operation leaves the state the solver held before it. A deletion is refused
    only when the fresh solve of the keys it retains fails too (:meth:`IncrementalSVDD.remove`).
    """


class BulkFallbackWarning(RuntimeWarning):
    """A bulk build's landing missed the exact certificate: the batch is replayed key by key.

    The replay reaches the same exact optimum, but one walk per key can take far longer
    than the bulk build (minutes instead of seconds at a few thousand keys). The solver's
    ``n_bulk_fallbacks`` counts these and ``bulk_fallback_reason`` names the last reason.
    """


class WalkDriver:
    """The maintained state of the exact walk and every call into its kernels.

    Parameters
    ----------
    C, sigma : float
        Box constraint and RBF kernel width, validated by the caller.

    Attributes
    ----------
    max_events : int or None
        Event limit of one walk (None: 50 n + 1000).
    n_polishes, n_refactorizations, n_rebuilds : int
        Counters of :meth:`_polish`, :meth:`_refactorize` and :meth:`_rebuild`.
    """

    def __init__(self, C, sigma):
        self._C = C
        self._sigma = sigma
        self.max_events = None  # None: 50 n + 1000 events per walk
        self._rebuilding = False
        self._event_budget = None  # events the rest state may take in all (a bulk landing's)
        self._first_try = None  # (events per walk, repair walks) of an operation's first try
        self._d = None
        self._next_id = 0
        self._slot_of = {}
        self.n_refactorizations = 0
        self.n_polishes = 0
        self.n_rebuilds = 0
        self._allocate(d=1, cap=16, mcap=8)
        self._d = None

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
        self._fs = np.empty(W.FS_SIZE)
        self._fs[[W._RHO, W._C, W._INV_SIGMA2, W._MIN_PIVOT, W._PROBE_LIMIT, W._REFRESH_LIMIT]] = (
            0.0, self._C, 1.0 / self._sigma**2, np.inf, W.PROBE_TOL, W.REFRESH_PROBE_TOL)
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

    def _ensure_margin(self, m):
        """Margin capacity for a margin set of m keys installed at once (a landing): raised to
        m + 2 where it is less (the kernels ask for more once m reaches the capacity), not to
        the next doubling - at 2,048 margin keys a doubled capacity held a 134 MB inverse buffer
        and 67 MB of margin rows where 34 MB each are used, and a build paid for touching them."""
        if self._S.shape[0] < m + 2:
            self._grow_margin(at_least=m + 2)

    def _grow_margin(self, at_least=0):
        """Margin capacity doubled (the walk's growth: one copy of the inverse per doubling), or
        raised to ``at_least`` where that is more (:meth:`_ensure_margin`)."""
        mcap = self._S.shape[0]
        new = max(2 * mcap, at_least)
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
    def _first_try_bounds(self):
        """(events per walk, repair walks) of an operation's first try, or None where the full
        limits apply (no first try, a user's ``max_events``, a rebuild)."""
        if self._first_try is None or self.max_events is not None or self._rebuilding:
            return None
        return self._first_try

    def _event_limit(self):
        if self.max_events is not None and not self._rebuilding:
            return self.max_events
        bounds = self._first_try_bounds()
        limit = 50 * self._n + 1000
        return limit if bounds is None else min(limit, bounds[0])

    def _repair_limit(self):
        """Repair walks a rest state may take: 10 n + 10, fewer on an operation's first try."""
        bounds = self._first_try_bounds()
        limit = 10 * self._n + 10
        return limit if bounds is None else min(limit, bounds[1])

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

    def _singular(self, exc):
        """The SolverFailure of a margin matrix that a refactorisation inside a walk or its
        rest state found singular to working precision (``np.linalg.LinAlgError``: an
        in-walk refresh or a polish of keys that rounding makes dependent, e.g. many exact
        duplicates of a few keys under a kernel much wider than their spread). The walk
        stopped part way, so it is a failure like any other: the caller's fallback (a fresh
        solve, or the state held before) takes over."""
        self._ist[W._CUR_C] = -1
        # the id -> slot map and the id-order cache may miss a slot deletion of the kernel:
        # the fallback reads the held keys from the arrays (``_held_keys``), which hold them
        self._order_cache = None
        return SolverFailure(f"the margin set's bordered matrix is singular to working "
                             f"precision ({exc})")

    def _walk(self, c, mode, kc_ready=False):
        """Run one exact walk of slot c, then relax any sign violators (see _rest.repair)."""
        try:
            code = W.walk(*self._arrays(), c, mode, kc_ready, self._event_limit())
            while self._check(code):
                code = W.walk(*self._arrays(), c, mode, False, self._event_limit())
        except np.linalg.LinAlgError as exc:
            raise self._singular(exc) from exc

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
        return feasible(n_real, self._C)

    def _on_vertex(self, n_real):
        """True when n_real keys have a single feasible point: n C = 1 to FEASIBILITY_TOL
        (from either side), where a = C for every key is the only way to sum to one."""
        return sums_to_one(n_real, self._C)

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
        """Bring the state to rest in canonical form (see ``_rest.settle``), polishing when it
        asks, at most ``SETTLE_POLISHES`` times; a caller that has just factorised the inverse
        and evaluated every gradient passes polish_allowed=False (it counts as one polish).

        With ``_event_budget`` set (a bulk landing's rest state) the events of the whole rest
        state are bounded: each kernel call relaxes at most one violator and every walk in it
        may take only what is left of the budget, so the rest state takes at most about twice
        the budget; SolverFailure when it is spent."""
        limit, repairs = self._event_limit(), self._repair_limit()
        deadline = None
        if self._event_budget is not None:
            deadline, repairs = self._ist[W._EVENTS] + self._event_budget, 1
        polishes = 0 if polish_allowed else 1
        while True:
            if deadline is not None:
                limit = int(deadline - self._ist[W._EVENTS])
                if limit <= 0:
                    self._ist[W._CUR_C] = -1
                    raise SolverFailure(f"the rest state took more than its budget of "
                                        f"{self._event_budget} events")
            try:
                code = settle(*self._arrays(), limit, repairs, polishes < W.SETTLE_POLISHES)
            except np.linalg.LinAlgError as exc:
                raise self._singular(exc) from exc
            if code == W.NEED_POLISH:
                self._polish()
                polishes += 1
            elif code == W.TOO_MANY_EVENTS and deadline is not None:
                continue  # one relaxation done (or the budget spent): the next, or fail
            elif not self._check(code):
                break
        if polishes >= W.SETTLE_POLISHES:
            self._check_rest_from_keys()

    def _check_rest_from_keys(self):
        """After the last polish an operation may take: its rest state checked from the keys
        (one fresh evaluation, O(n |support| d), as each polish before it cost); SolverFailure
        when its KKT residual is above ``REST_CHECK_FACTOR`` times what a rest state tolerates
        (``_walk.REST_CHECK_FACTOR``)."""
        n = self._n
        if n == 0:
            return
        kkt = CS.kkt_residual_from(self._fresh_gradients(), self._alpha, self._status, n,
                                   self._anchor, self._C, self._fs[W._RHO])
        limit = W.REST_CHECK_FACTOR * W.REPAIR_FACTOR * max(self._C, 1.0) * W.KAPPA_TOL
        if not kkt <= limit:
            self._ist[W._CUR_C] = -1
            raise SolverFailure(
                f"the state at rest is {kkt:.2g} off the optimum when evaluated from the keys "
                f"(above {limit:.2g}) after {W.SETTLE_POLISHES} polishes: the walk's rounding "
                "on nearly dependent keys")

    def _reset(self):
        d = self._d
        self._allocate(d=d, cap=self._Xt.shape[1], mcap=self._S.shape[0])
        self._slot_of = {}

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

    def _remove_slot(self, slot, key_id):
        """Walk slot to 0, delete it and settle: one kernel call (``_rest.remove_and_settle``)
        unless the walk needs more margin capacity or the settle a polish."""
        try:
            moved, code = remove_and_settle(*self._arrays(), slot, self._event_limit(),
                                              self._repair_limit())
        except np.linalg.LinAlgError as exc:  # before or after the slot's deletion
            raise self._singular(exc) from exc
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

    def _fresh_gradients(self):
        """Every slot's gradient from the keys, shape (n,) (``_consistency.fresh_gradients``)."""
        return CS.fresh_gradients(self._Xt, self._alpha, self._n, self._anchor, self._d,
                                  self._fs[W._INV_SIGMA2], self._fs[W._RHO])

    def _bordered(self):
        """M' = [[0, 1^T], [1, 2 K'_SS]] of the current margin set, shape (m + 1, m + 1)."""
        return CS.bordered_matrix(self._S, self._KSt, self._m)

    # ------------------------------------------------------------------ polish and refactorisation
    def _polish(self):
        """Refresh the state of the current partition from scratch.

        A fresh inverse of the bordered matrix and every gradient from the keys (the margin
        gradients then hold the true equality residuals, which ``_rest.correct`` removes by a
        walk that respects the bounds). Used when a step ran on small pivots, whose rounding
        (~eps / pivot) the maintained state inherited. Cost O(m^3 + n |support| d).
        SolverFailure (:meth:`_singular`) when the bordered matrix is singular to working
        precision.
        """
        self._fs[W._MIN_PIVOT] = np.inf
        self._ist[W._SETTLED] = -1  # the refreshed state must be settled in full
        m, n = self._m, self._n
        self.n_polishes += 1
        if m > 0:
            try:
                bordered_inverse(self._bordered(), self._R)
            except np.linalg.LinAlgError as exc:
                raise self._singular(exc) from exc
            self._calibrate_probe()
        self._grad[:n] = self._fresh_gradients()

    def _calibrate_probe(self):
        """Set the probe thresholds from a freshly factorised inverse (``_walk.calibrate_probe``:
        4x its own probe, at least PROBE_TOL and, while a margin key's Schur complement is below
        POLISH_PIVOT, at most PROBE_TOL_MAX; the in-walk refresh's back to
        REFRESH_PROBE_TOL). Without it a large margin set whose fresh inverse already probes
        above PROBE_TOL (1.1e-11 at m = 2048) would polish after every operation without
        improving anything."""
        W.calibrate_probe(self._R, self._m, self._S, self._KSt, self._status, self._n,
                          self._vbuf, self._fs)

    def _refactorize(self):
        """After a failed audit: polish, then restore the canonical resting state."""
        self._polish()
        self._settle()
        self.n_refactorizations += 1

    # ------------------------------------------------------------------ failure handling
    def _held_keys(self, keep):
        """Ids (ascending) and keys, shape (k,) and (k, d), of the held keys that ``keep``
        selects (a function of the ascending ids, returning a boolean mask). A failed walk
        leaves them intact - a walk never touches a key."""
        order = self._order()
        chosen = keep(self._ids[order])
        return self._ids[order][chosen].copy(), self._Xt[:, order[chosen]].T.copy()

    def _snapshot(self):
        """The held state without its keys, margin kernel rows and inverse: what
        :meth:`_restore` puts back when an operation is refused. O(n + m) copies - the
        inverse, O(m^2) to copy and as much as a whole admission at large m, is factorised
        afresh only when it is needed."""
        n, m = self._n, self._m
        return {"d": self._d, "next_id": self._next_id, "ids": self._ids[:n].copy(),
                "alpha": self._alpha[:n].copy(), "grad": self._grad[:n].copy(),
                "status": self._status[:n].copy(), "S": self._S[:m].copy(),
                "fs": self._fs.copy(), "ist": self._ist.copy(),
                "margin_capacity": self._S.shape[0]}

    def _restore(self, snap, ids, keys):
        """Put back, in place, the state of :meth:`_snapshot` (after a refused operation).

        ``ids``, ``keys``: the keys held at the snapshot, ids ascending (:meth:`_held_keys`);
        the warm-up anchor is the origin. Ids, coefficients, gradients, rho, the partition,
        the margin order and the settings are the snapshot's bits; the margin kernel rows are
        recomputed from the keys by the walk's own kernel (the bits it held,
        :func:`_state.fill_kernel_rows`); the inverse of the bordered matrix is factorised
        afresh, as a polish of the same partition does (``n_polishes`` counts it). No walk
        runs, so the restore cannot fail where the operation did.
        """
        n, m = len(snap["ids"]), len(snap["S"])
        self._allocate(d=self._d, cap=max(self._Xt.shape[1], n + 1),
                       mcap=snap["margin_capacity"])
        self._slot_of = {}
        self._d = snap["d"]
        self._next_id = snap["next_id"]
        if n == 0:
            return
        slot_ids = snap["ids"]
        real = slot_ids >= 0
        self._Xt[:, :n] = 0.0  # the anchor (id -1) is the origin
        self._Xt[:, :n][:, real] = keys[np.searchsorted(ids, slot_ids[real])].T
        self._ids[:n] = slot_ids
        self._alpha[:n] = snap["alpha"]
        self._grad[:n] = snap["grad"]
        self._status[:n] = snap["status"]
        self._S[:m] = snap["S"]
        self._spos[:n] = -1
        self._spos[snap["S"]] = np.arange(m)
        self._fs[:] = snap["fs"]
        self._ist[:] = snap["ist"]
        self._slot_of = {int(i): slot for slot, i in enumerate(slot_ids) if i >= 0}
        fill_kernel_rows(self)
        if m > 0:
            bordered_inverse(self._bordered(), self._R)
            self._fs[W._MIN_PIVOT] = np.inf
            self.n_polishes += 1

    def _recover(self, exc, snap, ids, keys):
        """After a refused admission: restore the state held before it (:meth:`_restore` of
        ``snap``; ``ids``, ``keys`` from :meth:`_held_keys`), then raise. The ids of the
        refused admissions are not consumed."""
        self._restore(snap, ids, keys)
        raise SolverFailure(
            f"{exc}; the admission was refused and the solver holds the state it had before "
            f"it ({len(ids)} keys, nothing lost)"
        ) from exc

    def _rebuild(self, ids, keys):
        """Fresh solve of the given keys by the walk, key by key, keeping their ids (the
        deletion fallback's last resort, when the bulk build does not certify). A walk that
        fails raises SolverFailure and leaves a partial state: the caller restores the state
        it held before (:meth:`_restore`)."""
        next_id = self._next_id
        self._reset()
        self._rebuilding = True  # with the default event limit, not a user override
        try:
            for key_id, x in zip(ids, keys, strict=True):
                self._add_checked(x, int(key_id))
        finally:
            self._rebuilding = False
            self._next_id = next_id
        self.n_rebuilds += 1
