"""Atomic file replacement (temporary file, fsync, rename, directory fsync) and store locks.

Paths are resolved first (``os.path.realpath``): for a symlinked store the real file is the
one rewritten and locked, and the link stays a link.

The rename is the commit point. A failure before it raises and leaves the previous file; a
failed directory fsync after it cannot undo the rename, so it is a
:class:`DurabilityWarning`, not an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks
    fcntl = None

from ._errors import DurabilityWarning

__all__ = ["atomic_write", "read_file", "resolve", "store_lock"]


def resolve(path):
    """The real path of a store (symlinks followed), as a str."""
    return os.path.realpath(os.fspath(path))


def read_file(path):
    """All bytes of ``path``."""
    with open(path, "rb") as fh:
        return fh.read()


@contextlib.contextmanager
def store_lock(path):
    """Exclusive advisory lock (``flock``) on ``REALPATH.lock``, for processes sharing a store.

    Every process that loads, changes and saves one store should hold it around the whole
    sequence (the command line does). On systems without ``fcntl`` it does nothing.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(resolve(path) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _temp_pattern(base):
    """Names of this store's temporary files: ``.BASE.<16 hex>.tmp`` (written now) and
    ``.BASE.<8 of [a-z0-9_]>.tmp`` (``tempfile``'s names, written by earlier versions). The
    random part has a fixed length and no dot, so a name belongs to exactly one store."""
    return re.compile(re.escape(f".{base}.") + r"(?:[0-9a-f]{16}|[a-z0-9_]{8})\.tmp")


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


def atomic_write(path, chunks):
    """Write ``chunks`` followed by their sha256 to ``path``, atomically.

    Steps: resolve ``path``; remove stale temporary files of this store (left by crashed
    saves); write a new temporary file in the same directory, fsync it; rename it over the
    target (the commit point); fsync the directory.

    Parameters
    ----------
    path : str or path-like
    chunks : iterable of bytes

    Raises
    ------
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
    directory, base = os.path.split(target)
    _remove_stale_temps(directory, base)
    fd, tmp = _create_temp(directory, base)
    try:
        with os.fdopen(fd, "wb") as fh:
            hasher = hashlib.sha256()
            for chunk in chunks:
                _write_chunk(fh, chunk, hasher)
            fh.write(hasher.digest())
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
            "or power loss", DurabilityWarning, stacklevel=3)
