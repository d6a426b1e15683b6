"""The store database: a save to the store a memory is bound to writes the change in place (a
few pages, not the file), a committed forget leaves the forgotten key and value in no file, a
writer killed inside its transaction leaves the previous state, and a save to a store that
another writer changed becomes a whole new database."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from svtoolkit.memory import ForgettableMemory
from svtoolkit.memory import _database as D

SECRET = "the-secret-value-7f3a"
PAGE = 4096


def build(path, n=6000, d=8, seed=0):
    """A saved store of n records (enough pages that a rewrite would show), with one record
    whose value is SECRET and whose key is returned."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    mem = ForgettableMemory(sigma=3.0, nu=0.3, n0=n)
    mem.extend(X, [f"value {i}" for i in range(n)], record_ids=[f"r{i}" for i in range(n)])
    secret_key = rng.standard_normal(d) * 0.1  # near the centre: a support record
    mem.add(secret_key, SECRET, record_id="secret")
    mem.save(path)
    return secret_key


def pages(path):
    data = path.read_bytes()
    return [data[i:i + PAGE] for i in range(0, len(data), PAGE)]


def files_holding(directory, needle):
    return sorted(p.name for p in directory.iterdir() if p.is_file() and needle in p.read_bytes())


def test_a_save_to_the_bound_store_rewrites_only_the_pages_of_the_change(tmp_path):
    path = tmp_path / "m.svtk"
    build(path)
    mem = ForgettableMemory.load(path)
    before, inode = pages(path), path.stat().st_ino
    mem.edit("r17", value="edited")  # a value: the solver does not move
    mem.save(path)
    after = pages(path)
    assert path.stat().st_ino == inode  # in place, not a new file renamed over it
    changed = sum(a != b for a, b in zip(before, after)) + abs(len(after) - len(before))
    assert changed <= 8, f"{changed} of {len(before)} pages changed for one edited value"
    mem.forget("r3")  # the solver moves: every gradient and some coefficients (8 bytes a key
    before = after    # each), not the keys, values or margin rows
    mem.save(path)
    after = pages(path)
    changed = sum(a != b for a, b in zip(before, after)) + abs(len(after) - len(before))
    array_pages = -(-len(mem) * 8 // PAGE)
    assert changed <= 2 * array_pages + 16 < len(before) // 4, (changed, len(before))
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == mem.state_digest() and "r3" not in loaded
    assert loaded.get("r17") == "edited"


def test_a_committed_forget_leaves_the_key_and_value_in_no_file(tmp_path):
    path = tmp_path / "m.svtk"
    secret_key = build(path)
    assert files_holding(tmp_path, SECRET.encode()) == ["m.svtk"]
    mem = ForgettableMemory.load(path)
    inode = path.stat().st_ino
    mem.forget("secret")
    mem.save(path)
    assert path.stat().st_ino == inode  # the incremental write, not a rename
    assert files_holding(tmp_path, SECRET.encode()) == []
    assert files_holding(tmp_path, secret_key.astype("<f8").tobytes()) == []
    assert not any(p.name.endswith("-journal") for p in tmp_path.iterdir())
    assert "secret" in ForgettableMemory.load(path).tombstones


@pytest.mark.parametrize("phase", ["_write_records", "_write_slots", "_write_meta"])
def test_a_writer_killed_inside_its_transaction_leaves_the_previous_state(tmp_path, phase):
    path = tmp_path / "m.svtk"
    build(path, n=3000)
    previous = ForgettableMemory.load(path)
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory._database as D
        from svtoolkit.memory import ForgettableMemory
        mem = ForgettableMemory.load({str(path)!r})
        mem.forget("secret")
        mem.add([9.0] * 8, "late", record_id="late")
        real = D.{phase}
        def dying(*args, **kwargs):
            real(*args, **kwargs)
            os._exit(9)  # mid-transaction: no rollback, no cleanup
        D.{phase} = dying
        mem.save({str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == 9, proc.stderr.decode()
    assert (tmp_path / "m.svtk-journal").exists()  # what the writer left
    mem = ForgettableMemory.load(path)  # a hot journal is rolled back by the next connection
    assert mem.state_digest() == previous.state_digest() and "secret" in mem
    assert "late" not in mem
    mem.forget("secret")  # the next committed write removes the journal; the erasure holds
    mem.save(path)
    assert not (tmp_path / "m.svtk-journal").exists()
    assert files_holding(tmp_path, SECRET.encode()) == []


def test_a_whole_write_after_a_killed_writer_removes_its_journal(tmp_path):
    """A new database renamed over the store must not sit beside the replaced file's journal
    (it holds that file's pages, the forgotten record among them)."""
    path = tmp_path / "m.svtk"
    build(path, n=300)
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory._database as D
        from svtoolkit.memory import ForgettableMemory
        mem = ForgettableMemory.load({str(path)!r})
        mem.add([9.0] * 8, "late", record_id="late")
        real = D._write_meta
        def dying(*args):
            real(*args)
            os._exit(9)
        D._write_meta = dying
        mem.save({str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == 9, proc.stderr.decode()
    assert files_holding(tmp_path, SECRET.encode()) == ["m.svtk", "m.svtk-journal"]
    mem = ForgettableMemory.load(path)
    mem.forget("secret")
    mem._binding = None  # as a memory that was not read from this store: a whole new file
    mem.save(path)
    assert files_holding(tmp_path, SECRET.encode()) == []
    assert ForgettableMemory.load(path).state_digest() == mem.state_digest()


def test_a_failed_transaction_changes_nothing_and_the_next_save_writes_it_all(tmp_path,
                                                                             monkeypatch):
    path = tmp_path / "m.svtk"
    build(path, n=500)
    mem = ForgettableMemory.load(path)
    digest = mem.state_digest()
    mem.forget("secret")
    real = D._write_meta

    def failing(*args):
        real(*args)
        raise OSError("simulated: disk full at the commit")

    monkeypatch.setattr(D, "_write_meta", failing)
    with pytest.raises(OSError, match="disk full"):
        mem.save(path)
    assert ForgettableMemory.load(path).state_digest() == digest  # rolled back
    monkeypatch.setattr(D, "_write_meta", real)
    mem.save(path)  # the changes were kept for the next write
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == mem.state_digest() and "secret" not in loaded
    assert files_holding(tmp_path, SECRET.encode()) == []


def test_a_store_changed_by_another_writer_is_written_whole(tmp_path):
    path = tmp_path / "m.svtk"
    build(path, n=500)
    first, second = ForgettableMemory.load(path), ForgettableMemory.load(path)
    second.forget("r1")
    second.save(path)  # the store no longer holds what `first` was bound to
    inode = path.stat().st_ino
    first.edit("r2", value="from first")
    first.save(path)
    assert path.stat().st_ino != inode  # a new database renamed into place
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == first.state_digest() and loaded.get("r2") == "from first"


def test_a_reload_is_the_same_solver_bit_for_bit(tmp_path):
    """The margin kernel rows and positions are not stored: recomputed at load, they are the
    rows the walk maintained, to the bit (and the next operation takes the same steps)."""
    path = tmp_path / "m.svtk"
    build(path, n=800)
    mem = ForgettableMemory.load(path)
    for i in range(0, 40, 3):
        mem.forget(f"r{i}")
    mem.add(np.full(8, 0.05), "new", record_id="new")
    mem.save(path)
    loaded = ForgettableMemory.load(path)
    a, b = mem._solver.state_dict(), loaded._solver.state_dict()
    for name, value in a.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == b[name].dtype and np.array_equal(
                value.view(np.uint8), b[name].view(np.uint8)), name
        else:
            assert value == b[name], name
    mem.forget("r41")
    loaded.forget("r41")
    assert mem.state_digest() == loaded.state_digest()


def test_the_database_says_what_it_is(tmp_path):
    path = tmp_path / "m.svtk"
    build(path, n=100)
    assert path.read_bytes().startswith(D.SQLITE_MAGIC)
    assert D.is_database(path) and not D.is_signed_store(path)
    ForgettableMemory.load(path).save(path, key=b"k" * 32)
    assert D.is_signed_store(path)
    assert not D.is_database(tmp_path / "absent.svtk")
    assert os.stat(path).st_mode & 0o077 == 0  # readable by its owner only


@pytest.mark.parametrize("d, expected", [(8, 4096), (120, 4096), (121, 8192), (384, 16384),
                                         (768, 32768), (4096, 65536)])
def test_the_page_size_holds_several_records(d, expected):
    assert D.page_size(8 * d) == expected


def test_wide_keys_fill_their_pages(tmp_path):
    """d = 384: on SQLite's default 4 KiB page a record (a 3 KiB key) left a quarter of its
    page empty (41.5 MB for 10^4 records of 32.7 MB content); 16 KiB pages hold five."""
    path = tmp_path / "m.svtk"
    n, d = 600, 384
    X = np.random.default_rng(3).standard_normal((n, d))
    mem = ForgettableMemory(sigma=30.0, nu=0.3, n0=n)
    mem.extend(X, list(range(n)), record_ids=[f"r{i}" for i in range(n)])
    mem.save(path)
    header = path.read_bytes()[:100]
    assert int.from_bytes(header[16:18], "big") == 16384  # the page size field
    content = n * 8 * d  # the keys alone
    slots = n * (8 + 8 + 8 + 1)  # ids, alpha, grad, status
    # 5 records of 3,072 + ~40 bytes fill 15.6 KB of a 16 KB page (95 %); the rest: a few
    # pages of metadata, the id index and the slot blocks
    assert path.stat().st_size <= 1.1 * (content + slots) + 16 * 16384
    assert files_holding(tmp_path, X[5].astype("<f8").tobytes()) == ["m.svtk"]
    mem.forget("r5")
    mem.save(path)
    assert files_holding(tmp_path, X[5].astype("<f8").tobytes()) == []  # erased on big pages
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == mem.state_digest() and "r5" not in loaded
