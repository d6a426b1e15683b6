"""ForgettableMemory.query against a brute-force reference (direct differences, every record).

The query ranks the records by one matrix-vector product on maintained squared norms and
re-scores, by direct differences, the rows its rounding bound cannot rule out; these tests
hold it to the answer of the direct computation over every held record: the same ids in the
same order (keys closer than the rounding of their distances may come in either order, the
direct computation's under another summation order), and scores and weights within the error
bounds derived below.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import numpy as np
import pytest

from svtoolkit.memory import ForgettableMemory
from svtoolkit.memory._search import TOTAL_RTOL

U = 2.0 ** -53  # unit roundoff of float64


def gamma(m):
    """gamma_m = m u / (1 - m u): the relative error bound of a sum of m rounded terms."""
    return m * U / (1.0 - m * U)


def reference(mem, q):
    """Every held record by direct differences: (record ids, solver ids, similarities,
    weights, y = D / sigma^2, keys), in the order of ``mem.record_ids``."""
    solver = mem._solver
    sids, alpha = np.asarray(solver.ids), np.asarray(solver.alpha)
    ids = mem.record_ids
    X = np.stack([mem.key(r) for r in ids])
    y = ((X - q) ** 2).sum(axis=1) / mem.sigma ** 2
    sims = np.exp(-y)
    return ids, sids, sims, alpha * sims / float(alpha @ sims), y, X


def select(sims, sids, k, tau):
    """Indices of the answer for similarities ``sims``: those >= tau, by decreasing
    similarity, ties by solver id (older first), the first k."""
    rows = np.flatnonzero(sims >= tau)
    return rows[np.lexsort((sids[rows], -sims[rows]))][:k]


def score_bound(y, d):
    """Largest difference between two evaluations of exp(-D / sigma^2) that both sum the
    direct differences (in different orders), relative to the score: each sum is within
    gamma_{d+2} D of the exact D (a relative error: no cancellation), the division adds u,
    and exp adds a few ulps (library exp: < 2 ulp); so |y - y'| <= 2 (gamma_{d+2} + u) y and
    the scores differ by a factor of at most exp(|y - y'|) (1 + 4 u)^2."""
    return 2.0 * (gamma(d + 2) + U) * y * 1.01 + 8.0 * U


def weight_bound(y, d, n, X, q, sigma):
    """Relative bound on a weight a_i s_i / sum_j a_j s_j: the score's own (score_bound),
    the normaliser's terms not returned (from the expansion, off by at most E / sigma^2 with
    E = 2 gamma_{d+4} (max |x| + |q|)^2, and never by more than TOTAL_RTOL: past it they are
    summed directly) plus the scores' bound, and the two sums' rounding (gamma_n each)."""
    root = float(np.sqrt((X * X).sum(axis=1).max()) + np.sqrt(q @ q))
    span = root * root  # inf past the float range: then every term is summed directly
    expansion = min(2.0 * gamma(d + 4) * span / sigma ** 2, TOTAL_RTOL) * 1.01
    return 2.0 * score_bound(y, d) + expansion + 2.0 * gamma(n)


def assert_matches_reference(mem, q, k, tau):
    """The query's answer is the direct computation's for some similarities within the
    rounding bound of the direct ones (score_bound: two orders of the same sum may rank keys
    closer than it either way): the hits' own scores, each within the bound, and the lowest
    the bound allows for every other record. Well-separated keys leave one answer, the
    reference's; the weights are within weight_bound."""
    hits = mem.query(q, k, min_similarity=tau)
    ids, sids, sims, weights, y, X = reference(mem, q)
    d = X.shape[1]
    index = {rid: i for i, rid in enumerate(ids)}
    got = [h.record_id for h in hits]
    rows = [index[rid] for rid in got]  # a KeyError: a record that is not held came back
    bound = score_bound(y, d) * sims
    scores = np.array([h.score for h in hits])
    assert np.all(np.abs(scores - sims[rows]) <= bound[rows])
    chosen = sims - bound
    chosen[rows] = scores
    assert [ids[i] for i in select(chosen, sids, k, tau)] == got
    got_weights = np.array([h.weight for h in hits])
    assert np.all(np.abs(got_weights - weights[rows])
                  <= weight_bound(y[rows], d, len(mem), X, q, mem.sigma) * weights[rows])
    return hits


@pytest.mark.parametrize("d", [1, 3, 16, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_query_equals_brute_force_after_adds_and_forgets(d, seed):
    rng = np.random.default_rng(seed)
    n = 150
    X = rng.standard_normal((n, d)) * 3.0 + 5.0  # away from the origin: |x|^2 >> D
    mem = ForgettableMemory(sigma=2.0 * np.sqrt(d), nu=0.3, n0=n)
    mem.extend(X, [f"v{i}" for i in range(n)])
    for rid in rng.choice(mem.record_ids, size=40, replace=False):
        mem.forget(str(rid), verify=False)
    for i in range(20):
        mem.add(X[i] + 0.1 * rng.standard_normal(d), f"new {i}", record_id=f"n{i}")
    queries = [X[rng.integers(n)] for _ in range(3)]  # exactly a key (maybe forgotten)
    queries += [X[rng.integers(n)] + s * rng.standard_normal(d) for s in (1e-6, 0.3, 3.0)]
    queries += [rng.standard_normal(d) * 20.0]  # far from everything
    for q in queries:
        for k in (1, 4, len(mem) + 3):
            for tau in (1e-12, 0.5, 0.95, 1.0):
                assert_matches_reference(mem, q, k, tau)


@pytest.mark.parametrize("offset, spread, sigma", [
    (10.0, 1e-9, 1.0),     # E / sigma^2 ~ 1e-12: the normaliser's far terms from the expansion
    (1e3, 1e-5, 4e-5),     # E / sigma^2 ~ 10: the expansion ranks nothing; all re-scored
])
def test_query_near_duplicates_far_from_origin(offset, spread, sigma):
    # |x|^2 - 2 x.q + |q|^2 cancels: its error (E ~ 1e-11 .. 1e-8) exceeds the distances
    # between these keys, so the answer must come from the direct differences
    rng = np.random.default_rng(7)
    d, n = 16, 60
    center = rng.standard_normal(d)
    center *= offset / np.linalg.norm(center)
    X = center + spread * rng.standard_normal((n, d))
    mem = ForgettableMemory(sigma=sigma, C=1.0 / (0.3 * n))
    mem.extend(X, list(range(n)))
    for rid in ("r3", "r10", "r11"):
        mem.forget(rid, verify=False)
    for q in (X[3], X[5], center, center + 0.3 * spread * rng.standard_normal(d)):
        for k in (1, 5, n):
            hits = assert_matches_reference(mem, q, k, 1e-6)
            assert "r3" not in [h.record_id for h in hits]


def test_query_with_norms_near_the_end_of_the_float_range():
    # (max |x| + |q|)^2 >= 1e300: |x|^2 - 2 x.q + |q|^2 could overflow where the differences
    # do not, so every row is scored directly
    rng = np.random.default_rng(13)
    center = np.array([1.2e154, 0.0])  # |x|^2 ~ 1.4e308 fits; 2 x.q does not
    X = center + 1e152 * rng.standard_normal((40, 2))
    mem = ForgettableMemory(sigma=1e152, C=0.1)
    mem.extend(X, list(range(40)))
    mem.forget("r5", verify=False)
    table = mem._table
    assert np.sqrt(table._sqnorm_max) + np.linalg.norm(X[3]) >= 1e150  # its square >= 1e300
    for q in (X[3], X[5], 1.01 * X[7]):
        for k in (1, 4, 40):
            hits = assert_matches_reference(mem, q, k, 1e-3)
            assert "r5" not in [h.record_id for h in hits]
    assert mem.query(X[3], k=1)[0].record_id == "r3"


def test_forgotten_record_is_never_returned_and_ties_go_to_the_older():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((30, 4)) + 100.0
    dup = X[7].copy()
    mem = ForgettableMemory(sigma=1.0, C=0.1)
    mem.extend(X, list(range(30)))
    mem.add(dup, "copy", record_id="copy")  # an exact tie with r7, younger
    hits = assert_matches_reference(mem, dup, 2, 0.5)
    assert [h.record_id for h in hits] == ["r7", "copy"]
    mem.forget("r7", verify=False)
    hits = assert_matches_reference(mem, dup, 3, 0.5)
    assert hits[0].record_id == "copy" and "r7" not in [h.record_id for h in hits]
    mem.forget("copy", verify=False)
    hits = assert_matches_reference(mem, dup, 30, 1.0)
    assert hits == []  # no other key is at distance 0


def test_many_exact_ties_beyond_k_are_broken_by_age():
    rng = np.random.default_rng(5)
    X = np.repeat(rng.standard_normal((3, 8)), 20, axis=0)  # 3 groups of 20 equal keys
    order = rng.permutation(len(X))
    mem = ForgettableMemory(sigma=5.0, C=0.05)
    mem.extend(X[order], [int(i) for i in order])
    for rid in ("r0", "r4", "r33"):
        mem.forget(rid, verify=False)
    for q in X[::20]:
        for k in (1, 7, 25, 60):
            assert_matches_reference(mem, q, k, 1e-9)


def test_squared_norms_follow_the_rows():
    rng = np.random.default_rng(11)
    d = 12
    X = rng.standard_normal((80, d)) * 4.0
    mem = ForgettableMemory(sigma=3.0, nu=0.3, n0=80)
    mem.extend(X[:60], list(range(60)))
    for i in range(60, 80):
        mem.add(X[i], i)
    big = 50.0 * np.ones(d)
    mem.add(big, "big", record_id="big")
    for rid in ("r0", "r59", "r17"):
        mem.forget(rid, verify=False)
    mem.edit("r20", key=X[20] + 1.0)
    table = mem._table
    keys = table.keys[: table.n]
    # each squared norm is a dot product of length d: within gamma_d of the exact value
    want = np.einsum("ij,ij->i", keys, keys)
    assert np.all(np.abs(table.row_sqnorm[: table.n] - want) <= 2.0 * gamma(d) * want)
    assert np.all(table.row_sqnorm[table.n:] == 0.0)  # freed rows hold nothing
    assert_matches_reference(mem, big, 3, 1e-12)
    mem.forget("big", verify=False)  # the largest norm goes: the bound is recomputed
    assert_matches_reference(mem, X[30], 5, 0.5)
    assert table._sqnorm_max == table.row_sqnorm[: table.n].max()


def test_values_come_back_as_stored_and_as_fresh_copies():
    """A hit's value equals the value added - strings read without the JSON parser when
    their canonical text has no escape (quotes, backslashes and control characters are
    escaped; non-ASCII is kept), every other value parsed - and a mutable value is a fresh
    copy that the caller may change without changing the store."""
    values = ["plain", "", "naïve – ünïcödé 🙂", 'a "quoted" word', "back\\slash",
              "tab\tand\nnewline\x01", "\u2028 line separator", "null", 0, 2.5, None,
              True, ["a", {"b": [1, "c\"d"]}], {"k": "v"}]
    X = np.random.default_rng(17).standard_normal((len(values), 3)) * 10.0
    mem = ForgettableMemory(sigma=1.0, C=0.2)
    mem.extend(X, values)
    for x, value in zip(X, values, strict=True):
        hits = mem.query(x, k=1)
        assert len(hits) == 1 and hits[0].value == value
        assert type(hits[0].value) is type(value)
    hit = mem.query(X[-2], k=1)[0]
    hit.value[1]["b"].append(2)
    assert mem.query(X[-2], k=1)[0].value == values[-2]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_helpers_agree_with_numpy(seed):
    """The compiled search's one-pass k-th smallest (a bounded max-heap), its row filter and
    its ranking (a heap sort on similarity, then solver id) against np.partition,
    np.flatnonzero and np.lexsort, ties and k = 1 .. n included."""
    from svtoolkit.memory._search import _best_first, _kth_smallest, _rows_at_most

    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 100, 1000):
        for a in (rng.standard_normal(n), rng.integers(0, 4, n).astype(float)):
            for k in sorted({1, 2, max(1, n // 2), n - 1, n} - {0}):
                if k <= n:
                    assert _kth_smallest(a, k) == np.partition(a, k - 1)[k - 1]
            for cut in (-np.inf, a.min(), float(np.median(a)), a.max(), np.inf):
                assert np.array_equal(_rows_at_most(a, cut), np.flatnonzero(a <= cut))
        row_sid = rng.permutation(3 * n).astype(np.int64)  # distinct, unordered ids
        rows = rng.choice(3 * n, size=n, replace=False).astype(np.int64)
        sims = rng.integers(1, 5, n) / 4.0  # many exact ties
        for k, tau in ((1, 0.0), (3, 0.5), (n, 0.0), (n, 1.0), (n + 2, 0.75)):
            got_rows, got_sims = _best_first(rows, sims, row_sid, k, tau)
            want = np.lexsort((row_sid[rows], -sims))
            want = want[: min(k, int(np.count_nonzero(sims >= tau)))]
            assert np.array_equal(got_rows, rows[want]) and np.array_equal(got_sims, sims[want])


def test_warm_search_compiles_the_signature_a_query_uses():
    """In a fresh process, after warm_search() a query adds no signature to the search kernel
    (the server warms it at start-up so that its first query does not compile)."""
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from svtoolkit.memory import ForgettableMemory\n"
        "from svtoolkit.memory._search import nearest_rows, warm_search\n"
        "warm_search()\n"
        "assert len(nearest_rows.signatures) == 1, nearest_rows.signatures\n"
        "mem = ForgettableMemory(sigma=1.0, C=0.5)\n"
        "mem.extend(np.arange(6.0).reshape(3, 2), [0, 1, 2])\n"
        "mem.query([0.5, 1.0], k=2, min_similarity=0.1)\n"
        "mem.query(np.array([1e200, 0.0]), k=1)\n"
        "assert len(nearest_rows.signatures) == 1, nearest_rows.signatures\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
