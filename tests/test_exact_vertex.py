"""Deletions that leave n C = 1: the feasible set is one point and the solver lands on it.

With n keys and ``n C = 1`` the only coefficients with ``sum(a) = 1`` and ``a <= C`` are
``a = C`` for every key (S empty); rho is then optimal anywhere up to ``min_i h_i``,
``h_i = k(x_i, x_i) - 2 (K a)_i``, and the solver reports that upper end (no key has a = 0,
so the interval has no lower end), as a fresh solve of the same keys does. ``n C`` within
FEASIBILITY_TOL of 1 from either side counts as this vertex. Every deletion here used to be
refused by the walk ("no admissible event") on some of these keys; none may be.

Every state is compared with a fresh solve of the keys it holds, to :func:`agreement_bound`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from svtoolkit import IncrementalSVDD
from svtoolkit._rules import FEASIBILITY_TOL

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `verification` lives in the repository, not in the package
    sys.path.insert(0, str(ROOT))

from verification.check_chains import agreement_bound  # noqa: E402, F401 - the tests' bound

EPS = np.finfo(np.float64).eps


def assert_equals_fresh(solver, probes):
    """alpha (summed over identical keys: the split between exact twins is free), rho and the
    decision function of ``solver`` against a fresh solve of the keys it holds."""
    fresh = IncrementalSVDD(solver.C, solver.sigma)
    fresh.extend(solver.keys)
    assert solver.certified == fresh.certified
    tol = max(agreement_bound(solver), agreement_bound(fresh))
    _, group = np.unique(solver.keys, axis=0, return_inverse=True)
    group = group.ravel()
    np.testing.assert_allclose(np.bincount(group, solver.alpha), np.bincount(group, fresh.alpha),
                               rtol=0, atol=tol)
    if solver.certified:
        assert abs(solver.rho - fresh.rho) <= tol
    np.testing.assert_allclose(solver.decision_function(probes), fresh.decision_function(probes),
                               rtol=0, atol=tol)


def assert_on_vertex(solver):
    """Every coefficient exactly C, S empty, and rho at the upper end of its interval: the
    largest f over the keys is 0 (to the rounding of f's sums, 2 n eps)."""
    assert solver.certified and len(solver.margin_ids) == 0
    np.testing.assert_array_equal(solver.alpha, np.full(len(solver), solver.C))
    f = solver.decision_function(solver.keys)
    assert abs(f.max()) <= 4.0 * EPS * len(solver)


def C_ulps_from_one_54th(j):
    """1/54 moved by j ulps of itself; 54 C is then 1 + ~0.85 j ulps of 1 (j = -5 ... 5 within
    FEASIBILITY_TOL of 1, j = -6 just below it, j = 6 just above)."""
    C = 1.0 / 54
    for _ in range(abs(j)):
        C = np.nextafter(C, 1.0 if j > 0 else 0.0)
    return C


def test_deleting_any_key_with_mass_down_to_n_C_one_lands_on_the_vertex():
    """55 Gaussian keys in d = 6, sigma = 3, C = 1/54: delete each margin or error key."""
    X = np.random.default_rng(4).standard_normal((55, 6))
    probes = np.vstack([X[:10] + 0.1, np.random.default_rng(5).standard_normal((10, 6))])
    base = IncrementalSVDD(1 / 54, 3.0)
    base.extend(X)
    victims = base.ids[base.alpha > 0.0]
    assert len(base.margin_ids) > 0 and len(victims) == 55
    for victim in victims:
        s = base.copy()
        s.remove(victim)
        assert len(s) == 54 and victim not in s.ids
        assert_on_vertex(s)
        assert_equals_fresh(s, probes)
    # the vertex itself: deleting a further key goes to warm-up, and adding it back certifies
    s.remove(s.ids[0])
    assert not s.certified and len(s) == 53
    s.add(X[0])
    assert_on_vertex(s)


@pytest.mark.parametrize("j", [-14, -6, -5, -3, -1, 0, 1, 2, 5, 6, 9, 14])
def test_deletions_within_a_few_ulps_of_n_C_one(j):
    """54 C = 1 + ~0.85 j ulps. Within FEASIBILITY_TOL the 54 keys have one feasible point;
    below it they are in warm-up; above it a walk ends within BOUND_SNAP C of the vertex and
    the rest state snaps there."""
    C = C_ulps_from_one_54th(j)
    assert (abs(54 * C - 1.0) <= FEASIBILITY_TOL) == (-5 <= j <= 5)
    rng = np.random.default_rng(100 + j)
    X = rng.standard_normal((55, 6))
    probes = rng.standard_normal((12, 6))
    base = IncrementalSVDD(C, 3.0)
    base.extend(X)
    for victim in [*base.margin_ids[:3], *base.error_ids[:3]]:
        s = base.copy()
        s.remove(victim)
        assert s.certified == (54 * C >= 1.0 - FEASIBILITY_TOL)
        if s.certified:
            assert_on_vertex(s)
        assert_equals_fresh(s, probes)


@pytest.mark.parametrize("seed", range(6))
def test_crossing_the_warm_up_boundary_both_ways(seed):
    """C = 1/54 with 55 keys: two deletions, two admissions, repeated, so n C crosses 1
    downwards (a deletion re-admits the anchor) and upwards (an admission drops it), landing
    on n C = 1 exactly on the way each time."""
    rng = np.random.default_rng(seed)
    s = IncrementalSVDD(1 / 54, 2.0)
    s.extend(rng.standard_normal((55, 5)))
    probes = rng.standard_normal((10, 5))
    sizes = []
    for step in range(16):
        if step % 4 < 2:
            s.remove(s.ids[rng.integers(len(s))])
        else:
            s.add(rng.standard_normal(5))
        sizes.append(len(s))
        assert s.certified == (len(s) >= 54)
        if len(s) == 54:
            assert_on_vertex(s)
        assert_equals_fresh(s, probes)
    assert 53 in sizes and 54 in sizes and 55 in sizes


@pytest.mark.parametrize("jitter", [0.0, 1e-9])
def test_keys_with_duplicates_deleted_down_to_n_C_one(jitter):
    """30 keys and 25 twins of them (exact, or 1e-9 apart), C = 1/54: deleting any key with
    mass lands on the vertex; then a chain of deletions of 70 such keys down to 53."""
    rng = np.random.default_rng(600)
    B0 = rng.standard_normal((30, 6))
    X = np.vstack([B0, B0[:25] + jitter * rng.standard_normal((25, 6))])
    probes = np.vstack([B0[:5] + 0.05, rng.standard_normal((5, 6))])
    base = IncrementalSVDD(1 / 54, 3.0)
    base.extend(X)
    for victim in base.ids[base.alpha > 0.0]:
        s = base.copy()
        s.remove(victim)
        assert_on_vertex(s)
        assert_equals_fresh(s, probes)
    B1 = rng.standard_normal((40, 6))
    s = IncrementalSVDD(1 / 54, 3.0)
    s.extend(np.vstack([B1, B1[:30] + jitter * rng.standard_normal((30, 6))]))
    while len(s) > 53:
        s.remove(s.ids[rng.integers(len(s))])
        assert s.certified == (len(s) >= 54)
        assert_equals_fresh(s, probes)
    s.add(B1[0])
    assert_on_vertex(s)


def test_a_pair_just_above_the_vertex_keeps_its_margin_keys():
    """Two keys with 2 C - 1 = 6e-13 (above FEASIBILITY_TOL, so not the vertex): the optimum
    splits the mass equally, a = (1/2, 1/2), both margin keys 3e-13 below C. Each lies within
    BOUND_SNAP C of C, so the snap puts both at C - a state with sum(a) = 2 C, off the
    equality constraint by 6e-13, and a KKT residual of 1.2e-12 against the enumeration. A
    snap must not move mass the correction walk cannot put back (here no margin key is left
    to take it)."""
    X = np.random.default_rng(109).standard_normal((2, 2))
    s = IncrementalSVDD(0.5 + 3e-13, 2.5)
    s.extend(X)
    assert abs(s.alpha.sum() - 1.0) <= 4 * EPS
    np.testing.assert_allclose(s.alpha, [0.5, 0.5], rtol=0, atol=4 * EPS)


def test_the_reference_canonical_form_keeps_the_pair_too():
    """The reference's canonical form snaps by the solver's rule: given the pair's optimum as
    two margin keys, it keeps them (each is within BOUND_SNAP C of C, the two together are
    not); a single margin key that close is snapped."""
    from svtoolkit.kernels import rbf_kernel
    from svtoolkit.reference import _canonical

    X = np.random.default_rng(109).standard_normal((3, 2))
    C = 0.5 + 3e-13
    K = rbf_kernel(X[:2], sigma=2.5)
    none = np.array([], dtype=int)
    alpha, _, (margin, error, _) = _canonical(K, C, np.array([0.5, 0.5]), 0.0,
                                              (np.array([0, 1]), none, none))
    np.testing.assert_array_equal(alpha, [0.5, 0.5])
    assert list(margin) == [0, 1] and len(error) == 0
    C3 = 0.4  # one key 3e-13 below C (within BOUND_SNAP C = 4e-13), a free margin key
    alpha, _, (margin, error, _) = _canonical(rbf_kernel(X, sigma=2.5), C3,
                                              np.array([C3, C3 - 3e-13, 0.2 + 3e-13]), 0.0,
                                              (np.array([1, 2]), np.array([0]), none))
    assert alpha[1] == C3 and list(error) == [0, 1] and list(margin) == [2]
