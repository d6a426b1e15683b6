"""Exceptions and warnings of :mod:`svtoolkit.memory`."""

from __future__ import annotations

__all__ = ["MemoryFileError", "MemoryAuthenticationError", "BudgetExceededWarning",
           "DurabilityWarning", "ReceiptError", "StaleStateError", "StoreOwnedError"]


class MemoryFileError(ValueError):
    """A memory file that :meth:`ForgettableMemory.load` refuses.

    Damaged, malformed, internally inconsistent, failing the KKT or digest check, or of another
    version. Not every deliberate edit is caught: see :meth:`ForgettableMemory.load`.
    """


class BudgetExceededWarning(UserWarning):
    """The support set alone exceeds the budget; nothing more can be evicted with a certificate."""


class DurabilityWarning(UserWarning):
    """A save is committed (the new file is in place) but may not survive a power loss.

    Issued when the directory fsync after the rename fails: the rename cannot be undone, so
    the save is not reported as failed, but the operating system has not confirmed that the
    directory entry reached the disk.
    """


class MemoryAuthenticationError(MemoryFileError):
    """A file that ``load(path, key=...)`` refuses: its HMAC is missing or does not verify.

    The file was not signed, was modified after it was signed, or was signed with another key.
    """


class ReceiptError(ValueError):
    """A receipt that does not verify with the memory's key (forged, altered or unsigned)."""


class StaleStateError(ValueError):
    """A memory older than a receipt it should follow: a replayed or rolled-back file."""


class StoreOwnedError(OSError):
    """A write refused because a running server owns the store (it holds the store's lock
    from start to stop); the message names the server's address (``--server URL``)."""
