"""One resident :class:`ForgettableMemory` behind the server: locks, saves, receipts, requests.

Transport-free (no web framework): :mod:`svtoolkit.memory.server` turns HTTP requests into
calls of :class:`MemoryService` and its exceptions into HTTP errors. Every request body is a
parsed JSON object; every answer is a JSON-serialisable dict.

Rules kept here:

* **The server owns its store.** From start to :meth:`MemoryService.close` (or the process's
  end) it holds the store's lock (:class:`~svtoolkit.memory._atomic.StoreOwnership`): every
  other writer (the command line, a second server, :meth:`ForgettableMemory.save` in another
  process) is refused with a message naming the server's address. Every request first checks
  that the file is still the one the server last loaded or saved; a file replaced anyway (by
  a program that ignores the lock) is refused for reads and writes alike, so no answer ever
  comes from a state the file no longer holds.
* **One writer at a time, concurrent readers.** A readers-writer lock in the process.
* **Saved before acknowledged.** A change that moved the memory is saved atomically
  (:meth:`ForgettableMemory.save`) before its answer is returned. If anything fails after the
  memory moved (a failed save, a solver failure), the memory is reloaded from the file, which
  still holds the previous state: a refused request changes nothing.
* **Validation is the memory's own.** Fields are passed to the Python API unchanged, so its
  errors (and their messages) are the server's; only what the API does not have (the request
  shape, text keys, the value-size bound, paging) is checked here.
* **Receipts.** Every receipt (forget, edit) is appended to ``REALPATH.receipts.jsonl`` (one
  JSON object per line, fsync'd) after the store's save and before the answer. The log is a
  hash chain: each line carries ``prev``, the sha256 of the line before (the first: a genesis
  bound to the store), and the store holds the head (count, last hash and the last line
  itself), saved with the operation before its line is appended. At start-up the log is
  checked against the head (:func:`~svtoolkit.memory._receipts.check_chain`): a log cut short,
  a line deleted, swapped, duplicated or edited, a removed log is refused, nothing changed on
  disk; a log lacking only the store's last line (a crash between the two writes) gets it
  back. With a signing key every logged receipt's MAC is verified; signed or not, a store
  older than the newest logged receipt (a lower revision, or the same revision with another
  digest) is refused: it was rolled back or replayed.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import threading
import time
import warnings

from .._validation import check_int
from . import _atomic, _database
from ._errors import MemoryFileError, ReceiptError, StaleStateError
from ._receipts import advance, chain_line, check_chain, next_link, verify_receipt
from ._store import ForgettableMemory

__all__ = ["MemoryService", "ServiceUnavailable", "StoreChangedError", "TooLarge",
           "DEFAULT_MAX_VALUE_BYTES", "DEFAULT_PAGE", "MAX_PAGE"]

#: Largest value accepted, in bytes of its canonical JSON (UTF-8).
DEFAULT_MAX_VALUE_BYTES = 64 * 1024
#: Default and largest page of ``records`` and ``receipts``.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: Fields every logged receipt has (receipts of later versions may have more).
_RECEIPT_FIELDS = ("operation", "record_id", "time", "digest_before", "digest_after",
                   "n_records", "revision")


class StoreChangedError(RuntimeError):
    """The store file was replaced or written by another process since the server loaded or
    saved it (by a program that ignored the server's lock)."""


class ServiceUnavailable(RuntimeError):
    """The server could not restore its state after a failure; it must be restarted."""


class TooLarge(ValueError):
    """A value larger than the server's bound."""


class _ReadWriteLock:
    """Many readers or one writer; a waiting writer holds back new readers (no starvation)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def write(self):
        with self._cond:
            self._waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _identity(path):
    """What changes when a file is replaced (a rename gives a new inode) or written in place
    (a new mtime and, for a database, its change counter: bytes 24-27 of its header, which
    every commit increments even within the clock's granularity)."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        counter = os.pread(fh.fileno(), 4, 24)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, counter


def _fields(body, allowed, what):
    """``body`` as a dict with only ``allowed`` fields; ValueError / TypeError otherwise."""
    if not isinstance(body, dict):
        raise TypeError(f"{what}: the request body must be a JSON object; got "
                        f"{type(body).__name__}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"expected {', '.join(allowed)}")
    return body


def _flag(body, name, default=False):
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false; got {value!r}")
    return value


def _page(offset, limit):
    for name, value, low in (("offset", offset, 0), ("limit", limit, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    if limit > MAX_PAGE:
        raise ValueError(f"limit must be at most {MAX_PAGE}; got {limit}")
    return int(offset), int(limit)


def _hit(hit):
    return {"record_id": hit.record_id, "value": hit.value, "weight": hit.weight,
            "score": hit.score}


class _ReceiptLog:
    """The store's append-only JSON-lines receipt log, chained (``docs/memory_server.md``).

    Read whole at start: :attr:`lines` (bytes, no newlines; None when the file does not
    exist) and :attr:`entries` (the same, parsed). Nothing on disk changes until
    :meth:`repair`, called once the log was checked against the store.
    """

    def __init__(self, path):
        self.path = path
        self.lines, self.entries, self._size = self._read()

    def _read(self):
        try:
            data = _atomic.read_file(self.path)
        except FileNotFoundError:
            return None, [], 0
        complete = data[: data.rfind(b"\n") + 1]
        lines = complete.split(b"\n")[:-1]
        entries = []
        for number, line in enumerate(lines, 1):
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):
                entry = None
            if not isinstance(entry, dict) or any(f not in entry for f in _RECEIPT_FIELDS):
                raise MemoryFileError(f"{self.path}: line {number} is not a receipt")
            entries.append(entry)
        return lines, entries, len(complete)

    def repair(self, missing):
        """Drop a torn last line (a crash during its write) and append ``missing`` (bytes or
        None: the store's last receipt, which the log lacks after a crash before its fsync)."""
        if self.lines is not None and os.path.getsize(self.path) != self._size:
            with open(self.path, "r+b") as fh:
                fh.truncate(self._size)
                os.fsync(fh.fileno())
        if missing is not None:
            self.append(missing)

    def catch_up(self, head):
        """Append the store's last receipt when the log lacks it (its write failed)."""
        if head is not None and len(self.lines or ()) < head["legacy"] + head["count"]:
            self.append(head["last"].encode("ascii"))

    def append(self, line):
        """Append one line (bytes, no newline), fsync'd; on a failure the file is cut back."""
        created = self.lines is None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "ab") as fh:
            try:
                fh.write(line + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.ftruncate(fh.fileno(), self._size)
                raise
        if created and os.name == "posix":
            _atomic._fsync_directory(os.path.dirname(self.path))
        self.lines = [*(self.lines or ()), line]
        self.entries.append(json.loads(line))
        self._size += len(line) + 1


class MemoryService:
    """A loaded store served to many threads.

    Parameters
    ----------
    store : str or path-like
        The memory file (made by ``svtoolkit memory init`` or :meth:`ForgettableMemory.save`).
    signing_key : bytes, optional
        The store's key. Required for a signed store (a server without it would save the store
        unsigned); with it the file's MAC is checked at load, saves and receipts are signed.
    max_value_bytes : int, default 65536
        Largest value accepted (canonical JSON, UTF-8 bytes).
    encoder : callable, optional
        ``str -> ndarray of shape (d,)`` for text keys; default: the shared
        all-MiniLM-L6-v2 encoder, loaded once here when the store holds text keys.
    encoder_threads : int, default 1
        Torch intra-op threads of that encoder (set for the whole process). One request is
        encoded at a time; on a small shared CPU one thread is much faster per sentence than
        several (their spin-waiting competes with everything else: measured in
        ``docs/memory_server.md``).

    Raises
    ------
    MemoryFileError
        The store (or its receipt log) does not load, or is signed and no key was given; the
        receipt log does not fit the store's chain head (the message names the line).
    StaleStateError
        The newest logged receipt is newer than the store (signed or not).
    ReceiptError
        With a key: a logged receipt does not verify.
    """

    def __init__(self, store, *, signing_key=None, max_value_bytes=DEFAULT_MAX_VALUE_BYTES,
                 encoder=None, encoder_threads=1):
        self.path = _atomic.resolve(store)
        self._key = signing_key
        self._max_value = int(max_value_bytes)
        self._rw = _ReadWriteLock()
        self._broken = None
        self._latest_audit = None
        self._owner = _atomic.StoreOwnership(self.path)
        try:
            self._mem = self._load()
            self._receipts = _ReceiptLog(self.path + ".receipts.jsonl")
            self._check_receipts()
            self._identity = _identity(self.path)
        except BaseException:
            self._owner.release()
            raise
        self.text_keys = self._mem.metadata.get("encoder") is not None
        self._encode = encoder
        self._encode_lock = threading.Lock()
        if self.text_keys and encoder is None:
            import torch

            from ..embeddings import load_encoder

            check_int(encoder_threads, "encoder_threads", min=1)
            torch.set_num_threads(encoder_threads)
            model = load_encoder(backend="torch")  # once, at start-up: requests never wait
            self._encode = lambda text: model.encode(text)[0]

    # ------------------------------------------------------------------ state
    def announce(self, url):
        """Name the server's address in the store's lock file (other writers' refusals say
        ``--server URL``)."""
        self._owner.announce(url)

    def close(self):
        """Give up the store (other writers may write it again); idempotent."""
        self._owner.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _load(self):
        mem = ForgettableMemory.load(self.path, key=self._key)
        if self._key is None and _database.is_signed_store(self.path):
            raise MemoryFileError(
                f"{self.path} is signed: give its key (--key-file PATH or "
                "$SVTOOLKIT_MEMORY_KEY), otherwise the server would save it unsigned")
        return mem

    def _check_receipts(self):
        """Refuse a receipt log that does not fit the store's chain head (cut short, a line
        deleted, swapped, duplicated or edited, removed), a forged entry, or a store older
        than its log (signed or not); then make the log whole (a torn last line dropped, the
        store's last receipt appended when a crash kept it from the log)."""
        log = self._receipts
        try:
            missing = check_chain(log.path, log.lines, log.entries, self._mem._receipt_chain)
        except MemoryFileError:
            if log.entries:  # a store older than the log: the more precise diagnosis
                self._check_not_older(log.entries[-1])
            raise
        entries = log.entries + ([json.loads(missing)] if missing is not None else [])
        if self._key is not None:
            for number, entry in enumerate(entries, 1):
                if not verify_receipt(entry, self._key):
                    raise ReceiptError(f"{log.path}: receipt {number} does not verify with "
                                       "the store's key")
        if entries:
            self._check_not_older(entries[-1])
        log.repair(missing)

    def _check_not_older(self, newest):
        try:
            self._mem._check_not_older(newest)
        except StaleStateError as exc:
            raise StaleStateError(
                f"{self.path}: {exc}; its receipt log {self._receipts.path} holds later "
                "operations, so the store was rolled back or replaced by an older copy (which "
                "can hold forgotten records): the server refuses to serve it") from None

    @property
    def signed(self):
        """True when the store has a signing key (signed saves and receipts)."""
        return self._key is not None

    @property
    def n_records(self):
        """Records held now."""
        return len(self._mem)

    def _restore(self):
        """Reload the file (still the last saved state) after a failure that moved the memory."""
        try:
            self._mem = self._load()
            self._identity = _identity(self.path)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the service unusable
            self._broken = (f"the server could not restore its state from {self.path} after "
                            f"a failure ({type(exc).__name__}: {exc}); restart it")

    def _check_usable(self):
        if self._broken is not None:
            raise ServiceUnavailable(self._broken)

    def _check_unchanged(self):
        """Refuse to answer when the file is not the one this server last loaded or saved."""
        try:
            current = _identity(self.path)
        except FileNotFoundError:
            current = None
        if current != self._identity:
            raise StoreChangedError(
                f"{self.path} was replaced or written by another process although this server "
                "owns it; nothing is answered from a state the file may no longer hold "
                "(restart the server to serve the file's state)")

    @contextlib.contextmanager
    def _reading(self):
        with self._rw.read():
            self._check_usable()
            self._check_unchanged()
            yield self._mem

    def _mutate(self, fn, *, receipt=False):
        """Apply ``fn(memory)`` as the one writer, save if it moved, restore if it failed.

        With ``receipt=True``, ``fn`` returns a :class:`DeletionReceipt`, which is appended to
        the receipt log after the save, still under the writer's lock (the log's order is the
        order of the operations), and returned as its dict form.

        Returns
        -------
        out : whatever ``fn`` returned
        notes : list of str
            The warnings issued (over budget, a committed save whose directory fsync failed).
        """
        with self._rw.write(), self._owner.writing():
            self._check_usable()
            self._check_unchanged()
            mem = self._mem
            revision = mem.revision
            # one writer at a time, and readers issue no warnings: recording them is safe here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if receipt:
                        self._receipts.catch_up(mem._receipt_chain)
                    out = fn(mem)
                    if receipt:
                        out, line = self._link(mem, out)
                    if mem.revision != revision:
                        mem.save(self.path)
                        self._identity = _identity(self.path)
                except BaseException as exc:
                    if mem.revision != revision or not isinstance(
                            exc, (ValueError, TypeError, KeyError)):
                        self._restore()
                    raise
            notes = [str(w.message) for w in caught]
            if receipt:
                try:
                    self._receipts.append(line)
                except OSError as exc:  # the change is committed: say so, it did not fail
                    notes.append(f"the receipt was not yet written to {self._receipts.path} "
                                 f"({exc}); the store holds it, and it is appended before the "
                                 "next receipt or at the next start")
            return out, notes

    def _link(self, mem, receipt):
        """The logged form of a receipt (its dict with ``prev``) and its line; moves the
        memory's chain head past it (saved with the operation, before the line is
        appended)."""
        prev, start = next_link(mem._receipt_chain, self._receipts.lines or [])
        entry = {**receipt.to_dict(), "prev": prev}
        line = chain_line(entry)
        mem._receipt_chain = advance(start, line)
        return entry, line

    # ------------------------------------------------------------------ inputs
    def _embed(self, text):
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        with self._encode_lock:  # fast tokenizers are not safe to share between threads
            return self._encode(text)

    def _key_of(self, body):
        """The key of a request: ``key`` as given, ``text`` embedded, or None for neither."""
        if "key" in body and "text" in body:
            raise ValueError("give key or text, not both")
        if "text" in body:
            if not self.text_keys:
                raise ValueError("this store holds vector keys (created without --text); "
                                 "use key")
            return self._embed(body["text"])
        return body.get("key")

    def _check_value_size(self, value):
        try:
            size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":"))
                       .encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError, RecursionError):
            return  # not JSON: the memory refuses it with its own message
        if size > self._max_value:
            raise TooLarge(f"value is {size} bytes of JSON, more than this server's limit of "
                           f"{self._max_value} (--max-value-bytes)")

    def _summary(self, mem):
        return {"n_records": len(mem), "digest": mem.state_digest(), "revision": mem.revision}

    # ------------------------------------------------------------------ writes
    def add(self, body):
        """``POST /records``: ``{key | text, value, id?}`` -> id, evictions, digest."""
        body = _fields(body, ("key", "text", "value", "id"), "add")
        if "value" not in body:
            raise ValueError("add needs value (null stores null)")
        key = self._key_of(body)
        if key is None:
            raise ValueError("add needs key or text")
        self._check_value_size(body["value"])

        def apply(mem):
            result = mem.add_record(key, body["value"], record_id=body.get("id"))
            return {"record_id": result.record_id, "evicted": list(result.evicted),
                    **self._summary(mem)}

        out, notes = self._mutate(apply)
        return {**out, "warnings": notes}

    def _receipted(self, apply):
        entry, notes = self._mutate(apply, receipt=True)
        return {**entry, "warnings": notes}

    def forget(self, record_id, *, audit=False, verify=True):
        """``DELETE /records/{id}``: exact forget -> the receipt (also logged)."""
        return self._receipted(lambda mem: mem.forget(record_id, audit=audit, verify=verify))

    def edit(self, record_id, body):
        """``PATCH /records/{id}``: ``{value?, key? | text?, audit?, verify?}`` -> the receipt."""
        body = _fields(body, ("value", "key", "text", "audit", "verify"), "edit")
        # verify as given: the memory knows its levels (True, False or a level's name)
        kwargs = {"audit": _flag(body, "audit"), "verify": body.get("verify", True)}
        key = self._key_of(body)
        if key is not None:
            kwargs["key"] = key
        if "value" in body:
            self._check_value_size(body["value"])
            kwargs["value"] = body["value"]
        return self._receipted(lambda mem: mem.edit(record_id, **kwargs))

    def evict(self, body):
        """``POST /evict``: ``{count?}`` or ``{budget}`` -> the evicted ids (certified)."""
        body = _fields(body, ("count", "budget"), "evict")
        if "count" in body and "budget" in body:
            raise ValueError("evict: give count or budget, not both")
        budget = body.get("budget")
        if "budget" in body and (isinstance(budget, bool) or
                                 not isinstance(budget, numbers.Integral) or budget < 0):
            raise ValueError(f"budget must be an integer >= 0; got {budget!r}")

        def apply(mem):
            count = body.get("count") if budget is None else max(0, len(mem) - int(budget))
            return {"evicted": list(mem.evict_reserve(count)), **self._summary(mem)}

        out, notes = self._mutate(apply)
        return {**out, "warnings": notes}

    # ------------------------------------------------------------------ reads
    def query(self, body):
        """``POST /query``: ``{key | text, k?, min_similarity?}`` -> hits (score, weight)."""
        body = _fields(body, ("key", "text", "k", "min_similarity"), "query")
        key = self._key_of(body)
        if key is None:
            raise ValueError("query needs key or text")
        with self._reading() as mem:
            hits = mem.query(key, k=body.get("k", 1), min_similarity=body.get("min_similarity"))
            return {"hits": [_hit(h) for h in hits], "revision": mem.revision}

    def records(self, offset=0, limit=DEFAULT_PAGE):
        """``GET /records``: one page of held records (id, value, partition), insertion order."""
        offset, limit = _page(offset, limit)
        with self._reading() as mem:
            ids = mem.record_ids
            where = {rid: name for name, members in mem.partition().items()
                     for rid in members}
            page = [{"record_id": rid, "value": mem.get(rid), "partition": where[rid]}
                    for rid in ids[offset: offset + limit]]
            return {"records": page, "total": len(ids), "offset": offset, "limit": limit,
                    **self._summary(mem)}

    def record(self, record_id):
        """``GET /records/{id}``: one held record with its key; KeyError when not held."""
        with self._reading() as mem:
            value = mem.get(record_id)
            where = next(name for name, members in mem.partition().items()
                         if record_id in members)
            return {"record_id": record_id, "value": value, "partition": where,
                    "key": mem.key(record_id).tolist(), "revision": mem.revision}

    def audit(self):
        """``GET /audit``: recompute the certificate (a fresh solve: costly at large n)."""
        with self._reading() as mem:
            report = {**mem.audit().to_dict(), "tombstones": len(mem.tombstones),
                      "revision": mem.revision, "signed": self.signed, "time": time.time()}
            self._latest_audit = report
            return report

    def latest_audit(self):
        """``GET /audit/latest``: the last audit computed (None before the first)."""
        with self._reading():
            return {"audit": self._latest_audit}

    def receipts(self, offset=0, limit=DEFAULT_PAGE):
        """``GET /receipts``: one page of the receipt log, oldest first."""
        offset, limit = _page(offset, limit)
        with self._reading() as mem:
            entries = self._receipts.entries
            return {"receipts": entries[offset: offset + limit], "total": len(entries),
                    "offset": offset, "limit": limit, "signed": self.signed,
                    **self._summary(mem)}
