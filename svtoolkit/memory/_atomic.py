"""Atomic file replacement (temporary file, fsync, rename, directory fsync) and store locks.

Paths are resolved first (``os.path.realpath``): for a symlinked store the real file is the
one rewritten and locked, and the link stays a link.

The rename is the commit point. A failure before it raises and leaves the previous file; a
failed directory fsync after it cannot undo the rename, so it is a
:class:`DurabilityWarning`, not an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks
    fcntl = None

from ._errors import DurabilityWarning, StoreOwnedError

__all__ = ["atomic_write", "read_file", "remove_stale_temps", "resolve", "store_lock",
           "StoreOwnership", "writing"]


def resolve(path):
    """The real path of a store (symlinks followed), as a str."""
    return os.path.realpath(os.fspath(path))


def read_file(path):
    """All bytes of ``path``."""
    with open(path, "rb") as fh:
        return fh.read()


#: Seconds between two tries of a store's lock held by another writer (a short operation).
_LOCK_POLL = 0.01
_held = threading.local()  # .paths: real paths whose store lock this thread holds now


def _holding(target):
    """True when this thread holds the store lock of ``target`` (its own writes pass)."""
    return target in getattr(_held, "paths", ())


@contextlib.contextmanager
def _hold(target):
    paths = getattr(_held, "paths", None)
    if paths is None:
        paths = _held.paths = set()
    new = target not in paths
    paths.add(target)
    try:
        yield
    finally:
        if new:
            paths.discard(target)


def _owner_of(fd):
    """The server named in a held lock file, as a dict, or None (none, or one that died).

    A server that owns a store writes ``{"pid": ..., "url": ...}`` into the lock file; only
    the lock says whether it still runs, so this is asked only when a lock could not be
    taken. A named process that no longer exists left the text behind (a crash).
    """
    try:
        text = os.pread(fd, 4096, 0)
        owner = json.loads(text.decode("utf-8")) if text else None
    except (OSError, ValueError):
        return None
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return None
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return None
    except OSError:  # alive, another user's
        pass
    return owner


def _owned_message(target, owner):
    url = owner.get("url")
    where = f"the server at {url}" if url else "a server that is starting"
    how = (f"svtoolkit memory COMMAND --server {url}" if url else
           "svtoolkit memory COMMAND --server URL")
    return (f"{target} is owned by {where} (pid {owner['pid']}): while it runs, no other "
            f"process may write the store; send changes through it ({how})")


def _take(fd, target, mode):
    """``flock(fd, mode)``, waiting while other writers hold the lock; refused while a server
    owns the store (it holds the lock for its lifetime)."""
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            owner = _owner_of(fd)
            if owner is not None:
                raise StoreOwnedError(_owned_message(target, owner)) from None
            time.sleep(_LOCK_POLL)


@contextlib.contextmanager
def store_lock(path):
    """Exclusive advisory lock (``flock``) on ``REALPATH.lock``, for processes sharing a store.

    Every process that loads, changes and saves one store should hold it around the whole
    sequence (the command line does). It waits while another process holds it for an
    operation, and is refused while a server owns the store. Held again by the same thread
    (nested), it is a no-op. On systems without ``fcntl`` it does nothing.

    Raises
    ------
    StoreOwnedError
        A running server (``svtoolkit memory serve``) owns the store; the message names its
        address.
    """
    target = resolve(path)
    if fcntl is None or _holding(target):  # not POSIX, or held already by this thread
        yield
        return
    fd = os.open(target + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        _take(fd, target, fcntl.LOCK_EX)
        if os.fstat(fd).st_size:  # a crashed server's note: the lock says it is gone
            os.ftruncate(fd, 0)
        with _hold(target):
            yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def writing(target):
    """Around one save of the store at real path ``target``: a shared lock on an existing
    ``REALPATH.lock`` (none when it does not exist), so that the save is refused while a
    server owns the store; nothing for a thread that holds the store lock."""
    if fcntl is None or _holding(target):  # not POSIX, or this thread holds the lock
        yield
        return
    try:
        fd = os.open(target + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        _take(fd, target, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


class StoreOwnership:
    """A server's hold on its store, from start to stop: the exclusive lock on ``REALPATH.lock``.

    While it is held, every other writer is refused (:class:`StoreOwnedError`, whose message
    names the server's address once :meth:`announce` gave it): the command line, a second
    server, :meth:`ForgettableMemory.save` in another process. Readers are not affected (a
    save replaces the file atomically, so a reader sees the last acknowledged state).

    Parameters
    ----------
    path : str or path-like
        The store.

    Raises
    ------
    StoreOwnedError
        Another server owns the store.
    """

    def __init__(self, path):
        self.target = resolve(path)
        self._fd = None
        if fcntl is None:  # pragma: no cover - not POSIX
            return
        fd = os.open(self.target + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            _take(fd, self.target, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.announce(None)

    def announce(self, url):
        """Write this process's id and the server's ``url`` into the lock file."""
        if self._fd is None:  # pragma: no cover
            return
        note = json.dumps({"pid": os.getpid(), "url": url}).encode("utf-8")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, note, 0)

    def writing(self):
        """Context manager around the owner's own writes (they pass the lock it holds)."""
        return _hold(self.target)

    def release(self):
        """Give the store up (idempotent); the process's end does it too."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _temp_pattern(base):
    """Names of this store's temporary files: ``.BASE.<16 hex>.tmp`` (written now) and
    ``.BASE.<8 of [a-z0-9_]>.tmp`` (``tempfile``'s names, written by earlier versions). The
    random part has a fixed length and no dot, so a name belongs to exactly one store."""
    return re.compile(re.escape(f".{base}.") + r"(?:[0-9a-f]{16}|[a-z0-9_]{8})\.tmp")


def remove_stale_temps(target):
    """Delete the temporary files that crashed saves of the store at real path ``target``
    left behind (every save does, whichever way it writes)."""
    directory, base = os.path.split(target)
    _remove_stale_temps(directory, base)


def _remove_stale_temps(directory, base):
    """Delete the temporary files that crashed saves of this store left behind.

    A save in progress holds an exclusive ``flock`` on its temporary file (released by the
    kernel when its process dies), so a file whose lock can be taken is stale.
    """
    pattern = _temp_pattern(base)
    for name in os.listdir(directory):
        if not pattern.fullmatch(name):
            continue
        full = os.path.join(directory, name)
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            continue
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # another save is writing it
            # without flock (Windows) a file in use cannot be unlinked: it is left alone
            with contextlib.suppress(FileNotFoundError,
                                     *(() if fcntl is not None else (PermissionError,))):
                os.unlink(full)
        finally:
            os.close(fd)


def _create_temp(directory, base):
    """A new temporary file (mode 0600) for this store, locked while it is written."""
    while True:
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # pragma: no cover - 64 random bits
            continue
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, tmp


def _write_chunk(fh, chunk):
    """One write of the save path (a seam for the crash-injection tests)."""
    fh.write(chunk)


def _fsync_directory(directory):
    if os.name != "posix":  # pragma: no cover - Windows has no directory fsync
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, chunks):
    """Write ``chunks`` to ``path``, atomically.

    Steps: resolve ``path``; remove stale temporary files of this store (left by crashed
    saves); write a new temporary file in the same directory, fsync it; rename it over the
    target (the commit point); fsync the directory.

    Parameters
    ----------
    path : str or path-like
    chunks : iterable of bytes

    Raises
    ------
    StoreOwnedError
        A server owns the store (and this thread is not that server's writer); nothing is
        written.
    OSError
        Anything failing before the rename; the previous file is then unchanged and the
        temporary file removed.

    Warns
    -----
    DurabilityWarning
        The directory fsync after the rename failed: the new file is in place, but the
        rename may not survive a power loss.
    """
    target = resolve(path)
    with writing(target):
        _replace(target, chunks)


def _replace(target, chunks):
    directory, base = os.path.split(target)
    _remove_stale_temps(directory, base)
    fd, tmp = _create_temp(directory, base)
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in chunks:
                _write_chunk(fh, chunk)
            fh.flush()
            os.fsync(fh.fileno())
            if fcntl is not None:  # rename under the temp's lock: no cleanup takes it first
                os.replace(tmp, target)
        if fcntl is None:  # pragma: no cover - an open file cannot be renamed on Windows
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:
        _fsync_directory(directory)
    except OSError as exc:
        warnings.warn(
            f"{target}: the new file is in place (the save is committed), but the directory "
            f"fsync failed ({exc}): durability of the rename is not guaranteed across a crash "
            "or power loss", DurabilityWarning, stacklevel=4)
