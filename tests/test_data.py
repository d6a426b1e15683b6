"""svtoolkit.data: generators, preprocessing helpers and the real-data loaders.

Seeds are fixed per test (``np.random.default_rng(SEED + k)``).
"""

from __future__ import annotations

import importlib.util
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from svtoolkit import data

SEED = 20261130
HAS_SKTIME = importlib.util.find_spec("sktime") is not None


# ------------------------------------------------------------------------------ generators
def test_gaussian_keys_shape_scale_and_determinism():
    a = data.gaussian_keys(2000, 3, scale=2.0, rng=SEED)
    b = data.gaussian_keys(2000, 3, scale=2.0, rng=np.random.default_rng(SEED))
    assert a.shape == (2000, 3) and a.dtype == np.float64
    np.testing.assert_array_equal(a, b)
    assert abs(a.std() - 2.0) < 0.1


@pytest.mark.parametrize("n, d, exc, match", [
    (0, 3, ValueError, "n must be >= 1"),
    (5, 0, ValueError, "d must be >= 1"),
    (2.5, 3, TypeError, "n must be an int"),
])
def test_gaussian_keys_rejects_bad_sizes(n, d, exc, match):
    with pytest.raises(exc, match=match):
        data.gaussian_keys(n, d, rng=SEED)


def test_redundant_keys_cluster_structure():
    X = data.redundant_keys(4, 6, 5, spread=1.0, jitter=1e-3, rng=SEED + 1)
    assert X.shape == (24, 5)
    clusters = X.reshape(4, 6, 5)
    within = np.abs(clusters - clusters.mean(axis=1, keepdims=True)).max()
    between = np.linalg.norm(clusters[0, 0] - clusters[1, 0])
    assert within < 1e-2 < between


def test_redundant_keys_without_jitter_are_exact_duplicates():
    X = data.redundant_keys(3, 4, 2, jitter=0.0, rng=SEED + 2)
    assert len(np.unique(X, axis=0)) == 3


def test_redundant_keys_rejects_negative_jitter():
    with pytest.raises(ValueError, match="jitter must be finite and >= 0"):
        data.redundant_keys(2, 2, 2, jitter=-1.0)


# ------------------------------------------------------------------------------ preprocessing
def test_sliding_windows_univariate_and_multichannel():
    x = np.arange(10.0)
    w = data.sliding_windows(x, 4, step=3)
    np.testing.assert_array_equal(w, [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]])
    X = np.arange(20.0).reshape(10, 2)
    W = data.sliding_windows(X, 5, step=5)
    assert W.shape == (2, 5, 2)
    np.testing.assert_array_equal(W[1], X[5:10])
    W[0, 0, 0] = -1.0  # a copy, not a view
    assert X[0, 0] == 0.0


@pytest.mark.parametrize("x, width, match", [
    (np.zeros((2, 2, 2)), 1, "must be 1-D"),
    (np.zeros(3), 4, "fewer than width=4"),
])
def test_sliding_windows_rejects_bad_input(x, width, match):
    with pytest.raises(ValueError, match=match):
        data.sliding_windows(x, width)


def test_standardize_own_and_given_statistics():
    X = data.gaussian_keys(500, 3, scale=3.0, rng=SEED + 3) + 5.0
    Z = data.standardize(X)
    np.testing.assert_allclose(Z.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(Z.std(axis=0), 1.0, rtol=1e-12)
    Z2 = data.standardize(X[:10], mean=X.mean(axis=0), std=X.std(axis=0))
    np.testing.assert_allclose(Z2, Z[:10], rtol=1e-13)


def test_standardize_rejects_constant_column():
    X = np.ones((4, 2))
    X[:, 0] = [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match=r"columns \[1\] are constant"):
        data.standardize(X)


def test_deduplicate_drops_exact_duplicates_at_radius_zero():
    X = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1e-12]])
    kept, index = data.deduplicate(X, 0.0)
    np.testing.assert_array_equal(index, [0, 1, 3])
    np.testing.assert_array_equal(kept, X[[0, 1, 3]])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), radius=st.floats(0.0, 1.5))
def test_deduplicate_separation_and_cover(seed, radius):
    X = np.random.default_rng(seed).standard_normal((30, 2))
    kept, index = data.deduplicate(X, radius)
    dist = np.sqrt(((X[:, None, :] - kept[None, :, :]) ** 2).sum(-1))
    pair = dist[index]
    np.fill_diagonal(pair, np.inf)
    assert (pair > radius).all()  # kept rows are more than radius apart
    assert (dist.min(axis=1) <= radius + 1e-15).all()  # every row is covered
    assert (np.diff(index) > 0).all()


def test_deduplicate_rejects_negative_radius():
    with pytest.raises(ValueError, match="radius must be finite and >= 0"):
        data.deduplicate(np.zeros((2, 2)), -0.1)


# ------------------------------------------------------------------------------ real data
def test_load_shuttle_matches_river():
    X, y = data.load_shuttle(return_labels=True)
    assert X.shape == (49097, 9) and y.shape == (49097,)
    assert int(y.sum()) == 3511  # river's documentation: 3,511 anomalies
    from river.datasets import Shuttle

    for i, (row, label) in enumerate(itertools.islice(Shuttle(), 200)):
        np.testing.assert_array_equal(X[i], [row[f] for f in data.SHUTTLE_FEATURES])
        assert y[i] == label
    np.testing.assert_array_equal(data.load_shuttle(), X)


def _no_package(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name in ("river", "sktime"):
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_loaders_name_the_extra_when_the_package_is_missing(monkeypatch):
    _no_package(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install 'svtoolkit\[verify\]'"):
        data.load_shuttle()
    with pytest.raises(ImportError, match=r"pip install 'svtoolkit\[examples\]'"):
        data.load_mitdb_ecg()


def test_loader_reports_a_package_without_the_file(monkeypatch, tmp_path):
    empty = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: empty)
    with pytest.raises(FileNotFoundError, match="has no datasets/data/mitdb/mitdb.csv"):
        data.load_mitdb_ecg()


@pytest.mark.skipif(not HAS_SKTIME, reason="sktime not installed (svtoolkit[examples])")
def test_load_mitdb_ecg():
    signal, labels = data.load_mitdb_ecg()
    assert signal.shape == labels.shape == (7500,)
    assert set(np.unique(labels)) == {0, 1}
    edges = np.flatnonzero(np.diff(labels))
    assert len(edges) == 2  # one contiguous anomalous segment
    assert np.isfinite(signal).all() and signal.std() > 0
