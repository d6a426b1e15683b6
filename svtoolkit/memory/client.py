"""A client of the memory server (``svtoolkit memory serve``), on the standard library only.

:class:`Client` has the methods of :class:`~svtoolkit.memory.ForgettableMemory` that make sense
remotely and returns the same types (:class:`~svtoolkit.memory.Hit`,
:class:`~svtoolkit.memory.AddResult`, :class:`~svtoolkit.memory.DeletionReceipt`,
:class:`~svtoolkit.memory.AuditReport`). The server's refusals come back as the exceptions the
Python API raises, with the same messages: ``ValueError`` (400), ``TypeError`` (422),
``KeyError`` (404); anything else (no or a wrong token, a store changed by another process, a
failed save, an unreachable server) is a :class:`ServerError`, an :class:`OSError`.

Connections are kept alive, one per thread, so a ``Client`` may be shared between threads.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
import urllib.parse
from dataclasses import fields

import numpy as np

from ._receipts import AddResult, AuditReport, DeletionReceipt, Hit

__all__ = ["Client", "ServerError", "load_token", "TOKEN_ENV", "MIN_TOKEN_CHARS"]

#: Environment variable holding the bearer token (when no token file is given).
TOKEN_ENV = "SVTOOLKIT_MEMORY_TOKEN"
#: Shortest token accepted.
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"[\x21-\x7e]+")  # visible ASCII: safe in an HTTP header
_UNCHANGED = object()
# a kept-alive connection idle longer than this is reopened before use (the server closes
# idle connections after 5 s; reopening first avoids sending a change into a closing socket)
_IDLE_S = 2.0


class ServerError(OSError):
    """A request the server refused for a reason other than its input, or could not answer.

    Attributes
    ----------
    status : int or None
        The HTTP status (401 no or wrong token, 409 the store was replaced by another process,
        413 too large, 503 a failed save or an unusable server, 500 a solver failure); None when
        no answer came (connection refused or lost: the outcome of a change is then unknown).
    """

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


def load_token(path=None, *, env=TOKEN_ENV):
    """The bearer token from a file, or from the environment variable ``env``.

    The token is the text with surrounding whitespace removed; it must be at least
    :data:`MIN_TOKEN_CHARS` visible ASCII characters (e.g. ``openssl rand -hex 32``).

    Parameters
    ----------
    path : str or path-like, optional
        A file holding the token (read first when given).
    env : str, default "SVTOOLKIT_MEMORY_TOKEN"

    Returns
    -------
    str or None
        None when there is no file and the variable is unset or empty.

    Raises
    ------
    ValueError
        A token that is too short or holds characters other than visible ASCII.
    OSError
        The file cannot be read.
    """
    if path is not None:
        with open(path, "rb") as fh:
            raw, source = fh.read(), f"the token file {os.fspath(path)}"
    elif os.environ.get(env):
        raw, source = os.environ[env].encode("utf-8", "surrogateescape"), env
    else:
        return None
    try:
        token = raw.strip().decode("ascii")
    except UnicodeDecodeError:
        token = None
    if token is None or not _TOKEN.fullmatch(token):
        raise ValueError(f"the token from {source} must be visible ASCII characters (no spaces "
                         "or control characters)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token from {source} must be at least {MIN_TOKEN_CHARS} "
                         f"characters (whitespace stripped); got {len(token)}")
    return token


def _jsonable_key(key):
    """A key as a JSON list; anything numpy cannot read as floats is sent as given (the
    server's memory refuses it with its own message)."""
    if key is None or isinstance(key, (str, bytes)):
        return key
    try:
        return np.asarray(key, dtype=np.float64).tolist()
    except (TypeError, ValueError):
        return key


def _receipt(entry):
    return DeletionReceipt(**{f.name: entry[f.name] for f in fields(DeletionReceipt)
                              if f.name in entry})


def _flag_text(value):
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


_ERRORS = {400: ValueError, 422: TypeError, 404: KeyError}


class Client:
    """A remote :class:`~svtoolkit.memory.ForgettableMemory` served by ``svtoolkit memory serve``.

    Parameters
    ----------
    url : str
        ``http://HOST:PORT`` (``https://`` for a server behind a TLS proxy).
    token : str
        The server's bearer token (see :func:`load_token`).
    timeout : float, default 60
        Seconds to wait for an answer (an audit of a large store takes a fresh solve).

    Examples
    --------
    >>> client = Client("http://127.0.0.1:8765", load_token("memory.token"))  # doctest: +SKIP
    >>> client.add([0.0, 1.0], {"text": "Bob lives in Lisbon."}, record_id="bob")  # doctest: +SKIP
    'bob'
    >>> client.forget("bob").digest_after  # doctest: +SKIP
    """

    def __init__(self, url, token, *, timeout=60.0):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://HOST:PORT or https://HOST:PORT; got {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"url must name the server only (no path or query); got {url!r}")
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise TypeError("token must be a str of visible ASCII characters")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._timeout = float(timeout)
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._local = threading.local()

    def __repr__(self):
        return f"Client({self.url!r})"

    # ------------------------------------------------------------------ transport
    def _connection(self):
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and time.monotonic() - local.used > _IDLE_S:
            conn.close()
            conn = None
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self._timeout)
            local.conn = conn
        return conn

    def _drop_connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def close(self):
        """Close this thread's connection (others close when their threads end)."""
        self._drop_connection()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def request(self, method, path, body=None, params=None, *, retry=False):
        """One request; the answer's JSON (a dict), or the mapped exception.

        Parameters
        ----------
        method : str
        path : str
            An endpoint of ``docs/memory_server.md``, e.g. ``"/records"``.
        body : JSON value, optional
        params : dict, optional
            Query parameters.
        retry : bool, default False
            Resend once on a lost connection (only for requests that change nothing).
        """
        if params:
            path += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body, allow_nan=True).encode("utf-8")
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            except (ConnectionError, http.client.HTTPException, TimeoutError) as exc:
                self._drop_connection()
                if retry and attempt == 0:
                    continue
                raise ServerError(f"{method} {self.url}{path}: no answer ({exc}); a change may "
                                  "or may not have been applied") from exc
            self._local.used = time.monotonic()
            if response.getheader("Connection", "").lower() == "close":
                self._drop_connection()
            return self._answer(response.status, payload, method, path)
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer(self, status, payload, method, path):
        try:
            out = json.loads(payload) if payload else None
        except ValueError:
            out = None
        if 200 <= status < 300:
            return out
        message = out.get("error") if isinstance(out, dict) else None
        message = message or f"{method} {path}: HTTP {status}"
        exc = _ERRORS.get(status)
        if exc is not None:
            raise exc(message)
        raise ServerError(message, status)

    @staticmethod
    def _id_path(record_id):
        if not isinstance(record_id, str):
            raise KeyError(f"record ids are str; got {record_id!r}")
        return "/records/" + urllib.parse.quote(record_id, safe="")

    # ------------------------------------------------------------------ writes
    def add_record(self, key=None, value=None, *, record_id=None, text=None):
        """Store a record (``POST /records``); see :meth:`ForgettableMemory.add_record`.

        Parameters
        ----------
        key : array_like of shape (d,), optional
            The key; or give ``text`` for a text store (embedded by the server's encoder).
        value : JSON value
        record_id : str, optional
        text : str, optional

        Returns
        -------
        AddResult
        """
        body = {"value": value}
        if text is not None:
            body["text"] = text
        if key is not None:
            body["key"] = _jsonable_key(key)
        if record_id is not None:
            body["id"] = record_id
        out = self.request("POST", "/records", body)
        return AddResult(out["record_id"], tuple(out["evicted"]))

    def add(self, key, value, *, record_id=None):
        """Store a record by its key vector; the record id (see :meth:`ForgettableMemory.add`)."""
        return self.add_record(key, value, record_id=record_id).record_id

    def add_text(self, text, value, *, record_id=None):
        """Store a record keyed by a sentence (text stores); the record id."""
        return self.add_record(None, value, record_id=record_id, text=text).record_id

    def forget(self, record_id, *, audit=False, verify=True):
        """Exact deletion (``DELETE /records/{id}``); the :class:`DeletionReceipt`."""
        out = self.request("DELETE", self._id_path(record_id), params={
            "audit": _flag_text(bool(audit)), "verify": _flag_text(verify)})
        return _receipt(out)

    def edit(self, record_id, *, value=_UNCHANGED, key=None, text=None, audit=False,
             verify=True):
        """Exact edit (``PATCH /records/{id}``); the :class:`DeletionReceipt` (``"edit"``).

        Omit ``value`` to keep it (``None`` is a JSON value); ``text`` re-embeds the key.
        """
        body = {"audit": bool(audit), "verify": verify}
        if value is not _UNCHANGED:
            body["value"] = value
        if key is not None:
            body["key"] = _jsonable_key(key)
        if text is not None:
            body["text"] = text
        return _receipt(self.request("PATCH", self._id_path(record_id), body))

    def evict_reserve(self, count=None, *, budget=None):
        """Certified eviction (``POST /evict``): reserve records, oldest first.

        Parameters
        ----------
        count : int, optional
            Most records to evict (default: every reserve record).
        budget : int, optional
            Instead of ``count``: evict until at most ``budget`` records are held (as far as
            reserve records allow).

        Returns
        -------
        tuple of str
        """
        body = {} if budget is None else {"budget": budget}
        if count is not None:
            body["count"] = count
        return tuple(self.request("POST", "/evict", body)["evicted"])

    # ------------------------------------------------------------------ reads
    def query(self, q=None, k=1, *, min_similarity=None, text=None):
        """The held records nearest to ``q`` (or to ``text``) that support it: list of Hit.

        An empty list is the "no record" answer (see :meth:`ForgettableMemory.query`).
        """
        body = {"k": k}
        if q is not None:
            body["key"] = _jsonable_key(q)
        if text is not None:
            body["text"] = text
        if min_similarity is not None:
            body["min_similarity"] = min_similarity
        out = self.request("POST", "/query", body, retry=True)
        return [Hit(h["record_id"], h["value"], h["weight"], h["score"]) for h in out["hits"]]

    def get(self, record_id):
        """The value of a held record (``GET /records/{id}``); KeyError otherwise."""
        return self.record(record_id)["value"]

    def record(self, record_id):
        """dict with ``record_id``, ``value``, ``partition`` and ``key`` of a held record."""
        return self.request("GET", self._id_path(record_id), retry=True)

    def records(self, offset=0, limit=None):
        """Held records in insertion order: list of dict (``record_id``, ``value``, ``partition``).

        Parameters
        ----------
        offset : int, default 0
        limit : int, optional
            Most records to return (default: all, fetched in pages of 1000).
        """
        out, page = [], 1000
        while limit is None or len(out) < limit:
            size = page if limit is None else min(page, limit - len(out))
            got = self.request("GET", "/records", params={"offset": offset + len(out),
                                                           "limit": size}, retry=True)
            out.extend(got["records"])
            if len(got["records"]) < size:
                break
        return out

    def audit(self):
        """Recompute the certificate (``GET /audit``; a fresh solve): :class:`AuditReport`."""
        out = self.request("GET", "/audit", retry=True)
        return AuditReport(**{f.name: out[f.name] for f in fields(AuditReport)})

    def audit_info(self):
        """The last ``GET /audit`` result as a dict (with revision, tombstones), or None."""
        return self.request("GET", "/audit/latest", retry=True)["audit"]

    def receipts(self, offset=0, limit=None):
        """The server's receipt log, oldest first: list of :class:`DeletionReceipt`."""
        out, page = [], 1000
        while limit is None or len(out) < limit:
            size = page if limit is None else min(page, limit - len(out))
            got = self.request("GET", "/receipts", params={"offset": offset + len(out),
                                                            "limit": size}, retry=True)
            out.extend(_receipt(e) for e in got["receipts"])
            if len(got["receipts"]) < size:
                break
        return out

    def health(self):
        """``GET /health`` (no token needed): ``{"status": "ok"}``."""
        return self.request("GET", "/health", retry=True)

    def __len__(self):
        return self.request("GET", "/records", params={"offset": 0, "limit": 1},
                             retry=True)["total"]

    def state_digest(self):
        """The served memory's state digest (sha256, hex)."""
        return self.request("GET", "/records", params={"offset": 0, "limit": 1},
                             retry=True)["digest"]
