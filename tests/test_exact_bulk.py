"""The Gram-free bulk build of IncrementalSVDD (SMO with a kernel-column cache + exact landing).

The Gram-free path is taken above ``BULK_MAX_KEYS`` keys; the tests lower that threshold (and
the subsample and cache sizes) so that it runs on problems small enough for the walk, and
compare it with the walk replaying the keys one at a time and with the Gram-matrix bulk path.
"""

from __future__ import annotations

import numpy as np
import pytest

import svtoolkit.exact._landing as landing_module
import svtoolkit.exact.solver as solver_module
from svtoolkit import IncrementalSVDD
from svtoolkit.exact import BulkFallbackWarning
from svtoolkit.exact import _bulk as B

#: Keys within 1e-7 of each other leave the optimum flat along their split (docs/exact_solver.md,
#: "Limits"); f is compared there, as in the walk's own near-duplicate tests.
TOL_F_NEARDUP = 1e-6


def _build(X, C, sigma, monkeypatch, path, guess=None, cache_columns=3):
    """Extend an empty solver by ``path``: "walk", "gram" (bulk with the Gram matrix) or
    "cached" (the Gram-free bulk path, subsample ``guess`` keys, ``cache_columns`` columns)."""
    with monkeypatch.context() as patch:
        if path == "walk":
            patch.setattr(solver_module, "BULK_MIN_KEYS", 10**9)
        elif path == "cached":
            patch.setattr(solver_module, "BULK_MAX_KEYS", 1)
            patch.setattr(landing_module, "BULK_GUESS_KEYS", guess or len(X) // 4)
            patch.setattr(landing_module, "BULK_CACHE_BYTES", 8 * len(X) * cache_columns)
        solver = IncrementalSVDD(C, sigma)
        ids = solver.extend(X)
    np.testing.assert_array_equal(ids, np.arange(len(X)))
    assert solver.n_bulk_builds == (0 if path == "walk" else 1)
    return solver


def _same_state(a, b, tol=1e-12):
    for name in ("margin_ids", "error_ids", "reserve_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_allclose(a.alpha, b.alpha, rtol=0, atol=tol)
    assert a.rho == pytest.approx(b.rho, abs=tol)


REGIMES = [  # (n, d, nu, sigma): few, many and all keys in the margin set; n C = 1; wide keys
    (200, 6, 0.3, 1.5), (300, 4, 0.5, 0.3), (150, 3, 0.1, 3.0), (120, 5, 1.0, 1.0),
    (400, 16, 0.3, 5.5),
]


@pytest.mark.parametrize("n,d,nu,sigma", REGIMES)
def test_gram_free_build_lands_on_the_walks_state(n, d, nu, sigma, monkeypatch):
    """Same partition, coefficients and rho as the walk and as the Gram bulk path (a unique
    optimum), to rounding; the certificate holds and the state continues exactly."""
    X = np.random.default_rng(n + d).standard_normal((n, d))
    C = 1.0 / (nu * n)
    walked = _build(X, C, sigma, monkeypatch, "walk")
    gram = _build(X, C, sigma, monkeypatch, "gram")
    cached = _build(X, C, sigma, monkeypatch, "cached")
    _same_state(cached, walked)
    _same_state(cached, gram)
    assert cached.certified and cached.kkt_residual() <= 1e-13
    found = cached.consistency()
    assert found.grad_drift <= 1e-12 and found.margin_rows_drift == 0.0
    for s in (cached, walked):
        s.remove(3)
        s.add(X[3] + 0.25)
    _same_state(cached, walked)


@pytest.mark.parametrize("cache_columns", [2, 5, 1000])
def test_the_cache_size_does_not_change_the_result(cache_columns, monkeypatch):
    """The LRU cache only saves recomputation: any size (two columns at least) gives the same
    SMO iterates, hence bit-identical states."""
    X = np.random.default_rng(7).standard_normal((250, 5))
    reference = _build(X, 1 / (0.3 * 250), 1.2, monkeypatch, "cached", cache_columns=2000)
    s = _build(X, 1 / (0.3 * 250), 1.2, monkeypatch, "cached", cache_columns=cache_columns)
    np.testing.assert_array_equal(s.alpha, reference.alpha)
    assert s.rho == reference.rho


def test_cached_smo_follows_the_gram_smo_bit_for_bit():
    """smo_cached on kernel columns computed on demand makes the same moves as smo on the
    Gram matrix (the same kernel values, selection and steps)."""
    rng = np.random.default_rng(11)
    n, C = 180, 1.0 / (0.3 * 180)
    Xt = np.ascontiguousarray(rng.standard_normal((4, n)))
    Kp = B.shifted_gram(Xt, n, 0.5)
    a_gram = B.feasible_start(n, C)
    g_gram = 2.0 * (Kp @ a_gram)
    it_gram = B.smo(Kp, C, B.SMO_TOL, 10**5, a_gram, g_gram)
    a = B.feasible_start(n, C)
    g = 2.0 * (Kp @ a)
    it = B.smo_cached(Xt, n, 0.5, C, B.SMO_TOL, 10**5, a, g, *B.column_cache(n, 4))
    assert it == it_gram > 0
    np.testing.assert_array_equal(a, a_gram)
    np.testing.assert_array_equal(g, g_gram)


def test_kernel_sums_are_the_same_in_threads_and_equal_the_direct_sum(monkeypatch):
    rng = np.random.default_rng(12)
    n = 300
    Xt = np.ascontiguousarray(rng.standard_normal((3, n)))
    idx = np.arange(0, n, 3)
    coef = rng.random(len(idx))
    coef /= coef.sum()  # a unit mass, as the solver's coefficients
    single = B.kernel_sums(Xt, n, 0.7, idx, coef)
    monkeypatch.setattr(B, "SUM_PARALLEL_PAIRS", 0)
    monkeypatch.setattr(B, "SUM_THREADS", 3)
    np.testing.assert_array_equal(B.kernel_sums(Xt, n, 0.7, idx, coef), single)
    diff = Xt.T[:, None, :] - Xt.T[idx][None, :, :]
    direct = np.expm1(-0.7 * (diff**2).sum(-1)) @ coef
    np.testing.assert_allclose(single, direct, rtol=0, atol=1e-14)


def test_threaded_fresh_gradients_are_bit_identical(monkeypatch):
    s = IncrementalSVDD(1 / (0.3 * 200), 1.5)
    s.extend(np.random.default_rng(13).standard_normal((200, 6)))
    single = s._fresh_gradients()
    monkeypatch.setattr(B, "SUM_PARALLEL_PAIRS", 0)
    monkeypatch.setattr(B, "SUM_THREADS", 2)
    np.testing.assert_array_equal(s._fresh_gradients(), single)


def test_guessed_start_is_feasible_and_ranks_outliers_first():
    rng = np.random.default_rng(14)
    n, C = 400, 1.0 / (0.3 * 400)
    X = rng.standard_normal((n, 3))
    X[:20] *= 6.0  # far outliers: the guess must put them in the error set
    Xt = np.ascontiguousarray(X.T)
    a = B.guess_start(Xt, n, 1.0 / 3.0, C, 64)
    assert a.sum() == pytest.approx(1.0, abs=1e-12)
    assert (a >= 0.0).all() and (a <= C).all()
    assert (a[:20] == C).all()
    np.testing.assert_array_equal(B.guess_start(Xt, n, 1.0 / 3.0, C, n),
                                  B.feasible_start(n, C))


def test_gram_free_build_of_near_duplicates_matches_the_decision_function(monkeypatch):
    """Clusters of near duplicates (1e-7 apart): keys dependent on the margin set stay at a
    bound, as in the walk; f is compared (the optimum is flat along the twins' split)."""
    rng = np.random.default_rng(31)
    centers = rng.standard_normal((12, 3))
    X = np.repeat(centers, 8, axis=0) + 1e-7 * rng.standard_normal((96, 3))
    walked = _build(X, 0.03, 1.0, monkeypatch, "walk")
    cached = _build(X, 0.03, 1.0, monkeypatch, "cached", guess=24)
    assert cached.kkt_residual() <= 1e-10
    Q = rng.standard_normal((50, 3))
    np.testing.assert_allclose(cached.decision_function(Q), walked.decision_function(Q),
                               rtol=0, atol=TOL_F_NEARDUP)


@pytest.mark.parametrize("failure", ["certificate", "smo"])
def test_gram_free_build_falls_back_to_the_walk(failure, monkeypatch):
    """Above ACTIVE_SET_MAX_KEYS (no active set): a landing that is not certified, or an SMO
    that does not converge, leaves nothing behind: the walk builds the same state, bit for
    bit."""
    X = np.random.default_rng(32).standard_normal((100, 4))
    reference = _build(X, 0.02, 1.2, monkeypatch, "walk")
    monkeypatch.setattr(solver_module, "BULK_MAX_KEYS", 1)
    monkeypatch.setattr(solver_module, "ACTIVE_SET_MAX_KEYS", 1)
    monkeypatch.setattr(landing_module, "BULK_GUESS_KEYS", 25)
    if failure == "certificate":
        monkeypatch.setattr(solver_module, "BULK_KKT_TOL", -1.0)
    else:
        monkeypatch.setattr(B, "smo_cached", lambda *args: -1)
    s = IncrementalSVDD(0.02, 1.2)
    with pytest.warns(BulkFallbackWarning):
        np.testing.assert_array_equal(s.extend(X), np.arange(100))
    assert s.n_bulk_builds == 0
    np.testing.assert_array_equal(s.alpha, reference.alpha)
    assert s.rho == reference.rho


def test_gram_free_smo_that_does_not_converge_is_finished_by_the_active_set(monkeypatch):
    """Up to ACTIVE_SET_MAX_KEYS, a Gram-free SMO that stops short (here: no iteration at all,
    the guessed start) hands its iterate to the active-set method, which lands on the walk's
    state (to the rounding of two exact solves, 1e-12)."""
    X = np.random.default_rng(32).standard_normal((100, 4))
    reference = _build(X, 0.02, 1.2, monkeypatch, "walk")
    monkeypatch.setattr(solver_module, "BULK_MAX_KEYS", 1)
    monkeypatch.setattr(landing_module, "BULK_GUESS_KEYS", 25)
    monkeypatch.setattr(B, "smo_cached", lambda *args: -1)
    s = IncrementalSVDD(0.02, 1.2)
    np.testing.assert_array_equal(s.extend(X), np.arange(100))
    assert s.n_bulk_builds == 1 and s.n_active_set_builds == 1 and s.n_bulk_fallbacks == 0
    assert s.kkt_residual() <= 1e-12
    _same_state(s, reference)


def test_gram_free_build_above_the_gram_cap_matches_the_walk(monkeypatch):
    """With the shipped settings (subsample, cache, thresholds), 5,000 keys in d = 16 at
    nu = 0.3: the Gram-free build lands on the walk's state."""
    X = np.random.default_rng(51).standard_normal((5000, 16))
    C = 1.0 / (0.3 * 5000)
    cached = IncrementalSVDD(C, 5.5)
    cached.extend(X)
    assert cached.n_bulk_builds == 1
    walked = _build(X, C, 5.5, monkeypatch, "walk")
    _same_state(cached, walked)
    assert cached.kkt_residual() <= 1e-12
