"""ForgettableMemory: what a forget erases, symlinked stores, truthful save errors, digest
encoding, thread-local evictions, and the command line's handling of hostile input.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import svtoolkit.memory._atomic as atomic_module
import svtoolkit.memory._database as database_module
from svtoolkit.cli import main
from svtoolkit.memory import (
    AddResult,
    BudgetExceededWarning,
    DurabilityWarning,
    ForgettableMemory,
    MemoryAuthenticationError,
    MemoryFileError,
)
from svtoolkit.memory._database import SQLITE_MAGIC
from _store_edit import header_of, read_rows

SECRET = "alice-secret-tulip-42"
DATA = Path(__file__).parent / "data"


def cli(capsys, *argv):
    code = main(["memory", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def two_record_memory():
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([0.0, 0.0], SECRET, record_id="alice")
    mem.add([3.0, 0.0], "bob-value", record_id="bob")
    return mem


def files_holding(directory, needle):
    return sorted(p.name for p in Path(directory).iterdir()
                  if p.is_file() and needle.encode() in p.read_bytes())


# ------------------------------------------------------------------ stale temporary files
def _crash_a_save(path):
    """A process that writes a whole new store over ``path`` (a memory not bound to it: the
    save builds the database and renames it into place) and dies mid-write, leaving its
    temporary file."""
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory as m
        import svtoolkit.memory._atomic as atomic
        mem = m.ForgettableMemory(sigma=1.0, C=0.5)
        mem.add([0.0, 0.0], {SECRET!r}, record_id="alice")
        mem.add([3.0, 0.0], "bob-value", record_id="bob")
        mem.add([9.0, 9.0], "late", record_id="late")
        real, calls = atomic._write_chunk, [0]
        def dying(fh, chunk):
            calls[0] += 1
            real(fh, chunk)
            if calls[0] == 3:
                fh.flush()
                os._exit(9)
        atomic._write_chunk = dying
        mem.save({str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()


def _assert_a_crash_left_a_temp_holding_the_secret(tmp_path):
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".m.svtk.")
    assert files_holding(tmp_path, SECRET) == sorted([leftovers[0], "m.svtk"])
    assert ForgettableMemory.load(tmp_path / "m.svtk").record_ids == ["alice", "bob"]


def test_a_save_removes_what_crashed_saves_left(tmp_path):
    path = tmp_path / "m.svtk"
    two_record_memory().save(path)
    _crash_a_save(path)
    _assert_a_crash_left_a_temp_holding_the_secret(tmp_path)
    mem = two_record_memory()  # not bound to the store: a whole new database
    mem.forget("alice")
    mem.save(path)
    assert files_holding(tmp_path, SECRET) == []  # neither the store nor a stale temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.svtk"]


def test_a_save_of_the_changes_removes_what_crashed_saves_left(tmp_path):
    path = tmp_path / "m.svtk"
    two_record_memory().save(path)
    _crash_a_save(path)
    _assert_a_crash_left_a_temp_holding_the_secret(tmp_path)
    mem = ForgettableMemory.load(path)  # bound: its save writes only the change
    mem.forget("alice")
    mem.save(path)
    assert "alice" not in ForgettableMemory.load(path)
    assert files_holding(tmp_path, SECRET) == []  # neither the store nor a stale temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.svtk"]


def test_cleanup_spares_other_files_and_temps_in_use(tmp_path):
    path = tmp_path / "m.svtk"
    two_record_memory().save(path)
    spared = [".m.svtk.bak.abcdefgh.tmp",  # the temporary file of a store named m.svtk.bak
              ".m.svtk.notes.tmp", "m.svtk.abcdefgh.tmp", ".m.svtk.abc.tmp"]
    for name in spared:
        (tmp_path / name).write_text(SECRET)
    stale = tmp_path / ".m.svtk.zz9_ab01.tmp"  # what an older svtoolkit's crash left
    stale.write_text(SECRET)
    busy = tmp_path / ".m.svtk.0123456789abcdef.tmp"  # a save in progress holds its lock
    busy.write_text(SECRET)
    import fcntl

    with open(busy, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        two_record_memory().save(path)  # not bound to the store: a whole new database
    assert not stale.exists() and busy.exists()
    assert all((tmp_path / name).exists() for name in spared)


def test_docs_say_what_a_forget_erases():
    text = (Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    for phrase in ("What a forget erases", "stale temporary", "Not erased"):
        assert phrase in text


# ------------------------------------------------------------------ symlinked stores
def test_forget_through_a_symlink_rewrites_the_real_file(tmp_path, capsys):
    real, link = tmp_path / "real.svtk", tmp_path / "link.svtk"
    two_record_memory().save(real)
    link.symlink_to(real.name)  # relative, as `ln -s real.svtk link.svtk` makes it
    code, out, err = cli(capsys, "forget", link, "bob")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == real.name
    assert "bob" not in ForgettableMemory.load(real)
    assert files_holding(tmp_path, "bob-value") == []
    # writers through the link and through the real path share one lock file
    assert not (tmp_path / "link.svtk.lock").exists()
    assert cli(capsys, "add", real, "--key", "5,5", "--value", "c", "--id", "c")[0] == 0
    assert ForgettableMemory.load(link).record_ids == ["alice", "c"]


def test_library_save_through_a_symlink_keeps_the_link(tmp_path):
    real, link = tmp_path / "real.svtk", tmp_path / "link.svtk"
    mem = two_record_memory()
    mem.save(real)
    link.symlink_to(real)
    mem.forget("alice")
    mem.save(link)
    assert link.is_symlink()
    assert ForgettableMemory.load(real).record_ids == ["bob"]


# ------------------------------------------------------------------ truthful save errors
def _failing_directory_fsync(directory):
    raise OSError(5, "simulated: directory fsync failed")


def test_a_failed_directory_fsync_after_the_rename_is_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "m.svtk"
    two_record_memory().save(path)
    mem = two_record_memory()  # not bound to the store: renamed over it
    mem.forget("alice")
    monkeypatch.setattr(atomic_module, "_fsync_directory", _failing_directory_fsync)
    with pytest.warns(DurabilityWarning, match="the new file is in place .* durability of "
                                               "the rename is not guaranteed"):
        mem.save(path)  # committed: no exception
    assert ForgettableMemory.load(path).record_ids == ["bob"]


def test_cli_does_not_report_failure_for_a_committed_change(tmp_path, capsys, monkeypatch):
    """A single file of version 2 is converted by the save: a new database renamed over it."""
    path = tmp_path / "m.svtk"
    shutil.copyfile(DATA / "memory_v2.svtk", path)
    monkeypatch.setattr(atomic_module, "_fsync_directory", _failing_directory_fsync)
    code, out, err = cli(capsys, "forget", path, "k5")
    assert code == 0 and json.loads(out)["record_id"] == "k5"
    assert err.startswith("warning: ") and "durability of the rename is not guaranteed" in err
    assert path.read_bytes().startswith(SQLITE_MAGIC)
    assert "k5" not in ForgettableMemory.load(path)


def test_a_failure_before_the_rename_is_still_an_error(tmp_path, monkeypatch):
    path = tmp_path / "m.svtk"
    two_record_memory().save(path)
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError(28, "simulated: no space left")

    monkeypatch.setattr(atomic_module.os, "replace", failing_replace)
    mem = two_record_memory()  # not bound to the store: renamed over it
    mem.forget("alice")
    with pytest.raises(OSError, match="no space left"):
        mem.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.svtk"]


def test_a_failure_in_the_transaction_of_the_changes_is_an_error(tmp_path, monkeypatch):
    """A save to the bound store writes the change in one transaction: a failure in it rolls
    back and raises, the store is as it was, and the next save writes the change."""
    path = tmp_path / "m.svtk"
    mem = two_record_memory()
    mem.save(path)
    before = path.read_bytes()
    real = database_module._write_meta

    def failing_meta(*args):
        raise sqlite3.OperationalError("simulated: disk I/O error")

    monkeypatch.setattr(database_module, "_write_meta", failing_meta)
    mem.forget("alice")
    with pytest.raises(OSError, match="disk I/O error.*nothing changed"):
        mem.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.svtk"]
    assert ForgettableMemory.load(path).record_ids == ["alice", "bob"]
    monkeypatch.setattr(database_module, "_write_meta", real)
    mem.save(path)
    assert ForgettableMemory.load(path).record_ids == ["bob"]
    assert files_holding(tmp_path, SECRET) == []


# ------------------------------------------------------------------ keys far from the origin
def test_wide_keys_far_from_the_origin_round_trip(tmp_path):
    """d = 128, keys around 1e3: fresh gradients of large-norm keys must not cancel."""
    rng = np.random.default_rng(128)
    X = rng.standard_normal((800, 128)) + 1e3
    mem = ForgettableMemory(sigma=16.0, nu=0.3, n0=len(X))
    for i, x in enumerate(X):
        mem.add(x, i, record_id=f"k{i}")
    path = tmp_path / "wide.svtk"
    mem.save(path)
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == mem.state_digest()
    probes = X[:50] + 0.1 * rng.standard_normal((50, 128))
    for q in probes:
        assert [(h.record_id, h.weight) for h in loaded.query(q, k=5)] == \
            [(h.record_id, h.weight) for h in mem.query(q, k=5)]


# ------------------------------------------------------------------ unambiguous digest
def test_states_that_differ_have_different_digests(tmp_path):
    """Without length prefixes, key bytes could be read as value bytes and back."""
    tail = struct.unpack("<d", b"12345678")[0]
    one = ForgettableMemory(sigma=1.0, C=1.0)
    one.add([0.5], 123456789, record_id="x")
    two = ForgettableMemory(sigma=1.0, C=1.0)
    two.add([0.5, tail], 9, record_id="x")
    assert one.state_digest() != two.state_digest()
    for name, mem in (("one", one), ("two", two)):
        mem.save(tmp_path / name)
        assert ForgettableMemory.load(tmp_path / name).state_digest() == mem.state_digest()


def test_an_empty_memory_digest_depends_on_the_dimension():
    a, b = ForgettableMemory(sigma=1.0, C=0.5), ForgettableMemory(sigma=1.0, C=0.5)
    a.add([1.0], "v", record_id="v")
    b.add([1.0, 2.0], "v", record_id="v")
    a.forget("v")
    b.forget("v")
    assert a.state_digest() != b.state_digest()


def test_a_version_1_file_still_loads(tmp_path):
    """tests/data/memory_v1.svtk was written by the version-1 code (24 Gaussian keys, seed
    2024, budget 20, a forget, a value edit and a non-ASCII record)."""
    mem = ForgettableMemory.load(DATA / "memory_v1.svtk")
    assert len(mem) == 20 and mem.revision == 31 and mem.budget == 20
    assert mem.record_ids[:5] == ["k0", "k1", "k4", "k5", "k6"]
    assert mem.get("k6") == ["edited", 5] and mem.get("unicode-id-é") == "Zoë"
    assert mem.tombstones["k2"][0] == "forgotten"
    assert sorted(r for r, (why, _) in mem.tombstones.items() if why == "evicted") == \
        ["k3", "k7", "k8", "k9"]
    assert mem.metadata == {"note": "version-1 test file"}
    assert mem.audit().fresh_deviation <= 1e-9
    # saved again it is a current-version file with the same records
    mem.save(tmp_path / "upgraded.svtk")
    again = ForgettableMemory.load(tmp_path / "upgraded.svtk")
    assert again.state_digest() == mem.state_digest() and again.record_ids == mem.record_ids


def test_a_tampered_version_1_file_fails_its_digest(tmp_path):
    import hashlib

    data = (DATA / "memory_v1.svtk").read_bytes()
    hlen = struct.unpack_from("<Q", data, 12)[0]
    header = json.loads(data[20:20 + hlen])
    header["records"][0][2] = json.dumps("forged")
    text = json.dumps(header).encode()
    body = data[:12] + struct.pack("<Q", len(text)) + text + data[20 + hlen:-32]
    path = tmp_path / "v1.svtk"
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(MemoryFileError, match="state digest mismatch"):
        ForgettableMemory.load(path)


V2_KEY = b"version-2-fixture-key-32-bytes!!"  # tests/data/make_memory_v2.py's
V2_DIGEST = "5104b7a9fcb22bf22fc22d4ebc549f467d7f0b42ebff384fa50ccf10d77eff90"
V2_FILES = [("memory_v2.svtk", None), ("memory_v2_signed.svtk", V2_KEY)]


def _assert_the_version_2_state(mem):
    """What tests/data/make_memory_v2.py made: 24 keys, budget 20 (k0..k3 evicted), k23
    forgotten, k20 edited, a non-ASCII record."""
    assert len(mem) == 20 and mem.revision == 31 and mem.budget == 20
    assert mem.record_ids[:3] == ["k4", "k5", "k6"] and mem.record_ids[-1] == "unicode-id-é"
    assert mem.get("k5") == {"i": 5, "text": "value 5"} and mem.get("k6") == "value 6"
    assert mem.get("k20") == ["edited", 6] and mem.get("unicode-id-é") == "Zoë"
    assert {r: why for r, (why, _) in mem.tombstones.items()} == {
        "k0": "evicted", "k1": "evicted", "k2": "evicted", "k3": "evicted",
        "k23": "forgotten"}
    assert mem.metadata == {"note": "version-2 test file"}
    assert mem.state_digest() == V2_DIGEST


@pytest.mark.parametrize("name, key", V2_FILES, ids=["unsigned", "signed"])
def test_a_version_2_file_still_loads(name, key):
    path = DATA / name
    assert path.read_bytes()[:8] == b"SVTKMEM\x00"
    mem = ForgettableMemory.load(path, key=key)
    _assert_the_version_2_state(mem)
    assert mem.signed == (key is not None) and mem.audit().fresh_deviation <= 1e-9
    if key is not None:
        unkeyed = ForgettableMemory.load(path)  # no key: the MAC is not checked
        assert not unkeyed.signed and unkeyed.state_digest() == V2_DIGEST
        with pytest.raises(MemoryAuthenticationError, match="MAC mismatch"):
            ForgettableMemory.load(path, key=b"another-key-of-32-bytes-length!!")


@pytest.mark.parametrize("name, key", V2_FILES, ids=["unsigned", "signed"])
def test_a_save_converts_a_version_2_file_to_a_database(tmp_path, name, key):
    path = tmp_path / "m.svtk"
    shutil.copyfile(DATA / name, path)
    ForgettableMemory.load(path, key=key).save(path)  # signed with the key it was loaded with
    assert path.read_bytes().startswith(SQLITE_MAGIC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.svtk"]
    meta = read_rows(path)[0]
    assert meta["signed"] == (key is not None)
    assert header_of(path)["format_version"] == 3 and header_of(path)["digest"] == V2_DIGEST
    converted = ForgettableMemory.load(path, key=key)
    _assert_the_version_2_state(converted)
    assert converted.signed == (key is not None)
    if key is not None:
        _assert_the_version_2_state(ForgettableMemory.load(path))  # reads without the key
        with pytest.raises(MemoryAuthenticationError, match="MAC mismatch"):
            ForgettableMemory.load(path, key=b"another-key-of-32-bytes-length!!")
    else:
        with pytest.raises(MemoryAuthenticationError, match="not signed"):
            ForgettableMemory.load(path, key=V2_KEY)


@pytest.mark.parametrize("name, key", V2_FILES, ids=["unsigned", "signed"])
def test_the_next_save_of_a_converted_file_writes_only_the_change(tmp_path, monkeypatch,
                                                                   name, key):
    path = tmp_path / "m.svtk"
    shutil.copyfile(DATA / name, path)
    ForgettableMemory.load(path, key=key).save(path)
    converted = ForgettableMemory.load(path, key=key)
    assert converted._binding is not None  # bound to the database it was read from
    store_id = header_of(path)["store_id"]
    assert files_holding(tmp_path, "value 5") == ["m.svtk"]

    def no_new_database(*args, **kwargs):
        raise AssertionError("the save wrote a whole new database")

    monkeypatch.setattr(database_module, "write_new", no_new_database)
    converted.forget("k5")
    converted.save(path)
    assert header_of(path)["store_id"] == store_id
    again = ForgettableMemory.load(path, key=key)
    assert len(again) == 19 and "k5" not in again and again.tombstones["k5"][0] == "forgotten"
    assert again.state_digest() == converted.state_digest() != V2_DIGEST
    assert again.signed == (key is not None)
    assert files_holding(tmp_path, "value 5") == []


def test_a_signed_version_2_file_is_not_converted_without_its_key(tmp_path):
    path = tmp_path / "m.svtk"
    shutil.copyfile(DATA / "memory_v2_signed.svtk", path)
    before = path.read_bytes()
    unkeyed = ForgettableMemory.load(path)
    with pytest.raises(ValueError, match="is a signed store: saving this memory without its "
                                         "signing key would replace it unsigned"):
        unkeyed.save(path)
    assert path.read_bytes() == before
    unkeyed.save(path, key=V2_KEY)
    assert path.read_bytes().startswith(SQLITE_MAGIC)
    assert ForgettableMemory.load(path, key=V2_KEY).signed


# ------------------------------------------------------------------ buffers after a forget
def test_a_forgotten_key_leaves_the_memory_buffers():
    rng = np.random.default_rng(11)
    X = rng.standard_normal((12, 3))
    mem = ForgettableMemory(sigma=1.5, C=0.2)
    for i, x in enumerate(X):
        mem.add(x, i, record_id=f"k{i}")
    for victim in ("k11", "k4"):  # the newest row, then one from the middle
        mem.forget(victim)
        table = mem._table
        assert not np.any(table.keys[table.n:]), "a row beyond n still holds a key"
        assert not any(np.array_equal(row, X[int(victim[1:])]) for row in table.keys)


def test_a_forgotten_key_leaves_the_solver_buffers():
    rng = np.random.default_rng(12)
    X = rng.standard_normal((12, 3))
    mem = ForgettableMemory(sigma=1.5, C=0.2)
    for i, x in enumerate(X):
        mem.add(x, i, record_id=f"k{i}")
    mem.forget("k11")
    Xt = mem._solver._Xt
    assert not any(np.array_equal(Xt[:, j], X[11]) for j in range(Xt.shape[1]))


# ------------------------------------------------------------------ evictions per call
def test_each_add_reports_its_own_evictions_across_threads():
    rng = np.random.default_rng(13)
    X = rng.standard_normal((400, 2))
    mem = ForgettableMemory(sigma=1.0, nu=0.3, n0=40, budget=40)
    results, errors = [[], []], []
    start = threading.Barrier(2)

    def writer(t):
        try:
            start.wait()
            for i in range(t, len(X), 2):
                results[t].append(mem.add_record(X[i], i, record_id=f"t{t}-{i}"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetExceededWarning)
        threads = [threading.Thread(target=writer, args=(t,)) for t in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors
    reported = [rid for per_thread in results for r in per_thread for rid in r.evicted]
    assert all(isinstance(r, AddResult) for per_thread in results for r in per_thread)
    evicted = {rid for rid, (why, _) in mem.tombstones.items() if why == "evicted"}
    assert len(reported) == len(set(reported)) and set(reported) == evicted
    assert len(evicted) >= 300
    for t, per_thread in enumerate(results):  # ids this thread added, in order
        assert [r.record_id for r in per_thread] == [f"t{t}-{i}" for i in range(t, len(X), 2)]


def test_add_record_matches_add_and_last_evicted():
    mem = ForgettableMemory(sigma=1.0, C=1.0, budget=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetExceededWarning)
        for x in ([0.0, 0.0], [0.1, 0.0], [5.0, 5.0]):
            mem.add(x, "v")
        result = mem.add_record([0.05, 0.0], "v")
    assert result.evicted == (result.record_id,) == mem.last_evicted
    assert result.record_id not in mem


# ------------------------------------------------------------------ hostile CLI input
@pytest.fixture
def store(tmp_path, capsys):
    path = tmp_path / "facts.svtk"
    assert cli(capsys, "init", path, "--sigma", 1.0, "--C", 0.5)[0] == 0
    return path


@pytest.mark.parametrize("command", ["add", "query", "edit"])
def test_deeply_nested_key_is_a_one_line_error(store, capsys, command):
    cli(capsys, "add", store, "--key", "0,0", "--value", "o", "--id", "o")
    before = store.read_bytes()
    deep = "[" * 100_000 + "]" * 100_000
    extra = {"add": ["--value", "x"], "query": [], "edit": []}[command]
    target = ["o"] if command == "edit" else []
    code, out, err = cli(capsys, command, store, *target, "--key", deep, *extra)
    assert code == 1 and out == ""
    assert err.startswith("error: --key is nested too deeply") and len(err.splitlines()) == 1
    assert store.read_bytes() == before


def test_list_prints_ids_unambiguously(store, capsys):
    spoof = "mallory\t\"fake\"\nalice"
    cli(capsys, "add", store, "--key", "0,0", "--value", "v", "--id", spoof)
    cli(capsys, "add", store, "--key", "4,4", "--value", "line\nbreak", "--id", "Zoë")
    code, out, _ = cli(capsys, "list", store)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 and out.isascii()
    rows = [[json.loads(field) for field in line.split("\t")] for line in lines]
    assert rows == [[spoof, "v"], ["Zoë", "line\nbreak"]]
    code, out, _ = cli(capsys, "query", store, "--key", "0,0.1")
    assert len(out.splitlines()) == 1 and json.loads(out.split("\t")[0]) == spoof


def test_add_text_output_escapes_the_id(store, capsys):
    code, out, _ = cli(capsys, "add", store, "--key", "0,0", "--value", "v", "--id",
                       "x\ndigest: forged")
    assert code == 0 and [line.split(":")[0] for line in out.splitlines()] == \
        ["record_id", "n_records", "evicted", "digest"]


# ------------------------------------------------------------------ value-only edits
def _refuse_solver_checks(monkeypatch, solver):
    def refused(*args, **kwargs):
        raise AssertionError("a value-only edit ran a full solver verification")

    for name in ("kkt_residual", "consistency", "audit", "add", "remove"):
        monkeypatch.setattr(solver, name, refused)


def test_value_only_edit_does_not_verify_the_untouched_solver(tmp_path, monkeypatch):
    rng = np.random.default_rng(14)
    X = rng.standard_normal((40, 3))
    mem = ForgettableMemory(sigma=1.5, nu=0.3, n0=40)
    for i, x in enumerate(X):
        mem.add(x, i, record_id=f"k{i}")
    first = mem.edit("k1", value="one")  # no residual known yet: computed once
    fresh = mem._solver.kkt_residual()
    assert first.kkt_residual == fresh
    _refuse_solver_checks(monkeypatch, mem._solver)
    receipts = [mem.edit(f"k{i}", value={"new": i}) for i in range(2, 12)]
    monkeypatch.undo()
    assert all(r.kkt_residual == fresh for r in receipts)
    assert [mem.get(f"k{i}") for i in range(2, 12)] == [{"new": i} for i in range(2, 12)]
    # the digests chain and match a from-scratch evaluation of the same state
    assert all(a.digest_after == b.digest_before for a, b in zip(receipts, receipts[1:]))
    mem.save(tmp_path / "m.svtk")
    loaded = ForgettableMemory.load(tmp_path / "m.svtk")
    assert loaded.state_digest() == receipts[-1].digest_after == mem.state_digest()
    # a loaded memory knows its residual from the load's check: its first edit is cheap too
    _refuse_solver_checks(monkeypatch, loaded._solver)
    assert loaded.edit("k3", value="again").kkt_residual == pytest.approx(fresh, abs=1e-15)


def test_key_edit_and_forget_recompute_the_residual():
    mem = ForgettableMemory(sigma=1.0, C=0.3)
    rng = np.random.default_rng(15)
    for i, x in enumerate(rng.standard_normal((10, 2))):
        mem.add(x, i, record_id=f"k{i}")
    mem.edit("k0", value="v")
    receipt = mem.forget("k1")
    assert receipt.kkt_residual == mem._solver.kkt_residual()
    receipt = mem.edit("k2", key=[3.0, 3.0])
    assert receipt.kkt_residual == mem._solver.kkt_residual()
