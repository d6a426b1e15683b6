"""The store: :class:`ForgettableMemory`, its operations, queries and persistence calls.

The record table, the value codec, the store database and the atomic write live in their own
modules of :mod:`svtoolkit.memory`, as do what a save writes and how a load rebuilds and
verifies a memory (``_persistence``) and what a receipt certifies (``_certificates``); this one
ties them to the exact solver.
"""

from __future__ import annotations

import json
import numbers
import struct
import threading
import time
import warnings

import numpy as np

from .._rules import feasible
from .._validation import as_key, as_keys, check_int, check_positive, check_sigma
from ..exact import IncrementalSVDD, SolverFailure
from . import _atomic, _certificates, _database, _persistence, _table
from ._audit import RollingAudit
from ._codec import check_new_record_id, decode_value, encode_value
from ._errors import BudgetExceededWarning, MemoryFileError, ReceiptError, StaleStateError
from ._receipts import AddResult, AuditReport, DeletionReceipt, ExtendResult, Hit, verify_receipt
from ._signing import check_key

__all__ = ["ForgettableMemory", "Hit", "DEFAULT_MIN_SIMILARITY"]

#: Default support threshold on the kernel similarity k(q, x) (see :meth:`ForgettableMemory.query`).
DEFAULT_MIN_SIMILARITY = 0.5
#: Receipts (``verify=True``) and loads (``verify="auto"``) recompute every gradient from the
#: keys while that costs at most this many multiply-adds (``n |support| d``; ~10 ms on one core);
#: above it they use the maintained certificate (see ``docs/memory.md``, "Verification levels").
FRESH_KKT_WORK = 50_000_000
_UNCHANGED = object()


def _check_budget(budget, C):
    if budget is None:
        return None
    budget = check_int(budget, "budget", min=1)
    if not feasible(budget, C):
        raise ValueError(
            f"budget={budget} with C={C:.6g} gives budget * C < 1: so few records can never "
            "hold the optimum (the memory would stay in warm-up); raise the budget to at "
            "least ceil(1 / C)"
        )
    return int(budget)


def _check_min_similarity(value):
    value = check_positive(value, "min_similarity")
    if value > 1.0:
        raise ValueError(f"min_similarity must be in (0, 1]; got {value}")
    return value


class ForgettableMemory:
    r"""A key-value memory whose deletions are exact and whose evictions are certified.

    Parameters
    ----------
    sigma : float
        RBF kernel width, ``k(a, b) = exp(-||a - b||^2 / sigma^2)``.
    C : float, optional
        Box constraint of the SVDD dual, fixed for the life of the memory.
    nu, n0 : float, int, optional
        Alternative to ``C``: ``C = 1 / (nu * n0)``, computed once at the reference size ``n0``
        and never recomputed as records come and go. Give ``C`` or both ``nu`` and ``n0``.
    budget : int, optional
        Most records to hold. When an :meth:`add` exceeds it, reserve records (coefficient
        exactly 0) are evicted, oldest first, by exact decrement. When the support set alone
        exceeds the budget nothing more is evicted: the memory holds more than ``budget``
        records, :attr:`over_budget` is True and a :class:`BudgetExceededWarning` is issued.
        Needs ``budget * C >= 1`` (otherwise the memory could never be certified).
    min_similarity : float in (0, 1], default 0.5
        Support threshold of :meth:`query`: a record supports a query ``q`` when
        ``k(q, x) >= min_similarity``, i.e. ``||q - x|| <= sigma * sqrt(ln(1 / min_similarity))``.
    metadata : dict, optional
        JSON-serialisable annotations saved with the memory (the command line records the text
        encoder here).
    signing_key : bytes, optional
        Secret key (at least 16 bytes). With it, :meth:`save` signs the store (an HMAC-SHA256
        seal over its state) and every receipt carries a MAC (:func:`verify_receipt`).
        :meth:`load` with ``key=`` gives the loaded memory that key.

    Notes
    -----
    Guarantees (details and scope in ``docs/memory.md``):

    * **Exact deletion.** :meth:`forget` removes the record by exact decrement: the state
      equals a from-scratch solve of the retained records with the same C (checked by
      ``audit=True`` to machine precision). The record's key and value are dropped; only its
      id is kept, as a tombstone, so that a second forget is refused.
    * **No stale answers.** A query is answered only from held records, so a forgotten
      record's value is never returned; when no held record supports the query the answer is
      the empty list ("no record").
    * **Certified eviction.** A reserve record has coefficient exactly 0: evicting it changes
      no coefficient and no hit weight; rho and the decision function stay too, except when
      the margin set is empty (rho is then not unique and the exact decrement reports the
      midpoint of its optimal interval, as a fresh solve does). The certificate covers the
      current records: a later admission can make an evicted record matter again.
    * **Transactions.** Bad input raises before anything changes; every public operation
      (:meth:`save` included, until the file is in place) holds one lock, so concurrent
      readers never see a half-applied operation and concurrent saves land in order.
    * **Files.** The store's unkeyed seal and the state digest detect damage, not deliberate
      tampering (both can be recomputed); see :meth:`load`. A signing key makes the seal an
      HMAC, which does detect tampering by anyone without the key.
    * **Threads.** Every operation holds the memory's lock. Use the return values
      (:meth:`add_record`, :meth:`evict_reserve`, receipts), not :attr:`last_evicted`, when
      several threads share a memory.

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit import ForgettableMemory
    >>> mem = ForgettableMemory(sigma=1.0, C=0.5)
    >>> mem.add([0.0, 0.0], "origin", record_id="o")
    'o'
    >>> mem.add([3.0, 0.0], "east", record_id="e")
    'e'
    >>> [h.value for h in mem.query([2.9, 0.1])]
    ['east']
    >>> receipt = mem.forget("e")
    >>> mem.query([2.9, 0.1])
    []
    """

    def __init__(self, *, sigma, C=None, nu=None, n0=None, budget=None,
                 min_similarity=DEFAULT_MIN_SIMILARITY, metadata=None, signing_key=None):
        sigma = check_sigma(sigma)
        if C is not None:
            if nu is not None or n0 is not None:
                raise ValueError("give either C or nu with n0, not both")
            solver = IncrementalSVDD(C, sigma)
        elif nu is not None and n0 is not None:
            solver = IncrementalSVDD.from_nu(nu, n0, sigma)
        else:
            raise ValueError("give C, or nu together with n0 (C = 1 / (nu * n0))")
        self._budget = _check_budget(budget, solver.C)
        self._min_similarity = _check_min_similarity(min_similarity)
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict; got {type(metadata).__name__}")
        self._metadata_text = encode_value(metadata, "metadata")
        self._signing_key = None if signing_key is None else check_key(signing_key,
                                                                       "signing_key")
        solver.audit_every = 0  # the memory runs the rolling audit instead (_audit.py)
        self._solver = solver
        self._rolling = RollingAudit()
        self._load_verification = None
        self._nu = None if nu is None else float(nu)
        self._n0 = None if n0 is None else int(n0)
        self._lock = threading.RLock()
        self._table = _table.RecordTable()
        self._tombstones = {}  # record_id -> (reason, time)
        self._tombstones_changed = {}  # ids tombstoned or untombstoned since the last write
        self._binding = None  # the store database last read or written (_database.Binding)
        self._next_auto = 0
        self._revision = 0
        self._receipt_chain = None  # head of the store's receipt log (a server's; _receipts)
        self._digest = None
        self._coefficients = None  # cached coefficients hash; None when the solver moved
        self._kkt = None  # (KKT residual, "fresh" | "maintained") of the solver; None: moved
        self._last_evicted = ()

    # ------------------------------------------------------------------ properties
    @property
    def C(self):
        """The box constraint (fixed)."""
        return self._solver.C

    @property
    def sigma(self):
        """The RBF kernel width."""
        return self._solver.sigma

    @property
    def budget(self):
        """Most records to hold (None: unbounded)."""
        return self._budget

    @property
    def min_similarity(self):
        """Default support threshold of :meth:`query`."""
        return self._min_similarity

    @property
    def n_features(self):
        """Key dimension (None before the first record)."""
        return self._table.d

    @property
    def metadata(self):
        """A copy of the metadata dict."""
        return json.loads(self._metadata_text)

    @property
    def certified(self):
        """True when the held keys hold the optimum on their own (n C >= 1)."""
        with self._lock:
            return self._solver.certified

    @property
    def over_budget(self):
        """True when more records are held than the budget (the support set alone exceeds it)."""
        with self._lock:
            return self._budget is not None and len(self._table) > self._budget

    @property
    def revision(self):
        """Number of state-changing operations applied so far (persists across save/load)."""
        return self._revision

    @property
    def load_verification(self):
        """How :meth:`load` verified this memory's solver state: ``"full"``, ``"maintained"``
        or ``"none"`` (``check_kkt=False``); None for a memory not read from a file."""
        return self._load_verification

    @property
    def signed(self):
        """True when the memory has a signing key (signed saves and receipts)."""
        return self._signing_key is not None

    @property
    def last_evicted(self):
        """Record ids evicted by the budget during the last operation (oldest first).

        After an :meth:`add` this can include the id the add just returned. It is one
        attribute of the memory: with several threads it shows the last operation of *any*
        thread. Threads should read the evictions from :meth:`add_record` (or the return
        value of :meth:`evict_reserve`) instead.
        """
        return self._last_evicted

    @property
    def tombstones(self):
        """dict record_id -> (reason, time): records that were forgotten or evicted."""
        with self._lock:
            return dict(self._tombstones)

    @property
    def record_ids(self):
        """Held record ids in insertion order (an edited key moves its record to the end)."""
        with self._lock:
            return self._table.record_ids(self._solver.ids)

    def __len__(self):
        return len(self._table)

    def __contains__(self, record_id):
        """True when ``record_id`` is a held record; False for anything that is not a str."""
        return isinstance(record_id, str) and record_id in self._table

    def __repr__(self):
        return (f"ForgettableMemory(n={len(self)}, C={self.C:.6g}, sigma={self.sigma:.6g}, "
                f"budget={self._budget}, certified={self.certified})")

    def get(self, record_id):
        """The value of a held record (a fresh copy).

        Raises
        ------
        KeyError
            Unknown, forgotten or evicted record id.
        """
        with self._lock:
            _, text = self._lookup(record_id)
            return decode_value(text)

    def key(self, record_id):
        """The key of a held record, ndarray of shape (d,) (a copy)."""
        with self._lock:
            sid, _ = self._lookup(record_id)
            return self._table.key(sid)

    def partition(self):
        """dict with the record ids of the margin, error and reserve sets (insertion order)."""
        with self._lock:
            s = self._solver
            return {name: self._table.record_ids(ids) for name, ids in
                    (("margin", s.margin_ids), ("error", s.error_ids),
                     ("reserve", s.reserve_ids))}

    def support_record_ids(self):
        """Record ids with a nonzero coefficient (margin and error sets), insertion order."""
        with self._lock:
            s = self._solver
            return self._table.record_ids(np.sort(np.concatenate([s.margin_ids, s.error_ids])))

    # ------------------------------------------------------------------ record bookkeeping
    def _lookup(self, record_id):
        if not isinstance(record_id, str):
            raise KeyError(f"record ids are str; got {record_id!r}")
        rec = self._table.get(record_id)
        if rec is None:
            tomb = self._tombstones.get(record_id)
            if tomb is not None:
                reason, when = tomb
                stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
                raise KeyError(f"record {record_id!r} was already {reason} at {stamp}")
            raise KeyError(f"unknown record id {record_id!r}")
        return rec

    def _new_record_id(self, record_id):
        """Validate a caller's id, or pick the next free automatic one; changes nothing.

        Returns
        -------
        record_id : str
        next_auto : int
            The value :attr:`_next_auto` takes once the record is admitted (unchanged for a
            caller's id), committed by the caller only after the admission succeeded.
        """
        if record_id is None:
            return self._free_auto_id(self._next_auto)
        check_new_record_id(record_id)
        if record_id in self._table:
            raise ValueError(f"duplicate record id {record_id!r}: it is already held "
                             "(use edit() to change it)")
        return record_id, self._next_auto

    def _free_auto_id(self, counter):
        """The first automatic id ``r<counter>``, ``r<counter + 1>``, ... neither held nor
        tombstoned, and the counter after it."""
        while True:
            candidate = f"r{counter}"
            counter += 1
            if candidate not in self._table and candidate not in self._tombstones:
                return candidate, counter

    def _drop(self, record_id, reason, when):
        self._table.drop(record_id)
        if reason is not None:
            self._tombstones[record_id] = (reason, when)
            self._tombstone_changed(record_id)

    def _untombstone(self, record_id):
        """A tombstoned id is held again (its tombstone goes)."""
        if self._tombstones.pop(record_id, None) is not None:
            self._tombstone_changed(record_id)

    def _tombstone_changed(self, record_id):
        # in the order of the changes: the store writes new tombstones in the dict's order
        self._tombstones_changed.pop(record_id, None)
        self._tombstones_changed[record_id] = None

    def _changed(self, solver=True):
        """Bookkeeping after a change; when the solver moved, one slice of the rolling audit.

        Returns
        -------
        dict or None
            The rolling audit's slice (:meth:`RollingAudit.step`), None when the solver did
            not change.
        """
        self._revision += 1
        self._digest = None
        if not solver:
            return None
        self._coefficients = None
        self._kkt = None
        self._table.coefficients_changed()
        return self._rolling.step(self._solver)

    # ------------------------------------------------------------------ digest
    def state_digest(self):
        """sha256 (hex) of the exact state.

        Covers, and only covers: C, sigma, the budget, the support threshold
        (``min_similarity``), the key dimension, the number of held records, rho, every held
        record (its id, key bits and canonical value, each length-prefixed, in its insertion
        slot), and the coefficients: their count, the positions (int64, indexes into the
        insertion order of the held records) of the non-zero coefficients, then those
        coefficients' float64 bits, both in insertion order (every other coefficient is
        exactly 0.0, so this fixes every bit of the coefficient vector). Every variable-length
        field is preceded by its length, so two different states never encode to the same
        bytes (the rule of file format versions 2 and 3; version-1 files are checked with the
        version-1 rule when loaded, and report the current digests afterwards).

        It does **not** cover the tombstones, the metadata, ``nu`` and ``n0`` (only the C they
        gave), the revision, the next automatic id, or the solver's derived arrays (gradients,
        margin kernel rows, bordered inverse). Up to sha256 collisions, two memories have the
        same digest exactly when they have the same configuration above and hold the same
        records in the same slots with bit-identical coefficients and rho. A receipt's
        ``digest_after`` can be compared with the digest of a saved file later.

        The digest is an unkeyed hash: it identifies a state, it does not authenticate one.
        Whoever can write a store can recompute the digest (and the unkeyed seal) for
        a state of their choosing; only a digest kept elsewhere (a receipt) detects that.

        Returns
        -------
        str
            64 hex digits.

        Notes
        -----
        The records enter through a two-level hash (per 64 insertion slots, then over the
        blocks), so an operation rehashes only the blocks it touched; the coefficients are
        hashed in full when the solver changed (a value-only edit reuses their hash).
        """
        with self._lock:
            if self._digest is None:
                if self._coefficients is None:
                    self._coefficients = _table.coefficients_hash(self._solver)
                self._digest = _table.state_digest(self._solver, self._table, self._budget,
                                                   self._min_similarity, self._coefficients)
            return self._digest

    # ------------------------------------------------------------------ operations
    def add(self, key, value, *, record_id=None):
        """Store a record by exact increment (:meth:`add_record` also returns the evictions).

        Parameters
        ----------
        key : array_like of shape (d,)
            Finite numbers; d is fixed by the first record.
        value : JSON value
            str, int, float, bool, None, or lists / str-keyed dicts of those (stored as
            canonical JSON; never pickled), nested at most :data:`MAX_VALUE_DEPTH` (64)
            levels and at most :data:`MAX_VALUE_BYTES` (1 MiB) of canonical JSON.
        record_id : str, optional
            A new id, at most :data:`MAX_RECORD_ID_BYTES` (1024) bytes of UTF-8; by default
            ``"r0"``, ``"r1"``, ... (skipping ids in use or forgotten). A forgotten or
            evicted id may be reused.

        Returns
        -------
        str
            The record id. Records evicted by the budget are listed in :attr:`last_evicted`.
            With a budget the new record itself can be among them: reserve records go oldest
            first, so a new reserve record is evicted at once when fewer older records are
            reserve than must go. The returned id is then already tombstoned as "evicted"
            (``record_id in memory`` is False).

        Raises
        ------
        ValueError
            Wrong dimension, NaN/inf in the key, empty, too long or duplicate record id, a
            value nested too deeply or too large, a record id or value with an unpaired
            UTF-16 surrogate (not encodable as UTF-8).
        TypeError
            Non-numeric key, non-str record id, value that is not JSON.
        SolverFailure
            The exact walk failed; the memory is as before (no automatic id is used up).
        """
        return self.add_record(key, value, record_id=record_id).record_id

    def add_record(self, key, value, *, record_id=None):
        """Store a record by exact increment; return its id and what this call evicted.

        The same operation as :meth:`add`. The evictions are returned by the call that caused
        them, so a thread sees its own even when others share the memory (unlike
        :attr:`last_evicted`, which shows the last operation of any thread).

        Parameters
        ----------
        key, value, record_id
            As in :meth:`add`.

        Returns
        -------
        AddResult
            ``(record_id, evicted)``; ``evicted`` can include ``record_id`` (see :meth:`add`).

        Raises
        ------
        ValueError, TypeError, SolverFailure
            As in :meth:`add`; the memory is then unchanged.
        """
        with self._lock:
            key = as_key(key, "key", d=self._table.d)
            value_text = encode_value(value)
            record_id, next_auto = self._new_record_id(record_id)
            # everything that can fail, before the solver
            leaf = _table.record_leaf(record_id, key, value_text)
            sid = self._solver.add(key)  # SolverFailure: state as before, re-raised
            self._table.insert(int(sid), key, record_id, value_text, leaf)
            self._next_auto = next_auto
            self._untombstone(record_id)
            self._changed()
            evicted = self._enforce_budget() if self._budget is not None else ()
            self._last_evicted = evicted
            return AddResult(record_id, evicted)

    def extend(self, keys, values, *, record_ids=None):
        """Store many records by one exact solver call (all or nothing).

        The keys go to :meth:`IncrementalSVDD.extend` in one call (into an empty memory it
        takes the solver's bulk path), so the state is the exact optimum of the held records,
        as after one :meth:`add` per row; the budget is then enforced once.

        Parameters
        ----------
        keys : array_like of shape (k, d)
        values : sequence of k JSON values
        record_ids : sequence of k str, optional
            New ids, distinct and not held; by default the next automatic ids.

        Returns
        -------
        ExtendResult
            ``(record_ids, evicted)``, also for threads (see :meth:`add_record`).

        Raises
        ------
        ValueError, TypeError
            As in :meth:`add` for any row, a length mismatch, or repeated ids. Nothing is
            stored.
        SolverFailure
            A walk failed; the memory is as before.
        """
        with self._lock:
            keys = as_keys(keys, "keys", d=self._table.d)
            values = list(values)
            if len(values) != keys.shape[0]:
                raise ValueError(f"values has {len(values)} entries for {keys.shape[0]} keys")
            if record_ids is not None:
                record_ids = list(record_ids)
                if len(record_ids) != keys.shape[0]:
                    raise ValueError(f"record_ids has {len(record_ids)} entries for "
                                     f"{keys.shape[0]} keys")
            texts = [encode_value(v) for v in values]
            ids, next_auto = self._new_record_ids(record_ids, keys.shape[0])
            leaves = _table.record_leaves(ids, keys, texts)  # ids and texts encode: checked
            sids = self._solver.extend(keys)  # SolverFailure: as before, re-raised
            self._table.insert_many(sids, keys, ids, texts, leaves)
            for rid in ids:
                self._untombstone(rid)
            self._next_auto = next_auto
            self._changed()
            evicted = self._enforce_budget() if self._budget is not None else ()
            self._last_evicted = evicted
            return ExtendResult(tuple(ids), evicted)

    def _new_record_ids(self, record_ids, count):
        """``count`` new ids (validated, distinct) and the next automatic counter."""
        if record_ids is None:
            ids, counter = [], self._next_auto
            for _ in range(count):
                rid, counter = self._free_auto_id(counter)
                ids.append(rid)
            return ids, counter
        for rid in record_ids:
            self._new_record_id(rid)
        if len(set(record_ids)) != len(record_ids):
            raise ValueError("record_ids holds the same id twice")
        return record_ids, self._next_auto

    def _enforce_budget(self):
        excess = len(self._table) - self._budget
        if excess <= 0 or not self._solver.certified:
            return ()
        evicted = self._evict(excess)
        if len(self._table) > self._budget:
            warnings.warn(
                f"the support set holds {len(self._table)} records, more than the budget "
                f"{self._budget}: only reserve records can be evicted with a certificate, so "
                "the memory is over budget (lower nu / raise C, or raise the budget)",
                BudgetExceededWarning, stacklevel=3,
            )
        return evicted

    def _evict(self, count):
        evicted = []
        when = time.time()
        for sid in self._solver.reserve_ids[:count]:
            record_id = self._table.record_id(sid)
            try:
                self._solver.remove(int(sid))
            except SolverFailure as exc:  # the solver still holds the record: stop evicting
                warnings.warn(f"eviction of {record_id!r} stopped: {exc}",
                              BudgetExceededWarning, stacklevel=4)
                break
            self._drop(record_id, "evicted", when)
            evicted.append(record_id)
        if evicted:
            self._changed()
        return tuple(evicted)

    def evict_reserve(self, count=None):
        """Certified eviction on demand: drop reserve records (coefficient exactly 0).

        Oldest first, by exact decrement; ``count`` limits how many (default: all). No
        coefficient and no hit weight changes; nor does the decision function unless the
        margin set is empty (then rho moves to the midpoint of its optimal interval, as in a
        fresh solve). Nothing is evicted during warm-up (nothing is certified then).

        Returns
        -------
        tuple of str
            The evicted record ids (also in :attr:`last_evicted`; tombstoned as "evicted").
        """
        if count is not None and (isinstance(count, bool) or
                                  not isinstance(count, numbers.Integral) or count < 0):
            raise ValueError(f"count must be an integer >= 0 or None; got {count!r}")
        with self._lock:
            if not self._solver.certified:
                self._last_evicted = ()
            else:
                self._last_evicted = self._evict(len(self._table) if count is None
                                                 else int(count))
            return self._last_evicted

    def forget(self, record_id, *, audit=False, verify=True):
        """Delete a record by exact decrement and return a receipt.

        Afterwards the memory equals a from-scratch solve of the retained records with the
        same C; the record's key and value are gone and its id is kept as a tombstone.

        Parameters
        ----------
        record_id : str
        audit : bool, default False
            Also solve the retained records from scratch and report the largest
            decision-function deviation (cost: a full solve).
        verify : bool or {"auto", "full", "maintained"}, default True
            The receipt's KKT residual. ``"full"``: recomputed from the keys (every gradient
            fresh, ``O(n |support| d)``, usually more than the deletion itself);
            ``"maintained"``: evaluated on the maintained gradients (O(n)); ``True`` (the
            same as ``"auto"``): fresh while ``n |support| d`` <= :data:`FRESH_KKT_WORK`, else
            maintained; ``False``: none (``kkt_residual`` None). The receipt's
            ``kkt_source`` says which; its ``rolling_audit`` reports the fresh checks of the
            maintained state this operation ran whatever ``verify`` is.

        Returns
        -------
        DeletionReceipt

        Raises
        ------
        KeyError
            Unknown id, or an id already forgotten or evicted. Nothing changes.
        """
        verify = _certificates.check_verify(verify)
        with self._lock:
            sid, _ = self._lookup(record_id)
            before = self.state_digest()
            removed = self._table.key(sid)
            self._solver.remove(sid)  # SolverFailure: state as before, re-raised
            when = time.time()
            self._drop(record_id, "forgotten", when)
            checked = self._changed()
            self._last_evicted = ()
            return _certificates.receipt(self, "forget", record_id, when, before, [removed],
                                         audit, verify, checked, FRESH_KKT_WORK)

    def edit(self, record_id, *, value=_UNCHANGED, key=None, audit=False, verify=True):
        """Change a record: an exact remove-and-add.

        With a new ``key`` the old key is removed by exact decrement and the new one admitted
        by exact increment (the record moves to the end of the insertion order), so the state
        equals a from-scratch solve of the other records plus the new one. A value-only edit
        leaves the solver untouched (the keys are unchanged) and drops the old value; its
        cost does not grow with the solver: the receipt's KKT residual is the one already
        computed for the unchanged solver state (by an earlier receipt or by :meth:`load`;
        computed once if there is none) and the digest rehashes one record block.

        Parameters
        ----------
        record_id : str
        value : JSON value, optional
            New value (``None`` is a valid JSON value; omit the argument to keep the old one).
        key : array_like of shape (d,), optional
            New key.
        audit, verify : bool
            As in :meth:`forget`.

        Returns
        -------
        DeletionReceipt
            ``operation="edit"``.
        """
        verify = _certificates.check_verify(verify)
        with self._lock:
            sid, old_text = self._lookup(record_id)
            if key is None and value is _UNCHANGED:
                raise ValueError("edit needs a new value, a new key, or both")
            new_key = None if key is None else as_key(key, "key", d=self._table.d)
            new_text = old_text if value is _UNCHANGED else encode_value(value)
            before = self.state_digest()
            old_key = self._table.key(sid)
            # everything that can fail is computed before the state changes
            leaf = _table.record_leaf(record_id, old_key if new_key is None else new_key,
                                      new_text)
            when = time.time()
            if new_key is None:
                self._table.set_value(record_id, new_text, leaf)
                probes = [old_key]
            else:
                self._replace_key(record_id, sid, old_key, old_text, new_key, new_text, leaf)
                probes = [old_key, new_key]
            checked = self._changed(solver=new_key is not None)
            self._last_evicted = ()
            return _certificates.receipt(self, "edit", record_id, when, before, probes, audit,
                                         verify, checked, FRESH_KKT_WORK)

    def _replace_key(self, record_id, sid, old_key, old_text, new_key, new_text, leaf):
        """Exact remove of the old key and add of the new one (the edit's solver part)."""
        self._solver.remove(sid)
        self._drop(record_id, None, None)
        try:
            new_sid = self._solver.add(new_key)
        except SolverFailure as exc:
            restored = self._solver.add(old_key)
            self._table.insert(int(restored), old_key, record_id, old_text,
                               _table.record_leaf(record_id, old_key, old_text))
            self._changed()
            raise SolverFailure(
                f"edit of {record_id!r} failed while admitting the new key ({exc}); "
                "the old key and value were re-admitted at the end of the order"
            ) from exc
        self._table.insert(int(new_sid), new_key, record_id, new_text, leaf)

    # ------------------------------------------------------------------ reading
    def query(self, q, k=1, *, min_similarity=None):
        """The held records nearest to ``q`` that support it.

        A record *supports* ``q`` when its kernel similarity
        ``k(q, x) = exp(-||q - x||^2 / sigma^2)`` is at least ``min_similarity``. The answer
        lists up to ``k`` supporting records by decreasing similarity (ties: older first).
        **An empty list is the "no record" answer**: nothing held supports the query. A
        forgotten or evicted record is never returned, whatever the query.

        Parameters
        ----------
        q : array_like of shape (d,)
        k : int, default 1
        min_similarity : float in (0, 1], optional
            Overrides the memory's threshold for this query.

        Returns
        -------
        list of Hit
        """
        # a plain int skips the abstract-class check (most of a small query's own cost)
        integral = type(k) is int or (isinstance(k, numbers.Integral) and not isinstance(k, bool))
        if not integral or k < 1:
            raise ValueError(f"k must be an integer >= 1; got {k!r}")
        tau = self._min_similarity if min_similarity is None else check_positive(
            min_similarity, "min_similarity")
        if tau > 1.0:
            raise ValueError(f"min_similarity must be in (0, 1]; got {tau}")
        with self._lock:
            table = self._table
            q = as_key(q, "q", d=table.d)
            n = table.n
            if n == 0:
                return []
            table.sync_alpha(self._solver)
            sids, sims, weights = table.nearest(q, int(k), 1.0 / (self.sigma * self.sigma),
                                                tau)
            record_ids, texts = table.records_of(sids)
            return list(map(Hit._make, zip(record_ids, map(decode_value, texts),
                                           weights.tolist(), sims.tolist(), strict=True)))

    def decision_function(self, X):
        """SVDD decision function ``f(x) = 2 sum_i a_i k(x, x_i) - 1 + rho`` of the held keys.

        f > 0 inside the description, 0 on its boundary, < 0 outside.

        Parameters
        ----------
        X : array_like of shape (m, d)

        Returns
        -------
        ndarray of shape (m,)
        """
        with self._lock:
            if not len(self._table):
                raise ValueError("decision_function needs at least one record in the memory")
            return self._solver.decision_function(as_keys(X, "X", d=self._table.d))

    def audit(self, probes=None):
        """Recompute the certificate: KKT residual and deviation from a fresh solve.

        Parameters
        ----------
        probes : array_like of shape (m, d), optional
            Extra points at which to compare the decision functions.

        Returns
        -------
        AuditReport
        """
        with self._lock:
            extra = None if probes is None else as_keys(probes, "probes", d=self._table.d)
            s = self._solver
            self._kkt = (float(s.kkt_residual()), "fresh")  # an audit always recomputes
            return AuditReport(
                n_records=len(self._table),
                n_margin=len(s.margin_ids),
                n_error=len(s.error_ids),
                n_reserve=len(s.reserve_ids),
                certified=s.certified,
                kkt_residual=self._kkt[0],
                fresh_deviation=(_certificates.fresh_deviation(s, extra) if len(self._table)
                                 else None),
                digest=self.state_digest(),
                budget=self._budget,
                over_budget=self.over_budget,
            )

    # ------------------------------------------------------------------ persistence
    def save(self, path, *, key=None):
        """Write the memory to the store database at ``path`` (signed when there is a key).

        **A save to the store this memory was loaded from or last saved to** (while the file
        still holds that state) writes only what changed since, in one SQLite transaction:
        the rows of the records added, edited or dropped, the tombstones made or dropped, the
        blocks of the solver's per-key arrays whose bytes changed (its gradient moves at every
        key: 8 bytes a key), and the header with the new seal. The commit is the commit point:
        a crash before it leaves the previous state (SQLite's rollback journal restores it at
        the next open). **Any other save** (another path, a store another writer changed, a
        single file of an earlier version, which is so converted) writes a whole new database:
        resolve ``path`` (a symlink's target is the file rewritten; the link stays); remove
        temporary files that earlier crashed saves of this store left (they can hold records
        forgotten since); write a temporary file in the same directory, fsync it; rename it
        over the target - the commit point; fsync the directory. Either way a crash leaves
        the previous state or the new one, never a mix, and a forgotten record's key and
        value are in no file of the store once its save is committed (``docs/memory.md``,
        "What a forget erases"). A failed directory fsync after a rename cannot undo it: it is
        a :class:`DurabilityWarning`, not an error. The file is created readable by its owner
        only. Format: ``docs/memory.md``, "Store database" (version :data:`FORMAT_VERSION`;
        no pickle).

        The memory's lock is held until the change is committed, so concurrent saves of one
        memory land in the order of its operations: a save never replaces a store with an
        older state than one already saved by another thread (which would bring back a
        forgotten record). Operations on the memory wait for a save in progress. Processes
        sharing a store must serialise load-change-save with :func:`store_lock` (the command
        line does).

        Parameters
        ----------
        path : str or path-like
        key : bytes, optional
            Signing key (at least 16 bytes); default: the memory's own (``signing_key``,
            or the key it was loaded with). With a key the store's seal is an HMAC-SHA256,
            checked by ``load(path, key=...)``.

        Raises
        ------
        ValueError
            There is no key (neither ``key`` nor the memory's own) and ``path`` is a signed
            store: it would be replaced unsigned. Nothing is written.
        StoreOwnedError
            A running server owns the store (it holds the store's lock); nothing is written.
        OSError
            The store could not be written (before the commit point; nothing changed).

        Warns
        -----
        DurabilityWarning
            A new database is in place but the directory fsync failed.
        """
        key = self._signing_key if key is None else check_key(key)
        with self._lock:
            if key is None and _database.is_signed_store(_atomic.resolve(path)):
                raise ValueError(
                    f"{path} is a signed store: saving this memory without its signing key "
                    "would replace it unsigned (load it with key=..., or pass key= to save); "
                    "nothing was written")
            _persistence.save(self, path, key)

    @classmethod
    def load(cls, path, *, key=None, verify="auto", check_kkt=True):
        """Read a memory written by :meth:`save`, refusing anything that does not verify.

        Checks, in order: the format (a store database of version 3, or a single file of
        version 1 or 2, which loads and converts at the next save); the seal (an unkeyed
        sha256 over the header, the solver's arrays and the tombstones; with a ``key``, the
        HMAC, before anything is parsed; a single file's checksum and MAC); the structure of
        the header and arrays, the solver's internal consistency, the record table, the
        tombstones (known reason, id not held, time a finite number of seconds in [0, year
        9999]) and counters (integers >= 0), the solver's numbers (``verify``), and the state
        digest (which covers the records; by the rule of the file's version). Values are read
        as JSON; nothing is unpickled. A database is read in one transaction (a consistent
        state while a writer commits).

        The solver's numbers are checked at one of two levels. **Full**: the KKT residual
        recomputed from the stored keys (at most :data:`KKT_TOL`) together with the
        maintained gradients, bordered inverse and margin kernel rows against a fresh
        evaluation (:meth:`IncrementalSVDD.consistency`; cost ``O(n |support| d + m n d)``).
        **Maintained**: the KKT residual evaluated on the stored (maintained) gradients (at
        most :data:`KKT_TOL`; O(n)); nothing is recomputed from the keys (the rolling audit
        resumes at the next operation that changes the solver).

        Without a key, the seal detects damage, not deliberate tampering: it is an unkeyed
        sha256, which anyone who can write the file can recompute, and so is the stored
        digest. A store edited with both recomputed is refused only if the edit breaks the
        structure, the KKT conditions (a coefficient or key changed) or the solver's
        consistency; tombstones, metadata, ``nu``/``n0``, the revision and the next automatic
        id are covered by the seal alone (see :meth:`state_digest`). With a key, any
        change by someone without the key is refused. Neither detects a *replayed* older
        file signed with the same key: compare with the newest receipt
        (:meth:`check_receipt`).

        Parameters
        ----------
        path : str or path-like
        key : bytes, optional
            Signing key. The file must then carry a valid HMAC-SHA256; the loaded memory keeps
            the key (its saves and receipts are signed). Without a key a signed file loads
            too, its MAC unchecked.
        verify : {"auto", "full", "maintained"}, default "auto"
            The level of the solver's checks. ``"auto"`` is ``"full"`` for a file loaded
            without a key (there the fresh checks are what refuse a modified coefficient, key
            or solver array whose seal was recomputed) and for any state whose fresh
            evaluation costs at most :data:`FRESH_KKT_WORK`; it is ``"maintained"`` for a
            larger signed file whose MAC verified with ``key`` (nobody without the key can
            have changed a byte of it). ``"maintained"`` on an unsigned file accepts some
            forgeries the full level refuses; use it only for files you wrote yourself.
            :attr:`load_verification` tells which level ran.
        check_kkt : bool, default True
            False skips the solver's numeric checks altogether (``load_verification`` is
            ``"none"``); only for files you wrote yourself.

        Returns
        -------
        ForgettableMemory

        Raises
        ------
        MemoryAuthenticationError
            With a key: the file is not signed, or its MAC does not verify (modified, or
            signed with another key). A subclass of :class:`MemoryFileError`.
        MemoryFileError
            Not a memory store, unsupported version, seal or checksum mismatch, inconsistent or
            malformed contents (including a header that is not a JSON object or is nested too
            deeply), a solver state a fresh evaluation contradicts (KKT residual, gradients,
            inverse, kernel rows), or a digest mismatch. Names the problem.
        OSError
            The file cannot be read.
        """
        key = None if key is None else check_key(key)
        verify = _certificates.check_verify(verify, _certificates.VERIFY_LEVELS)
        try:
            return _persistence.load(cls, path, key, verify if check_kkt else "none",
                                     FRESH_KKT_WORK)
        except MemoryFileError as exc:
            raise type(exc)(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError,
                struct.error) as exc:
            raise MemoryFileError(f"{path}: malformed contents ({type(exc).__name__}: "
                                  f"{exc})") from exc

    def check_receipt(self, receipt):
        """Check that a signed receipt is authentic and that this memory is not older.

        A replayed file (an older file signed with the same key, e.g. one that still holds a
        forgotten record) passes :meth:`load`; against the newest receipt it fails here. The
        memory must be at the receipt's revision with the receipt's ``digest_after``, or at a
        later revision.

        Parameters
        ----------
        receipt : DeletionReceipt or dict
            A receipt of this memory's lineage, or its JSON form.

        Raises
        ------
        ValueError
            The memory has no signing key.
        ReceiptError
            The receipt's MAC does not verify with the memory's key, or it has no revision.
        StaleStateError
            The memory is at a lower revision than the receipt (replayed or rolled back), or
            at the same revision with another state (forked or forged).
        """
        if self._signing_key is None:
            raise ValueError("check_receipt needs a memory with a signing key (load it with "
                             "key=...)")
        if not verify_receipt(receipt, self._signing_key):
            raise ReceiptError("the receipt's MAC does not verify with this memory's key "
                               "(unsigned, altered, or signed with another key)")
        fields = receipt.signed_fields() if isinstance(receipt, DeletionReceipt) else receipt
        self._check_not_older(fields)

    def _check_not_older(self, fields):
        """Refuse this memory when it is older than a receipt's fields (no MAC check here).

        The rule of :meth:`check_receipt`, also applied by the server to an unsigned store
        and the newest receipt of its log.
        """
        revision, digest = fields["revision"], fields["digest_after"]
        if isinstance(revision, bool) or not isinstance(revision, int):
            raise ReceiptError(f"the receipt has no revision (got {revision!r})")
        with self._lock:
            if self._revision < revision:
                raise StaleStateError(
                    f"the memory is at revision {self._revision}, older than the receipt's "
                    f"revision {revision} ({fields['operation']} of "
                    f"{fields['record_id']!r}): the file was replayed or rolled back")
            if self._revision == revision and self.state_digest() != digest:
                raise StaleStateError(
                    f"the memory is at the receipt's revision {revision} but its state digest "
                    "differs from the receipt's digest_after: not the state the receipt "
                    "certifies")
