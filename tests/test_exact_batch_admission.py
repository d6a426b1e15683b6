"""A batch into a solver that holds keys: walked key by key until the rest of it is heavy.

Each admission walks at O(n m) per event. On the digits with a third of the rows held twice at
gamma = 1 (every kernel value between distinct rows underflows to 0, so the margin set grows to
every distinct row and twins tie exactly) admissions took hundreds of zero-length events each:
a ``partial_fit`` of 2,396 such rows in five chunks had not finished after ten minutes, where
one build of all of them takes 3 s. Once the rows left are at least BULK_BATCH_FRACTION of the
keys held while the margin set holds at least BULK_BATCH_MARGIN_SHARE of them (asked before
each walk: the walks can grow the margin set), the rest of the batch is solved afresh with the
keys held (ids kept). Every result is compared with a fresh solve of the same keys
(:func:`test_exact_vertex.assert_equals_fresh`).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.distance import pdist
from test_exact_vertex import agreement_bound, assert_equals_fresh

import svtoolkit.exact.solver as solver_module
from svtoolkit import IncrementalSVDD

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def _twin_digits():
    """600 digits rows (450 distinct, 150 of them held twice), shuffled; C = 1 / (0.2 x 600)."""
    X = sklearn_datasets.load_digits().data[:450]
    rng = np.random.default_rng(0)
    X = np.vstack([X, X[rng.integers(450, size=150)]])[rng.permutation(600)]
    return X, 1.0 / (0.2 * 600)


def test_a_batch_whose_walks_grow_the_margin_set_hands_its_rest_to_a_fresh_solve():
    X, C = _twin_digits()
    s = IncrementalSVDD(C, 1.0)
    s.extend(X[:120])  # n C = 1: every key at C, no margin key
    assert len(s.margin_ids) == 0
    s.extend(X[120:240])  # the walks grow the margin set to every distinct key
    assert s.n_bulk_builds == 2
    np.testing.assert_array_equal(s.ids, np.arange(240))
    assert_equals_fresh(s, np.vstack([X[:240], X[240:280]]))


def test_the_fresh_solve_equals_the_walks(monkeypatch):
    X, C = _twin_digits()
    s = IncrementalSVDD(C, 1.0)
    s.extend(X[:120])
    s.extend(X[120:240])
    monkeypatch.setattr(solver_module, "BULK_BATCH_FRACTION", np.inf)  # walk every key
    walked = IncrementalSVDD(C, 1.0)
    walked.extend(X[:120])
    walked.extend(X[120:240])
    assert walked.n_bulk_builds == 1
    assert_equals_fresh(walked, X[240:280])
    probes = np.vstack([X[:240], X[240:280]])
    tol = max(agreement_bound(s), agreement_bound(walked))
    np.testing.assert_allclose(s.decision_function(probes), walked.decision_function(probes),
                               rtol=0, atol=tol)


def test_cheap_walks_are_kept():
    """Gaussian keys at the median distance: a few events per admission, a small margin set;
    the batch is walked key by key."""
    X = np.random.default_rng(1).standard_normal((440, 6))
    s = IncrementalSVDD.from_nu(0.2, 400, float(np.median(pdist(X[:400]))))
    s.extend(X[:400])
    events = s.n_events
    s.extend(X[400:])
    assert s.n_bulk_builds == 1 and s.n_events > events
    assert_equals_fresh(s, X[:40] + 0.1)
