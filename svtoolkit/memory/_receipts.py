"""Results of memory operations: deletion receipts (optionally signed), audit reports, adds,
query answers."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from ._errors import MemoryFileError
from ._signing import check_key, macs_equal, receipt_mac

__all__ = ["DeletionReceipt", "AuditReport", "AddResult", "ExtendResult", "Hit", "verify_receipt",
           "CHAIN_HEAD_FIELDS", "advance", "chain_genesis", "chain_line", "check_chain",
           "entry_hash", "next_link"]

#: Receipt fields added with the verification levels; a receipt without them (an older one)
#: was signed without them, so they enter the MAC only when they hold a value.
_OPTIONAL_FIELDS = ("kkt_source", "rolling_audit")
#: What a receipt's ``kkt_residual`` was computed from (see :class:`DeletionReceipt`).
KKT_SOURCES = ("fresh", "maintained", "cached fresh", "cached maintained")


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
        Largest KKT violation of the state after the operation (in units of the decision
        function), computed as ``kkt_source`` says; ``None`` when the caller passed
        ``verify=False``.
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
    revision : int or None
        :attr:`ForgettableMemory.revision` after the operation (a memory, or a file, at a
        lower revision is older than this receipt: see :meth:`ForgettableMemory.check_receipt`).
    mac : str or None
        HMAC-SHA256 (hex) over every other field, when the memory has a signing key
        (:func:`verify_receipt` checks it); None otherwise.
    kkt_source : str or None
        How ``kkt_residual`` was obtained: ``"fresh"`` - every gradient recomputed from the
        keys for this receipt (``O(n |support| d)``); ``"maintained"`` - evaluated on the
        gradients the exact walk maintains (O(n); their agreement with the keys is what
        ``rolling_audit`` and the full checks verify); ``"cached fresh"`` /
        ``"cached maintained"`` - a value-only edit, whose solver state is the one that
        value was computed for; None with ``verify=False``.
    rolling_audit : dict or None
        The fresh checks this operation ran on part of the solver state (the rolling audit,
        ``docs/memory.md``): ``gradients_checked`` keys whose maintained gradients were
        compared with a fresh evaluation from the keys, their largest difference
        ``grad_drift``, ``inverse_columns_checked`` columns of the bordered margin system
        multiplied by the maintained inverse, their largest deviation from the identity
        ``inverse_residual``, and ``repaired`` (a drift above the solver's audit thresholds
        triggered a full audit and refactorisation). None when no slice fell on this
        operation (a small memory takes one every few operations) or it did not change the
        solver (a value-only edit).
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
    revision: int | None = None
    mac: str | None = None
    kkt_source: str | None = None
    rolling_audit: dict | None = None

    def signed_fields(self):
        """dict of every field except ``mac`` (what the MAC covers; the optional fields
        ``kkt_source`` and ``rolling_audit`` only when they hold a value)."""
        return _payload({f.name: getattr(self, f.name) for f in fields(self)})

    def to_dict(self):
        """Plain JSON-serialisable dict (adds ``time_utc`` in ISO 8601, not covered by the MAC)."""
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
        """Plain JSON-serialisable dict."""
        return asdict(self)


class ExtendResult(NamedTuple):
    """What one :meth:`ForgettableMemory.extend` did.

    Attributes
    ----------
    record_ids : tuple of str
        The ids of the new records, in row order.
    evicted : tuple of str
        Records this call evicted by the budget (oldest first); can include new ids.
    """

    record_ids: tuple
    evicted: tuple


class AddResult(NamedTuple):
    """What one :meth:`ForgettableMemory.add_record` did.

    Attributes
    ----------
    record_id : str
        The id of the new record.
    evicted : tuple of str
        Records this call evicted by the budget (oldest first); can include ``record_id``.
    """

    record_id: str
    evicted: tuple


def _payload(values):
    """The MAC's payload: every field but ``mac``; an optional field only when not None."""
    return {name: value for name, value in values.items() if name != "mac" and not (
        name in _OPTIONAL_FIELDS and value is None)}


def _receipt_fields(receipt):
    if isinstance(receipt, DeletionReceipt):
        return receipt.signed_fields(), receipt.mac
    if isinstance(receipt, dict):
        names = [f.name for f in fields(DeletionReceipt) if f.name != "mac"]
        missing = [n for n in names if n not in receipt and n not in _OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"receipt is missing field(s) {', '.join(missing)}")
        return _payload({n: receipt.get(n) for n in names}), receipt.get("mac")
    raise TypeError(f"receipt must be a DeletionReceipt or its dict form; got "
                    f"{type(receipt).__name__}")


def verify_receipt(receipt, key):
    """Whether a receipt's MAC verifies under ``key`` (constant-time comparison).

    Parameters
    ----------
    receipt : DeletionReceipt or dict
        A receipt, or its :meth:`DeletionReceipt.to_dict` form read back from JSON (the
        ``time_utc`` entry is ignored).
    key : bytes
        The memory's signing key.

    Returns
    -------
    bool
        False for an unsigned receipt, a changed field, or a MAC made with another key.

    Raises
    ------
    TypeError, ValueError
        A key that is not bytes or too short; a receipt of another type or missing fields.
    """
    key = check_key(key)
    payload, mac = _receipt_fields(receipt)
    if not isinstance(mac, str) or not mac.isascii():
        return False
    try:
        expected = receipt_mac(key, payload)
    except (TypeError, ValueError):  # a field that is not JSON cannot have been signed
        return False
    return macs_equal(expected, mac)


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


# ---------------------------------------------------------------------------- the log's chain
#: Domain tag of a receipt log's genesis value.
_CHAIN_TAG = b"svtoolkit.ReceiptLog/v1\x00"
#: Keys of a store's chain head (``receipt_chain`` in the file header).
CHAIN_HEAD_FIELDS = ("store", "legacy", "count", "head", "last")


def entry_hash(line):
    """sha256 (hex) of one log line's bytes (without its newline)."""
    return hashlib.sha256(line).hexdigest()


def chain_genesis(store, legacy_lines):
    """The predecessor of a log's first chained entry: bound to the store and to the lines
    the log held before its chain started.

    Parameters
    ----------
    store : str
        The store's chain identity (32 hex digits, drawn when its chain starts).
    legacy_lines : list of bytes
        The log's unchained lines written before the chain (receipts of earlier versions),
        without their newlines; usually none.

    Returns
    -------
    str
        64 hex digits.
    """
    legacy = hashlib.sha256(b"".join(line + b"\n" for line in legacy_lines)).digest()
    return hashlib.sha256(_CHAIN_TAG + store.encode("ascii") + b"\x00" + legacy).hexdigest()


def chain_line(entry):
    """The log line (bytes, no newline) of a receipt's dict form with its ``prev``."""
    return json.dumps(entry, sort_keys=True, ensure_ascii=True).encode("ascii")


def next_link(head, lines):
    """``(prev, start)`` for appending one receipt to a log.

    Parameters
    ----------
    head : dict or None
        The store's chain head (:data:`CHAIN_HEAD_FIELDS`); None when its chain has not
        started (a fresh store, or one written before the chain).
    lines : list of bytes
        The log's lines now (only read when the chain starts: they become its legacy part).

    Returns
    -------
    prev : str
        What the new entry carries as ``prev``.
    start : dict
        The head before the new entry (a new chain's when ``head`` is None: a fresh chain
        identity, the lines now as its legacy part, no entry yet), for :func:`advance`.
    """
    if head is not None:
        return head["head"], head
    store = secrets.token_hex(16)
    start = {"store": store, "legacy": len(lines), "count": 0,
             "head": chain_genesis(store, lines), "last": None}
    return start["head"], start


def advance(start, line):
    """The head after appending ``line`` (bytes) to a log whose head was ``start``."""
    return {**start, "count": start["count"] + 1, "head": entry_hash(line),
            "last": line.decode("ascii")}


def check_chain(name, lines, entries, head):
    """Check a receipt log against its store's chain head.

    Parameters
    ----------
    name : str
        The log's path (for messages).
    lines : list of bytes or None
        The log's complete lines (no newlines) in file order; None when the log does not
        exist.
    entries : list of dict
        The same lines parsed (JSON objects).
    head : dict or None
        The store's chain head; None for a store whose chain has not started.

    Returns
    -------
    bytes or None
        The line to append to make the log whole: the store's last entry, when the log lacks
        exactly that one (a crash between the store's save and the log's fsync); else None.

    Raises
    ------
    MemoryFileError
        The log and the head disagree: the message names the first line that does not fit
        and what was expected there.
    """
    present = lines or []
    if head is None:
        chained = [n for n, entry in enumerate(entries, 1) if "prev" in entry]
        if chained:
            raise MemoryFileError(
                f"{name}: line {chained[0]} is a chained entry (it carries prev), but the store "
                "holds no chain head: the store was replaced by a copy from before its log's "
                "chain started, or its head was removed")
        return None
    legacy, count = head["legacy"], head["count"]
    where = (f"the store's chain head says the log holds {legacy + count} line(s) ("
             f"{f'{legacy} written before the chain, then ' if legacy else ''}{count} chained; "
             f"the last one's hash {head['head'][:16]}...)")
    if lines is None and legacy + count > 1:
        raise MemoryFileError(f"{name} is missing, but {where}: the log was removed")
    if len(present) < legacy:
        raise MemoryFileError(f"{name} holds {len(present)} line(s), but {where}: the log "
                              "was cut short or lines were deleted")
    early = [n for n, entry in enumerate(entries[:legacy], 1) if "prev" in entry]
    if early:
        raise MemoryFileError(
            f"{name}: line {early[0]} is a chained entry (it carries prev), but {where}: a "
            "line before it was deleted")
    expected = chain_genesis(head["store"], present[:legacy])
    for number, line in enumerate(present[legacy:], legacy + 1):
        prev = entries[number - 1].get("prev")
        if prev != expected:
            what = (f"the hash of line {number - 1}): a line before it was deleted, swapped, "
                    "duplicated or edited" if number > legacy + 1 else
                    "the chain's genesis (bound to this store and to the lines before the "
                    "chain)): a line before it was deleted, swapped or edited, or the log "
                    "belongs to another store")
            raise MemoryFileError(f"{name}: line {number} carries prev {str(prev)[:16]}..., "
                                  f"expected {expected[:16]}... ({what}")
        expected = entry_hash(line)
        if number == legacy + count and expected != head["head"]:
            raise MemoryFileError(
                f"{name}: line {number} is the store's last logged receipt, but its hash "
                f"{expected[:16]}... differs from the store's chain head {head['head'][:16]}"
                "...: it was edited or replaced")
    found = len(present) - legacy
    if found > count:
        raise MemoryFileError(
            f"{name} holds {found} chained line(s) after line {legacy}, but {where}: line "
            f"{legacy + count + 1} is not in the store's history (the store is an older copy, "
            "or the lines were added)")
    if found == count:
        return None
    last = head["last"].encode("ascii")
    if found == count - 1 and json.loads(last).get("prev") == expected and \
            entry_hash(last) == head["head"]:
        return last
    raise MemoryFileError(f"{name} ends after {len(present)} line(s), but {where}: the log "
                          "was cut short")
