"""Batched training path: FISTA partition finder, capped-simplex projection, ridged solve.

One battery runs over every backend through the parametrized ``backend`` fixture: torch CPU
(float64, float32), torch CUDA (skipped without a device), MLX CPU (float64, float32) and MLX GPU
(skipped without one). References are in ``naive_batched.py``: the sorted breakpoint walk for the
projection, cvxpy/OSQP (eps 1e-10, polished) + an exact active-set polish for the SVDD optimum,
and an entry-by-entry bordered solve for the ridged system.

Seeds are fixed per test (``np.random.default_rng(SEED + k)``).
"""

from __future__ import annotations

import contextlib
import signal

import naive_batched as nb
import numpy as np
import pytest

SEED = 20261129

# Named tolerances, one table per dtype (float32 values measured with a margin of ~10x).
TOLERANCES = {
    "float64": {
        "proj_alpha": 1e-12,  # projection vs sorted reference, times max(1, |y|)
        "proj_sum": 1e-12,  # |sum(a) - 1|
        "fista_gap": 1e-10,  # (obj - obj*) / |obj*| after 800 iterations
        "padded": 1e-12,  # masked problem vs the same problem unpadded
        "ridged": 1e-10,  # ridged solve vs entry-by-entry reference, relative to C
        "exact": 1e-9,  # ridge 0 on the exact partition vs the exact optimum, relative to C
        "other": 1e-14,  # ridged result when another problem changes
    },
    "float32": {
        "proj_alpha": 2e-6,
        "proj_sum": 1e-5,
        "fista_gap": 2e-5,
        "padded": 5e-5,
        "ridged": 2e-3,
        "exact": 2e-3,
        "other": 1e-6,
    },
}

BACKENDS = [
    ("torch", "cpu", "float64"),
    ("torch", "cpu", "float32"),
    ("torch", "cuda", "float64"),
    ("torch", "cuda", "float32"),
    ("mlx", "cpu", "float64"),
    ("mlx", "cpu", "float32"),
    ("mlx", "gpu", "float32"),
]


class Backend:
    """Converts NumPy data to one framework/device/dtype and exposes its batched API."""

    def __init__(self, framework, device, dtype):
        self.framework, self.device, self.dtype = framework, device, dtype
        self.tol = TOLERANCES[dtype]
        if framework == "torch":
            torch = pytest.importorskip("torch")
            if device == "cuda" and not torch.cuda.is_available():
                pytest.skip("no CUDA device in this session (torch.cuda.is_available() is False)")
            from svtoolkit.torch import batched as api

            self.lib, self._dtype = torch, getattr(torch, dtype)
        else:
            mx = pytest.importorskip("mlx.core")
            if device == "gpu" and not mx.is_available(mx.gpu):
                pytest.skip("no MLX GPU (Metal or CUDA) in this session")
            from svtoolkit.mlx import batched as api

            self.lib, self._dtype = mx, getattr(mx, dtype)
        self.api = api

    def array(self, x):
        x = np.asarray(x)
        if self.framework == "torch":
            dtype = self.lib.bool if x.dtype == bool else self._dtype
            return self.lib.tensor(x, dtype=dtype, device=self.device)
        return self.lib.array(x) if x.dtype == bool else self.lib.array(x, dtype=self._dtype)

    def rounded(self, x):
        """The float x as this backend stores it (float32 rounding)."""
        return float(self.numpy(self.array(np.array([x])))[0])

    def numpy(self, a):
        if self.framework == "torch":
            a = a.detach().cpu()
            return a.numpy() if a.dtype == self.lib.bool else a.double().numpy()
        if a.dtype == self.lib.bool_:
            return np.array(a)
        return np.array(a.astype(self.lib.float64) if self.device == "cpu" else a, np.float64)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Run this module's torch work on one intra-op thread.

    The problems here are tiny (n <= 48): on a loaded 2-core machine torch's OpenMP threads
    made each small bmm 10-100x slower than one thread (measured: FISTA, G = 3, n = 40, 200
    iterations, 5.1 s with 2 threads vs 0.57 s with 1). Results do not depend on it.
    """
    from threadpoolctl import threadpool_limits

    # threadpoolctl, not torch.set_num_threads: restoring torch's thread count with the latter
    # leaves torch 2.13's batched CPU LU broken for the rest of the session (pytorch#142815)
    with threadpool_limits(limits=1, user_api="openmp"):
        yield


@pytest.fixture(params=BACKENDS, ids=["-".join(b) for b in BACKENDS])
def backend(request):
    framework, device, dtype = request.param
    bk = Backend(framework, device, dtype)
    if framework == "mlx":
        previous = bk.lib.default_device()
        bk.lib.set_default_device(bk.lib.gpu if device == "gpu" else bk.lib.cpu)
        yield bk
        bk.lib.set_default_device(previous)
    else:
        yield bk


# --------------------------------------------------------------------------------------------
# problems shared by several tests
# --------------------------------------------------------------------------------------------

C_SHARED = 1.0 / (0.3 * 24)  # C from nu = 0.3 at n0 = 24; feasible for every n >= 8


def _gram(X):
    return nb.rbf(X, X, nb.median_sigma(X))


def _pack(grams, n):
    """Zero-pad Gram matrices to n; garbage (NaN) off the mask that must never leak in."""
    G = len(grams)
    K = np.full((G, n, n), np.nan)
    mask = np.zeros((G, n), dtype=bool)
    for g, Kg in enumerate(grams):
        m = Kg.shape[0]
        K[g, :m, :m] = Kg
        mask[g, :m] = True
    return K, mask


@pytest.fixture(scope="module")
def gaussian_problems():
    """Three Gaussian-key problems (n = 24, 31, 40) with their exact optima."""
    rng = np.random.default_rng(SEED)
    grams = [_gram(nb.gaussian_keys(rng, n)) for n in (24, 31, 40)]
    exact = [nb.exact_svdd(K, C_SHARED) for K in grams]
    return grams, exact


# --------------------------------------------------------------------------------------------
# projection
# --------------------------------------------------------------------------------------------


def _projection_rows(rng, n):
    """Rows at three scales, rows with ties, and a row already on the simplex."""
    rows = [rng.normal(size=n) * scale for scale in (1e-3, 1.0, 100.0, 1.0, 100.0)]
    tied = rng.normal(size=n)
    tied[: n // 2] = tied[0]
    rows.append(tied)
    rows.append(np.full(n, 1.0 / n))
    return np.stack(rows)


def _assert_projection_kkt(y, a, C, tol):
    """a = clip(y - lam, 0, C) for one lam: free entries share y - a; bounds on the others."""
    free = (a > 0) & (a < C)
    if not free.any():
        return
    shift = y[free] - a[free]
    lam = shift.mean()
    assert np.ptp(shift) <= tol
    assert np.all(y[a == 0] <= lam + tol)
    assert np.all(y[a == C] >= lam + C - tol)


@pytest.mark.parametrize("C", [1.0 / 32, 0.05, 0.3, 2.0], ids=["nC=1", "C=0.05", "C=0.3", "C=2"])
def test_projection_matches_sorted_reference(backend, C):
    """Exact vs the breakpoint walk; feasible to 1e-12 (fp64); KKT of the projection."""
    rng = np.random.default_rng(SEED + 1)
    Y = _projection_rows(rng, 32)
    A = backend.numpy(backend.api.project_capped_simplex(backend.array(Y), C))
    Y = backend.numpy(backend.array(Y))  # the rows the backend actually saw (fp32 rounding)
    for y, a in zip(Y, A, strict=True):
        ref, _ = nb.project_capped_simplex_sorted(y, C)
        scale = max(1.0, np.abs(y).max())
        assert np.abs(a - ref).max() <= backend.tol["proj_alpha"] * scale
        # fp64: 1e-12 absolute at every scale; fp32 cannot resolve lam better than ulp(|y|)
        sum_scale = 1.0 if backend.dtype == "float64" else scale
        assert abs(a.sum() - 1.0) <= backend.tol["proj_sum"] * sum_scale
        assert a.min() >= 0.0 and a.max() <= backend.rounded(C)
        _assert_projection_kkt(y, a, backend.rounded(C), backend.tol["proj_alpha"] * scale)


def test_projection_mask_infeasible_and_empty_rows(backend):
    """Masked entries get exactly 0 and NaN there is ignored; m C < 1 gives C; empty gives 0."""
    rng = np.random.default_rng(SEED + 2)
    n, C = 10, 0.25
    Y = rng.normal(size=(4, n))
    mask = np.zeros((4, n), dtype=bool)
    mask[0, :6] = True
    mask[1, [0, 3, 4, 8, 9]] = True
    mask[2, :3] = True  # 3 * 0.25 < 1: infeasible
    Y[~mask] = np.nan
    A = backend.api.project_capped_simplex(backend.array(Y), C, mask=backend.array(mask))
    A = backend.numpy(A)
    for g in (0, 1):
        ref, _ = nb.project_capped_simplex_sorted(backend.numpy(backend.array(Y[g, mask[g]])), C)
        np.testing.assert_allclose(A[g, mask[g]], ref, rtol=0, atol=backend.tol["proj_alpha"])
    assert np.all(A[~mask] == 0.0)
    assert np.all(A[2, :3] == backend.rounded(C))
    assert np.all(A[3] == 0.0)


def test_lipschitz_bound_never_underestimates(backend):
    """RBF Gram (Collatz-Wielandt) and a Gram with negative entries (Gershgorin fallback)."""
    rng = np.random.default_rng(SEED + 3)
    X = rng.normal(size=(30, 4))
    grams = np.stack([_gram(X), X @ X.T])
    bound = backend.numpy(backend.api.lipschitz_bound(backend.array(grams)))
    top = np.array([np.linalg.eigvalsh(K)[-1] for K in grams])
    assert np.all(bound >= top * (1.0 - 1e-6))
    assert bound[0] <= 1.5 * top[0]  # tight enough for RBF that FISTA is not slowed down


# --------------------------------------------------------------------------------------------
# FISTA
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("restart", [False, True], ids=["plain", "restart"])
def test_fista_objective_approaches_the_exact_optimum(backend, gaussian_problems, restart):
    grams, exact = gaussian_problems
    K, mask = _pack(grams, 40)
    Kb, maskb = backend.array(K), backend.array(mask)
    gaps = {}
    for iters in (5, 40, 800):
        A = backend.api.fista_svdd(Kb, C_SHARED, mask=maskb, iters=iters, restart=restart)
        A = backend.numpy(A)
        gaps[iters] = []
        for g, (Kg, ref) in enumerate(zip(grams, exact, strict=True)):
            a = A[g, mask[g]]
            assert abs(a.sum() - 1.0) <= backend.tol["proj_sum"] * 10
            assert a.min() >= 0.0 and a.max() <= C_SHARED * (1 + 1e-6)
            gap = (nb.objective(Kg, a) - ref["objective"]) / abs(ref["objective"])
            gaps[iters].append(gap)
    gaps = {k: np.array(v) for k, v in gaps.items()}
    assert np.all(gaps[800] <= backend.tol["fista_gap"])
    assert np.all(gaps[5] > 10 * np.maximum(gaps[40], backend.tol["fista_gap"]))
    assert np.all(gaps[40] >= gaps[800] - backend.tol["fista_gap"])


def test_fista_recovers_the_exact_partition(backend, gaussian_problems):
    """At 400 iterations on Gaussian keys the estimated S and E equal the exact sets."""
    grams, exact = gaussian_problems
    K, mask = _pack(grams, 40)
    alpha = backend.api.fista_svdd(backend.array(K), C_SHARED, mask=backend.array(mask), iters=400)
    margin, error = backend.api.partition_masks(alpha, C_SHARED, mask=backend.array(mask))
    margin, error = backend.numpy(margin), backend.numpy(error)
    for g, ref in enumerate(exact):
        m = mask[g]
        np.testing.assert_array_equal(margin[g, m], ref["margin"])
        np.testing.assert_array_equal(error[g, m], ref["error"])


def test_fista_masked_problems_equal_unpadded(backend, gaussian_problems):
    """Prefix masks, a scattered mask and NaN off the mask: the same result as alone."""
    grams, _ = gaussian_problems
    n = 48
    K, mask = _pack(grams, n)
    perm = np.random.default_rng(SEED + 4).permutation(n)  # scatter the last problem's keys
    K[2] = K[2][np.ix_(perm, perm)]
    mask[2] = mask[2][perm]
    A = backend.numpy(backend.api.fista_svdd(backend.array(K), C_SHARED, mask=backend.array(mask)))
    for g, Kg in enumerate(grams):
        alone = backend.numpy(backend.api.fista_svdd(backend.array(Kg[None]), C_SHARED))[0]
        expected = np.zeros(n)
        if g == 2:  # position i holds original key perm[i]
            positions = np.flatnonzero(mask[2])
            expected[positions] = alone[perm[positions]]
        else:
            expected[: Kg.shape[0]] = alone
        np.testing.assert_allclose(A[g], expected, rtol=0, atol=backend.tol["padded"])
        assert np.all(A[g, ~mask[g]] == 0.0)


def test_fista_result_does_not_depend_on_other_problems(backend, gaussian_problems):
    """Replacing one problem (keys, length, warm-up) leaves every other result bit for bit."""
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    rng = np.random.default_rng(SEED + 5)
    K2, mask2 = K.copy(), mask.copy()
    K2[1], mask2[1] = _pack([_gram(nb.redundant_keys(rng, 36))], 40)[0][0], False
    mask2[1, :36] = True
    K3, mask3 = K.copy(), mask.copy()
    mask3[1] = False
    mask3[1, :5] = True  # warm-up: 5 C < 1
    results = [
        backend.numpy(backend.api.fista_svdd(backend.array(Ki), C_SHARED, mask=backend.array(mi)))
        for Ki, mi in ((K, mask), (K2, mask2), (K3, mask3))
    ]
    for other in results[1:]:
        np.testing.assert_array_equal(other[[0, 2]], results[0][[0, 2]])
    np.testing.assert_allclose(results[2][1, :5], C_SHARED, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# partition and ridged solve
# --------------------------------------------------------------------------------------------


def test_partition_masks_thresholds(backend):
    C = 0.2
    alpha = np.array([[0.0, 1e-4, 2e-3, 0.5, 1 - 2e-3, 1 - 1e-4, 1.0, 0.5]]) * C
    mask = np.ones_like(alpha, dtype=bool)
    mask[0, -1] = False
    margin, error = backend.api.partition_masks(
        backend.array(alpha), C, tol=1e-3, mask=backend.array(mask)
    )
    np.testing.assert_array_equal(backend.numpy(margin)[0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(backend.numpy(error)[0], [0, 0, 0, 0, 0, 1, 1, 0])
    margin, error = backend.api.partition_masks(backend.array(alpha), C, tol=0.0)
    np.testing.assert_array_equal(backend.numpy(margin)[0], [0, 1, 1, 1, 1, 1, 0, 1])
    np.testing.assert_array_equal(backend.numpy(error)[0], [0, 0, 0, 0, 0, 0, 1, 0])


@pytest.mark.parametrize("ridge", [1e-3, 1e-1])
def test_ridged_solve_matches_entrywise_reference(backend, gaussian_problems, ridge):
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    Kb, maskb = backend.array(K), backend.array(mask)
    alpha0 = backend.api.fista_svdd(Kb, C_SHARED, mask=maskb, iters=40)
    margin, error = backend.api.partition_masks(alpha0, C_SHARED, mask=maskb)
    alpha, rho, valid = backend.api.ridged_svdd_solve(
        Kb, C_SHARED, margin, error, ridge=ridge, mask=maskb
    )
    alpha, rho, valid = backend.numpy(alpha), backend.numpy(rho), backend.numpy(valid)
    margin, error = backend.numpy(margin), backend.numpy(error)
    Kseen = backend.numpy(Kb)
    assert valid.all()
    for g, Kg in enumerate(grams):
        m = Kg.shape[0]
        ref_alpha, ref_rho = nb.ridged_solve(
            Kseen[g, :m, :m], C_SHARED, np.flatnonzero(margin[g]), np.flatnonzero(error[g]), ridge
        )
        tol = backend.tol["ridged"]
        np.testing.assert_allclose(alpha[g, :m], ref_alpha, rtol=0, atol=tol * C_SHARED)
        np.testing.assert_allclose(rho[g], ref_rho, rtol=0, atol=tol)
        assert np.all(alpha[g, m:] == 0.0)


def test_ridge_zero_on_the_exact_partition_gives_the_exact_optimum(backend, gaussian_problems):
    """Sign convention and packing: alpha and rho equal the exact solver's."""
    grams, exact = gaussian_problems
    K, mask = _pack(grams, 40)
    margin, error = np.zeros_like(mask), np.zeros_like(mask)
    for g, ref in enumerate(exact):
        margin[g, : len(ref["margin"])] = ref["margin"]
        error[g, : len(ref["error"])] = ref["error"]
    alpha, rho, valid = backend.api.ridged_svdd_solve(
        backend.array(K), C_SHARED, backend.array(margin), backend.array(error), ridge=0.0,
        mask=backend.array(mask),
    )
    alpha, rho = backend.numpy(alpha), backend.numpy(rho)
    assert backend.numpy(valid).all()
    for g, ref in enumerate(exact):
        m = len(ref["alpha"])
        np.testing.assert_allclose(
            alpha[g, :m], ref["alpha"], rtol=0, atol=backend.tol["exact"] * C_SHARED
        )
        np.testing.assert_allclose(rho[g], ref["rho"], rtol=0, atol=backend.tol["exact"])


def test_ridged_result_does_not_depend_on_other_problems(backend, gaussian_problems):
    """Growing another problem's margin set (new padded width) changes others only by rounding."""
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    rng = np.random.default_rng(SEED + 6)
    margin = np.zeros_like(mask)
    error = np.zeros_like(mask)
    for g, Kg in enumerate(grams):
        margin[g, rng.choice(Kg.shape[0], size=6, replace=False)] = True
    margin2 = margin.copy()
    margin2[1, :31] = True  # 31 margin keys instead of 6
    out = [
        backend.api.ridged_svdd_solve(
            backend.array(K), C_SHARED, backend.array(s), backend.array(error),
            mask=backend.array(mask),
        )
        for s in (margin, margin2)
    ]
    for first, second in zip(*out, strict=True):
        first, second = backend.numpy(first), backend.numpy(second)
        np.testing.assert_allclose(second[[0, 2]], first[[0, 2]], rtol=0, atol=backend.tol["other"])


def test_a_problem_gives_the_same_bits_wherever_it_sits_in_its_batch(backend,
                                                                    gaussian_problems):
    """The same problem solved alone and at the fourth place of a batch of problems of its own
    margin size with more error keys: the same bits (``torch.equal``, not a tolerance). The SV
    layers' exact causality rests on it: a chunk boundary's bucket also holds the later
    prefixes, whose number decides its place and whose error counts pad its error block. On
    an AMD EPYC (torch's default MKL, no ``MKL_CBWR``) both broke it before the bordered
    systems were padded to a multiple of 8 rows and the error sums taken in index order: MKL's
    LU rounded a 17-row system differently at places 3 and 4 of a batch (1.7e-16), and a plain
    sum over a zero-padded error axis rounds with its length."""
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    rng = np.random.default_rng(SEED + 12)
    groups = np.array([2, 2, 2, 2])
    masks = np.repeat(mask[2:3], 4, axis=0)
    margin, error = np.zeros_like(masks), np.zeros_like(masks)
    picks = [rng.permutation(40) for _ in range(3)]
    picks.append(picks[2])  # the problem watched: the third one's keys, fewer error keys
    for i, (picked, n_errors) in enumerate(zip(picks, (3, 9, 11, 3), strict=True)):
        margin[i, picked[:16]] = True
        error[i, picked[16:16 + n_errors]] = True

    def solve(rows):
        index = groups[rows]
        return backend.api.ridged_svdd_solve(
            backend.array(K), C_SHARED, backend.array(margin[rows]), backend.array(error[rows]),
            mask=backend.array(masks[rows]), groups=backend.lib.tensor(index)
            if backend.framework == "torch" else backend.lib.array(index))

    alone, batch = solve(slice(3, 4)), solve(slice(0, 4))
    for one, many in zip(alone, batch, strict=True):
        np.testing.assert_array_equal(backend.numpy(many)[3], backend.numpy(one)[0])


def test_problems_on_shared_grams_equal_problems_on_copies(backend, gaussian_problems):
    """``groups=``: problems posed on K[groups[i]] give what the same problems give on copied
    Gram matrices (values; in torch also the gradient, summed over the copies)."""
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    groups = np.array([0, 0, 1, 2, 2, 1, 2])
    rng = np.random.default_rng(SEED + 10)
    masks = mask[groups].copy()
    for i, m in enumerate((24, 16, 31, 40, 28, 20, 12)):
        masks[i, m:] = False
    margin, error = np.zeros_like(masks), np.zeros_like(masks)
    for i in range(len(groups)):
        inside = np.flatnonzero(masks[i])
        picked = rng.permutation(inside)
        margin[i, picked[: len(inside) // 2]] = True
        error[i, picked[-1]] = True
    args = [backend.array(a) for a in (margin, error)]
    copied = backend.array(K[groups])
    shared = backend.array(K)
    if backend.framework == "torch":
        copied.requires_grad_()
        shared.requires_grad_()
    out_copied = backend.api.ridged_svdd_solve(copied, C_SHARED, *args,
                                               mask=backend.array(masks))
    out_shared = backend.api.ridged_svdd_solve(shared, C_SHARED, *args,
                                               mask=backend.array(masks),
                                               groups=backend.lib.tensor(groups)
                                               if backend.framework == "torch"
                                               else backend.lib.array(groups))
    assert backend.numpy(out_shared[2]).all()
    for a, b in zip(out_copied, out_shared, strict=True):
        np.testing.assert_allclose(backend.numpy(b), backend.numpy(a), rtol=0,
                                   atol=backend.tol["other"])
    if backend.framework == "torch":
        weights = backend.array(rng.normal(size=masks.shape))
        for alpha, rho, _ in (out_copied, out_shared):
            ((alpha * weights).sum() + (rho * rho).sum()).backward()
        summed = np.zeros_like(K)
        np.add.at(summed, groups, backend.numpy(copied.grad))
        np.testing.assert_allclose(backend.numpy(shared.grad), summed, rtol=0,
                                   atol=backend.tol["other"] * max(1.0, np.abs(summed).max()))


def test_groups_are_checked(backend, gaussian_problems):
    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    none = backend.array(np.zeros((2, 40), dtype=bool))
    make = backend.lib.tensor if backend.framework == "torch" else backend.lib.array
    with pytest.raises(ValueError, match="groups must index K's first axis, 0 .. 2"):
        backend.api.ridged_svdd_solve(backend.array(K), C_SHARED, none, none,
                                      groups=make(np.array([0, 3])))
    with pytest.raises(TypeError, match="groups must be a 1-d integer"):
        backend.api.ridged_svdd_solve(backend.array(K), C_SHARED, none, none,
                                      groups=make(np.array([0.0, 1.0])))


def _invalid_batch():
    """Rows: valid, warm-up, empty margin set, |E| C > 1, exact duplicate keys both in S."""
    rng = np.random.default_rng(SEED + 7)
    n, C = 8, 0.3
    X = rng.normal(size=(n, 3))
    X[7] = X[6]  # exact duplicate
    K = np.repeat(_gram(X)[None], 5, axis=0)
    mask = np.ones((5, n), dtype=bool)
    mask[1, 3:] = False  # 3 * 0.3 < 1
    margin = np.zeros((5, n), dtype=bool)
    error = np.zeros((5, n), dtype=bool)
    margin[[0, 1, 3], :2] = True
    error[0, 2] = True
    margin[1, 2] = False
    error[3, 2:6] = True  # 4 * 0.3 > 1
    margin[4, [0, 6, 7]] = True  # duplicate keys 6 and 7: singular without a ridge
    error[2, 0] = True
    return K, mask, margin, error, C


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_invalid_problems_are_flagged_never_nan(backend, ridge):
    K, mask, margin, error, C = _invalid_batch()
    expected = np.array([True, False, False, False, ridge > 0])
    if backend.framework == "torch":
        torch = backend.lib
        Kt = backend.array(K).requires_grad_()
        alpha, rho, valid = backend.api.ridged_svdd_solve(
            Kt, C, backend.array(margin), backend.array(error), ridge=ridge,
            mask=backend.array(mask),
        )
        (alpha.sum() + rho.sum()).backward()
        grad = backend.numpy(Kt.grad)
        assert torch.isfinite(alpha).all() and torch.isfinite(rho).all()
    else:
        mx = backend.lib

        def loss(Km):
            a, r, _ = backend.api.ridged_svdd_solve(
                Km, C, backend.array(margin), backend.array(error), ridge=ridge,
                mask=backend.array(mask),
            )
            return mx.sum(a) + mx.sum(r)

        alpha, rho, valid = backend.api.ridged_svdd_solve(
            backend.array(K), C, backend.array(margin), backend.array(error), ridge=ridge,
            mask=backend.array(mask),
        )
        grad = backend.numpy(mx.grad(loss)(backend.array(K)))
    alpha, rho, valid = backend.numpy(alpha), backend.numpy(rho), backend.numpy(valid)
    np.testing.assert_array_equal(valid, expected)
    assert np.isfinite(grad).all()
    assert np.all(alpha[~valid] == 0.0) and np.all(rho[~valid] == 0.0)
    assert np.isfinite(alpha).all() and abs(alpha[0].sum() - 1.0) < 1e-5


def test_input_errors_name_the_argument(backend):
    api, C = backend.api, 0.3
    K = backend.array(np.eye(4)[None])
    with pytest.raises(ValueError, match=r"K must have shape \(G, n, n\)"):
        api.fista_svdd(backend.array(np.eye(4)), C)
    with pytest.raises(ValueError, match="C must be finite and > 0"):
        api.fista_svdd(K, -1.0)
    with pytest.raises(TypeError, match="C must be a real number"):
        api.fista_svdd(K, "0.3")
    with pytest.raises(ValueError, match="mask must have shape"):
        api.fista_svdd(K, C, mask=backend.array(np.ones((1, 3), dtype=bool)))
    with pytest.raises(TypeError, match="mask must be a bool"):
        api.fista_svdd(K, C, mask=backend.array(np.ones((1, 4))))
    with pytest.raises(ValueError, match="K contains NaN or inf"):
        api.fista_svdd(backend.array(np.full((1, 4, 4), np.nan)), C)
    with pytest.raises(ValueError, match="iters must be >= 0; got -1"):
        api.fista_svdd(K, C, iters=-1)
    with pytest.raises(TypeError, match="iters must be an int; got float"):
        api.fista_svdd(K, C, iters=2.0)
    with pytest.raises(ValueError, match="y contains NaN or inf"):
        api.project_capped_simplex(backend.array(np.full((1, 4), np.inf)), C)
    with pytest.raises(ValueError, match=r"tol must be finite and in \[0.0, 0.5\); got 0.7"):
        api.partition_masks(backend.array(np.ones((1, 4))), C, tol=0.7)
    both = backend.array(np.array([[True, False, False, False]]))
    with pytest.raises(ValueError, match="overlap"):
        api.ridged_svdd_solve(K, C, both, both)
    with pytest.raises(ValueError, match="ridge must be finite and >= 0; got -1.0"):
        api.ridged_svdd_solve(K, C, both, backend.array(np.zeros((1, 4), dtype=bool)), ridge=-1.0)
    with pytest.raises(ValueError, match="margin_mask marks keys outside mask"):
        api.ridged_svdd_solve(
            K, C, both, backend.array(np.zeros((1, 4), dtype=bool)),
            mask=backend.array(np.array([[False, True, True, True]])),
        )


# --------------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gradcheck_ridged_path_end_to_end(device):
    """Keys, values, queries -> RBF Gram -> ridged solve -> readout and decision, in fp64.

    The partition is read by FISTA at the unperturbed keys and checked to be stable under the
    finite-difference perturbations; gradcheck then differentiates the ridged approximation.
    """
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device in this session (torch.cuda.is_available() is False)")
    from svtoolkit.torch import fista_svdd, partition_masks, ridged_svdd_solve

    gen = torch.Generator().manual_seed(SEED + 8)
    G, n, d, C, sigma = 2, 10, 3, 0.25, 1.5
    X = torch.randn(G, n, d, generator=gen, dtype=torch.float64).to(device)
    V = torch.randn(G, n, 2, generator=gen, dtype=torch.float64).to(device)
    Q = torch.randn(G, 4, d, generator=gen, dtype=torch.float64).to(device)

    def rbf(A, B):
        return torch.exp(-((A[:, :, None, :] - B[:, None, :, :]) ** 2).sum(-1) / sigma**2)

    def partition(X):
        return partition_masks(fista_svdd(rbf(X, X), C, iters=400), C)

    margin, error = partition(X)
    for shift in (1e-6, -1e-6):
        m2, e2 = partition(X + shift)
        assert torch.equal(m2, margin) and torch.equal(e2, error)

    def layer(X, V, Q):
        alpha, rho, valid = ridged_svdd_solve(rbf(X, X), C, margin, error)
        assert bool(valid.all())
        weights = rbf(Q, X) * alpha[:, None, :]
        readout = weights @ V / weights.sum(-1, keepdim=True)
        decision = 2.0 * weights.sum(-1) - 1.0 + rho[:, None]
        return readout, decision

    inputs = tuple(t.clone().requires_grad_() for t in (X, V, Q))
    assert torch.autograd.gradcheck(layer, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_mlx_ridged_gradient_matches_finite_differences():
    """mx.grad through the custom solve VJP vs central differences, fp64 on the CPU."""
    mx = pytest.importorskip("mlx.core")
    from svtoolkit.mlx import ridged_svdd_solve

    rng = np.random.default_rng(SEED + 9)
    G, n, C = 2, 12, 0.25
    K = np.stack([_gram(rng.normal(size=(n, 3))) for _ in range(G)])
    margin = np.zeros((G, n), dtype=bool)
    error = np.zeros((G, n), dtype=bool)
    margin[:, :5] = True
    error[:, 5:7] = True
    weights = mx.array(rng.normal(size=(G, n)), dtype=mx.float64)

    def loss(Km):
        alpha, rho, _ = ridged_svdd_solve(Km, C, mx.array(margin), mx.array(error))
        return mx.sum(alpha * weights) + mx.sum(rho * rho)

    with mx.stream(mx.cpu):
        grad = np.array(mx.grad(loss)(mx.array(K, dtype=mx.float64)))
        for _ in range(3):
            D = rng.normal(size=K.shape)
            D = D + D.transpose(0, 2, 1)
            h = 1e-6
            plus = loss(mx.array(K + h * D, dtype=mx.float64)).item()
            minus = loss(mx.array(K - h * D, dtype=mx.float64)).item()
            numeric = (plus - minus) / (2 * h)
            assert abs((grad * D).sum() - numeric) <= 1e-6 * max(1.0, abs(numeric))


def test_torch_and_mlx_agree_in_float64(gaussian_problems):
    """Two independent implementations of the same algorithm, compared to rounding."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("mlx.core")
    import svtoolkit.mlx as smx
    import svtoolkit.torch as st

    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    at = st.fista_svdd(torch.tensor(K), C_SHARED, mask=torch.tensor(mask), iters=120)
    am = smx.fista_svdd(mx.array(K, dtype=mx.float64), C_SHARED, mask=mx.array(mask), iters=120)
    np.testing.assert_allclose(np.array(am), at.numpy(), rtol=0, atol=1e-12)
    st_masks = st.partition_masks(at, C_SHARED, mask=torch.tensor(mask))
    rt = st.ridged_svdd_solve(torch.tensor(K), C_SHARED, *st_masks, mask=torch.tensor(mask))
    mx_masks = tuple(mx.array(m.numpy()) for m in st_masks)
    rm = smx.ridged_svdd_solve(
        mx.array(K, dtype=mx.float64), C_SHARED, *mx_masks, mask=mx.array(mask)
    )
    for a, b in zip(rt[:2], rm[:2], strict=True):
        np.testing.assert_allclose(np.array(b), a.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("restart", [False, True])
def test_fused_cpu_kernel_equals_the_tensor_path(gaussian_problems, dtype, restart):
    """backend='numba' (fused CPU kernel, the CPU default) runs the same algorithm as the
    tensor operations of backend='torch': equal to rounding (float32: its own tolerance)."""
    torch = pytest.importorskip("torch")
    import svtoolkit.torch as st

    grams, _ = gaussian_problems
    K, mask = _pack(grams, 40)
    Kt = torch.tensor(K, dtype=getattr(torch, dtype))
    mt = torch.tensor(mask)
    fused = st.fista_svdd(Kt, C_SHARED, mask=mt, iters=80, restart=restart, backend="numba")
    tensor = st.fista_svdd(Kt, C_SHARED, mask=mt, iters=80, restart=restart, backend="torch")
    assert fused.dtype == Kt.dtype
    tol = 1e-12 if dtype == "float64" else TOLERANCES["float32"]["padded"]
    np.testing.assert_allclose(fused.numpy(), tensor.numpy(), rtol=0, atol=tol)
    assert torch.all(fused[~mt] == 0)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'numba', 'torch'"):
        st.fista_svdd(Kt, C_SHARED, mask=mt, backend="cuda")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("restart", [False, True])
def test_prefix_kernel_equals_the_batch_kernel_bit_for_bit(dtype, restart):
    """The lockstep prefix kernel (every chunk boundary of a Gram together) gives each prefix
    problem exactly what the one-problem-per-thread kernel gives it on its own masked Gram:
    excluded keys, warm-up prefixes (m C < 1) and boxes with error keys included."""
    from svtoolkit._fista import fista_batch, fista_prefix_batch
    from svtoolkit._rules import POWER_ITERS

    rng = np.random.default_rng(SEED + 11)
    for G, P, chunk in [(3, 40, 8), (2, 130, 13)]:
        X = rng.normal(size=(G, P, 4))
        K = np.exp(-((X[:, :, None] - X[:, None]) ** 2).sum(-1) / 8).astype(dtype)
        keep = rng.random((G, P)) > 0.2
        ends = np.arange(chunk, P + 1, chunk, dtype=np.int64)
        J = len(ends)
        masks = np.repeat(keep[:, None], J, axis=1)
        for j, end in enumerate(ends):
            masks[:, j, end:] = False
        for C in (0.05, 0.25, 0.6):
            lockstep = np.empty((G, J, P), dtype)
            fista_prefix_batch(K, keep, ends, C, 60, POWER_ITERS, restart, lockstep)
            alone = np.empty((G * J, P), dtype)
            fista_batch(np.repeat(K, J, axis=0), masks.reshape(-1, P), C, 60, POWER_ITERS,
                        restart, alone)
            np.testing.assert_array_equal(lockstep.reshape(-1, P), alone)


_THREAD_BUG_SCRIPT = r"""
import sys
import numpy as np
import torch
sys.path.insert(0, sys.argv[1])
import naive_batched as nb
from svtoolkit.torch import ridged_svdd_solve

torch.set_num_threads(2)  # torch 2.13's batched CPU LU is wrong after this (pytorch#142815)
rng = np.random.default_rng(0)
X = rng.standard_normal((6, 200, 4))
K = np.stack([nb.rbf(x, x, 0.15) for x in X])
C = 1.0 / 20.0
margin = np.ones((6, 200), bool)
error = np.zeros((6, 200), bool)
alpha, rho, valid = ridged_svdd_solve(torch.tensor(K), C, torch.tensor(margin),
                                      torch.tensor(error), ridge=1e-3)
worst = 0.0
for g in range(6):
    a_ref, r_ref = nb.ridged_solve(K[g], C, np.flatnonzero(margin[g]), np.flatnonzero(error[g]),
                                   1e-3)
    worst = max(worst, float(np.abs(alpha[g].numpy() - a_ref).max()), abs(float(rho[g]) - r_ref))
# the backward on the same one-matrix path: directional derivatives by central differences
Kt = torch.tensor(K, requires_grad=True)
w = torch.tensor(rng.standard_normal((6, 200)))

def loss(K):
    alpha, rho, _ = ridged_svdd_solve(K, C, torch.tensor(margin), torch.tensor(error), ridge=1e-3)
    return (alpha * w).sum() + (rho * rho).sum()

loss(Kt).backward()
worst_grad = 0.0
for _ in range(2):
    D = torch.tensor(rng.standard_normal(K.shape))
    h = 1e-6
    with torch.no_grad():
        numeric = (loss(Kt + h * D) - loss(Kt - h * D)) / (2 * h)
    error_d = abs(float((Kt.grad * D).sum() - numeric)) / max(1.0, abs(float(numeric)))
    worst_grad = max(worst_grad, error_d)
print(bool(valid.all()), worst, worst_grad)
"""


def test_ridged_solve_survives_the_torch_thread_bug(tmp_path):
    """After torch.set_num_threads(2), torch 2.13's batched CPU LU returns wrong solutions
    (or raises) for systems larger than ~150; the ridged solve factorises such systems one at
    a time (and checks every residual), in the forward and in the backward's adjoint solves.
    Run in a subprocess: the bad state is global."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "thread_bug.py"
    script.write_text(_THREAD_BUG_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300, check=True)
    valid, worst, worst_grad = out.stdout.split()[-3:]
    assert valid == "True" and float(worst) <= 1e-10
    # central differences at h = 1e-6: rounding eps |L| / h ~ 1e-10 |L|, amplified by the
    # ridged system's conditioning (ridge 1e-3); a wrong adjoint is off by O(1)
    assert float(worst_grad) <= 1e-6


# --------------------------------------------------------------------------------------------
# property test and a slow, larger comparison
# --------------------------------------------------------------------------------------------


def test_projection_property_torch_float64():
    """Random lengths, scales and boxes (hypothesis): torch fp64 equals the sorted walk."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from svtoolkit.torch import project_capped_simplex

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=24),
        st.floats(0.0, 3.0),
    )
    def check(values, extra):
        y = np.array(values)
        C = 1.0 / len(y) + extra
        if len(y) * C < 1.0:  # 1/n rounded down: the box is infeasible, not this test's case
            C = np.nextafter(C, 2.0)
        a = project_capped_simplex(torch.tensor(y)[None], C)[0].numpy()
        ref, _ = nb.project_capped_simplex_sorted(y, C)
        scale = max(1.0, np.abs(y).max())
        assert np.abs(a - ref).max() <= 1e-12 * scale
        assert abs(a.sum() - 1.0) <= 1e-12 * scale

    check()


@pytest.mark.slow
@pytest.mark.parametrize("kind, bound", [("gaussian", 1e-9), ("redundant", 1e-6)])
def test_fista_at_n256_reaches_the_exact_objective(backend, kind, bound):
    """n = 256 (the accuracy study's size): relative objective gap after 1000 iterations.

    Near-duplicate clusters make the problem nearly singular and FISTA slow: measured gaps
    1.6e-7 and 1.2e-7 there (1e-13 on Gaussian keys), hence the looser bound.
    """
    rng = np.random.default_rng(SEED + 10)
    make = nb.gaussian_keys if kind == "gaussian" else nb.redundant_keys
    grams = [_gram(make(rng, 256)) for _ in range(2)]
    C = 1.0 / (0.2 * 256)
    exact = [nb.exact_svdd(K, C) for K in grams]
    A = backend.numpy(backend.api.fista_svdd(backend.array(np.stack(grams)), C, iters=1000))
    for Kg, ref, a in zip(grams, exact, A, strict=True):
        gap = (nb.objective(Kg, a) - ref["objective"]) / abs(ref["objective"])
        assert gap <= max(backend.tol["fista_gap"], bound)


# --------------------------------------------------------------------------------------------
# feasibility to rounding at every box, count thresholds, empty shapes
# --------------------------------------------------------------------------------------------

BOXES = [0.05, 1.0, 100.0, 1e4]


def _eps(backend):
    return float(np.finfo(backend.dtype).eps)


@pytest.mark.parametrize("C", BOXES, ids=[f"C={C:g}" for C in BOXES])
def test_projection_sum_is_at_rounding_level_for_every_box(backend, C):
    """``|sum(a) - 1| <= 4 eps (1 + |F| |lam|)`` (F the free entries) at n = 256, whatever
    ``m C``: the stopping tolerance once grew with ``m C`` (1.2e-2 at C = 100 in float32)."""
    rng = np.random.default_rng(SEED + 11)
    Y = backend.numpy(backend.array(rng.normal(size=(64, 256)) * 0.05))
    A = backend.numpy(backend.api.project_capped_simplex(backend.array(Y), C))
    for y, a in zip(Y, A, strict=True):
        ref, lam = nb.project_capped_simplex_sorted(y, C)
        n_free = np.count_nonzero((ref > 0) & (ref < C))
        assert abs(a.sum() - 1.0) <= 4 * _eps(backend) * (1 + n_free * abs(lam))


@pytest.mark.parametrize("C", BOXES + [1e30], ids=[f"C={C:g}" for C in BOXES + [1e30]])
def test_fista_iterate_is_feasible_to_rounding_for_every_box(backend, gaussian_problems, C):
    """FISTA's iterate sums to 1 within 4 eps on every feasible problem, for the fused Numba
    kernel and the tensor path alike. K = I (4 keys) is solved by the uniform point; with the
    old tolerance it stopped at [0.5] * 4 for C >= 1e6 (float32) and C >= 1e16 (float64)."""
    grams, _ = gaussian_problems
    K, mask = _pack(grams + [np.eye(4)], 40)
    runs = [{}]  # the CPU torch backend has two paths: the fused Numba kernel and tensor ops
    if backend.framework == "torch" and backend.device == "cpu":
        runs = [{"backend": "numba"}, {"backend": "torch"}]
    feasible = mask.sum(-1) * C >= 1.0
    for kwargs in runs:
        A = backend.api.fista_svdd(backend.array(K), C, mask=backend.array(mask), **kwargs)
        A = backend.numpy(A)
        assert np.all(np.abs(A[feasible].sum(-1) - 1.0) <= 4 * _eps(backend)), kwargs
        if feasible[3]:
            np.testing.assert_allclose(A[3, :4], 0.25, rtol=0, atol=4 * _eps(backend))


@contextlib.contextmanager
def _time_limit(seconds):
    """Raise TimeoutError after ``seconds`` of pure-Python work (SIGALRM; POSIX only)."""
    if not hasattr(signal, "setitimer"):
        pytest.skip("needs signal.setitimer (POSIX)")

    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


TINY_AND_EDGE_BOXES = [1e-30, 1e-19, 1e-17, 1e-10, 1 / 49, 1 / 3, 1 / (2**31 - 1), 1.0, 1e30]


@pytest.mark.parametrize("C", TINY_AND_EDGE_BOXES, ids=[f"C={C:.3g}" for C in TINY_AND_EDGE_BOXES])
def test_count_thresholds_agree_between_torch_and_mlx(C):
    """Warm-up (``m C < 1 - FEASIBILITY_TOL``) and ``|E| C > 1 + FEASIBILITY_TOL`` are decided
    identically by torch (float64 products) and MLX (an integer threshold), for tiny C too:
    MLX once overflowed int32 (C = 1e-10), raised std::bad_cast (1e-19) and looped forever
    (1e-30)."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("mlx.core")
    from svtoolkit._rules import FEASIBILITY_TOL
    from svtoolkit.mlx import batched as mb
    from svtoolkit.torch import batched as tb

    counts = [0, 1, 2, 3, 48, 49, 50, 10**6, 2**31 - 2, 2**31 - 1]
    m_t, m_x = torch.tensor(counts), mx.array(counts, dtype=mx.int32)
    with _time_limit(5.0):
        feasible = np.array(mb._feasible(m_x, C))
        too_many = np.array(mb._too_many_errors(m_x, C))
    np.testing.assert_array_equal(feasible, tb._feasible(m_t, C).numpy())
    np.testing.assert_array_equal(feasible, [k > 0 and k * C >= 1.0 - FEASIBILITY_TOL
                                             for k in counts])
    np.testing.assert_array_equal(too_many, [k * C > 1.0 + FEASIBILITY_TOL for k in counts])


@pytest.mark.parametrize("C", [1e-30, 1e-19, 1e-10])
def test_tiny_box_is_warm_up_on_every_backend(backend, C):
    """A box no count can fill: every problem is in warm-up (C on its keys, invalid), no error."""
    K = backend.array(np.repeat(np.eye(4)[None], 2, axis=0))
    margin = np.zeros((2, 4), dtype=bool)
    margin[:, :2] = True
    none = backend.array(np.zeros((2, 4), dtype=bool))
    A = backend.numpy(backend.api.fista_svdd(K, C))
    np.testing.assert_array_equal(A, np.full((2, 4), backend.rounded(C)))
    P = backend.numpy(backend.api.project_capped_simplex(backend.array(np.eye(4)[:2]), C))
    np.testing.assert_array_equal(P, np.full((2, 4), backend.rounded(C)))
    _, _, valid = backend.api.ridged_svdd_solve(K, C, backend.array(margin), none)
    assert not backend.numpy(valid).any()


def test_feasibility_is_the_exact_solvers_rule(backend):
    """n = 49, C = 1/49: ``49 * (1/49)`` rounds to just below 1 in float64. The exact path
    certifies it (``n C >= 1 - FEASIBILITY_TOL``); the batched path agrees and solves a
    consistent partition (one margin key, 48 error keys) instead of calling it warm-up."""
    n, C = 49, 1.0 / 49
    assert n * C < 1.0
    rng = np.random.default_rng(SEED + 12)
    K = _gram(rng.normal(size=(n, 3)))[None]
    margin = np.zeros((1, n), dtype=bool)
    margin[0, 0] = True
    error = ~margin
    _, _, valid = backend.api.ridged_svdd_solve(
        backend.array(K), C, backend.array(margin), backend.array(error), ridge=0.0
    )
    assert backend.numpy(valid).all()
    A = backend.numpy(backend.api.fista_svdd(backend.array(K), C))
    assert abs(A.sum() - 1.0) <= 64 * _eps(backend)


@pytest.mark.parametrize("G, n", [(0, 3), (2, 0), (0, 0)])
def test_empty_batch_or_key_axis_gives_empty_outputs(backend, G, n):
    """G = 0 problems or n = 0 keys: every function returns outputs of the right shapes."""
    api = backend.api
    K = backend.array(np.zeros((G, n, n)))
    Y = backend.array(np.zeros((G, n)))
    none = backend.array(np.zeros((G, n), dtype=bool))
    assert backend.numpy(api.fista_svdd(K, 0.5)).shape == (G, n)
    assert backend.numpy(api.project_capped_simplex(Y, 0.5)).shape == (G, n)
    assert backend.numpy(api.lipschitz_bound(K)).shape == (G,)
    alpha, rho, valid = api.ridged_svdd_solve(K, 0.5, none, none)
    assert backend.numpy(alpha).shape == (G, n)
    assert backend.numpy(rho).shape == (G,)
    assert backend.numpy(valid).shape == (G,) and not backend.numpy(valid).any()
    if backend.framework == "torch":
        out = api.fista_svdd(K, 0.5, backend="torch")
        assert tuple(out.shape) == (G, n)
