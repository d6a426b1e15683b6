"""Tolerances and fixed settings that more than one module of svtoolkit relies on.

Constants, and the two rules of the SVDD dual built on them (:func:`feasible`,
:func:`sums_to_one`), with no imports, so that every module (the Numba kernels included: they
read module globals when they are compiled) can take them from here without an import cycle.
A tolerance that only one module uses is defined in that module. The table of tolerances in
``docs/design.md`` lists every constant here and the module-local ones (tests check it).

Changing a value here changes compiled kernels: clear the Numba cache (``__pycache__/*.nbi``,
``*.nbc``) afterwards, since the cache does not track imported constants.
"""

# --- feasibility of the SVDD dual ------------------------------------------------------------
#: ``n C >= 1 - FEASIBILITY_TOL`` counts as feasible (the exact solver, the batched path, the
#: exact gates and the warm-up rule of the layers all decide it this way), and an error set
#: with ``|E| C`` within it of 1 sums to one. Why this value: ``C = 1 / n`` (or
#: ``1 / (nu n0)`` with ``nu n0 = n``) evaluated in floating point gives ``n C = 1 - 1.1e-16``
#: for n = 49, 98, 103, ... so the test needs a slack of a few ulps of 1 (the relative error of
#: such a C and of the product is at most ~3 eps = 6.7e-16). It must not be larger: a real
#: shortfall ``n C = 1 - e`` means the optimum carries ``e`` on a margin key whose f = 0 fixes
#: rho, and treating it as feasible snapped ``e`` away and left rho undetermined (measured with
#: ``e = 1e-13``, 20 keys: f off by 2.6e-2 and path-dependent under the former 1e-12).
FEASIBILITY_TOL = 1e-15
#: A problem with m keys is feasible when ``m C >= FEASIBLE_FROM`` (float64 product).
FEASIBLE_FROM = 1.0 - FEASIBILITY_TOL


def feasible(n, C):
    """Whether ``n`` keys with box constraint ``C`` can carry ``sum(a) = 1``.

    The one feasibility rule of the SVDD dual (``0 <= a_i <= C``, ``sum(a) = 1``): the
    float64 product ``n C >= FEASIBLE_FROM``. Below it the problem is in warm-up. Compiled
    kernels cannot call Python functions and compare with :data:`FEASIBLE_FROM` themselves.

    Parameters
    ----------
    n : int
        Number of keys (>= 0).
    C : float
        Box constraint.

    Returns
    -------
    bool
    """
    return float(n) * float(C) >= FEASIBLE_FROM


def sums_to_one(n, C):
    """Whether ``n`` keys at ``a_i = C`` (an error set with no margin key) give ``sum(a) = 1``.

    ``|n C - 1| <= FEASIBILITY_TOL`` in float64: the slack of :func:`feasible`, on both sides
    of 1. Then ``a = C`` on those keys is the one feasible point they leave, and rho is only
    known to lie in an interval.

    Parameters
    ----------
    n : int
        Number of keys at the upper bound (>= 0).
    C : float
        Box constraint.

    Returns
    -------
    bool
    """
    return abs(float(n) * float(C) - 1.0) <= FEASIBILITY_TOL


#: Error keys alone overflow the unit sum when ``|E| C > ERRORS_OVERFLOW_ABOVE`` (float64
#: product): the batched path (torch, MLX) then flags its estimated partition invalid. The
#: slack is :data:`FEASIBILITY_TOL` on the other side of 1, so that ``|E| = 1 / C`` keys with
#: C rounded up by an ulp still sum to one (the same rounding as in :func:`feasible`).
ERRORS_OVERFLOW_ABOVE = 1.0 + FEASIBILITY_TOL

# --- rest state of the exact solver (and the reference's canonical form) -----------------------
#: A margin coefficient within ``BOUND_SNAP * C`` of a bound is at that bound (the residue of
#: its own updates: a step that lands a coefficient on a bound computes it as a difference of
#: quantities of size C, so it ends a few ulps of C away; 1e-12 C leaves a wide margin above
#: that and far below any coefficient that matters).
BOUND_SNAP = 1e-12
#: Unit roundoff of fp64 (2^-53). The other residue a margin coefficient can carry is the
#: rounding of the sum ``sum(a) = 1`` it belongs to: the correction walk moves ``1 - fl(sum a)``
#: onto the margin set, so when no coefficient is truly free the last margin key keeps the
#: rounding of that sum (measured: 212 or more keys at ``C = 1/k`` sum to ``1 - 1.2e-12 C``
#: in slot order, just above ``BOUND_SNAP * C``, and the residue pinned rho at an arbitrary
#: point of its optimal interval, f off a fresh solve by up to 2.8e-3). Summed in order, the
#: rounding error of ``s = a_1 + ... + a_n`` is at most ``SUM_ROUNDOFF * sum_i |s_i|`` over the
#: computed partial sums s_i (each addition errs by at most u |s_i|, and the errors add), so a
#: margin coefficient within that bound of a bound is at that bound.
SUM_ROUNDOFF = 2.0**-53

# --- batched (approximate) path: torch, MLX and the fused Numba kernel -------------------------
#: Power iterations before the Lipschitz bound of FISTA is read off. The bound is a valid upper
#: bound after any number of them (Collatz-Wielandt); 16 from the all-ones vector bring it
#: within 1.5x of lambda_max on RBF Gram matrices (measured in the tests, docs/batched.md), so
#: the step is not needlessly short.
POWER_ITERS = 16
#: Safeguard on the capped-simplex projection's root search (a warning is issued if a row
#: reaches it). Measured: 2.1-3.4 warm-started passes per projection inside FISTA and 3-8 from a
#: cold start (docs/batched.md); the safeguard has never been hit.
PROJECTION_MAX_ITER = 100
#: Default threshold of the batched ``partition_masks``, a fraction of C: coefficients within
#: 1e-3 C of a bound are read as at the bound. Measured (docs/batched.md): at 80-160 FISTA
#: iterations this threshold reads the right partition for 99.76-99.93 % of Gaussian keys; a
#: coefficient still drifting towards a bound is put in that bound's set, not in the margin.
BATCHED_PARTITION_TOL = 1e-3
#: Default ridge on the margin block of the batched bordered system, the value of Forgetful
#: Attention (arXiv:2607.12204), eq. 6: it keeps the system non-singular for any estimated
#: partition of a PSD Gram matrix, at a measured bias of about 1e-3 C on the coefficients
#: (docs/batched.md).
RIDGE = 1e-3

# --- reference (interior point) -----------------------------------------------------------
#: The cvxpy reference reads the partition off the interior-point coefficients with this
#: threshold (a fraction of C) before its exact polish. Interior-point coefficients at the
#: reference's tolerances are accurate to about 1e-6 C, so a coefficient that close to a bound
#: is read as at it; the exact polish then repairs any misread key, one violator at a time.
IPM_PARTITION_TOL = 1e-6
