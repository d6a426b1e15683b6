"""Bulk builds whose landing misses the exact certificate: polished in place, not replayed.

The bulk landing (SMO, then the walk's rest state from its partition) can end with maintained
gradients that drifted from a fresh evaluation of the keys, so its certificate fails by a
little; the build then used to replay the whole batch key by key (O(n) walks). Each test
would fail on a solver without the polish of the landing (``n_bulk_builds`` stayed 0 there).
"""


import numpy as np
import pytest
from scipy.spatial.distance import pdist
from test_exact_vertex import assert_equals_fresh

import svtoolkit.exact._walk as W
import svtoolkit.exact.solver as solver_module
from svtoolkit import IncrementalSVDD
from svtoolkit.exact import BulkFallbackWarning, SolverFailure

#: The exact certificate of a build (BULK_KKT_TOL), units of f.
KKT_EXACT = solver_module.BULK_KKT_TOL
#: Two exact solves of the same keys at a unique optimum agree to the rounding of the bordered
#: solve, eps / kappa relative with kappa the smallest margin Schur complement; a margin key
#: has kappa >= KAPPA_TOL = 1e-8 (collinear keys come close to it), so 2.2e-8 relative on a
#: coefficient of at most C = 1 / 1.5: 1.5e-8 absolute, rounded up.
TOL_ALPHA_COLLINEAR = 2e-8


def _collinear(n, seed):
    t = np.random.default_rng(seed).uniform(0.0, 1.0, n)
    X = np.c_[t, 2.0 * t + 0.5]
    return X, 0.1 * float(np.median(pdist(X)))


def _walked(C, sigma, X, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(solver_module, "BULK_MIN_KEYS", 10**9)
        s = IncrementalSVDD(C, sigma)
        s.extend(X)
    assert s.n_bulk_builds == 0
    return s


def test_collinear_landing_is_polished_not_replayed(monkeypatch):
    """150 collinear keys in R^2 (sigma = 0.1 x median distance, nu = 0.01): the SMO stops
    at its iteration limit and the landing's certificate fails (9e-11 measured); the polish
    repairs it, and the state is the one the walk reaches key by key."""
    X, sigma = _collinear(150, 0)
    C = 1.0 / (0.01 * 150)
    bulk = IncrementalSVDD(C, sigma)
    bulk.extend(X)
    assert bulk.n_bulk_builds == 1 and bulk.n_bulk_fallbacks == 0
    assert bulk.bulk_fallback_reason is None
    assert bulk.kkt_residual() <= KKT_EXACT
    walked = _walked(C, sigma, X, monkeypatch)
    for name in ("margin_ids", "error_ids", "reserve_ids"):
        np.testing.assert_array_equal(getattr(bulk, name), getattr(walked, name))
    np.testing.assert_allclose(bulk.alpha, walked.alpha, rtol=0, atol=TOL_ALPHA_COLLINEAR)


def _objective(s):
    """a^T K a of a solver's state, from its keys (the SVDD dual's objective)."""
    X = s.keys
    K = np.exp(-((X[:, None, :] - X[None, :, :]) ** 2).sum(-1) / s.sigma**2)
    return float(s.alpha @ K @ s.alpha)


def _no_active_set(*args, **kwargs):
    return None, 0.0, False


def test_a_landing_that_is_not_accepted_is_solved_by_the_active_set(monkeypatch):
    """The same keys with the polish switched off: the landing's certificate fails, and the
    primal active-set method solves the build from the SMO iterate instead of a replay. Two
    feasible states whose KKT residuals are at most eps have objectives within 2 eps of each
    other (the gap is at most g . (a1 - a2), and ||a1 - a2||_1 <= 2 as both sum to 1), plus
    the rounding of the two sums a^T K a (~n u)."""
    monkeypatch.setattr(solver_module, "BULK_POLISH_ROUNDS", 0)
    X, sigma = _collinear(150, 0)
    C = 1.0 / (0.01 * 150)
    s = IncrementalSVDD(C, sigma)
    s.extend(X)
    assert s.n_active_set_builds == 1 and s.n_bulk_builds == 1 and s.n_bulk_fallbacks == 0
    assert s.kkt_residual() <= KKT_EXACT
    walked = _walked(C, sigma, X, monkeypatch)
    assert walked.kkt_residual() <= KKT_EXACT
    tol = 2.0 * (s.kkt_residual() + walked.kkt_residual()) + 150 * np.finfo(float).eps
    assert abs(_objective(s) - _objective(walked)) <= tol


def test_a_landing_past_its_event_limit_is_solved_by_the_active_set(monkeypatch):
    """A landing whose walk passes its event limit (here 0: every landing that must walk at
    all) is not replayed key by key: the active-set method solves the batch from the SMO
    iterate, and the result is the walk's optimum (objectives within the bound above)."""
    monkeypatch.setattr(solver_module, "BULK_LANDING_EVENTS_PER_KEY", 0)
    monkeypatch.setattr(solver_module, "BULK_LANDING_MIN_EVENTS", 0)
    X = np.random.default_rng(7).standard_normal((120, 4))
    s = IncrementalSVDD(0.02, 1.2)
    s.extend(X)
    assert s.n_active_set_builds == 1 and s.n_bulk_builds == 1 and s.n_bulk_fallbacks == 0
    assert s.kkt_residual() <= KKT_EXACT
    walked = _walked(0.02, 1.2, X, monkeypatch)
    tol = 2.0 * (s.kkt_residual() + walked.kkt_residual()) + 120 * np.finfo(float).eps
    assert abs(_objective(s) - _objective(walked)) <= tol
    s.remove(int(s.margin_ids[0]))  # the installed state is a state like any other
    s.add(X[0] + 0.1)
    assert s.kkt_residual() <= KKT_EXACT


def test_without_the_polish_and_the_active_set_the_build_falls_back_and_says_why(monkeypatch):
    """With the polish and the active-set method switched off: the replay's fallback is
    counted and named."""
    monkeypatch.setattr(solver_module, "BULK_POLISH_ROUNDS", 0)
    monkeypatch.setattr(solver_module.AS, "active_set", _no_active_set)
    X, sigma = _collinear(150, 0)
    s = IncrementalSVDD(1.0 / (0.01 * 150), sigma)
    with pytest.warns(BulkFallbackWarning, match="bulk build of 150 keys was not accepted"):
        s.extend(X)
    assert s.n_bulk_builds == 0 and s.n_bulk_fallbacks == 1
    assert "above BULK_KKT_TOL" in s.bulk_fallback_reason
    assert "iteration limit" in s.bulk_fallback_reason
    assert "the active-set fallback did not converge" in s.bulk_fallback_reason
    assert s.kkt_residual() <= KKT_EXACT


def test_dense_collinear_keys_build_exactly():
    """500 collinear keys in R^2 (sigma = 0.1 x median distance, nu = 0.01): the bulk landing
    did not certify and the key-by-key replay's 177th admission ran past the event limit, so
    the build was refused (its walk's inverse falls apart on these keys; docs/exact_solver.md,
    "Limits"). Now it is built, and the fresh KKT residual certifies the optimum. Deletions
    and admissions on it are not refused either; they walk on the inverse of a numerically
    singular margin set, so what holds after them is the rest check's bound (a state past it
    is solved afresh), not the build's certificate (8.4e-12 seen under
    ``OPENBLAS_CORETYPE=Haswell``)."""
    X, sigma = _collinear(500, 0)
    s = IncrementalSVDD.from_nu(0.01, 500, sigma)
    ids = s.extend(X)
    assert len(s) == 500 and s.certified and s.kkt_residual() <= KKT_EXACT
    limit = W.REST_CHECK_FACTOR * W.REPAIR_FACTOR * max(s.C, 1.0) * W.KAPPA_TOL
    rng = np.random.default_rng(1)
    for victim in rng.choice(ids, 5, replace=False):
        s.remove(int(victim))
        t = rng.uniform(0.0, 1.0)
        s.add([t, 2.0 * t + 0.5])
        assert s.kkt_residual() <= limit
    assert len(s) == 500


def test_a_gram_free_landing_falls_back_to_the_active_set_too(monkeypatch):
    """The 500 collinear keys with the Gram matrix ruled out (BULK_MAX_KEYS patched to 200, so
    the Gram-free SMO and landing run, as above 4,096 keys): the landing did not certify and
    the key-by-key replay was refused (SolverFailure, "more than 9850 events in one walk").
    Up to ACTIVE_SET_MAX_KEYS keys the Gram-free path now has the Gram path's budget and last
    resort: the active set forms the Gram matrix and builds it, at the Gram path's optimum
    (objectives within the bound of the tests above)."""
    X, sigma = _collinear(500, 0)
    on_gram = IncrementalSVDD.from_nu(0.01, 500, sigma)
    on_gram.extend(X)
    monkeypatch.setattr(solver_module, "BULK_MAX_KEYS", 200)
    s = IncrementalSVDD.from_nu(0.01, 500, sigma)
    s.extend(X)
    assert s.n_active_set_builds == 1 and s.n_bulk_builds == 1 and s.n_bulk_fallbacks == 0
    assert s.certified and s.kkt_residual() <= KKT_EXACT
    tol = 2.0 * (s.kkt_residual() + on_gram.kkt_residual()) + 500 * np.finfo(float).eps
    assert abs(_objective(s) - _objective(on_gram)) <= tol


def test_the_active_sets_start_snaps_the_keys_that_nearly_meet_a_bound():
    """The SMO iterate handed to the active set (``_active_set.snapped_start``): coefficients
    within ``snap`` C of a bound go to it and sum(a) = 1 is restored by an equal share over the
    others, so the start stays feasible with fewer free keys; where nothing would stay free,
    or the share would leave the box, the iterate is kept as it is."""
    from svtoolkit.exact._active_set import snapped_start

    C, snap = 0.1, 1e-2  # snapped: within 1e-3 of a bound
    a = np.array([C, C - 5e-4, 3e-4, 0.0] + [0.08002] * 10)  # sum 1 (to rounding)
    b = snapped_start(a, C, snap)
    np.testing.assert_array_equal(b[:4], [C, C, 0.0, 0.0])
    share = b[4:] - a[4:]  # -(5e-4 - 3e-4) / 10 each
    np.testing.assert_allclose(share, -2e-5, rtol=1e-9)
    assert abs(b.sum() - 1.0) <= 16 * np.finfo(float).eps
    assert 0.0 < b[4:].min() and b[4:].max() < C
    # nothing would stay free: the iterate as it is
    c = np.full(10, C)
    np.testing.assert_array_equal(snapped_start(c, C, snap), c)
    # nine keys snapped up to C take 8.9e-3 from three free keys, one of them at 2e-3: the
    # share would leave the box, so the iterate is kept
    d = np.array([C - 9.9e-4] * 9 + [2e-3, 0.053455, 0.053455])
    assert abs(d.sum() - 1.0) < 1e-12
    np.testing.assert_array_equal(snapped_start(d, C, snap), d)


def test_a_rejected_landing_is_counted_and_named(monkeypatch):
    """A certificate no landing can meet: the replay builds the state, the fallback is on
    record and announced (it used to be visible only as n_bulk_builds staying 0)."""
    monkeypatch.setattr(solver_module, "BULK_KKT_TOL", -1.0)
    X = np.random.default_rng(32).standard_normal((100, 4))
    s = IncrementalSVDD(0.02, 1.2)
    with pytest.warns(BulkFallbackWarning, match="replaying them key by key") as record:
        s.extend(X)
    assert len(record) == 1 and record[0].filename == __file__  # points at the caller
    # the build's landing, then the fresh solve that the check after the batch tries (no
    # state meets a negative certificate): both rejected, both on record, one warning
    assert s.n_bulk_builds == 0 and s.n_bulk_fallbacks == 2
    assert s.bulk_fallback_reason.startswith("the landing's KKT residual")


@pytest.mark.slow
def test_a_degenerate_vertex_does_not_cycle_and_refreshes_stop_at_the_inverses_floor():
    """3,000 2-D Gaussian keys (sigma = 0.1 x the median distance, nu = 0.01). The landing's
    first relaxation walk met a degenerate vertex and cycled through three keys at step length
    0 (join i, leave j, join k, leave i, ...), refactorising the inverse
    after every shrink at O(m^3) on the way (a fresh inverse of these 1,436 margin keys probes
    at 3.7e-5, above the fixed refresh threshold): the build had not returned after 570 s.
    With the ban on rejoining while a_c stands still and the refresh threshold that learns the
    inverse's floor it is exact (93 s measured, a cold compile included).

    Whether the walk finishes depended on the BLAS kernel: under
    ``OPENBLAS_CORETYPE=Sandybridge``, and on an Intel Xeon's default kernel, the landing
    still ran on (not returned after 14 and 20 minutes, and 570 s). The landing's rest state
    now has an event budget, past which the active-set method solves the build (163 s on
    that Intel Xeon), so it ends on every kernel."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3000, 2))
    sample = X[rng.choice(3000, 2000, replace=False)]
    s = IncrementalSVDD.from_nu(0.01, 3000, 0.1 * float(np.median(pdist(sample))))
    s.extend(X)
    assert s.n_bulk_builds == 1 and s.n_bulk_fallbacks == 0
    assert s.kkt_residual() <= KKT_EXACT
    assert len(s.margin_ids) > 1000  # the degenerate regime: half the keys on the margin


def test_a_rest_state_that_drifted_from_the_keys_is_refused_not_returned():
    """500 collinear keys in R^2 (sigma = 0.1 x median distance, nu = 0.01) added one by one
    with the event limit raised to 10^6: on the default kernels the admission of the 180th key
    ran 28,386 events on pivots down to 7e-11 and, after its three polishes, returned a state
    whose margin gradients were 0.02 off a fresh evaluation of the keys (the maintained ones
    read 0; KKT residual 0.02, nothing raised). The last rest state of an operation is now
    checked from the keys, and an operation whose state drifted fails (SolverFailure; the
    solver holds the state it had before it). Which admissions fail depends on the last bits
    of the BLAS kernel (under OPENBLAS_CORETYPE=Sandybridge an earlier one does; on an Intel
    Xeon the rebuild that used to follow a refusal failed too and dropped two keys held
    before); the property does not: after every operation, failed or not, the state held
    passes the check from the keys (``REST_CHECK_FACTOR`` times the dependent keys'
    tolerance, 4e-7 here) and a refused one leaves the coefficients and rho it found."""
    t = np.random.default_rng(0).uniform(0.0, 1.0, 500)
    X = np.c_[t, 2.0 * t + 0.5]
    s = IncrementalSVDD.from_nu(0.01, 500, 0.1 * float(np.median(pdist(X))))
    s.max_events = 10**6
    limit = W.REST_CHECK_FACTOR * W.REPAIR_FACTOR * max(s.C, 1.0) * W.KAPPA_TOL
    held, alpha, rho = 0, s.alpha, s.rho
    for x in X[:180]:
        try:
            s.add(x)
            held += 1
        except SolverFailure as exc:  # refused, and the state before it restored
            assert "the solver holds the state it had before it" in str(exc)
            assert np.array_equal(s.alpha, alpha) and s.rho == rho
        alpha, rho = s.alpha, s.rho
        assert len(s) == held
        assert s.kkt_residual() <= limit


def test_a_deletion_whose_decrement_fails_is_done_by_a_fresh_solve_not_refused(monkeypatch):
    """The right to be forgotten does not depend on the walk: when the exact decrement raises
    (event limit, a drifted rest state), ``remove`` replaces the state by a fresh solve of the
    retained keys - the same optimum - instead of rebuilding the keys it held, the deleted one
    included, and raising (it did that before)."""
    X = np.random.default_rng(41).standard_normal((120, 3))
    s = IncrementalSVDD(1.0 / (0.3 * 120), 1.5)
    s.extend(X)
    victim = int(s.margin_ids[0])

    def failing(self, slot, key_id):
        raise SolverFailure("more than 1 events in one walk (forced)")

    monkeypatch.setattr(IncrementalSVDD, "_remove_slot", failing)
    s.remove(victim)
    assert victim not in s.ids and len(s) == 119
    fresh = IncrementalSVDD(s.C, s.sigma)
    fresh.extend(np.delete(X, victim, axis=0))  # ids 0.. in the same order: the same solve
    np.testing.assert_array_equal(s.alpha, fresh.alpha)
    assert s.rho == fresh.rho and s.kkt_residual() <= KKT_EXACT
    assert s.add(X[victim]) == 120  # ids are not reused


def _failing_admission(monkeypatch, times):
    """Make the next ``times`` exact increments fail (as an event limit would) before they
    move anything; later ones (a rebuild's) run as usual."""
    real, left = IncrementalSVDD._add_checked, [times]

    def failing(self, x, new_id):
        if left[0] > 0:
            left[0] -= 1
            raise SolverFailure("more than 1 events in one walk (forced)")
        return real(self, x, new_id)

    monkeypatch.setattr(IncrementalSVDD, "_add_checked", failing)


def test_an_admission_whose_walk_fails_is_solved_afresh_not_refused(monkeypatch):
    """When the exact increment raises, ``add`` and ``extend`` replace the state by a fresh
    bulk solve of the keys held and the new ones (ids kept), taken only at the exact
    certificate - the optimum the walk was heading for - instead of refusing the keys."""
    X = np.random.default_rng(43).standard_normal((60, 3))
    s = IncrementalSVDD(1.0 / (0.3 * 60), 1.5)
    s.extend(X[:40])
    s.remove(5)  # the held ids are not 0..n-1: they must survive the fresh solve
    _failing_admission(monkeypatch, times=2)
    assert s.add(X[40]) == 40
    np.testing.assert_array_equal(s.extend(X[41:]), np.arange(41, 60))
    assert s.n_admission_fallbacks == 2 and s.kkt_residual() <= KKT_EXACT
    np.testing.assert_array_equal(s.ids, np.delete(np.arange(60), 5))
    monkeypatch.undo()
    fresh = IncrementalSVDD(s.C, s.sigma)
    fresh.extend(np.delete(X, 5, axis=0))  # 59 keys: the walk, key by key
    np.testing.assert_array_equal(s.margin_ids, np.delete(np.arange(60), 5)[fresh.margin_ids])
    # two exact solves of one unique optimum: each solves the bordered margin system to its
    # backward error, so they differ by at most ~cond(M) u in each coefficient (a factor 64
    # for the length of the sums and the rest state's corrections)
    M = fresh.margin_system().inverse
    cond = np.linalg.cond(M)
    np.testing.assert_allclose(s.alpha, fresh.alpha, rtol=0,
                               atol=64.0 * cond * np.finfo(float).eps * s.C)
    s.remove(int(s.margin_ids[0]))  # the state continues as any exact state
    assert s.kkt_residual() <= KKT_EXACT and s.add(X[5]) == 60


def test_an_admission_the_fresh_solve_cannot_take_is_refused_with_nothing_lost(monkeypatch):
    """The fallback needs no user event limit (neither the bulk build nor the anchored solve
    of warm-up runs with one); with one the admission is refused as before: the state is a
    fresh solve of the keys held before and the refused id is not consumed."""
    X = np.random.default_rng(44).standard_normal((30, 3))
    s = IncrementalSVDD(1.0 / (0.3 * 30), 1.5)
    s.extend(X[:20])
    before = s.alpha.copy()
    s.max_events = 10**6  # a user's event limit: the bulk build does not apply
    _failing_admission(monkeypatch, times=1)
    with pytest.raises(SolverFailure, match=r"state it had before it \(20 keys"):
        s.add(X[20])
    monkeypatch.undo()
    np.testing.assert_array_equal(s.ids, np.arange(20))
    np.testing.assert_array_equal(s.alpha, before)  # restored, not rebuilt
    assert s.n_admission_fallbacks == 0 and s.add(X[20]) == 20


def test_an_admission_in_warm_up_whose_walk_fails_is_solved_afresh_not_refused(monkeypatch):
    """While n C < 1 the fresh solve is the anchored problem's (the keys and the virtual
    anchor, ``IncrementalSVDD._build_anchored``): an admission whose walk fails there is no
    longer refused (it was: the bulk build needs n C >= 1). Five clusters of six keys 1e-5
    apart at sigma = 0.5 (nu = 0.5: warm-up until the 15th key) refused the 14th key that
    way; here the failure is forced on well-spread keys, where the walk's state is the
    reference. Two exact solves of one optimum differ by about cond(M) u per coefficient
    (M the bordered margin matrix; a factor 64 for the sums' lengths, as above)."""
    X = np.random.default_rng(45).standard_normal((12, 3))
    C = 1.0 / 15.0  # n C = 0.8 at 12 keys: warm-up throughout
    s = IncrementalSVDD(C, 1.5)
    s.extend(X[:11])
    _failing_admission(monkeypatch, times=1)
    assert s.add(X[11]) == 11
    monkeypatch.undo()
    walked = IncrementalSVDD(C, 1.5)
    walked.extend(X)
    assert not s.certified and s.n_admission_fallbacks == 1 and s.n_active_set_builds == 1
    assert s.kkt_residual() <= KKT_EXACT
    np.testing.assert_array_equal(s.ids, walked.ids)
    np.testing.assert_array_equal(s.margin_ids, walked.margin_ids)
    cond = np.linalg.cond(walked._bordered())  # the anchor's row included (warm-up)
    tol = 64.0 * cond * np.finfo(float).eps
    np.testing.assert_allclose(s.alpha, walked.alpha, rtol=0, atol=tol * C)
    assert s.warmup_mass == pytest.approx(walked.warmup_mass, abs=tol)
    for x in np.random.default_rng(46).standard_normal((4, 3)):  # on out of warm-up
        s.add(x)
    assert s.certified and s.kkt_residual() <= KKT_EXACT


def _with_probe_floor(s, floor, seed):
    """Add symmetric noise to the margin block of ``s``'s inverse so that its probe reads
    about ``floor``, as a fresh inverse of a large margin set does; returns that probe."""
    m = s._m
    noise = np.random.default_rng(seed).standard_normal((m, m))
    s._R[1: m + 1, 1: m + 1] += floor * 1e-2 * (noise + noise.T)
    w = np.zeros(m + 1)
    return W.inverse_probe_residual(s._R, m, s._S, s._KSt, s._status, s._n, w, w, w, False)


def test_the_probe_threshold_follows_a_well_conditioned_floor_above_the_ceiling():
    """Every margin key's Schur complement is ~2 (keys far apart in d = 64: K is nearly I);
    an inverse probing at 5e-9 - the size of a fresh inverse's floor at 4,000 such keys of
    d = 384 - gets a threshold of 4x that probe. Under the ceiling PROBE_TOL_MAX that applied
    to every margin set, each later operation polished twice without lowering the probe."""
    X = np.random.default_rng(47).standard_normal((60, 64))
    s = IncrementalSVDD(1.0 / 30.0, 1.0)
    s.extend(X)
    assert len(s.margin_ids) == 60
    assert np.min(1.0 / np.abs(np.diag(s._R)[1:61])) > W.POLISH_PIVOT
    probe = _with_probe_floor(s, 5e-9, 48)
    assert probe > W.PROBE_TOL_MAX
    s._calibrate_probe()
    assert s._fs[W._PROBE_LIMIT] == 4.0 * probe


def test_the_probe_threshold_keeps_its_ceiling_while_a_margin_key_has_a_near_twin():
    """Two keys 1e-3 sigma apart, both on the margin (Schur complement ~4e-6, below
    POLISH_PIVOT): the same probe keeps the threshold at PROBE_TOL_MAX, so operations polish
    and refresh the gradients that the steps' ~eps / pivot rounding reaches."""
    X = np.random.default_rng(47).standard_normal((60, 64))
    X[1] = X[0] + 1e-3 / np.sqrt(64)
    s = IncrementalSVDD(1.0 / 30.0, 1.0)
    s.extend(X)
    assert {0, 1} <= set(s.margin_ids.tolist())
    m = s._m
    assert np.min(1.0 / np.abs(np.diag(s._R)[1: m + 1])) < W.POLISH_PIVOT
    assert _with_probe_floor(s, 5e-9, 48) > W.PROBE_TOL_MAX
    s._calibrate_probe()
    assert s._fs[W._PROBE_LIMIT] == W.PROBE_TOL_MAX


@pytest.mark.slow
def test_deletions_among_4000_margin_keys_of_d_384_do_not_polish():
    """4,000 keys of d = 384 at sigma = 0.1 x their median distance (every key on the margin):
    a fresh inverse probes at about 1.6e-9. Before the threshold followed that floor past
    PROBE_TOL_MAX, each operation polished twice (11.6 s each; a deletion now none), and the
    states after it are the fresh solve's to the bordered solve's rounding."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4000, 384))
    sigma = 0.1 * float(np.median(pdist(X[:400])))
    s = IncrementalSVDD(1.0 / 2000.0, sigma)
    s.extend(X)
    assert len(s.margin_ids) == 4000 and s._fs[W._PROBE_LIMIT] > W.PROBE_TOL_MAX
    polishes = s.n_polishes
    for victim in rng.choice(4000, 4, replace=False):
        s.remove(int(victim))
    assert s.n_polishes == polishes
    assert s.consistency().kkt_residual <= KKT_EXACT


def test_an_active_set_not_accepted_from_the_smo_start_runs_again_from_the_centre(monkeypatch):
    """The active-set fallback that does not converge from the SMO iterate (it can cycle near
    the optimum of tight clusters: a key freed and held again by zero-length steps) is run
    once more from the centre of the box, every a = 1 / n. Here the first run is made to
    stop at its iteration cap; the build is then the second run's, at the exact certificate."""
    from svtoolkit.exact import _active_set as AS

    X = np.random.default_rng(7).standard_normal((120, 2))
    C = 1.0 / (0.3 * 120)
    starts, original = [], AS.active_set

    def first_run_stalls(Kp, upper, a, tol, max_iter):
        starts.append(a.copy())
        if len(starts) == 1:
            return np.zeros(len(a), dtype=bool), 0.0, False
        return original(Kp, upper, a, tol, max_iter)

    monkeypatch.setattr(AS, "active_set", first_run_stalls)
    monkeypatch.setattr(solver_module.IncrementalSVDD, "_land_bulk",
                        lambda self, Kp, a: 1.0)  # the landing misses its certificate
    s = IncrementalSVDD(C, 0.3 * float(np.median(pdist(X))))
    s.extend(X)
    assert len(starts) == 2 and s.n_active_set_builds == 1
    np.testing.assert_array_equal(starts[1], np.full(120, 1.0 / 120))
    assert s.kkt_residual() <= KKT_EXACT


def _tight_clusters_1000():
    """1,000 keys in tight clusters in d = 6 (281 centres, jitter 1e-5, sigma = 0.1 x the
    median distance, nu = 0.5; 469 margin keys; found by a randomised chain) and 40 more."""
    rng = np.random.default_rng(743329030)
    centres = 3.0 * rng.standard_normal((281, 6))
    X = centres[rng.integers(281, size=2250)] + 1e-5 * rng.standard_normal((2250, 6))
    sigma = 0.1 * float(np.median(pdist(X[:300])))
    s = IncrementalSVDD(1.0 / (0.5 * 1000), sigma)
    s.extend(X[:1000])
    return s, X[1000:1040]


def _events_at(monkeypatch, name):
    """The solver's event count each time its method ``name`` (a fallback) is called."""
    seen = []
    original = getattr(solver_module.IncrementalSVDD, name)

    def counted(self, *args, **kwargs):
        seen.append(self.n_events)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(solver_module.IncrementalSVDD, name, counted)
    return seen


def test_an_admission_whose_walk_cannot_finish_is_solved_afresh_within_its_first_try(
        monkeypatch):
    """On the tight clusters an admission used to take 13-161 s under the full limits (a walk
    of up to 50 n + 1,000 events, a rest state of up to 10 n + 10 repair walks) before a
    fresh solve of every key replaced it; its first try is bounded by about the work of one
    rebuild."""
    s, X = _tight_clusters_1000()
    walk_limit, repairs = s._first_try_limits()
    seen = _events_at(monkeypatch, "_admit_afresh")
    events, fallbacks = s.n_events, s.n_admission_fallbacks
    new = s.add(X[0])
    assert len(seen) == 1 and seen[0] - events <= (repairs + 2) * walk_limit
    assert s.n_admission_fallbacks == fallbacks + 1 and new in s.ids
    assert s.kkt_residual() <= KKT_EXACT
    assert_equals_fresh(s, X[1:])


def test_a_deletion_whose_walk_cannot_finish_is_solved_afresh_within_its_first_try(monkeypatch):
    """On the tight clusters (:func:`_tight_clusters_1000`) the deletion of a margin key
    used to take 441,000 events and three polishes (136 s) under the full limits
    before its rest state failed the check from the keys and a fresh solve replaced it. Its
    first try is bounded by about the work of one rebuild, so the fresh solve comes after at
    most (FIRST_TRY_REPAIRS + 2) walks of the first try's length."""
    s, X = _tight_clusters_1000()
    assert 974 in set(s.margin_ids.tolist())
    walk_limit, repairs = s._first_try_limits()
    seen = _events_at(monkeypatch, "_solve_afresh_without")
    events, builds = s.n_events, s.n_bulk_builds
    s.remove(974)
    assert len(seen) == 1 and seen[0] - events <= (repairs + 2) * walk_limit
    assert s.n_bulk_builds == builds + 1 and 974 not in s.ids
    assert s.kkt_residual() <= KKT_EXACT
    assert_equals_fresh(s, X)
