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
_UNIT = 2.0 ** -53  # unit roundoff of float64
#: A query's normaliser ``sum_i a_i k(q, x_i)`` takes the terms of the records it does not
#: return from the expansion while that is off by at most this factor (relative, per term:
#: ``E / sigma^2`` of :meth:`RecordTable.nearest`), else from the direct differences of every
#: support record. 2^-30: far above what keys of moderate norm give (1e-14..1e-12), far below
#: anything a weight is read for.
TOTAL_RTOL = 2.0 ** -30


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

    def records_at(self, rows):
        """Record ids and value texts (two lists) of the records in table rows ``rows``."""
        record_ids = list(map(self._rid_by_sid.__getitem__, self.row_sid[rows].tolist()))
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
        """The rows of the (at most) ``k`` held records most similar to ``q`` that support it.

        The similarity of row i is ``s_i = exp(-D_i * inv_sigma2)`` with ``D_i`` the squared
        distance summed over the direct differences ``keys[i] - q`` (no cancellation). Rows
        with ``s_i >= min_similarity`` are ranked by decreasing ``s_i``, ties by increasing
        solver id (older first). Computing ``D_i`` so for every row is the cost of a query;
        instead one matrix-vector product gives ``a_i = |x_i|^2 - 2 x_i . q + |q|^2`` from the
        maintained squared norms, which ranks the rows to within an absolute error ``E``
        (below); only the rows that the bound cannot rule out (usually ``k`` or a few more)
        are re-scored by direct differences, and the answer is read from those scores alone.
        NumPy, not a compiled loop: a query from a fresh process (the command line) then needs
        no JIT initialisation (about a second).

        Bound (u = 2^-53, gamma_m = m u / (1 - m u)): a dot product of length d is off by at
        most ``gamma_d`` times the sum of the absolute products, so ``|a_i - D_i| <=
        gamma_{d+2} (|x_i| + |q|)^2 <= E = 2 gamma_{d+4} (M + |q|)^2``, M the largest key
        norm (the 2 absorbs the rounding of M and |q| themselves); the direct sum is off by
        at most ``gamma_{d+2} D_i`` (a relative error: no cancellation).

        Parameters
        ----------
        q : ndarray of shape (d,), float64
        k : int >= 1
        inv_sigma2 : float
            ``1 / sigma^2``.
        min_similarity : float in (0, 1]

        Returns
        -------
        rows : ndarray of shape (m,), int
            m <= k rows, best first.
        sims : ndarray of shape (m,)
            Their similarities (direct differences).
        total : float
            ``sum_i row_alpha[i] s_i`` over the support rows (the others' terms are 0; the
            coefficients must be synced, :meth:`sync_alpha`): the candidates' terms from the
            direct differences, the others' from ``a_i`` (relative error of each such term at
            most ``E inv_sigma2`` plus rounding; see ``docs/memory.md``).
        """
        n, d = self.n, self.d
        if self._sqnorm_stale:
            self._sqnorm_max = float(self.row_sqnorm[:n].max()) if n else 0.0
            self._sqnorm_stale = False
        keys = self.keys[:n]
        qq = float(q @ q)
        span = (math.sqrt(self._sqnorm_max) + math.sqrt(qq)) ** 2
        if not span < 1e300:
            # norms near the end of the float64 range (the expansion could overflow where the
            # differences do not): every row directly
            rows = np.arange(n)
            sims = self._direct_similarities(rows, q, inv_sigma2)
            total = float(self.row_alpha[:n] @ sims)
        else:
            a = keys @ (q * -2.0)  # -2 x_i . q (the scaling is exact)
            a += self.row_sqnorm[:n]
            a += qq
            g = (d + 4) * _UNIT / (1.0 - (d + 4) * _UNIT)
            err = 2.0 * g * span  # E above
            # the normaliser's other terms from a (then a_i >= -E, so exp(-a_i / sigma^2)
            # <= 1 + 2^-30: no overflow); past TOTAL_RTOL, every support term directly below
            approximate_total = err * inv_sigma2 <= TOTAL_RTOL
            support = self.support_rows
            if approximate_total:
                approx = np.multiply(a[support], -inv_sigma2)
                np.exp(approx, out=approx)
                total = float(self.support_alpha @ approx)
            # |a_i - D'_i| <= A + B a_i for the direct sum D'_i: E, the relative error of
            # D'_i, and a margin of 64 u (relative, and absolute in units of sigma^2) for the
            # rounding of exp(-D' inv_sigma2) and of the threshold (rows whose D' differ by
            # less can tie in s)
            slack_b = g + 64.0 * _UNIT
            slack_a = err * (1.0 + slack_b) + 64.0 * _UNIT / inv_sigma2
            # a row can support q only if D'_i <= r_hi, hence only if a_i <= cut
            r_hi = (-math.log(min_similarity) * (1.0 + 16.0 * _UNIT)
                    + 16.0 * _UNIT) / inv_sigma2
            rows = (a <= (r_hi + slack_a) / (1.0 - slack_b)).nonzero()[0]
            if rows.size > k:
                # the k rows of smallest a have D' <= t + A + B t (t: the k-th smallest a); a
                # row ranks above one of them only if its D' is no larger: only if a <= cut_k
                near = a[rows]
                t = float(np.partition(near, k - 1)[k - 1])
                rows = rows[near <= (t * (1.0 + slack_b) + 2.0 * slack_a) / (1.0 - slack_b)]
            sims = self._direct_similarities(rows, q, inv_sigma2)
            if approximate_total:  # the candidates' terms from their direct scores
                approx = np.multiply(a[rows], -inv_sigma2)
                total += float(self.row_alpha[rows] @ (sims - np.exp(approx, out=approx)))
            else:  # keys far from the origin for sigma: the normaliser from the differences
                total = float(self.support_alpha
                              @ self._direct_similarities(support, q, inv_sigma2))
        # best first; the supporting rows (s_i >= min_similarity) are then a prefix
        order = np.lexsort((self.row_sid[rows], -sims))
        order = order[: min(k, int(np.count_nonzero(sims >= min_similarity)))]
        return rows[order], sims[order], total

    def _direct_similarities(self, rows, q, inv_sigma2):
        """exp(-||keys[row] - q||^2 inv_sigma2) for ``rows``, from the differences."""
        diff = self.keys[rows] - q
        sims = np.einsum("ij,ij->i", diff, diff)
        np.multiply(sims, -inv_sigma2, out=sims)
        return np.exp(sims, out=sims)

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
