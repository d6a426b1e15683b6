"""IncrementalSVDD.audit_slice: what the memory's rolling audit compares, read through one method.

The slice is checked against a direct computation from the public state (keys, coefficients,
rho, the margin system) and against deliberate damage to the maintained gradients and inverse,
which it must show; the rolling audit itself must read nothing private of the solver.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from test_exact_rho import _pinned_by_a_residue
from test_exact_vertex import agreement_bound

from svtoolkit import IncrementalSVDD, rbf_kernel
from svtoolkit.exact import AuditSlice
from svtoolkit.exact._state import shifted_inverse

AUDIT = Path(__file__).resolve().parent.parent / "svtoolkit" / "memory" / "_audit.py"
SIGMA = 1.5


def _solver():
    X = np.random.default_rng(3).standard_normal((120, 4))
    s = IncrementalSVDD.from_nu(0.3, 120, SIGMA)
    s.extend(X)
    assert s.certified and s.margin_size == len(s.margin_ids) >= 2
    return s


def _direct_bordered(s):
    """M' = [[0, 1^T], [1, 2 (K_SS - 1)]] and R' = M'^{-1} as maintained, from the public
    margin system (its unshifted inverse shifted back)."""
    ms = s.margin_system()
    keys = s.keys[np.searchsorted(s.ids, ms.margin_ids)]
    m = len(ms.margin_ids)
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * (rbf_kernel(keys, keys, sigma=SIGMA) - 1.0)
    return M, shifted_inverse(ms.inverse)


def test_audit_slice_equals_a_direct_computation():
    s = _solver()
    ids = s.ids[[0, 7, 50, 119]]
    columns = np.array([0, 2, s.margin_size])
    found = s.audit_slice(ids, columns)
    assert isinstance(found, AuditSlice)
    # f at a key from the public state: 2 sum_j a_j k(x, x_j) - 1 + rho
    X = s.keys[np.searchsorted(s.ids, ids)]
    direct = 2.0 * rbf_kernel(X, s.keys, sigma=SIGMA) @ s.alpha - 1.0 + s.rho
    np.testing.assert_allclose(found.fresh_gradients, direct, rtol=0, atol=1e-12)
    np.testing.assert_allclose(found.maintained_gradients, direct, rtol=0, atol=1e-12)
    M, R = _direct_bordered(s)
    assert found.inverse_columns.shape == (s.margin_size + 1, 3)
    np.testing.assert_allclose(found.inverse_columns, R @ M[:, columns], rtol=0, atol=1e-10)
    np.testing.assert_allclose(found.inverse_columns, np.eye(s.margin_size + 1)[:, columns],
                               rtol=0, atol=1e-10)
    assert found.rho_offset == 0.0  # a free margin key fixes rho


def test_audit_slice_shows_damage_to_the_maintained_state():
    """The maintained gradients and inverse are read, not recomputed: damage shows."""
    s = _solver()
    ids = s.ids[:5]
    slot = s._slot_of[int(ids[2])]
    s._grad[slot] += 1e-7
    s._R[1, 1] += 1e-6  # row 1 of R times the border column [0; 1 ... 1] moves by 1e-6
    found = s.audit_slice(ids, [0, 1])
    drift = found.maintained_gradients - found.fresh_gradients
    assert abs(drift[2] - 1e-7) < 1e-12 and np.max(np.abs(np.delete(drift, 2))) < 1e-12
    residual = found.inverse_columns - np.eye(s.margin_size + 1)[:, [0, 1]]
    assert abs(residual[1, 0] - 1e-6) < 1e-12


def test_audit_slice_reports_a_rho_pinned_by_a_residue():
    """rho_offset from the maintained gradients: the distance from a fresh solve's rho."""
    pinned, fresh = _pinned_by_a_residue()
    found = pinned.audit_slice([], [])
    assert abs(found.rho_offset - abs(pinned.rho - fresh.rho)) <= agreement_bound(fresh)
    assert found.fresh_gradients.shape == (0,) and found.inverse_columns.shape == (2, 0)


def test_audit_slice_refuses_unknown_ids_and_columns():
    s = _solver()
    with pytest.raises(KeyError, match="unknown id 1000000"):
        s.audit_slice([10**6], [])
    for bad in ([-1], [s.margin_size + 1]):
        with pytest.raises(ValueError, match="columns"):
            s.audit_slice([], bad)
    empty = IncrementalSVDD(C=1.0, sigma=1.0)
    empty.add([0.0, 0.0])  # one key at a = C = 1: the margin set is empty
    assert empty.margin_size == 0
    with pytest.raises(ValueError, match="columns"):
        empty.audit_slice([], [0])


def test_the_rolling_audit_reads_no_private_of_the_solver():
    tree = ast.parse(AUDIT.read_text())
    private = [node.attr for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id == "solver" and node.attr.startswith("_")]
    assert private == []
    assert "solver._" not in AUDIT.read_text()
