"""Numba kernels of the exact Cauwenberghs-Poggio walk on the SVDD dual.

Everything here is a free ``@njit`` function over arrays and scalars; the state lives in
:class:`svtoolkit.exact.solver.IncrementalSVDD`. One add or remove is one call of :func:`walk`
(one Python -> Numba crossing per operation; the whole event loop runs inside), and its rest
state one call of ``settle`` (:mod:`svtoolkit.exact._rest`). This module owns the state layout
below (the ``ist`` and ``fs`` slot names: ``_N``, ``_M``, ... and ``_RHO``, ``_C``, ...) and
the one tolerance table of the walk.

State layout (``cap`` slots, ``mcap`` margin capacity; slot order is arbitrary, swap-remove):

==========  =================  =========================================================
name        shape              meaning
==========  =================  =========================================================
Xt          (d, cap)           keys, one column per slot (vectorisable distance loops)
ids         (cap,) int64       stable ids; the virtual anchor has id -1
alpha       (cap,)             coefficients a
grad        (cap,)             g_i = 2 (K' a)_i + rho'  (= f(x_i))
status      (cap,) int8        RESERVE / MARGIN / ERROR / MOVING
spos        (cap,) int64       position in the margin list, -1 if not a margin point
S           (mcap,) int64      margin list (slots), in bordered-system order
KSt         (mcap, cap)        KSt[p, i] = K'(x_{S[p]}, x_i): the columns K'[:, S], each contiguous
R           (mcap+1, mcap+1)   inverse of M' = [[0, 1^T], [1, 2 K'_SS]]
blocked     (cap,) int64       epoch stamp: slot is dependent on the current S (see below);
                               ``_TABU``: slot left S while a_c stood still (see walk)
fs          (FS_SIZE,)         [rho' = rho + 1, C, 1/sigma^2, smallest pivot of the operation,
                                the probe thresholds of the rest state and of the in-walk
                                refresh] (slots ``_RHO``, ``_C``, ``_INV_SIGMA2``,
                               ``_MIN_PIVOT``, ``_PROBE_LIMIT``, ``_REFRESH_LIMIT``)
ist         (IST_SIZE,) int64  [n, m, anchor slot, epoch, last_left, last_joined,
                                events, refused joins, current walk's slot and mode, repairs,
                                event count at the last completed settle (-1: must settle)]
                               (slots ``_N``, ``_M``, ``_ANCHOR``, ... ``_SETTLED``)
==========  =================  =========================================================

**The shifted kernel.** The walk runs on K' = K - 1 1^T, i.e. K'_ij = k(x_i, x_j) - 1, computed
without cancellation (:func:`svtoolkit.kernels.rbf_row_minus_one`), with rho' = rho + 1. Under
sum(a) = 1 this is the same problem with the same gradients: a^T K a = a^T K' a + 1 and
2 (K a)_i - 1 + rho = 2 (K' a)_i + rho'. It matters for near keys: the information of a tight
cluster lives in 1 - k ~ (distance / sigma)^2, which K keeps only to its absolute precision
(~1e-16, so ~1e-7 relative at distances of 1e-4 sigma) and K' to full relative precision. The
bordered systems are related by M = M' T with T = [[1, 2 1^T], [0, I]], so M^{-1} = T^{-1} M'^{-1}
(see :meth:`IncrementalSVDD.margin_system`, which reports the unshifted inverse).

The virtual anchor (docs/design.md, "warm-up") is an ordinary slot with k(anchor, x) = 0 for every
key, k(anchor, anchor) = 1 and no upper bound, i.e. K'(anchor, x) = -1 and K'(anchor, anchor) = 0.
It absorbs the mass the keys cannot hold while n C < 1 (warm-up).
"""

from __future__ import annotations

import numpy as np

from .._jit import njit
from .._rules import FEASIBILITY_TOL
from ..kernels import rbf_row_minus_one

# --- status codes ------------------------------------------------------------------------------
RESERVE = 0
MARGIN = 1
ERROR = 2
MOVING = 3  # the coefficient being driven by the current walk

# --- walk modes --------------------------------------------------------------------------------
ADMIT = 0  # raise a_c until g_c = 0 (S) or a_c = C (E)
REMOVE = 1  # lower a_c to 0; the caller deletes the slot
RELAX_DOWN = 2  # lower a_c until g_c = 0 (S) or a_c = 0 (R)

# --- walk return codes ---------------------------------------------------------------------------
DONE = 0
NEED_MARGIN_CAPACITY = 1
TOO_MANY_EVENTS = 2
NO_EVENT = 3
NEED_POLISH = 4
INCONSISTENT = 5

# --- tolerances (one table; see docs/exact_solver.md) ------------------------------------------
#: A point whose Schur complement against the margin set is below this, times the scale of K'
#: around it where that scale is below 1 (:func:`kappa_floor`), is numerically dependent on it
#: (an exact or near duplicate of margin points); it is kept out of S at its bound.
KAPPA_TOL = 1e-8
#: Error/reserve points whose gradient moves slower than this per unit step are not event
#: candidates (their gradient changes by less than SENS_TOL * step, far below 1e-12).
SENS_TOL = 1e-12
#: FEASIBILITY_TOL (svtoolkit._rules): n C >= 1 - tol counts as feasible; an anchor residue
#: below it is snapped to 0.
#: At rest, error/reserve points whose gradient has the wrong sign by more than
#: max(REPAIR_MIN_TOL * max(C, 1), REPAIR_FACTOR * C * min(kappa_i, floor_i)) are relaxed by
#: their own walk (floor_i: :func:`kappa_floor`)
#: (kappa_i: the point's Schur complement against S; see ``_rest.worst_violator``).
REPAIR_MIN_TOL = 1e-13
REPAIR_FACTOR = 4.0
#: BOUND_SNAP and SUM_ROUNDOFF (svtoolkit._rules): at rest, a margin coefficient within
#: BOUND_SNAP * C of a bound, or within the rounding bound of sum(a) (``_rest.sum_rounding``),
#: is moved to that bound.
#: Equality residuals at or below this are rounding; ``_rest.correct`` leaves them.
CORRECT_SKIP = 1e-16
#: At rest |sum(a) - 1| must be below this, else the operation fails (and is rebuilt).
CONSISTENCY_TOL = 1e-9
#: An operation whose rank-one updates used a pivot (Schur complement) below this ends with a
#: polish: fresh inverse, [rho; a_S] re-solved for the partition, gradients from the keys.
#: Rounding in a step grows like eps / pivot (cancellation in the sensitivities), so below
#: 1e-5 it could exceed ~1e-12 in f.
POLISH_PIVOT = 1e-5
#: ... and so does one whose inverse fails the probe max |R (M 1) - 1| <= fs[_PROBE_LIMIT], a
#: threshold that starts at PROBE_TOL and is set after every fresh factorisation to 4x that
#: inverse's own probe (its rounding floor), never below PROBE_TOL: at m = 2048 margin keys a
#: fresh inverse probes at 1.1e-11, and a polish that cannot improve the probe would otherwise
#: run after every operation ...
PROBE_TOL = 1e-11
#: ... nor above PROBE_TOL_MAX while some margin key's Schur complement against the others
#: (1 / |R_kk|) is below POLISH_PIVOT: there the floor is the conditioning of near twins, the
#: steps' rounding (~eps / pivot) reaches the gradients, and the polish that a probe above
#: this forces after each operation is what refreshes them (tight clusters 1e-5 apart ended
#: builds 1.3e-8 off the optimum without it). With every complement above POLISH_PIVOT the
#: floor is the size of the margin set and no ceiling applies: a fresh inverse probes at
#: 1.6e-9 on 4,000 keys of d = 384 with every key on the margin, where the ceiling made every
#: operation polish twice (11.6 s an operation instead of 0.06-2 s, the states no closer to a
#: fresh solve).
PROBE_TOL_MAX = 1e-9
#: The in-walk refactorisation after a shrink on a small pivot (:func:`_leave`) runs when the
#: probe exceeds fs[_REFRESH_LIMIT]: REFRESH_PROBE_TOL (the drift that breaks sum(a) = 1 shows
#: far above it), raised to 4x the probe of the refactorised inverse after a refresh that did
#: not improve the probe 4x (it met the inverse's own floor), and back to REFRESH_PROBE_TOL
#: after one that did and at every polish. Below a fresh inverse's floor a refresh cannot
#: help: at m = 1,436 keys of a 2-D Gaussian (sigma = 0.1 x the median distance) a fresh
#: inverse probes at 3.7e-5, and the refresh ran after every shrink, at O(m^3). On collinear
#: keys the floor falls from 2e-2 to 7e-10 as dependent keys leave S, and each refresh
#: improves the probe 10-700x: there the rule refreshes as before.
REFRESH_PROBE_TOL = 1e-9
#: The rest state asks for a polish again after its relaxation walks when one of them used a
#: pivot below POLISH_PIVOT (near twins trade places at a pivot of about their Schur
#: complement: measured 1.1e-11, whose rounding left f off a fresh evaluation by 1.3e-7
#: unseen); at most this many polishes per operation.
SETTLE_POLISHES = 3
#: A rest state reached after SETTLE_POLISHES polishes (the last settle could not polish
#: again) is checked from the keys: its KKT residual may exceed rounding only by the sign
#: violation that the rest state tolerates on keys dependent on S (REPAIR_FACTOR * C *
#: KAPPA_TOL, :func:`_rest.worst_violator`). Above this many times that bound it is not a rest
#: state of the exact walk at all - its maintained quantities drifted (measured: 500 collinear
#: keys with the event limit raised, one admission of 28,386 events on pivots down to 7e-11 left
#: the margin gradients 0.02 off the keys while the maintained ones read 0) - and the operation
#: fails instead of returning it.
REST_CHECK_FACTOR = 10.0

#: ``blocked`` stamp of a slot that left S in a stretch of steps that did not move a_c; it may
#: not rejoin S until a_c moves (:func:`walk`, anti-cycling). Epoch stamps are >= 0.
_TABU = -2

# ist indices
_N, _M, _ANCHOR, _EPOCH, _LAST_LEFT, _LAST_JOINED, _EVENTS, _REFUSED = 0, 1, 2, 3, 4, 5, 6, 7
_CUR_C, _CUR_MODE, _REPAIRS, _SETTLED = 8, 9, 10, 11
IST_SIZE = 12

# fs indices
_RHO = 0  # rho' = rho + 1: the offset of the shifted kernel's gradients, g = 2 K' a + rho'
_C = 1  # the box constraint C
_INV_SIGMA2 = 2  # 1 / sigma^2
_MIN_PIVOT = 3  # smallest pivot (Schur complement) of the operation so far; inf at rest
_PROBE_LIMIT = 4  # the rest state's probe threshold, calibrated on the last fresh factorisation
_REFRESH_LIMIT = 5  # the in-walk refresh's probe threshold (REFRESH_PROBE_TOL or its own floor)
FS_SIZE = 6

# event kinds
_EV_NONE = 0
_EV_C_TO_S = 1
_EV_C_TO_E = 2
_EV_C_TO_R = 3
_EV_C_ZERO = 4
_EV_S_TO_R = 5
_EV_S_TO_E = 6
_EV_JOIN = 7  # an error or reserve point reaches g = 0 and joins S


@njit
def kernel_column(Xt, n, c, anchor, inv_sigma2, out):
    """out[i] = k(x_i, x_c) - 1 for the first n slots (the shifted kernel; anchor rules applied).

    Parameters
    ----------
    Xt : ndarray of shape (d, cap)
        Keys as columns.
    n : int
        Number of live slots.
    c : int
        Slot of the column.
    anchor : int
        Slot of the virtual anchor, -1 if absent.
    inv_sigma2 : float
        ``1 / sigma**2``.
    out : ndarray of shape (>= n,)
        Written in place.
    """
    if c == anchor:
        for i in range(n):
            out[i] = -1.0
        out[c] = 0.0
        return
    rbf_row_minus_one(Xt, n, Xt[:, c], inv_sigma2, out)
    if anchor >= 0:
        out[anchor] = -1.0
    out[c] = 0.0


@njit
def _matvec(R, m1, v, out, scale):
    """out[:m1] = scale * R[:m1, :m1] v, one row of R at a time (rows are contiguous).

    Each out[i] sums R[i, j] v[j] in increasing j. Four rows are summed side by side (four
    independent chains instead of one: about twice as fast on a large margin set, the same
    bits). The transposed form (a sum of R's rows, which vectorises) was tried: R is the
    inverse of a symmetric matrix only up to rounding, and using R^T for R moved streamed SV
    outputs by 4e-12 where this form gives 5e-13. ``out`` must not be ``v``.
    """
    i = 0
    while i + 4 <= m1:
        r0, r1, r2, r3 = R[i], R[i + 1], R[i + 2], R[i + 3]
        s0 = s1 = s2 = s3 = 0.0
        for j in range(m1):
            vj = v[j]
            s0 += r0[j] * vj
            s1 += r1[j] * vj
            s2 += r2[j] * vj
            s3 += r3[j] * vj
        out[i] = scale * s0
        out[i + 1] = scale * s1
        out[i + 2] = scale * s2
        out[i + 3] = scale * s3
        i += 4
    while i < m1:
        row = R[i]
        s = 0.0
        for j in range(m1):
            s += row[j] * v[j]
        out[i] = scale * s
        i += 1


@njit
def _matvec_pair(R, m1, v, out, v2, out2):
    """out[:m1] = R[:m1, :m1] v and out2[:m1] = R[:m1, :m1] v2 in one pass over R, each with
    the bits of :func:`_matvec` (each sum in increasing j; four rows side by side)."""
    i = 0
    while i + 4 <= m1:
        r0, r1, r2, r3 = R[i], R[i + 1], R[i + 2], R[i + 3]
        s0 = s1 = s2 = s3 = 0.0
        t0 = t1 = t2 = t3 = 0.0
        for j in range(m1):
            vj = v[j]
            s0 += r0[j] * vj
            s1 += r1[j] * vj
            s2 += r2[j] * vj
            s3 += r3[j] * vj
            wj = v2[j]
            t0 += r0[j] * wj
            t1 += r1[j] * wj
            t2 += r2[j] * wj
            t3 += r3[j] * wj
        out[i] = s0
        out[i + 1] = s1
        out[i + 2] = s2
        out[i + 3] = s3
        out2[i] = t0
        out2[i + 1] = t1
        out2[i + 2] = t2
        out2[i + 3] = t3
        i += 4
    while i < m1:
        row = R[i]
        s = 0.0
        t = 0.0
        for j in range(m1):
            s += row[j] * v[j]
            t += row[j] * v2[j]
        out[i] = s
        out2[i] = t
        i += 1


@njit
def _add_rows(target, n, rows, coef, count, scale):
    """target[:n] += scale * coef[p] * rows[p, :n] for p < count, in increasing p for each i.

    Four rows per sweep of ``target`` (each entry still adds its terms in the same order, so
    the bits are those of one row at a time)."""
    p = 0
    while p + 4 <= count:
        b0, b1 = scale * coef[p], scale * coef[p + 1]
        b2, b3 = scale * coef[p + 2], scale * coef[p + 3]
        r0, r1, r2, r3 = rows[p], rows[p + 1], rows[p + 2], rows[p + 3]
        for i in range(n):
            target[i] = (((target[i] + b0 * r0[i]) + b1 * r1[i]) + b2 * r2[i]) + b3 * r3[i]
        p += 4
    while p < count:
        b = scale * coef[p]
        row = rows[p]
        for i in range(n):
            target[i] += b * row[i]
        p += 1


#: :func:`_add_rows_off_margin` sums column by column when at most 1 / OFF_MARGIN_SWEEP of the
#: slots are off the margin. Measured on 2,048 slots, their rows in cache (Intel Xeon): a sweep
#: of 2,047 rows 1.2 ms; columns 0.01 ms for one slot, 0.35 ms for 64, 0.58 ms for 128, and
#: 1.2 ms for 256 (the break-even, n / 8; the rule keeps a margin of two).
OFF_MARGIN_SWEEP = 16


@njit
def _add_rows_off_margin(target, n, status, rows, coef, count, scale):
    """:func:`_add_rows` for the slots off the margin set (the bits of ``_add_rows`` there);
    the margin slots' entries are left unspecified (their rates are never read: a margin
    gradient stays 0 along a step).

    Where few slots are off the margin (``OFF_MARGIN_SWEEP * k <= n`` for the k = n - count of
    them, ``count`` the margin rows) each is summed down its column of ``rows``, O(k count),
    instead of sweeping all n slots, O(n count): with every key on the margin that sweep was
    half of each step's work.
    """
    if OFF_MARGIN_SWEEP * (n - count) > n:
        _add_rows(target, n, rows, coef, count, scale)
        return
    for i in range(n):
        if status[i] != MARGIN:
            t = target[i]
            for p in range(count):  # the sweep's sum too: each entry adds in increasing p
                t += (scale * coef[p]) * rows[p, i]
            target[i] = t


@njit
def _sensitivities(n, m, S, KSt, R, kc, beta, vbuf, gam, status):
    """beta = -R [1; 2 K_Sc] and gamma_i = 2 K_ic + 2 K_iS beta_S + beta_0 for the slots off
    the margin set (:func:`_add_rows_off_margin`)."""
    vbuf[0] = 1.0
    for p in range(m):
        vbuf[p + 1] = 2.0 * kc[S[p]]
    _matvec(R, m + 1, vbuf, beta, -1.0)
    b0 = beta[0]
    for i in range(n):
        gam[i] = 2.0 * kc[i] + b0
    _add_rows_off_margin(gam, n, status, KSt, beta[1:], m, 2.0)


@njit
def _schur(m, S, KSt, R, k, bk, vbuf):
    """Sensitivities of S with respect to slot k (into bk) and k's Schur complement kappa."""
    vbuf[0] = 1.0
    for p in range(m):
        vbuf[p + 1] = 2.0 * KSt[p, k]
    _matvec(R, m + 1, vbuf, bk, -1.0)
    kappa = 0.0  # 2 K_kk with K_kk = k(x, x) - 1 = 0 (RBF and anchor alike)
    for i in range(m + 1):
        kappa += vbuf[i] * bk[i]
    return kappa


@njit
def kappa_floor(m, R, v, kappa, anchor):
    """The Schur complement below which a candidate counts as dependent on S.

    ``v = [1; 2 K'_Sk]`` is the candidate's bordered column (as :func:`_schur` fills it) and
    ``kappa`` its computed Schur complement ``-v^T R v``. The computation cancels terms of
    size ``s = |v|^T |R| |v|`` (the scale of K' around the candidate: ~1 for keys a kernel
    width apart, ~(spread / sigma)^2 inside a tight cluster), so its rounding is ~(m + 2) u s
    plus R's own drift, and a pivot kappa puts ~u s / kappa of relative rounding into the
    later steps. The floor is KAPPA_TOL * min(s, 1): relative to the scale where that scale is
    below 1 (a cluster's information lives at ~(spread / sigma)^2, which K' keeps to full
    relative precision), the absolute KAPPA_TOL elsewhere. ``s`` is computed (O(m^2)) only
    when kappa is below KAPPA_TOL, so keys that enter under the absolute rule pay nothing.
    During warm-up (``anchor >= 0``) the floor stays absolute: the anchor's unit entries
    (K'(anchor, x) = -1) dominate those steps, and admitting cluster keys on their own scale
    there let sum(a) drift past CONSISTENCY_TOL (one build in a few hundred at C = 0.15).
    """
    if kappa >= KAPPA_TOL or m == 0 or anchor >= 0:
        return KAPPA_TOL
    s = 0.0
    for i in range(m + 1):
        row = R[i]
        t = 0.0
        for j in range(m + 1):
            t += abs(row[j] * v[j])
        s += abs(v[i]) * t
    return KAPPA_TOL * min(s, 1.0)


@njit
def _grow(R, m, bk, kappa):
    """R <- [[R, 0], [0, 0]] + (1/kappa) [bk; 1] [bk; 1]^T  (bordered size m+1 -> m+2)."""
    if m == 0:
        R[0, 0] = 0.0  # -2 K_kk
        R[0, 1] = 1.0
        R[1, 0] = 1.0
        R[1, 1] = 0.0
        return
    inv = 1.0 / kappa
    b = bk[: m + 1].copy()  # a separate array: the update below vectorises
    for i in range(m + 1):
        bi = b[i] * inv
        row = R[i]
        for j in range(m + 1):
            row[j] += bi * b[j]
        R[i, m + 1] = bi
        R[m + 1, i] = bi
    R[m + 1, m + 1] = inv


@njit
def _shrink(R, m, q):
    """Remove row/column q (>= 1) of the bordered inverse of size m+1; the last moves to q."""
    if m == 1:
        return  # S becomes empty: R is undefined until the next grow
    if m == 2:
        # one key stays: its system [[0, 1], [1, 2 K'_kk]] with K'_kk = 0 (any key, and the
        # anchor) is its own inverse, set exactly as _grow sets it. The downdate would keep
        # the larger inverse's rounding, below any probe threshold, and every later step
        # would scale by it (measured: R off by 5.8e-13, rho drifting 2 C 5.8e-13 a deletion
        # in warm-up, never corrected)
        R[0, 0] = 0.0
        R[0, 1] = 1.0
        R[1, 0] = 1.0
        R[1, 1] = 0.0
        return
    rqq = R[q, q]
    pivot_row = R[q, : m + 1].copy()  # a separate array: the update below vectorises
    for i in range(m + 1):
        if i == q:
            continue
        f = R[i, q] / rqq
        row = R[i]
        for j in range(m + 1):
            row[j] -= f * pivot_row[j]
        # column q was updated too (it is dropped or overwritten by column m below)
    if q != m:
        for i in range(m + 1):
            R[i, q] = R[i, m]
        for j in range(m + 1):
            R[q, j] = R[m, j]


@njit
def _join(k, Xt, alpha, grad, status, spos, S, KSt, R, kc, c, bk, kappa, fs, ist):
    """Slot k enters the margin set (bordered inverse grows; its kernel column is stored).

    k's gradient keeps its value (zero up to rounding of the step that brought it here); the
    residual is removed with every other one by ``_rest.correct`` at rest.
    """
    n = ist[_N]
    m = ist[_M]
    if m > 0 and kappa < fs[_MIN_PIVOT]:
        fs[_MIN_PIVOT] = kappa  # smallest pivot since the last polish
    _grow(R, m, bk, kappa)
    if k == c:
        for i in range(n):
            KSt[m, i] = kc[i]
    else:
        kernel_column(Xt, n, k, ist[_ANCHOR], fs[_INV_SIGMA2], KSt[m])
    S[m] = k
    spos[k] = m
    status[k] = MARGIN
    ist[_M] = m + 1
    ist[_SETTLED] = -1
    ist[_LAST_JOINED] = k


@njit
def _shift_coefficient(j, target, alpha, grad, column, n):
    """Set a_j = target and move every gradient with it (column = K[:, j])."""
    delta = target - alpha[j]
    if delta == 0.0:
        return
    alpha[j] = target
    two_delta = 2.0 * delta
    for i in range(n):
        grad[i] += two_delta * column[i]


@njit
def _leave(j, new_status, alpha, grad, status, spos, S, KSt, R, fs, ist):
    """Margin slot j leaves S for the reserve or error set; its coefficient is snapped.

    The snap moves a_j to exactly 0 or C; every gradient follows (g += 2 K[:, j] delta), so
    the gradients stay those of the coefficients (the sum residual goes to ``_rest.correct``).
    """
    n = ist[_N]
    m = ist[_M]
    p = spos[j]
    target = alpha[j]
    if new_status == RESERVE:
        target = 0.0
    elif new_status == ERROR:
        target = fs[_C]
    _shift_coefficient(j, target, alpha, grad, KSt[p], n)
    if m > 1:
        pivot = 1.0 / abs(R[p + 1, p + 1])  # j's Schur complement against the rest of S
        if pivot < fs[_MIN_PIVOT]:
            fs[_MIN_PIVOT] = pivot
    _shrink(R, m, p + 1)
    last = m - 1
    if p != last:
        moved = S[last]
        S[p] = moved
        spos[moved] = p
        src = KSt[last]
        dst = KSt[p]
        for i in range(n):
            dst[i] = src[i]
    spos[j] = -1
    status[j] = new_status
    ist[_M] = m - 1
    ist[_SETTLED] = -1
    ist[_LAST_LEFT] = j
    ist[_EPOCH] += 1  # S shrank: points blocked as dependent on the old S may enter again
    if fs[_MIN_PIVOT] < POLISH_PIVOT and m > 1:
        refresh_inverse_if_drifted(R, m - 1, S, KSt, status, n, fs)


@njit
def refresh_inverse_if_drifted(R, m, S, KSt, status, n, fs):
    """Refactorise R from K'_SS when its probe exceeds fs[_REFRESH_LIMIT] (O(m^2), O(m^3) to
    refresh), and set that threshold from the result (REFRESH_PROBE_TOL in the table above).

    Called after a shrink of an operation that used a small pivot. The rank-one downdate
    subtracts entries of size ~1 / pivot, so R can lose ~eps / pivot of absolute accuracy -
    enough to break sum(a) = 1 along the next steps (measured 5e-8 per step on keys 3e-5 sigma
    apart during warm-up). A factorised inverse solves the border row (the sum) to rounding.
    """
    w = np.empty(m + 1)
    before = inverse_probe_residual(R, m, S, KSt, status, n, w, w, w, False)
    if before <= fs[_REFRESH_LIMIT]:
        return
    M = np.zeros((m + 1, m + 1))
    for p in range(m):
        M[0, p + 1] = 1.0
        M[p + 1, 0] = 1.0
        for q in range(m):
            M[p + 1, q + 1] = 2.0 * KSt[q, S[p]]
    fresh = np.linalg.inv(M)
    for i in range(m + 1):
        for j in range(m + 1):
            R[i, j] = fresh[i, j]
    # a refresh that did not improve the probe 4x met the fresh inverse's own floor: the next
    # ones wait for drift above it; one that did goes back to REFRESH_PROBE_TOL
    floor = inverse_probe_residual(R, m, S, KSt, status, n, w, w, w, False)
    fs[_REFRESH_LIMIT] = REFRESH_PROBE_TOL if 4.0 * floor <= before else 4.0 * floor


@njit
def calibrate_probe(R, m, S, KSt, status, n, w, fs):
    """After a fresh factorisation R: the rest state's probe threshold fs[_PROBE_LIMIT] = 4x
    R's own probe (the factorisation's rounding floor), at least PROBE_TOL and, while a margin
    key's Schur complement 1 / |R_kk| is below POLISH_PIVOT, at most PROBE_TOL_MAX; the
    in-walk refresh's back to REFRESH_PROBE_TOL. ``w``: scratch, length >= m + 1."""
    floor = inverse_probe_residual(R, m, S, KSt, status, n, w, w, w, False)
    limit = max(PROBE_TOL, 4.0 * floor)
    for k in range(1, m + 1):
        if abs(R[k, k]) * POLISH_PIVOT > 1.0:
            limit = min(PROBE_TOL_MAX, limit)
            break
    fs[_PROBE_LIMIT] = limit
    fs[_REFRESH_LIMIT] = REFRESH_PROBE_TOL


@njit
def _upper(i, anchor, C):
    return np.inf if i == anchor else C


@njit
def _better(t, tie, tbest, tiebest):
    """Smallest step wins; exact ties go to the smallest tie key (Bland's rule on ids)."""
    return t < tbest or (t == tbest and tie < tiebest)


@njit
def _step_to(value, rate):
    """Step length for ``value + rate * t`` to reach 0 (value on the far side counts as 0)."""
    if value * rate >= 0.0:
        return 0.0
    return -value / rate


@njit
def _start(c, mode, alpha, grad, status, spos, S, KSt, R, fs, ist):
    """Put c in the MOVING state; returns True when nothing needs to move."""
    if mode == ADMIT:
        if alpha[c] == 0.0 and grad[c] >= 0.0:
            status[c] = RESERVE  # KKT already holds at a_c = 0
            return True
        status[c] = MOVING
        return False
    if status[c] == MARGIN:
        _leave(c, MOVING, alpha, grad, status, spos, S, KSt, R, fs, ist)
    status[c] = MOVING
    if alpha[c] == 0.0:
        if mode == RELAX_DOWN:
            status[c] = RESERVE
        return True
    return False


@njit
def walk(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf, blocked,
         fs, ist, c, mode, kc_ready, max_events):
    """Move alpha[c] exactly, one event at a time, until c's target is met.

    Modes: ``ADMIT`` raises a_c until g_c = 0 (c joins S) or a_c = C (E); ``REMOVE`` lowers
    a_c to 0 (c stays MOVING for the caller to delete); ``RELAX_DOWN`` lowers a_c until
    g_c = 0 (S) or a_c = 0 (R). Every step updates alpha, rho and the gradients by the
    sensitivities and the bordered inverse by rank-one growth/shrink; no step is skipped,
    zero-length steps included. Resumable: on NEED_MARGIN_CAPACITY the state is consistent;
    the caller enlarges the margin arrays and calls again.

    Returns
    -------
    int
        DONE, NEED_MARGIN_CAPACITY, TOO_MANY_EVENTS or NO_EVENT.

    Notes
    -----
    With S empty only rho moves (every g shifts by d rho): up when c gains mass, until c or an
    error point reaches g = 0; down when c loses mass, until a reserve point (or, relaxing, c)
    does. Ties: the smallest step wins, equal steps go to the smallest id, the moving point's
    own events last. Anti-cycling: a point may not leave S by a zero-length step right after
    entering, and a point that left S while a_c stood still (a step that did not change a_c
    in floating point) may not rejoin S until a_c moves; when that leaves no admissible event
    the ban is lifted. Without the ban a degenerate vertex can cycle through three keys at
    step length 0 (join i, leave j, join k, leave i, join j, leave k, ...; seen on 3,000 2-D
    Gaussian keys at sigma = 0.1 x the median distance). A point whose Schur
    complement is below :func:`kappa_floor` never enters S (it is marked dependent until S
    shrinks).
    """
    ist[_CUR_C] = c
    ist[_CUR_MODE] = mode
    ist[_LAST_LEFT] = -1
    ist[_LAST_JOINED] = -1
    ist[_EPOCH] += 1
    _lift_tabu(blocked, ist[_N])
    if status[c] != MOVING or alpha[c] == 0.0:
        if _start(c, mode, alpha, grad, status, spos, S, KSt, R, fs, ist):
            ist[_CUR_C] = -1
            return DONE
    if not kc_ready:
        kernel_column(Xt, ist[_N], c, ist[_ANCHOR], fs[_INV_SIGMA2], kc)
    sign = 1.0 if mode == ADMIT else -1.0
    events = 0
    while True:
        if events >= max_events:
            return TOO_MANY_EVENTS
        if ist[_M] == S.shape[0]:
            return NEED_MARGIN_CAPACITY
        events += 1
        ist[_EVENTS] += 1
        if ist[_M] == 0:
            code = _rho_step(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, bk, fs, ist,
                             c, mode, sign)
        else:
            code = _step(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk,
                         vbuf, blocked, fs, ist, c, mode, sign)
        if code == _CONTINUE:
            continue
        if code == DONE:
            ist[_CUR_C] = -1
        return code


_CONTINUE = -1


@njit
def _lift_tabu(blocked, n):
    """Clear every ``_TABU`` stamp; returns how many there were."""
    count = 0
    for i in range(n):
        if blocked[i] == _TABU:
            blocked[i] = -1
            count += 1
    return count


@njit
def _finish_own(c, kind, alpha, grad, status, spos, S, KSt, R, kc, bk, kappa, Xt, fs, ist):
    """Execute the moving point's own terminal event."""
    if kind == _EV_C_ZERO:
        _shift_coefficient(c, 0.0, alpha, grad, kc, ist[_N])
        if ist[_CUR_MODE] == RELAX_DOWN:
            status[c] = RESERVE
    elif kind == _EV_C_TO_R:
        status[c] = RESERVE
    elif kind == _EV_C_TO_E:
        _shift_coefficient(c, fs[_C], alpha, grad, kc, ist[_N])
        status[c] = ERROR
    else:  # _EV_C_TO_S
        _join(c, Xt, alpha, grad, status, spos, S, KSt, R, kc, c, bk, kappa, fs, ist)
    return DONE


@njit
def _rho_step(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, bk, fs, ist, c, mode, sign):
    """One event with S empty: rho moves alone (up when c gains mass, down when it loses)."""
    n = ist[_N]
    big = np.iinfo(np.int64).max
    tbest = np.inf
    tiebest = big
    kind = _EV_NONE
    who = -1
    if mode == ADMIT and alpha[c] >= _upper(c, ist[_ANCHOR], fs[_C]):
        return _finish_own(c, _EV_C_TO_E, alpha, grad, status, spos, S, KSt, R, kc, bk, 2.0,
                           Xt, fs, ist)
    if mode != REMOVE:
        t = _step_to(grad[c], sign)
        tbest, tiebest = t, big - 1
        kind = _EV_C_TO_S if alpha[c] > 0.0 else _EV_C_TO_R
        who = c
    watch = ERROR if sign > 0 else RESERVE
    for i in range(n):
        if status[i] == watch:
            t = _step_to(grad[i], sign)
            if _better(t, ids[i], tbest, tiebest):
                tbest, tiebest, kind, who = t, ids[i], _EV_JOIN, i
    if kind == _EV_NONE:
        # Nothing can take the mass: legal only for a rounding residue (n C = 1 exactly).
        if alpha[c] <= FEASIBILITY_TOL:
            return _finish_own(c, _EV_C_ZERO, alpha, grad, status, spos, S, KSt, R, kc, bk,
                               2.0, Xt, fs, ist)
        return NO_EVENT
    d_rho = sign * tbest
    fs[_RHO] += d_rho
    for i in range(n):
        grad[i] += d_rho
    if tbest > 0.0:
        ist[_LAST_LEFT] = -1
        ist[_LAST_JOINED] = -1
    if who == c:
        return _finish_own(c, kind, alpha, grad, status, spos, S, KSt, R, kc, bk, 2.0, Xt, fs,
                           ist)
    _join(who, Xt, alpha, grad, status, spos, S, KSt, R, kc, c, bk, 2.0, fs, ist)
    return _CONTINUE


@njit
def _step(Xt, ids, alpha, grad, status, spos, S, KSt, R, kc, gam, beta, bk, vbuf, blocked, fs,
          ist, c, mode, sign):
    """One ordinary event: a_c moves by sign * t, S follows by beta, every g by gamma."""
    n = ist[_N]
    m = ist[_M]
    C = fs[_C]
    anchor = ist[_ANCHOR]
    big = np.iinfo(np.int64).max
    _sensitivities(n, m, S, KSt, R, kc, beta, vbuf, gam, status)
    tbest = np.inf
    tiebest = big
    kind = _EV_NONE
    who = -1
    # the moving point's own events (lowest priority among exact ties)
    if mode == ADMIT:
        ub = _upper(c, anchor, C)
        if ub < np.inf:
            t = ub - alpha[c]
            tbest, tiebest, kind, who = (t if t > 0.0 else 0.0), big - 1, _EV_C_TO_E, c
    else:
        t = alpha[c] if alpha[c] > 0.0 else 0.0
        tbest, tiebest, kind, who = t, big - 1, _EV_C_ZERO, c
    if mode != REMOVE and gam[c] > kappa_floor(m, R, vbuf, gam[c], anchor):
        t = _step_to(grad[c], sign * gam[c])
        if _better(t, big - 2, tbest, tiebest):
            tbest, tiebest, kind, who = t, big - 2, _EV_C_TO_S, c
    # margin points reaching a bound
    last_joined = ist[_LAST_JOINED]
    for p in range(m):
        j = S[p]
        db = sign * beta[p + 1]
        if db < 0.0:
            t, ev = alpha[j] / (-db), _EV_S_TO_R
        elif db > 0.0 and _upper(j, anchor, C) < np.inf:
            t, ev = (C - alpha[j]) / db, _EV_S_TO_E
        else:
            continue
        if t <= 0.0:
            if j == last_joined:
                continue  # anti-cycling: no zero-length exit right after entering
            t = 0.0
        if _better(t, ids[j], tbest, tiebest):
            tbest, tiebest, kind, who = t, ids[j], ev, j
    # error and reserve points reaching g = 0
    epoch = ist[_EPOCH]
    last_left = ist[_LAST_LEFT]
    for i in range(n):
        st = status[i]
        if st == MARGIN or st == MOVING or blocked[i] == epoch:
            continue
        if blocked[i] == _TABU:
            continue  # anti-cycling: left S while a_c stood still
        dg = sign * gam[i]
        if st == ERROR:
            if dg <= SENS_TOL:
                continue
        elif dg >= -SENS_TOL:
            continue
        t = _step_to(grad[i], dg)
        if t == 0.0 and i == last_left:
            continue  # anti-cycling: no zero-length return to S
        if _better(t, ids[i], tbest, tiebest):
            tbest, tiebest, kind, who = t, ids[i], _EV_JOIN, i
    if kind == _EV_NONE:
        if _lift_tabu(blocked, n) > 0:
            return _CONTINUE  # the ban left nothing admissible: lifted, choose again
        return NO_EVENT
    # take the step
    st = sign * tbest
    before = alpha[c]
    alpha[c] += st
    still = alpha[c] == before
    if not still:
        _lift_tabu(blocked, n)
    fs[_RHO] += st * beta[0]
    for p in range(m):
        alpha[S[p]] += st * beta[p + 1]
    for i in range(n):
        if status[i] != MARGIN:
            grad[i] += st * gam[i]
    if tbest > 0.0:
        ist[_LAST_LEFT] = -1
        ist[_LAST_JOINED] = -1
    # execute the event
    if who == c:
        if kind == _EV_C_TO_S:
            for i in range(m + 1):
                bk[i] = beta[i]  # c's own S-sensitivities; its Schur complement is gamma_c
        return _finish_own(c, kind, alpha, grad, status, spos, S, KSt, R, kc, bk, gam[c], Xt, fs,
                           ist)
    if kind == _EV_S_TO_R or kind == _EV_S_TO_E:
        _leave(who, RESERVE if kind == _EV_S_TO_R else ERROR, alpha, grad, status, spos, S,
               KSt, R, fs, ist)
        if still:
            blocked[who] = _TABU
        return _CONTINUE
    kappa = _schur(m, S, KSt, R, who, bk, vbuf)
    if kappa < kappa_floor(m, R, vbuf, kappa, ist[_ANCHOR]):
        blocked[who] = epoch  # dependent on S: stays at its bound until S shrinks
        ist[_REFUSED] += 1
        return _CONTINUE
    _join(who, Xt, alpha, grad, status, spos, S, KSt, R, kc, c, bk, kappa, fs, ist)
    return _CONTINUE


@njit
def inverse_probe_residual(R, m, S, KSt, status, n, w, r, du, newton):
    """max |R_K (M_K v) - v| for v = 1, M_K = [[0, 1^T], [1, 2 K_SS]] the unshifted bordered
    matrix and R_K = T^{-1} R its inverse (module docstring): an O(m^2) check that R is still
    the inverse, on the scale of the unshifted system. (Probing the shifted system directly
    would read its own rounding as drift: on well-separated keys M' 1 has entries ~2m.)
    ``status``: the slots' sets (the margin slots are S's), ``n`` the live slots; ``w`` a
    scratch vector of length >= m + 1.

    With ``newton`` also du[:m + 1] = R r (the Newton step of ``_rest.correct`` for its
    residual r), in the same pass over R with the bits of :func:`_matvec`
    (:func:`_matvec_pair`): on a large margin set each pass reads R from memory (34 MB at
    m = 2,048), and a rest state probes R and then corrects. ``w`` distinct from ``r`` and
    ``du``; without ``newton`` they are not touched (any arrays)."""
    if m == 0:
        return 0.0
    # w = M_K 1: w[0] = m, w[p + 1] = 1 + sum_j 2 (K'[j, S[p]] + 1) over the margin slots j.
    # K' is symmetric to the bit (every kernel entry is the same sum of squared coordinate
    # differences, whichever key comes first), so each sum is read along the contiguous row
    # KSt[p] = K'[S[p], :], four rows at a time (four independent sums). Where at least a
    # quarter of the n slots are on the margin, j runs over them in increasing slot order (found
    # by a pass over the slots), so the reads go forward through each row; elsewhere in S's
    # order. With all 2,048 keys on the margin S's order jumped about each row: 3x slower.
    slots = S[:m]
    if 4 * m >= n:
        listed = np.empty(m, dtype=np.int64)
        q = 0
        for i in range(n):
            if status[i] == MARGIN and q < m:
                listed[q] = i
                q += 1
        if q == m:  # always, while status agrees with S
            slots = listed
    w[0] = m
    p = 0
    while p + 4 <= m:
        r0, r1, r2, r3 = KSt[p], KSt[p + 1], KSt[p + 2], KSt[p + 3]
        s0 = s1 = s2 = s3 = 1.0
        for q in range(m):
            j = slots[q]
            s0 += 2.0 * (r0[j] + 1.0)
            s1 += 2.0 * (r1[j] + 1.0)
            s2 += 2.0 * (r2[j] + 1.0)
            s3 += 2.0 * (r3[j] + 1.0)
        w[p + 1] = s0
        w[p + 2] = s1
        w[p + 3] = s2
        w[p + 4] = s3
        p += 4
    while p < m:
        row = KSt[p]
        t = 1.0
        for q in range(m):
            t += 2.0 * (row[slots[q]] + 1.0)
        w[p + 1] = t
        p += 1
    prod = np.empty(m + 1)
    if newton:
        _matvec_pair(R, m + 1, w, prod, r, du)
    else:
        _matvec(R, m + 1, w, prod, 1.0)
    worst = 0.0
    border = 0.0
    first = 0.0
    for i in range(m + 1):
        s = prod[i]
        if i == 0:
            first = s
            continue
        border += s
        err = abs(s - 1.0)
        if err > worst:
            worst = err
    err = abs(first - 2.0 * border - 1.0)  # row 0 of T^{-1} R: row_0 - 2 sum_p row_p
    return max(worst, err)


@njit
def _support(Xt, alpha, n, anchor):
    """Keys (as columns) and coefficients of the slots with a != 0, anchor excluded."""
    count = 0
    for j in range(n):
        if alpha[j] != 0.0 and j != anchor:
            count += 1
    chosen = np.empty(count, dtype=np.int64)
    coef = np.empty(count)
    q = 0
    for j in range(n):
        if alpha[j] != 0.0 and j != anchor:
            chosen[q] = j
            coef[q] = alpha[j]
            q += 1
    # row by row: Xt is (d, capacity), so a column gather would stride by the capacity
    keys = np.empty((Xt.shape[0], count))
    for k in range(Xt.shape[0]):
        for q in range(count):
            keys[k, q] = Xt[k, chosen[q]]
    return keys, coef


@njit
def _weighted_kernel_sums(keys, coef, points, inv_sigma2, out):
    """out[r] = sum_q coef[q] (k(points[:, r], keys[:, q]) - 1) (points as columns)."""
    row = np.empty(keys.shape[1])
    for r in range(points.shape[1]):
        rbf_row_minus_one(keys, keys.shape[1], points[:, r], inv_sigma2, row)
        s = 0.0
        for q in range(keys.shape[1]):
            s += coef[q] * row[q]
        out[r] = s


@njit
def anchor_terms(alpha, n, anchor, out):
    """Add the anchor's entries of the shifted kernel to out = sum_j a_j K'_ij (real j only).

    K'(anchor, x) = -1 for every key and K'(anchor, anchor) = 0, so every key's sum loses
    a_anchor and the anchor's own sum is minus the keys' mass.
    """
    if anchor < 0:
        return
    keys_mass = 0.0
    for j in range(n):
        if j != anchor:
            keys_mass += alpha[j]
    for i in range(n):
        out[i] -= alpha[anchor]
    out[anchor] = -keys_mass


@njit
def fresh_gradients(Xt, alpha, n, anchor, inv_sigma2, rho, out):
    """out[i] = 2 sum_j a_j K'_ij + rho' from the keys (O(n |support| d)); see the module
    docstring for the shifted kernel K' = K - 1 and rho' = rho + 1."""
    keys, coef = _support(Xt, alpha, n, anchor)
    _weighted_kernel_sums(keys, coef, Xt[:, :n], inv_sigma2, out)
    anchor_terms(alpha, n, anchor, out)
    for i in range(n):
        out[i] = 2.0 * out[i] + rho


@njit
def decision(Qt, Xt, alpha, n, anchor, inv_sigma2, rho, out):
    """f(q) = 2 sum_i a_i K'(q, x_i) + rho' for each column of Qt (the anchor's K' is -1).

    Equal to 2 sum_i a_i k(q, x_i) - 1 + rho (the anchor contributing 0) whenever
    sum(a) = 1, and evaluated at a key it is that key's gradient.
    """
    keys, coef = _support(Xt, alpha, n, anchor)
    _weighted_kernel_sums(keys, coef, Qt, inv_sigma2, out)
    held = alpha[anchor] if anchor >= 0 else 0.0
    for r in range(Qt.shape[1]):
        out[r] = 2.0 * (out[r] - held) + rho


@njit
def delete_slot(p, Xt, ids, alpha, grad, status, spos, S, KSt, blocked, ist):
    """Remove slot p (not a margin point) by moving the last slot into it.

    Returns the slot that moved into p, or -1 when p was the last slot.
    """
    n = ist[_N]
    last = n - 1
    if ist[_ANCHOR] == p:
        ist[_ANCHOR] = -1
    ist[_N] = last
    if p == last:
        for k in range(Xt.shape[0]):
            Xt[k, p] = 0.0  # a deleted key leaves no copy in the buffers beyond n
        return -1
    for k in range(Xt.shape[0]):
        Xt[k, p] = Xt[k, last]
        Xt[k, last] = 0.0
    ids[p] = ids[last]
    alpha[p] = alpha[last]
    grad[p] = grad[last]
    status[p] = status[last]
    spos[p] = spos[last]
    blocked[p] = blocked[last]
    if spos[p] >= 0:
        S[spos[p]] = p
    for q in range(ist[_M]):
        KSt[q, p] = KSt[q, last]
    if ist[_ANCHOR] == last:
        ist[_ANCHOR] = p
    return last


@njit
def insert_slot(x, new_id, Xt, ids, alpha, grad, status, spos, S, KSt, blocked, kc, fs, ist,
                is_anchor):
    """Append a slot for key x (or the anchor) with a = 0, status MOVING; fill its kernel
    column (into kc), its entries of K'[:, S], and its gradient g = 2 (K' a) + rho'."""
    n = ist[_N]
    p = n
    for k in range(Xt.shape[0]):
        Xt[k, p] = x[k]
    ids[p] = new_id
    alpha[p] = 0.0
    status[p] = MOVING
    spos[p] = -1
    blocked[p] = -1
    ist[_N] = n + 1
    if is_anchor:
        ist[_ANCHOR] = p
    kernel_column(Xt, n + 1, p, ist[_ANCHOR], fs[_INV_SIGMA2], kc)
    for q in range(ist[_M]):
        KSt[q, p] = kc[S[q]]
    s = 0.0
    for j in range(n):
        s += alpha[j] * kc[j]
    grad[p] = 2.0 * s + fs[_RHO]
    return p
