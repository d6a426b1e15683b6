"""Signed memory files and receipts: HMAC-SHA256 under a secret key.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from svtoolkit.cli import main
from svtoolkit.memory import (
    DeletionReceipt,
    ForgettableMemory,
    MemoryAuthenticationError,
    MemoryFileError,
    ReceiptError,
    StaleStateError,
    verify_receipt,
)
from _store_edit import edit_store, header_of, read_rows

KEY = b"k" * 16 + b"-the-auditors-key"
OTHER = b"o" * 32
HEADER = struct.Struct("<8sIIQ")  # single files (versions 1, 2): magic, version, flags, length
DATA = Path(__file__).parent / "data"
V2_KEY = b"version-2-fixture-key-32-bytes!!"  # tests/data/memory_v2_signed.svtk's


def signed_memory(seed=0, n=12):
    rng = np.random.default_rng(seed)
    mem = ForgettableMemory(sigma=1.5, C=0.3, signing_key=KEY)
    for i, x in enumerate(rng.standard_normal((n, 3))):
        mem.add(x, {"i": i}, record_id=f"k{i}")
    return mem


def recompute_checksum(body):
    return body + hashlib.sha256(body).digest()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "signed.svtk"
    signed_memory().save(path)
    return path


# ------------------------------------------------------------------ files
def test_signed_round_trip(saved):
    loaded = ForgettableMemory.load(saved, key=KEY)
    assert loaded.signed and len(loaded) == 12
    assert ForgettableMemory.load(saved).signed is False  # no key: the MAC is not checked


def test_unsigned_file_is_refused_with_a_key(tmp_path):
    path = tmp_path / "plain.svtk"
    ForgettableMemory(sigma=1.0, C=0.5).save(path)
    with pytest.raises(MemoryAuthenticationError, match="the store is not signed"):
        ForgettableMemory.load(path, key=KEY)
    # a single file of version 2, unsigned, likewise
    with pytest.raises(MemoryAuthenticationError, match="the file is not signed"):
        ForgettableMemory.load(DATA / "memory_v2.svtk", key=KEY)


def test_flipped_byte_with_recomputed_checksum_is_refused(saved):
    """The revision is outside the digest: without a key, only the seal guards it, and whoever
    can write the file can recompute an unkeyed seal."""
    meta = read_rows(saved)[0]
    assert meta["signed"] == 1 and header_of(saved)["revision"] == 12
    assert meta["header"].count(b'"revision":12,') == 1
    edit_store(saved, header_text=meta["header"].replace(b'"revision":12,',
                                                         b'"revision":13,'))  # one byte
    assert read_rows(saved)[0]["seal"] != meta["seal"]  # resealed, without the key
    assert ForgettableMemory.load(saved).revision == 13  # the unkeyed checks cannot tell
    with pytest.raises(MemoryAuthenticationError, match="MAC mismatch: the store was modified"):
        ForgettableMemory.load(saved, key=KEY)


def test_stripped_mac_is_refused(saved):
    edit_store(saved, sql=[("UPDATE meta SET value = 0 WHERE name = 'signed'", ()),
                           ("UPDATE meta SET value = '' WHERE name = 'mac'", ())])
    assert read_rows(saved)[0]["signed"] == 0
    assert len(ForgettableMemory.load(saved)) == 12  # a valid unsigned store now
    with pytest.raises(MemoryAuthenticationError, match="not signed .* MAC was stripped"):
        ForgettableMemory.load(saved, key=KEY)


@pytest.mark.parametrize("signed, mac, message", [
    (0, None, "'signed' is 0 but it holds a MAC"),  # the mark cleared, the MAC left
    (7, None, "meta row 'signed' is 7, not 0 or 1"),
    (1, "", "'signed' is 1 but it holds no MAC"),
])
def test_a_signed_mark_that_disagrees_is_refused(saved, signed, mac, message):
    sql = [("UPDATE meta SET value = ? WHERE name = 'signed'", (signed,))]
    if mac is not None:
        sql.append(("UPDATE meta SET value = ? WHERE name = 'mac'", (mac,)))
    edit_store(saved, sql=sql)
    with pytest.raises(MemoryFileError, match=message):
        ForgettableMemory.load(saved)


def test_a_signed_store_loaded_without_its_key_is_still_checked_for_damage(saved):
    edit_store(saved, header=lambda h: {**h, "revision": h["revision"] + 1}, reseal=False)
    with pytest.raises(MemoryFileError, match="seal mismatch"):
        ForgettableMemory.load(saved)


def test_mac_from_another_key_is_refused(tmp_path):
    path = tmp_path / "other.svtk"
    signed_memory().save(path, key=OTHER)
    with pytest.raises(MemoryAuthenticationError, match="signed with another key"):
        ForgettableMemory.load(path, key=KEY)
    assert ForgettableMemory.load(path, key=OTHER).signed


def test_unknown_flags_are_refused(tmp_path):
    """Flags exist in the single files only (a store database has no flags word)."""
    path = tmp_path / "v2.svtk"
    data = bytearray((DATA / "memory_v2.svtk").read_bytes())
    assert HEADER.unpack_from(data, 0)[1:3] == (2, 0)  # version 2, no flags
    struct.pack_into("<I", data, 12, 0x3)
    path.write_bytes(recompute_checksum(bytes(data[:-32])))
    with pytest.raises(MemoryFileError, match="unknown flags 0x3"):
        ForgettableMemory.load(path)


@pytest.mark.parametrize("key, exc, match", [
    ("a text key of 24 chars..", TypeError, "key must be bytes .* encode text keys"),
    (b"short", ValueError, "at least 16 bytes; got 5"),
    (12345, TypeError, "key must be bytes"),
])
def test_bad_keys_are_refused(saved, key, exc, match):
    with pytest.raises(exc, match=match):
        ForgettableMemory.load(saved, key=key)
    with pytest.raises(exc, match=match):
        ForgettableMemory(sigma=1.0, C=0.5, signing_key=key)
    with pytest.raises(exc, match=match):
        signed_memory().save(saved, key=key)


def test_mac_comparisons_are_constant_time(saved, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    ForgettableMemory.load(saved, key=KEY)
    assert calls == [(str, str)]  # the database's seal (hex)
    receipt = ForgettableMemory.load(saved, key=KEY).forget("k1")
    assert verify_receipt(receipt, KEY)
    assert calls[-1] == (str, str) and len(calls) == 3
    calls.clear()
    ForgettableMemory.load(DATA / "memory_v2_signed.svtk", key=V2_KEY)
    assert calls == [(bytes, bytes)]  # a single file's MAC (raw bytes)


# ------------------------------------------------------------------ receipts
def test_receipts_carry_a_mac_that_verifies():
    mem = signed_memory()
    receipt = mem.forget("k3", audit=True)
    assert isinstance(receipt, DeletionReceipt) and len(receipt.mac) == 64
    assert receipt.revision == mem.revision
    assert verify_receipt(receipt, KEY)
    assert verify_receipt(json.loads(json.dumps(receipt.to_dict())), KEY)  # as printed
    assert not verify_receipt(receipt, OTHER)
    forged = receipt.to_dict() | {"record_id": "k4"}
    assert not verify_receipt(forged, KEY)
    assert not verify_receipt(receipt.to_dict() | {"mac": None}, KEY)
    assert not verify_receipt(receipt.to_dict() | {"mac": "é" * 64}, KEY)
    edit = mem.edit("k5", value="new")
    assert verify_receipt(edit, KEY) and edit.revision == receipt.revision + 1


def test_unsigned_memory_gives_unsigned_receipts():
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([0.0], "a", record_id="a")
    receipt = mem.forget("a")
    assert receipt.mac is None and not verify_receipt(receipt, KEY)


def test_verify_receipt_rejects_bad_input():
    with pytest.raises(ValueError, match="receipt is missing field"):
        verify_receipt({"operation": "forget"}, KEY)
    with pytest.raises(TypeError, match="receipt must be a DeletionReceipt"):
        verify_receipt("receipt", KEY)


def test_replayed_older_file_is_caught_by_the_newest_receipt(tmp_path):
    path, old = tmp_path / "m.svtk", tmp_path / "old-copy.svtk"
    mem = signed_memory()
    mem.save(path)
    shutil.copyfile(path, old)  # the attacker keeps the state that still holds k2
    receipt = mem.forget("k2")
    mem.save(path)
    ForgettableMemory.load(path, key=KEY).check_receipt(receipt)  # the real file: fine
    shutil.copyfile(old, path)  # replay
    replayed = ForgettableMemory.load(path, key=KEY)  # its MAC is genuine
    assert "k2" in replayed
    with pytest.raises(StaleStateError, match="older than the receipt's revision .* replayed"):
        replayed.check_receipt(receipt)
    with pytest.raises(StaleStateError, match="older than the receipt"):
        replayed.check_receipt(json.loads(json.dumps(receipt.to_dict())))


def test_later_states_pass_and_forks_fail_the_receipt_check():
    mem = signed_memory()
    receipt = mem.forget("k2")
    mem.check_receipt(receipt)
    mem.add([5.0, 5.0, 5.0], "later", record_id="later")
    mem.check_receipt(receipt)  # a later revision follows the receipt
    fork = signed_memory()
    fork.forget("k3")  # same revision, another state
    with pytest.raises(StaleStateError, match="state digest differs"):
        fork.check_receipt(receipt)
    with pytest.raises(ReceiptError, match="does not verify"):
        mem.check_receipt(receipt.to_dict() | {"revision": 0})
    plain = ForgettableMemory(sigma=1.0, C=0.5)
    with pytest.raises(ValueError, match="needs a memory with a signing key"):
        plain.check_receipt(receipt)


# ------------------------------------------------------------------ command line
def cli(capsys, *argv):
    code = main(["memory", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_signs_with_a_key_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SVTOOLKIT_MEMORY_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")  # a trailing newline is not part of the key
    store = tmp_path / "s.svtk"
    k = ["--key-file", key_file]
    code, out, _ = cli(capsys, "init", store, "--sigma", 1.0, "--C", 0.5, *k)
    assert code == 0 and "(signed)" in out
    cli(capsys, "add", store, "--key", "0,0", "--value", "secret", "--id", "a", *k)
    cli(capsys, "add", store, "--key", "3,0", "--value", "b", "--id", "b", *k)
    code, out, _ = cli(capsys, "forget", store, "a", *k)
    receipt = json.loads(out)
    assert code == 0 and verify_receipt(receipt, KEY)
    ForgettableMemory.load(store, key=KEY)
    code, _, err = cli(capsys, "list", store)  # no key: a signed file still reads
    assert code == 0
    receipt_file = tmp_path / "receipt.json"
    receipt_file.write_text(json.dumps(receipt))
    code, out, _ = cli(capsys, "check-receipt", store, receipt_file, *k)
    assert code == 0 and out.startswith("ok:")
    wrong = tmp_path / "wrong"
    wrong.write_bytes(OTHER)
    code, _, err = cli(capsys, "list", store, "--key-file", wrong)
    assert code == 1 and "MAC mismatch" in err and len(err.splitlines()) == 1


def test_cli_takes_the_key_from_the_environment(tmp_path, capsys, monkeypatch):
    store, old = tmp_path / "s.svtk", tmp_path / "old.svtk"
    monkeypatch.setenv("SVTOOLKIT_MEMORY_KEY", KEY.decode())
    assert cli(capsys, "init", store, "--sigma", 1.0, "--C", 0.5)[0] == 0
    cli(capsys, "add", store, "--key", "0,0", "--value", "secret", "--id", "a")
    cli(capsys, "add", store, "--key", "3,0", "--value", "b", "--id", "b")
    shutil.copyfile(store, old)
    code, out, _ = cli(capsys, "forget", store, "a")
    receipt_file = tmp_path / "r.json"
    receipt_file.write_text(out)
    shutil.copyfile(old, store)  # replay the file that still holds "a"
    code, _, err = cli(capsys, "check-receipt", store, receipt_file)
    assert code == 1 and err.startswith("error: ") and "replayed or rolled back" in err
    monkeypatch.setenv("SVTOOLKIT_MEMORY_KEY", "too-short")
    code, _, err = cli(capsys, "list", store)
    assert code == 1 and "at least 16 bytes" in err


def test_cli_sign_and_key_required(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SVTOOLKIT_MEMORY_KEY", raising=False)
    store = tmp_path / "s.svtk"
    cli(capsys, "init", store, "--sigma", 1.0, "--C", 0.5)
    code, _, err = cli(capsys, "sign", store)
    assert code == 1 and "sign needs a key" in err
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    assert cli(capsys, "sign", store, "--key-file", key_file)[0] == 0
    assert ForgettableMemory.load(store, key=KEY).signed
    # --key (a record key) is never read as an abbreviation of --key-file
    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error
        main(["memory", "list", str(store), "--key", str(key_file)])


def test_a_signed_store_is_never_written_without_its_key(saved):
    data = saved.read_bytes()
    unkeyed = ForgettableMemory.load(saved)  # reads without the key (MAC unchecked)
    unkeyed.forget("k1")
    with pytest.raises(ValueError, match=r"is a signed store: saving this memory without its "
                                         r"signing key would replace it unsigned"):
        unkeyed.save(saved)
    assert saved.read_bytes() == data
    unkeyed.save(saved, key=KEY)  # with the key it is written, signed
    assert ForgettableMemory.load(saved, key=KEY).revision == 13


@pytest.mark.parametrize("argv", [
    ["add", "--key", "0,0,0", "--value", "x", "--id", "new"],
    ["forget", "k1"],
    ["edit", "k1", "--value", "changed"],
])
def test_the_cli_refuses_to_write_a_signed_store_without_its_key(saved, capsys, monkeypatch,
                                                                 tmp_path, argv):
    monkeypatch.delenv("SVTOOLKIT_MEMORY_KEY", raising=False)
    data = saved.read_bytes()
    code, _, err = cli(capsys, argv[0], saved, *argv[1:])
    assert code == 1 and "is signed: give its key (--key-file PATH" in err
    assert saved.read_bytes() == data
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    code, _, err = cli(capsys, argv[0], saved, *argv[1:], "--key-file", key_file)
    assert code == 0, err
    assert ForgettableMemory.load(saved, key=KEY).revision == 13
