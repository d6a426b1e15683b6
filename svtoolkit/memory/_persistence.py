"""The file side of :class:`~svtoolkit.memory.ForgettableMemory`: what
:meth:`~ForgettableMemory.save` writes into the store database (a change of the one the memory
is bound to, or a new one), and how :meth:`~ForgettableMemory.load` rebuilds a memory from a
store - the solver from its stored state, the record table from the store's records (checked
in bulk), the tombstones and counters - and verifies it (the solver's numbers at the chosen
level, then the state digest). The formats themselves are :mod:`._database` (written) and
:mod:`._format` (the single files of earlier versions, read).
"""

from __future__ import annotations

import json

import numpy as np

from ..exact import IncrementalSVDD
from . import _atomic, _database, _format, _table
from ._audit import RollingAudit
from ._certificates import fresh_work, maintained_kkt
from ._codec import check_record_id, check_utf8, non_canonical_values
from ._errors import MemoryAuthenticationError, MemoryFileError

__all__ = ["save", "load", "from_contents", "install", "checked_records"]


def save(mem, path, key):
    """Write ``mem`` to ``path``: as a change of the database it is bound to when ``path`` is
    that database and still holds the state it last read or wrote, else as a new database
    (a single file of an earlier version is converted so); ``mem`` is then bound to it."""
    target = _atomic.resolve(path)
    header, arrays = _parts(mem)
    binding = mem._binding
    written = None
    if binding is not None and binding.path == target and _database.is_database(target):
        try:
            written = _database.write_changes(
                binding, header, arrays, mem._table.row, mem._tombstones,
                mem._table.changed_sids, mem._tombstones_changed, key)
        except BaseException:
            mem._binding = None  # it may describe neither state now: the next save is whole
            raise
    if written is None:
        rows = ((sid, mem._table.row(sid)) for sid in mem._solver.ids.tolist())
        written = _database.write_new(target, header, arrays, rows, mem._tombstones, key)
    mem._binding = written
    mem._table.changed_sids.clear()
    mem._tombstones_changed.clear()


def _parts(mem):
    """The header fields and solver arrays a store database holds for ``mem``."""
    state = mem._solver.state_dict(compact=True)
    arrays = {name: state.pop(name) for name in (*_database.SLOT_ARRAYS,
                                                 *_database.SMALL_ARRAYS)}
    header = {
        "config": {"C": mem.C, "sigma": mem.sigma, "nu": mem._nu, "n0": mem._n0,
                   "budget": mem._budget, "min_similarity": mem._min_similarity},
        "metadata_json": mem._metadata_text,
        "next_auto": mem._next_auto,
        "revision": mem._revision,
        "digest": mem.state_digest(),
        "audit_cursor": [int(c) for c in mem._rolling.cursor()],
        "receipt_chain": mem._receipt_chain,
        "solver_scalars": state,
        "n": int(arrays["ids"].shape[0]),
    }
    return header, arrays


def load(cls, path, key, verify, fresh_limit):
    """A ``cls`` memory read from the store at ``path`` (a database, or a single file of an
    earlier version), checked at the level ``verify`` (see :func:`from_contents`)."""
    target = _atomic.resolve(path)
    if not _database.is_database(target):
        contents = _format.parse_file(_atomic.read_file(target), key)
        return from_contents(cls, contents, key, verify, fresh_limit)
    stored = _database.read(target, key)
    mem = from_contents(cls, _database_contents(stored), key, verify, fresh_limit)
    mem._binding = stored.binding
    mem._table.changed_sids.clear()
    return mem


def _database_contents(stored):
    """The :class:`_format.FileContents` of a read database: the solver's state with its keys
    (the records' keys in slot order; the warm-up anchor's column is zero), the record list
    in insertion order."""
    header, arrays = stored.header, stored.arrays
    state = {**header["solver_scalars"], **arrays}
    ids = arrays["ids"]
    d = int(state["d"])
    Xt = np.zeros((max(d, 0), ids.shape[0]))
    real = np.flatnonzero(ids >= 0)
    keys = []
    try:
        for sid in ids[real].tolist():  # slot order (the solver's columns)
            keys.append(stored.records[sid][1])
    except KeyError:
        raise MemoryFileError("record table does not match the solver's keys") from None
    if len(keys) != len(stored.records) or any(len(k) != 8 * d for k in keys):
        raise MemoryFileError("record table does not match the solver's keys")
    if keys:
        Xt[:, real] = np.frombuffer(b"".join(keys), dtype="<f8").reshape(len(keys), d).T
    records = [[stored.records[sid][0], sid, stored.records[sid][2]]
               for sid in sorted(stored.records)]  # insertion order (solver ids ascend)
    state["Xt"] = Xt
    return _format.FileContents(
        version=_database.FORMAT_VERSION, signed=stored.signed, config=header["config"],
        metadata_text=header["metadata_json"], records=records,
        tombstones=stored.tombstones,
        next_auto=_format.parse_counter(header, "next_auto"),
        revision=_format.parse_counter(header, "revision"), digest=header["digest"],
        solver_state=state, audit_cursor=_format.parse_cursor(header),
        receipt_chain=_format.parse_chain(header))


def from_contents(cls, contents, key, verify, fresh_limit):
    """A ``cls`` memory built by its constructor from a parsed file, then filled and verified.

    ``verify`` is ``"auto"``, ``"full"``, ``"maintained"`` or ``"none"`` (see
    :meth:`ForgettableMemory.load`); ``"auto"`` is ``"maintained"`` only for a file signed
    with ``key`` whose fresh evaluation costs more than ``fresh_limit`` multiply-adds.
    """
    try:
        solver = IncrementalSVDD.from_state_dict(contents.solver_state)
    except ValueError as exc:
        raise MemoryFileError(f"inconsistent solver state: {exc}") from exc
    config = contents.config
    if config["C"] != solver.C or config["sigma"] != solver.sigma:
        raise MemoryFileError("configuration disagrees with the solver state (C, sigma)")
    mem = cls(sigma=solver.sigma, C=solver.C, budget=config["budget"],
              min_similarity=config["min_similarity"],
              metadata=json.loads(contents.metadata_text), signing_key=key)
    install(mem, solver, contents, nu=config["nu"], n0=config["n0"])
    if verify == "auto":
        verify = "maintained" if key is not None and fresh_work(solver) > fresh_limit \
            else "full"
    if verify == "full":
        found = solver.consistency()
        _format.check_solver_numbers(found, solver.fresh_inverse_residual)
        mem._kkt = (float(found.kkt_residual), "fresh")
    elif verify == "maintained":
        mem._kkt = (maintained_kkt(solver), "maintained")
        _format.check_maintained_numbers(mem._kkt[0])
    mem._load_verification = verify
    stored = mem.state_digest() if contents.version >= 2 else _table.state_digest_v1(
        solver, mem._table, mem._budget, mem._min_similarity)
    if stored != contents.digest:
        if key is not None and contents.version == _database.FORMAT_VERSION:
            # the signed header holds the digest: a record changed by someone without the key
            raise MemoryAuthenticationError("state digest mismatch: the records differ from "
                                            "what was signed")
        raise MemoryFileError("state digest mismatch: the records differ from what was "
                              "saved")
    return mem


def install(mem, solver, contents, *, nu, n0):
    """Install a loaded solver, its record table, tombstones and counters into ``mem``, a
    freshly built memory."""
    solver.audit_every = 0  # the rolling audit replaces the solver's periodic one
    mem._solver = solver
    mem._rolling = RollingAudit(*contents.audit_cursor)
    mem._nu = None if nu is None else float(nu)
    mem._n0 = None if n0 is None else int(n0)
    mem._table = _table.RecordTable(solver.n_features)
    records = contents.records
    if [int(r[1]) for r in records] != solver.ids.tolist():
        raise MemoryFileError("record table does not match the solver's keys")
    ids, texts = checked_records(records)
    keys = solver.keys
    try:
        leaves = _table.record_leaves(ids, keys, texts)
    except UnicodeEncodeError:
        for record_id, text in zip(ids, texts):
            check_record_id(record_id)
            check_utf8(text, f"value of {record_id!r}")
        raise
    mem._table.insert_many(solver.ids, keys, ids, texts, leaves)
    mem._tombstones = _format.parse_tombstones(contents.tombstones, mem._table,
                                                check_record_id)
    mem._next_auto = contents.next_auto
    mem._revision = contents.revision
    mem._receipt_chain = contents.receipt_chain
    mem._digest = None
    mem._coefficients = None
    mem._kkt = None


def checked_records(records):
    """Record ids and value texts of a file's record list, refusing bad ones.

    Ids must be distinct non-empty str; values canonical JSON text (both checked in bulk:
    the per-record work at 10^5 records is what a load spends most on).
    """
    ids, texts = [], []
    for record_id, _, text in records:
        ids.append(record_id)
        texts.append(text)
    if not all(isinstance(r, str) and r for r in ids):
        for record_id in ids:
            check_record_id(record_id)
    if len(set(ids)) != len(ids):
        seen = set()
        for record_id in ids:
            if record_id in seen:
                raise MemoryFileError(f"record id {record_id!r} appears twice")
            seen.add(record_id)
    for record_id, text in zip(ids, texts):
        if not isinstance(text, str):
            raise MemoryFileError(f"value of {record_id!r} is not JSON text")
    bad = non_canonical_values(texts)
    if bad is not None:
        raise MemoryFileError(f"malformed contents: the value of {ids[bad]!r} is not "
                              "canonical JSON text")
    return ids, texts
