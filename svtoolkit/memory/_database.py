"""The store database: a memory's persistent form, one SQLite file (``docs/memory.md``, "Store
database").

Tables::

    meta(name PRIMARY KEY, value)   header (canonical JSON: configuration, counters, the state
                                    digest, the receipt chain's head, the solver's scalars),
                                    the solver's small arrays (S, R, fs, ist), signed, seal,
                                    mac
    records(sid PRIMARY KEY, record_id UNIQUE, key, value)   one row per held record
    tombstones(seq PRIMARY KEY, record_id UNIQUE, reason, time)   in the order they were made
    slots(name, block, data)        the solver's per-slot arrays (ids, alpha, grad, status) in
                                    blocks of SLOT_BLOCK slots

Arrays are raw little-endian bytes. A save to the database a memory was read from or last
wrote (its :class:`Binding`: same store id, same seal) writes only what changed since, in one
transaction: the rows of the records added, edited or dropped, the tombstones made or
dropped, the slot blocks whose bytes changed (the gradient moves everywhere at every
operation: 8 bytes a key; keys, values and the margin kernel rows are not rewritten), and the
meta rows. Any other save builds a whole database in memory and renames it over the target
(:func:`._atomic.atomic_write`).

The seal is a sha256 (it detects damage) over the header, the small arrays, and the roots of
two-level hashes of the slot blocks and of the tombstones (blocks of TOMB_BLOCK sequence
numbers), so that a write rehashes only what it wrote; a signed store also holds the
HMAC-SHA256 of the same under its key (it detects forgery). The records enter through the
header's state digest, which a load recomputes from the records it read.

Erasure: every connection that writes sets ``secure_delete`` (SQLite overwrites deleted
content with zeros) and the rollback journal (``journal_mode=DELETE``), which holds the
changed pages as they were during a transaction and is deleted at its commit: once a forget
is committed, no file of the store holds the forgotten key or value.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sqlite3
import struct
from dataclasses import dataclass, field

import numpy as np

from . import _atomic
from ._format import READABLE_VERSIONS as _SINGLE_FILE_VERSIONS
from ._format import FORMAT_NAME, is_signed_file, parse_header
from ._errors import MemoryAuthenticationError, MemoryFileError
from ._signing import file_mac, macs_equal

__all__ = ["SQLITE_MAGIC", "FORMAT_VERSION", "READABLE_VERSIONS", "SLOT_ARRAYS",
           "SMALL_ARRAYS", "Binding", "Stored", "is_database", "is_signed_database",
           "is_signed_store", "write_new", "write_changes", "read"]

#: First 16 bytes of every SQLite database file.
SQLITE_MAGIC = b"SQLite format 3\x00"
#: ``PRAGMA user_version`` of the store databases this version writes and reads (versions 1
#: and 2 were single files: :mod:`._format` reads them, the next save converts them).
FORMAT_VERSION = 3
#: Format versions :meth:`ForgettableMemory.load` reads: the single files of versions 1 and 2
#: and the store database of version 3.
READABLE_VERSIONS = (*_SINGLE_FILE_VERSIONS, FORMAT_VERSION)
#: ``PRAGMA application_id``: "SVKM".
APPLICATION_ID = 0x53564B4D
#: Slots per block of the solver's per-slot arrays.
SLOT_BLOCK = 4096
#: Tombstone sequence numbers per hashed block.
TOMB_BLOCK = 64
#: The solver's per-slot arrays (one entry per key) and their stored dtypes.
SLOT_ARRAYS = {"ids": "<i8", "alpha": "<f8", "grad": "<f8", "status": "|i1"}
#: The solver's small arrays (margin list, bordered inverse, scalars) and their dtypes.
SMALL_ARRAYS = {"S": "<i8", "R": "<f8", "fs": "<f8", "ist": "<i8"}
#: Records a page of a new database is sized to hold (:func:`page_size`; fewer past 64 KiB).
#: SQLite keeps a row whole on one leaf page and leaves the rest of the page empty, so on its
#: default 4 KiB page a record of d = 384 (a 3 KiB key) filled three quarters of a page:
#: 41.5 MB for 10^4 records whose content is 32.7 MB.
RECORDS_PER_PAGE = 4
#: Bytes of a record row besides its key (id, value, SQLite's cell and row headers), for
#: :func:`page_size`: ids and values are usually short; a longer one only packs less well.
_ROW_EXTRA = 64
#: Seconds a connection waits for another one's lock (a reader of the whole store, a writer).
BUSY_TIMEOUT_S = 30.0
_SEAL_TAG = b"svtoolkit.ForgettableMemory/database/v3\x00"
_TOMB_TAG = b"svtoolkit.ForgettableMemory/tombstones/v3\x00"
_U64 = struct.Struct("<Q")
_SCHEMA = (
    "CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID",
    "CREATE TABLE records(sid INTEGER PRIMARY KEY, record_id TEXT NOT NULL UNIQUE, "
    "key BLOB NOT NULL, value TEXT NOT NULL)",
    "CREATE TABLE tombstones(seq INTEGER PRIMARY KEY, record_id TEXT NOT NULL UNIQUE, "
    "reason TEXT NOT NULL, time REAL NOT NULL)",
    "CREATE TABLE slots(name TEXT NOT NULL, block INTEGER NOT NULL, data BLOB NOT NULL, "
    "PRIMARY KEY (name, block)) WITHOUT ROWID",
)
_TABLES = ("meta", "records", "slots", "tombstones")


@dataclass
class Binding:
    """What a memory knows of the database it was read from or last wrote: enough to write
    the next state as a change of that one, and to tell that the file still holds it.

    Attributes
    ----------
    path : str
        Real path of the database.
    store_id : str
        32 hex digits, fixed when the database was created (a rename over it makes another).
    seal : str
        The seal of the state last read or written (hex).
    slots : dict
        name -> ndarray: the per-slot arrays as stored.
    slot_hashes : dict
        name -> list of bytes: sha256 of each stored block.
    tomb_seq : dict
        record_id -> sequence number of its tombstone row.
    tomb_rows : dict
        sequence number -> the row's canonical bytes (what its block hash covers).
    tomb_hashes : dict
        block -> sha256 of its rows.
    next_seq : int
        The sequence number the next tombstone gets.
    """

    path: str
    store_id: str
    seal: str
    slots: dict
    slot_hashes: dict
    tomb_seq: dict = field(default_factory=dict)
    tomb_rows: dict = field(default_factory=dict)
    tomb_hashes: dict = field(default_factory=dict)
    next_seq: int = 0


# ---------------------------------------------------------------------------- identification
def _head(path, size):
    try:
        with open(path, "rb") as fh:
            return fh.read(size)
    except FileNotFoundError:
        return b""


def is_database(path):
    """True when ``path`` starts like an SQLite database (reads 16 bytes; False when absent)."""
    return _head(path, len(SQLITE_MAGIC)) == SQLITE_MAGIC


def is_signed_database(path):
    """True when the store database at ``path`` says it is signed (no seal check here)."""
    if not is_database(path):
        return False
    try:
        with _reader(path) as con:
            row = con.execute("SELECT value FROM meta WHERE name = 'signed'").fetchone()
    except sqlite3.Error:
        return False
    return row is not None and row[0] == 1


def is_signed_store(path):
    """True when the store at ``path`` (a database, or a single file of an earlier version)
    says it is signed."""
    return is_signed_database(path) or is_signed_file(path)


# ---------------------------------------------------------------------------- connections
def _configure(con):
    con.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    con.execute("PRAGMA secure_delete = ON")
    mode = con.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
    if mode != "delete":
        raise MemoryFileError(f"the store database cannot use the rollback journal "
                              f"(journal_mode is {mode!r})")
    con.execute("PRAGMA synchronous = FULL")
    con.execute("PRAGMA temp_store = MEMORY")
    return con


class _reader:
    """A connection for one read of a whole state (one transaction: a consistent snapshot)."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.con = _configure(sqlite3.connect(self.path, isolation_level=None,
                                              timeout=BUSY_TIMEOUT_S))
        self.con.execute("BEGIN")
        return self.con

    def __exit__(self, *exc):
        try:
            self.con.execute("COMMIT")
        finally:
            self.con.close()


# ---------------------------------------------------------------------------- hashing
def _block_bytes(array, block):
    return array[block * SLOT_BLOCK:(block + 1) * SLOT_BLOCK].tobytes()


def _slot_root(slot_hashes):
    h = hashlib.sha256()
    for name in SLOT_ARRAYS:
        hashes = slot_hashes[name]
        h.update(_U64.pack(len(hashes)))
        h.update(b"".join(hashes))
    return h.digest()


def _tomb_row(seq, record_id, reason, when):
    return json.dumps([seq, record_id, reason, when], ensure_ascii=False, allow_nan=True,
                      separators=(",", ":")).encode("utf-8", "surrogatepass")


def _tomb_block_hash(rows, block):
    h = hashlib.sha256(_TOMB_TAG)
    for seq in range(block * TOMB_BLOCK, (block + 1) * TOMB_BLOCK):
        row = rows.get(seq)
        if row is not None:
            h.update(_U64.pack(len(row)))
            h.update(row)
    return h.digest()


def _tomb_root(tomb_hashes):
    h = hashlib.sha256(_U64.pack(len(tomb_hashes)))
    for block in sorted(tomb_hashes):
        h.update(_U64.pack(block))
        h.update(tomb_hashes[block])
    return h.digest()


def _seal(key, header_text, small, slot_hashes, tomb_hashes):
    """``(seal, mac)``: the hex sha256 over everything but the record rows, and the hex
    HMAC-SHA256 of the same under ``key`` ("" without a key)."""
    parts = [_SEAL_TAG]
    for chunk in (header_text, *(small[name] for name in SMALL_ARRAYS),
                  _slot_root(slot_hashes), _tomb_root(tomb_hashes)):
        parts += [_U64.pack(len(chunk)), chunk]
    seal = hashlib.sha256(b"".join(parts)).hexdigest()
    return seal, ("" if key is None else file_mac(key, parts).hex())


def _header_text(header):
    return json.dumps(header, ensure_ascii=False, allow_nan=False, sort_keys=True,
                      separators=(",", ":")).encode("utf-8", "surrogatepass")


def _small_bytes(arrays):
    return {name: np.ascontiguousarray(arrays[name], dtype=dtype).tobytes()
            for name, dtype in SMALL_ARRAYS.items()}


def _slot_arrays(arrays):
    return {name: np.ascontiguousarray(arrays[name], dtype=dtype).copy()
            for name, dtype in SLOT_ARRAYS.items()}


def _full_header(header, arrays, store_id, n_tombstones):
    n_records = int(np.count_nonzero(np.asarray(arrays["ids"]) >= 0))  # one per real slot
    return {**header, "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "store_id": store_id, "slot_block": SLOT_BLOCK, "n_records": n_records,
            "n_tombstones": n_tombstones,
            "arrays": {name: list(np.shape(arrays[name])) for name in SMALL_ARRAYS}}


# ---------------------------------------------------------------------------- writing
def page_size(key_bytes):
    """The page size of a new database whose keys are ``key_bytes`` long: the smallest power
    of two from SQLite's default 4096 to its largest, 65536, that holds
    :data:`RECORDS_PER_PAGE` records (16384 for d = 384: 5 records, 95 % of the page; 4096
    for d <= 120). A change writes whole pages, so larger pages cost more bytes per commit:
    they are taken only where a small page would be mostly empty."""
    need = RECORDS_PER_PAGE * (key_bytes + _ROW_EXTRA)
    size = 4096
    while size < need and size < 65536:
        size *= 2
    return size


def _record_row(sid, row):
    record_id, key, text = row
    return sid, record_id, np.ascontiguousarray(key, dtype="<f8").tobytes(), text


def _write_meta(con, header_text, small, seal, mac):
    rows = [("header", header_text), ("signed", int(bool(mac))), ("seal", seal), ("mac", mac)]
    rows += [(f"array:{name}", small[name]) for name in SMALL_ARRAYS]
    con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", rows)


def write_new(path, header, arrays, rows, tombstones, key):
    """Write a whole new database over ``path`` (built in memory, renamed into place).

    Parameters
    ----------
    path : str
        Real path of the store.
    header : dict
        JSON-serialisable header fields (configuration, counters, digest, solver scalars).
    arrays : dict
        The solver's arrays: :data:`SLOT_ARRAYS` (shape (n,)) and :data:`SMALL_ARRAYS`.
    rows : iterable of (sid, (record_id, key, value_text))
        Every held record.
    tombstones : dict
        record_id -> (reason, time), in the order they were made.
    key : bytes or None
        Signing key.

    Returns
    -------
    Binding
        The written state (for :func:`write_changes`).

    Raises
    ------
    StoreOwnedError, OSError
        As :func:`._atomic.atomic_write` (nothing changed).
    """
    store_id = secrets.token_hex(16)
    records = [_record_row(sid, row) for sid, row in rows]
    con = sqlite3.connect(":memory:", isolation_level=None)
    try:
        # before the first table: a database's page size is fixed once it holds one
        con.execute(f"PRAGMA page_size = {page_size(len(records[0][2]) if records else 0)}")
        con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        con.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
        con.execute("BEGIN")
        for statement in _SCHEMA:
            con.execute(statement)
        con.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", records)
        binding = Binding(path, store_id, "", _slot_arrays(arrays), {})
        for name, array in binding.slots.items():
            blocks = [_block_bytes(array, b) for b in range(-(-len(array) // SLOT_BLOCK))]
            binding.slot_hashes[name] = [hashlib.sha256(b).digest() for b in blocks]
            con.executemany("INSERT INTO slots VALUES (?, ?, ?)",
                            [(name, b, data) for b, data in enumerate(blocks)])
        _insert_tombstones(con, binding, tombstones.items())
        small = _small_bytes(arrays)
        text = _header_text(_full_header(header, arrays, store_id, len(tombstones)))
        binding.seal, mac = _seal(key, text, small, binding.slot_hashes, binding.tomb_hashes)
        _write_meta(con, text, small, binding.seal, mac)
        con.execute("COMMIT")
        data = con.serialize()
    finally:
        con.close()
    with _atomic.writing(path):
        _settle_journal(path)
        # page-sized chunks: the seam of the crash tests sees the file being written
        _atomic.atomic_write(path, (data[i:i + 4096] for i in range(0, len(data), 4096)))
        _remove_journal(path)
    return binding


def _settle_journal(path):
    """Before a new database replaces ``path``: roll back a hot journal that a killed writer
    left (the file it belongs to is whole again should the replacement not happen)."""
    if not os.path.exists(path + "-journal") or not is_database(path):
        return
    con = _configure(sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S))
    try:
        con.execute("BEGIN IMMEDIATE")  # a hot journal is played back here
        con.execute("ROLLBACK")
    finally:
        con.close()


def _remove_journal(path):
    """After the rename: a journal left beside the store belongs to the replaced file (SQLite
    ignores one its writer never committed, and it holds that file's pages); remove it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + "-journal")


def _insert_tombstones(con, binding, items):
    """Append tombstone rows (record_id, (reason, time)) with the next sequence numbers."""
    new = []
    for record_id, (reason, when) in items:
        seq = binding.next_seq
        binding.next_seq += 1
        binding.tomb_seq[record_id] = seq
        binding.tomb_rows[seq] = _tomb_row(seq, record_id, reason, when)
        new.append((seq, record_id, reason, when))
    con.executemany("INSERT INTO tombstones VALUES (?, ?, ?, ?)", new)
    for block in {seq // TOMB_BLOCK for seq, *_ in new}:
        binding.tomb_hashes[block] = _tomb_block_hash(binding.tomb_rows, block)


def write_changes(binding, header, arrays, rows, tombstones, changed_sids, changed_tombs, key):
    """Write the state as a change of the one ``binding`` describes, in one transaction.

    Parameters
    ----------
    binding : Binding
        Updated in place to the written state (its cost is the change's, not the store's);
        after a failure it no longer describes the file and must be dropped (the next save
        then writes a new database).
    header, arrays, key
        As :func:`write_new`.
    rows : callable
        ``sid -> (record_id, key, value_text)`` or None when the slot holds no record.
    tombstones : dict
        The memory's tombstones (record_id -> (reason, time)).
    changed_sids : set
        Slots whose records may differ from what the database holds.
    changed_tombs : dict
        Record ids whose tombstone may differ (keys, in the order of their last change: new
        tombstones are written in that order, the order of ``tombstones``).

    Returns
    -------
    Binding or None
        ``binding``, now the written state; None (nothing written) when the file no longer
        holds the state of ``binding`` (the caller then writes a new database).

    Raises
    ------
    StoreOwnedError, OSError
        Nothing changed (the transaction rolled back).
    """
    try:
        con = _configure(sqlite3.connect(binding.path, isolation_level=None,
                                         timeout=BUSY_TIMEOUT_S))
    except sqlite3.Error:
        return None
    try:
        return _apply(con, binding, header, arrays, rows, tombstones, changed_sids,
                      changed_tombs, key)
    except sqlite3.Error as exc:
        raise OSError(f"{binding.path}: the store database could not be written ({exc}); "
                      "nothing changed") from exc
    finally:
        con.close()


def _apply(con, new, header, arrays, rows, tombstones, changed_sids, changed_tombs, key):
    """The transaction of :func:`write_changes` on an open connection."""
    with _atomic.writing(new.path):
        _atomic.remove_stale_temps(new.path)  # they can hold records forgotten since
        con.execute("BEGIN IMMEDIATE")
        try:
            if not _holds(con, new):
                con.execute("ROLLBACK")
                return None
            _write_records(con, rows, changed_sids)
            _write_tombstones(con, new, tombstones, changed_tombs)
            _write_slots(con, new, arrays)
            small = _small_bytes(arrays)
            text = _header_text(_full_header(header, arrays, new.store_id, len(tombstones)))
            new.seal, mac = _seal(key, text, small, new.slot_hashes, new.tomb_hashes)
            _write_meta(con, text, small, new.seal, mac)
            con.execute("COMMIT")
        except BaseException:
            if con.in_transaction:
                con.execute("ROLLBACK")
            raise
    return new


def _holds(con, binding):
    """True when the open database still holds the state ``binding`` describes."""
    try:
        meta = dict(con.execute("SELECT name, value FROM meta WHERE name IN "
                                "('header', 'seal')").fetchall())
        header = json.loads(meta["header"])
    except (sqlite3.Error, KeyError, ValueError, TypeError):
        return False
    return isinstance(header, dict) and header.get("store_id") == binding.store_id and \
        meta["seal"] == binding.seal


def _write_records(con, rows, changed_sids):
    """Drop, then (re)write, the rows of the changed slots."""
    held, dropped = [], []
    for sid in sorted(changed_sids):
        row = rows(sid)
        (dropped if row is None else held).append((sid, row))
    # the drops first: an id forgotten and added again in one interval changes its slot
    con.executemany("DELETE FROM records WHERE sid = ?", [(sid,) for sid, _ in held + dropped])
    con.executemany("INSERT INTO records VALUES (?, ?, ?, ?)",
                    [_record_row(sid, row) for sid, row in held])


def _write_tombstones(con, binding, tombstones, changed):
    gone = [rid for rid in changed if rid in binding.tomb_seq]
    dropped_blocks = set()
    for record_id in gone:
        seq = binding.tomb_seq.pop(record_id)
        del binding.tomb_rows[seq]
        dropped_blocks.add(seq // TOMB_BLOCK)
    con.executemany("DELETE FROM tombstones WHERE record_id = ?", [(r,) for r in gone])
    made = [rid for rid in changed if rid in tombstones]  # the order they were made in
    _insert_tombstones(con, binding, [(rid, tombstones[rid]) for rid in made])
    for block in dropped_blocks:
        if any(s in binding.tomb_rows for s in range(block * TOMB_BLOCK,
                                                     (block + 1) * TOMB_BLOCK)):
            binding.tomb_hashes[block] = _tomb_block_hash(binding.tomb_rows, block)
        else:
            binding.tomb_hashes.pop(block, None)


def _write_slots(con, binding, arrays):
    """Write the blocks whose bytes changed, drop the blocks past the end."""
    for name, dtype in SLOT_ARRAYS.items():
        array = np.ascontiguousarray(arrays[name], dtype=dtype)
        old = binding.slots[name]
        hashes = binding.slot_hashes[name]
        n_blocks = -(-len(array) // SLOT_BLOCK)
        changed = []
        for b in range(n_blocks):
            data = _block_bytes(array, b)
            if b < len(hashes) and data == _block_bytes(old, b):
                continue
            digest = hashlib.sha256(data).digest()
            if b < len(hashes):
                hashes[b] = digest
            else:
                hashes.append(digest)
            changed.append((name, b, data))
        con.executemany("INSERT OR REPLACE INTO slots VALUES (?, ?, ?)", changed)
        if len(hashes) > n_blocks:
            con.execute("DELETE FROM slots WHERE name = ? AND block >= ?", (name, n_blocks))
            del hashes[n_blocks:]
        binding.slots[name] = array  # the caller's copy (state_dict): nothing writes it


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Stored:
    """A database's contents, its seal verified (with a key: its MAC).

    Attributes
    ----------
    header : dict
    arrays : dict
        Every array of :data:`SLOT_ARRAYS` and :data:`SMALL_ARRAYS`.
    records : dict
        sid -> (record_id, key bytes, value_text).
    tombstones : list
        ``[record_id, reason, time]`` in sequence order.
    signed : bool
    binding : Binding
    """

    header: dict
    arrays: dict
    records: dict
    tombstones: list
    signed: bool
    binding: Binding


def read(path, key=None):
    """Read a store database whole (one transaction) and check its seal.

    Parameters
    ----------
    path : str
        Real path of the store.
    key : bytes, optional
        Signing key: the database must then be signed and its MAC verify.

    Returns
    -------
    Stored

    Raises
    ------
    MemoryAuthenticationError
        With a key: not signed, or the MAC does not verify.
    MemoryFileError
        Not a store database of this version, a missing table or row, arrays that do not fit
        their shapes, or a seal mismatch (damaged, or changed without resealing).
    """
    try:
        with _reader(path) as con:
            app, version = (con.execute(f"PRAGMA {p}").fetchone()[0]
                            for p in ("application_id", "user_version"))
            if app != APPLICATION_ID:
                raise MemoryFileError("an SQLite database, but not an svtoolkit memory store")
            if version != FORMAT_VERSION:
                raise MemoryFileError(f"unsupported store database version {version}; this "
                                      f"svtoolkit reads version {FORMAT_VERSION}")
            tables = {r[0] for r in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not set(_TABLES) <= tables:
                raise MemoryFileError("the store database lacks the tables "
                                      f"{sorted(set(_TABLES) - tables)}")
            meta = dict(con.execute("SELECT name, value FROM meta").fetchall())
            slot_rows = con.execute("SELECT name, block, data FROM slots "
                                    "ORDER BY name, block").fetchall()
            tomb_rows = con.execute("SELECT seq, record_id, reason, time FROM tombstones "
                                    "ORDER BY seq").fetchall()
            record_rows = con.execute("SELECT sid, record_id, key, value FROM records"
                                      ).fetchall()
    except sqlite3.DatabaseError as exc:
        raise MemoryFileError(f"not a readable store database ({exc})") from None
    return _parse(meta, slot_rows, tomb_rows, record_rows, path, key)


def _meta_field(meta, name, kind):
    value = meta.get(name)
    if not isinstance(value, kind):
        raise MemoryFileError(f"the store database's meta row {name!r} is missing or not "
                              f"{kind.__name__}")
    return value


def _parse(meta, slot_rows, tomb_rows, record_rows, path, key):
    header_text = _meta_field(meta, "header", bytes)
    signed = _meta_field(meta, "signed", int)
    if signed not in (0, 1):
        raise MemoryFileError(f"the store database's meta row 'signed' is {signed!r}, not 0 "
                              "or 1")
    signed = bool(signed)
    seal = _meta_field(meta, "seal", str)
    mac = _meta_field(meta, "mac", str)
    if signed != bool(mac):
        raise MemoryFileError("the store database's meta rows disagree: 'signed' is "
                              f"{int(signed)} but it holds {'a' if mac else 'no'} MAC")
    small = {name: _meta_field(meta, f"array:{name}", bytes) for name in SMALL_ARRAYS}
    slot_blocks = {name: [] for name in SLOT_ARRAYS}
    for name, block, data in slot_rows:
        if name not in slot_blocks or block != len(slot_blocks[name]) or \
                not isinstance(data, bytes):
            raise MemoryFileError(f"the store's slot blocks are not contiguous ({name!r}, "
                                  f"block {block})")
        slot_blocks[name].append(data)
    slot_hashes = {n: [hashlib.sha256(b).digest() for b in blocks]
                   for n, blocks in slot_blocks.items()}
    binding = Binding(path, "", seal, {}, slot_hashes)
    tombstones = []
    for seq, record_id, reason, when in tomb_rows:
        binding.tomb_seq[record_id] = seq
        binding.tomb_rows[seq] = _tomb_row(seq, record_id, reason, when)
        tombstones.append([record_id, reason, when])
    binding.next_seq = tomb_rows[-1][0] + 1 if tomb_rows else 0
    for block in {seq // TOMB_BLOCK for seq in binding.tomb_rows}:
        binding.tomb_hashes[block] = _tomb_block_hash(binding.tomb_rows, block)
    _check_seal(key, signed, seal, mac, header_text, small, slot_hashes, binding.tomb_hashes)
    header = parse_header(header_text, FORMAT_VERSION, "store", "surrogatepass")
    binding.store_id = header["store_id"]
    arrays = _parse_arrays(header, small, slot_blocks)
    binding.slots = {name: arrays[name].copy() for name in SLOT_ARRAYS}
    if header["n_records"] != len(record_rows) or header["n_tombstones"] != len(tombstones):
        raise MemoryFileError("the store's record or tombstone count disagrees with its header")
    records = {sid: (rid, k, text) for sid, rid, k, text in record_rows}
    return Stored(header, arrays, records, tombstones, signed, binding)


def _check_seal(key, signed, seal, mac, header_text, small, slot_hashes, tomb_hashes):
    """The seal always (damage, signed or not); with a key, the MAC too (forgery)."""
    found, found_mac = _seal(key, header_text, small, slot_hashes, tomb_hashes)
    if found != seal:
        raise MemoryFileError("seal mismatch: the store is damaged or was modified after it "
                              "was written")
    if key is not None:
        if not signed:
            raise MemoryAuthenticationError(
                "the store is not signed (no MAC), but a signing key was given: it was saved "
                "without a key, or its MAC was stripped")
        if not macs_equal(found_mac, mac):
            raise MemoryAuthenticationError(
                "MAC mismatch: the store was modified after it was signed, or signed with "
                "another key")


def _parse_arrays(header, small, slot_blocks):
    out = {}
    shapes = header["arrays"]
    for name, dtype in SMALL_ARRAYS.items():
        shape = tuple(int(s) for s in shapes[name])
        raw = small[name]
        if len(raw) != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise MemoryFileError(f"array {name!r} does not fit its declared shape {shape}")
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    n = int(header["n"])
    for name, dtype in SLOT_ARRAYS.items():
        array = np.frombuffer(b"".join(slot_blocks[name]), dtype=dtype)
        if array.shape != (n,) or len(slot_blocks[name]) != -(-n // SLOT_BLOCK):
            raise MemoryFileError(f"slot array {name!r} holds {array.shape[0]} entries in "
                                  f"{len(slot_blocks[name])} blocks; the header says {n}")
        out[name] = array.copy()
    return out
