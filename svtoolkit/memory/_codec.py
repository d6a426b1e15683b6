"""The value codec: canonical JSON text for values, UTF-8 checks for ids and text."""

from __future__ import annotations

import json

__all__ = ["encode_value", "decode_value", "check_utf8", "check_record_id",
           "check_new_record_id", "non_canonical_values", "MAX_RECORD_ID_BYTES",
           "MAX_VALUE_DEPTH", "MAX_VALUE_BYTES"]

#: Longest id a new record may have, in UTF-8 bytes. Percent-encoded in a URL path an id takes
#: at most three times as many characters, far inside what an HTTP request line may hold, so a
#: record added through any entry point can always be read and forgotten through the server.
MAX_RECORD_ID_BYTES = 1024
#: Deepest nesting of lists and objects in a value (or metadata) accepted at input. An answer
#: wraps a value in a few levels of its own (a page of records: three), and Python's JSON
#: encoder and decoder stop near 1000 levels, so every accepted value can be listed, queried
#: and reloaded.
MAX_VALUE_DEPTH = 64
#: Largest value accepted at input, in bytes of its canonical JSON (UTF-8). The server's own
#: bound (``--max-value-bytes``, 64 KiB by default) is at most this.
MAX_VALUE_BYTES = 1024 * 1024

_CANONICAL = json.JSONEncoder(ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                              allow_nan=False)


def encode_value(value, name="value"):
    """Canonical JSON text of a value, refusing anything that would not come back equal.

    Parameters
    ----------
    value : JSON value
    name : str, default "value"
        The argument's name, used in error messages.

    Returns
    -------
    str
        Canonical JSON (sorted keys, no spaces, non-ASCII kept), encodable as UTF-8.

    Raises
    ------
    TypeError
        Not JSON, or does not survive a JSON round trip unchanged.
    ValueError
        Nested more than :data:`MAX_VALUE_DEPTH` levels, larger than :data:`MAX_VALUE_BYTES`,
        or a string holds an unpaired UTF-16 surrogate (not encodable as UTF-8, so it could be
        neither hashed nor saved).
    """
    _check_depth(value, name)
    try:
        text = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
        same = json.loads(text) == value
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name} must be JSON-serialisable (str, int, float, bool, None, and lists or "
            f"str-keyed dicts of those; no NaN/inf): {exc}"
        ) from exc
    except RecursionError as exc:
        raise ValueError(f"{name} is nested too deeply to encode as JSON") from exc
    if not same:
        raise TypeError(
            f"{name} does not survive a JSON round trip unchanged (tuples become lists, "
            "non-str dict keys become strings); pass the JSON form"
        )
    check_utf8(text, name)
    size = len(text.encode("utf-8"))
    if size > MAX_VALUE_BYTES:
        raise ValueError(f"{name} is {size} bytes of JSON, more than the largest accepted "
                         f"({MAX_VALUE_BYTES} bytes)")
    return text


def _check_depth(value, name):
    """Refuse a value with lists / dicts nested more than :data:`MAX_VALUE_DEPTH` deep.

    Iterative (a deeper value must be refused without exhausting Python's stack); an object
    met twice on one path (a cycle) is refused by the JSON encoder afterwards, and cannot
    be deeper than the bound here without being refused.
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if depth == MAX_VALUE_DEPTH:
                raise ValueError(f"{name} is nested too deeply: more than {MAX_VALUE_DEPTH} "
                                 "levels of lists and objects")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def decode_value(text):
    """A fresh copy of the value whose canonical JSON text is ``text``.

    A string's canonical text escapes only ``"``, ``\\`` and the control characters below
    U+0020 (non-ASCII is kept), each with a backslash: a string text without one holds its
    characters verbatim between the quotes, and is read without the JSON parser.
    """
    if text[0] == '"' and "\\" not in text:
        return text[1:-1]
    return json.loads(text)


def non_canonical_values(texts):
    """Index of the first text that is not the canonical JSON of a value, or None.

    The same test as ``encode_value(json.loads(text)) == text`` for each text, in one parse
    of all of them (a text read from a UTF-8 file holds no unpaired surrogate, and the value
    of a canonical text survives the round trip by construction).

    Parameters
    ----------
    texts : list of str

    Returns
    -------
    int or None
    """
    if not texts:
        return None
    try:
        # one parse for all; each text is then compared with its own element's encoding, so
        # a text that is not valid JSON on its own can never pass
        values = json.loads("[" + ",".join(texts) + "]")
    except (ValueError, RecursionError):
        values = None
    if values is None or len(values) != len(texts):
        for i, text in enumerate(texts):
            try:
                if _CANONICAL.encode(json.loads(text)) != text:
                    return i
            except (ValueError, TypeError, RecursionError):
                return i
        return None
    encode = _CANONICAL.encode
    for i, (value, text) in enumerate(zip(values, texts)):
        try:
            if encode(value) != text:
                return i
        except (ValueError, RecursionError):
            return i
    return None


def check_utf8(text, name):
    """Refuse a str that cannot be encoded as UTF-8 (an unpaired surrogate such as '\\ud800')."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} contains an unpaired UTF-16 surrogate ({text[exc.start]!r} at position "
            f"{exc.start}), which is not valid text and cannot be stored as UTF-8"
        ) from None


def check_record_id(record_id):
    """Return ``record_id`` if it is a non-empty str encodable as UTF-8; raise otherwise."""
    if not isinstance(record_id, str):
        raise TypeError(f"record_id must be a str; got {type(record_id).__name__}")
    if not record_id:
        raise ValueError("record_id must be a non-empty string")
    check_utf8(record_id, "record_id")
    return record_id


def check_new_record_id(record_id):
    """:func:`check_record_id`, and at most :data:`MAX_RECORD_ID_BYTES` bytes of UTF-8.

    The length bound is for ids of new records only: a file written before it may hold
    longer ids, which still load and can be forgotten.
    """
    check_record_id(record_id)
    if len(record_id) > MAX_RECORD_ID_BYTES or \
            len(record_id.encode("utf-8")) > MAX_RECORD_ID_BYTES:
        raise ValueError(f"record_id is {len(record_id.encode('utf-8'))} bytes of UTF-8, "
                         f"more than the longest accepted ({MAX_RECORD_ID_BYTES})")
    return record_id
