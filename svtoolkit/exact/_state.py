"""Stored states of :class:`~svtoolkit.exact.IncrementalSVDD`: structural validation and the
conversion between the shifted-kernel arrays the walk keeps and the unshifted system.

:meth:`IncrementalSVDD.from_state_dict` calls :func:`check_state` before any kernel sees a
stored array; optimality itself is :meth:`IncrementalSVDD.consistency`'s job.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import _walk as W

__all__ = ["check_state", "state_int", "state_ints", "steering_fields", "unshifted_inverse",
           "shifted_inverse", "STATE_SUM_TOL", "INT64_MAX"]


def unshifted_inverse(R_shifted):
    """M^{-1} = T^{-1} M'^{-1} for M = [[0, 1^T], [1, 2 K_SS]], M' its shifted-kernel twin.

    K = K' + 1 1^T gives M = M' T with T = [[1, 2 1^T], [0, I]]; T^{-1} only changes row 0:
    row_0 - 2 sum_p row_p.
    """
    R = R_shifted.copy()
    R[0] -= 2.0 * R_shifted[1:].sum(axis=0)
    return R


def shifted_inverse(R):
    """Inverse of :func:`unshifted_inverse`: M'^{-1} = T M^{-1} (row 0 + 2 sum_p row_p)."""
    R_shifted = R.copy()
    R_shifted[0] += 2.0 * R[1:].sum(axis=0)
    return R_shifted


INT64_MAX = int(np.iinfo(np.int64).max)
#: |sum(a) - 1| a stored state may show (the KKT residual itself is checked by the loader).
STATE_SUM_TOL = 1e-9


def state_int(state, key, low, high):
    """``state[key]`` as a Python int in [low, high], or ValueError naming the field."""
    value = state[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,
                                                                      np.integer)):
        raise ValueError(f"state[{key!r}] must be an integer; got {value!r}")
    if not low <= int(value) <= high:
        raise ValueError(f"state[{key!r}] = {value} is outside [{low}, {high}]")
    return int(value)


def state_ints(state, key, shape):
    """``state[key]`` as an int64 array of the given shape (integer dtype required)."""
    arr = np.asarray(state[key])
    if arr.shape != shape:
        raise ValueError(f"state[{key!r}] has shape {arr.shape}, expected {shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"state[{key!r}] must hold integers; got dtype {arr.dtype}")
    return arr.astype(np.int64)


def steering_fields(state):
    """The settings of a format-3 state that steer later operations, validated:
    ``(ops_since_audit, max_events, probe_tol, margin_capacity)``."""
    ops = state_int(state, "ops_since_audit", 0, INT64_MAX)
    max_events = state["max_events"]
    if max_events is not None:
        max_events = state_int(state, "max_events", 1, INT64_MAX)
    probe_tol = state["probe_tol"]
    if isinstance(probe_tol, (bool, np.bool_)) or not isinstance(probe_tol, numbers.Real) \
            or not W.PROBE_TOL <= float(probe_tol) <= W.PROBE_TOL_MAX:
        raise ValueError(f"state['probe_tol'] = {probe_tol!r} is outside "
                         f"[{W.PROBE_TOL}, {W.PROBE_TOL_MAX}]")
    capacity = state_int(state, "margin_capacity", 1, INT64_MAX)
    return ops, max_events, float(probe_tol), capacity


def state_floats(state, key, shape):
    """``state[key]`` as a finite float64 array of the given shape."""
    arr = np.asarray(state[key])
    if arr.shape != shape:
        raise ValueError(f"state[{key!r}] has shape {arr.shape}, expected {shape}")
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"state[{key!r}] must hold real numbers; got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"state[{key!r}] contains NaN or inf")
    return arr


def check_state(state, n, m, d, solver):
    """Structural checks of a stored state with n >= 1 keys, before any of it is used.

    Everything the Numba kernels index with or divide by is checked, so a damaged state is
    refused with a ValueError instead of reaching them: integer fields and their ranges,
    finite floats, the anchor, the partition codes and their coefficients (reserve exactly 0,
    error exactly C, margin strictly inside), the margin list against the status array and
    its positions, ``sum(a) = 1``, and the derived constants against C and sigma. Optimality
    itself is :meth:`IncrementalSVDD.consistency`'s job (O(n |support| d)).
    """
    for key, shape in {"Xt": (d, n), "alpha": (n,), "grad": (n,), "KSt": (m, n),
                       "R": (m + 1, m + 1)}.items():
        state_floats(state, key, shape)
    ids = state_ints(state, "ids", (n,))
    status = state_ints(state, "status", (n,))
    spos = state_ints(state, "spos", (n,))
    S = state_ints(state, "S", (m,))
    ist = state_ints(state, "ist", (W.IST_SIZE,))
    fs = np.asarray(state["fs"], dtype=np.float64)
    if fs.shape != (W.FS_SIZE,):
        raise ValueError(f"state['fs'] has shape {fs.shape}, expected ({W.FS_SIZE},)")
    if not (np.isfinite(fs[W._RHO]) and fs[W._C] == solver._fs[W._C] and fs[W._INV_SIGMA2] == solver._fs[W._INV_SIGMA2]
            and fs[W._MIN_PIVOT] > 0.0):
        raise ValueError("state['fs'] disagrees with C and sigma or holds a non-finite rho")
    anchor = int(ist[W._ANCHOR])
    if not -1 <= anchor < n or not -1 <= int(ist[W._CUR_C]) < n:
        raise ValueError("state's anchor or current slot is outside [-1, n)")
    expected_neg = np.zeros(n, bool)
    if anchor >= 0:
        expected_neg[anchor] = True
    if not np.array_equal(ids < 0, expected_neg) or (anchor >= 0 and ids[anchor] != -1):
        raise ValueError("state ids: keys need ids >= 0 and only the anchor slot holds -1")
    if not np.isin(status, (W.RESERVE, W.MARGIN, W.ERROR)).all():
        raise ValueError("state status codes must be reserve (0), margin (1) or error (2)")
    if not np.array_equal(np.sort(S), np.flatnonzero(status == W.MARGIN)):
        raise ValueError("state margin list disagrees with the status array")
    expected_spos = np.full(n, -1, dtype=np.int64)
    expected_spos[S] = np.arange(m)
    if not np.array_equal(spos, expected_spos):
        raise ValueError("state margin positions (spos) disagree with the margin list")
    alpha = np.asarray(state["alpha"], dtype=np.float64)
    real = ids >= 0
    C = solver._C
    inside = (alpha > 0.0) & (alpha < C)
    if ((status == W.RESERVE) & (alpha != 0.0)).any() \
            or ((status == W.ERROR) & real & (alpha != C)).any() \
            or ((status == W.MARGIN) & real & ~inside).any() \
            or (alpha < 0.0).any() or abs(alpha.sum() - 1.0) > STATE_SUM_TOL:
        raise ValueError("state coefficients disagree with their partition or with "
                         "sum(a) = 1 (reserve exactly 0, error exactly C, margin in (0, C))")
