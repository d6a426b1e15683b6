"""ForgettableMemory: a key-value memory with exact deletion, receipts and certified eviction.

A user-facing store on top of the exact fp64 solver (:class:`svtoolkit.IncrementalSVDD`).
Every record is a key vector (for text, a sentence embedding; see :mod:`svtoolkit.embeddings`)
and a JSON value. The one-class SVM (SVDD) over the keys decides what is certified-redundant
(the reserve set, coefficient exactly 0) and makes deletion exact: after :meth:`forget` the
memory is what it would have been had the record never been added (same C; paper 000 §4-§6).

What is guaranteed, and its scope, is written out in ``docs/memory.md``; the short version is
in the :class:`ForgettableMemory` docstring.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from ._jit import njit
from ._validation import as_key, as_keys, check_positive, check_sigma
from .exact import IncrementalSVDD, SolverFailure

__all__ = [
    "ForgettableMemory",
    "Hit",
    "DeletionReceipt",
    "AuditReport",
    "MemoryFileError",
    "BudgetExceededWarning",
    "FORMAT_VERSION",
    "KKT_TOL",
]

#: Version of the file format written by :meth:`ForgettableMemory.save`.
FORMAT_VERSION = 1
#: First 8 bytes of every memory file.
MAGIC = b"SVTKMEM\x00"
#: :meth:`ForgettableMemory.load` refuses a state whose KKT residual (recomputed from the stored
#: keys) exceeds this. Exact states measure ~1e-13; the solver repairs drift above 1e-10.
KKT_TOL = 1e-8
#: Default support threshold on the kernel similarity k(q, x) (see :meth:`ForgettableMemory.query`).
DEFAULT_MIN_SIMILARITY = 0.5

_HEADER = struct.Struct("<8sIQ")  # magic, format version, header length
_CHECKSUM_BYTES = 32
_ALIGN = 8
#: dtypes a memory file may declare (anything else is refused before any array is built).
_FILE_DTYPES = {"<f8": np.float64, "<i8": np.int64, "|i1": np.int8}
_STATE_TAG = b"svtoolkit.ForgettableMemory/state/v1\x00"
#: Records are hashed in blocks of this many consecutive solver ids (insertion slots), so that
#: an operation rehashes only the blocks it touched (see ``state_digest``).
_BLOCK = 64
_LEAF_TAG = b"svtoolkit.ForgettableMemory/record/v1\x00"
_UNCHANGED = object()


class MemoryFileError(ValueError):
    """A memory file that :meth:`ForgettableMemory.load` refuses.

    Damaged, malformed, internally inconsistent, failing the KKT or digest check, or of another
    version. Not every deliberate edit is caught: see :meth:`ForgettableMemory.load`.
    """


class BudgetExceededWarning(UserWarning):
    """The support set alone exceeds the budget; nothing more can be evicted with a certificate."""


class Hit(NamedTuple):
    """One answer of :meth:`ForgettableMemory.query`.

    Attributes
    ----------
    record_id : str
    value : JSON value
        A fresh copy of the stored value (decoded from its JSON text).
    weight : float
        The record's share of the support-vector readout at the query,
        ``a_i k(q, x_i) / sum_j a_j k(q, x_j)`` over every held record; exactly 0 for a reserve
        (certified-redundant) record.
    score : float
        The kernel similarity ``k(q, x_i) = exp(-||q - x_i||^2 / sigma^2)`` in (0, 1].
    """

    record_id: str
    value: Any
    weight: float
    score: float


@dataclass(frozen=True)
class DeletionReceipt:
    """Evidence of one deletion (:meth:`ForgettableMemory.forget`) or edit.

    Attributes
    ----------
    operation : {"forget", "edit"}
    record_id : str
    time : float
        Seconds since the epoch (UTC) of the operation, taken when it is applied (before the
        receipt's verification and audit); for a forget it is the tombstone's time.
    kkt_residual : float or None
        Largest KKT violation of the state after the operation, recomputed from the keys (in
        units of the decision function); ``None`` when the caller passed ``verify=False``.
    digest_before, digest_after : str
        :meth:`ForgettableMemory.state_digest` before and after (sha256, hex).
    n_records : int
        Records held afterwards.
    certified : bool
        Whether the retained keys hold the optimum on their own (``n C >= 1``); below that the
        solver is in warm-up and nothing is certified.
    audit_deviation : float or None
        With ``audit=True``: ``max |f_memory(p) - f_fresh(p)|`` over the retained keys and the
        removed (and, for an edit, the new) key, where ``f_fresh`` is a solver trained from
        scratch on the retained records with the same C. ``None`` without an audit or when the
        memory is empty afterwards.
    """

    operation: str
    record_id: str
    time: float
    kkt_residual: float | None
    digest_before: str
    digest_after: str
    n_records: int
    certified: bool
    audit_deviation: float | None = None

    def to_dict(self):
        """Plain JSON-serialisable dict (adds ``time_utc`` in ISO 8601)."""
        out = asdict(self)
        out["time_utc"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.time)) + (
            f".{int((self.time % 1) * 1e6):06d}Z"
        )
        return out


@dataclass(frozen=True)
class AuditReport:
    """Result of :meth:`ForgettableMemory.audit`.

    Attributes
    ----------
    n_records, n_margin, n_error, n_reserve : int
        Records held and the sizes of the partition (margin S, error E, reserve R).
    certified : bool
    kkt_residual : float
        Recomputed from the keys.
    fresh_deviation : float or None
        ``max |f_memory - f_fresh|`` over the held keys (and any extra probes), ``f_fresh`` being
        a from-scratch solve of the held records in the same order with the same C; ``None`` for
        an empty memory.
    digest : str
    budget : int or None
    over_budget : bool
    """

    n_records: int
    n_margin: int
    n_error: int
    n_reserve: int
    certified: bool
    kkt_residual: float
    fresh_deviation: float | None
    digest: str
    budget: int | None
    over_budget: bool

    def to_dict(self):
        return asdict(self)


# ---------------------------------------------------------------------------- numba kernels
@njit
def _similarities(keys, n, q, inv_sigma2, out):
    """out[i] = exp(-||keys[i] - q||^2 / sigma^2) for i < n (coordinate-wise, no cancellation)."""
    d = keys.shape[1]
    for i in range(n):
        acc = 0.0
        for t in range(d):
            diff = keys[i, t] - q[t]
            acc += diff * diff
        out[i] = np.exp(-acc * inv_sigma2)


# ---------------------------------------------------------------------------- value encoding
def _encode_value(value, name="value"):
    """Canonical JSON text of a value, refusing anything that would not come back equal.

    Parameters
    ----------
    value : JSON value
    name : str, default "value"
        The argument's name, used in error messages.

    Returns
    -------
    str
        Canonical JSON (sorted keys, no spaces, non-ASCII kept), encodable as UTF-8.

    Raises
    ------
    TypeError
        Not JSON, or does not survive a JSON round trip unchanged.
    ValueError
        Nested too deeply to encode, or a string holds an unpaired UTF-16 surrogate (not
        encodable as UTF-8, so it could be neither hashed nor saved).
    """
    try:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
        same = json.loads(text) == value
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name} must be JSON-serialisable (str, int, float, bool, None, and lists or "
            f"str-keyed dicts of those; no NaN/inf): {exc}"
        ) from exc
    except RecursionError as exc:
        raise ValueError(f"{name} is nested too deeply to encode as JSON") from exc
    if not same:
        raise TypeError(
            f"{name} does not survive a JSON round trip unchanged (tuples become lists, "
            "non-str dict keys become strings); pass the JSON form"
        )
    _check_utf8(text, name)
    return text


def _check_utf8(text, name):
    """Refuse a str that cannot be encoded as UTF-8 (an unpaired surrogate such as '\\ud800')."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} contains an unpaired UTF-16 surrogate ({text[exc.start]!r} at position "
            f"{exc.start}), which is not valid text and cannot be stored as UTF-8"
        ) from None


def _check_record_id(record_id):
    """Return ``record_id`` if it is a non-empty str encodable as UTF-8; raise otherwise."""
    if not isinstance(record_id, str):
        raise TypeError(f"record_id must be a str; got {type(record_id).__name__}")
    if not record_id:
        raise ValueError("record_id must be a non-empty string")
    _check_utf8(record_id, "record_id")
    return record_id


def _leaf(record_id, key, value_text):
    """sha256 of one record: id, key bits (float64 little-endian) and canonical value."""
    rid = record_id.encode("utf-8")
    h = hashlib.sha256(_LEAF_TAG)
    h.update(struct.pack("<I", len(rid)))
    h.update(rid)
    h.update(np.ascontiguousarray(key, dtype="<f8").tobytes())
    h.update(value_text.encode("utf-8"))
    return np.frombuffer(h.digest(), dtype=np.uint8)


# ---------------------------------------------------------------------------- the store
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
    * **Files.** The file checksum and the state digest detect damage, not deliberate
      tampering (both are unkeyed and can be recomputed); see :meth:`load`.

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
                 min_similarity=DEFAULT_MIN_SIMILARITY, metadata=None):
        sigma = check_sigma(sigma)
        if C is not None:
            if nu is not None or n0 is not None:
                raise ValueError("give either C or nu with n0, not both")
            solver = IncrementalSVDD(C, sigma)
        elif nu is not None and n0 is not None:
            solver = IncrementalSVDD.from_nu(nu, n0, sigma)
        else:
            raise ValueError("give C, or nu together with n0 (C = 1 / (nu * n0))")
        self._init_state(solver, nu=nu, n0=n0, budget=budget, min_similarity=min_similarity,
                         metadata=metadata)

    def _init_state(self, solver, *, nu, n0, budget, min_similarity, metadata):
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
                raise TypeError(f"budget must be an int or None; got {type(budget).__name__}")
            if budget < 1:
                raise ValueError(f"budget must be >= 1; got {budget}")
            if budget * solver.C < 1.0 - 1e-12:
                raise ValueError(
                    f"budget={budget} with C={solver.C:.6g} gives budget * C < 1: so few records "
                    "can never hold the optimum (the memory would stay in warm-up); raise the "
                    "budget to at least ceil(1 / C)"
                )
            budget = int(budget)
        min_similarity = check_positive(min_similarity, "min_similarity")
        if min_similarity > 1.0:
            raise ValueError(f"min_similarity must be in (0, 1]; got {min_similarity}")
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict; got {type(metadata).__name__}")
        self._metadata_text = _encode_value(metadata, "metadata")
        self._solver = solver
        self._nu = None if nu is None else float(nu)
        self._n0 = None if n0 is None else int(n0)
        self._budget = budget
        self._min_similarity = float(min_similarity)
        self._lock = threading.RLock()
        # Record table. Rows hold the keys for queries (swap-remove, unordered); everything
        # indexed by solver id ("sid") follows the solver's insertion order.
        self._d = solver.n_features  # None until the first key (a loaded solver knows it)
        self._keys = np.zeros((0, 0))
        self._row_sid = np.zeros(0, dtype=np.int64)
        self._row_alpha = np.zeros(0)
        self._n = 0
        self._row_by_sid = np.zeros(0, dtype=np.int64)
        self._leaf_by_sid = np.zeros((0, 32), dtype=np.uint8)
        self._block_hash = np.zeros((0, 32), dtype=np.uint8)
        self._dirty_blocks = set()
        self._rid_by_sid = {}
        self._records = {}  # record_id -> (sid, value_text)
        self._tombstones = {}  # record_id -> (reason, time)
        self._next_auto = 0
        self._revision = 0
        self._digest = None
        self._alpha_synced = False
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
        return self._d

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
            return self._budget is not None and len(self._records) > self._budget

    @property
    def revision(self):
        """Number of state-changing operations applied so far (persists across save/load)."""
        return self._revision

    @property
    def last_evicted(self):
        """Record ids evicted by the budget during the last operation (oldest first).

        After an :meth:`add` this can include the id the add just returned.
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
            return [self._rid_by_sid[int(s)] for s in self._solver.ids]

    def __len__(self):
        return len(self._records)

    def __contains__(self, record_id):
        """True when ``record_id`` is a held record; False for anything that is not a str."""
        return isinstance(record_id, str) and record_id in self._records

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
            return json.loads(text)

    def key(self, record_id):
        """The key of a held record, ndarray of shape (d,) (a copy)."""
        with self._lock:
            sid, _ = self._lookup(record_id)
            return self._keys[self._row_by_sid[sid]].copy()

    def partition(self):
        """dict with the record ids of the margin, error and reserve sets (insertion order)."""
        with self._lock:
            s = self._solver
            return {name: [self._rid_by_sid[int(i)] for i in ids] for name, ids in
                    (("margin", s.margin_ids), ("error", s.error_ids),
                     ("reserve", s.reserve_ids))}

    def support_record_ids(self):
        """Record ids with a nonzero coefficient (margin and error sets), insertion order."""
        with self._lock:
            s = self._solver
            sids = np.sort(np.concatenate([s.margin_ids, s.error_ids]))
            return [self._rid_by_sid[int(i)] for i in sids]

    # ------------------------------------------------------------------ record table
    def _lookup(self, record_id):
        if not isinstance(record_id, str):
            raise KeyError(f"record ids are str; got {record_id!r}")
        rec = self._records.get(record_id)
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
            counter = self._next_auto
            while True:
                candidate = f"r{counter}"
                counter += 1
                if candidate not in self._records and candidate not in self._tombstones:
                    return candidate, counter
        _check_record_id(record_id)
        if record_id in self._records:
            raise ValueError(f"duplicate record id {record_id!r}: it is already held "
                             "(use edit() to change it)")
        return record_id, self._next_auto

    def _ensure_rows(self, d, sid):
        if self._keys.shape[0] == 0:
            self._d = d
            self._keys = np.zeros((16, d))
            self._row_sid = np.zeros(16, dtype=np.int64)
            self._row_alpha = np.zeros(16)
        if self._n >= self._keys.shape[0]:
            cap = 2 * self._keys.shape[0]
            for name in ("_keys", "_row_sid", "_row_alpha"):
                old = getattr(self, name)
                new = np.zeros((cap,) + old.shape[1:], dtype=old.dtype)
                new[: self._n] = old[: self._n]
                setattr(self, name, new)
        if sid >= self._row_by_sid.shape[0]:
            old_cap = self._row_by_sid.shape[0]
            cap = max(2 * old_cap, sid + 1, _BLOCK)
            cap = -(-cap // _BLOCK) * _BLOCK  # whole blocks only
            rows = np.full(cap, -1, dtype=np.int64)
            rows[:old_cap] = self._row_by_sid
            leaves = np.zeros((cap, 32), dtype=np.uint8)
            leaves[:old_cap] = self._leaf_by_sid
            blocks = np.zeros((cap // _BLOCK, 32), dtype=np.uint8)
            blocks[: self._block_hash.shape[0]] = self._block_hash
            self._row_by_sid, self._leaf_by_sid, self._block_hash = rows, leaves, blocks
            self._dirty_blocks.update(range(old_cap // _BLOCK, cap // _BLOCK))

    def _insert_record(self, sid, key, record_id, value_text, leaf=None):
        if leaf is None:
            leaf = _leaf(record_id, key, value_text)
        self._ensure_rows(key.shape[0], sid)
        row = self._n
        self._keys[row] = key
        self._row_sid[row] = sid
        self._row_by_sid[sid] = row
        self._set_leaf(sid, leaf)
        self._rid_by_sid[sid] = record_id
        self._records[record_id] = (sid, value_text)
        self._n += 1

    def _drop_record(self, record_id, reason, when):
        sid, _ = self._records.pop(record_id)
        row = int(self._row_by_sid[sid])
        last = self._n - 1
        if row != last:
            moved = int(self._row_sid[last])
            self._keys[row] = self._keys[last]
            self._row_sid[row] = moved
            self._row_alpha[row] = self._row_alpha[last]
            self._row_by_sid[moved] = row
        self._row_by_sid[sid] = -1
        self._set_leaf(sid, 0)
        del self._rid_by_sid[sid]
        self._n = last
        if reason is not None:
            self._tombstones[record_id] = (reason, when)

    def _changed(self):
        self._revision += 1
        self._digest = None
        self._alpha_synced = False

    def _sync_alpha(self):
        if not self._alpha_synced:
            if self._n:
                self._row_alpha[self._row_by_sid[self._solver.ids]] = self._solver.alpha
            self._alpha_synced = True

    # ------------------------------------------------------------------ digest
    def _set_leaf(self, sid, leaf):
        self._leaf_by_sid[sid] = leaf
        self._dirty_blocks.add(sid // _BLOCK)

    def _records_root(self):
        """sha256 over the block hashes; a block hashes the leaves of its 64 insertion slots
        (a slot not held contributes 32 zero bytes), up to the block of the last held slot."""
        n_blocks = -(-(int(self._row_sid[: self._n].max()) + 1) // _BLOCK) if self._n else 0
        for b in self._dirty_blocks:
            block = self._leaf_by_sid[b * _BLOCK:(b + 1) * _BLOCK]
            self._block_hash[b] = np.frombuffer(hashlib.sha256(block.tobytes()).digest(),
                                                dtype=np.uint8)
        self._dirty_blocks.clear()
        return hashlib.sha256(self._block_hash[:n_blocks].tobytes()).digest()

    def state_digest(self):
        """sha256 (hex) of the exact state.

        Covers, and only covers: C, sigma, the budget, the support threshold
        (``min_similarity``), the number of held records, rho, every held record (its id, key
        bits and canonical value, in its insertion slot), and the coefficients: the positions
        (int64, indexes into the insertion order of the held records) of the non-zero
        coefficients, then those coefficients' float64 bits, both in insertion order (every
        other coefficient is exactly 0.0, so this fixes every bit of the coefficient vector).

        It does **not** cover the tombstones, the metadata, ``nu`` and ``n0`` (only the C they
        gave), the revision, the next automatic id, or the solver's derived arrays (gradients,
        margin kernel rows, bordered inverse). Up to sha256 collisions, two memories have the
        same digest exactly when they have the same configuration above and hold the same
        records in the same slots with bit-identical coefficients and rho. A receipt's
        ``digest_after`` can be compared with the digest of a saved file later.

        The digest is an unkeyed hash: it identifies a state, it does not authenticate one.
        Whoever can write a memory file can recompute the digest (and the file checksum) for
        a state of their choosing; only a digest kept elsewhere (a receipt) detects that.

        Returns
        -------
        str
            64 hex digits.

        Notes
        -----
        The records enter through a two-level hash (per 64 insertion slots, then over the
        blocks), so an operation rehashes only the blocks it touched; the coefficients are
        hashed in full.
        """
        with self._lock:
            if self._digest is None:
                s = self._solver
                h = hashlib.sha256(_STATE_TAG)
                h.update(struct.pack("<ddqdqd", s.C, s.sigma,
                                     -1 if self._budget is None else self._budget,
                                     self._min_similarity, len(self._records), s.rho))
                h.update(self._records_root())
                # the coefficients by their support: reserve records are exactly 0.0, so the
                # non-zero positions and values fix every bit of alpha (and hash ~3x less)
                alpha = s.alpha
                support = (alpha != 0.0).nonzero()[0]  # 2x faster than flatnonzero on floats
                h.update(np.ascontiguousarray(support, dtype="<i8").tobytes())
                h.update(np.ascontiguousarray(alpha[support], dtype="<f8").tobytes())
                self._digest = h.hexdigest()
            return self._digest

    # ------------------------------------------------------------------ operations
    def add(self, key, value, *, record_id=None):
        """Store a record by exact increment.

        Parameters
        ----------
        key : array_like of shape (d,)
            Finite numbers; d is fixed by the first record.
        value : JSON value
            str, int, float, bool, None, or lists / str-keyed dicts of those (stored as
            canonical JSON; never pickled).
        record_id : str, optional
            A new id; by default ``"r0"``, ``"r1"``, ... (skipping ids in use or forgotten).
            A forgotten or evicted id may be reused.

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
            Wrong dimension, NaN/inf in the key, empty or duplicate record id, a record id or
            value with an unpaired UTF-16 surrogate (not encodable as UTF-8).
        TypeError
            Non-numeric key, non-str record id, value that is not JSON.
        SolverFailure
            The exact walk failed; the memory is as before (no automatic id is used up).
        """
        with self._lock:
            key = as_key(key, "key", d=self._d)
            value_text = _encode_value(value)
            record_id, next_auto = self._new_record_id(record_id)
            leaf = _leaf(record_id, key, value_text)  # everything that can fail, before the solver
            sid = self._solver.add(key)  # SolverFailure: rebuilt without the key, re-raised
            self._insert_record(int(sid), key, record_id, value_text, leaf)
            self._next_auto = next_auto
            self._tombstones.pop(record_id, None)
            self._changed()
            self._last_evicted = self._enforce_budget() if self._budget is not None else ()
            return record_id

    def _enforce_budget(self):
        excess = len(self._records) - self._budget
        if excess <= 0 or not self._solver.certified:
            return ()
        evicted = self._evict(excess)
        if len(self._records) > self._budget:
            warnings.warn(
                f"the support set holds {len(self._records)} records, more than the budget "
                f"{self._budget}: only reserve records can be evicted with a certificate, so "
                "the memory is over budget (lower nu / raise C, or raise the budget)",
                BudgetExceededWarning, stacklevel=3,
            )
        return evicted

    def _evict(self, count):
        evicted = []
        when = time.time()
        for sid in self._solver.reserve_ids[:count]:
            record_id = self._rid_by_sid[int(sid)]
            try:
                self._solver.remove(int(sid))
            except SolverFailure as exc:  # the solver still holds the record: stop evicting
                warnings.warn(f"eviction of {record_id!r} stopped: {exc}",
                              BudgetExceededWarning, stacklevel=4)
                break
            self._drop_record(record_id, "evicted", when)
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
                self._last_evicted = self._evict(len(self._records) if count is None
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
        verify : bool, default True
            Recompute the KKT residual from the keys (cost O(n |support| d), usually more than
            the deletion itself). With False the receipt's ``kkt_residual`` is None.

        Returns
        -------
        DeletionReceipt

        Raises
        ------
        KeyError
            Unknown id, or an id already forgotten or evicted. Nothing changes.
        """
        with self._lock:
            sid, _ = self._lookup(record_id)
            before = self.state_digest()
            removed = self._keys[self._row_by_sid[sid]].copy()
            self._solver.remove(sid)  # SolverFailure: state as before, re-raised
            when = time.time()
            self._drop_record(record_id, "forgotten", when)
            self._changed()
            self._last_evicted = ()
            return self._receipt("forget", record_id, when, before, [removed], audit, verify)

    def edit(self, record_id, *, value=_UNCHANGED, key=None, audit=False, verify=True):
        """Change a record: an exact remove-and-add.

        With a new ``key`` the old key is removed by exact decrement and the new one admitted
        by exact increment (the record moves to the end of the insertion order), so the state
        equals a from-scratch solve of the other records plus the new one. A value-only edit
        leaves the solver untouched (the keys are unchanged) and drops the old value.

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
        with self._lock:
            sid, old_text = self._lookup(record_id)
            if key is None and value is _UNCHANGED:
                raise ValueError("edit needs a new value, a new key, or both")
            new_key = None if key is None else as_key(key, "key", d=self._d)
            new_text = old_text if value is _UNCHANGED else _encode_value(value)
            before = self.state_digest()
            old_key = self._keys[self._row_by_sid[sid]].copy()
            # everything that can fail is computed before the state changes
            leaf = _leaf(record_id, old_key if new_key is None else new_key, new_text)
            when = time.time()
            if new_key is None:
                self._records[record_id] = (sid, new_text)
                self._set_leaf(sid, leaf)
                probes = [old_key]
            else:
                self._replace_key(record_id, sid, old_key, old_text, new_key, new_text, leaf)
                probes = [old_key, new_key]
            self._changed()
            self._last_evicted = ()
            return self._receipt("edit", record_id, when, before, probes, audit, verify)

    def _replace_key(self, record_id, sid, old_key, old_text, new_key, new_text, leaf):
        """Exact remove of the old key and add of the new one (the edit's solver part)."""
        self._solver.remove(sid)
        self._drop_record(record_id, None, None)
        try:
            new_sid = self._solver.add(new_key)
        except SolverFailure as exc:
            restored = self._solver.add(old_key)
            self._insert_record(int(restored), old_key, record_id, old_text)
            self._changed()
            raise SolverFailure(
                f"edit of {record_id!r} failed while admitting the new key ({exc}); "
                "the old key and value were re-admitted at the end of the order"
            ) from exc
        self._insert_record(int(new_sid), new_key, record_id, new_text, leaf)

    def _receipt(self, operation, record_id, when, before, probes, audit, verify):
        deviation = None
        if audit and self._n:
            deviation = self._fresh_deviation(np.vstack(probes))
        return DeletionReceipt(
            operation=operation,
            record_id=record_id,
            time=when,
            kkt_residual=float(self._solver.kkt_residual()) if verify else None,
            digest_before=before,
            digest_after=self.state_digest(),
            n_records=len(self._records),
            certified=self._solver.certified,
            audit_deviation=deviation,
        )

    def _fresh_deviation(self, extra_probes=None):
        keys = self._solver.keys
        fresh = IncrementalSVDD(self._solver.C, self._solver.sigma)
        fresh.extend(keys)
        probes = keys if extra_probes is None else np.vstack([keys, extra_probes])
        return float(np.max(np.abs(self._solver.decision_function(probes)
                                   - fresh.decision_function(probes))))

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
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"k must be an integer >= 1; got {k!r}")
        tau = self._min_similarity if min_similarity is None else check_positive(
            min_similarity, "min_similarity")
        if tau > 1.0:
            raise ValueError(f"min_similarity must be in (0, 1]; got {tau}")
        with self._lock:
            q = as_key(q, "q", d=self._d)
            n = self._n
            if n == 0:
                return []
            self._sync_alpha()
            sims = np.empty(n)
            _similarities(self._keys, n, q, 1.0 / (self.sigma * self.sigma), sims)
            rows = np.flatnonzero(sims >= tau)
            if rows.size == 0:
                return []
            gated = self._row_alpha[:n] * sims
            total = float(gated.sum())
            order = np.lexsort((self._row_sid[rows], -sims[rows]))[: int(k)]
            hits = []
            for row in rows[order]:
                sid = int(self._row_sid[row])
                record_id = self._rid_by_sid[sid]
                hits.append(Hit(record_id, json.loads(self._records[record_id][1]),
                                float(gated[row] / total) if total > 0.0 else 0.0,
                                float(sims[row])))
            return hits

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
            if not self._records:
                raise ValueError("decision_function needs at least one record in the memory")
            return self._solver.decision_function(as_keys(X, "X", d=self._d))

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
            extra = None if probes is None else as_keys(probes, "probes", d=self._d)
            s = self._solver
            return AuditReport(
                n_records=len(self._records),
                n_margin=len(s.margin_ids),
                n_error=len(s.error_ids),
                n_reserve=len(s.reserve_ids),
                certified=s.certified,
                kkt_residual=float(s.kkt_residual()),
                fresh_deviation=self._fresh_deviation(extra) if self._records else None,
                digest=self.state_digest(),
                budget=self._budget,
                over_budget=self.over_budget,
            )

    # ------------------------------------------------------------------ persistence
    def save(self, path):
        """Write the memory to ``path`` atomically.

        A temporary file in the same directory is written, flushed and fsynced, renamed over
        ``path`` and the directory is fsynced: a crash at any point leaves either the previous
        file or the new one, never a mix (a crash can leave a stale hidden ``.NAME.*.tmp``
        file, which is never read). The file is created readable by its owner only. Format:
        ``docs/memory.md`` (version :data:`FORMAT_VERSION`, sha256 checksum, no pickle).

        The memory's lock is held until the file is in place, so concurrent saves of one
        memory land in the order of its operations: a save never replaces a file with an
        older state than one already saved by another thread (which would bring back a
        forgotten record). Operations on the memory wait for a save in progress.

        Parameters
        ----------
        path : str or path-like
        """
        with self._lock:
            _atomic_write(os.fspath(path), self._serialize())

    def _serialize(self):
        state = self._solver.state_dict()
        arrays, scalars, offset = [], {}, 0
        blobs = []
        for name, val in state.items():
            if isinstance(val, np.ndarray):
                a = np.ascontiguousarray(val, dtype=val.dtype.newbyteorder("<"))
                pad = (-offset) % _ALIGN
                offset += pad
                blobs.append(b"\x00" * pad)
                arrays.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                               "offset": offset, "nbytes": a.nbytes})
                blobs.append(a.tobytes())
                offset += a.nbytes
            else:
                scalars[name] = val
        records = [[self._rid_by_sid[int(s)], int(s), self._records[self._rid_by_sid[int(s)]][1]]
                   for s in self._solver.ids]
        header = {
            "format": "svtoolkit.ForgettableMemory",
            "format_version": FORMAT_VERSION,
            "config": {"C": self.C, "sigma": self.sigma, "nu": self._nu, "n0": self._n0,
                       "budget": self._budget, "min_similarity": self._min_similarity},
            "metadata_json": self._metadata_text,
            "records": records,
            "tombstones": [[rid, reason, when] for rid, (reason, when) in
                           self._tombstones.items()],
            "next_auto": self._next_auto,
            "revision": self._revision,
            "digest": self.state_digest(),
            "solver_scalars": scalars,
            "arrays": arrays,
        }
        text = json.dumps(header, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")
        return [_HEADER.pack(MAGIC, FORMAT_VERSION, len(text)), text, *blobs]

    @classmethod
    def load(cls, path, *, check_kkt=True):
        """Read a memory written by :meth:`save`, refusing anything that does not verify.

        Checks, in order: the magic bytes and the format version, the sha256 checksum of the
        whole file, the structure of the header and arrays, the solver's internal consistency,
        the record table, the tombstones (known reason, id not held, time a finite number of
        seconds in [0, year 9999]) and counters (integers >= 0), the KKT residual recomputed
        from the stored keys (at most :data:`KKT_TOL`) together with the maintained gradients,
        bordered inverse and margin kernel rows against a fresh evaluation
        (:meth:`IncrementalSVDD.consistency`; cost O(n |support| d + m n d)), and the state
        digest. Values are read as JSON; nothing is unpickled.

        The checksum detects damage, not deliberate tampering: it is an unkeyed sha256, which
        anyone who can write the file can recompute, and so is the stored digest. A file
        edited with both recomputed is refused only if the edit breaks the structure, the
        KKT conditions (a coefficient or key changed) or the solver's consistency;
        tombstones, metadata, ``nu``/``n0``, the revision and the next automatic id are
        covered by the checksum alone (see :meth:`state_digest`).

        Parameters
        ----------
        path : str or path-like
        check_kkt : bool, default True
            Recompute the KKT residual and compare the solver's maintained quantities
            (gradients, bordered inverse, margin kernel rows) with a fresh evaluation from the
            keys - the checks that catch a modified coefficient, key or solver array whose
            checksum was recomputed, and that keep later deletions exact. Only skip it for
            files you wrote yourself.

        Returns
        -------
        ForgettableMemory

        Raises
        ------
        MemoryFileError
            Not a memory file, unsupported version, checksum mismatch, inconsistent or
            malformed contents (including a header that is not a JSON object or is nested too
            deeply), a solver state a fresh evaluation contradicts (KKT residual, gradients,
            inverse, kernel rows), or a digest mismatch. Names the problem.
        OSError
            The file cannot be read.
        """
        data = _read_file(path)
        if len(data) < _HEADER.size + _CHECKSUM_BYTES:
            raise MemoryFileError(f"{path}: too short to be a memory file ({len(data)} bytes)")
        magic, version, header_len = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise MemoryFileError(f"{path}: not an svtoolkit memory file (bad magic bytes)")
        if version != FORMAT_VERSION:
            raise MemoryFileError(
                f"{path}: unsupported format version {version}; this svtoolkit reads version "
                f"{FORMAT_VERSION}"
            )
        body = memoryview(data)[:-_CHECKSUM_BYTES]
        if hashlib.sha256(body).digest() != bytes(data[-_CHECKSUM_BYTES:]):
            raise MemoryFileError(f"{path}: checksum mismatch: the file is damaged or was "
                                  "modified after it was written")
        try:
            return cls._from_payload(body, header_len, check_kkt)
        except MemoryFileError as exc:
            raise MemoryFileError(f"{path}: {exc}") from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RecursionError,
                struct.error) as exc:
            raise MemoryFileError(f"{path}: malformed contents ({type(exc).__name__}: "
                                  f"{exc})") from exc

    @classmethod
    def _from_payload(cls, body, header_len, check_kkt):
        start = _HEADER.size
        if start + header_len > len(body):
            raise MemoryFileError("header length runs past the end of the file")
        header = _parse_header(bytes(body[start:start + header_len]))
        base = start + header_len
        state = dict(header["solver_scalars"])
        for spec in header["arrays"]:
            dtype = _FILE_DTYPES.get(spec["dtype"])
            if dtype is None:
                raise MemoryFileError(f"array {spec['name']!r} has refused dtype "
                                      f"{spec['dtype']!r}")
            shape = tuple(int(s) for s in spec["shape"])
            lo, nbytes = base + int(spec["offset"]), int(spec["nbytes"])
            if lo < base or lo + nbytes > len(body) or nbytes != math.prod(shape) * \
                    np.dtype(dtype).itemsize:
                raise MemoryFileError(f"array {spec['name']!r} does not fit its declared "
                                      "shape and offset")
            state[spec["name"]] = np.frombuffer(body[lo:lo + nbytes], dtype=dtype).reshape(
                shape).copy()
        try:
            solver = IncrementalSVDD.from_state_dict(state)
        except ValueError as exc:
            raise MemoryFileError(f"inconsistent solver state: {exc}") from exc
        config = header["config"]
        if config["C"] != solver.C or config["sigma"] != solver.sigma:
            raise MemoryFileError("configuration disagrees with the solver state (C, sigma)")
        mem = cls.__new__(cls)
        mem._init_state(solver, nu=config["nu"], n0=config["n0"], budget=config["budget"],
                        min_similarity=config["min_similarity"],
                        metadata=json.loads(header["metadata_json"]))
        ids = solver.ids
        records = header["records"]
        if [int(r[1]) for r in records] != ids.tolist():
            raise MemoryFileError("record table does not match the solver's keys")
        keys = solver.keys
        for (record_id, sid, text), key in zip(records, keys, strict=True):
            _check_record_id(record_id)
            if record_id in mem._records:
                raise MemoryFileError(f"record id {record_id!r} appears twice")
            if _encode_value(json.loads(text)) != text:
                raise MemoryFileError(f"value of {record_id!r} is not canonical JSON")
            mem._insert_record(int(sid), key, record_id, text)
        mem._tombstones = _parse_tombstones(header["tombstones"], mem._records)
        mem._next_auto = _parse_counter(header, "next_auto")
        mem._revision = _parse_counter(header, "revision")
        if check_kkt:
            _check_solver_numbers(solver.consistency())
        if mem.state_digest() != header["digest"]:
            raise MemoryFileError("state digest mismatch: the records differ from what was "
                                  "saved")
        return mem


# ---------------------------------------------------------------------------- file helpers
#: What a loaded solver's maintained quantities may differ from a fresh evaluation by (see
#: :meth:`IncrementalSVDD.consistency`): gradients as much as the KKT residual; the bordered
#: inverse's ||R M - I|| by what an ill-conditioned margin set legitimately shows (~1e-8) with
#: room to spare; kernel rows by a few ulps (another machine's exp).
_LOAD_LIMITS = {"kkt_residual": KKT_TOL, "grad_drift": KKT_TOL, "margin_rows_drift": 1e-12,
                "inverse_residual": 1e-6}  # rows before the inverse: M is built from them
_LOAD_MEANING = {
    "kkt_residual": "the stored coefficients are not the optimum of the stored keys",
    "grad_drift": "the stored gradients disagree with the keys and coefficients",
    "inverse_residual": "the stored bordered inverse is not the inverse of the margin system",
    "margin_rows_drift": "the stored margin kernel rows disagree with the keys",
}


def _check_solver_numbers(found):
    """Refuse a loaded state whose numbers a fresh evaluation contradicts (names which)."""
    for name, limit in _LOAD_LIMITS.items():
        if not found[name] <= limit:
            raise MemoryFileError(f"{name.replace('_', ' ')} {found[name]:.3g} exceeds "
                                  f"{limit:g}: {_LOAD_MEANING[name]} (tampered or corrupted)")


#: Latest tombstone time a file may hold: 9999-12-31T23:59:59Z (``time.gmtime`` formats it).
_MAX_TIME = 253402300799.0
_REASONS = ("forgotten", "evicted")


def _parse_header(raw):
    """The header dict of a memory file, refusing anything but a version-1 JSON object."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise MemoryFileError("header is not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise MemoryFileError(f"header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MemoryFileError(f"header is a JSON {type(header).__name__}, not an object")
    if header.get("format") != "svtoolkit.ForgettableMemory" or \
            header.get("format_version") != FORMAT_VERSION:
        raise MemoryFileError("header does not describe a version-1 memory")
    return header


def _parse_counter(header, name):
    """A header counter (``next_auto``, ``revision``): an integer >= 0."""
    value = header[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MemoryFileError(f"{name} must be an integer >= 0; got {value!r}")
    return value


def _parse_tombstones(entries, held):
    """dict record_id -> (reason, time) from the header's tombstone list, each checked.

    Parameters
    ----------
    entries : list
        ``[record_id, reason, time]`` triples as saved.
    held : dict
        The held records (a tombstoned id must not be held).

    Raises
    ------
    MemoryFileError
        Not a list of triples, an unknown reason, an id held or listed twice, or a time that
        is not a finite number of seconds in ``[0, _MAX_TIME]``.
    TypeError, ValueError
        An invalid record id (reported by ``load`` as malformed contents).
    """
    if not isinstance(entries, list):
        raise MemoryFileError("tombstones must be a list")
    out = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 3:
            raise MemoryFileError(f"tombstone {i} is not a [record_id, reason, time] triple")
        record_id, reason, when = entry
        _check_record_id(record_id)
        if reason not in _REASONS:
            raise MemoryFileError(f"unknown tombstone reason {reason!r}")
        if record_id in held:
            raise MemoryFileError(f"record {record_id!r} is both held and tombstoned")
        if record_id in out:
            raise MemoryFileError(f"record {record_id!r} is tombstoned twice")
        out[record_id] = (reason, _tombstone_time(record_id, when))
    return out


def _tombstone_time(record_id, when):
    if isinstance(when, bool) or not isinstance(when, (int, float)) or \
            not 0.0 <= when <= _MAX_TIME:
        raise MemoryFileError(
            f"tombstone of {record_id!r} has time {when!r}: expected a finite number of "
            f"seconds since the epoch in [0, {_MAX_TIME:.0f}]"
        )
    return float(when)

def _read_file(path):
    with open(path, "rb") as fh:
        return fh.read()


def _write_chunk(fh, chunk, hasher):
    """One write of the save path (a seam for the crash-injection tests)."""
    hasher.update(chunk)
    fh.write(chunk)


def _fsync_directory(directory):
    if os.name != "posix":  # pragma: no cover - Windows has no directory fsync
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, chunks):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            hasher = hashlib.sha256()
            for chunk in chunks:
                _write_chunk(fh, chunk, hasher)
            fh.write(hasher.digest())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)
