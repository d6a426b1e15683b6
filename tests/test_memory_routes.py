"""The memory server's route table against its client and its documentation.

:data:`svtoolkit.memory.server.ROUTES` is the one list of endpoints. These tests hold the
client (``svtoolkit.memory.client.Client``) and ``docs/memory_server.md`` to it: every request
a client method sends is answered by a route of the table, every route of the table is
reachable through a client method (the audit page, which a browser opens, excepted), and the
documentation's endpoint table lists exactly the routes of the table. The client's requests
run in process, through the real ASGI app, on a connection that hands the request to the app
the way uvicorn does (the path percent-decoded, the query string raw).
"""

import asyncio
import importlib
import inspect
import json
import re
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from starlette.routing import Match  # noqa: E402

from svtoolkit.memory import Client, ForgettableMemory  # noqa: E402
from svtoolkit.memory import server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "routes-test-token-0123456789"
#: Routes no client method calls: the audit page, which a browser opens (``GET /``).
PAGE_ONLY = {("GET", "/")}
#: Client methods that send no request of their own: ``request`` is the transport every other
#: method goes through (any method and path), ``close`` closes the connection.
NOT_ENDPOINTS = {"request", "close"}
#: One call of each client method that sends requests (a refusal by the server is an answer
#: too: ``add_text`` on a vector store is refused by ``POST /records`` itself).
CLIENT_CALLS = {
    "add_record": lambda c: c.add_record([3.0, 1.0], "added", record_id="added"),
    "add": lambda c: c.add([4.0, 1.0], "plain", record_id="plain"),
    "add_text": lambda c: c.add_text("a sentence", "text"),
    "edit": lambda c: c.edit("r1", value="edited"),
    "forget": lambda c: c.forget("r2"),
    "evict_reserve": lambda c: c.evict_reserve(),
    "query": lambda c: c.query([0.0, 0.0], k=2),
    "get": lambda c: c.get("r0"),
    "record": lambda c: c.record("r0"),
    "records": lambda c: c.records(),
    "audit": lambda c: c.audit(),
    "audit_info": lambda c: c.audit_info(),
    "receipts": lambda c: c.receipts(),
    "health": lambda c: c.health(),
    "__len__": len,
    "state_digest": lambda c: c.state_digest(),
}


class _Response:
    def __init__(self, status, headers, body):
        self.status, self._headers, self._body = status, headers, body

    def read(self):
        return self._body

    def getheader(self, name, default=None):
        return self._headers.get(name.lower(), default)


class _AppConnection:
    """An ``http.client.HTTPConnection`` stand-in that hands each request to an ASGI app.

    The scope is built as uvicorn builds it: ``path`` percent-decoded, ``raw_path`` and
    ``query_string`` as sent. Every request is logged as (method, target, answer).
    """

    def __init__(self, app, log):
        self._app, self._log, self._pending = app, log, None

    def request(self, method, target, body=None, headers=None):
        raw_path, _, query = target.partition("?")
        data = body or b""
        header_list = [(b"host", b"127.0.0.1:8765"),
                       *((k.lower().encode("latin-1"), v.encode("latin-1"))
                         for k, v in (headers or {}).items())]
        if data:
            header_list.append((b"content-length", str(len(data)).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "root_path": "",
                 "path": urllib.parse.unquote(raw_path), "raw_path": raw_path.encode("ascii"),
                 "query_string": query.encode("ascii"), "headers": header_list,
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8765)}
        messages = [{"type": "http.request", "body": data, "more_body": False}]
        sent = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        asyncio.run(self._app(scope, receive, send))
        payload = b"".join(m.get("body", b"") for m in sent[1:])
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in sent[0]["headers"]}
        self._pending = _Response(sent[0]["status"], headers, payload)
        try:
            answer = json.loads(payload)
        except ValueError:  # the page
            answer = payload.decode("utf-8")
        self._log.append((method, target, sent[0]["status"], answer))

    def getresponse(self):
        response, self._pending = self._pending, None
        return response

    def close(self):
        pass


@pytest.fixture
def served(tmp_path):
    """(app, client, log): a six-record vector store served in process."""
    rng = np.random.default_rng(0)
    mem = ForgettableMemory(sigma=1.0, C=0.3)
    for i, x in enumerate(rng.standard_normal((6, 2))):
        mem.add(x, f"value {i}", record_id=f"r{i}")
    mem.save(tmp_path / "store.svtk")
    app = server.create_app(tmp_path / "store.svtk", token=TOKEN)
    log = []
    client = Client("http://127.0.0.1:8765", TOKEN)
    connection = _AppConnection(app, log)
    client._connection = lambda: connection
    try:
        yield app, client, log
    finally:
        app.service.close()


def _route_of(method, target):
    """The entry of ``ROUTES`` whose route answers ``method target`` (None: none does)."""
    raw_path, _, _ = target.partition("?")
    scope = {"type": "http", "method": method, "path": urllib.parse.unquote(raw_path),
             "root_path": ""}
    matched = [route for route in server.router.routes if route.matches(scope)[0] is Match.FULL]
    assert len(matched) <= 1, (method, target, matched)
    if not matched:
        return None
    (route,) = matched
    return next(e for e in server.ROUTES if e.handler is route.endpoint)


def _public_methods(cls):
    names = {name for name, value in vars(cls).items()
             if not name.startswith("_") and inspect.isfunction(value)}
    return names | {"__len__"}


def test_the_router_is_the_route_table():
    assert [(next(iter(r.methods)), r.path, r.endpoint, r.summary)
            for r in server.router.routes] == [tuple(e) for e in server.ROUTES]
    assert all(len(r.methods) == 1 for r in server.router.routes)  # no implicit HEAD
    assert len({(e.method, e.path) for e in server.ROUTES}) == len(server.ROUTES)
    for entry in server.ROUTES:
        assert inspect.iscoroutinefunction(entry.handler)
        assert entry.handler.__module__ == server.__name__ and "." not in \
            entry.handler.__qualname__, entry  # a module-level function, not a closure


def test_every_client_request_is_a_route_and_every_route_a_client_request(served):
    _, client, log = served
    assert _public_methods(Client) - NOT_ENDPOINTS == set(CLIENT_CALLS), \
        "a client method was added or removed: give it a call in CLIENT_CALLS"
    used = {}
    for name, call in CLIENT_CALLS.items():
        del log[:]
        try:
            call(client)
        except (ValueError, TypeError, KeyError):  # the server's refusal: still a route's answer
            pass
        assert log, f"Client.{name} sent no request"
        for method, target, status, answer in log:
            entry = _route_of(method, target)
            assert entry is not None, f"Client.{name} sends {method} {target}: no such route"
            assert not (isinstance(answer, dict) and answer.get("type") == "HTTPError"), \
                (name, method, target, status, answer)
            used.setdefault((entry.method, entry.path), set()).add(name)
    table = {(e.method, e.path) for e in server.ROUTES}
    assert set(used) | PAGE_ONLY == table, f"routes no client method calls: " \
        f"{sorted(table - set(used) - PAGE_ONLY)}"
    assert not set(used) & PAGE_ONLY


_IDS = ["a\n", "a\nb", "\n", "tab\tnl\n", "a/b", "/", "/lead", "trail/", "%41", "100%",
        "q?x=1&y#z", "..", "sp ace", "\u00fcn\u00ef", "\r\n"]


@pytest.mark.parametrize("record_id", _IDS, ids=repr)
def test_a_record_path_carries_any_id_whole(record_id):
    """Everything after ``/records/`` is the id, newlines and slashes included (a pattern
    ending in ``$`` would also match before a final newline, and ``.`` stops at one)."""
    for method, handler in [("GET", server.get_record), ("PATCH", server.edit_record),
                            ("DELETE", server.forget_record)]:
        scope = {"type": "http", "method": method, "path": "/records/" + record_id,
                 "root_path": ""}
        (route,) = [r for r in server.router.routes if r.endpoint is handler]
        match, child = route.matches(scope)
        assert match is Match.FULL and child["path_params"] == {"record_id": record_id}
        others = [r for r in server.router.routes if r is not route
                  and r.matches(scope)[0] is not Match.NONE]
        assert all(r.endpoint in (server.get_record, server.edit_record,
                                  server.forget_record) for r in others), others


def test_record_ids_round_trip_through_the_client_in_process(served):
    _, client, log = served
    for n, record_id in enumerate(_IDS):
        assert client.add([5.0 + n, 1.0], record_id, record_id=record_id) == record_id
        assert client.get(record_id) == record_id
        assert client.edit(record_id, value=[record_id]).record_id == record_id
        assert client.forget(record_id).record_id == record_id
        with pytest.raises(KeyError, match="already forgotten"):
            client.get(record_id)
    assert all(_route_of(method, target) is not None for method, target, _, _ in log)


def test_a_wrong_method_on_a_record_names_the_path_it_was_sent_to(served):
    app, _, _ = served
    log = []
    connection = _AppConnection(app, log)
    for target, shown in [("/records/r0", "/records/r0"), ("/records/a%2Fb", "/records/a/b")]:
        connection.request("PUT", target, b"{}", {"Authorization": f"Bearer {TOKEN}"})
        assert log[-1][2:] == (405, {"error": f"Method Not Allowed: PUT {shown}",
                                     "type": "HTTPError"})


def _documented_endpoints():
    text = (ROOT / "docs" / "memory_server.md").read_text(encoding="utf-8")
    section = text.split("\n## Endpoints\n", 1)[1].split("\n## ", 1)[0]
    return [tuple(m.groups()) for m in
            re.finditer(r"^\| `([A-Z]+) (/\S*)` \|", section, flags=re.M)]


def test_the_documented_endpoint_table_is_the_route_table():
    # the documentation writes the record id of a path as {id}
    shown = [(e.method, e.path.replace("{record_id:svtoolkit_record_id}", "{id}"))
             for e in server.ROUTES]
    assert _documented_endpoints() == shown


def test_a_missing_framework_names_the_extra_to_install(monkeypatch):
    monkeypatch.delitem(sys.modules, "svtoolkit.memory.server")
    monkeypatch.setitem(sys.modules, "fastapi", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=re.escape(
            "the memory server (svtoolkit memory serve) needs FastAPI and uvicorn, which are "
            "not installed: pip install 'svtoolkit[serve]'")):
        importlib.import_module("svtoolkit.memory.server")
