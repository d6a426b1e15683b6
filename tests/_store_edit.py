"""Edit a store database the way a tamperer (or a damaged disk) would, for the tests.

:func:`edit_store` changes rows of a store written by :meth:`ForgettableMemory.save` and, by
default, recomputes its unkeyed seal, as whoever can write the file can: the seal then no
longer tells, and what refuses the edit is the structure, the digest, the solver's checks or,
for a signed store, its MAC. With ``key`` it recomputes the MAC too (the forger holds the
key); with ``reseal=False`` both are left as they were.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3

import numpy as np

from svtoolkit.memory import _database as D


def read_rows(path):
    """The raw contents: (meta dict, slot blocks dict name -> list of bytes, tombstone rows,
    record rows dict sid -> [record_id, key bytes, value text])."""
    con = sqlite3.connect(path)
    try:
        meta = dict(con.execute("SELECT name, value FROM meta"))
        slots = {}
        for name, block, data in con.execute("SELECT name, block, data FROM slots "
                                             "ORDER BY name, block"):
            slots.setdefault(name, []).append(data)
        tombs = [list(r) for r in con.execute("SELECT seq, record_id, reason, time FROM "
                                              "tombstones ORDER BY seq")]
        records = {r[0]: list(r[1:]) for r in con.execute("SELECT sid, record_id, key, "
                                                          "value FROM records")}
    finally:
        con.close()
    return meta, slots, tombs, records


def header_of(path):
    return json.loads(read_rows(path)[0]["header"])


def arrays_of(path):
    """The solver's arrays as stored (slot arrays and small arrays), as writable copies."""
    meta, slots, _, _ = read_rows(path)
    header = json.loads(meta["header"])
    out = {name: np.frombuffer(b"".join(slots.get(name, [])), dtype=dtype).copy()
           for name, dtype in D.SLOT_ARRAYS.items()}
    for name, dtype in D.SMALL_ARRAYS.items():
        out[name] = np.frombuffer(meta[f"array:{name}"], dtype=dtype).reshape(
            header["arrays"][name]).copy()
    return out


def edit_store(path, *, header=None, arrays=None, sql=(), reseal=True, key=None,
               header_text=None):
    """Change a store database in place.

    Parameters
    ----------
    header : callable, optional
        ``dict -> dict``: the new header (JSON).
    header_text : bytes, optional
        The header row's raw bytes (instead of ``header``).
    arrays : callable, optional
        ``dict -> None``: edits :func:`arrays_of`'s arrays in place (shapes may change).
    sql : sequence of (statement, parameters)
        Run first, in the same transaction (records, tombstones, meta).
    reseal : bool, default True
        Recompute the seal over the edited contents (unkeyed, or with ``key``).
    """
    current = arrays_of(path)
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("BEGIN")
        for statement, params in sql:
            con.execute(statement, params)
        if arrays is not None:
            arrays(current)
            con.execute("DELETE FROM slots")
            for name, dtype in D.SLOT_ARRAYS.items():
                a = np.ascontiguousarray(current[name], dtype=dtype)
                for b in range(-(-len(a) // D.SLOT_BLOCK)):
                    con.execute("INSERT INTO slots VALUES (?, ?, ?)",
                                (name, b, a[b * D.SLOT_BLOCK:(b + 1) * D.SLOT_BLOCK].tobytes()))
            for name, dtype in D.SMALL_ARRAYS.items():
                con.execute("UPDATE meta SET value = ? WHERE name = ?",
                            (np.ascontiguousarray(current[name], dtype=dtype).tobytes(),
                             f"array:{name}"))
        if header is not None or arrays is not None:
            h = json.loads(con.execute("SELECT value FROM meta WHERE name = 'header'"
                                       ).fetchone()[0])
            if arrays is not None:
                h["arrays"] = {n: list(np.shape(current[n])) for n in D.SMALL_ARRAYS}
            if header is not None:
                h = header(h)
            header_text = D._header_text(h) if header_text is None else header_text
        if header_text is not None:
            con.execute("UPDATE meta SET value = ? WHERE name = 'header'", (header_text,))
        con.execute("COMMIT")
    finally:
        con.close()
    if reseal:
        seal_store(path, key)


def seal_store(path, key=None):
    """Recompute and store the (unkeyed) seal of the database's current contents; with
    ``key`` its MAC too (a forger who holds the key)."""
    meta, slots, tombs, _ = read_rows(path)
    slot_hashes = {name: [hashlib.sha256(b).digest() for b in slots.get(name, [])]
                   for name in D.SLOT_ARRAYS}
    rows = {seq: D._tomb_row(seq, rid, reason, when) for seq, rid, reason, when in tombs}
    tomb_hashes = {b: D._tomb_block_hash(rows, b) for b in {s // D.TOMB_BLOCK for s in rows}}
    small = {name: meta[f"array:{name}"] for name in D.SMALL_ARRAYS}
    seal, mac = D._seal(key, meta["header"], small, slot_hashes, tomb_hashes)
    con = sqlite3.connect(path, isolation_level=None)
    try:
        con.execute("UPDATE meta SET value = ? WHERE name = 'seal'", (seal,))
        if key is not None:
            con.execute("UPDATE meta SET value = ? WHERE name = 'mac'", (mac,))
    finally:
        con.close()
