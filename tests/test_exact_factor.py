"""The fresh inverse of the bordered margin matrix (``svtoolkit.exact._factor``)."""

from __future__ import annotations

import numpy as np
import pytest

from svtoolkit import rbf_kernel
from svtoolkit.exact import _bulk as B
from svtoolkit.exact import _factor as F
from svtoolkit.exact import _landing as L
from svtoolkit.exact import _walk as W

EPS = 2.0**-52


def bordered(K):
    """M' = [[0, 1^T], [1, 2 (K - 1)]] of a kernel matrix K (m, m)."""
    m = K.shape[0]
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * (K - 1.0)
    return M


def gaussian_bordered(m, d, width, seed=0):
    """M' of m Gaussian keys in R^d under a kernel ``width`` x their median distance."""
    X = np.random.default_rng(seed).standard_normal((m, d))
    dist = np.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(-1))
    median = np.median(dist[np.triu_indices(m, 1)]) if m > 1 else 1.0
    return bordered(rbf_kernel(X, sigma=width * median))


def residual_bound(M, R):
    """A backward-stable inverse has ``|R M - I|_max <= c (m + 1) eps |R|_inf |M|_inf`` with c
    of order one (LU and Cholesky alike; c = 4 leaves room for the rank-one term and the
    border's identity, each one rounding per entry)."""
    norm = lambda A: np.abs(A).sum(axis=1).max()  # noqa: E731
    return 4.0 * M.shape[0] * EPS * norm(R) * norm(M)


def inverse(M):
    """``bordered_inverse`` into a buffer of its own size."""
    return F.bordered_inverse(M, np.empty_like(M))


def no_lu(monkeypatch):
    def forbidden(M):
        raise AssertionError("LU taken where the Cholesky route applies")

    monkeypatch.setattr(F.np.linalg, "inv", forbidden)


@pytest.mark.parametrize("m", [1, 2, 63, 64, 65, 130])
def test_the_cholesky_route_inverts_a_well_conditioned_margin_matrix(m, monkeypatch):
    """Narrow kernels (cond(2 K) near 1): no LU; R M' = I within the backward-error bound, R
    exactly symmetric, and R's border what the identity gives (R_00 = 2 - 1/s)."""
    M = gaussian_bordered(m, 6, 0.2, seed=m)
    no_lu(monkeypatch)
    R = inverse(M)
    assert R.shape == M.shape
    assert np.array_equal(R, R.T)
    assert np.abs(R @ M - np.eye(m + 1)).max() <= residual_bound(M, R)
    # s = 1^T (2 K)^{-1} 1 by an independent LU solve: at cond(2 K) near 1 both agree to about
    # m eps (3e-14 at m = 130), far inside 1e-12
    u = np.linalg.solve(M[1:, 1:] + 2.0, np.ones(m))
    assert R[0, 0] == pytest.approx(2.0 - 1.0 / u.sum(), rel=1e-12)


def test_the_border_identity_holds_for_any_shift():
    """B(c)^{-1} = B(0)^{-1} - c e_0 e_0^T for B(c) = [[0, 1^T], [1, A + c 1 1^T]]."""
    rng = np.random.default_rng(1)
    G = rng.standard_normal((7, 7))
    A = G @ G.T + np.eye(7)

    def B(c):
        out = np.zeros((8, 8))
        out[0, 1:] = out[1:, 0] = 1.0
        out[1:, 1:] = A + c
        return out

    for c in (-2.0, 0.5, 3.0):
        shifted = np.linalg.inv(B(0.0))
        shifted[0, 0] -= c
        np.testing.assert_allclose(np.linalg.inv(B(c)), shifted, atol=1e-12)


def test_an_ill_conditioned_margin_matrix_is_inverted_by_lu():
    """Wide kernels (cond(2 K) far above 1 / CHOLESKY_MIN_RCOND): LU's inverse, to the bit."""
    M = gaussian_bordered(50, 2, 1.0)
    assert np.linalg.cond(M[1:, 1:] + 2.0) > 1e3 / F.CHOLESKY_MIN_RCOND
    np.testing.assert_array_equal(inverse(M), np.linalg.inv(M))


def test_the_warm_up_anchor_keeps_the_cholesky_route(monkeypatch):
    """The anchor's unshifted kernel row is e_anchor (k(anchor, x) = 0, k(anchor, anchor) =
    1): 2 K_SS stays positive definite, and the Cholesky route inverts M' within the bound."""
    K = rbf_kernel(np.random.default_rng(2).standard_normal((5, 3)), sigma=0.5)
    K = np.pad(K, ((0, 1), (0, 1)))
    K[-1, -1] = 1.0
    M = bordered(K)
    no_lu(monkeypatch)
    R = inverse(M)
    assert np.abs(R @ M - np.eye(7)).max() <= residual_bound(M, R)


def test_a_singular_margin_matrix_raises_as_lu_does():
    """Two equal keys: M' is singular; the error is LU's LinAlgError (the callers turn it
    into a SolverFailure with its fallback)."""
    X = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    R = np.full((6, 6), 7.0)
    with pytest.raises(np.linalg.LinAlgError):
        F.bordered_inverse(bordered(rbf_kernel(X, sigma=1.0)), R)
    assert (R == 7.0).all()  # nothing written
    with pytest.raises(np.linalg.LinAlgError):
        inverse(np.zeros((1, 1)))  # an empty margin set has no inverse


@pytest.mark.parametrize("width", [0.2, 1.0])  # the Cholesky route and LU
def test_the_inverse_goes_into_the_leading_block_of_a_larger_buffer(width):
    """The solver's inverse buffer has room for more margin keys: the block is written (the
    same bits as into a buffer of its own size), the rest left as it was."""
    M = gaussian_bordered(40, 2, width)
    R = np.full((50, 50), 7.0)
    block = F.bordered_inverse(M, R)
    assert np.shares_memory(block, R) and block.shape == M.shape
    np.testing.assert_array_equal(block, inverse(M))
    assert (R[41:] == 7.0).all() and (R[:, 41:] == 7.0).all()


@pytest.mark.parametrize("width", [0.2, 1.0])  # the Cholesky route and LU
def test_the_cholesky_route_from_the_block_reads_its_lower_triangle_only(width):
    """``cholesky_bordered_inverse`` from 2 K_SS with NaN above the diagonal: the bits of
    ``bordered_inverse`` where that takes the route; False and R untouched where it takes LU."""
    M = gaussian_bordered(40, 2, width)
    A = M[1:, 1:] + 2.0
    anorm = float(A.sum(axis=0).max())
    A[np.triu_indices(40, 1)] = np.nan
    R = np.full((45, 45), 7.0)
    if width == 0.2:
        assert F.cholesky_bordered_inverse(A, anorm, R)
        np.testing.assert_array_equal(R[:41, :41], inverse(M))
    else:
        assert not F.cholesky_bordered_inverse(A, anorm, R)
        assert (R == 7.0).all()


@pytest.mark.parametrize(("width", "m"), [(0.2, 40), (1.0, 25)])  # Cholesky, LU (rcond 3e-8)
def test_a_landing_factorises_its_margin_set_as_a_polish_does(width, m):
    """``_landing.factor_margin`` (the bulk build's margin set, from the gathered kernel rows)
    writes the bits ``bordered_inverse`` gives for the bordered matrix of the same rows, on
    either route, and installs the margin set."""
    rng = np.random.default_rng(3)
    n = 60
    X = rng.standard_normal((n, 2))
    dist = np.sqrt(((X[:, None, :] - X[None, :, :]) ** 2).sum(-1))
    sigma = width * np.median(dist[np.triu_indices(n, 1)])
    Kp = B.shifted_gram(np.ascontiguousarray(X.T), n, 1.0 / sigma**2)
    order = rng.permutation(n)[:m].astype(np.int64)
    rows = Kp[order]
    # the route taken, by a margin of 10 either way from LAPACK's estimate of 1 / cond_1
    rcond = 1.0 / np.linalg.cond(B.bordered_margin_matrix(rows, order)[1:, 1:] + 2.0, 1)
    assert rcond > 10 * F.CHOLESKY_MIN_RCOND if width == 0.2 else rcond < F.CHOLESKY_MIN_RCOND / 10
    S, spos = np.zeros(m + 2, np.int64), np.full(n, -1, np.int64)
    status = np.full(n, W.RESERVE, np.int8)
    KSt, R, ist = np.zeros((m + 2, n)), np.zeros((m + 3, m + 3)), np.zeros(16, np.int64)
    assert L.factor_margin(rows, order, S, spos, status, KSt, R, ist) == m
    M = B.bordered_margin_matrix(rows, order)
    expected = F.bordered_inverse(M, np.empty((m + 1, m + 1)))
    np.testing.assert_array_equal(R[: m + 1, : m + 1], expected)
    assert np.array_equal(S[:m], order) and np.array_equal(KSt[:m], rows)
    assert ist[W._M] == m and (status[order] == W.MARGIN).all()
