"""Stored states of :class:`~svtoolkit.exact.IncrementalSVDD`: export and restore, structural
validation, and the conversion between the shifted-kernel arrays the walk keeps and the
unshifted system.

:meth:`IncrementalSVDD.state_dict` is :func:`export_state`; :meth:`IncrementalSVDD.from_state_dict`
is :func:`restore_state`, which calls :func:`check_state` before any kernel sees a stored array;
optimality itself is :meth:`IncrementalSVDD.consistency`'s job.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import _walk as W

__all__ = ["export_state", "restore_state", "check_state", "state_int", "state_ints",
           "steering_fields", "stored_fs", "margin_positions", "fill_kernel_rows",
           "unshifted_inverse", "shifted_inverse", "STATE_FORMAT", "STATE_SUM_TOL", "INT64_MAX"]


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
#: 2: the walk's arrays hold the shifted kernel (KSt = K' = K - 1, R = M'^{-1},
#: fs[_RHO] = rho + 1); format-1 states (unshifted) are converted on load.
#: 3: also the settings that steer later operations (the calibrated inverse-probe
#: tolerance, the operations since the last audit, the event limit and the margin
#: capacity, at which a walk pauses to grow its arrays); states of formats 1 and 2 load
#: with their defaults (PROBE_TOL, 0, None, the smallest capacity that holds them).
#: 4: the inverse-probe thresholds live in ``fs``, where the walk's kernels read them: the
#: rest state's (slot ``_PROBE_LIMIT``, format 3's field ``probe_tol``) and the in-walk
#: refresh's (``_REFRESH_LIMIT``, new); format-3 states load with their ``probe_tol`` put
#: there, formats 1 and 2 with PROBE_TOL, and all three with REFRESH_PROBE_TOL.
STATE_FORMAT = 4
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
    """The settings of a state of format 3 or later that steer later operations, validated:
    ``(ops_since_audit, max_events, margin_capacity)`` (the probe threshold: :func:`stored_fs`)."""
    ops = state_int(state, "ops_since_audit", 0, INT64_MAX)
    max_events = state["max_events"]
    if max_events is not None:
        max_events = state_int(state, "max_events", 1, INT64_MAX)
    capacity = state_int(state, "margin_capacity", 1, INT64_MAX)
    return ops, max_events, capacity


def stored_fs(state, version):
    """``state['fs']`` as the walk's ``fs`` array of FS_SIZE floats, its probe thresholds
    checked (earlier formats held four floats: they get the thresholds they used, format 3's
    ``probe_tol`` or PROBE_TOL, and REFRESH_PROBE_TOL). :func:`check_state` checks the rest.
    """
    fs = np.asarray(state["fs"], dtype=np.float64)
    size = W.FS_SIZE if version >= 4 else 4
    if fs.shape != (size,):
        raise ValueError(f"state['fs'] has shape {fs.shape}, expected ({size},)")
    if version < 4:
        probe_tol = state["probe_tol"] if version == 3 else W.PROBE_TOL
        if isinstance(probe_tol, (bool, np.bool_)) or not isinstance(probe_tol, numbers.Real):
            raise ValueError(f"state['probe_tol'] must be a real number; got {probe_tol!r}")
        fs = np.append(fs, [float(probe_tol), W.REFRESH_PROBE_TOL])
        if not W.PROBE_TOL <= fs[W._PROBE_LIMIT] < 1.0:
            raise ValueError(f"state['probe_tol'] = {probe_tol!r} is outside "
                             f"[{W.PROBE_TOL}, 1)")
        return fs
    if not W.PROBE_TOL <= fs[W._PROBE_LIMIT] < 1.0:  # 1: an inverse wrong outright
        raise ValueError(f"state['fs'] holds the rest state's probe threshold "
                         f"{float(fs[W._PROBE_LIMIT])!r}, outside [{W.PROBE_TOL}, 1)")
    if not W.REFRESH_PROBE_TOL <= fs[W._REFRESH_LIMIT] < 1.0:  # 1: an inverse wrong outright
        raise ValueError(f"state['fs'] holds the in-walk refresh's probe threshold "
                         f"{float(fs[W._REFRESH_LIMIT])!r}, outside [{W.REFRESH_PROBE_TOL}, 1)")
    return fs.copy()


def state_floats(state, key, shape):
    """``state[key]`` as a finite float64 array of the given shape."""
    arr = np.asarray(state[key])
    if arr.shape != shape:
        raise ValueError(f"state[{key!r}] has shape {arr.shape}, expected {shape}")
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"state[{key!r}] must hold real numbers; got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
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
    shapes = {"Xt": (d, n), "alpha": (n,), "grad": (n,), "R": (m + 1, m + 1)}
    if "KSt" in state:  # a compact state's rows are computed, not read
        shapes["KSt"] = (m, n)
    for key, shape in shapes.items():
        state_floats(state, key, shape)
    ids = state_ints(state, "ids", (n,))
    status = state_ints(state, "status", (n,))
    spos = state_ints(state, "spos", (n,))
    S = state_ints(state, "S", (m,))
    ist = state_ints(state, "ist", (W.IST_SIZE,))
    fs = state["fs"]  # already in this format's layout, its thresholds checked (stored_fs)
    if not (np.isfinite(fs[W._RHO]) and fs[W._C] == solver._fs[W._C]
            and fs[W._INV_SIGMA2] == solver._fs[W._INV_SIGMA2] and fs[W._MIN_PIVOT] > 0.0):
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


def export_state(solver, compact=False):
    """The state and steering settings of ``solver`` as plain arrays (copies) and numbers.

    ``compact=True`` leaves out the keys ``Xt`` (a caller that stores them itself puts them
    back before :func:`restore_state`), the margin kernel rows ``KSt`` and the margin
    positions ``spos``: :func:`restore_state` recomputes those two from the keys by the
    walk's own kernel, bit for bit what the walk maintains.
    """
    n, m = solver._n, solver._m
    state = {
        "format": STATE_FORMAT,
        "C": solver._C,
        "sigma": solver._sigma,
        "d": -1 if solver._d is None else solver._d,
        "next_id": solver._next_id,
        "audit_every": solver.audit_every,
        "ops_since_audit": solver._ops_since_audit,
        "max_events": solver.max_events,
        "margin_capacity": int(solver._S.shape[0]),
        "ids": solver._ids[:n].copy(),
        "alpha": solver._alpha[:n].copy(),
        "grad": solver._grad[:n].copy(),
        "status": solver._status[:n].copy(),
        "S": solver._S[:m].copy(),
        "R": solver._R[: m + 1, : m + 1].copy(),
        "fs": solver._fs.copy(),
        "ist": solver._ist.copy(),
    }
    if not compact:
        state["Xt"] = solver._Xt[:, :n].copy()
        state["spos"] = solver._spos[:n].copy()
        state["KSt"] = solver._KSt[:m, :n].copy()
    return state


def margin_positions(state, n, m):
    """``spos`` of a compact state (:func:`export_state`): ``spos[S[p]] = p``, else -1."""
    S = state_ints(state, "S", (m,))
    if m and not ((S >= 0) & (S < n)).all():
        raise ValueError("state's margin list is outside [0, n)")
    spos = np.full(n, -1, dtype=np.int64)
    spos[S] = np.arange(m)
    return spos


def fill_kernel_rows(solver):
    """The margin kernel rows of a solver restored from a compact state, from its keys.

    ``KSt[p] = K'(x_{S[p]}, .)`` by :func:`_walk.kernel_column`, the function that fills
    every row the walk keeps (its entries are symmetric to the bit: the squared differences
    are summed coordinate by coordinate in the same order either way), so the rows are the
    ones the exported solver held. Cost ``m n d``.
    """
    n, m = solver._n, solver._m
    anchor, inv_sigma2 = int(solver._ist[W._ANCHOR]), solver._fs[W._INV_SIGMA2]
    for p in range(m):
        W.kernel_column(solver._Xt, n, int(solver._S[p]), anchor, inv_sigma2, solver._KSt[p])


def restore_state(solver_class, state):
    """A new ``solver_class`` holding ``state`` (:func:`export_state` output, any format up to
    STATE_FORMAT), checked by :func:`check_state` before any array is used."""
    version = state.get("format")
    if version not in (1, 2, 3, STATE_FORMAT):
        raise ValueError(f"unknown solver state format {version!r}")
    solver = solver_class(state["C"], state["sigma"],
                          audit_every=state_int(state, "audit_every", 0, INT64_MAX))
    d = state_int(state, "d", -1, INT64_MAX)
    ist = state_ints(state, "ist", (W.IST_SIZE,))
    n, m = int(ist[W._N]), int(ist[W._M])
    if not 0 <= m <= n:
        raise ValueError(f"state sizes are inconsistent: n={n}, m={m} (need 0 <= m <= n)")
    mcap = max(8, m + 1)
    fs = stored_fs(state, version)
    if version >= 3:
        ops, solver.max_events, mcap = steering_fields(state)
        solver._ops_since_audit = ops
        # at least 8 and never below m; it grows with S but never shrinks with the keys
        if not max(m, 8) <= mcap <= 2**40:
            raise ValueError(f"state['margin_capacity'] = {mcap} is outside "
                             f"[max(8, m) = {max(m, 8)}, 2**40]")
    if d < 0 or n == 0:
        if n:
            raise ValueError("state holds keys but no dimension")
        if d == 0:
            raise ValueError("state dimension d must be >= 1 (or -1 before any key)")
        if ist[W._ANCHOR] != -1 or ist[W._CUR_C] != -1:
            raise ValueError("an empty state cannot hold an anchor or a current slot")
        solver._next_id = state_int(state, "next_id", 0, INT64_MAX)
        if d > 0:
            solver._d = d
            solver._allocate(d=d, cap=16, mcap=mcap)
            solver._ist[:] = ist
            limits = [W._PROBE_LIMIT, W._REFRESH_LIMIT]
            solver._fs[limits] = fs[limits]
        return solver
    compact = "KSt" not in state
    state = {**state, "fs": fs}
    if compact:
        state = {**state, "spos": margin_positions(state, n, m)}
    check_state(state, n, m, d, solver)
    solver._d = d
    solver._allocate(d=d, cap=max(16, n + 1), mcap=mcap)
    solver._Xt[:, :n] = state["Xt"]
    solver._ids[:n] = state["ids"]
    solver._alpha[:n] = state["alpha"]
    solver._grad[:n] = state["grad"]
    solver._status[:n] = state["status"]
    solver._spos[:n] = state["spos"]
    solver._S[:m] = state["S"]
    if not compact:
        solver._KSt[:m, :n] = state["KSt"]
    solver._R[: m + 1, : m + 1] = state["R"]
    solver._fs[:] = state["fs"]
    if version == 1:  # unshifted kernel: K' = K - 1, R' = T R, rho' = rho + 1
        solver._KSt[:m, :n] -= 1.0
        solver._R[: m + 1, : m + 1] = shifted_inverse(solver._R[: m + 1, : m + 1])
        solver._fs[W._RHO] += 1.0
    solver._ist[:] = ist
    solver._next_id = state_int(state, "next_id", 0, INT64_MAX)
    ids = solver._ids[:n]
    real = ids[ids >= 0]
    if len(np.unique(real)) != len(real) or (len(real) and real.max() >= solver._next_id):
        raise ValueError("state ids are duplicated or not below next_id")
    solver._slot_of = {int(i): slot for slot, i in enumerate(ids) if i >= 0}
    if compact:
        fill_kernel_rows(solver)
    return solver
