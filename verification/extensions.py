"""Check 7: the extension point. Other parts of svtoolkit register checks as modules
``verification/check_*.py`` exposing ``run(quick: bool = True) -> list[dict]``.

Each returned record must have the keys of :data:`verification.records.RECORD_KEYS`
(``name``, ``passed``, ``value``, ``tolerance``, ``detail``). A module whose optional
dependency is missing (``ImportError`` on import or inside ``run``) is reported as *skipped*
with the reason; any other exception, or a malformed record, is reported as a *failed* check.
Nothing an extension does can crash the suite.
"""

from __future__ import annotations

import importlib
import pkgutil
import traceback
from pathlib import Path

from .records import RECORD_KEYS, is_record, skipped_check

__all__ = ["discover", "run_extensions", "PREFIX"]

#: Module-name prefix of an extension check.
PREFIX = "check_"


def discover(package="verification"):
    """Names of the extension modules of ``package`` (``check_*``), sorted.

    Parameters
    ----------
    package : str
        An importable package whose directory holds the ``check_*.py`` modules.

    Returns
    -------
    list of str
        Fully qualified module names.
    """
    module = importlib.import_module(package)
    paths = [str(Path(p)) for p in module.__path__]
    names = [info.name for info in pkgutil.iter_modules(paths)
             if info.name.startswith(PREFIX) and not info.ispkg]
    return [f"{package}.{name}" for name in sorted(names)]


def _failure(name, message):
    return {"name": name, "passed": False, "value": None, "tolerance": None, "op": None,
            "detail": message}


def _short_traceback(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return " ".join(line.strip() for line in lines)


def run_module(qualified, quick):
    """Import one extension module and run it; never raises.

    Returns
    -------
    list of dict
        Its records (each tagged with ``"source"``), or one skipped/failed record.
    """
    short = qualified.rsplit(".", 1)[-1]
    try:
        module = importlib.import_module(qualified)
        run = getattr(module, "run", None)
        if not callable(run):
            return [dict(_failure(short, f"{qualified} has no run(quick) function"),
                         source=qualified)]
        records = run(quick=quick)
    except ImportError as exc:
        return [dict(skipped_check(short, f"optional dependency missing: {exc}"),
                     source=qualified)]
    except Exception as exc:
        return [dict(_failure(short, f"{qualified}.run raised {_short_traceback(exc)}"),
                     source=qualified)]
    if not isinstance(records, list) or not records:
        return [dict(_failure(short, f"{qualified}.run returned {type(records).__name__}, "
                                     "expected a non-empty list of records"),
                     source=qualified)]
    out = []
    for i, record in enumerate(records):
        if not is_record(record):
            out.append(dict(_failure(f"{short}[{i}]", "malformed record (needs keys "
                                     f"{', '.join(RECORD_KEYS)}): {record!r:.200}"),
                            source=qualified))
            continue
        record = dict(record, source=qualified)
        if record["passed"] not in (True, False, None):
            record["passed"] = False
            record["detail"] = f"non-boolean 'passed'; {record['detail']}"
        if record["passed"] is None:
            record.setdefault("skipped", True)
        out.append(record)
    return out


def run_extensions(quick=True, package="verification"):
    """Discover and run every extension module of ``package``.

    Returns
    -------
    records : list of dict
    modules : list of str
        The modules found.
    """
    modules = discover(package)
    records = []
    for qualified in modules:
        records.extend(run_module(qualified, quick))
    return records, modules
