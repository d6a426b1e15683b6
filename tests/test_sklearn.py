"""IncrementalOneClassSVM: scikit-learn's estimator checks, equality with OneClassSVM, exact
unlearning, refused operations, and the scikit-learn tooling (Pipeline, GridSearchCV, clone,
pickle).

Tolerances:

==================================  ===========  =============================================
comparison                          tol          why
==================================  ===========  =============================================
decision vs OneClassSVM(tol=1e-10)  1e-6 rel     libsvm caches the kernel matrix in float32
                                                 (measured up to ~2e-8 relative)
dual_coef_ vs OneClassSVM           1e-5         same (coefficients in [0, 1])
forget vs fit on the retained       1e-10        both exact fp64 solves of one problem
pickle round trip, continuation     bit for bit  the solver state travels whole
==================================  ===========  =============================================
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("sklearn")

from sklearn.base import clone  # noqa: E402
from sklearn.model_selection import GridSearchCV  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.svm import OneClassSVM  # noqa: E402
from sklearn.utils._param_validation import InvalidParameterError  # noqa: E402
from sklearn.utils.estimator_checks import parametrize_with_checks  # noqa: E402

from svtoolkit import SolverFailure  # noqa: E402
from svtoolkit.sklearn import IncrementalOneClassSVM  # noqa: E402

TOL_SKLEARN_REL = 1e-6
TOL_DUAL = 1e-5
TOL_EXACT = 1e-10


@parametrize_with_checks([IncrementalOneClassSVM(),
                          IncrementalOneClassSVM(nu=0.1, gamma="auto")])
def test_sklearn_estimator_checks(estimator, check):
    check(estimator)


def _blobs(seed, n=60, d=2):
    return np.random.default_rng(seed).standard_normal((n, d))


def _dense_dual(est_or_oc, n):
    a = np.zeros(n)
    a[est_or_oc.support_] = est_or_oc.dual_coef_[0]
    return a


@pytest.mark.parametrize("nu, gamma", [(0.5, "scale"), (0.1, "auto"), (0.3, 0.7), (0.05, 2.0)])
def test_matches_oneclass_svm(nu, gamma):
    rng = np.random.default_rng(3)
    X, probes = rng.standard_normal((120, 3)), 2.0 * rng.standard_normal((200, 3))
    ref = OneClassSVM(nu=nu, gamma=gamma, tol=1e-10).fit(X)
    est = IncrementalOneClassSVM(nu=nu, gamma=gamma).fit(X)
    expected = ref.decision_function(probes)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(est.decision_function(probes), expected,
                               rtol=0, atol=TOL_SKLEARN_REL * scale)
    np.testing.assert_allclose(est.score_samples(probes), ref.score_samples(probes),
                               rtol=0, atol=TOL_SKLEARN_REL * scale)
    assert est.offset_ == pytest.approx(ref.offset_[0], rel=TOL_SKLEARN_REL)
    np.testing.assert_allclose(_dense_dual(est, 120), _dense_dual(ref, 120), atol=TOL_DUAL)
    assert est.dual_coef_.sum() == pytest.approx(nu * 120, rel=1e-12)
    assert est.gamma_ == pytest.approx(ref._gamma, rel=1e-15)


def test_after_partial_fit_matches_oneclass_svm_at_the_held_size():
    # C = 1/(nu n0) stays fixed, so n samples held are OneClassSVM(nu = nu n0 / n).
    rng = np.random.default_rng(4)
    X, probes = rng.standard_normal((90, 2)), 2.0 * rng.standard_normal((100, 2))
    est = IncrementalOneClassSVM(nu=0.3, gamma=0.5).fit(X[:60]).partial_fit(X[60:])
    ref = OneClassSVM(nu=0.3 * 60 / 90, gamma=0.5, tol=1e-10).fit(X)
    expected = ref.decision_function(probes)
    np.testing.assert_allclose(est.decision_function(probes), expected,
                               rtol=0, atol=TOL_SKLEARN_REL * np.abs(expected).max())
    np.testing.assert_array_equal(est.sample_ids_, np.arange(90))
    assert est.n_samples_seen_ == 90


def test_forget_is_exact_unlearning():
    X = _blobs(5, n=80)
    probes = 2.0 * np.random.default_rng(6).standard_normal((100, 2))
    est = IncrementalOneClassSVM(nu=0.2, gamma=0.8, n0=50).fit(X[:50]).partial_fit(X[50:])
    gone = np.array([est.support_[0], 7, 55, est.support_[-1]])
    est.forget(gone)
    keep = np.setdiff1d(np.arange(80), gone)
    fresh = IncrementalOneClassSVM(nu=0.2, gamma=0.8, n0=50).fit(X[keep])
    np.testing.assert_array_equal(est.sample_ids_, keep)
    np.testing.assert_allclose(est.decision_function(probes), fresh.decision_function(probes),
                               rtol=0, atol=TOL_EXACT)
    np.testing.assert_allclose(_dense_dual(est, len(keep)), _dense_dual(fresh, len(keep)),
                               rtol=0, atol=TOL_EXACT)
    assert est.offset_ == pytest.approx(fresh.offset_, abs=TOL_EXACT)
    np.testing.assert_array_equal(est.support_vectors_, X[keep][est.support_])
    assert est.solver_.kkt_residual() < 1e-12


@pytest.mark.parametrize("nu, gamma", [(0.5, "scale"), (0.1, "auto"), (0.3, 0.7)])
def test_support_attributes_follow_oneclass_svm(nu, gamma):
    """support_, n_support_, support_vectors_ and dual_coef_ have OneClassSVM's shapes,
    dtypes and order, and equal a real OneClassSVM fit's (coefficients to libsvm's float32
    kernel cache, TOL_DUAL; the support set itself exactly)."""
    X = np.random.default_rng(12).standard_normal((90, 3))
    ref = OneClassSVM(nu=nu, gamma=gamma, tol=1e-10).fit(X)
    est = IncrementalOneClassSVM(nu=nu, gamma=gamma).fit(X)
    for name in ("support_", "n_support_", "support_vectors_", "dual_coef_"):
        ours, theirs = getattr(est, name), getattr(ref, name)
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), name
    np.testing.assert_array_equal(est.support_, ref.support_)
    np.testing.assert_array_equal(est.n_support_, ref.n_support_)
    np.testing.assert_array_equal(est.support_vectors_, ref.support_vectors_)
    np.testing.assert_allclose(est.dual_coef_, ref.dual_coef_, rtol=0, atol=TOL_DUAL)


def test_after_forget_support_indexes_the_remaining_rows():
    """After forget, support_ indexes the held rows renumbered without the forgotten ones: it
    equals support_ of OneClassSVM(nu = nu n0 / n) fit on those rows."""
    X = np.random.default_rng(13).standard_normal((100, 2))
    est = IncrementalOneClassSVM(nu=0.2, gamma=0.6).fit(X[:70]).partial_fit(X[70:])
    gone = [int(est.support_[0]), 5, 71, int(est.support_[-1])]
    est.forget(gone)
    keep = np.setdiff1d(np.arange(100), gone)
    ref = OneClassSVM(nu=0.2 * 70 / len(keep), gamma=0.6, tol=1e-10).fit(X[keep])
    np.testing.assert_array_equal(est.support_, ref.support_)
    np.testing.assert_array_equal(est.n_support_, [len(ref.support_)])
    np.testing.assert_array_equal(est.support_vectors_, X[keep][est.support_])
    np.testing.assert_array_equal(est.support_vectors_, X[est.sample_ids_[est.support_]])
    np.testing.assert_allclose(est.dual_coef_, ref.dual_coef_, rtol=0, atol=TOL_DUAL)


def _snapshot(est):
    return {k: np.copy(v) for k, v in est.solver_.state_dict().items()} | {
        "ids": est.sample_ids_.copy(), "support": est.support_.copy(), "offset": est.offset_}


def _assert_unchanged(est, before):
    after = _snapshot(est)
    assert after.keys() == before.keys()
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


@pytest.mark.parametrize("ids, error, match", [
    ([3, 500], KeyError, "unknown sample id 500"),
    ([-1], KeyError, "unknown sample id -1"),
    ([2, 2], ValueError, "ids must be distinct"),
    ([1.0], TypeError, "ids must be integers"),
    ([[1, 2]], ValueError, "1-D"),
])
def test_refused_forget_changes_nothing(ids, error, match):
    est = IncrementalOneClassSVM(nu=0.5, gamma=1.0).fit(_blobs(7, n=40))
    before = _snapshot(est)
    with pytest.raises(error, match=match):
        est.forget(ids)
    _assert_unchanged(est, before)


def test_forget_twice_raises_already_forgotten():
    est = IncrementalOneClassSVM(gamma=1.0).fit(_blobs(8, n=30))
    est.forget(4)
    before = _snapshot(est)
    with pytest.raises(KeyError, match="sample id 4 was already forgotten"):
        est.forget([0, 4])
    _assert_unchanged(est, before)


def test_forget_below_nu_n0_is_warm_up_until_samples_come_back():
    X = _blobs(9, n=21)
    est = IncrementalOneClassSVM(nu=0.5, gamma=1.0, n0=20).fit(X[:20])  # needs >= 10
    est.forget(np.arange(10))
    assert len(est.sample_ids_) == 10 and est.solver_.certified
    np.testing.assert_array_equal(est.dual_coef_, np.ones((1, 10)))  # a = C for all
    est.forget(10)  # a deletion is never refused: back to warm-up
    assert not est.solver_.certified and np.isnan(est.offset_)
    with pytest.raises(ValueError, match=r"holds 9 samples, .* at least nu\*n0 = 10 .*warm-up"):
        est.predict(X[:3])
    est.partial_fit(X[20:])
    fresh = IncrementalOneClassSVM(nu=0.5, gamma=1.0, n0=20).fit(X[np.r_[11:21]])
    # both on the one feasible point a = C (10 samples, 10 C = 1), rho from sums of 10 terms
    # of size <= 2 C in other orders: f within 8 * 10 eps, decision_function = f / (2 C)
    np.testing.assert_array_equal(est.dual_coef_, np.ones((1, 10)))
    np.testing.assert_allclose(est.decision_function(X), fresh.decision_function(X), rtol=0,
                               atol=8 * 10 * np.finfo(np.float64).eps / (2 * est.C_))


def test_forget_down_to_exactly_nu_n0_equals_the_fit_of_what_remains():
    """nu n0 = 54 of 108 samples kept: every coefficient at C (dual_coef_ = 1), and the model
    is a fit of the 54 under the same C. Both land on that one feasible point with rho from
    sums of 54 terms of size <= 2 C in different orders: f differs by at most ~8 * 54 eps,
    and decision_function = f / (2 C)."""
    X = np.random.default_rng(702).standard_normal((108, 6))
    est = IncrementalOneClassSVM(nu=0.5, gamma=1 / 9).fit(X)
    est.forget(np.arange(54))
    fresh = IncrementalOneClassSVM(nu=0.5, gamma=1 / 9, n0=108).fit(X[54:])
    np.testing.assert_array_equal(est.sample_ids_, np.arange(54, 108))
    np.testing.assert_array_equal(est.dual_coef_, np.ones((1, 54)))
    np.testing.assert_array_equal(fresh.dual_coef_, np.ones((1, 54)))
    probes = np.vstack([X, np.random.default_rng(703).standard_normal((20, 6))])
    tol = 8 * 54 * np.finfo(np.float64).eps / (2 * est.C_)
    np.testing.assert_allclose(est.decision_function(probes), fresh.decision_function(probes),
                               rtol=0, atol=tol)


def test_a_stream_of_small_chunks_equals_one_fit_of_all_rows():
    """nu = 0.3, n0 = 200 (C = 1/60) fed as 7 chunks of 29 rows: the first two chunks are held
    in warm-up (29 and 58 < 60 samples), the third ends it, and the end state is what one
    fit of the 203 rows gives. Both solve the bordered system of the same margin set from
    sums over 203 samples (terms of size <= 2) in other orders: f agrees to 8 cond(M) n eps
    (cond of the bordered matrix), and decision_function = f / (2 C)."""
    X = np.random.default_rng(40).standard_normal((203, 3))
    probes = np.vstack([X, 2.0 * np.random.default_rng(41).standard_normal((50, 3))])
    stream = IncrementalOneClassSVM(nu=0.3, gamma=0.3, n0=200)
    for k, chunk in enumerate(np.split(X, 7)):
        stream.partial_fit(chunk)
        assert stream.solver_.certified == (k >= 2)
        if k < 2:
            with pytest.raises(ValueError, match="warm-up"):
                stream.decision_function(probes)
    whole = IncrementalOneClassSVM(nu=0.3, gamma=0.3, n0=200).fit(X)
    np.testing.assert_array_equal(stream.sample_ids_, np.arange(203))
    assert set(stream.support_) == set(whole.support_)
    cond = max(np.linalg.cond(est.solver_._bordered()) for est in (stream, whole))
    tol = 8 * cond * 203 * np.finfo(np.float64).eps
    np.testing.assert_allclose(stream.decision_function(probes), whole.decision_function(probes),
                               rtol=0, atol=tol / (2 * whole.C_))
    np.testing.assert_allclose(_dense_dual(stream, 203), _dense_dual(whole, 203), rtol=0,
                               atol=tol / whole.C_)


def test_forget_empty_is_a_no_op():
    est = IncrementalOneClassSVM(gamma=1.0).fit(_blobs(10, n=20))
    before = _snapshot(est)
    assert est.forget([]) is est
    _assert_unchanged(est, before)


def test_failed_walk_in_forget_restores_the_model(monkeypatch):
    est = IncrementalOneClassSVM(nu=0.2, gamma=1.0).fit(_blobs(11, n=40))
    before = _snapshot(est)
    probes = _blobs(12, n=20)
    expected = est.decision_function(probes)
    solver, real_remove, calls = est.solver_, est.solver_.remove, []

    def flaky_remove(sample_id):
        calls.append(sample_id)
        if len(calls) == 2:
            raise SolverFailure("injected failure")
        real_remove(sample_id)

    monkeypatch.setattr(solver, "remove", flaky_remove)
    with pytest.raises(SolverFailure, match="injected failure"):
        est.forget([1, 2, 3])
    assert est.solver_ is not solver  # the copy taken before the call
    _assert_unchanged(est, before)
    np.testing.assert_array_equal(est.decision_function(probes), expected)


def test_forget_before_fit_raises():
    from sklearn.exceptions import NotFittedError
    with pytest.raises(NotFittedError, match="not fitted"):
        IncrementalOneClassSVM().forget([0])


@pytest.mark.parametrize("method", ["fit", "partial_fit"])
def test_fewer_than_nu_n0_samples_are_held_in_warm_up(method):
    est = getattr(IncrementalOneClassSVM(nu=0.5, gamma=1.0, n0=100), method)(_blobs(13, n=20))
    assert not est.solver_.certified and len(est.sample_ids_) == 20
    for decide in (est.decision_function, est.score_samples, est.predict):
        with pytest.raises(ValueError, match=r"holds 20 samples, .* at least nu\*n0 = 50"):
            decide(_blobs(14, n=3))


def test_refused_fit_leaves_the_estimator_as_it_was():
    from sklearn.exceptions import NotFittedError
    est = IncrementalOneClassSVM(nu=0.5, n0=10).fit(_blobs(32, n=10, d=3))
    before = _snapshot(est)
    est.set_params(gamma=1e-320)
    with pytest.raises(ValueError, match="outside the range the RBF kernel supports"):
        est.fit(_blobs(33, n=20, d=2))
    _assert_unchanged(est, before)
    assert est.n_features_in_ == 3
    fresh = IncrementalOneClassSVM(nu=0.5, gamma=1e-320)
    with pytest.raises(ValueError, match="outside the range the RBF kernel supports"):
        fresh.partial_fit(_blobs(34, n=20))
    assert not hasattr(fresh, "n_features_in_")
    with pytest.raises(NotFittedError, match="not fitted"):
        fresh.predict(_blobs(35, n=2))


def test_partial_fit_with_other_number_of_features_raises():
    est = IncrementalOneClassSVM().fit(_blobs(14, n=20, d=3))
    before = _snapshot(est)
    with pytest.raises(ValueError, match="X has 2 features, but IncrementalOneClassSVM is "
                                         "expecting 3 features"):
        est.partial_fit(_blobs(15, n=5, d=2))
    _assert_unchanged(est, before)


@pytest.mark.parametrize("method", ["fit", "partial_fit", "decision_function", "predict"])
def test_nan_input_raises(method):
    est = IncrementalOneClassSVM().fit(_blobs(16, n=20))
    bad = _blobs(17, n=5)
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        getattr(est, method)(bad)


@pytest.mark.parametrize("params, match", [
    ({"nu": 0.0}, "'nu' parameter"), ({"nu": 1.5}, "'nu' parameter"),
    ({"gamma": 0.0}, "'gamma' parameter"), ({"gamma": "median"}, "'gamma' parameter"),
    ({"n0": 0}, "'n0' parameter"), ({"n0": 2.5}, "'n0' parameter"),
])
def test_invalid_parameters_raise(params, match):
    with pytest.raises(InvalidParameterError, match=match):
        IncrementalOneClassSVM(**params).fit(_blobs(18, n=10))


def test_gamma_is_resolved_at_fit_and_then_fixed():
    X = 3.0 * _blobs(19, n=30, d=4)
    est = IncrementalOneClassSVM(gamma="scale").fit(X)
    assert est.gamma_ == 1.0 / (4 * X.var())
    est.partial_fit(10.0 * _blobs(20, n=10, d=4))
    assert est.gamma_ == 1.0 / (4 * X.var())
    assert IncrementalOneClassSVM(gamma="auto").fit(X).gamma_ == 0.25
    assert IncrementalOneClassSVM(gamma="scale").fit(np.ones((5, 2))).gamma_ == 1.0


def test_unrepresentable_gamma_raises():
    with pytest.raises(ValueError, match="outside the range the RBF kernel supports"):
        IncrementalOneClassSVM(gamma=1e-320).fit(_blobs(21, n=10))


def test_n0_defaults_to_the_fit_size_and_refit_restarts_ids():
    est = IncrementalOneClassSVM(nu=0.25).fit(_blobs(22, n=40))
    assert est.n0_ == 40 and est.C_ == 1.0 / (0.25 * 40)
    est.partial_fit(_blobs(23, n=5)).forget([0, 41])
    est.fit(_blobs(24, n=8))
    np.testing.assert_array_equal(est.sample_ids_, np.arange(8))
    assert est.n0_ == 8 and est.n_samples_seen_ == 8


def test_first_partial_fit_fits():
    X = _blobs(25, n=30)
    a = IncrementalOneClassSVM(gamma=0.5).partial_fit(X)
    b = IncrementalOneClassSVM(gamma=0.5).fit(X)
    np.testing.assert_array_equal(a.decision_function(X), b.decision_function(X))


def test_predict_is_the_sign_of_decision_function():
    X = _blobs(26, n=50)
    est = IncrementalOneClassSVM(nu=0.3, gamma=1.0).fit(X)
    probes = 2.0 * _blobs(27, n=200)
    decision = est.decision_function(probes)
    np.testing.assert_array_equal(est.predict(probes), np.where(decision >= 0, 1, -1))
    np.testing.assert_array_equal(est.fit_predict(X), np.where(est.decision_function(X) >= 0,
                                                               1, -1))
    assert {-1, 1} == set(est.predict(probes).tolist())


def test_pickle_round_trip_continues_exactly():
    X = _blobs(28, n=70)
    est = IncrementalOneClassSVM(nu=0.2, gamma=0.7).fit(X[:50])
    twin = pickle.loads(pickle.dumps(est))
    assert twin.solver_ is not est.solver_
    np.testing.assert_array_equal(twin.decision_function(X), est.decision_function(X))
    gone = [int(est.support_[0]), 3, 60]
    for model in (est, twin):
        model.partial_fit(X[50:]).forget(gone)
    np.testing.assert_array_equal(twin.decision_function(X), est.decision_function(X))
    np.testing.assert_array_equal(twin.dual_coef_, est.dual_coef_)
    np.testing.assert_array_equal(twin.sample_ids_, est.sample_ids_)


def test_clone_is_unfitted_with_the_same_parameters():
    est = IncrementalOneClassSVM(nu=0.2, gamma=0.7, n0=30).fit(_blobs(29, n=30))
    twin = clone(est)
    assert twin.get_params() == {"nu": 0.2, "gamma": 0.7, "n0": 30}
    assert not hasattr(twin, "solver_")


def _labelled_toy(seed):
    rng = np.random.default_rng(seed)
    X = np.vstack([rng.standard_normal((80, 2)), rng.uniform(-6.0, 6.0, (20, 2))])
    y = np.r_[np.ones(80, dtype=int), -np.ones(20, dtype=int)]
    order = rng.permutation(100)
    return X[order], y[order]


def test_pipeline_and_grid_search():
    X, y = _labelled_toy(30)
    pipe = make_pipeline(StandardScaler(), IncrementalOneClassSVM(nu=0.2))
    search = GridSearchCV(pipe, {"incrementaloneclasssvm__nu": [0.1, 0.3],
                                 "incrementaloneclasssvm__gamma": [0.1, 1.0]},
                          scoring="roc_auc", cv=3).fit(X, y)
    assert search.best_score_ > 0.9  # inliers score higher than uniform outliers
    scaled = StandardScaler().fit_transform(X)
    best = IncrementalOneClassSVM(
        nu=search.best_params_["incrementaloneclasssvm__nu"],
        gamma=search.best_params_["incrementaloneclasssvm__gamma"]).fit(scaled)
    np.testing.assert_allclose(search.best_estimator_.decision_function(X),
                               best.decision_function(scaled), rtol=0, atol=1e-12)


def test_feature_names_from_a_dataframe():
    pd = pytest.importorskip("pandas")
    X = pd.DataFrame(_blobs(31, n=20, d=3), columns=["a", "b", "c"])
    est = IncrementalOneClassSVM().fit(X)
    np.testing.assert_array_equal(est.feature_names_in_, ["a", "b", "c"])
    assert est.n_features_in_ == 3
    est.partial_fit(X.iloc[:5])
    np.testing.assert_array_equal(est.sample_ids_, np.arange(25))
