"""Many exact twins of a few keys under a wide kernel: no operation is refused or left half done.

Twelve points of a ring (the unit circle in the plane of R^3), each held up to 19 times, with
sigma = 3 x the median distance: the kernel matrix of the twelve distinct points is nearly
singular, and the bordered matrix of a margin set holding two twins is exactly singular (equal
rows). Randomised chains of operations there met three failures: a refactorisation inside a
walk raised ``LinAlgError`` from the compiled kernel and left the state half walked (every
later state off the optimum, KKT 2e-4); the bulk build's active-set fallback shared a twin
group's mass among its members and refused its own singular margin matrix; and the key-by-key
walk that follows cycled past its event limit, so the build was refused. Every state here is
checked from the keys (its KKT residual evaluated afresh, at the exact certificate) and against
a fresh solve of the keys it holds. (The reference's interior point is no judge here: it
keeps every twin strictly inside the box, so its margin system is singular.)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from test_exact_vertex import agreement_bound, assert_equals_fresh

import svtoolkit.exact._driver as driver_module
from svtoolkit import IncrementalSVDD
from svtoolkit.exact._active_set import merge_twins
from svtoolkit.exact.solver import BULK_KKT_TOL

DATA = Path(__file__).parent / "data"
RING = np.stack([np.cos(2 * np.pi * np.arange(12) / 12),
                 np.sin(2 * np.pi * np.arange(12) / 12), np.zeros(12)], axis=1)
#: The ring point of each key of a build the walk refused (157 keys, in admission order).
BUILD_ORDER = ("852a1bb820950936749150704892733b6434953313391858596a0147682bbb56bb39369581288765"
               "b0664b2a27959525ab612b447151952a569b2931078aab302935b6037585a15194a8b61a82882")
SIGMA = 4.242640687119286  # 3 x the median distance of the chain's keys (3 sqrt 2)
C = 1.0 / 60  # nu = 0.3, n0 = 200


PROBES = np.vstack([0.5 * RING, 1.5 * RING, RING + [0.0, 0.0, 0.5]])


def assert_exact(solver):
    """At the exact certificate when evaluated from the keys, and equal to a fresh solve of
    the keys it holds (:func:`test_exact_vertex.assert_equals_fresh`)."""
    assert solver.kkt_residual() <= BULK_KKT_TOL
    assert_equals_fresh(solver, np.vstack([solver.keys, PROBES]))


def load_chain_state():
    """The state a chain of operations had reached (190 keys, S empty, 60 keys at C) and
    the batch whose deletion raised ``LinAlgError`` from inside the walk."""
    with np.load(DATA / "ring_twins_state.npz") as z:
        state = {k: (z[k].item() if z[k].ndim == 0 else z[k]) for k in z.files}
    victims = state.pop("victims").tolist()
    state["max_events"] = None
    return state, victims


def test_the_chain_state_is_the_ring():
    state, _ = load_chain_state()
    keys = state["Xt"].T
    assert len(np.unique(keys, axis=0)) == 12
    assert all(np.any(np.all(RING == k, axis=1)) for k in keys)


def test_a_singular_margin_matrix_inside_a_walk_is_a_failure_with_its_fallback():
    """The deletion of 24 keys, one decrement at a time: the 18th used to raise
    ``LinAlgError`` out of the compiled rest state with the state half walked. A walk that
    meets a singular margin matrix is now a SolverFailure like any other, and the deletion's
    fallback (a fresh solve of the retained keys) completes it."""
    state, victims = load_chain_state()
    s = IncrementalSVDD.from_state_dict(state)
    s.remove_many(victims)
    assert len(s) == 190 - len(victims)
    assert not set(victims) & set(s.ids.tolist())
    assert_exact(s)


def test_a_build_of_many_twins_is_not_refused():
    """157 keys on 12 ring points: the bulk landing is not accepted, the active-set fallback
    used to refuse its own twin-sharing result as singular, and the key-by-key walk then ran
    past its event limit (SolverFailure: the build refused)."""
    X = RING[[int(c, 16) for c in BUILD_ORDER]]
    s = IncrementalSVDD(C, SIGMA)
    s.extend(X)
    assert len(s) == len(X)
    assert s.kkt_residual() <= BULK_KKT_TOL
    # the same keys in the reverse order take the plain bulk landing: the same optimum
    other = IncrementalSVDD(C, SIGMA)
    other.extend(X[::-1])
    tol = max(agreement_bound(s), agreement_bound(other))
    f, f_other = s.decision_function(PROBES), other.decision_function(PROBES)
    np.testing.assert_allclose(f, f_other, rtol=0, atol=tol)
    np.testing.assert_allclose(s.decision_function(X), other.decision_function(X), rtol=0,
                               atol=tol)


def test_a_singular_polish_is_a_failure_with_its_fallback(monkeypatch):
    """A refactorisation in Python (the polish a deletion's rest state asks for) that finds
    the margin matrix singular: a SolverFailure, so the deletion takes its fallback, not a
    raw ``LinAlgError`` with the key half deleted."""
    X = np.random.default_rng(0).standard_normal((60, 3))
    s = IncrementalSVDD(1.0 / 30, 1.5)
    s.extend(X)
    victim = int(s.margin_ids[0])
    s._fs[driver_module.W._PROBE_LIMIT] = 0.0  # the rest state's probe fails: it polishes
    inverse, calls = driver_module.bordered_inverse, []

    def singular_once(M, R):
        if not calls:
            calls.append(M.shape)
            raise np.linalg.LinAlgError("Singular matrix")
        return inverse(M, R)

    monkeypatch.setattr(driver_module, "bordered_inverse", singular_once)
    s.remove(victim)
    assert calls and victim not in s.ids
    assert_exact(s)


def test_merge_twins_keeps_each_group_total_and_frees_one_member():
    """Per group of equal free keys: floor(T / C) members at C, one with the remainder (free),
    the rest at 0; unequal keys, held keys and the anchor untouched."""
    C = 0.1
    Xt = np.array([[0.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0.0],
                   [0.0, 1.0, 0.0, 1.0, 0.0, 2.0, 0.0]])
    a = np.array([0.08, 0.05, 0.07, 0.05, 0.06, 0.04, 0.3])
    free = np.array([True, True, True, True, True, True, True])
    upper = np.array([C, C, C, C, C, C, np.inf])  # the last slot: the warm-up anchor
    merge_twins(Xt, a, free, upper)
    # the origin: slots 0, 2, 4 (total 0.21 = 2 C + 0.01); the anchor (slot 6) is no key
    np.testing.assert_allclose(a[[0, 2, 4]], [C, C, 0.01], rtol=1e-12)
    assert free.tolist() == [False, False, False, False, True, True, True]
    # (1, 1): slots 1, 3 (total 0.1 = C: one at C, no remainder, the other at 0)
    assert a[1] == C and a[3] == 0.0
    assert a[5] == 0.04 and a[6] == 0.3
    assert abs(a.sum() - 0.65) <= 4 * np.finfo(float).eps


def test_merge_twins_puts_a_remainder_of_rounding_on_its_bound():
    """A group whose total is a multiple of C up to the rounding of its sum: no member is left
    free with that rounding as its mass (it would pin rho)."""
    C = 0.1
    Xt = np.zeros((2, 3))
    for direction in (1.0, 0.0):  # the third member 2 ulps above or below C, and so the total
        third = np.nextafter(np.nextafter(C, direction), direction)
        a = np.array([0.05, 0.05, third])
        assert math.fsum(a.tolist()) != 2 * C
        free = np.ones(3, dtype=bool)
        merge_twins(Xt, a, free, np.full(3, C))
        assert a.tolist() == [C, C, 0.0] and not free.any()
