"""Check records: the one shape every check of the suite (and every extension) reports in.

A record is a plain dict ``{"name", "passed", "value", "tolerance", "detail"}``; the suite adds
``"op"`` (how value is compared with tolerance) and, for a skipped check, ``"skipped": True``
with ``"passed": None``. Plain dicts travel through joblib, Dask and JSON unchanged.
"""

from __future__ import annotations

import math

__all__ = ["make_check", "skipped_check", "RECORD_KEYS", "is_record", "failed"]

#: Keys every record must have (extensions included).
RECORD_KEYS = ("name", "passed", "value", "tolerance", "detail")

_OPS = {
    "<=": lambda value, tol: value <= tol,
    ">=": lambda value, tol: value >= tol,
    "==": lambda value, tol: value == tol,
    "<": lambda value, tol: value < tol,
    ">": lambda value, tol: value > tol,
}


def make_check(name, value, tolerance, *, op="<=", detail=""):
    """A pass/fail record: ``passed`` is ``value op tolerance``.

    Parameters
    ----------
    name : str
        Dotted name, e.g. ``"exact.stream"``.
    value : float
        The measured value. NaN (or None) never passes.
    tolerance : float
        The bound it is compared with.
    op : {"<=", ">=", "==", "<", ">"}
        The comparison.
    detail : str
        One line of context (what was measured, how many cases, the published figure).

    Returns
    -------
    dict
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}; got {op!r}")
    measured = None if value is None else float(value)
    ok = measured is not None and not math.isnan(measured) and _OPS[op](measured, tolerance)
    return {"name": name, "passed": bool(ok), "value": measured, "tolerance": tolerance,
            "op": op, "detail": detail}


def skipped_check(name, reason):
    """A record for a check that could not run (``passed`` is None; never a failure)."""
    return {"name": name, "passed": None, "value": None, "tolerance": None, "op": None,
            "detail": reason, "skipped": True}


def is_record(obj):
    """True when ``obj`` is a dict with every key of :data:`RECORD_KEYS`."""
    return isinstance(obj, dict) and all(key in obj for key in RECORD_KEYS)


def failed(records):
    """The records whose ``passed`` is False (skipped records are not failures)."""
    return [r for r in records if r.get("passed") is False]
