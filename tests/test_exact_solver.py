"""The exact incremental/decremental SVDD solver against independent references.

Tolerance table (one per comparison class; reasons in docs/design.md §6.2):

=============================  ========  =====================================================
comparison                     tol       why
=============================  ========  =====================================================
objective vs QP reference      1e-9 rel  the polished reference is exact to rounding
f vs QP reference              1e-8      well-separated keys (unique, well-conditioned optimum)
f vs reference, near dups      1e-6      f is determined only to O(C |grad k| delta) when keys
                                         are delta = 1e-7 apart (the optimum is flat along the
                                         split of weight between twins); objective still 1e-9
KKT (value-based, naive)       1e-9      certificate of optimality of a convex QP
f vs brute-force enumeration   1e-10     tiny problems, exact partition
round trip (ids, alpha, rho)   1e-12     the walk is reversible
reserve eviction (f change)    1e-12     nothing is re-solved (summation order only)
=============================  ========  =====================================================
"""

from __future__ import annotations

import naive
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from svtoolkit import IncrementalSVDD, SolverFailure, rbf_kernel
from svtoolkit._rules import FEASIBILITY_TOL
from svtoolkit.exact import BulkFallbackWarning
from svtoolkit.exact import _walk as W
from svtoolkit.exact import solver as solver_module
from svtoolkit.exact._factor import bordered_inverse
from svtoolkit.reference import decision_function, objective, solve_svdd

TOL_OBJ = 1e-9
TOL_F = 1e-8
TOL_F_NEARDUP = 1e-6
TOL_KKT = 1e-9


def reference_for(solver):
    K = rbf_kernel(solver.keys, sigma=solver.sigma)
    ref = solve_svdd(K, solver.C)
    if not ref.polished:
        ref = solve_svdd(K, solver.C, solver="OSQP")
    assert ref.polished, ref.message
    return K, ref


def probes(solver, rng, extra=8):
    keys = solver.keys
    d = keys.shape[1]
    return np.vstack(
        [keys, keys + 0.05 * rng.standard_normal(keys.shape), rng.standard_normal((extra, d))]
    )


def compare_with_reference(solver, rng, tol_f=TOL_F):
    """Objective, value-based KKT and decision function against the polished QP reference."""
    K, ref = reference_for(solver)
    a = solver.alpha
    assert abs(objective(K, a) - ref.objective) <= TOL_OBJ * max(1.0, abs(ref.objective))
    assert naive.kkt_violation(K, solver.C, a, solver.rho) <= TOL_KKT
    P = probes(solver, rng)
    f_ref = decision_function(solver.keys, ref.alpha, ref.rho, P, sigma=solver.sigma)
    assert np.max(np.abs(solver.decision_function(P) - f_ref)) <= tol_f
    return ref


def state_arrays(solver):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v)
            for k, v in solver.state_dict().items()}


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key in before:
        if isinstance(before[key], np.ndarray):
            assert np.array_equal(before[key], after[key]), key
        else:
            assert before[key] == after[key], key


# ------------------------------------------------------------------------------- kernels
def test_rbf_kernel_matches_naive_double_loop():
    # exp amplifies the last-bit rounding of its argument by |argument|: 1e-12 relative covers
    # arguments down to about -30 (kernel values of 1e-13), far past anything that matters
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((9, 3)), rng.standard_normal((5, 3))
    np.testing.assert_allclose(rbf_kernel(X, Y, sigma=1.3), naive.rbf(X, Y, 1.3),
                               rtol=1e-12, atol=1e-300)
    K = rbf_kernel(X, sigma=0.7)
    np.testing.assert_allclose(K, naive.rbf(X, X, 0.7), rtol=1e-12, atol=1e-300)
    assert np.array_equal(K, K.T) and np.all(np.diag(K) == 1.0)


def test_vectorised_exp_within_one_ulp_of_numpy():
    from svtoolkit.kernels import exp_nonpositive_inplace

    x = -np.concatenate([np.linspace(0, 745, 200001), [0.0, 1e-300, 707.9, 708.0, 708.5, 1e4]])
    v = x.copy()
    exp_nonpositive_inplace(v, len(v))
    ref = np.exp(x)
    normal = ref > 3.4e-308
    assert np.all(np.abs(v[normal] - ref[normal]) <= np.spacing(ref[normal]))
    assert np.all(v[~normal] == 0.0) and v[0] == 1.0


def test_rbf_kernel_keeps_near_duplicates_distinct():
    x = np.array([[0.3, -0.2]])
    K = rbf_kernel(np.vstack([x, x + 1e-7]), sigma=1.0)
    assert K[0, 1] < 1.0


def test_rbf_kernel_rejects_bad_input():
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        rbf_kernel(np.zeros((2, 2)), sigma=0.0)
    with pytest.raises(ValueError, match="same number of features"):
        rbf_kernel(np.zeros((2, 2)), np.zeros((2, 3)), sigma=1.0)
    with pytest.raises(ValueError, match="X contains NaN"):
        rbf_kernel(np.array([[np.nan, 0.0]]), sigma=1.0)
    with pytest.raises(ValueError, match="X must be 2-D"):
        rbf_kernel(np.zeros(3), sigma=1.0)
    with pytest.raises(TypeError, match="X must be numeric"):
        rbf_kernel([["a", "b"]], sigma=1.0)


# ------------------------------------------------------------------------------- construction
@pytest.mark.parametrize(
    "args, exc, msg",
    [
        ((0.0, 1.0), ValueError, "C must be finite and > 0"),
        ((-1.0, 1.0), ValueError, "C must be finite and > 0"),
        ((np.nan, 1.0), ValueError, "C must be finite and > 0"),
        ((0.1, 0.0), ValueError, "sigma must be finite and > 0"),
        ((0.1, np.inf), ValueError, "sigma must be finite and > 0"),
        ((True, 1.0), TypeError, "C must be a real number"),
        (("0.1", 1.0), TypeError, "C must be a real number"),
    ],
)
def test_constructor_rejects_bad_hyperparameters(args, exc, msg):
    with pytest.raises(exc, match=msg):
        IncrementalSVDD(*args)


def test_from_nu_computes_C_once():
    s = IncrementalSVDD.from_nu(0.5, 45, 1.5)
    assert s.C == 1.0 / (0.5 * 45)
    s.extend(np.random.default_rng(0).standard_normal((60, 2)))
    assert s.C == 1.0 / (0.5 * 45)
    with pytest.raises(ValueError, match=r"nu must be in \(0, 1\]"):
        IncrementalSVDD.from_nu(1.5, 10, 1.0)
    with pytest.raises(ValueError, match="n0 must be >= 1; got 0"):
        IncrementalSVDD.from_nu(0.5, 0, 1.0)
    with pytest.raises(TypeError, match="n0 must be an int; got float"):
        IncrementalSVDD.from_nu(0.5, 10.0, 1.0)


# ------------------------------------------------------------------------------- streams
def test_stream_matches_reference_after_every_admission():
    rng = np.random.default_rng(45)
    X = rng.standard_normal((45, 4))
    s = IncrementalSVDD.from_nu(0.5, 45, 1.5)
    for i, x in enumerate(X):
        s.add(x)
        assert s.certified == ((i + 1) * s.C >= 1 - FEASIBILITY_TOL)
        if s.certified:
            ref = compare_with_reference(s, rng, tol_f=1e-12)
            assert set(s.margin_ids) == set(s.ids[ref.margin])
            assert set(s.error_ids) == set(s.ids[ref.error])


# (d, sigma, C, near-duplicate spacing or None): duplicates, near duplicates at 1e-7, d = 1,
# very small and very large sigma, C near 1/n, C >= 1.
REPLAYS = {
    "gaussian": (4, 1.5, 0.08, None),
    "d1": (1, 1.0, 0.1, None),
    "small_sigma": (2, 0.05, 0.1, None),
    "large_sigma": (2, 50.0, 0.1, None),
    "C_near_1_over_n": (4, 1.0, 1.0 / 19.5, None),
    "C_above_1": (3, 1.0, 1.5, None),
    "duplicates": (3, 1.0, 0.1, 0.0),
    "near_duplicates_1e-7": (3, 1.0, 0.1, 1e-7),
    "near_duplicates_1e-7_d1": (1, 1.0, 0.1, 1e-7),
}


def replay(name, seed, n_ops, *, check=True, n_range=(6, 26)):
    """Random add/remove sequence; compares with a fresh reference solve after every step."""
    d, sigma, C, spacing = REPLAYS[name]
    rng = np.random.default_rng(seed)
    s = IncrementalSVDD(C, sigma, audit_every=50)
    lo, hi = n_range
    near = spacing is not None and spacing > 0
    for _ in range(n_ops):
        n = len(s)
        if n < lo or (n < hi and rng.random() < 0.55):
            if spacing is not None and n and rng.random() < 0.3:
                x = s.keys[rng.integers(n)] + spacing * rng.standard_normal(d)
            else:
                x = rng.standard_normal(d)
            s.add(x)
        else:
            s.remove(s.ids[rng.integers(n)])
        a = s.alpha
        assert np.all(a >= 0.0) and np.all(a <= s.C)  # no coefficient ever leaves the box
        if check and s.certified:
            compare_with_reference(s, rng, tol_f=TOL_F_NEARDUP if near else TOL_F)
    return s


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_random_add_remove_replay_matches_reference_every_step(name):
    replay(name, seed=sorted(REPLAYS).index(name), n_ops=70)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REPLAYS))
@pytest.mark.parametrize("seed", range(10, 16))
def test_long_replays_match_reference(name, seed):
    replay(name, seed=seed, n_ops=250)


# ------------------------------------------------------------------------------- brute force
#: Acceptance tolerance of the enumeration (box and sign conditions of a partition). Its default,
#: 1e-10, accepted at n C = 1 (where a = C is the only feasible point) a partition 7e-11 outside
#: the box, whose f is 2.1e-10 from the optimum's (and whose rho is above the optimal interval).
#: The bordered solves of these 2..6 keys err by ~u cond(M) ~ 1e-15, so 1e-12 still accepts every
#: exact partition and the f tolerance below only has to cover that rounding.
TOL_ENUMERATION = 1e-12
#: Where C is above 1/n by less than about n TOL_ENUMERATION, every feasible coefficient lies
#: within TOL_ENUMERATION of a bound and the enumeration rejects every partition (n = 2, C = 1/2
#: + 6.8e-13: both keys at 1/2, within 6.8e-13 of C, while both at C sum to 1 + 1.4e-12), so C
#: keeps at least this far from 1/n when it is not 1/n itself. That pair, and deletions at n C
#: within a few ulps of 1, are checked on their own in test_exact_vertex.py.
MIN_C_FRAC = 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(n=3, seed=21, sigma=0.5, c_frac=0.0, dups=False)
@example(n=3, seed=331, sigma=0.5, c_frac=0.0, dups=False)
@example(n=5, seed=0, sigma=2.5, c_frac=0.05, dups=False)  # 4 keys at C: rho's midpoint
@given(
    st.integers(2, 6),
    st.integers(0, 10_000),
    st.sampled_from([0.5, 1.0, 2.5]),
    st.one_of(st.just(0.0), st.floats(MIN_C_FRAC, 1.0)),
    st.booleans(),
)
def test_tiny_problems_match_enumeration_of_all_partitions(n, seed, sigma, c_frac, dups):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, 2))
    if dups:
        X[-1] = X[0]
    C = 1.0 / n + c_frac * (1.2 - 1.0 / n)
    s = IncrementalSVDD(C, sigma)
    s.extend(X)
    K = naive.rbf(X, X, sigma)
    best = naive.enumerate_svdd(K, C, tol=TOL_ENUMERATION)
    assert best is not None
    obj, a_ref, rho_ref = best
    assert abs(naive.objective(K, s.alpha) - obj) <= 1e-12
    assert naive.kkt_violation(K, C, s.alpha, s.rho) <= 1e-12
    Q = np.vstack([X, rng.standard_normal((5, 2))])
    f_ref = naive.decision(X, a_ref, rho_ref, Q, sigma)
    assert np.max(np.abs(s.decision_function(Q) - f_ref)) <= 1e-10
    # removing any key leaves the optimum of the rest (or warm-up below feasibility)
    victim = int(rng.integers(n))
    s.remove(s.ids[victim])
    keep = np.delete(np.arange(n), victim)
    if (n - 1) * C >= 1 - 1e-12:
        best = naive.enumerate_svdd(K[np.ix_(keep, keep)], C, tol=TOL_ENUMERATION)
        assert abs(naive.objective(K[np.ix_(keep, keep)], s.alpha) - best[0]) <= 1e-12
    else:
        assert not s.certified


# ------------------------------------------------------------------------------- exactness
def test_decrement_equals_fresh_build_with_same_C():
    rng = np.random.default_rng(7)
    worst = 0.0
    for _trial in range(20):
        X = rng.standard_normal((50, 6))
        s = IncrementalSVDD.from_nu(0.5, 50, 2.5)
        ids = s.extend(X)
        victims = rng.choice(ids, size=2, replace=False)
        for v in victims:
            s.remove(v)
        fresh = IncrementalSVDD(s.C, s.sigma)
        fresh.extend(X[np.setdiff1d(np.arange(50), victims)])
        assert set(s.margin_ids) == set(s.ids[np.isin(fresh.ids, fresh.margin_ids)])
        P = np.vstack([X, X + 0.05 * rng.standard_normal(X.shape)])
        worst = max(worst, np.max(np.abs(s.decision_function(P) - fresh.decision_function(P))))
    assert worst <= 1e-12


def test_round_trip_restores_state():
    rng = np.random.default_rng(3)
    s = IncrementalSVDD.from_nu(0.5, 30, 1.5)
    s.extend(rng.standard_normal((30, 3)))
    ids0, alpha0, rho0 = s.ids, s.alpha, s.rho
    for _ in range(10):
        new = s.add(rng.standard_normal(3))
        s.remove(new)
        assert np.array_equal(s.ids, ids0)
        np.testing.assert_allclose(s.alpha, alpha0, rtol=0, atol=1e-12)
        assert abs(s.rho - rho0) <= 1e-12


def test_reserve_eviction_changes_nothing():
    rng = np.random.default_rng(11)
    s = IncrementalSVDD.from_nu(0.3, 80, 1.5)
    s.extend(rng.standard_normal((80, 3)))
    reserve = s.reserve_ids
    assert len(reserve) > 10
    support = ~np.isin(s.ids, reserve)
    alpha_support, rho = s.alpha[support], s.rho
    P = rng.standard_normal((100, 3))
    f0 = s.decision_function(P)
    evicted = s.evict_reserve()
    assert np.array_equal(evicted, reserve)
    assert len(s.reserve_ids) == 0 and s.certified
    np.testing.assert_array_equal(s.alpha, alpha_support)
    assert s.rho == rho
    assert np.max(np.abs(s.decision_function(P) - f0)) <= 1e-12
    assert s.kkt_residual() <= 1e-12


# ------------------------------------------------------------------------------- degenerate cases
def _empty_margin_problem():
    """Gaussian keys whose optimum has an empty margin set (1 / C = 8 is a whole number)."""
    for seed in range(100):
        X = np.random.default_rng(seed).standard_normal((16, 2))
        s = IncrementalSVDD(1.0 / 8.0, 2.0)
        s.extend(X)
        if len(s.margin_ids) == 0:
            return X, s
    raise AssertionError("no empty-margin example among 100 seeds")


def test_empty_margin_set_at_rest_reports_midpoint_rho():
    X, s = _empty_margin_problem()
    K = rbf_kernel(X, sigma=s.sigma)
    ref = solve_svdd(K, s.C)
    assert ref.polished and len(ref.margin) == 0
    assert abs(s.rho - ref.rho) <= 1e-12
    np.testing.assert_allclose(s.alpha, ref.alpha, atol=1e-15)


def test_decrement_and_increment_from_an_empty_margin_set():
    rng = np.random.default_rng(5)
    X, s = _empty_margin_problem()
    for victim in list(s.error_ids[:2]) + list(s.reserve_ids[:2]):
        t = s.copy()
        t.remove(victim)  # error victim: rho-only move down; reserve: direct removal
        if t.certified:
            compare_with_reference(t, rng, tol_f=1e-12)
    t = s.copy()
    t.add(rng.standard_normal(2))  # rho-only move up first
    compare_with_reference(t, rng, tol_f=1e-12)


def test_margin_set_empties_during_a_decrement():
    rng = np.random.default_rng(0)
    hits = 0
    for seed in range(60):
        X = np.random.default_rng(seed).standard_normal((14, 2))
        s = IncrementalSVDD(1.0 / 6.5, 3.0)
        s.extend(X)
        if len(s.margin_ids) == 1:
            s.remove(s.margin_ids[0])  # the only margin point leaves first: S is empty
            if s.certified:
                compare_with_reference(s, rng, tol_f=1e-12)
            hits += 1
    assert hits >= 3


def test_exact_duplicates_and_ties():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((12, 3))
    X = np.vstack([X, X[:4], X[:4]])  # every one of the first four keys three times
    s = IncrementalSVDD(0.1, 1.2)
    ids = s.extend(X[rng.permutation(len(X))])
    compare_with_reference(s, rng, tol_f=1e-10)
    for v in rng.choice(ids, 6, replace=False):
        s.remove(v)
        compare_with_reference(s, rng, tol_f=1e-10)


@pytest.mark.parametrize("spacing", [1e-9, 1e-7, 1e-5, 1e-3])
def test_near_duplicate_clusters_stay_exact(spacing):
    rng = np.random.default_rng(int(-np.log10(spacing)))
    centers = rng.standard_normal((5, 3))
    X = np.repeat(centers, 6, axis=0) + spacing * rng.standard_normal((30, 3))
    s = IncrementalSVDD(0.08, 1.0)
    ids = s.extend(X)
    compare_with_reference(s, rng, tol_f=TOL_F_NEARDUP)
    for v in rng.choice(ids, 8, replace=False):
        s.remove(v)
        compare_with_reference(s, rng, tol_f=TOL_F_NEARDUP)
    audit = s.audit()
    assert audit.inverse_residual <= 1e-8 and audit.grad_drift <= 1e-10


@pytest.mark.parametrize("jitter", [0.0, 1e-6, 1e-5, 1e-4])
def test_tight_clusters_never_fail_and_stay_near_optimal(jitter):
    """Twelve keys within `jitter` of one point: K is numerically rank-deficient in many
    directions. Keys dependent on S stay out of it; the KKT residual is bounded by the
    documented 4 C KAPPA_TOL (1e-8 here), and nothing is ever thrown out of the box."""
    worst = 0.0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        X = rng.standard_normal(6) + jitter * rng.standard_normal((12, 6))
        s = IncrementalSVDD(0.3, 2.0)
        ids = s.extend(X)
        worst = max(worst, s.kkt_residual())
        for v in ids[:6]:
            s.remove(v)
            worst = max(worst, s.kkt_residual())
            a = s.alpha
            assert np.all(a >= 0) and np.all(a <= s.C) and abs(a.sum() + s.warmup_mass - 1) < 1e-9
    assert worst <= 4 * 0.3 * W.KAPPA_TOL


def test_collinear_near_duplicates_do_not_cycle():
    s = IncrementalSVDD(C=0.3, sigma=2.0)
    s.extend([[0.0], [1e-6], [2e-6]])  # used to make the repairs trade twins forever
    assert s.kkt_residual() <= 1e-12
    s.add([3e-6])
    assert s.certified and s.kkt_residual() <= 1e-12


def test_warmup_and_fallback_below_feasibility():
    rng = np.random.default_rng(4)
    s = IncrementalSVDD(0.2, 1.0)  # feasible from 5 keys on
    ids = [s.add(x) for x in rng.standard_normal((4, 2))]
    assert not s.certified and s.warmup_mass > 0
    assert abs(s.alpha.sum() + s.warmup_mass - 1.0) <= 1e-14
    assert s.kkt_residual() <= 1e-12  # optimum of the anchored problem
    ids.append(s.add(rng.standard_normal(2)))
    assert s.certified and s.warmup_mass == 0.0
    s.remove(ids[0])  # deletion is never refused: back to warm-up
    assert not s.certified and len(s) == 4 and s.kkt_residual() <= 1e-12
    for i in ids[1:]:
        s.remove(i)
    assert len(s) == 0 and not s.certified
    s.add(rng.standard_normal(2))
    assert len(s) == 1


def test_C_at_least_one_single_key_takes_all_mass():
    s = IncrementalSVDD(1.0, 1.0)
    s.add([0.0, 1.0])
    assert s.certified and s.alpha[0] == 1.0


def test_n_times_C_exactly_one():
    rng = np.random.default_rng(9)
    s = IncrementalSVDD(0.25, 1.0)
    s.extend(rng.standard_normal((4, 2)))
    assert s.certified
    np.testing.assert_array_equal(s.alpha, np.full(4, 0.25))


def test_audit_detects_and_repairs_a_corrupted_inverse():
    rng = np.random.default_rng(8)
    s = IncrementalSVDD.from_nu(0.3, 60, 1.0)
    s.extend(rng.standard_normal((60, 3)))
    assert s.audit().refactorized is False
    m = s._m
    s._R[: m + 1, : m + 1] *= 1.0 + 1e-6  # simulated drift
    report = s.audit()
    assert report.refactorized and report.inverse_residual > 1e-8
    assert s.audit().inverse_residual <= 1e-12
    s.remove(s.margin_ids[0])
    compare_with_reference(s, rng)


def test_long_random_sequence_has_no_drift():
    rng = np.random.default_rng(21)
    s = IncrementalSVDD(0.02, 1.5, audit_every=0)
    s.extend(rng.standard_normal((80, 4)))
    for _ in range(1500):
        if rng.random() < 0.5 and len(s) > 60:
            s.remove(s.ids[rng.integers(len(s))])
        else:
            s.add(rng.standard_normal(4))
    report = s.audit()
    assert report.grad_drift <= 1e-12 and report.inverse_residual <= 1e-12
    assert report.refactorized is False


# ------------------------------------------------------------------------------- bad input
def _filled():
    s = IncrementalSVDD.from_nu(0.5, 20, 1.0)
    s.extend(np.random.default_rng(1).standard_normal((20, 3)))
    return s


@pytest.mark.parametrize(
    "bad, exc, msg",
    [
        ([np.nan, 0.0, 0.0], ValueError, "x contains NaN"),
        ([np.inf, 0.0, 0.0], ValueError, "x contains inf"),
        ([0.0, 0.0], ValueError, "x has dimension 2, expected 3"),
        ([[0.0, 0.0, 0.0]], ValueError, "x must be 1-D"),
        (["a", "b", "c"], TypeError, "x must be numeric"),
        (None, TypeError, "x must be numeric"),
    ],
)
def test_bad_keys_are_refused_and_change_nothing(bad, exc, msg):
    s = _filled()
    before = state_arrays(s)
    with pytest.raises(exc, match=msg):
        s.add(bad)
    assert_same_state(before, state_arrays(s))


def test_bad_batch_is_refused_as_a_whole():
    s = _filled()
    before = state_arrays(s)
    X = np.random.default_rng(0).standard_normal((5, 3))
    X[3, 1] = np.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        s.extend(X)
    assert_same_state(before, state_arrays(s))


@pytest.mark.parametrize(
    "bad_id, msg",
    [(999, "unknown id 999"), (-1, "unknown id -1"), ("3", "ids are integers"),
     (True, "ids are integers"), (2.0, "ids are integers")],
)
def test_bad_ids_are_refused_and_change_nothing(bad_id, msg):
    s = _filled()
    before = state_arrays(s)
    with pytest.raises(KeyError, match=msg):
        s.remove(bad_id)
    assert_same_state(before, state_arrays(s))


def test_removed_id_is_reported_as_removed():
    s = _filled()
    s.remove(4)
    before = state_arrays(s)
    with pytest.raises(KeyError, match="id 4 is not held by the solver: it was removed"):
        s.remove(4)
    assert_same_state(before, state_arrays(s))


def test_decision_function_validates_queries():
    s = _filled()
    with pytest.raises(ValueError, match="X has dimension 2, expected 3"):
        s.decision_function(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="needs at least one key"):
        IncrementalSVDD(0.1, 1.0).decision_function(np.zeros((1, 2)))


def assert_restored(before, solver):
    """The state after a refused operation is ``before`` (``state_arrays``) to the bit, but
    for the inverse, which the restore factorises afresh, and the smallest pivot since the
    last factorisation, reset with it: the inverse is the fresh inverse of the bordered
    matrix of the same margin set (checked to the bit against ``bordered_inverse``), and within
    the maintained inverse's own drift of what was held (its residual ``|M R - I|`` before,
    amplified by ``|R|`` - the first-order bound on the distance between the two)."""
    after = state_arrays(solver)
    for key in set(before) - {"R", "fs"}:
        same = (np.array_equal(before[key], after[key]) if isinstance(before[key], np.ndarray)
                else before[key] == after[key])
        assert same, key
    keep = np.arange(len(before["fs"])) != W._MIN_PIVOT
    assert np.array_equal(before["fs"][keep], after["fs"][keep])
    m = len(after["S"])
    if m:
        M = solver._bordered()
        np.testing.assert_array_equal(after["R"], bordered_inverse(M, np.empty_like(M)))
        residual = np.abs(M @ before["R"] - np.eye(m + 1)).max()
        norm_R = np.abs(before["R"]).sum(axis=1).max()
        bound = norm_R * (residual + (m + 1) * np.abs(M).max() * norm_R * 2.0**-52)
        assert np.abs(after["R"] - before["R"]).max() <= bound


def test_a_refused_admission_restores_the_state_held_before_it():
    rng = np.random.default_rng(12)
    s = IncrementalSVDD.from_nu(0.4, 40, 1.2)
    s.extend(rng.standard_normal((40, 3)))
    s.remove(int(s.margin_ids[0]))  # slots no longer in id order
    s.add(rng.standard_normal(3))
    before = state_arrays(s)
    s.max_events = 0  # force the next walk to give up
    with pytest.raises(SolverFailure, match=r"refused .* state it had before it \(40 keys"):
        s.add(rng.standard_normal(3) * 3.0)
    s.max_events = None
    assert_restored(before, s)
    assert s.kkt_residual() < 1e-12
    assert s.add(rng.standard_normal(3)) == 41  # the failed admission consumed no id


def test_a_refused_admission_in_warm_up_restores_the_anchor():
    rng = np.random.default_rng(13)
    s = IncrementalSVDD(0.2, 1.0)
    s.extend(rng.standard_normal((3, 2)))  # n C = 0.6: warm-up, the anchor holds the rest
    assert not s.certified
    before = state_arrays(s)
    s.max_events = 0
    with pytest.raises(SolverFailure, match="state it had before it"):
        s.extend(rng.standard_normal((4, 2)))  # would cross n C = 1 part-way
    s.max_events = None
    assert_restored(before, s)
    assert not s.certified and s.warmup_mass == pytest.approx(0.4, abs=1e-15)
    assert np.array_equal(s.extend(rng.standard_normal((2, 2))), [3, 4]) and s.certified


# ------------------------------------------------------------------------------- views and export
def test_views_are_aligned_and_partition_the_keys():
    s = _filled()
    s.remove(3)
    s.remove(10)
    assert list(s.ids) == sorted(s.ids) and len(s.ids) == len(s) == 18
    assert s.keys.shape == (18, 3) and s.alpha.shape == (18,)
    parts = np.concatenate([s.margin_ids, s.error_ids, s.reserve_ids])
    assert sorted(parts) == list(s.ids)
    a = dict(zip(s.ids, s.alpha, strict=True))
    assert all(0 < a[i] < s.C for i in s.margin_ids)
    assert all(a[i] == s.C for i in s.error_ids)
    assert all(a[i] == 0.0 for i in s.reserve_ids)
    f = dict(zip(s.ids, s.decision_function(s.keys), strict=True))
    assert all(abs(f[i]) < 1e-12 for i in s.margin_ids)
    assert all(f[i] <= 1e-12 for i in s.error_ids)
    assert all(f[i] >= -1e-12 for i in s.reserve_ids)
    assert "IncrementalSVDD(C=" in repr(s)


def test_cached_insertion_order_survives_every_kind_of_operation():
    rng = np.random.default_rng(31)
    s = IncrementalSVDD(0.2, 1.5)  # warm-up below 5 keys: the anchor comes and goes
    for step in range(300):
        if len(s) > 3 and rng.random() < 0.45:
            s.remove(int(s.ids[rng.integers(len(s))]))
        else:
            s.add(rng.standard_normal(3))
        if step % 25 == 0:
            s.evict_reserve()
        cached = s._order().copy()
        s._order_cache = None  # recompute from scratch and compare
        assert np.array_equal(cached, s._order())
        assert list(s.ids) == sorted(s.ids)


def test_blocked_fresh_gradients_equal_the_coordinatewise_loop(monkeypatch):
    from svtoolkit.exact import _consistency as consistency_module

    rng = np.random.default_rng(17)
    s = IncrementalSVDD.from_nu(0.3, 300, 9.0)
    s.extend(rng.standard_normal((300, 130)))
    exact = s._fresh_gradients()  # below the work threshold: the Numba loop
    monkeypatch.setattr(consistency_module, "BLAS_FRESH_WORK", 0)
    blocked = s._fresh_gradients()
    np.testing.assert_allclose(blocked, exact, rtol=0, atol=1e-13)
    assert s.kkt_residual() <= 1e-12


def test_margin_system_is_the_bordered_inverse():
    s = _filled()
    ms = s.margin_system()
    order = {i: k for k, i in enumerate(s.ids)}
    keys = s.keys
    S = [order[i] for i in ms.margin_ids]
    E = [order[i] for i in ms.error_ids]
    K = rbf_kernel(keys, sigma=s.sigma)
    m = len(S)
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[np.ix_(S, S)]
    np.testing.assert_allclose(ms.inverse @ M, np.eye(m + 1), atol=1e-12)
    rhs = np.concatenate(([1 - len(E) * s.C], 1.0 - 2.0 * s.C * K[np.ix_(S, E)].sum(1)))
    u = ms.inverse @ rhs
    assert abs(u[0] - ms.rho) <= 1e-12
    np.testing.assert_allclose(u[1:], ms.alpha_margin, atol=1e-12)
    with pytest.raises(RuntimeError, match="needs a certified solver"):
        IncrementalSVDD(0.1, 1.0).margin_system()


def test_state_dict_round_trip_is_bit_exact_and_validated():
    s = _filled()
    s.remove(5)
    t = IncrementalSVDD.from_state_dict(s.state_dict())
    assert np.array_equal(t.alpha, s.alpha) and t.rho == s.rho
    assert np.array_equal(t.ids, s.ids)
    x = np.random.default_rng(0).standard_normal(3)
    assert t.add(x) == s.add(x)
    assert np.array_equal(t.alpha, s.alpha) and t.rho == s.rho
    bad = s.state_dict()
    bad["format"] = 99
    with pytest.raises(ValueError, match="unknown solver state format 99"):
        IncrementalSVDD.from_state_dict(bad)
    bad = s.state_dict()
    bad["S"] = bad["S"][:-1]
    with pytest.raises(ValueError, match=r"state\['S'\] has shape"):
        IncrementalSVDD.from_state_dict(bad)
    bad = s.state_dict()
    bad["ids"] = bad["ids"].copy()
    bad["ids"][1] = bad["ids"][0]
    with pytest.raises(ValueError, match="duplicated"):
        IncrementalSVDD.from_state_dict(bad)


def _warm_state():
    """A warm-up state (anchor present) and a certified one, for the damage tests."""
    w = IncrementalSVDD(0.1, 1.0)
    w.extend(np.random.default_rng(3).standard_normal((4, 3)))
    assert not w.certified
    return w


def _damage(state, key, index, value):
    state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    if index is None:
        state[key] = value
    else:
        state[key] = state[key].astype(np.result_type(state[key], np.asarray(value)))
        state[key][index] = value
    return state


@pytest.mark.parametrize(
    "key, index, value, msg",
    [
        ("ist", W._ANCHOR, 10**6, "anchor or current slot is outside"),
        ("ist", W._CUR_C, 10**6, "anchor or current slot is outside"),
        ("ist", W._M, 10**6, "sizes are inconsistent"),
        ("status", 0, 7, "status codes must be"),
        ("alpha", 0, np.nan, r"state\['alpha'\] contains NaN or inf"),
        ("Xt", (0, 5), np.inf, r"state\['Xt'\] contains NaN or inf"),
        ("R", (0, 0), np.nan, r"state\['R'\] contains NaN or inf"),
        ("fs", 1, 0.123, "disagrees with C and sigma"),
        ("fs", 2, 9.0, "disagrees with C and sigma"),
        ("fs", 0, np.nan, "non-finite rho"),
        ("spos", 0, 3, "margin positions"),
        ("ids", 2, -5, "only the anchor slot holds -1"),
        ("ids", 2, 0.5, "must hold integers"),
        ("next_id", None, 10**30, "outside"),
        ("audit_every", None, 2.7, "must be an integer"),
        ("d", None, 0, "shape"),
        ("fs", W._PROBE_LIMIT, 1.0, "rest state's probe threshold 1.0, outside"),
        ("fs", W._REFRESH_LIMIT, 1.0, "in-walk refresh's probe threshold 1.0, outside"),
        ("fs", W._REFRESH_LIMIT, 0.0, "in-walk refresh's probe threshold 0.0, outside"),
        ("margin_capacity", None, 3, r"state\['margin_capacity'\] = 3 is outside"),
        ("ops_since_audit", None, -1, "outside"),
        ("max_events", None, 0, "outside"),
    ],
)
def test_from_state_dict_refuses_damaged_fields(key, index, value, msg):
    """Every field a kernel indexes with or divides by is checked before use."""
    state = _filled().state_dict()
    with pytest.raises(ValueError, match=msg):
        IncrementalSVDD.from_state_dict(_damage(state, key, index, value))


def test_from_state_dict_refuses_coefficients_off_their_partition():
    s = _filled()
    state = s.state_dict()
    for change, msg in [(lambda a: a * 2.0, "sum"), (lambda a: a[::-1].copy(), "partition")]:
        with pytest.raises(ValueError, match=msg):
            IncrementalSVDD.from_state_dict(_damage(state, "alpha", None, change(state["alpha"])))
    w = _warm_state().state_dict()  # the anchor is the only slot allowed id -1 and a > C
    assert IncrementalSVDD.from_state_dict(w).warmup_mass > 0
    with pytest.raises(ValueError, match="only the anchor slot holds -1"):
        IncrementalSVDD.from_state_dict(_damage(w, "ist", W._ANCHOR, -1))


@pytest.mark.parametrize("key, figure", [("grad", "grad_drift"), ("R", "inverse_residual"),
                                          ("KSt", "margin_rows_drift")])
def test_consistency_exposes_tampered_maintained_state(key, figure):
    """Structurally sound but wrong numbers load, and consistency() names them."""
    s = _filled()
    clean = s.consistency()
    assert clean.kkt_residual < 1e-12 and clean.margin_rows_drift == 0.0
    assert clean.grad_drift < 1e-12 and clean.inverse_residual < 1e-12
    state = s.state_dict()
    state[key] = state[key] + 0.01
    found = IncrementalSVDD.from_state_dict(state).consistency()
    assert getattr(found, figure) > 1e-3


def test_kkt_residual_reads_nan_as_infinite():
    """Python's max drops a NaN that does not come first; a broken state must not pass."""
    from svtoolkit.reference import kkt_residual

    s = _filled()
    s._alpha[3] = np.nan
    assert s.kkt_residual() == np.inf
    assert s.consistency().kkt_residual == np.inf
    K = rbf_kernel(np.eye(3), sigma=1.0)
    assert kkt_residual(K, 0.5, np.array([0.5, 0.5, np.nan]), 0.0) == np.inf
    with pytest.raises(ValueError, match="all three"):
        kkt_residual(K, 0.5, np.array([0.5, 0.5, 0.0]), 0.0, margin=[0])


@pytest.mark.parametrize("sigma", [1e-200, 1e-160, 1e154, 1e155])
def test_sigma_whose_square_leaves_the_float_range_is_refused(sigma):
    with pytest.raises(ValueError, match="sigma=.* is out of range"):
        IncrementalSVDD(1.0, sigma)
    with pytest.raises(ValueError, match="sigma=.* is out of range"):
        rbf_kernel(np.zeros((2, 2)), sigma=sigma)


def test_extend_is_all_or_nothing_when_a_walk_fails():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((80, 3))
    s = IncrementalSVDD(0.05, 1.0)
    s.extend(X[:25])
    before = state_arrays(s)
    s.max_events = 5  # a later row of the batch needs more
    with pytest.raises(SolverFailure, match="state it had before it \\(25 keys"):
        s.extend(X[25:80])
    s.max_events = None
    assert len(s) == 25 and np.array_equal(s.ids, np.arange(25))
    assert_restored(before, s)
    assert np.array_equal(s.extend(X[25:27]), [25, 26])


def test_failed_first_admission_fixes_no_dimension():
    s = IncrementalSVDD(0.5, 1.0)
    s.max_events = 0
    with pytest.raises(SolverFailure, match="more than 0 events"):
        s.add([1.0, 2.0, 3.0])
    s.max_events = None
    assert len(s) == 0 and s.n_features is None and s.state_dict()["d"] == -1
    assert s.add([1.0, 2.0]) == 0


@pytest.mark.parametrize("batch", [False, True])
def test_a_deletion_whose_every_fallback_fails_is_refused_with_nothing_lost(monkeypatch, batch):
    """The deletion's last resort: its decrement fails, the bulk build of the retained keys
    does not certify, and the key-by-key rebuild fails too. The deletion is then refused and
    the solver holds the state it had before, the victim included (before, the rebuilt prefix
    was kept and the other keys were dropped: a store holding records for them fell out of
    step with its solver)."""
    rng = np.random.default_rng(4)
    X = rng.standard_normal((30, 3))
    s = IncrementalSVDD.from_nu(0.3, 30, 1.0)
    s.extend(X)
    s.remove(int(s.reserve_ids[s.reserve_ids != 17][0]))  # slots no longer in id order
    victims = [int(i) for i in s.margin_ids if i != 17][:2]  # key 17 is rebuilt, and fails
    before = state_arrays(s)
    admit = IncrementalSVDD._add_checked

    def fail_on_key_17_while_rebuilding(self, x, new_id):
        if self._rebuilding and new_id == 17:
            raise SolverFailure("injected")
        return admit(self, x, new_id)

    def failing_decrement(self, slot, key_id):
        raise SolverFailure("more than 1 events in one walk (forced)")

    monkeypatch.setattr(IncrementalSVDD, "_add_checked", fail_on_key_17_while_rebuilding)
    monkeypatch.setattr(IncrementalSVDD, "_remove_slot", failing_decrement)
    monkeypatch.setattr(IncrementalSVDD, "_bulk_admit", lambda self, X, ids, min_keys=None: False)
    if batch:
        for name in ("BULK_BATCH_FRACTION", "BULK_BATCH_MARGIN_SHARE"):
            monkeypatch.setattr(solver_module, name, 0.0)  # take the batch's fresh-solve path
        monkeypatch.setattr(solver_module, "BULK_MIN_KEYS", 1)
    caller = "remove_many" if batch else "remove"
    with pytest.raises(SolverFailure, match=rf"; {caller}: .* deletion was refused .* before it"):
        s.remove_many(victims) if batch else s.remove(victims[0])
    monkeypatch.undo()
    assert_restored(before, s)
    assert s.kkt_residual() < 1e-12
    s.remove_many(victims)  # the same deletion goes through once the walks can finish
    assert not set(victims) & set(s.ids.tolist()) and s.add(X[0]) == 30


def test_from_nu_names_nu_when_C_would_overflow():
    with pytest.raises(ValueError, match=r"nu \* n0 = .* is too small"):
        IncrementalSVDD.from_nu(1e-320, 1, 1.0)


def test_copy_keeps_settings():
    s = _filled()
    s.max_events = 77
    twin = s.copy()
    assert twin.max_events == 77 and twin.audit_every == s.audit_every


def test_internal_tolerances_are_ordered():
    # a dependent point must be excluded before its sensitivity could be trusted, and every
    # operation that pivots near the exclusion threshold must end with a polish
    assert W.SENS_TOL < W.KAPPA_TOL < W.POLISH_PIVOT
    assert W.CORRECT_SKIP < W.REPAIR_MIN_TOL < W.CONSISTENCY_TOL


# --- regressions: exactness defects found by an outside audit ---------------------------------


def _kkt_terms(s):
    """(margin |f|, worst sign violation on E and R, 2 |sum(a) - 1|) from fresh gradients."""
    g = s._fresh_gradients()
    st, a = s._status[: s._n], s._alpha[: s._n]
    margin = np.max(np.abs(g[st == W.MARGIN]), initial=0.0)
    sign = max(np.max(np.maximum(g[st == W.ERROR], 0.0), initial=0.0),
               np.max(np.maximum(-g[st == W.RESERVE], 0.0), initial=0.0))
    return margin, sign, 2.0 * abs(a.sum() - 1.0)


@pytest.mark.parametrize("C", [0.3, 0.15])
@pytest.mark.parametrize("jitter", [3e-5, 1e-4])
def test_tight_clusters_margin_at_rounding_and_sign_within_dependence_bound(jitter, C):
    """Twelve keys within 3e-5..1e-4 sigma: the margin gradients are at rounding level (the walk
    runs on the shifted kernel k - 1, which keeps these keys' distances to full relative
    precision; with k itself they carried ~eps / kappa = 1e-8), the only larger term is the sign
    violation of keys kept out of S as dependent, bounded by REPAIR_FACTOR C KAPPA_TOL by
    construction, and no operation fails (before: residuals up to 4.7e-8 and walks that lost
    1e-8 of sum(a) per step until the state left its box)."""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        X = rng.standard_normal(6) + jitter * rng.standard_normal((12, 6))
        s = IncrementalSVDD(C, 2.0)
        ids = s.extend(X)
        for v in [None, *ids[:6]]:
            if v is not None:
                s.remove(v)
            margin, sign, total = _kkt_terms(s)
            assert margin <= 1e-14 and total <= 1e-14, (seed, margin, total)
            assert sign <= W.REPAIR_FACTOR * C * W.KAPPA_TOL, (seed, sign)


def test_translated_wide_keys_keep_their_exactness_and_audit_changes_nothing():
    """d = 128, n |support| d above the matrix-product threshold: the same problem translated
    by 1e4 gave kkt_residual 9e-9 (cancellation in |x|^2 + |y|^2 - 2 x.y) and audit() then
    'repaired' the exact state into a wrong one."""
    rng = np.random.default_rng(21)
    Z = rng.standard_normal((800, 128))
    a = IncrementalSVDD(1 / 320, 16.0)
    a.extend(Z)
    b = IncrementalSVDD(1 / 320, 16.0)
    b.extend(Z + 1e4)
    assert b.kkt_residual() <= 1e-12
    before = b.decision_function(Z[:40] + 1e4)
    report = b.audit()
    assert not report.refactorized and report.kkt_residual <= 1e-12
    np.testing.assert_array_equal(b.decision_function(Z[:40] + 1e4), before)
    np.testing.assert_allclose(before, a.decision_function(Z[:40]), rtol=0, atol=1e-11)


@pytest.mark.parametrize("scale", [1e154, 1e300])
def test_huge_finite_keys_are_handled_exactly(scale):
    """Keys x 1e300 at d = 128 used to leave NaN coefficients after the automatic audit; every
    pairwise kernel value is 0 there, so the optimum is a = 1/n-or-C on every key."""
    rng = np.random.default_rng(22)
    Z = rng.standard_normal((800, 128)) * scale
    s = IncrementalSVDD(1 / 320, 16.0)
    ids = s.extend(Z)
    report = s.audit()
    assert np.isfinite(s.alpha).all() and np.isfinite(s.rho) and report.kkt_residual <= 1e-12
    s.remove(ids[5])
    s.add(Z[5] * 1.5)
    assert s.kkt_residual() <= 1e-12 and np.isfinite(s.decision_function(Z[:3])).all()


def test_shortfall_below_one_is_warm_up_not_a_snap():
    """n C = 1 - 1e-13 is a real shortfall, not rounding: the optimum of 21 keys carries 1e-13
    on a margin key whose f = 0 fixes rho. Treating 20 keys as feasible snapped it away (f off
    by 2.6e-2 against the same keys built by another route)."""
    C = (1 - 1e-13) / 20
    X = np.random.default_rng(103).standard_normal((25, 6))
    a = IncrementalSVDD(C, 2.5)
    a.extend(X[:20])
    assert not a.certified  # 20 C < 1 - FEASIBILITY_TOL: warm-up
    a.add(X[20])
    b = IncrementalSVDD(C, 2.5)
    ids = b.extend(X)
    for i in ids[21:]:
        b.remove(int(i))
    Q = np.random.default_rng(1).standard_normal((50, 6))
    np.testing.assert_allclose(a.decision_function(Q), b.decision_function(Q), rtol=0,
                               atol=1e-12)
    assert len(a.margin_ids) == 1 and a.kkt_residual() <= 1e-13


def test_exactly_feasible_by_rounding_still_certifies():
    """C = 1/49: 49 C rounds to 1 - 1.1e-16, within FEASIBILITY_TOL, so 49 keys certify."""
    s = IncrementalSVDD(1 / 49, 1.0)
    s.extend(np.random.default_rng(4).standard_normal((49, 3)))
    assert 49 * s.C < 1.0 and s.certified and s.kkt_residual() <= 1e-12


def test_format_1_states_load_into_the_shifted_kernel():
    """States written before the shifted kernel (format 1: KSt = K, R = M^{-1}, fs[0] = rho)
    convert on load and continue exactly."""
    from svtoolkit.exact._state import unshifted_inverse

    rng = np.random.default_rng(23)
    s = IncrementalSVDD(0.1, 1.3)
    ids = s.extend(rng.standard_normal((40, 4)))
    state = s.state_dict()
    m = len(state["S"])
    old = dict(state, format=1, KSt=state["KSt"] + 1.0, R=unshifted_inverse(state["R"]),
               fs=state["fs"][:4] - np.array([1.0, 0.0, 0.0, 0.0]))
    t = IncrementalSVDD.from_state_dict(old)
    assert m > 0 and t.consistency().inverse_residual <= 1e-10
    Q = rng.standard_normal((20, 4))
    np.testing.assert_allclose(t.decision_function(Q), s.decision_function(Q), atol=1e-13)
    for solver in (s, t):
        solver.remove(ids[3])
    np.testing.assert_allclose(t.decision_function(Q), s.decision_function(Q), atol=1e-12)
    assert t.rho == pytest.approx(s.rho, abs=1e-13)


def test_margin_system_reports_the_unshifted_inverse():
    """margin_system().inverse is M^{-1} of M = [[0, 1^T], [1, 2 K_SS]] (the exact backward
    reads it), although the walk keeps the shifted kernel's inverse."""
    rng = np.random.default_rng(24)
    s = IncrementalSVDD(0.1, 1.3)
    X = rng.standard_normal((40, 4))
    ids = s.extend(X)
    system = s.margin_system()
    m = len(system.margin_ids)
    rows = [int(np.flatnonzero(ids == i)[0]) for i in system.margin_ids]
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * rbf_kernel(X[rows], sigma=1.3)
    np.testing.assert_allclose(system.inverse @ M, np.eye(m + 1), atol=1e-9)


def test_deleted_newest_key_leaves_no_copy_in_the_buffers():
    """Removing the newest key used to leave it in the key buffer beyond n."""
    rng = np.random.default_rng(25)
    s = IncrementalSVDD(0.2, 1.0)
    ids = s.extend(rng.standard_normal((10, 3)))
    secret = np.array([123.25, -7.5, 42.0])
    new_id = s.add(secret)
    s.remove(new_id)
    assert not np.isclose(s._Xt, secret[:, None]).all(axis=0).any()
    s.remove(ids[0])
    assert not (s._Xt[:, s._n:] != 0.0).any()


# --- bulk build (extend into an empty solver) -------------------------------------------------


def _walked(C, sigma, X, monkeypatch):
    """The same keys admitted by the walk one at a time (the bulk path switched off)."""
    import svtoolkit.exact.solver as solver_module

    with monkeypatch.context() as patch:
        patch.setattr(solver_module, "BULK_MIN_KEYS", 10**9)
        s = IncrementalSVDD(C, sigma)
        s.extend(X)
    assert s.n_bulk_builds == 0
    return s


BULK_REGIMES = [  # (n, d, nu, sigma): small, medium and near-total margin sets, n C = 1
    (200, 6, 0.3, 1.5), (300, 4, 0.5, 0.3), (150, 3, 0.1, 3.0), (120, 5, 1.0, 1.0),
]


@pytest.mark.parametrize("n,d,nu,sigma", BULK_REGIMES)
def test_bulk_build_lands_on_the_walks_state(n, d, nu, sigma, monkeypatch):
    """SMO + exact landing reaches the partition and coefficients the walk reaches (unique
    optimum), to rounding, and the state continues exactly."""
    X = np.random.default_rng(n + d).standard_normal((n, d))
    C = 1.0 / (nu * n)
    walked = _walked(C, sigma, X, monkeypatch)
    bulk = IncrementalSVDD(C, sigma)
    ids = bulk.extend(X)
    assert bulk.n_bulk_builds == 1 and bulk.certified
    np.testing.assert_array_equal(ids, np.arange(n))
    for name in ("margin_ids", "error_ids", "reserve_ids"):
        np.testing.assert_array_equal(getattr(bulk, name), getattr(walked, name))
    np.testing.assert_allclose(bulk.alpha, walked.alpha, rtol=0, atol=1e-12)
    assert bulk.rho == pytest.approx(walked.rho, abs=1e-12) and bulk.kkt_residual() <= 1e-13
    assert bulk.consistency().grad_drift <= 1e-12
    for s in (bulk, walked):
        s.remove(int(ids[1]))
        s.add(X[1] + 0.25)
    np.testing.assert_allclose(bulk.alpha, walked.alpha, rtol=0, atol=1e-12)


def test_a_bulk_landing_sizes_the_margin_buffers_to_its_margin_set():
    """Every key on the margin (a narrow kernel): the landing holds margin rows and an inverse
    for that margin set, not for the next power of two (at 2,048 keys a doubled capacity held
    134 MB of inverse where 34 MB are used); the walk's joins after it still grow them."""
    n = 300
    X = np.random.default_rng(3).standard_normal((n, 6))
    s = IncrementalSVDD(1.0 / (0.4 * n), 0.05)
    s.extend(X)
    m = len(s.margin_ids)
    assert s.n_bulk_builds == 1 and m == n
    assert s._S.shape[0] == m + 2 and s._R.shape == (m + 3, m + 3)
    for x in np.random.default_rng(4).standard_normal((3, 6)):  # each joins the margin set
        s.add(x)
    assert len(s.margin_ids) == n + 3 and s._S.shape[0] >= n + 4
    assert s.certified and s.kkt_residual() <= 1e-13


def test_bulk_build_of_near_duplicates_matches_the_decision_function(monkeypatch):
    """Clusters of near duplicates (1e-7 apart): keys dependent on the margin set stay at a
    bound, as in the walk; the optimum is flat along the twins' split, so f is compared."""
    rng = np.random.default_rng(31)
    centers = rng.standard_normal((12, 3))
    X = np.repeat(centers, 8, axis=0) + 1e-7 * rng.standard_normal((96, 3))
    walked = _walked(0.03, 1.0, X, monkeypatch)
    bulk = IncrementalSVDD(0.03, 1.0)
    bulk.extend(X)
    assert bulk.n_bulk_builds == 1 and bulk.kkt_residual() <= 1e-10
    Q = rng.standard_normal((50, 3))
    np.testing.assert_allclose(bulk.decision_function(Q), walked.decision_function(Q),
                               rtol=0, atol=TOL_F_NEARDUP)


def test_bulk_build_falls_back_to_the_walk(monkeypatch):
    """A landing that is not accepted leaves nothing behind: the walk builds the same state."""
    import svtoolkit.exact.solver as solver_module

    X = np.random.default_rng(32).standard_normal((100, 4))
    reference = _walked(0.02, 1.2, X, monkeypatch)
    monkeypatch.setattr(solver_module, "BULK_KKT_TOL", -1.0)
    # the replay alone: at BULK_KKT_TOL = -1 a replay that polished would go on to the
    # active set of IncrementalSVDD._settle_degenerate too
    monkeypatch.setattr(IncrementalSVDD, "_settle_degenerate", lambda self, marks: None)
    s = IncrementalSVDD(0.02, 1.2)
    with pytest.warns(BulkFallbackWarning):
        np.testing.assert_array_equal(s.extend(X), np.arange(100))
    assert s.n_bulk_builds == 0
    np.testing.assert_array_equal(s.alpha, reference.alpha)
    assert s.rho == reference.rho


def test_bulk_path_is_not_taken_in_warm_up_or_for_cheap_walks_into_a_filled_solver():
    X = np.random.default_rng(33).standard_normal((100, 3))
    s = IncrementalSVDD(0.001, 1.0)  # 100 C < 1: warm-up, walked
    s.extend(X)
    assert s.n_bulk_builds == 0 and not s.certified
    t = IncrementalSVDD(0.05, 3.0)
    t.extend(X[:80])
    events = t.n_events
    assert len(t.margin_ids) < solver_module.BULK_BATCH_MARGIN_SHARE * 80
    t.extend(X[80:])  # not empty, and a small margin set: walked
    assert t.n_bulk_builds == 1 and t.n_events > events
    assert t.kkt_residual() <= 1e-13


def test_audit_and_consistency_are_frozen_results():
    import dataclasses

    from svtoolkit.exact import Audit, Consistency

    s = IncrementalSVDD(0.2, 1.0)
    s.extend(np.random.default_rng(41).standard_normal((20, 3)))
    found, report = s.consistency(), s.audit()
    assert isinstance(found, Consistency) and isinstance(report, Audit)
    assert found.kkt_residual <= 1e-13
    assert dataclasses.asdict(report).keys() == {"grad_drift", "inverse_residual",
                                                 "kkt_residual", "refactorized", "rho_offset"}
    assert report.refactorized is False
    with pytest.raises(AttributeError, match="cannot assign"):
        found.kkt_residual = 0.0


def test_the_reference_names_its_solvers():
    K = rbf_kernel(np.random.default_rng(0).standard_normal((6, 2)), sigma=1.0)
    with pytest.raises(ValueError, match="solver must be one of 'CLARABEL', 'OSQP'; got 'ECOS'"):
        solve_svdd(K, 0.5, solver="ecos")
