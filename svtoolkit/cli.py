"""Command line: ``svtoolkit memory init|add|forget|edit|query|list|audit STORE ...``.

Also runnable as ``python -m svtoolkit``. Every command that changes a store takes an exclusive
lock on ``STORE.lock`` (POSIX), loads and verifies the file, applies the change and saves it
atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys

import numpy as np

__all__ = ["main"]

GUARANTEES = """\
What the memory guarantees, and the scope of each guarantee:

  forget   Exact deletion. The record is removed by exact decrement of a one-class SVM
           (SVDD) solved in fp64: the stored state equals a from-scratch solve of the
           remaining records with the same C. The record's key and value are erased from the
           file on the next save (the atomic rename replaces the old file); its id is kept
           as a tombstone so a second forget is refused. The receipt gives the KKT residual
           (optimality, recomputed from the keys), sha256 digests of the state before and
           after, and with --audit the largest deviation from a fresh solve. Scope: the
           store file. Copies you made, backups, logs and any system that already read an
           answer are outside it; so is data the filesystem or disk keeps after a rename.

  query    Answers come only from held records: a forgotten or evicted record's value is
           never returned. A record supports a query when the kernel similarity
           exp(-||q - x||^2 / sigma^2) reaches the store's min_similarity; with no
           supporting record the answer is "no record".

  budget   Certified eviction. Over budget, only reserve records (SVM coefficient exactly 0)
           are evicted, oldest first: no coefficient and no answer weight changes (nor the
           decision function, unless the margin set is empty: rho is then not unique and
           moves to the midpoint of its optimal interval). Scope: the records held now; a
           later record can make an evicted one matter again. If the support set alone
           exceeds the budget, nothing more is evicted and the store grows past the budget
           (with a warning).

  files    Saves are atomic (temporary file, fsync, rename, directory fsync): a crash leaves
           the old file or the new one. Loading checks the format version, a sha256 checksum,
           the internal consistency, the KKT residual and the state digest, and refuses a
           damaged file. The checksum detects damage, not deliberate tampering: it is
           not a signature (no key is involved), so someone who can write the file can
           recompute it, and the stored digest too. The state digest covers the configuration
           (C, sigma, budget, min_similarity), the held records and the coefficients, not
           the tombstones, the metadata or the counters; keep receipts' digests elsewhere to
           detect a forged state. Values are JSON; nothing is unpickled.

Keys: --key 1,2.5 or --key '[1, 2.5]'. A key starting with a minus sign can be written
--key=-1,2 (--key -1,2 also works).

Text keys (--text) need the optional encoder: pip install 'svtoolkit[text]'.
"""
#: A token that is a key starting with a minus sign ("-1,2", "-.5 3", "-1e-3"), not an option.
_NEGATIVE_KEY = re.compile(r"^-\.?\d")


def _parse_key(text):
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [
            float(tok) for tok in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ValueError(
            f"--key must be numbers separated by commas or a JSON list: {exc}") from exc
    return np.asarray(values, dtype=np.float64)


def _key_from(args, mem):
    if getattr(args, "text", None) is not None:
        if mem.metadata.get("encoder") is None:
            raise ValueError("this store holds vector keys (created without --text); use --key")
        from .embeddings import encode

        return encode(args.text)[0]
    if getattr(args, "key", None) is not None:
        return _parse_key(args.key)
    return None


def _value_from(args):
    if args.value_json is not None:
        try:
            return json.loads(args.value_json)
        except RecursionError:
            raise ValueError("--value-json is nested too deeply") from None
        except ValueError as exc:
            raise ValueError(f"--value-json is not valid JSON: {exc}") from None
    return args.value


@contextlib.contextmanager
def _locked(store):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
        yield
        return
    fd = os.open(os.fspath(store) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _emit(obj, as_json):
    if as_json:
        print(json.dumps(obj, indent=2, ensure_ascii=False))
    else:
        for k, v in obj.items():
            print(f"{k}: {v}")


def _cmd_init(args):
    from .memory import ForgettableMemory

    metadata = {"encoder": "all-MiniLM-L6-v2"} if args.text else {}
    mem = ForgettableMemory(sigma=args.sigma, C=args.C, nu=args.nu, n0=args.n0,
                            budget=args.budget, min_similarity=args.min_similarity,
                            metadata=metadata)
    with _locked(args.store):  # check and write under one lock: no other process in between
        if os.path.exists(args.store) and not args.force:
            raise FileExistsError(f"{args.store} exists (use --force to replace it)")
        mem.save(args.store)
    print(f"created {args.store}: C={mem.C:.6g} sigma={mem.sigma:g} budget={mem.budget} "
          f"min_similarity={mem.min_similarity:g}" + (" (text keys)" if args.text else ""))


def _mutate(args, fn):
    from .memory import ForgettableMemory

    with _locked(args.store):
        mem = ForgettableMemory.load(args.store)
        out = fn(mem)
        mem.save(args.store)
    return out


def _cmd_add(args):
    if args.value is None and args.value_json is None:
        raise ValueError("add needs --value or --value-json (--value-json null stores null)")

    def apply(mem):
        key = _key_from(args, mem)
        if key is None:
            raise ValueError("add needs --key or --text")
        rid = mem.add(key, _value_from(args), record_id=args.id)
        return {"record_id": rid, "n_records": len(mem), "evicted": list(mem.last_evicted),
                "digest": mem.state_digest()}

    _emit(_mutate(args, apply), args.json)


def _cmd_forget(args):
    receipt = _mutate(args, lambda mem: mem.forget(args.record_id, audit=args.audit))
    _emit(receipt.to_dict(), True)


def _cmd_edit(args):
    def apply(mem):
        kwargs = {}
        key = _key_from(args, mem)
        if key is not None:
            kwargs["key"] = key
        if args.value is not None or args.value_json is not None:
            kwargs["value"] = _value_from(args)
        return mem.edit(args.record_id, audit=args.audit, **kwargs)

    _emit(_mutate(args, apply).to_dict(), True)


def _cmd_query(args):
    from .memory import ForgettableMemory

    mem = ForgettableMemory.load(args.store)
    key = _key_from(args, mem)
    if key is None:
        raise ValueError("query needs --key or --text")
    hits = mem.query(key, k=args.k, min_similarity=args.min_similarity)
    if args.json:
        print(json.dumps([h._asdict() for h in hits], indent=2, ensure_ascii=False))
    elif not hits:
        print("no record")
    else:
        for h in hits:
            print(f"{h.record_id}\tscore={h.score:.4f}\tweight={h.weight:.4f}\t"
                  f"{json.dumps(h.value, ensure_ascii=False)}")


def _cmd_list(args):
    from .memory import ForgettableMemory

    mem = ForgettableMemory.load(args.store)
    for rid in mem.record_ids:
        print(f"{rid}\t{json.dumps(mem.get(rid), ensure_ascii=False)}")


def _cmd_audit(args):
    from .memory import ForgettableMemory

    mem = ForgettableMemory.load(args.store)
    report = mem.audit().to_dict()
    report["tombstones"] = len(mem.tombstones)
    report["revision"] = mem.revision
    _emit(report, args.json)


def _parser():
    parser = argparse.ArgumentParser(
        prog="svtoolkit",
        description="svtoolkit: forgettable attention memory (exact fp64 SVDD gate).",
    )
    top = parser.add_subparsers(dest="group", required=True)
    memory = top.add_parser(
        "memory", help="a key-value memory with exact deletion and certified eviction",
        description="A key-value memory with exact deletion, receipts and certified eviction.",
        epilog=GUARANTEES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = memory.add_subparsers(dest="command", required=True)

    def command(name, func, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=GUARANTEES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("store", help="path of the memory file")
        p.set_defaults(func=func)
        return p

    def key_args(p):
        g = p.add_mutually_exclusive_group()
        g.add_argument("--key", help="key vector: numbers separated by commas, or a JSON list "
                       "(a leading minus sign: --key=-1,2)")
        g.add_argument("--text", help="a sentence, embedded with all-MiniLM-L6-v2 (text stores)")

    def value_args(p):
        g = p.add_mutually_exclusive_group()
        g.add_argument("--value", help="value, stored as a string")
        g.add_argument("--value-json", help="value as JSON (number, list, object, ...)")

    p = command("init", _cmd_init, "create an empty memory file")
    p.add_argument("--sigma", type=float, required=True, help="RBF kernel width")
    p.add_argument("--C", type=float, help="box constraint (or give --nu and --n0)")
    p.add_argument("--nu", type=float, help="C = 1 / (nu * n0), computed once")
    p.add_argument("--n0", type=int, help="reference size for --nu")
    p.add_argument("--budget", type=int, help="most records to hold (certified eviction)")
    p.add_argument("--min-similarity", type=float, default=0.5,
                   help="support threshold of queries on exp(-||q-x||^2/sigma^2) (default 0.5)")
    p.add_argument("--text", action="store_true", help="keys are sentences (MiniLM encoder)")
    p.add_argument("--force", action="store_true", help="replace an existing file")

    p = command("add", _cmd_add, "store a record (exact increment)")
    key_args(p)
    value_args(p)
    p.add_argument("--id", help="record id (default r0, r1, ...)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("forget", _cmd_forget, "delete a record exactly and print its receipt (JSON)")
    p.add_argument("record_id")
    p.add_argument("--audit", action="store_true",
                   help="also compare with a from-scratch solve of the remaining records")

    p = command("edit", _cmd_edit, "change a record's key and/or value (exact remove-and-add)")
    p.add_argument("record_id")
    key_args(p)
    value_args(p)
    p.add_argument("--audit", action="store_true")

    p = command("query", _cmd_query, "the nearest records supporting a query")
    key_args(p)
    p.add_argument("-k", type=int, default=1, help="number of answers (default 1)")
    p.add_argument("--min-similarity", type=float, help="override the store's threshold")
    p.add_argument("--json", action="store_true", help="print JSON (an empty list: no record)")

    command("list", _cmd_list, "list the held records (id and value)")

    p = command("audit", _cmd_audit, "verify the file and recompute the certificate")
    p.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _join_negative_keys(argv):
    """Rewrite ``--key -1,2`` as ``--key=-1,2`` (argparse would read ``-1,2`` as an option)."""
    out = []
    for token in argv:
        if out and out[-1] == "--key" and _NEGATIVE_KEY.match(token):
            out[-1] = f"--key={token}"
        else:
            out.append(token)
    return out


def main(argv=None):
    """Entry point of the ``svtoolkit`` command.

    Parameters
    ----------
    argv : list of str, optional
        Arguments after the program name (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success; 1 after printing a one-line ``error: ...`` to stderr (bad input, a
        refused or unreadable file, an operating-system error, a solver failure).
    """
    from .exact import SolverFailure

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(_join_negative_keys(argv))
    try:
        args.func(args)
    except KeyError as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError, ImportError, SolverFailure) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
