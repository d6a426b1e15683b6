"""HMAC-SHA256 authentication of memory files and receipts (stdlib ``hmac`` / ``hashlib``).

The checksum and the state digest are unkeyed: they detect damage, not forgery. A MAC under a
secret key does detect forgery, by anyone who does not hold the key. Every comparison of a MAC
is constant-time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import json

__all__ = ["MAC_BYTES", "MIN_KEY_BYTES", "check_key", "file_mac", "macs_equal", "receipt_mac"]

MAC_BYTES = 32
#: Shortest signing key accepted (128 bits).
MIN_KEY_BYTES = 16
_RECEIPT_TAG = b"svtoolkit.DeletionReceipt/v1\x00"


def check_key(key, name="key"):
    """A signing key as bytes: ``bytes``-like, at least :data:`MIN_KEY_BYTES` long.

    Raises
    ------
    TypeError
        Not bytes-like (a str must be encoded first: its encoding would be a guess).
    ValueError
        Shorter than :data:`MIN_KEY_BYTES` bytes.
    """
    if isinstance(key, str) or not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes (the secret signing key); got "
                        f"{type(key).__name__}" + (" - encode text keys, e.g. "
                                                   "key.encode('utf-8')"
                                                   if isinstance(key, str) else ""))
    key = bytes(key)
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{name} must be at least {MIN_KEY_BYTES} bytes; got {len(key)}")
    return key


def file_mac(key, data):
    """HMAC-SHA256 of ``data`` under ``key``: 32 bytes.

    ``data`` is bytes-like, or a list of bytes-like chunks MACed as their concatenation
    (without building it: a 10^5-record file is tens of MB)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for chunk in (data if isinstance(data, list) else [data]):
        mac.update(chunk)
    return mac.digest()


def macs_equal(a, b):
    """Constant-time comparison of two MACs (bytes or str)."""
    return hmac.compare_digest(a, b)


def receipt_mac(key, fields):
    """HMAC-SHA256 (hex) of a receipt's fields.

    Parameters
    ----------
    key : bytes
    fields : dict
        Every field of the receipt except ``mac``; encoded as canonical JSON (sorted keys, no
        spaces; floats as their shortest round-trip decimal), so a receipt read back from its
        JSON form verifies.

    Returns
    -------
    str
        64 hex digits.
    """
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, _RECEIPT_TAG + text.encode("ascii"), hashlib.sha256).hexdigest()
