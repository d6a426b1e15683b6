"""Local corpus files: generic fractional split, the standard enwik8 split, bad files."""

import zipfile

import numpy as np
import pytest

from svtoolkit.corpora import (
    ENWIK8_BYTES,
    ENWIK8_SPLIT,
    corpus_file_splits,
    enwik8_splits,
    is_enwik8,
    read_corpus_file,
)


def _random_bytes(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def fake_enwik8(tmp_path):
    """A sparse file of enwik8's size, with marker bytes on both sides of each cut."""
    path = tmp_path / "enwik8"
    n_train, n_val, _ = ENWIK8_SPLIT
    with open(path, "wb") as fh:
        fh.truncate(ENWIK8_BYTES)
        for offset, value in ((n_train - 1, 1), (n_train, 2), (n_train + n_val - 1, 3),
                              (n_train + n_val, 4), (ENWIK8_BYTES - 1, 5)):
            fh.seek(offset)
            fh.write(bytes([value]))
    return path


def test_generic_file_is_read_raw_and_split_by_fraction(tmp_path):
    data = _random_bytes(10_000)
    path = tmp_path / "tinystories-valid.txt"
    path.write_bytes(data)
    assert not is_enwik8(path)
    assert read_corpus_file(path) == data
    assert read_corpus_file(path, max_bytes=100) == data[:100]
    splits = corpus_file_splits(path, val=0.1, test=0.1)
    assert splits.sizes() == {"train": 8000, "val": 1000, "test": 1000}
    assert bytes(splits.val) == data[8000:9000]
    assert corpus_file_splits(path, max_bytes=1000).sizes() == {"train": 900, "val": 50,
                                                               "test": 50}


def test_zip_of_one_file(tmp_path):
    data = _random_bytes(3000, seed=1)
    path = tmp_path / "corpus.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("owt_sample.txt", data)
    assert read_corpus_file(path) == data
    assert read_corpus_file(path, max_bytes=10) == data[:10]


def test_enwik8_gets_the_standard_split(fake_enwik8):
    assert is_enwik8(fake_enwik8)
    splits = corpus_file_splits(fake_enwik8)
    assert splits.sizes() == dict(zip(("train", "val", "test"), ENWIK8_SPLIT, strict=True))
    assert (splits.train[-1], splits.val[0], splits.val[-1], splits.test[0],
            splits.test[-1]) == (1, 2, 3, 4, 5)
    capped = corpus_file_splits(fake_enwik8, max_bytes=1000)
    assert capped.sizes() == {"train": 1000, "val": ENWIK8_SPLIT[1], "test": ENWIK8_SPLIT[2]}
    assert capped.val[0] == 2  # validation and test stay the standard bytes


@pytest.mark.parametrize("name", ["enwik8", "ENWIK8.txt", "enwik8.raw"])
def test_enwik8_names(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"abc")
    assert is_enwik8(path)
    with pytest.raises(ValueError, match="named as enwik8 but holds 3 bytes"):
        read_corpus_file(path)


def test_enwik8_inside_zip_is_recognised(tmp_path):
    path = tmp_path / "download.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("enwik8", b"too short")
    assert is_enwik8(path)
    with pytest.raises(ValueError, match="named as enwik8"):
        read_corpus_file(path)


def test_enwik8_splits_checks_the_size():
    with pytest.raises(ValueError, match="whole of enwik8"):
        enwik8_splits(b"abc")


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no corpus file"):
        read_corpus_file(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="not a regular file"):
        read_corpus_file(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        read_corpus_file(empty)
    two = tmp_path / "two.zip"
    with zipfile.ZipFile(two, "w") as archive:
        archive.writestr("a.txt", b"a")
        archive.writestr("b.txt", b"b")
    with pytest.raises(ValueError, match="exactly one file"):
        read_corpus_file(two)
    with pytest.raises(TypeError, match="path must be a str or Path"):
        read_corpus_file(3)
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"abcdef")
    with pytest.raises(ValueError, match="max_bytes must be >= 1; got 0"):
        read_corpus_file(ok, max_bytes=0)
