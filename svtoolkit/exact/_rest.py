"""Numba kernels of the walk's rest state: :func:`settle` and the steps it is made of.

After the walk of an operation (:mod:`svtoolkit.exact._walk`, whose module docstring describes
the state layout and holds the one tolerance table), :func:`settle` brings the state to its
canonical rest: it asks for a polish on small pivots or a failed inverse probe, relaxes sign
violators by their own walks (:func:`repair`, :func:`worst_violator`), snaps margin
coefficients that sit on a bound into that bound's set (:func:`snap_margin_bounds`), removes
the equality residuals by a correction walk (:func:`correct`) and, with the margin set empty,
puts rho at the midpoint of its optimal interval (:func:`recenter_rho`). A deletion's walk,
slot removal and rest state run in one crossing (:func:`remove_and_settle`).
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from .._rules import BOUND_SNAP, SUM_ROUNDOFF
from ._walk import (
    _ANCHOR,
    _C,
    _CUR_C,
    _CUR_MODE,
    _EPOCH,
    _EV_JOIN,
    _EV_NONE,
    _EV_S_TO_E,
    _EV_S_TO_R,
    _EVENTS,
    _LAST_JOINED,
    _LAST_LEFT,
    _M,
    _MIN_PIVOT,
    _N,
    _PROBE_LIMIT,
    _REFUSED,
    _REPAIRS,
    _RHO,
    _SETTLED,
    ADMIT,
    CONSISTENCY_TOL,
    CORRECT_SKIP,
    DONE,
    ERROR,
    INCONSISTENT,
    MARGIN,
    MOVING,
    NEED_MARGIN_CAPACITY,
    NEED_POLISH,
    POLISH_PIVOT,
    RELAX_DOWN,
    REMOVE,
    REPAIR_FACTOR,
    REPAIR_MIN_TOL,
    RESERVE,
    TOO_MANY_EVENTS,
    _add_rows_off_margin,
    _better,
    _join,
    _leave,
    _matvec,
    _schur,
    _step_to,
    delete_slot,
    inverse_probe_residual,
    kappa_floor,
    walk,
)


@njit
def worst_violator(grad, status, S, KSt, R, fs, ist, bk, vbuf, done):
    """Slot of the largest sign violation worth a relaxation walk, or -1.

    A violation counts when it exceeds REPAIR_MIN_TOL and REPAIR_FACTOR * C * kappa_i, with
    kappa_i the point's Schur complement against S (capped at its :func:`kappa_floor`). Only a
    point kept out of S as dependent can violate by more than rounding; relaxing it swaps it
    with the margin points it
    depends on, which moves their gradient difference by about 2 C kappa_i - so below that
    bound the optimum splits weight between near twins, the vertex state is within that bound
    of it, and a relaxation would only make the twins trade places. ``done`` marks points
    already relaxed in this settle (each is relaxed at most once: anti-cycling).
    """
    worst = 0.0
    who = -1
    m = ist[_M]
    scale = max(fs[_C], 1.0)
    for i in range(ist[_N]):
        st = status[i]
        if st == ERROR:
            v = grad[i]
        elif st == RESERVE:
            v = -grad[i]
        else:
            continue
        if v <= REPAIR_MIN_TOL * scale or v <= worst or (i < done.shape[0] and done[i]):
            continue
        if m > 0:
            # tolerated only while i is dependent on S (kappa_i below its floor): so at rest
            # every sign violation outside `done` is below REPAIR_FACTOR * C * KAPPA_TOL
            kappa = _schur(m, S, KSt, R, i, bk, vbuf)
            kappa = min(kappa, kappa_floor(m, R, vbuf, kappa, ist[_ANCHOR]))
            if v <= REPAIR_FACTOR * fs[_C] * kappa:
                continue
        worst = v
        who = i
    return who


@njit
def repair(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf, blocked,
           fs, ist, max_events, max_repairs, newton):
    """Relax every error/reserve point whose gradient sign is wrong, by its own walk.

    Such points are keys that were kept out of S as dependent on it (near duplicates): while
    their twin moved, their gradient drifted by a first-order amount. Relaxing one is an exact
    walk with the point as the moving coefficient (up from R, down from E); it transfers mass
    between the point and the margin set it depends on until a bound is met, and strictly
    lowers the objective. Signs are judged after a Newton correction of the equalities.
    Resumable like :func:`walk`. ``newton``: ``beta`` holds the first correction's Newton
    step for this state (:func:`correct`; never with a walk to resume).
    """
    if ist[_CUR_C] >= 0:
        code = walk(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                    blocked, fs, ist, ist[_CUR_C], ist[_CUR_MODE], False, max_events)
        if code != DONE:
            return code
    done = np.zeros(0, dtype=np.bool_)  # allocated at the first violator
    for _ in range(max_repairs):
        # judge signs on the corrected state: a walk can leave equality residuals (a point
        # that joined S by a zero-length step keeps its rounding-level gradient)
        code = correct(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                       blocked, fs, ist, max_events, newton)
        newton = False
        if code != DONE:
            return code
        v = worst_violator(grad, status, S, KSt, R, fs, ist, bk, vbuf, done)
        if v < 0:
            return DONE
        if done.shape[0] == 0:
            done = np.zeros(ist[_N], dtype=np.bool_)
        done[v] = True
        ist[_REPAIRS] += 1
        mode = ADMIT if status[v] == RESERVE else RELAX_DOWN
        status[v] = MOVING
        code = walk(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                    blocked, fs, ist, v, mode, False, max_events)
        if code != DONE:
            return code
    return TOO_MANY_EVENTS


@njit
def settle(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf, blocked,
           fs, ist, max_events, max_repairs, polish_allowed):
    """Bring the state to rest in canonical form (one crossing per operation).

    Asks for a polish (NEED_POLISH; the caller polishes and calls again, with
    ``polish_allowed=False`` once it has polished ``SETTLE_POLISHES`` times) when a rank-one
    update of this operation used a pivot below POLISH_PIVOT or the inverse fails its probe -
    before the repair, and again after it when a relaxation walk used such a pivot (near
    twins: a relaxation swaps a key with the margin key it depends on, at a pivot of about its
    Schur complement); relaxes sign violators (:func:`repair`); moves
    margin coefficients that sit on a bound into that bound's set; removes the equality
    residuals (:func:`correct`); with S empty puts rho at the midpoint of its optimal interval
    (what a fresh solve reports), with the warm-up anchor alone in S where the anchor puts it
    (:func:`anchor_rho`). Skipped when nothing moved since the last rest state.
    """
    if polish_allowed and ist[_EVENTS] == ist[_SETTLED] and fs[_MIN_PIVOT] == np.inf:
        # nothing moved since the last rest state (e.g. a reserve key was deleted): only the
        # midpoint of rho's interval can have changed
        if ist[_M] == 0 and ist[_N] > 0:
            recenter_rho(alpha, grad, status, fs, ist[_N])
        return DONE
    newton = False
    if polish_allowed:
        if fs[_MIN_PIVOT] < POLISH_PIVOT:
            return NEED_POLISH
        # unless a walk resumes, the repair's first step corrects this very state: its Newton
        # step R r comes out of the probe's pass over R (r in vbuf, R r in beta)
        m, n = ist[_M], ist[_N]
        newton = ist[_CUR_C] < 0 and 0 < m < S.shape[0] \
            and _equality_residual(alpha, grad, S, n, m, vbuf) > CORRECT_SKIP
        if inverse_probe_residual(R, m, S, KSt, status, n, bk, vbuf, beta, newton) \
                > fs[_PROBE_LIMIT]:
            return NEED_POLISH
    code = repair(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                  blocked, fs, ist, max_events, max_repairs, newton)
    if code != DONE:
        return code
    # the repair ends on a corrected state (its last step is a correction that found no
    # violator after it): a snap's moved mass is what needs correcting, and the correction can
    # leave the rounding of sum(a) on a margin key that a bound event of it made the last one:
    # snap that too, then correct again. Without a snap the state stays as the repair left it
    # (another correction would only chase the rounding of the last one's step: one more
    # O(m^2) product with the inverse, 2 ms at 2,048 margin keys).
    for _ in range(2):
        if snap_margin_bounds(alpha, grad, status, spos, S, KSt, R, fs, ist) == 0:
            break
        code = correct(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                       blocked, fs, ist, max_events, False)
        if code != DONE:
            return code
    if ist[_M] == 0 and ist[_N] > 0:
        recenter_rho(alpha, grad, status, fs, ist[_N])
    elif ist[_M] == 1 and S[0] == ist[_ANCHOR]:
        anchor_rho(alpha, grad, fs, ist[_N], ist[_ANCHOR])
    if not _consistent(alpha, status, fs, ist):
        return INCONSISTENT
    if polish_allowed and fs[_MIN_PIVOT] < POLISH_PIVOT:
        # a relaxation or correction walk of this rest state used a small pivot: its
        # rounding (~eps / pivot) is in the maintained gradients, as after any such step
        return NEED_POLISH
    ist[_SETTLED] = ist[_EVENTS]
    fs[_MIN_PIVOT] = np.inf  # pivots are judged per operation
    return DONE


@njit
def _consistent(alpha, status, fs, ist):
    """Last line of defence: sum(a) = 1 and every coefficient inside its box (rounding)."""
    C = fs[_C]
    total = 0.0
    for i in range(ist[_N]):
        a = alpha[i]
        total += a
        if a < 0.0 or (a > C and i != ist[_ANCHOR]):
            return False
    return abs(total - 1.0) <= CONSISTENCY_TOL


@njit
def _equality_residual(alpha, grad, S, n, m, r):
    """r[:m + 1] = [1 - sum(a); -g_S] (the sum in slot order); returns max |r|."""
    total = 0.0
    for i in range(n):
        total += alpha[i]
    r[0] = 1.0 - total
    worst = abs(r[0])
    for p in range(m):
        r[p + 1] = -grad[S[p]]
        worst = max(worst, abs(r[p + 1]))
    return worst


@njit
def correct(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, du, bk, r, blocked, fs,
            ist, max_events, newton):
    """Remove the equality residuals of the partition by a walk along the Newton direction.

    Residuals r = [1 - sum(a); -g_S] (the gradients are kept consistent with the
    coefficients, so g_S is the exact margin residual). The Newton direction
    [d rho; d a_S] = R r would remove them at t = 1; the state moves along it and stops at the
    first event on the way - a margin coefficient reaching a bound (it leaves S) or an
    error/reserve gradient reaching 0 (it joins S) - executes it and starts again from the new
    residual. After rounding-level drift the full step is taken at once (one O(n m) pass);
    after an inexact inverse (ill-conditioned S, see POLISH_PIVOT) the events keep every
    coefficient in its box where a plain Newton step would throw it out. ``newton``: ``du``
    holds R r for this state already (:func:`settle`, from the probe's pass over R).

    Returns DONE, NEED_MARGIN_CAPACITY or TOO_MANY_EVENTS.
    """
    ist[_LAST_LEFT] = -1
    ist[_LAST_JOINED] = -1
    ist[_EPOCH] += 1
    C = fs[_C]
    anchor = ist[_ANCHOR]
    big = np.iinfo(np.int64).max
    for _ in range(max_events):
        n = ist[_N]
        m = ist[_M]
        if m == 0:
            return DONE
        if m == S.shape[0]:
            return NEED_MARGIN_CAPACITY
        if _equality_residual(alpha, grad, S, n, m, r) <= CORRECT_SKIP:
            return DONE
        if newton:
            newton = False  # du = R r of this residual already
        else:
            _matvec(R, m + 1, r, du, 1.0)
        # gradient rates of the non-margin points along the direction
        for i in range(n):
            gam[i] = du[0]
        _add_rows_off_margin(gam, n, status, KSt, du[1:], m, 2.0)
        tbest, tiebest, kind, who = 1.0, big, _EV_NONE, -1
        last_joined = ist[_LAST_JOINED]
        for p in range(m):
            j = S[p]
            end = alpha[j] + du[p + 1]
            if end < 0.0:
                t, ev = _step_to(alpha[j], du[p + 1]), _EV_S_TO_R
            elif end > C and j != anchor:
                t, ev = _step_to(alpha[j] - C, du[p + 1]), _EV_S_TO_E
            else:
                continue
            if t == 0.0 and j == last_joined:
                continue
            if _better(t, ids[j], tbest, tiebest):
                tbest, tiebest, kind, who = t, ids[j], ev, j
        epoch = ist[_EPOCH]
        last_left = ist[_LAST_LEFT]
        for i in range(n):
            st = status[i]
            if st == MARGIN or st == MOVING or blocked[i] == epoch:
                continue
            end = grad[i] + gam[i]
            if st == ERROR:
                if end <= REPAIR_MIN_TOL * max(C, 1.0):
                    continue
            elif st == RESERVE:
                if end >= -REPAIR_MIN_TOL * max(C, 1.0):
                    continue
            t = _step_to(grad[i], gam[i])
            if t == 0.0 and i == last_left:
                continue
            if _better(t, ids[i], tbest, tiebest):
                tbest, tiebest, kind, who = t, ids[i], _EV_JOIN, i
        # move: coefficients and rho along du, gradients along their rates, margin
        # residuals shrink linearly (g_S(t) = (1 - t) g_S)
        t = tbest
        fs[_RHO] += t * du[0]
        for p in range(m):
            alpha[S[p]] += t * du[p + 1]
        for i in range(n):
            if status[i] != MARGIN:
                grad[i] += t * gam[i]
        for p in range(m):
            grad[S[p]] *= 1.0 - t
        if t > 0.0:
            ist[_LAST_LEFT] = -1
            ist[_LAST_JOINED] = -1
        ist[_EVENTS] += 1
        if kind == _EV_NONE:
            for p in range(m):
                grad[S[p]] = 0.0
            return DONE
        if kind == _EV_S_TO_R:
            _leave(who, RESERVE, alpha, grad, status, spos, S, KSt, R, fs, ist)
        elif kind == _EV_S_TO_E:
            _leave(who, ERROR, alpha, grad, status, spos, S, KSt, R, fs, ist)
        else:
            kappa = _schur(m, S, KSt, R, who, bk, r)
            if kappa < kappa_floor(m, R, r, kappa, anchor):
                blocked[who] = epoch
                ist[_REFUSED] += 1
            else:
                _join(who, Xt, alpha, grad, status, spos, S, KSt, R, kc, -1, bk, kappa, fs,
                      ist)
    return TOO_MANY_EVENTS


@njit
def sum_rounding(alpha, n):
    """Bound on the rounding error of ``sum(a)`` summed in slot order (the order of
    :func:`correct`): ``SUM_ROUNDOFF * sum_i |s_i|`` over the computed partial sums s_i (each
    addition errs by at most u |s_i| and the errors add; zero terms add none and are skipped).

    :func:`correct` moves ``1 - fl(sum a)`` onto the margin set, so a margin coefficient within
    this of a bound may be nothing but that rounding (svtoolkit._rules, SUM_ROUNDOFF)."""
    total = 0.0
    partial = 0.0
    for i in range(n):
        if alpha[i] != 0.0:
            total += alpha[i]
            partial += abs(total)
    return SUM_ROUNDOFF * partial


@njit
def at_upper_bound(a, C, sum_tol):
    """A margin coefficient that is C up to a residue: within BOUND_SNAP * C of it (its own
    updates' rounding) or within ``sum_tol`` (:func:`sum_rounding`)."""
    return a >= C * (1.0 - BOUND_SNAP) or C - a <= sum_tol


@njit
def at_lower_bound(a, C, sum_tol):
    """A margin coefficient that is 0 up to a residue (as :func:`at_upper_bound`)."""
    return a <= C * BOUND_SNAP or a <= sum_tol


@njit
def snap_margin_bounds(alpha, grad, status, spos, S, KSt, R, fs, ist):
    """At rest, a margin coefficient within a residue of a bound (:func:`at_upper_bound`,
    :func:`at_lower_bound`) joins that bound's set; returns the number snapped.

    Each snap moves mass off the equality ``sum(a) = 1``, which the correction walk then puts
    back on the margin keys left (if any). So the snaps are taken together or not at all: only
    if the mass they move together is itself a residue, at most ``max(BOUND_SNAP * C,
    sum_tol)`` - the bound each key meets on its own. Two keys 3e-13 below C = 1/2 + 3e-13
    each (the optimum splits the mass equally) are both within BOUND_SNAP C of it, but
    together they are 6e-13 off the sum, with no margin key left to take it back.
    """
    C = fs[_C]
    sum_tol = sum_rounding(alpha, ist[_N])
    moved = 0.0
    for p in range(ist[_M]):
        j = S[p]
        if j != ist[_ANCHOR] and at_upper_bound(alpha[j], C, sum_tol):
            moved += C - alpha[j]
        elif at_lower_bound(alpha[j], C, sum_tol):
            moved -= alpha[j]
    if abs(moved) > max(BOUND_SNAP * C, sum_tol):
        return 0
    snapped = 0
    p = 0
    while p < ist[_M]:
        j = S[p]
        if j != ist[_ANCHOR] and at_upper_bound(alpha[j], C, sum_tol):
            _leave(j, ERROR, alpha, grad, status, spos, S, KSt, R, fs, ist)
            snapped += 1
        elif at_lower_bound(alpha[j], C, sum_tol):
            _leave(j, RESERVE, alpha, grad, status, spos, S, KSt, R, fs, ist)
            snapped += 1
        else:
            p += 1
    return snapped


@njit
def recenter_rho(alpha, grad, status, fs, n):
    """With S empty, move rho to the midpoint of its optimal interval (libsvm's convention).

    rho is optimal anywhere in [max_{R} (rho - g_i), min_{E} (rho - g_i)]; every gradient
    shifts by the change.
    """
    rho = fs[_RHO]
    lo = -np.inf
    hi = np.inf
    for i in range(n):
        h = rho - grad[i]
        if status[i] == RESERVE:
            if h > lo:
                lo = h
        elif status[i] == ERROR:
            if h < hi:
                hi = h
    if lo == -np.inf and hi == np.inf:
        return
    if lo == -np.inf:
        new = hi
    elif hi == np.inf:
        new = lo
    else:
        new = 0.5 * (lo + hi)
    shift = new - rho
    fs[_RHO] = new
    for i in range(n):
        grad[i] += shift


@njit
def anchor_rho(alpha, grad, fs, n, anchor):
    """With the warm-up anchor alone in S, rho' from its definition; every gradient shifts by
    the change.

    The anchor's f is ``2 sum_j a_j K'(anchor, j) + rho' = rho' - 2 sum_keys a_j`` (K' is -1
    to every key, 0 to itself) and is 0 on the margin, so ``rho' = 2 sum_keys a_j``. The
    maintained rho' carries the rounding of every step since S last held keys, which no later
    step removes (measured: 9e-14 after exact twins on a wide kernel left S, where a fresh
    solve is within 3e-15).
    """
    mass = 0.0
    for j in range(n):
        if j != anchor:
            mass += alpha[j]
    shift = 2.0 * mass - fs[_RHO]
    fs[_RHO] += shift
    for i in range(n):
        grad[i] += shift


@njit
def remove_and_settle(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                      blocked, fs, ist, c, max_events, max_repairs):
    """A deletion in one crossing: :func:`walk` of slot c to 0, :func:`delete_slot`, then
    :func:`settle` (polish allowed).

    Returns
    -------
    (int, int)
        ``(-2, code)`` when the walk stopped with ``code`` (nothing deleted: the caller resumes
        the walk as usual), else ``(moved, code)`` with ``moved`` the result of
        :func:`delete_slot` and ``code`` the settle's (DONE, NEED_POLISH, ...).
    """
    code = walk(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf, blocked,
                fs, ist, c, REMOVE, False, max_events)
    if code != DONE:
        return -2, code
    moved = delete_slot(c, Xt, ids, alpha, grad, status, spos, S, KSt, blocked, ist)
    code = settle(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf,
                  blocked, fs, ist, max_events, max_repairs, True)
    return moved, code
