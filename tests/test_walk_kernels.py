"""The walk's O(m^2) / O(n m) kernels give the bits of their one-row-at-a-time definitions.

They sum four rows side by side (or update through a copy of the pivot row) for speed on
large margin sets; each output entry must still be the same floating-point operations in the
same order, so a state is bit-for-bit what the plain loops give. The references below are
those plain loops in Python floats (IEEE double, no fused multiply-add).
"""

import numpy as np
import pytest

from svtoolkit.exact import _bulk as B
from svtoolkit.exact import _walk as W
from svtoolkit.kernels import rbf_row_minus_one

SIZES = [1, 2, 3, 4, 5, 7, 8, 13, 64, 67]


def _matvec_ref(R, m1, v, scale):
    out = []
    for i in range(m1):
        s = 0.0
        for j in range(m1):
            s += float(R[i, j]) * float(v[j])
        out.append(scale * s)
    return np.array(out)


@pytest.mark.parametrize("m1", SIZES)
def test_matvec_sums_each_row_in_increasing_order(m1):
    rng = np.random.default_rng(m1)
    R = rng.standard_normal((m1 + 3, m1 + 5)) * 10.0 ** rng.integers(-8, 8, (m1 + 3, m1 + 5))
    v = rng.standard_normal(m1 + 5)
    out = np.full(m1 + 5, np.nan)
    W._matvec(R, m1, v, out, -1.0)
    assert np.array_equal(out[:m1], _matvec_ref(R, m1, v, -1.0))
    assert np.isnan(out[m1:]).all()  # nothing written beyond m1


@pytest.mark.parametrize("m1", SIZES)
def test_matvec_pair_has_the_bits_of_two_matvecs(m1):
    """The probe's pass over R also gives the correction's Newton step: both products summed
    as :func:`_matvec` sums them (each row in increasing order)."""
    rng = np.random.default_rng(m1)
    R = rng.standard_normal((m1 + 3, m1 + 5)) * 10.0 ** rng.integers(-8, 8, (m1 + 3, m1 + 5))
    v, v2 = rng.standard_normal(m1 + 5), rng.standard_normal(m1 + 5)
    out, out2 = np.full(m1 + 5, np.nan), np.full(m1 + 5, np.nan)
    W._matvec_pair(R, m1, v, out, v2, out2)
    assert np.array_equal(out[:m1], _matvec_ref(R, m1, v, 1.0))
    assert np.array_equal(out2[:m1], _matvec_ref(R, m1, v2, 1.0))
    assert np.isnan(out[m1:]).all() and np.isnan(out2[m1:]).all()


@pytest.mark.parametrize("count", [0, *SIZES])
def test_add_rows_adds_each_row_in_increasing_order(count):
    rng = np.random.default_rng(100 + count)
    n = 11
    rows = rng.standard_normal((count + 2, n + 4))
    coef = rng.standard_normal(count + 2) * 1e3
    target = rng.standard_normal(n + 4)
    expected = [float(t) for t in target]
    for p in range(count):
        b = 2.0 * float(coef[p])
        for i in range(n):
            expected[i] += b * float(rows[p, i])
    W._add_rows(target, n, rows, coef, count, 2.0)
    assert np.array_equal(target, np.array(expected))


@pytest.mark.parametrize("off", [0, 1, 3, 40])
def test_add_rows_off_margin_has_the_sweeps_bits_off_the_margin(off):
    """Off the margin the column-by-column sum (few slots off it) and the sweep (many) give
    the bits of _add_rows; of n = 48 slots, ``count`` rows on the margin, 1 and 3 off it take
    the columns."""
    rng = np.random.default_rng(200 + off)
    n = 48
    count = n - off  # the rows of the margin keys (the first `count` rows hold the sums)
    rows = rng.standard_normal((count + 2, n + 4))
    coef = rng.standard_normal(count + 2) * 1e3
    target = rng.standard_normal(n + 4)
    status = np.full(n + 4, W.MARGIN, dtype=np.int8)
    status[rng.choice(n, off, replace=False)] = W.ERROR
    swept = target.copy()
    W._add_rows(swept, n, rows, coef, count, 2.0)
    W._add_rows_off_margin(target, n, status, rows, coef, count, 2.0)
    outside = status[:n] != W.MARGIN
    assert (W.OFF_MARGIN_SWEEP * off <= n) == (off in (0, 1, 3))
    assert np.array_equal(target[:n][outside], swept[:n][outside])


@pytest.mark.parametrize("m", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("q", ["first", "middle", "last"])
def test_shrink_removes_row_and_column_q_as_the_plain_downdate(m, q):
    rng = np.random.default_rng(m)
    q = {"first": 1, "middle": max(1, m // 2), "last": m}[q]
    A = rng.standard_normal((m + 1, m + 1))
    R = np.zeros((m + 4, m + 4))
    R[: m + 1, : m + 1] = A @ A.T + np.eye(m + 1)
    ref = [[float(x) for x in row] for row in R[: m + 1, : m + 1]]
    rqq = ref[q][q]
    for i in range(m + 1):
        if i != q:
            f = ref[i][q] / rqq
            for j in range(m + 1):
                if j != q:
                    ref[i][j] -= f * ref[q][j]
    keep = [i for i in range(m + 1) if i != q]
    if q != m:  # the last row/column moves into q
        keep = [m if i == q else i for i in range(m)]
    expected = np.array([[ref[i][j] for j in keep] for i in keep])
    W._shrink(R, m, q)
    if m == 2:  # one key stays: its inverse [[0, 1], [1, 0]] is set exactly, not downdated
        assert np.array_equal(R[:2, :2], [[0.0, 1.0], [1.0, 0.0]])
    elif m > 2:
        assert np.array_equal(R[:m, :m], expected)


def _keys(n, d, seed):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    X[3] = X[1] + 1e-6  # a near twin: kernel values next to 0 in K' = k - 1
    return np.ascontiguousarray(X.T)


def test_the_shifted_kernel_is_symmetric_to_the_bit():
    Xt = _keys(40, 5, 1)
    K = np.empty((40, 40))
    for j in range(40):
        rbf_row_minus_one(Xt, 40, Xt[:, j].copy(), 0.7, K[j])
    assert np.array_equal(K, K.T)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 13])
def test_the_inverse_probe_is_its_definition(m):
    n = 20
    Xt = _keys(n, 4, m)
    KSt = np.empty((m + 2, n))
    S = np.random.default_rng(m).permutation(n)[:m].astype(np.int64)
    for p, k in enumerate(S):
        W.kernel_column(Xt, n, int(k), -1, 0.5, KSt[p])
    M = np.zeros((m + 1, m + 1))
    M[0, 1:] = M[1:, 0] = 1.0
    for p in range(m):
        for q in range(m):
            M[p + 1, q + 1] = 2.0 * KSt[q, S[p]]
    R = np.zeros((m + 3, m + 3))
    R[: m + 1, : m + 1] = np.linalg.inv(M) if m > 1 else np.linalg.pinv(M)
    # the sums take the margin keys in slot order where at least a quarter of the slots are
    # on the margin (listed by a pass over the slots), else in S's order
    order = np.argsort(S) if 4 * m >= n else np.arange(m)
    w = [float(m)]
    for p in range(m):
        s = 1.0
        for q in order:
            s += 2.0 * (float(KSt[q, S[p]]) + 1.0)
        w.append(s)
    prod = _matvec_ref(R, m + 1, np.array(w), 1.0)
    expected = max(max(abs(x - 1.0) for x in prod[1:]),
                   abs(prod[0] - 2.0 * sum(prod[1:]) - 1.0))
    status = np.full(n, W.RESERVE, dtype=np.int8)
    status[S] = W.MARGIN
    w = np.empty(m + 1)
    assert W.inverse_probe_residual(R, m, S, KSt, status, n, w, w, w, False) == expected
    # with the correction's Newton step from the same pass: du = R r, the bits of _matvec
    r = np.random.default_rng(m + 100).standard_normal(m + 1)
    du = np.full(m + 3, np.nan)
    assert W.inverse_probe_residual(R, m, S, KSt, status, n, w, r, du, True) == expected
    assert np.array_equal(du[: m + 1], _matvec_ref(R, m + 1, r, 1.0))


def test_the_margin_block_is_the_lower_triangle_of_twice_the_kernel_block():
    """``margin_block_lower``: the lower triangle of 2 K_SS with the bits of M' + 2 (what the
    Cholesky route of a landing reads), and its 1-norm to the rounding of the sums."""
    rng = np.random.default_rng(6)
    X = rng.standard_normal((40, 3))
    Kp = B.shifted_gram(np.ascontiguousarray(X.T), 40, 1.0)
    order = rng.permutation(40)[:25].astype(np.int64)
    rows = Kp[order]
    A = np.full((25, 25), np.nan)
    anorm = B.margin_block_lower(rows, order, A)
    full = B.bordered_margin_matrix(rows, order)[1:, 1:] + 2.0
    lower = np.tril_indices(25)
    assert np.array_equal(A[lower], full[lower])
    assert np.isnan(A[np.triu_indices(25, 1)]).all()  # the strict upper triangle not written
    # a column sum of 25 terms in [0, 2], in two orders: each within 25 u of the exact sum
    assert anorm == pytest.approx(full.sum(axis=0).max(), rel=2 * 25 * 2.0**-53)


def test_the_bordered_margin_matrix_is_the_gathered_block():
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((9, 30))
    order = rng.permutation(30)[:9].astype(np.int64)
    M = B.bordered_margin_matrix(rows, order)
    expected = np.zeros((10, 10))
    expected[0, 1:] = expected[1:, 0] = 1.0
    expected[1:, 1:] = 2.0 * rows[:, order]
    assert np.array_equal(M, expected)
