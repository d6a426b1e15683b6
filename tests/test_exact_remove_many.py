"""Batch deletion (IncrementalSVDD.remove_many): the state a fresh solve of the rest has.

Where decrements are expensive (a batch of at least BULK_BATCH_FRACTION of the keys while the
margin set holds at least BULK_BATCH_MARGIN_SHARE of them) the retained keys are solved afresh
by the bulk build with their ids kept; otherwise the keys are removed one decrement at a time.
Either way the result is compared with a fresh solve of the retained keys, to the bound two
exact solves of the same keys agree to (:func:`test_exact_vertex.agreement_bound`).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.spatial.distance import pdist
from test_exact_vertex import agreement_bound

import svtoolkit.exact.solver as solver_module
from svtoolkit import IncrementalSVDD
from svtoolkit.exact import BulkFallbackWarning


def _margin_heavy(n=300, seed=0):
    """Gaussian keys in d = 8 at a small width: most keys end on the margin."""
    X = np.random.default_rng(seed).standard_normal((n, 8))
    s = IncrementalSVDD.from_nu(0.3, n, 0.35 * float(np.median(pdist(X))))
    s.extend(X)
    assert len(s.margin_ids) >= solver_module.BULK_BATCH_MARGIN_SHARE * n
    return X, s


def _fresh(s, X, victims):
    keep = np.setdiff1d(np.arange(len(X)), victims)
    fresh = IncrementalSVDD(s.C, s.sigma)
    fresh.extend(X[keep])
    return fresh


def _assert_equals_fresh(s, fresh, probes):
    tol = max(agreement_bound(s), agreement_bound(fresh))
    np.testing.assert_allclose(s.alpha, fresh.alpha, rtol=0, atol=tol)
    np.testing.assert_allclose(s.decision_function(probes), fresh.decision_function(probes),
                               rtol=0, atol=tol)


def test_a_large_batch_on_a_margin_heavy_solver_is_solved_afresh_with_its_ids():
    X, s = _margin_heavy()
    victims = np.random.default_rng(1).choice(300, 45, replace=False)
    builds, next_id = s.n_bulk_builds, s._next_id
    s.remove_many(victims)
    assert s.n_bulk_builds == builds + 1  # the rebuild, not 45 decrements
    np.testing.assert_array_equal(s.ids, np.setdiff1d(np.arange(300), victims))
    _assert_equals_fresh(s, _fresh(s, X, victims), np.vstack([X, X[:50] + 0.1]))
    assert s.kkt_residual() <= solver_module.BULK_KKT_TOL
    with pytest.raises(KeyError, match="was removed"):
        s.remove(int(victims[0]))
    assert s.add(X[0] + 0.01) == next_id  # removed ids are never reused


def test_a_small_batch_or_few_margin_keys_is_removed_decrement_by_decrement():
    """The same victims removed one by one give the same bits."""
    X = np.random.default_rng(2).standard_normal((200, 4))
    s = IncrementalSVDD.from_nu(0.4, 200, 2.0 * float(np.median(pdist(X))))
    s.extend(X)
    assert len(s.margin_ids) < solver_module.BULK_BATCH_MARGIN_SHARE * 200
    one_by_one = s.copy()
    victims = [int(v) for v in np.random.default_rng(3).choice(200, 40, replace=False)]
    s.remove_many(victims)
    for v in victims:
        one_by_one.remove(v)
    np.testing.assert_array_equal(s.alpha, one_by_one.alpha)
    assert s.rho == one_by_one.rho and s.n_bulk_builds == 1  # the first extend's only


def test_a_rejected_landing_is_rebuilt_by_the_walk_and_announced(monkeypatch):
    X, s = _margin_heavy(n=200, seed=4)
    victims = np.arange(0, 200, 10)
    monkeypatch.setattr(solver_module, "BULK_KKT_TOL", -1.0)
    with pytest.warns(BulkFallbackWarning, match="remove_many: the bulk rebuild of the 180"):
        s.remove_many(victims)
    monkeypatch.undo()
    np.testing.assert_array_equal(s.ids, np.setdiff1d(np.arange(200), victims))
    _assert_equals_fresh(s, _fresh(s, X, victims), X)


@pytest.mark.parametrize("ids, error, message", [
    ([3, 999], KeyError, "unknown id 999"),
    ([3, 3], ValueError, "ids must be distinct"),
    ([3, 1.5], KeyError, "ids are integers"),
])
def test_a_refused_batch_removes_nothing(ids, error, message):
    _, s = _margin_heavy(n=120, seed=5)
    before = s.state_dict()
    with pytest.raises(error, match=message):
        s.remove_many(ids)
    after = s.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(after[key]), err_msg=key)


def test_an_empty_batch_changes_nothing_and_an_infeasible_rest_returns_to_warm_up():
    _, s = _margin_heavy(n=120, seed=6)
    alpha = s.alpha
    s.remove_many([])
    np.testing.assert_array_equal(s.alpha, alpha)
    s.remove_many(s.ids[:110])  # 10 keys left, 10 C < 1
    assert len(s) == 10 and not s.certified
