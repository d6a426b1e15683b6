"""ForgettableMemory at scale: the fast paths, checked for correctness at small n.

One-call builds (``extend``), the verification levels of loads and receipts, the rolling audit
that replaced the solver's periodic one, and the command line's ``--verify``. Speed itself is
measured in ``benchmarks/memory.py``; here the fast paths must give the answers of the slow ones
and refuse what they refuse.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import svtoolkit.memory._store as store_module
from svtoolkit.cli import main as cli_main
from svtoolkit.memory import (
    DeletionReceipt,
    ForgettableMemory,
    MemoryAuthenticationError,
    MemoryFileError,
    verify_receipt,
)
import svtoolkit.memory._audit as audit_module
from svtoolkit.memory._audit import (AUDIT_PERIOD, AUDIT_WORK, MAX_STRIDE, MIN_KEYS,
                                     RollingAudit, gather_work, key_work, schedule)
from svtoolkit.memory._codec import non_canonical_values
from svtoolkit.memory._signing import receipt_mac
from svtoolkit.memory._table import RecordTable, record_leaf
from _store_edit import arrays_of, edit_store, header_of

KEY = b"0123456789abcdef-scale"
HEADER = "<8sIIQ"  # single files (versions 1, 2): magic, version, flags, header length
DATA = Path(__file__).parent / "data"


def gaussian(seed, n=120, d=3):
    return np.random.default_rng(seed).standard_normal((n, d))


def built(seed=0, n=120, d=3, **kwargs):
    X = gaussian(seed, n, d)
    mem = ForgettableMemory(sigma=1.5, nu=0.3, n0=n, **kwargs)
    mem.extend(X, [{"i": i} for i in range(n)], record_ids=[f"k{i}" for i in range(n)])
    return mem, X


@pytest.fixture
def large(monkeypatch):
    """Every state counts as large: "auto" takes the maintained level."""
    monkeypatch.setattr(store_module, "FRESH_KKT_WORK", 0)


def _rewrite_single_file(path, mutate):
    """Apply ``mutate`` to the header and array bytes of an unsigned single file (version 2);
    new checksum."""
    data = path.read_bytes()
    _, version, flags, hlen = struct.unpack_from(HEADER, data, 0)
    assert (version, flags) == (2, 0)
    start = struct.calcsize(HEADER)
    header = json.loads(data[start:start + hlen])
    blob = bytearray(data[start + hlen:-32])
    mutate(header, blob)
    text = json.dumps(header).encode()
    body = struct.pack(HEADER, b"SVTKMEM\x00", version, 0, len(text)) + text + bytes(blob)
    path.write_bytes(body + hashlib.sha256(body).digest())


def _nudge(name, slot, delta):
    """An edit of the stored arrays (for :func:`edit_store`): ``name[slot] += delta``."""
    def mutate(arrays):
        arrays[name][slot] += delta
    return mutate


# ------------------------------------------------------------------ extend
def test_extend_is_one_solver_call_and_equals_one_add_per_record(monkeypatch):
    X = gaussian(1)
    calls = []
    mem = ForgettableMemory(sigma=1.5, nu=0.3, n0=len(X))
    original = mem._solver.extend
    monkeypatch.setattr(mem._solver, "extend", lambda K: calls.append(len(K)) or original(K))
    result = mem.extend(X, list(range(len(X))))
    assert calls == [len(X)] and result.record_ids == tuple(f"r{i}" for i in range(len(X)))
    one_by_one = ForgettableMemory(sigma=1.5, nu=0.3, n0=len(X))
    for i, x in enumerate(X):
        one_by_one.add(x, i)
    # the same optimum by two routes: equal to rounding, the same partition
    assert np.allclose(mem._solver.alpha, one_by_one._solver.alpha, rtol=0, atol=1e-12)
    assert mem.partition() == one_by_one.partition()
    assert mem.record_ids == one_by_one.record_ids
    assert [mem.get(r) for r in mem.record_ids] == list(range(len(X)))
    assert mem._solver.kkt_residual() < 1e-12
    # the bulk table insert hashes what one insert per record hashes
    table = RecordTable()
    for i, (sid, x) in enumerate(zip(mem._solver.ids, X, strict=True)):
        table.insert(int(sid), x, f"r{i}", str(i), record_leaf(f"r{i}", x, str(i)))
    assert table.records_root() == mem._table.records_root()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"values": [1, 2]}, ValueError, "values has 2 entries for 3 keys"),
    ({"record_ids": ["a", "b"]}, ValueError, "record_ids has 2 entries"),
    ({"record_ids": ["a", "b", "a"]}, ValueError, "same id twice"),
    ({"record_ids": ["a", "held", "c"]}, ValueError, "duplicate record id 'held'"),
    ({"values": [1, (2,), 3]}, TypeError, "JSON round trip"),
    ({"keys": [[0.0, 1.0], [np.nan, 0.0], [1.0, 1.0]]}, ValueError, "keys"),
])
def test_a_refused_extend_stores_nothing(kwargs, error, match):
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([5.0, 5.0], "x", record_id="held")
    before = (mem.state_digest(), mem.revision, mem.record_ids)
    args = {"keys": [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], "values": [1, 2, 3], **kwargs}
    with pytest.raises(error, match=match):
        mem.extend(args.pop("keys"), args.pop("values"), **args)
    assert (mem.state_digest(), mem.revision, mem.record_ids) == before


def test_extend_enforces_the_budget_once():
    X = gaussian(2, n=60)
    mem = ForgettableMemory(sigma=1.5, C=0.1, budget=40)
    result = mem.extend(X, [None] * 60)
    assert len(mem) == 40 and len(result.evicted) == 20
    assert all(r not in mem for r in result.evicted) and mem.last_evicted == result.evicted


# ------------------------------------------------------------------ verification levels
def test_default_load_of_a_large_signed_file_is_maintained_and_equals_the_full_load(
        tmp_path, large):
    mem, _ = built(3, signing_key=KEY)
    mem.forget("k5")
    path = tmp_path / "m.svtk"
    mem.save(path)
    default = ForgettableMemory.load(path, key=KEY)
    full = ForgettableMemory.load(path, key=KEY, verify="full")
    assert (default.load_verification, full.load_verification) == ("maintained", "full")
    assert default.state_digest() == full.state_digest() == mem.state_digest()
    a, b = default._solver.state_dict(), full._solver.state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a if isinstance(a[k], np.ndarray))
    # and both continue identically
    ra, rb = default.forget("k7"), full.forget("k7")
    assert (ra.digest_after, ra.kkt_source) == (rb.digest_after, "maintained")


def test_an_unsigned_file_is_fully_verified_by_default(tmp_path, large):
    """Without a key the fresh checks are what refuse a forged coefficient or solver array,
    so "auto" keeps them; the maintained level, asked for explicitly, does not see this one."""
    mem, _ = built(4)
    path = tmp_path / "m.svtk"
    mem.save(path)
    reserve = mem._solver._slot_of[int(mem._solver.reserve_ids[0])]
    before = arrays_of(path)["grad"][reserve]
    edit_store(path, arrays=_nudge("grad", reserve, 1e-3))  # still >= 0: the maintained KKT holds
    assert arrays_of(path)["grad"][reserve] == before + 1e-3
    with pytest.raises(MemoryFileError, match="grad drift .* exceeds"):
        ForgettableMemory.load(path)
    assert ForgettableMemory.load(path, verify="maintained").load_verification == "maintained"


def test_the_maintained_load_refuses_a_broken_certificate(tmp_path):
    mem, _ = built(5)
    path = tmp_path / "m.svtk"
    mem.save(path)
    margin = mem._solver._slot_of[int(mem._solver.margin_ids[0])]
    edit_store(path, arrays=_nudge("grad", margin, 1e-3))  # a margin gradient must be 0
    with pytest.raises(MemoryFileError, match="maintained kkt residual .* exceeds"):
        ForgettableMemory.load(path, verify="maintained")


def test_the_default_load_still_refuses_a_tampered_signed_file(tmp_path, large):
    mem, _ = built(6, signing_key=KEY)
    path = tmp_path / "m.svtk"
    mem.save(path)
    assert header_of(path)["n"] > 100

    def flip(arrays):  # one bit inside the arrays
        arrays["alpha"].view(np.uint8)[-200] ^= 0x01

    edit_store(path, arrays=flip)  # the seal recomputed, without the key
    with pytest.raises(MemoryAuthenticationError, match="MAC mismatch"):
        ForgettableMemory.load(path, key=KEY)


def test_load_refuses_an_unknown_verification_level(tmp_path):
    mem, _ = built(7)
    mem.save(tmp_path / "m.svtk")
    with pytest.raises(ValueError, match="verify must be one of"):
        ForgettableMemory.load(tmp_path / "m.svtk", verify="fast")
    with pytest.raises(ValueError, match="verify must be one of"):
        mem.forget("k1", verify="fast")
    assert "k1" in mem


def test_receipts_say_which_checks_were_fresh(large):
    mem, _ = built(8, signing_key=KEY)
    stride = schedule(120, len(mem.partition()["margin"]))[0]  # the slice after extend set it
    receipts = [mem.forget(f"k{i}") for i in range(3, 3 + stride)]
    receipt = receipts[-1]
    assert [r.rolling_audit for r in receipts[:-1]] == [None] * (stride - 1)
    assert receipt.kkt_source == "maintained"
    assert receipt.kkt_residual == pytest.approx(mem._solver.kkt_residual(), abs=1e-12)
    checks = receipt.rolling_audit
    assert checks["gradients_checked"] == len(mem) and checks["grad_drift"] < 1e-12
    assert checks["inverse_columns_checked"] >= 1 and checks["repaired"] is False
    assert mem.forget("k100", verify="full").kkt_source == "fresh"
    edit = mem.edit("k101", value="new")
    assert (edit.kkt_source, edit.rolling_audit) == ("cached fresh", None)
    assert mem.forget("k102", verify=False).kkt_source is None
    # the MAC covers the new fields
    forged = dict(receipt.to_dict(), kkt_source="fresh")
    assert verify_receipt(receipt.to_dict(), KEY) and not verify_receipt(forged, KEY)


def test_a_receipt_without_the_new_fields_still_verifies():
    mem, _ = built(9, signing_key=KEY)
    old = DeletionReceipt(**{k: v for k, v in mem.forget("k1").signed_fields().items()
                             if k not in ("kkt_source", "rolling_audit")})
    old = DeletionReceipt(**{**old.signed_fields(), "mac": receipt_mac(
        KEY, old.signed_fields())})
    as_json = {k: v for k, v in old.to_dict().items() if k not in ("kkt_source",
                                                                    "rolling_audit")}
    assert verify_receipt(as_json, KEY)


def test_small_memories_keep_fresh_receipts_and_loads(tmp_path):
    mem, _ = built(10)
    assert mem.forget("k2").kkt_source == "fresh"
    mem.save(tmp_path / "m.svtk", key=KEY)
    assert ForgettableMemory.load(tmp_path / "m.svtk", key=KEY).load_verification == "full"


# ------------------------------------------------------------------ rolling audit
@pytest.mark.parametrize("n, m", [(0, 0), (1, 0), (10, 3), (150, 40), (2000, 300),
                                  (10**5, 2000), (10**6, 5)])
def test_the_schedule_covers_every_key_and_column_within_one_period(n, m):
    stride, keys, columns = schedule(n, m)
    size = m + 1 if m else 0  # the bordered system's columns (none without a margin set)
    assert 1 <= stride <= MAX_STRIDE and keys <= n and columns <= size
    # operations until the cursor has passed every key / column once: the last slice of the
    # cycle falls at operation stride * (slices - 1) + 1, within the period
    if n:
        assert stride * (-(-n // keys) - 1) + 1 <= AUDIT_PERIOD
        assert keys >= min(n, MIN_KEYS)
    if size:
        assert stride * (-(-size // columns) - 1) + 1 <= AUDIT_PERIOD


@pytest.mark.parametrize("n, m, support, d", [(150, 40, 60, 3), (2000, 300, 600, 384),
                                              (10**4, 16, 3006, 384), (10**5, 17, 30006, 16),
                                              (10**5, 5, 10**5, 384)])
def test_a_slice_costs_at_most_the_audit_work_per_operation_and_still_cycles(n, m, support, d):
    """Where the period's slice would cost more than AUDIT_WORK multiply-adds per operation,
    it checks fewer keys (at least one): the cost per change is bounded, the cycle longer.
    The slice's fixed cost (the gather) is spread over at least 2 gather / AUDIT_WORK
    operations."""
    work, gather = key_work(support, d), gather_work(n, d)
    stride, keys, columns = schedule(n, m, work, gather)
    assert stride >= schedule(n, m)[0] and columns <= schedule(n, m)[2]
    assert stride == MAX_STRIDE or 2 * gather <= AUDIT_WORK * stride
    assert 1 <= keys <= schedule(n, m)[1]
    assert gather + keys * work <= max(AUDIT_WORK * stride, gather + work)  # one key fits
    period_keys = min(n, max(MIN_KEYS, -(-n // (AUDIT_PERIOD // stride))))  # uncapped
    if keys < period_keys:  # capped: the most that fit
        assert gather + (keys + 1) * work > AUDIT_WORK * stride
    else:
        assert stride * (-(-n // keys) - 1) + 1 <= AUDIT_PERIOD


def test_the_large_support_that_made_a_change_slow_gets_a_slice_of_nine_keys_every_third():
    # 10^5 records, 30,006 of them in the support, d = 16: 100 keys per slice cost 22 ms, 20
    # keys 12 ms (the exponential, not counted then, costs more than the 16 multiply-adds),
    # and gathering the support 3-4.5 ms of it, whatever the number of keys
    assert key_work(30006, 16) == 30006 * 40 and gather_work(10**5, 16) == 4 * 16 * 10**5
    found = schedule(10**5, 17, key_work(30006, 16), gather_work(10**5, 16))
    assert found == (3, 9, 4)  # every key within 33,336 operations
    # a small support: the period's slice, every third operation
    assert schedule(10**5, 17, key_work(327, 16), gather_work(10**5, 16)) == (3, 301, 4)


def test_a_slice_checks_what_the_support_allows(monkeypatch):
    """The slice reads the support, the dimension and the keys held from the solver."""
    mem, _ = built(14, n=150)
    solver = mem._solver
    work = key_work(solver.support_size, solver.n_features)
    gather = gather_work(len(solver), solver.n_features)
    assert solver.support_size == len(solver.margin_ids) + len(solver.error_ids) > 0
    stride = schedule(150, len(solver.margin_ids))[0]
    # a budget for the gather and 8 keys per slice
    monkeypatch.setattr(audit_module, "AUDIT_WORK", (gather + 8 * work) // stride + 1)
    assert audit_module.schedule(150, len(solver.margin_ids), work, gather)[:2] == (stride, 8)
    found = RollingAudit().slice(solver, repair=False)
    assert found["gradients_checked"] == 8


def test_small_memories_take_a_slice_every_stride_operations_and_large_ones_every_one():
    assert schedule(2000, 300)[:2] == (31, 64)  # 32 slices of 64 keys in 992 operations
    assert schedule(10**5, 2000) == (1, 100, 4)
    mem, _ = built(10, n=150)
    stride = schedule(150, len(mem.partition()["margin"]))[0]
    rolling, solver = RollingAudit(), mem._solver
    due = [rolling.step(solver, repair=False) is not None for _ in range(3 * stride)]
    assert due == ([True] + [False] * (stride - 1)) * 3


def test_a_full_cycle_of_the_rolling_audit_measures_what_the_full_audit_measures():
    mem, _ = built(11, n=150)
    solver = mem._solver
    slot = solver._slot_of[int(solver.reserve_ids[3])]
    solver._grad[slot] += 3e-7
    solver._R[1, 1] += 2e-6
    full = solver.consistency(margin_rows=False)
    _, keys, columns = schedule(len(solver), len(solver.margin_ids))
    rolling = RollingAudit()
    slices = [rolling.slice(solver, repair=False)
              for _ in range(-(-len(solver) // keys) + -(-(len(solver.margin_ids) + 1)
                                                         // columns))]
    assert max(s["grad_drift"] for s in slices) == pytest.approx(full.grad_drift, rel=1e-9)
    assert max(s["inverse_residual"] for s in slices) == pytest.approx(full.inverse_residual,
                                                                        rel=1e-6)


def test_the_rolling_audit_repairs_drift_within_one_cycle():
    mem, _ = built(12, n=100)
    solver = mem._solver
    victim = int(solver.reserve_ids[-1])
    solver._grad[solver._slot_of[victim]] += 1e-6
    assert solver.copy().audit().refactorized  # what the full audit would find
    stride, keys, _ = schedule(len(solver), len(solver.margin_ids))
    before = solver.n_refactorizations
    rng = np.random.default_rng(12)
    for j in range(stride * -(-len(solver) // keys) // 2 + 1):  # add + forget: 2 operations
        mem.add(rng.standard_normal(3), j, record_id=f"s{j}")
        mem.forget(f"s{j}")
    assert solver.n_refactorizations == before + 1
    assert solver.consistency().grad_drift < 1e-10


def test_no_full_audit_runs_in_a_stream_crossing_a_thousand_operations(monkeypatch):
    mem, X = built(13, n=60)
    assert mem._solver.audit_every == 0
    calls = []
    monkeypatch.setattr(mem._solver, "audit", lambda: calls.append(1))
    rng = np.random.default_rng(13)
    for j in range(510):
        mem.add(rng.standard_normal(3), j, record_id=f"s{j}")
        mem.forget(f"s{j}")
    assert mem._solver.n_refactorizations == 0 and calls == []
    assert mem._solver.kkt_residual() < 1e-12


def test_the_audit_cursor_survives_save_and_load(tmp_path):
    mem, _ = built(14)
    for r in ("k1", "k2", "k3"):
        mem.forget(r)
    mem.save(tmp_path / "m.svtk")
    loaded = ForgettableMemory.load(tmp_path / "m.svtk")
    assert loaded._rolling.cursor() == mem._rolling.cursor() != [0, 0, 0]
    assert header_of(tmp_path / "m.svtk")["audit_cursor"] == mem._rolling.cursor()
    edit_store(tmp_path / "m.svtk", header=lambda h: h | {"audit_cursor": [4, 1]})  # older
    assert ForgettableMemory.load(tmp_path / "m.svtk")._rolling.cursor() == [4, 1, 0]
    for bad in ([1, -2], [1, 2, 3, 4], [1, True, 0]):
        edit_store(tmp_path / "m.svtk", header=lambda h, bad=bad: h | {"audit_cursor": bad})
        with pytest.raises(MemoryFileError, match=r"audit_cursor must be \[next id"):
            ForgettableMemory.load(tmp_path / "m.svtk")


# ------------------------------------------------------------------ bulk checks at load
@pytest.mark.parametrize("texts, bad", [
    (['"a"', "1", "[1,2]", '{"a":1}'], None),
    (['"a', 'b"', "1,2"], 0),  # not JSON one by one, although their join parses
    (["1", "[1, 2]"], 1),  # valid but not canonical
    (["1", '{"b":1,"a":2}'], 1),  # keys unsorted
    (["1", "{not json"], 1),
])
def test_bulk_canonical_check_matches_the_one_by_one_check(texts, bad):
    assert non_canonical_values(texts) == bad


def test_a_duplicated_record_id_in_a_file_is_refused(tmp_path):
    path = tmp_path / "m.svtk"
    mem, _ = built(15)
    mem.save(path)
    # the store database refuses a second row with one record id (UNIQUE) ...
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed: "
                                                     "records.record_id"):
        edit_store(path, sql=[("UPDATE records SET record_id = 'k0' WHERE record_id = 'k1'",
                               ())])
    assert ForgettableMemory.load(path).record_ids == mem.record_ids  # nothing changed
    # ... and so does the load, when the table is rebuilt without the constraint
    edit_store(path, sql=[
        ("CREATE TABLE loose(sid INTEGER PRIMARY KEY, record_id TEXT NOT NULL, "
         "key BLOB NOT NULL, value TEXT NOT NULL)", ()),
        ("INSERT INTO loose SELECT * FROM records", ()),
        ("DROP TABLE records", ()),
        ("ALTER TABLE loose RENAME TO records", ()),
        ("UPDATE records SET record_id = 'k0' WHERE record_id = 'k1'", ())])
    with pytest.raises(MemoryFileError, match="record id 'k0' appears twice"):
        ForgettableMemory.load(path)
    # a single file of version 2 has no constraint: its load refuses the duplicate
    legacy = tmp_path / "v2.svtk"
    shutil.copyfile(DATA / "memory_v2.svtk", legacy)

    def duplicate(header, blob):
        assert header["records"][0][0] == "k4"
        header["records"][1][0] = header["records"][0][0]

    _rewrite_single_file(legacy, duplicate)
    with pytest.raises(MemoryFileError, match="record id 'k4' appears twice"):
        ForgettableMemory.load(legacy)


# ------------------------------------------------------------------ command line
def test_cli_verify_flag(tmp_path, capsys, monkeypatch, large):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    store = str(tmp_path / "m.svtk")
    mem, X = built(16, signing_key=KEY)
    mem.save(store)
    q = ",".join(repr(float(v)) for v in X[0])
    assert cli_main(["memory", "query", store, "--key-file", str(key_file), "--key", q]) == 0
    assert cli_main(["memory", "forget", store, "k0", "--key-file", str(key_file)]) == 0
    default = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert default["kkt_source"] == "maintained"
    assert cli_main(["memory", "forget", store, "k1", "--key-file", str(key_file),
                     "--verify", "full"]) == 0
    assert json.loads(capsys.readouterr().out)["kkt_source"] == "fresh"
    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error
        cli_main(["memory", "list", store, "--verify", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_a_vector_store_command_does_not_import_torch(tmp_path):
    mem, X = built(17)
    mem.save(tmp_path / "m.svtk")
    code = ("import sys; from svtoolkit.cli import main; "
            f"main(['memory', 'query', {str(tmp_path / 'm.svtk')!r}, '--key', '0,0,0']); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.splitlines()[-1] == "False"


# ------------------------------------------------------------------ slow
@pytest.mark.slow
def test_larger_extend_load_and_forget_agree_across_levels(tmp_path, large):
    X = gaussian(18, n=6000, d=8)
    mem = ForgettableMemory(sigma=3.0, nu=0.3, n0=1000, signing_key=KEY)
    mem.extend(X, list(range(len(X))))
    assert mem._solver.kkt_residual() < 1e-10
    mem.save(tmp_path / "m.svtk")
    a = ForgettableMemory.load(tmp_path / "m.svtk", key=KEY)
    b = ForgettableMemory.load(tmp_path / "m.svtk", key=KEY, verify="full")
    victims = [f"r{i}" for i in np.random.default_rng(18).choice(6000, 40, replace=False)]
    for r in victims:
        assert a.forget(r).digest_after == b.forget(r, verify="full").digest_after
    assert a._solver.kkt_residual() < 1e-10
