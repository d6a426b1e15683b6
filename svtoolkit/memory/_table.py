"""The record table of a memory and its incrementally maintained digest.

Rows hold the keys for queries (swap-remove, unordered) with their squared norms, kept as
rows come and go, for the nearest-record search (:meth:`RecordTable.nearest`); everything
indexed by solver id ("sid", the insertion slot) follows the solver's insertion order. Each
held record has a leaf hash in its slot; leaves are hashed in blocks of :data:`BLOCK` slots,
and only the blocks an operation touched are rehashed (see :func:`state_digest`).
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np

from . import _search

__all__ = ["RecordTable", "record_leaf", "record_leaves", "coefficients_hash", "state_digest",
           "state_digest_v1", "BLOCK"]

#: Records are hashed in blocks of this many consecutive solver ids (insertion slots), so that
#: an operation rehashes only the blocks it touched.
BLOCK = 64
_STATE_TAG = b"svtoolkit.ForgettableMemory/state/v2\x00"
_LEAF_TAG = b"svtoolkit.ForgettableMemory/record/v2\x00"
_COEF_TAG = b"svtoolkit.ForgettableMemory/coefficients/v2\x00"
# version 1 (files of format version 1 are verified with it; nothing new is hashed with it)
_STATE_TAG_V1 = b"svtoolkit.ForgettableMemory/state/v1\x00"
_LEAF_TAG_V1 = b"svtoolkit.ForgettableMemory/record/v1\x00"
_U64 = struct.Struct("<Q")


def record_leaf(record_id, key, value_text):
    """sha256 of one record, every field length-prefixed (uint64 little-endian).

    ``tag, len(id), id (UTF-8), d, key (d float64 little-endian), len(value), value (UTF-8
    canonical JSON)``: no two different records encode to the same bytes.

    Returns
    -------
    ndarray of shape (32,), uint8
    """
    rid = record_id.encode("utf-8")
    value = value_text.encode("utf-8")
    key = np.ascontiguousarray(key, dtype="<f8")
    h = hashlib.sha256(_LEAF_TAG)
    h.update(_U64.pack(len(rid)))
    h.update(rid)
    h.update(_U64.pack(key.shape[0]))
    h.update(key.tobytes())
    h.update(_U64.pack(len(value)))
    h.update(value)
    return np.frombuffer(h.digest(), dtype=np.uint8)


def record_leaves(record_ids, keys, value_texts):
    """:func:`record_leaf` of many records at once (the same bytes hashed).

    Parameters
    ----------
    record_ids : list of str
    keys : ndarray of shape (n, d)
    value_texts : list of str

    Returns
    -------
    ndarray of shape (n, 32), uint8

    Raises
    ------
    UnicodeEncodeError
        An id or value that is not encodable as UTF-8.
    """
    n = len(record_ids)
    d = keys.shape[1] if keys.ndim == 2 else 0
    raw = np.ascontiguousarray(keys, dtype="<f8").tobytes()
    width, dim = 8 * d, _U64.pack(d)
    pack, sha256, out = _U64.pack, hashlib.sha256, bytearray(32 * n)
    for i, (record_id, text) in enumerate(zip(record_ids, value_texts, strict=True)):
        rid, value = record_id.encode("utf-8"), text.encode("utf-8")
        out[32 * i:32 * i + 32] = sha256(b"".join((
            _LEAF_TAG, pack(len(rid)), rid, dim, raw[width * i:width * i + width],
            pack(len(value)), value))).digest()
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(n, 32)


def _record_leaf_v1(record_id, key, value_text):
    """The version-1 leaf (no key length, no value length): for reading old files only."""
    rid = record_id.encode("utf-8")
    h = hashlib.sha256(_LEAF_TAG_V1)
    h.update(struct.pack("<I", len(rid)))
    h.update(rid)
    h.update(np.ascontiguousarray(key, dtype="<f8").tobytes())
    h.update(value_text.encode("utf-8"))
    return np.frombuffer(h.digest(), dtype=np.uint8)


class RecordTable:
    """Held records: id, solver id, key row and canonical value text, with leaf hashes.

    Parameters
    ----------
    d : int or None
        Key dimension (None until the first key).
    """

    def __init__(self, d=None):
        self.d = d
        self.n = 0
        self.keys = np.zeros((0, 0))  # rows [:n] hold the keys (unordered)
        self.row_sqnorm = np.zeros(0)  # row_sqnorm[i] = keys[i] . keys[i]
        self._sqnorm_max = 0.0  # >= every held row_sqnorm (exact unless _sqnorm_stale)
        self._sqnorm_stale = False
        self.row_sid = np.zeros(0, dtype=np.int64)
        self.row_alpha = np.zeros(0)
        self.support_rows = np.zeros(0, dtype=np.int64)  # rows with row_alpha != 0
        self.support_alpha = np.zeros(0)  # row_alpha[support_rows]
        self._row_by_sid = np.zeros(0, dtype=np.int64)
        self._leaf_by_sid = np.zeros((0, 32), dtype=np.uint8)
        self._block_hash = np.zeros((0, 32), dtype=np.uint8)
        self._dirty_blocks = set()
        self.changed_sids = set()  # slots added, dropped or edited since the last store write
        self._rid_by_sid = {}
        self._records = {}  # record_id -> (sid, value_text)
        self._alpha_synced = False

    # ------------------------------------------------------------------ reading
    def __len__(self):
        return len(self._records)

    def __contains__(self, record_id):
        return record_id in self._records

    def get(self, record_id):
        """``(sid, value_text)`` of a held record, or None."""
        return self._records.get(record_id)

    def record_id(self, sid):
        """The record id held in solver slot ``sid``."""
        return self._rid_by_sid[int(sid)]

    def record_ids(self, sids):
        """Record ids of the solver ids ``sids`` (same order)."""
        return [self._rid_by_sid[int(s)] for s in sids]

    def records_of(self, sids):
        """Record ids and value texts (two lists) of the records in solver slots ``sids``
        (ndarray of int)."""
        record_ids = list(map(self._rid_by_sid.__getitem__, sids.tolist()))
        records = self._records
        return record_ids, [records[rid][1] for rid in record_ids]

    def key(self, sid):
        """Key of the record in slot ``sid``, ndarray of shape (d,) (a copy)."""
        return self.keys[self._row_by_sid[sid]].copy()

    def row(self, sid):
        """``(record_id, key, value_text)`` of the record in slot ``sid``, or None when the
        slot holds none (the store database's row of that slot)."""
        record_id = self._rid_by_sid.get(int(sid))
        if record_id is None:
            return None
        return record_id, self.keys[self._row_by_sid[sid]], self._records[record_id][1]

    # ------------------------------------------------------------------ changes
    def insert(self, sid, key, record_id, value_text, leaf):
        """Hold a new record in solver slot ``sid`` (``leaf``: its :func:`record_leaf`)."""
        self._ensure_rows(key.shape[0], sid)
        row = self.n
        self.keys[row] = key
        sqnorm = float(key @ key)
        self.row_sqnorm[row] = sqnorm
        self._sqnorm_max = max(self._sqnorm_max, sqnorm)
        self.row_sid[row] = sid
        self._row_by_sid[sid] = row
        self._set_leaf(sid, leaf)
        self._rid_by_sid[sid] = record_id
        self._records[record_id] = (sid, value_text)
        self.n += 1
        self._alpha_synced = False

    def insert_many(self, sids, keys, record_ids, value_texts, leaves):
        """Hold many new records at once (what :meth:`insert` does for each row).

        Parameters
        ----------
        sids : ndarray of shape (k,), int
            Free solver slots, distinct.
        keys : ndarray of shape (k, d)
        record_ids : list of k str
            Distinct ids, none held.
        value_texts : list of k str
        leaves : ndarray of shape (k, 32), uint8
            Their :func:`record_leaf`.
        """
        k = len(record_ids)
        if k == 0:
            return
        sids = np.asarray(sids, dtype=np.int64)
        self._ensure_rows(keys.shape[1], int(sids.max()), extra=k)
        rows = np.arange(self.n, self.n + k)
        self.keys[rows] = keys
        sqnorms = np.einsum("ij,ij->i", keys, keys)
        self.row_sqnorm[rows] = sqnorms
        self._sqnorm_max = max(self._sqnorm_max, float(sqnorms.max()))
        self.row_sid[rows] = sids
        self._row_by_sid[sids] = rows
        self._leaf_by_sid[sids] = leaves
        self._dirty_blocks.update(np.unique(sids // BLOCK).tolist())
        sid_list = sids.tolist()
        self.changed_sids.update(sid_list)
        self._rid_by_sid.update(zip(sid_list, record_ids))
        self._records.update(zip(record_ids, zip(sid_list, value_texts)))
        self.n += k
        self._alpha_synced = False

    def drop(self, record_id):
        """Remove a held record (its row is refilled by the last row); returns its sid."""
        sid, _ = self._records.pop(record_id)
        row = int(self._row_by_sid[sid])
        last = self.n - 1
        if self.row_sqnorm[row] == self._sqnorm_max:
            self._sqnorm_stale = True  # the bound may now be loose: recomputed at the next query
        if row != last:
            moved = int(self.row_sid[last])
            self.keys[row] = self.keys[last]
            self.row_sqnorm[row] = self.row_sqnorm[last]
            self.row_sid[row] = moved
            self.row_alpha[row] = self.row_alpha[last]
            self._row_by_sid[moved] = row
        # the freed row (the last) must not keep a copy of any key: zero it
        self.keys[last] = 0.0
        self.row_sqnorm[last] = 0.0
        self.row_sid[last] = 0
        self.row_alpha[last] = 0.0
        self._row_by_sid[sid] = -1
        self._set_leaf(sid, 0)
        del self._rid_by_sid[sid]
        self.n = last
        self._alpha_synced = False
        return sid

    def set_value(self, record_id, value_text, leaf):
        """Replace a held record's value (its key and slot stay)."""
        sid, _ = self._records[record_id]
        self._records[record_id] = (sid, value_text)
        self._set_leaf(sid, leaf)

    def coefficients_changed(self):
        """The solver's coefficients moved: the row copies must be refreshed before a query."""
        self._alpha_synced = False

    def sync_alpha(self, solver):
        """Copy the solver's coefficients into the rows, and find the rows of the support
        (``row_alpha != 0``) and their coefficients, once per change."""
        if not self._alpha_synced:
            if self.n:
                self.row_alpha[self._row_by_sid[solver.ids]] = solver.alpha
            self.support_rows = self.row_alpha[: self.n].nonzero()[0]
            self.support_alpha = self.row_alpha[self.support_rows]
            self._alpha_synced = True

    # ------------------------------------------------------------------ search
    def nearest(self, q, k, inv_sigma2, min_similarity):
        """The (at most) ``k`` held records most similar to ``q`` that support it.

        One matrix-vector product ``-2 X q`` (BLAS), then :func:`_search.nearest_rows`: the
        expansion ``|x_i|^2 - 2 x_i . q + |q|^2`` on the maintained squared norms ranks the
        rows within a rounding bound, and only the rows the bound cannot rule out are re-scored
        by direct differences (the ranking, ties and the normaliser's error are stated there).
        The coefficients must be synced (:meth:`sync_alpha`).

        Parameters
        ----------
        q : ndarray of shape (d,), float64
        k : int >= 1
        inv_sigma2 : float
            ``1 / sigma^2``.
        min_similarity : float in (0, 1]

        Returns
        -------
        sids, sims, weights : ndarray of shape (m,)
            As :func:`_search.nearest_rows`: the solver ids of m <= k records best first,
            their similarities and their readout weights.
        """
        n = self.n
        if self._sqnorm_stale:
            self._sqnorm_max = float(self.row_sqnorm[:n].max()) if n else 0.0
            self._sqnorm_stale = False
        keys = self.keys[:n]
        qq = float(q @ q)
        root = math.sqrt(self._sqnorm_max) + math.sqrt(qq)
        span = root * root  # inf past the float range (``** 2`` would raise OverflowError)
        # -2 x_i . q (the scaling is exact); not needed when every row is scored directly
        a = keys @ (q * -2.0) if span < 1e300 else np.empty(0)
        return _search.nearest_rows(keys, q, a, self.row_sqnorm[:n], qq, span,
                                    self.support_rows, self.support_alpha, self.row_alpha[:n],
                                    self.row_sid[:n], k, inv_sigma2, min_similarity)

    def _ensure_rows(self, d, sid, extra=1):
        """Room for ``extra`` more rows and for solver slots up to ``sid``."""
        if self.keys.shape[0] == 0:
            self.d = d
            self.keys = np.zeros((max(16, extra), d))
            self.row_sqnorm = np.zeros(self.keys.shape[0])
            self.row_sid = np.zeros(self.keys.shape[0], dtype=np.int64)
            self.row_alpha = np.zeros(self.keys.shape[0])
        if self.n + extra > self.keys.shape[0]:
            cap = max(2 * self.keys.shape[0], self.n + extra)
            for name in ("keys", "row_sqnorm", "row_sid", "row_alpha"):
                old = getattr(self, name)
                new = np.zeros((cap,) + old.shape[1:], dtype=old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        if sid >= self._row_by_sid.shape[0]:
            old_cap = self._row_by_sid.shape[0]
            cap = max(2 * old_cap, sid + 1, BLOCK)
            cap = -(-cap // BLOCK) * BLOCK  # whole blocks only
            rows = np.full(cap, -1, dtype=np.int64)
            rows[:old_cap] = self._row_by_sid
            leaves = np.zeros((cap, 32), dtype=np.uint8)
            leaves[:old_cap] = self._leaf_by_sid
            blocks = np.zeros((cap // BLOCK, 32), dtype=np.uint8)
            blocks[: self._block_hash.shape[0]] = self._block_hash
            self._row_by_sid, self._leaf_by_sid, self._block_hash = rows, leaves, blocks
            self._dirty_blocks.update(range(old_cap // BLOCK, cap // BLOCK))

    # ------------------------------------------------------------------ digest
    def _set_leaf(self, sid, leaf):
        self._leaf_by_sid[sid] = leaf
        self._dirty_blocks.add(sid // BLOCK)
        self.changed_sids.add(int(sid))

    def records_root(self):
        """sha256 over the block count and the block hashes; a block hashes the leaves of its
        64 insertion slots (a slot not held contributes 32 zero bytes), up to the block of the
        last held slot."""
        n_blocks = self._n_blocks()
        self._rehash_dirty()
        h = hashlib.sha256(_U64.pack(n_blocks))
        h.update(self._block_hash[:n_blocks].tobytes())
        return h.digest()

    def _n_blocks(self):
        return -(-(int(self.row_sid[: self.n].max()) + 1) // BLOCK) if self.n else 0

    def _rehash_dirty(self):
        for b in self._dirty_blocks:
            block = self._leaf_by_sid[b * BLOCK:(b + 1) * BLOCK]
            self._block_hash[b] = np.frombuffer(hashlib.sha256(block.tobytes()).digest(),
                                                dtype=np.uint8)
        self._dirty_blocks.clear()

    def records_root_v1(self):
        """The version-1 records root (leaves of :func:`_record_leaf_v1`, no block count),
        computed from scratch: for checking the digest stored in a version-1 file."""
        n_blocks = self._n_blocks()
        leaves = np.zeros((n_blocks * BLOCK, 32), dtype=np.uint8)
        for record_id, (sid, text) in self._records.items():
            leaves[sid] = _record_leaf_v1(record_id, self.key(sid), text)
        blocks = b"".join(hashlib.sha256(leaves[b * BLOCK:(b + 1) * BLOCK].tobytes()).digest()
                          for b in range(n_blocks))
        return hashlib.sha256(blocks).digest()


def coefficients_hash(solver):
    """sha256 of the coefficients by their support: the count k, the positions (int64,
    indexes into the insertion order) of the non-zero coefficients, then their float64 bits.

    Reserve records are exactly 0.0, so positions and values fix every bit of alpha.
    """
    alpha = solver.alpha
    support = (alpha != 0.0).nonzero()[0]  # 2x faster than flatnonzero on floats
    h = hashlib.sha256(_COEF_TAG)
    h.update(_U64.pack(support.shape[0]))
    h.update(np.ascontiguousarray(support, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(alpha[support], dtype="<f8").tobytes())
    return h.digest()


def state_digest(solver, table, budget, min_similarity, coefficients=None):
    """sha256 (hex) of the exact state (see :meth:`ForgettableMemory.state_digest`).

    Parameters
    ----------
    solver : IncrementalSVDD
    table : RecordTable
    budget : int or None
    min_similarity : float
    coefficients : bytes, optional
        :func:`coefficients_hash` of the solver, when the caller has it cached.

    Returns
    -------
    str
        64 hex digits.
    """
    h = hashlib.sha256(_STATE_TAG)
    h.update(struct.pack("<ddqdQQd", solver.C, solver.sigma, -1 if budget is None else budget,
                         min_similarity, table.d or 0, len(table), solver.rho))
    h.update(table.records_root())
    h.update(coefficients_hash(solver) if coefficients is None else coefficients)
    return h.hexdigest()


def state_digest_v1(solver, table, budget, min_similarity):
    """The version-1 digest (ambiguous encoding): only to check a version-1 file."""
    h = hashlib.sha256(_STATE_TAG_V1)
    h.update(struct.pack("<ddqdqd", solver.C, solver.sigma, -1 if budget is None else budget,
                         min_similarity, len(table), solver.rho))
    h.update(table.records_root_v1())
    alpha = solver.alpha
    support = (alpha != 0.0).nonzero()[0]
    h.update(np.ascontiguousarray(support, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(alpha[support], dtype="<f8").tobytes())
    return h.hexdigest()
