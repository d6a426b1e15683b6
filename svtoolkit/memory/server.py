"""The memory as a local service: an ASGI app (FastAPI) and :func:`serve` (uvicorn).

``svtoolkit memory serve STORE`` keeps one :class:`~svtoolkit.memory.ForgettableMemory` (and,
for a text store, the sentence encoder) resident and answers JSON over HTTP. Endpoints, the
error mapping, the security rules and the durability rule are in ``docs/memory_server.md``;
the state rules (one writer, saved before acknowledged, a refused request changes nothing,
receipts) are those of :class:`svtoolkit.memory._service.MemoryService`.

The endpoints are one table, :data:`ROUTES`; :data:`router` is built from it and every
handler is a module-level function that gets the app's service as a FastAPI dependency.
:func:`create_app` puts the router into an app with one service, inside the token guard.

Needs the optional extra ``serve`` (FastAPI and uvicorn): ``pip install 'svtoolkit[serve]'``.
"""

import base64
import hashlib
import hmac
import importlib.resources
import ipaddress
import json
import re
import socket
import sys
import traceback
from typing import Annotated, Callable, NamedTuple

try:
    import uvicorn
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import HTMLResponse, JSONResponse
    from starlette.convertors import Convertor, register_url_convertor
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
except ImportError as exc:
    raise ImportError("the memory server (svtoolkit memory serve) needs FastAPI and uvicorn, "
                      "which are not installed: pip install 'svtoolkit[serve]'") from exc

from .._validation import check_int, check_positive
from ..exact import SolverFailure
from ..exact._warmup import warm_walk
from ._codec import MAX_VALUE_BYTES
from ._search import warm_search
from ._service import (DEFAULT_MAX_VALUE_BYTES, DEFAULT_PAGE, MemoryService,
                       ServiceUnavailable, StoreChangedError, TooLarge)
from .client import MIN_TOKEN_CHARS, _TOKEN

__all__ = ["create_app", "serve", "router", "ROUTES", "Endpoint", "DEFAULT_PORT",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_REQUEST_TIMEOUT", "MAX_WAITING_PER_CLIENT",
           "MAX_CONNECTIONS"]

#: TCP port :func:`serve` listens on by default.
DEFAULT_PORT = 8765
#: Seconds a connection has to deliver a whole request (see :func:`serve`).
DEFAULT_REQUEST_TIMEOUT = 10.0
#: Connections of one client address that may wait for their request at once.
MAX_WAITING_PER_CLIENT = 32
#: Connections and requests in progress at once; beyond, requests get 503.
MAX_CONNECTIONS = 512
#: Largest request body accepted, in bytes.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: Paths answered without a token: the health probe, and the audit page (static code, no data:
#: a browser cannot send a bearer token when it opens a page; the page sends it with every
#: request for data).
_OPEN_PATHS = frozenset({"/health", "/"})
_COMMON_HEADERS = [(b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"),
                   (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]
_INT = re.compile(r"[0-9]{1,18}")


class _RecordIdConvertor(Convertor):
    """The ``{record_id}`` of ``/records/{record_id}``: everything after ``/records/``.

    uvicorn hands the path over percent-decoded, so an id (which may hold any character) can
    bring ``/`` and newlines into it. Starlette's own ``path`` convertor is ``.*``, which stops
    at a newline, and its route patterns end in ``$``, which also matches just before a final
    newline: ``/records/a%0A`` would be the record ``"a"``. ``(?s:.*)`` takes newlines too and,
    greedy, runs to the end of the path, so the whole rest is the id (the empty one included,
    which the service refuses as unknown).
    """

    regex = r"(?s:.*)"

    def convert(self, value):
        return value

    def to_string(self, value):
        return str(value)


# Starlette keeps one registry of convertors per process: the name is this package's
register_url_convertor("svtoolkit_record_id", _RecordIdConvertor())
_RECORD_PATH = "/records/{record_id:svtoolkit_record_id}"


class _HTTPError(Exception):
    def __init__(self, status, message, kind="HTTPError"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _status_of(exc):
    """HTTP status of an exception (the mapping of ``docs/memory_server.md``)."""
    if isinstance(exc, _HTTPError):
        return exc.status
    if isinstance(exc, KeyError):
        return 404
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, RecursionError):
        return 400
    if isinstance(exc, TypeError):
        return 422
    if isinstance(exc, ValueError):
        return 400
    if isinstance(exc, StoreChangedError):
        return 409
    if isinstance(exc, (ServiceUnavailable, OSError)):
        return 503
    return 500


def _message_of(exc):
    if isinstance(exc, KeyError):
        return str(exc.args[0]) if exc.args else "unknown record id"
    if isinstance(exc, RecursionError):
        return "input nested too deeply"
    if isinstance(exc, OSError) and not isinstance(exc, _HTTPError):
        return f"the store could not be saved, nothing changed: {exc}"
    if isinstance(exc, SolverFailure):
        return f"solver failure, nothing changed: {exc}"
    if _status_of(exc) == 500:
        return "internal error, nothing changed (see the server's log)"
    return str(exc)


async def _send_json(send, status, payload, headers=()):
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """ASGI middleware: the Host check, the bearer token (constant-time) and security headers."""

    def __init__(self, app, token, page_policy):
        self.app = app
        self._expected = f"Bearer {token}".encode("ascii")
        self._page_policy = page_policy.encode("ascii")
        #: Host header values accepted (None: any; :func:`serve` sets the bound address).
        self.allowed_hosts = None

    def _host_allowed(self, scope):
        if self.allowed_hosts is None:
            return True
        hosts = [value for name, value in scope.get("headers", ()) if name == b"host"]
        return len(hosts) == 1 and hosts[0].lower() in self.allowed_hosts

    def _authorized(self, scope):
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        extra = list(_COMMON_HEADERS)
        if path == "/":
            extra.append((b"content-security-policy", self._page_policy))

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        if not self._host_allowed(scope):
            # a page of another origin whose name was rebound to this address (DNS rebinding)
            # sends its own name: refused before anything else, the token included
            await _send_json(send_with_headers, 421, {
                "error": "the Host header does not name this server's address (requests "
                         "through another name are refused: DNS rebinding)",
                "type": "MisdirectedRequest"})
            return None
        if path not in _OPEN_PATHS and not self._authorized(scope):
            await _send_json(send_with_headers, 401, {
                "error": "a valid bearer token is required (Authorization: Bearer TOKEN)",
                "type": "AuthenticationError"},
                [(b"www-authenticate", b'Bearer realm="svtoolkit-memory"')])
            return None
        return await self.app(scope, receive, send_with_headers)


def _audit_page():
    """The audit page and its Content-Security-Policy (inline code allowed by its hash only)."""
    html = importlib.resources.files(__package__).joinpath("_page.html").read_text("utf-8")

    def digests(tag):
        return " ".join(
            "'sha256-" + base64.b64encode(hashlib.sha256(m.encode("utf-8")).digest()).decode()
            + "'" for m in re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S))

    policy = (f"default-src 'none'; script-src {digests('script')}; style-src "
              f"{digests('style')}; connect-src 'self'; img-src 'self'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'none'")
    return html, policy


def _query_params(request, allowed):
    params = dict(request.query_params)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"unknown query parameter(s) {', '.join(map(repr, unknown))}; "
                         f"expected {', '.join(allowed) or 'none'}")
    return params


def _int_param(params, name, default):
    text = params.get(name)
    if text is None:
        return default
    if not _INT.fullmatch(text):
        raise ValueError(f"{name} must be an integer >= 0; got {text!r}")
    return int(text)


def _bool_param(params, name, default, *, levels=False):
    """A true/false query parameter; with ``levels``, any other text is passed on as given
    (``verify`` also takes the memory's level names, which the memory itself checks)."""
    text = params.get(name)
    if text is None:
        return default
    if text.lower() in ("true", "false", "1", "0"):
        return text.lower() in ("true", "1")
    if levels:
        return text
    raise ValueError(f"{name} must be true or false; got {text!r}")


# ------------------------------------------------------------------ answering a request
def _error(exc):
    """The JSON error answer of an exception (500s print their traceback to stderr)."""
    status = _status_of(exc)
    if status == 500:
        traceback.print_exception(exc, file=sys.stderr)
    return JSONResponse({"error": _message_of(exc),
                         "type": getattr(exc, "kind", type(exc).__name__)}, status)


async def _body_of(request):
    """The request's JSON body, at most ``app.state.max_body_bytes`` long (413 beyond)."""
    limit = request.app.state.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and (not _INT.fullmatch(length) or int(length) > limit):
        raise _HTTPError(413, f"request body larger than {limit} bytes", "TooLarge")
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise _HTTPError(413, f"request body larger than {limit} bytes", "TooLarge")
    except ClientDisconnect:  # gone mid-body (or dropped for being slow): nothing to do
        raise _HTTPError(400, "the client disconnected before sending the whole body",
                         "ClientDisconnect") from None
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except RecursionError:
        raise _HTTPError(400, "request body is nested too deeply", "ValueError") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise _HTTPError(400, f"request body is not valid JSON: {exc}", "ValueError") from None


async def _call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in the thread pool, as a JSON answer or a JSON error."""
    try:
        return JSONResponse(await run_in_threadpool(fn, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error
        return _error(exc)


async def _with_body(request, fn, *args):
    """``fn(*args, body)`` for a request with a JSON body and no query parameters."""
    try:
        _query_params(request, ())
        body = await _body_of(request)
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    return await _call(fn, *args, body)


def _paged(request, fn):
    """``fn(offset, limit)`` from the query parameters ``offset`` and ``limit``."""
    params = _query_params(request, ("offset", "limit"))
    return fn(_int_param(params, "offset", 0), _int_param(params, "limit", DEFAULT_PAGE))


def _plain(request, fn, *args):
    """``fn(*args)`` for a request that takes no query parameters."""
    _query_params(request, ())
    return fn(*args)


async def _service(request: Request):
    """The app's :class:`~svtoolkit.memory._service.MemoryService` (a FastAPI dependency;
    a coroutine, since FastAPI runs a plain function dependency in its thread pool)."""
    return request.app.state.service


#: A handler's parameter that receives the app's service.
_Service = Annotated[MemoryService, Depends(_service)]


# ------------------------------------------------------------------ the handlers
# Each takes the request (its query parameters and body), the service (a dependency) and, on
# /records/{id}, the record id, and answers JSON (what it reads and answers: its route's row in
# docs/memory_server.md). The work runs in the thread pool; a failure is a JSON error.
async def health():
    """``{"status": "ok"}``; says nothing about the store."""
    return JSONResponse({"status": "ok"})


async def audit_page(request: Request):
    """The audit page (static HTML, no data)."""
    return HTMLResponse(request.app.state.page)


async def list_records(request: Request, service: _Service):
    """A page of held records (``?offset``, ``?limit``): :meth:`MemoryService.records`."""
    return await _call(_paged, request, service.records)


async def add_record(request: Request, service: _Service):
    """Store the body's record: :meth:`MemoryService.add`."""
    return await _with_body(request, service.add)


async def get_record(request: Request, service: _Service, record_id: str):
    """One held record: :meth:`MemoryService.record`."""
    return await _call(_plain, request, service.record, record_id)


async def edit_record(request: Request, service: _Service, record_id: str):
    """Edit a record as the body says: :meth:`MemoryService.edit`."""
    return await _with_body(request, service.edit, record_id)


def _forget(request, service, record_id):
    params = _query_params(request, ("audit", "verify"))
    return service.forget(record_id, audit=_bool_param(params, "audit", False),
                          verify=_bool_param(params, "verify", True, levels=True))


async def forget_record(request: Request, service: _Service, record_id: str):
    """Forget a record (``?audit``, ``?verify``): :meth:`MemoryService.forget`."""
    return await _call(_forget, request, service, record_id)


async def query(request: Request, service: _Service):
    """The records nearest to the body's key or text: :meth:`MemoryService.query`."""
    return await _with_body(request, service.query)


async def evict(request: Request, service: _Service):
    """Certified eviction of reserve records: :meth:`MemoryService.evict`."""
    return await _with_body(request, service.evict)


async def audit(request: Request, service: _Service):
    """A fresh audit of the held records: :meth:`MemoryService.audit`."""
    return await _call(_plain, request, service.audit)


async def latest_audit(request: Request, service: _Service):
    """The last audit's result, recomputing nothing: :meth:`MemoryService.latest_audit`."""
    return await _call(_plain, request, service.latest_audit)


async def receipts(request: Request, service: _Service):
    """A page of the receipt log (``?offset``, ``?limit``): :meth:`MemoryService.receipts`."""
    return await _call(_paged, request, service.receipts)


async def _http_error(request, exc):
    """Unknown paths and methods (404, 405) as JSON errors."""
    return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}",
                         "type": "HTTPError"}, exc.status_code)


class Endpoint(NamedTuple):
    """One route of the server.

    Attributes
    ----------
    method : str
        The HTTP method (only this one: no implicit ``HEAD``).
    path : str
        The route's path; ``{record_id:svtoolkit_record_id}`` is a record id, every character
        after ``/records/`` (the client percent-encodes it, the server gets it decoded).
    handler : callable
        The module-level coroutine function answering it: ``handler(request, service)``
        (``record_id`` too on a record path; ``/health`` takes nothing) -> a response.
    summary : str
        What the route does, in a few words.
    """

    method: str
    path: str
    handler: Callable
    summary: str


#: Every route of the server, in the order of the table in ``docs/memory_server.md``.
ROUTES = (
    Endpoint("POST", "/records", add_record, "store a record"),
    Endpoint("GET", "/records", list_records, "list held records, paged"),
    Endpoint("GET", _RECORD_PATH, get_record, "one held record"),
    Endpoint("PATCH", _RECORD_PATH, edit_record, "exact edit; its receipt"),
    Endpoint("DELETE", _RECORD_PATH, forget_record, "exact deletion; its receipt"),
    Endpoint("POST", "/query", query, "the nearest supporting records"),
    Endpoint("POST", "/evict", evict, "certified eviction of reserve records"),
    Endpoint("GET", "/audit", audit, "recompute the certificate (a fresh solve)"),
    Endpoint("GET", "/audit/latest", latest_audit, "the last audit, recomputing nothing"),
    Endpoint("GET", "/receipts", receipts, "the receipt log, paged"),
    Endpoint("GET", "/health", health, "health probe (no token)"),
    Endpoint("GET", "/", audit_page, "the audit page (no token)"),
)

#: The router of :data:`ROUTES` (what :func:`create_app` serves).
router = APIRouter()
for _route in ROUTES:
    router.add_api_route(_route.path, _route.handler, methods=[_route.method],
                         summary=_route.summary)
del _route


def create_app(store, *, token, signing_key=None, max_body_bytes=DEFAULT_MAX_BODY_BYTES,
               max_value_bytes=DEFAULT_MAX_VALUE_BYTES, encoder=None, encoder_threads=1):
    """The ASGI application serving one store.

    Loads and verifies the store (under its lock) and, for a text store, the encoder, once.

    Parameters
    ----------
    store : str or path-like
    token : str
        Bearer token every request except ``/health`` and ``/`` must carry (at least 16
        visible ASCII characters; :func:`svtoolkit.memory.client.load_token`).
    signing_key : bytes, optional
        The store's signing key (required for a signed store).
    max_body_bytes : int, default 1 MiB
        Largest request body (413 beyond).
    max_value_bytes : int, default 64 KiB
        Largest value, in bytes of canonical JSON (413 beyond).
    encoder : callable, optional
        ``str -> ndarray of shape (d,)`` replacing the sentence encoder (for tests).
    encoder_threads : int, default 1
        Torch threads of the sentence encoder (text stores).

    Returns
    -------
    ASGI application
        The FastAPI app of :data:`router` inside the token guard; its ``service`` attribute is
        the :class:`~svtoolkit.memory._service.MemoryService` (also the app's
        ``state.service``, which the handlers get).
    """
    if not isinstance(token, str) or not _TOKEN.fullmatch(token) or \
            len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"token must be at least {MIN_TOKEN_CHARS} visible ASCII characters")
    for name, value in (("max_body_bytes", max_body_bytes),
                        ("max_value_bytes", max_value_bytes)):
        check_int(value, name, min=1)
    if max_value_bytes > MAX_VALUE_BYTES:
        raise ValueError(f"max_value_bytes must be at most {MAX_VALUE_BYTES} (the memory's own "
                         f"bound on a value); got {max_value_bytes}")
    service = MemoryService(store, signing_key=signing_key, max_value_bytes=max_value_bytes,
                            encoder=encoder, encoder_threads=encoder_threads)
    html, policy = _audit_page()
    app = FastAPI(title="svtoolkit memory", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.state.service = service
    app.state.max_body_bytes = max_body_bytes
    app.state.page = html
    guard = _Guard(app, token, policy)
    guard.service = service
    return guard


def _bounded_protocol(*, request_timeout, max_waiting):
    """uvicorn's h11 protocol, with a bound on slow and idle clients.

    A connection must deliver a whole request (headers and body) within ``request_timeout``
    seconds of connecting or of the end of its previous response, otherwise it is closed.
    At most ``max_waiting`` connections of one client address may be waiting for their
    request at once: one more closes that client's oldest waiting connection (a client
    that sends its request at once is never the oldest for long). Connections whose request
    has arrived are not touched (a long answer, an audit, is not cut).
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = {}  # client address -> connections waiting for a request, oldest first

    class Bounded(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._deadline = None
            self._wait_for_request()

        def _peer(self):
            return self.client[0] if self.client else None

        def _wait_for_request(self):
            queue = waiting.setdefault(self._peer(), [])
            if self not in queue:
                queue.append(self)
            while len(queue) > max_waiting:
                queue[0]._drop()
            self._deadline = self.loop.call_later(request_timeout, self._drop)

        def _stop_waiting(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            queue = waiting.get(self._peer())
            if queue is not None and self in queue:
                queue.remove(self)
                if not queue:
                    del waiting[self._peer()]

        def _drop(self):
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data):
            super().data_received(data)
            if self._deadline is not None and self.conn.their_state not in (h11.IDLE,
                                                                           h11.SEND_BODY):
                self._stop_waiting()  # the whole request is in

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._wait_for_request()  # the next request on this connection

        def connection_lost(self, exc):
            self._stop_waiting()
            super().connection_lost(exc)

    return Bounded


def _is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _listen(host, port):
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(MAX_CONNECTIONS)
    sock.set_inheritable(True)
    return sock


def _allowed_hosts(host, port):
    """Host header values naming the bound address (and ``localhost`` for a loopback one)."""
    shown = f"[{host}]" if ":" in host else host
    names = {shown}
    if _is_loopback(host):
        names |= {"localhost", "127.0.0.1", "[::1]"}
    return frozenset(f"{name}:{port}".lower().encode("ascii") for name in names)


def serve(store, *, token, host="127.0.0.1", port=DEFAULT_PORT, signing_key=None,
          max_body_bytes=DEFAULT_MAX_BODY_BYTES, max_value_bytes=DEFAULT_MAX_VALUE_BYTES,
          encoder_threads=1, request_timeout=DEFAULT_REQUEST_TIMEOUT):
    """Serve ``store`` over HTTP until interrupted (SIGINT / SIGTERM).

    One process, one event loop; requests run in a thread pool (reads concurrently, one
    writer at a time). Prints one line, ``serving STORE (N records) on http://HOST:PORT``, to
    stdout once the socket listens (``port=0`` picks a free port and prints it).

    Parameters
    ----------
    store : str or path-like
    token : str
    host : str, default "127.0.0.1"
        Loopback unless told otherwise; a non-loopback address prints a warning (plain HTTP:
        the token and the data travel unencrypted).
    port : int, default 8765
    signing_key, max_body_bytes, max_value_bytes, encoder_threads
        As in :func:`create_app`.
    request_timeout : float, default 10
        Seconds a connection has to deliver a whole request (headers and body) after it
        connects or after its previous answer; slower or idle connections are closed. At
        most :data:`MAX_WAITING_PER_CLIENT` connections of one client address wait for their
        request at once (one more closes its oldest waiting connection).

    Requests whose Host header does not name the bound address (``localhost`` too, for a
    loopback address) are refused with 421 (DNS rebinding).
    """
    check_positive(request_timeout, "request_timeout")  # seconds
    app = create_app(store, token=token, signing_key=signing_key,
                     max_body_bytes=max_body_bytes, max_value_bytes=max_value_bytes,
                     encoder_threads=encoder_threads)
    try:
        warm_walk()  # Numba's one-time start-up here, not in the first change's response
        warm_search()  # nor the query kernel's in the first query's
        sock = _listen(host, port)
        bound = sock.getsockname()[1]
        if not _is_loopback(host):
            print(f"warning: listening on {host}, not a loopback address: plain HTTP carries "
                  "the token and the records unencrypted (put a TLS proxy in front)",
                  file=sys.stderr)
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound}"
        app.service.announce(url)  # other writers' refusals name it
        app.allowed_hosts = _allowed_hosts(host, bound)
        protocol = _bounded_protocol(request_timeout=float(request_timeout),
                                     max_waiting=MAX_WAITING_PER_CLIENT)
        config = uvicorn.Config(app, http=protocol, log_level="warning", access_log=False,
                                server_header=False, timeout_keep_alive=5,
                                limit_concurrency=MAX_CONNECTIONS)
        print(f"serving {store} ({app.service.n_records} records) on {url}", flush=True)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.service.close()
