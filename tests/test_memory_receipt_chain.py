"""The receipt log's chain: each entry carries the hash of the one before, the store holds the
head (count and last hash), and a log that does not fit the store is refused at start.

Each tampering is tried on an unsigned and a signed store: the refusal names the line and
what was expected there, and leaves both files byte for byte as they were. A crash between
the store's save and the log's fsync, a fresh store, a store written before the chain, and
the server's start are covered too.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from svtoolkit.memory import (
    ForgettableMemory,
    MemoryFileError,
    verify_receipt,
)
from svtoolkit.memory._database import SQLITE_MAGIC
from svtoolkit.memory._service import MemoryService
from _store_edit import header_of

KEY = b"receipt-chain-test-key-32-bytes!"
FORGOTTEN = ("r0", "r1", "r2", "r3")


def make_store(path, key=None, n=8, seed=0):
    """A vector-key store of ``n`` records ``r0..`` with values "value i"."""
    rng = np.random.default_rng(seed)
    mem = ForgettableMemory(sigma=1.0, C=0.3, signing_key=key)
    for i, x in enumerate(rng.standard_normal((n, 2))):
        mem.add(x, f"value {i}", record_id=f"r{i}")
    mem.save(path)
    return mem


def log_of(store):
    return str(store) + ".receipts.jsonl"


def lines_of(store):
    with open(log_of(store), "rb") as fh:
        return fh.read().split(b"\n")[:-1]


def write_lines(store, lines):
    with open(log_of(store), "wb") as fh:
        fh.write(b"".join(line + b"\n" for line in lines))


@pytest.fixture(params=[None, KEY], ids=["unsigned", "signed"])
def logged(request, tmp_path):
    """A store with four receipts logged by the service: (store path, key)."""
    store = tmp_path / "s.svtk"
    make_store(store, key=request.param)
    with MemoryService(store, signing_key=request.param) as service:
        for record_id in FORGOTTEN:
            service.forget(record_id)
    assert len(lines_of(store)) == len(FORGOTTEN)
    return store, request.param


def refused(store, key, match, error=MemoryFileError):
    """Starting a service on ``store`` raises ``error`` matching ``match``; no file changes."""
    before = {name: open(name, "rb").read() for name in (str(store), log_of(store))
              if os.path.exists(name)}
    with pytest.raises(error, match=match):
        MemoryService(store, signing_key=key)
    after = {name: open(name, "rb").read() for name in (str(store), log_of(store))
             if os.path.exists(name)}
    assert after == before


# ------------------------------------------------------------------ what a chain holds
def test_each_entry_carries_the_hash_of_the_one_before_and_the_store_holds_the_head(logged):
    store, key = logged
    lines = lines_of(store)
    entries = [json.loads(line) for line in lines]
    for before, entry in zip(lines, entries[1:]):
        assert entry["prev"] == hashlib.sha256(before).hexdigest()
    head = ForgettableMemory.load(store, key=key)._receipt_chain
    assert head["count"] == len(lines) and head["legacy"] == 0
    assert head["head"] == hashlib.sha256(lines[-1]).hexdigest()
    assert head["last"].encode() == lines[-1]
    if key is not None:  # each logged receipt still verifies (prev is not a receipt field)
        assert all(verify_receipt(entry, key) for entry in entries)
    with MemoryService(store, signing_key=key) as service:  # an intact log loads
        assert service.receipts()["total"] == len(FORGOTTEN)
    assert lines_of(store) == lines
    # erasure: the store now holds its last receipt too; no file holds a forgotten value
    for name in (str(store), log_of(store)):
        data = open(name, "rb").read()
        assert all(f"value {i}".encode() not in data for i in range(len(FORGOTTEN)))


# ------------------------------------------------------------------ tampering, refused
def test_a_log_cut_short_is_refused(logged):
    store, key = logged
    write_lines(store, lines_of(store)[:2])
    refused(store, key, r"s\.svtk\.receipts\.jsonl ends after 2 line\(s\), but the store's "
                        r"chain head says the log holds 4 line\(s\).*cut short")


def test_a_deleted_line_is_refused(logged):
    store, key = logged
    lines = lines_of(store)
    write_lines(store, lines[:1] + lines[2:])
    refused(store, key, r"line 2 carries prev [0-9a-f]{16}\.\.\., expected [0-9a-f]{16}\.\.\. "
                        r"\(the hash of line 1\): a line before it was deleted")


def test_two_swapped_lines_are_refused(logged):
    store, key = logged
    lines = lines_of(store)
    write_lines(store, [lines[0], lines[2], lines[1], lines[3]])
    refused(store, key, r"line 2 carries prev .*expected .*\(the hash of line 1\)")


def test_a_duplicated_line_is_refused(logged):
    store, key = logged
    lines = lines_of(store)
    write_lines(store, lines + lines[-1:])
    refused(store, key, r"line 5 carries prev .*expected .*\(the hash of line 4\)")


def test_a_duplicated_first_line_is_refused(logged):
    store, key = logged
    lines = lines_of(store)
    write_lines(store, lines[:1] + lines)
    refused(store, key, r"line 2 carries prev .*\(the hash of line 1\)")


@pytest.mark.parametrize("line", [2, 4])
def test_an_edited_line_is_refused(logged, line):
    """A changed field (the time: an unsigned store has no MAC to catch it) breaks the chain:
    at the next line, or for the last line at the store's head."""
    store, key = logged
    lines = lines_of(store)
    entry = json.loads(lines[line - 1])
    entry["time"] += 1.0
    lines[line - 1] = json.dumps(entry, sort_keys=True, ensure_ascii=True).encode()
    write_lines(store, lines)
    match = (r"line 3 carries prev .*\(the hash of line 2\)" if line == 2 else
             r"line 4 is the store's last logged receipt, but its hash [0-9a-f]{16}\.\.\. "
             r"differs from the store's chain head")
    refused(store, key, match)


def test_a_removed_log_is_refused(logged):
    store, key = logged
    os.unlink(log_of(store))
    refused(store, key, r"s\.svtk\.receipts\.jsonl is missing, but the store's chain head "
                        r"says the log holds 4 line\(s\).*the log was removed")


def test_another_stores_log_is_refused(tmp_path):
    """The genesis is bound to the store: a log made for another store does not fit."""
    a, b = tmp_path / "a.svtk", tmp_path / "b.svtk"
    make_store(a)
    make_store(b)
    for store in (a, b):
        with MemoryService(store) as service:
            service.forget("r0")
    os.replace(log_of(a), log_of(b))
    refused(b, None, r"line 1 carries prev .*\(the chain's genesis .*or the log belongs to "
                     r"another store")


def test_a_store_without_its_head_and_a_chained_log_is_refused(logged):
    """A store whose head is gone (a copy made before the chain started) does not accept a
    chained log."""
    store, key = logged
    mem = ForgettableMemory.load(store, key=key)
    mem._receipt_chain = None
    mem.save(store)
    refused(store, key, r"line 1 is a chained entry \(it carries prev\), but the store holds "
                        r"no chain head")


# ------------------------------------------------------------------ what still loads
def test_a_fresh_store_loads_and_starts_its_chain(tmp_path):
    store = tmp_path / "s.svtk"
    make_store(store)
    with MemoryService(store) as service:  # no log, no head: nothing to check
        assert service.receipts()["total"] == 0
        service.forget("r0")
    from svtoolkit.memory._receipts import chain_genesis

    head = ForgettableMemory.load(store)._receipt_chain
    assert head["count"] == 1 and head["legacy"] == 0
    assert json.loads(lines_of(store)[0])["prev"] == chain_genesis(head["store"], [])
    with MemoryService(store) as service:
        assert service.receipts()["total"] == 1


def test_a_store_written_before_the_chain_loads_and_its_chain_starts_at_the_next_write(
        tmp_path):
    """An old store (no head) with an old log (no prev): loaded as before; the next receipt
    starts the chain, whose genesis covers the old lines, so from then on they are checked
    too."""
    store = tmp_path / "s.svtk"
    make_store(store)
    with MemoryService(store) as service:
        service.forget("r0")
        service.forget("r1")
    old_lines = []
    for line in lines_of(store):  # the log as earlier versions wrote it
        entry = json.loads(line)
        del entry["prev"]
        old_lines.append(json.dumps(entry, sort_keys=True, ensure_ascii=True).encode())
    write_lines(store, old_lines)
    assert header_of(store)["receipt_chain"]["count"] == 2
    mem = ForgettableMemory.load(store)
    mem._receipt_chain = None  # the store as earlier versions wrote it: no head
    mem.save(store)
    assert header_of(store)["receipt_chain"] is None
    with MemoryService(store) as service:  # loads: nothing to check the old lines against
        assert service.receipts()["total"] == 2
        service.forget("r2")
    assert lines_of(store)[:2] == old_lines
    head = ForgettableMemory.load(store)._receipt_chain
    assert head["legacy"] == 2 and head["count"] == 1
    with MemoryService(store) as service:
        assert service.receipts()["total"] == 3
    lines = lines_of(store)
    write_lines(store, lines[1:])  # an old line deleted: now refused
    refused(store, None, r"line 2 is a chained entry \(it carries prev\), but the store's "
                         r"chain head says the log holds 3 line\(s\) \(2 written before "
                         r"the chain, then 1 chained.*a line before it was deleted")
    write_lines(store, [lines[1], lines[0], lines[2]])  # two old lines swapped
    refused(store, None, r"line 3 carries prev .*expected .*\(the chain's genesis \(bound "
                         r"to this store and to the lines before the chain\)\)")


def test_a_version_2_file_starts_its_chain_at_the_first_write(tmp_path):
    """A single file of version 2 predates the chain (no head, no log): the service loads it,
    and its first receipt converts it to a database whose head counts that one line."""
    store = tmp_path / "s.svtk"
    shutil.copyfile(Path(__file__).parent / "data" / "memory_v2.svtk", store)
    assert b"receipt_chain" not in store.read_bytes()
    with MemoryService(store) as service:
        assert service.receipts()["total"] == 0
        service.forget("k5")
    from svtoolkit.memory._receipts import chain_genesis

    assert store.read_bytes().startswith(SQLITE_MAGIC)
    head = header_of(store)["receipt_chain"]
    assert head["legacy"] == 0 and head["count"] == 1
    assert json.loads(lines_of(store)[0])["prev"] == chain_genesis(head["store"], [])
    with MemoryService(store) as service:
        assert service.receipts()["total"] == 1


# ------------------------------------------------------------------ crashes
def _crash_in_forget(store, key, how):
    """Run a forget in another process and kill it (SIGKILL) at ``how``."""
    script = textwrap.dedent(f"""
        import os, signal
        import svtoolkit.memory._service as service_module
        from svtoolkit.memory import _atomic
        key = {key!r}
        service = service_module.MemoryService({str(store)!r}, signing_key=key)
        real_append, real_chunk, calls = service_module._ReceiptLog.append, \\
            _atomic._write_chunk, [0]
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
        def append(self, line):
            if {how!r} == "torn line":
                with open(self.path, "ab") as fh:
                    fh.write(line[: len(line) // 2])
                    fh.flush()
                    os.fsync(fh.fileno())
            die()
        def chunk(fh, data, hasher):
            calls[0] += 1
            if calls[0] == 2:
                fh.flush()
                die()
            real_chunk(fh, data, hasher)
        if {how!r} == "during the save":
            _atomic._write_chunk = chunk
        else:
            service_module._ReceiptLog.append = append
        service.forget("r5")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()


@pytest.mark.parametrize("how", ["before the log line", "torn line"])
def test_a_kill_between_the_store_and_the_log_leaves_a_state_that_loads(logged, how):
    """The store is saved first (with the new head and its last entry); a kill before the
    log line is whole leaves the log one entry short: that entry is restored from the store
    at the next start, so the operation's receipt is not lost."""
    store, key = logged
    lines = lines_of(store)
    _crash_in_forget(store, key, how)
    mem = ForgettableMemory.load(store, key=key)
    assert "r5" not in mem and len(lines_of(store)) == len(lines)  # committed, not logged
    with MemoryService(store, signing_key=key) as service:
        got = service.receipts()
        assert got["total"] == len(lines) + 1
        newest = got["receipts"][-1]
        assert newest["record_id"] == "r5" and newest["digest_after"] == mem.state_digest()
        assert key is None or verify_receipt(newest, key)
    restored = lines_of(store)
    assert restored[:-1] == lines and restored[-1] == mem._receipt_chain["last"].encode()
    with MemoryService(store, signing_key=key) as service:  # and it stays whole
        assert service.receipts()["total"] == len(lines) + 1
        service.forget("r6")
    assert len(lines_of(store)) == len(lines) + 2


def test_a_failed_log_write_is_caught_up_before_the_next_receipt(logged, monkeypatch):
    """A receipt whose line could not be written (the store holds it) is appended before
    the next one, so the chain has no gap."""
    from svtoolkit.memory import _service

    store, key = logged
    real = _service._ReceiptLog.append
    with MemoryService(store, signing_key=key) as service:
        def failing(self, line):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(_service._ReceiptLog, "append", failing)
        out = service.forget("r5")
        assert any("not yet written" in note for note in out["warnings"])
        monkeypatch.setattr(_service._ReceiptLog, "append", real)
        service.forget("r6")
    assert [json.loads(line)["record_id"] for line in lines_of(store)] == \
        [*FORGOTTEN, "r5", "r6"]
    with MemoryService(store, signing_key=key) as service:
        assert service.receipts()["total"] == len(FORGOTTEN) + 2


# ------------------------------------------------------------------ the server
@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_the_server_refuses_to_start_on_a_tampered_log(tmp_path, key):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_memory_server import Server

    store = tmp_path / "s.svtk"
    make_store(store, key=key)
    server = Server(store, tmp_path, key=key)
    try:
        for record_id in FORGOTTEN:
            server.client.forget(record_id)
    finally:
        server.stop()
    lines = lines_of(store)
    write_lines(store, lines[:1] + lines[2:])
    before = open(store, "rb").read(), open(log_of(store), "rb").read()
    with pytest.raises(RuntimeError, match=r"(?s)server failed: .*line 2 carries prev "
                                           r".*\(the hash of line 1\)"):
        Server(store, tmp_path, key=key)
    assert (open(store, "rb").read(), open(log_of(store), "rb").read()) == before
