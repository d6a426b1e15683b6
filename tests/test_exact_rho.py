"""Rounding residues of sum(a) = 1 and where they put rho.

When exactly 1/C keys sit at C (nu n0 a whole number), a fresh solve has an empty margin set
and reports the midpoint of rho's optimal interval. The walk's correction moves
``1 - fl(sum a)`` onto the margin set, and k copies of C = 1/k summed in order miss 1
by more than BOUND_SNAP C for k >= 212 (1.2e-12 C at k = 212 and 300): the last margin key kept
that residue (C - 5.5e-15 beside 211 keys at C = 1/212, 3.9e-15 beside 300 keys at C = 1/300),
was not snapped, and pinned rho where its f = 0 -
an arbitrary point of the interval. Every f then differed from a fresh solve's by up to 1.3e-4
here (2.8e-3 on keys in d = 64) while the KKT residual said 1e-14. The rest state now snaps a
margin coefficient within the rounding bound of that sum, and the certificate (KKT residual,
``consistency().rho_offset``, ``audit()``, the memory's rolling audit) compares rho with the
rho a fresh solve reports.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_exact_vertex import agreement_bound, assert_equals_fresh

from svtoolkit import IncrementalSVDD, rbf_kernel
from svtoolkit._rules import BOUND_SNAP
from svtoolkit.exact import _walk as W
from svtoolkit.exact._rest import sum_rounding
from svtoolkit.memory._audit import RollingAudit
from svtoolkit.reference import solve_svdd

SIGMA = 30.0
D = 8


def _keys(rng, n):
    """Heavy-tailed keys (Student t, 2 degrees of freedom): many far outliers at C."""
    return rng.standard_t(2, (n, D))


def _chain(n0, seed, n_ops):
    """A bulk build of n0 keys at nu = 0.5 (1/C = n0 / 2 keys at C), then n_ops random
    admissions and deletions; yields the solver after each operation."""
    rng = np.random.default_rng(seed)
    s = IncrementalSVDD.from_nu(0.5, n0, SIGMA)
    s.extend(_keys(rng, n0))
    for _ in range(n_ops):
        if rng.random() < 0.5:
            s.add(_keys(rng, 1)[0])
        else:
            s.remove(int(rng.choice(s.ids)))
        yield s


# (n0, seed): the first operation left a residue on the last margin key before the fix, at
# C - 5.5e-15 (beside 211 keys at C = 1/212) and at 3.9e-15 (beside 300 keys at C = 1/300)
CHAINS = [(424, 12), (600, 4)]


@pytest.mark.parametrize(("n0", "seed"), CHAINS)
def test_a_residue_of_the_sum_does_not_pin_rho(n0, seed):
    """After every operation: the partition, a, rho and f of a fresh solve of the same keys,
    to the agreement bound of two exact solves (test_exact_vertex.agreement_bound: sums of
    at most n terms of size <= 2, 8 n eps with an empty margin set). Before the fix f was off
    by 1.3e-4 (n0 = 424) and 6.5e-5 (n0 = 600) after the first operation."""
    probes = np.random.default_rng(99).standard_t(2, (20, D))
    for s in _chain(n0, seed, 4):
        tol = BOUND_SNAP * s.C
        a = s.alpha[np.isin(s.ids, s.margin_ids)]
        assert np.all((a > tol) & (a < s.C - tol))  # no margin key is a residue
        fresh = IncrementalSVDD(s.C, s.sigma)
        fresh.extend(s.keys)
        for mine, theirs in ((s.margin_ids, fresh.margin_ids), (s.error_ids, fresh.error_ids)):
            # the same keys in the same order; the fresh solve numbers them from 0
            np.testing.assert_array_equal(np.isin(s.ids, mine), np.isin(fresh.ids, theirs))
        assert_equals_fresh(s, np.vstack([s.keys, probes]))
        assert s.consistency().rho_offset <= agreement_bound(s)


def test_the_interior_point_reference_reports_the_same_rho():
    """The independent reference (interior point + exact polish; midpoint with S empty)
    agrees: rho to the agreement bound plus the reference's own sums (numpy's K @ a, of the
    same length), i.e. twice the bound."""
    s = list(_chain(424, 12, 1))[-1]
    assert len(s.margin_ids) == 0  # before the fix: one margin key at C - 5.5e-15
    ref = solve_svdd(rbf_kernel(s.keys, sigma=s.sigma), s.C)
    assert ref.polished and len(ref.margin) == 0
    np.testing.assert_array_equal(s.alpha, ref.alpha)
    assert abs(s.rho - ref.rho) <= 2 * agreement_bound(s)


def _pinned_by_a_residue():
    """The state the walk used to leave, made by hand from a fresh solve with S empty: the
    212 keys at C = 1/212 sum (in slot order, as the correction walk sums) to 1 + 5.5e-15, so
    the error key with the largest f enters S at C - 5.5e-15, and rho moves to where that
    key's f = 0 (the high end of rho's interval). Every KKT condition of that partition
    holds."""
    rng = np.random.default_rng(10)  # a bulk build of this seed has S empty
    s = IncrementalSVDD.from_nu(0.5, 424, SIGMA)
    s.extend(_keys(rng, 424))
    assert len(s.margin_ids) == 0 and len(s.error_ids) == 212
    state = s.state_dict()
    n = len(s)
    a, g, st = state["alpha"], state["grad"], state["status"]
    j = int(np.flatnonzero(st == W.ERROR)[np.argmax(g[st == W.ERROR])])
    total = 0.0
    for value in a:  # slot order, one addition at a time
        total += value
    residue = total - 1.0
    assert BOUND_SNAP * s.C < residue <= sum_rounding(a, n)  # only the sum rule sees it
    column = np.empty(n)
    W.kernel_column(state["Xt"], n, j, -1, 1.0 / SIGMA**2, column)
    a[j] = s.C - residue
    g -= 2.0 * residue * column
    state["fs"][W._RHO] -= g[j]
    g -= g[j]
    st[j] = W.MARGIN
    state["spos"][j] = 0
    state["S"] = np.array([j])
    state["KSt"] = column[None, :].copy()
    state["R"] = np.array([[0.0, 1.0], [1.0, 0.0]])  # M' = [[0, 1], [1, 2 K'_jj = 0]]
    state["ist"][W._M] = 1
    pinned = IncrementalSVDD.from_state_dict(state)
    return pinned, s


def test_the_certificate_reports_a_rho_pinned_by_a_residue():
    """The KKT residual of the pinned state was 1.1e-14 (its partition's conditions hold);
    it now reports rho's distance from a fresh solve's, as consistency() does, and audit()
    repairs it to the fresh solve."""
    pinned, fresh = _pinned_by_a_residue()
    offset = abs(pinned.rho - fresh.rho)
    assert offset > 1e-6  # half the width of rho's interval
    bound = agreement_bound(fresh)
    assert abs(pinned.kkt_residual() - offset) <= bound
    assert abs(pinned.consistency().rho_offset - offset) <= bound
    report = pinned.audit()
    assert report.refactorized and abs(report.rho_offset - offset) <= bound
    assert report.kkt_residual <= bound
    assert_equals_fresh(pinned, fresh.keys)


def test_the_rolling_audit_compares_rho_with_a_fresh_solve():
    """A slice of the memory's rolling audit reports the offset from the maintained
    gradients and runs the repairing audit."""
    pinned, fresh = _pinned_by_a_residue()
    offset = abs(pinned.rho - fresh.rho)
    checked = RollingAudit().slice(pinned)
    assert abs(checked["rho_offset"] - offset) <= agreement_bound(fresh)
    assert checked["repaired"]
    assert_equals_fresh(pinned, fresh.keys)
    assert RollingAudit().slice(pinned)["rho_offset"] <= agreement_bound(fresh)


def test_eviction_with_an_empty_margin_set_keeps_rho_until_the_audit():
    """evict_reserve keeps rho (nothing changes); the offset from a fresh solve's midpoint is
    reported by consistency() - not by the KKT residual, whose conditions hold - and audit()
    re-centres it, as the next operation would."""
    rng = np.random.default_rng(10)
    s = IncrementalSVDD.from_nu(0.5, 424, SIGMA)
    s.extend(_keys(rng, 424))
    rho = s.rho
    s.evict_reserve()
    fresh = IncrementalSVDD(s.C, s.sigma)
    fresh.extend(s.keys)
    bound = agreement_bound(fresh)
    assert s.rho == rho and s.kkt_residual() <= bound
    assert abs(s.consistency().rho_offset - abs(rho - fresh.rho)) <= bound
    assert abs(rho - fresh.rho) > 1e-6
    assert s.audit().refactorized
    assert_equals_fresh(s, fresh.keys)
