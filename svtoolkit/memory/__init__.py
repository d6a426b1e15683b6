"""ForgettableMemory: a key-value memory with exact deletion, receipts and certified eviction.

A user-facing store on top of the exact fp64 solver (:class:`svtoolkit.IncrementalSVDD`).
Every record is a key vector (for text, a sentence embedding; see :mod:`svtoolkit.embeddings`)
and a JSON value. The one-class SVM (SVDD) over the keys decides what is certified-redundant
(the reserve set, coefficient exactly 0) and makes deletion exact: after
:meth:`~ForgettableMemory.forget` the memory is what it would have been had the record never
been added (same C).

What is guaranteed, and its scope, is written out in ``docs/memory.md``; the short version is
in the :class:`ForgettableMemory` docstring.

Modules: ``_store`` (the memory, its operations and queries), ``_persistence`` (what a save
writes, how a load rebuilds and verifies), ``_certificates`` (what a receipt certifies, at which
verification level), ``_table`` (the record table and its incremental digest), ``_codec``
(values as canonical JSON), ``_database`` (the store database: SQLite, written by the change),
``_format`` (the single files of earlier versions, read; the load checks), ``_atomic`` (atomic
replacement of a file, store locks), ``_signing`` (HMAC-SHA256 of stores and receipts),
``_receipts`` (receipts, audit reports, add and extend results), ``_audit`` (the rolling
audit), ``_errors``; the local service: ``_service`` (state rules), ``server`` (HTTP),
``client``.
"""

from ._atomic import store_lock
from ._codec import MAX_RECORD_ID_BYTES, MAX_VALUE_BYTES, MAX_VALUE_DEPTH
from ._errors import (
    BudgetExceededWarning,
    DurabilityWarning,
    MemoryAuthenticationError,
    MemoryFileError,
    ReceiptError,
    StaleStateError,
    StoreOwnedError,
)
from ._database import FORMAT_VERSION, READABLE_VERSIONS
from ._format import KKT_TOL
from ._receipts import AddResult, AuditReport, DeletionReceipt, ExtendResult, Hit, verify_receipt
from ._signing import MIN_KEY_BYTES
from .client import Client, ServerError

# The store imports the exact solver (Numba: about half a second); it is imported on first use,
# so that a client of a running server (``svtoolkit memory ... --server URL``) starts fast.
_FROM_STORE = ("ForgettableMemory", "DEFAULT_MIN_SIMILARITY", "FRESH_KKT_WORK")


def __getattr__(name):
    if name in _FROM_STORE:
        from . import _store

        return getattr(_store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

__all__ = [
    "ForgettableMemory",
    "Hit",
    "Client",
    "ServerError",
    "AddResult",
    "ExtendResult",
    "DeletionReceipt",
    "AuditReport",
    "verify_receipt",
    "store_lock",
    "MemoryFileError",
    "MemoryAuthenticationError",
    "ReceiptError",
    "StaleStateError",
    "StoreOwnedError",
    "BudgetExceededWarning",
    "DurabilityWarning",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "KKT_TOL",
    "MIN_KEY_BYTES",
    "MAX_RECORD_ID_BYTES",
    "MAX_VALUE_DEPTH",
    "MAX_VALUE_BYTES",
    "DEFAULT_MIN_SIMILARITY",
    "FRESH_KKT_WORK",
]
