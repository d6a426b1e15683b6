"""The file side of :class:`~svtoolkit.memory.ForgettableMemory`: the contents
:meth:`~ForgettableMemory.save` writes, and how :meth:`~ForgettableMemory.load` rebuilds a
memory from a parsed file - the solver from its stored state, the record table from the file's
records (checked in bulk), the tombstones and counters - and verifies it (the solver's numbers
at the chosen level, then the state digest). The format itself is :mod:`._format`.
"""

from __future__ import annotations

import json

from ..exact import IncrementalSVDD
from . import _format, _table
from ._audit import RollingAudit
from ._certificates import fresh_work, maintained_kkt
from ._codec import check_record_id, check_utf8, non_canonical_values
from ._errors import MemoryFileError

__all__ = ["file_contents", "from_contents", "install", "checked_records"]


def file_contents(mem, key):
    """The bytes :meth:`ForgettableMemory.save` writes (:func:`_format.serialize`)."""
    records = mem._table.file_records(mem._solver.ids)
    return _format.serialize(
        mem._solver.state_dict(),
        config={"C": mem.C, "sigma": mem.sigma, "nu": mem._nu, "n0": mem._n0,
                "budget": mem._budget, "min_similarity": mem._min_similarity},
        metadata_text=mem._metadata_text,
        records=records,
        tombstones=[[rid, reason, when] for rid, (reason, when) in
                    mem._tombstones.items()],
        next_auto=mem._next_auto,
        revision=mem._revision,
        digest=mem.state_digest(),
        audit_cursor=mem._rolling.cursor(),
        receipt_chain=mem._receipt_chain,
        key=key,
    )


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
        _format.check_solver_numbers(found)
        mem._kkt = (float(found.kkt_residual), "fresh")
    elif verify == "maintained":
        mem._kkt = (maintained_kkt(solver), "maintained")
        _format.check_maintained_numbers(mem._kkt[0])
    mem._load_verification = verify
    stored = mem.state_digest() if contents.version >= 2 else _table.state_digest_v1(
        solver, mem._table, mem._budget, mem._min_similarity)
    if stored != contents.digest:
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
