"""The single-file format of versions 1 and 2 (read; the next save converts it to the store
database of :mod:`._database`), and the checks every load applies, whichever the format
(``docs/memory.md``, "File format").

A version-2 file is a fixed binary header (magic, version, flags, header length), a UTF-8 JSON
header, the solver's arrays (raw little-endian, 8-byte aligned), an optional HMAC-SHA256 of
all of that (flag bit 0), and a sha256 of every preceding byte; version-1 files have no flags
and no MAC. This module parses those bytes, refusing anything malformed; it knows nothing
about queries or the solver's mathematics.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass

import numpy as np

from ._errors import MemoryAuthenticationError, MemoryFileError
from ._receipts import CHAIN_HEAD_FIELDS
from ._signing import MAC_BYTES, file_mac, macs_equal

__all__ = ["READABLE_VERSIONS", "MAGIC", "FORMAT_NAME", "KKT_TOL", "FileContents", "parse_file",
           "parse_header", "parse_counter", "parse_cursor", "parse_chain", "parse_tombstones",
           "check_solver_numbers", "check_maintained_numbers", "is_signed_file"]

#: Versions of the single-file format :meth:`ForgettableMemory.load` reads.
READABLE_VERSIONS = (1, 2)
#: First 8 bytes of every memory file.
MAGIC = b"SVTKMEM\x00"
#: :meth:`ForgettableMemory.load` refuses a state whose KKT residual (recomputed from the stored
#: keys) exceeds this. Exact states measure ~1e-13; the solver repairs drift above 1e-10.
KKT_TOL = 1e-8
#: The ``format`` field of every header, single file and database alike.
FORMAT_NAME = "svtoolkit.ForgettableMemory"
_HEADER_V1 = struct.Struct("<8sIQ")  # magic, format version, header length
_HEADER = struct.Struct("<8sIIQ")  # magic, format version, flags, header length
_VERSION = struct.Struct("<I")  # at offset 8 in every version
_SIGNED = 0x1  # flag: an HMAC-SHA256 precedes the checksum
_CHECKSUM_BYTES = 32
_ALIGN = 8
#: dtypes a memory file may declare (anything else is refused before any array is built).
_FILE_DTYPES = {"<f8": np.float64, "<i8": np.int64, "|i1": np.int8}
#: Latest tombstone time a file may hold: 9999-12-31T23:59:59Z (``time.gmtime`` formats it).
_MAX_TIME = 253402300799.0
_REASONS = ("forgotten", "evicted")


@dataclass(frozen=True)
class FileContents:
    """What a memory file holds, structurally checked (not yet checked against the solver).

    Attributes
    ----------
    version : int
        Format version of the store (1 or 2: a single file; 3: a store database, whose
        contents :mod:`._persistence` puts in this form); its digest follows that version's
        rule.
    signed : bool
        Whether the file carries an HMAC (checked only when a key was given).
    config : dict
        C, sigma, nu, n0, budget, min_similarity.
    metadata_text : str
        The metadata as JSON text.
    records : list
        ``[record_id, solver_id, canonical value JSON]`` in insertion order.
    tombstones : list
        ``[record_id, reason, time]`` as saved (checked by :func:`parse_tombstones`).
    next_auto, revision : int
    digest : str
    solver_state : dict
        :meth:`IncrementalSVDD.state_dict` as saved (arrays and scalars).
    audit_cursor : tuple of int
        Where the memory's rolling audit resumes (next solver id, next bordered-system
        column, operations before its next slice); ``(0, 0)`` for files written before it
        existed.
    receipt_chain : dict or None
        The head of the store's receipt log (``store``, ``legacy``, ``count``, ``head``,
        ``last``: see ``docs/memory_server.md``); None before a server logged a receipt
        with it.
    """

    version: int
    signed: bool
    config: dict
    metadata_text: str
    records: list
    tombstones: list
    next_auto: int
    revision: int
    digest: str
    solver_state: dict
    audit_cursor: tuple = (0, 0)
    receipt_chain: dict | None = None


def is_signed_file(path):
    """True when ``path`` is a memory file whose flags say it carries an HMAC.

    Reads the fixed binary header only (no checksum, no MAC check); False for a file that does
    not exist, is shorter than the header, is not a memory file or is of version 1.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(_HEADER.size)
    except FileNotFoundError:
        return False
    if len(head) < _HEADER.size:
        return False
    magic, version, flags, _ = _HEADER.unpack(head)
    return magic == MAGIC and version >= 2 and bool(flags & _SIGNED)


# ---------------------------------------------------------------------------- reading
def parse_file(data, key=None):
    """Check the framing, checksum and (with a key) MAC of a memory file; parse the rest.

    Parameters
    ----------
    data : bytes
    key : bytes, optional
        Signing key. With a key the file must carry a valid HMAC, checked before the header
        is parsed.

    Returns
    -------
    FileContents

    Raises
    ------
    MemoryAuthenticationError
        With a key: the file is not signed, or its MAC does not verify.
    MemoryFileError
        Too short, bad magic bytes, unsupported version, checksum mismatch, a header that is
        not a JSON object of the file's version, or arrays that do not fit their shapes.
    KeyError, TypeError, ValueError, IndexError, AttributeError
        A header missing fields or holding fields of the wrong type (reported by ``load`` as
        malformed contents).
    """
    if len(data) < _HEADER_V1.size + _CHECKSUM_BYTES:
        raise MemoryFileError(f"too short to be a memory file ({len(data)} bytes)")
    if bytes(data[:8]) != MAGIC:
        raise MemoryFileError("not an svtoolkit memory file (bad magic bytes)")
    (version,) = _VERSION.unpack_from(data, 8)
    if version not in READABLE_VERSIONS:
        raise MemoryFileError(f"unsupported format version {version}; this svtoolkit reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    body = memoryview(data)[:-_CHECKSUM_BYTES]
    if hashlib.sha256(body).digest() != bytes(data[-_CHECKSUM_BYTES:]):
        raise MemoryFileError("checksum mismatch: the file is damaged or was modified after "
                              "it was written")
    if version == 1:
        _, _, header_len = _HEADER_V1.unpack_from(data, 0)
        start, flags = _HEADER_V1.size, 0
    else:
        if len(body) < _HEADER.size:
            raise MemoryFileError("too short for a version-2 header")
        _, _, flags, header_len = _HEADER.unpack_from(data, 0)
        start = _HEADER.size
        if flags & ~_SIGNED:
            raise MemoryFileError(f"unknown flags {flags:#x} in the file header")
    signed = bool(flags & _SIGNED)
    if signed:
        if len(body) < start + MAC_BYTES:
            raise MemoryFileError("too short to hold its MAC")
        mac, body = bytes(body[-MAC_BYTES:]), body[:-MAC_BYTES]
    if key is not None:
        if not signed:
            raise MemoryAuthenticationError(
                "the file is not signed (no MAC), but a signing key was given: it was saved "
                "without a key, or its MAC was stripped")
        if not macs_equal(file_mac(key, body), mac):
            raise MemoryAuthenticationError(
                "MAC mismatch: the file was modified after it was signed, or signed with "
                "another key")
    if start + header_len > len(body):
        raise MemoryFileError("header length runs past the end of the file")
    header = parse_header(bytes(body[start:start + header_len]), version)
    state = dict(header["solver_scalars"])
    state.update(_parse_arrays(header["arrays"], body, start + header_len))
    return FileContents(
        version=version,
        signed=signed,
        config=header["config"],
        metadata_text=header["metadata_json"],
        records=header["records"],
        tombstones=header["tombstones"],
        next_auto=parse_counter(header, "next_auto"),
        revision=parse_counter(header, "revision"),
        digest=header["digest"],
        solver_state=state,
        audit_cursor=parse_cursor(header),
        receipt_chain=parse_chain(header),
    )


def parse_cursor(header):
    """The rolling audit's cursor: two or three integers >= 0 (absent in older files: start
    over; files that predate the countdown hold two)."""
    cursor = header.get("audit_cursor", [0, 0, 0])
    if not isinstance(cursor, list) or len(cursor) not in (2, 3) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cursor):
        raise MemoryFileError("audit_cursor must be [next id, next column] or [next id, next "
                              f"column, operations to wait], integers >= 0; got {cursor!r}")
    return tuple(cursor)


def _is_hex(value, digits):
    return isinstance(value, str) and len(value) == digits and all(
        c in "0123456789abcdef" for c in value)


def parse_chain(header):
    """The head of the store's receipt log, or None (absent: no receipt logged with a chain,
    or a file written before the chain existed)."""
    chain = header.get("receipt_chain")
    if chain is None:
        return None
    counts_ok = isinstance(chain, dict) and all(
        not isinstance(chain.get(n), bool) and isinstance(chain.get(n), int)
        for n in ("legacy", "count"))
    if not counts_ok or sorted(chain) != sorted(CHAIN_HEAD_FIELDS) or chain["legacy"] < 0 \
            or chain["count"] < 1 or not _is_hex(chain["store"], 32) or \
            not _is_hex(chain["head"], 64) or not isinstance(chain["last"], str) or \
            not chain["last"].isascii():
        raise MemoryFileError(
            "receipt_chain must be {store: 32 hex digits, legacy: integer >= 0, count: "
            "integer >= 1, head: 64 hex digits, last: ASCII text}; got "
            f"{str(chain)[:200]}")
    return dict(chain)


def parse_header(raw, version, kind="memory", decode_errors="strict"):
    """The header dict of a store, refusing anything but a JSON object of ``version``.

    Shared by the single-file readers and the database reader: ``kind`` names which in the
    message ("memory" or "store"), ``decode_errors`` is how its writer encoded the text (the
    database's writer uses ``"surrogatepass"``, so a lone surrogate it accepted reads back; the
    single files were strict UTF-8).
    """
    try:
        header = json.loads(raw.decode("utf-8", decode_errors))
    except RecursionError:
        raise MemoryFileError("header is not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise MemoryFileError(f"header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise MemoryFileError(f"header is a JSON {type(header).__name__}, not an object")
    if header.get("format") != FORMAT_NAME or header.get("format_version") != version:
        raise MemoryFileError(f"header does not describe a version-{version} {kind}")
    return header


def _parse_arrays(specs, body, base):
    """dict name -> ndarray (a copy) of the arrays the header declares."""
    out = {}
    for spec in specs:
        dtype = _FILE_DTYPES.get(spec["dtype"])
        if dtype is None:
            raise MemoryFileError(f"array {spec['name']!r} has refused dtype {spec['dtype']!r}")
        shape = tuple(int(s) for s in spec["shape"])
        lo, nbytes = base + int(spec["offset"]), int(spec["nbytes"])
        if lo < base or lo + nbytes > len(body) or \
                nbytes != math.prod(shape) * np.dtype(dtype).itemsize:
            raise MemoryFileError(f"array {spec['name']!r} does not fit its declared shape "
                                  "and offset")
        out[spec["name"]] = np.frombuffer(body[lo:lo + nbytes], dtype=dtype).reshape(
            shape).copy()
    return out


def parse_counter(header, name):
    """A header counter (``next_auto``, ``revision``): an integer >= 0."""
    value = header[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MemoryFileError(f"{name} must be an integer >= 0; got {value!r}")
    return value


def parse_tombstones(entries, held, check_record_id):
    """dict record_id -> (reason, time) from the header's tombstone list, each checked.

    Parameters
    ----------
    entries : list
        ``[record_id, reason, time]`` triples as saved.
    held : container of str
        The held record ids (a tombstoned id must not be held).
    check_record_id : callable
        Validates one record id (raises TypeError / ValueError).

    Raises
    ------
    MemoryFileError
        Not a list of triples, an unknown reason, an id held or listed twice, or a time that
        is not a finite number of seconds in ``[0, _MAX_TIME]``.
    TypeError, ValueError
        An invalid record id (reported by ``load`` as malformed contents).
    """
    if not isinstance(entries, list):
        raise MemoryFileError("tombstones must be a list")
    out = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 3:
            raise MemoryFileError(f"tombstone {i} is not a [record_id, reason, time] triple")
        record_id, reason, when = entry
        check_record_id(record_id)
        if reason not in _REASONS:
            raise MemoryFileError(f"unknown tombstone reason {reason!r}")
        if record_id in held:
            raise MemoryFileError(f"record {record_id!r} is both held and tombstoned")
        if record_id in out:
            raise MemoryFileError(f"record {record_id!r} is tombstoned twice")
        out[record_id] = (reason, _tombstone_time(record_id, when))
    return out


def _tombstone_time(record_id, when):
    if isinstance(when, bool) or not isinstance(when, (int, float)) or \
            not 0.0 <= when <= _MAX_TIME:
        raise MemoryFileError(
            f"tombstone of {record_id!r} has time {when!r}: expected a finite number of "
            f"seconds since the epoch in [0, {_MAX_TIME:.0f}]"
        )
    return float(when)


# ---------------------------------------------------------------------------- verification
#: What a loaded solver's maintained quantities may differ from a fresh evaluation by (see
#: :meth:`IncrementalSVDD.consistency`): gradients as much as the KKT residual; the bordered
#: inverse's ||R M - I|| by what an ill-conditioned margin set legitimately shows (~1e-8) with
#: room to spare; kernel rows by a few ulps (another machine's exp).
_LOAD_LIMITS = {"kkt_residual": KKT_TOL, "grad_drift": KKT_TOL, "margin_rows_drift": 1e-12,
                "inverse_residual": 1e-6}  # rows before the inverse: M is built from them
_LOAD_MEANING = {
    "kkt_residual": "the stored coefficients are not the optimum of the stored keys",
    "grad_drift": "the stored gradients disagree with the keys and coefficients",
    "inverse_residual": "the stored bordered inverse is not the inverse of the margin system",
    "margin_rows_drift": "the stored margin kernel rows disagree with the keys",
}


def check_maintained_numbers(kkt_residual):
    """Refuse a loaded state whose maintained certificate fails.

    Parameters
    ----------
    kkt_residual : float
        KKT residual evaluated on the stored (maintained) gradients.
    """
    if not kkt_residual <= KKT_TOL:
        raise MemoryFileError(f"maintained kkt residual {kkt_residual:.3g} exceeds "
                              f"{KKT_TOL:g}: {_LOAD_MEANING['kkt_residual']} by its own "
                              "maintained gradients (tampered or corrupted)")


#: A stored inverse above its load limit is still accepted when it is within this factor of a
#: freshly factorised inverse's own residual: on a numerically singular margin set (an
#: active-set build; 8.7e-3 measured on 500 collinear keys) no inverse does better.
INVERSE_FLOOR_FACTOR = 4.0


def check_solver_numbers(found, fresh_inverse_residual=None):
    """Refuse a loaded state whose numbers a fresh evaluation contradicts (names which).

    Parameters
    ----------
    found : Consistency
        :meth:`IncrementalSVDD.consistency` of the loaded solver.
    fresh_inverse_residual : callable, optional
        Returns the residual of a freshly factorised inverse
        (:meth:`IncrementalSVDD.fresh_inverse_residual`); called only when the stored
        inverse is above its limit, which it then raises to ``INVERSE_FLOOR_FACTOR`` times
        that floor.
    """
    for name, limit in _LOAD_LIMITS.items():
        value = getattr(found, name)
        if name == "inverse_residual" and not value <= limit \
                and fresh_inverse_residual is not None:
            limit = max(limit, INVERSE_FLOOR_FACTOR * fresh_inverse_residual())
        if not value <= limit:
            raise MemoryFileError(f"{name.replace('_', ' ')} {value:.3g} exceeds "
                                  f"{limit:g}: {_LOAD_MEANING[name]} (tampered or corrupted)")
