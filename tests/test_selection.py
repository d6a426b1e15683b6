"""Selection policies at a matched budget, each against a slow obviously-correct reference.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import numpy as np
import pytest

from svtoolkit import IncrementalSVDD
from svtoolkit.selection import (
    certified_selection,
    certified_streaming,
    h2o_scores,
    h2o_selection,
    h2o_streaming,
    random_selection,
    recency_selection,
    skewed_redundancy_context,
    uniform_rbf_readout,
)

SIGMA = 1.2


def k(a, b, sigma=SIGMA):
    return float(np.exp(-np.sum((np.asarray(a) - np.asarray(b)) ** 2) / sigma**2))


def naive_h2o_streaming(keys, budget, normalize, recent):
    cache, score = [], {}
    for t, x in enumerate(keys):
        cache.append(t)
        score[t] = 0.0
        att = {i: k(x, keys[i]) for i in cache}
        total = sum(att.values()) if normalize else 1.0
        for i in cache:
            score[i] += att[i] / total
        if len(cache) > budget:
            candidates = cache[: len(cache) - recent] if recent else list(cache)
            victim = min(candidates, key=lambda i: (score[i], i))
            cache.remove(victim)
    return sorted(cache)


def test_certified_selection_is_the_support_set():
    X = np.random.default_rng(0).standard_normal((40, 3))
    C = 1.0 / (0.3 * 40)
    keep = certified_selection(X, sigma=SIGMA, C=C)
    solver = IncrementalSVDD(C, SIGMA)
    solver.extend(X)
    assert keep.tolist() == [i for i, a in enumerate(solver.alpha) if a > 0.0]
    # the gated readout of the support set alone is the full gated readout
    alpha = solver.alpha
    q = np.random.default_rng(1).standard_normal((5, 3))
    full = np.array([[alpha @ [k(p, x) for x in X]] for p in q])
    kept = np.array([[alpha[keep] @ [k(p, x) for x in X[keep]]] for p in q])
    np.testing.assert_allclose(kept, full, rtol=0, atol=1e-14)


def test_certified_selection_refuses_warm_up():
    with pytest.raises(ValueError, match="warm-up"):
        certified_selection(np.eye(3), sigma=1.0, C=0.1)


@pytest.mark.parametrize("normalize", [True, False])
def test_h2o_scores_match_a_loop(normalize):
    rng = np.random.default_rng(2)
    X, Q = rng.standard_normal((12, 2)), rng.standard_normal((5, 2))
    expected = np.zeros(12)
    for q in Q:
        w = np.array([k(q, x) for x in X])
        expected += w / w.sum() if normalize else w
    np.testing.assert_allclose(h2o_scores(X, Q, sigma=SIGMA, normalize=normalize), expected,
                               rtol=1e-13)


def test_h2o_selection_keeps_top_scores_with_ties_to_the_earlier_key():
    X = np.array([[0.0], [0.0], [5.0], [0.1]])
    keep = h2o_selection(X, np.array([[0.0]]), 2, sigma=1.0, normalize=False)
    assert keep.tolist() == [0, 1]  # 0 and 1 tie; 3 is next, 2 is far


@pytest.mark.parametrize("normalize, recent", [(True, 0), (False, 0), (True, 3)])
def test_h2o_streaming_matches_the_naive_cache(normalize, recent):
    X = np.random.default_rng(3).standard_normal((30, 2))
    got = h2o_streaming(X, 10, sigma=SIGMA, normalize=normalize, recent=recent)
    assert got.tolist() == naive_h2o_streaming(X, 10, normalize, recent)


def test_recency_random_and_budget_checks():
    assert recency_selection(10, 3).tolist() == [7, 8, 9]
    a, b = random_selection(50, 7, 11), random_selection(50, 7, 11)
    assert a.tolist() == b.tolist() and len(set(a.tolist())) == 7
    with pytest.raises(ValueError, match="budget must be in \\[1, 10\\]"):
        recency_selection(10, 11)
    with pytest.raises(TypeError, match="budget must be an int"):
        random_selection(10, 2.0, 0)
    with pytest.raises(ValueError, match=r"recent must be in \[0, 1\]; got 2"):
        h2o_streaming(np.eye(4), 2, sigma=1.0, recent=2)
    with pytest.raises(ValueError, match="n must be >= 1; got 0"):
        recency_selection(0, 1)


def test_uniform_readout_matches_a_loop_and_refuses_empty_selection():
    rng = np.random.default_rng(4)
    X, V, Q = rng.standard_normal((9, 2)), rng.standard_normal((9, 3)), rng.standard_normal((4, 2))
    keep = np.array([0, 2, 5])
    expected = []
    for q in Q:
        w = np.array([k(q, X[i]) for i in keep])
        expected.append(w @ V[keep] / w.sum())
    np.testing.assert_allclose(uniform_rbf_readout(X, V, Q, sigma=SIGMA, keep=keep),
                               expected, rtol=1e-13)
    with pytest.raises(ValueError, match="keep is empty"):
        uniform_rbf_readout(X, V, Q, sigma=SIGMA, keep=[])
    with pytest.raises(ValueError, match="values must have shape"):
        uniform_rbf_readout(X, V[:3], Q, sigma=SIGMA)


@pytest.mark.parametrize("keep, exc, match", [
    ([0.9, 2.7], TypeError, "keep must hold integer row indices or be a boolean mask"),
    (np.array([1.0, 2.0]), TypeError, "got dtype float64"),
    (["0", "1"], TypeError, "keep must hold integer"),
    ([-1], ValueError, "keep indices must be in \\[0, 9\\)"),
    ([0, 9], ValueError, "keep indices must be in \\[0, 9\\)"),
    ([0, 0, 1], ValueError, "repeated indices"),
    ([[0, 1]], ValueError, "keep must be 1-D"),
    ([True, False], ValueError, "boolean mask must have length 9"),
    (np.zeros(9, dtype=bool), ValueError, "the boolean mask selects no key"),
])
def test_uniform_readout_refuses_a_keep_it_would_misread(keep, exc, match):
    rng = np.random.default_rng(8)
    X, V, Q = rng.standard_normal((9, 2)), rng.standard_normal((9, 3)), rng.standard_normal((4, 2))
    with pytest.raises(exc, match=match):
        uniform_rbf_readout(X, V, Q, sigma=SIGMA, keep=keep)


def test_uniform_readout_reads_a_boolean_mask_as_the_rows_it_selects():
    rng = np.random.default_rng(9)
    X, V, Q = rng.standard_normal((9, 2)), rng.standard_normal((9, 3)), rng.standard_normal((4, 2))
    mask = np.zeros(9, dtype=bool)
    mask[[1, 4, 8]] = True
    expected = []
    for q in Q:
        w = np.array([k(q, X[i]) for i in (1, 4, 8)])
        expected.append(w @ V[[1, 4, 8]] / w.sum())
    np.testing.assert_allclose(uniform_rbf_readout(X, V, Q, sigma=SIGMA, keep=mask), expected,
                               rtol=1e-13)
    np.testing.assert_allclose(uniform_rbf_readout(X, V, Q, sigma=SIGMA, keep=list(mask)),
                               expected, rtol=1e-13)


def naive_certified_streaming(keys, budget, C):
    """Shadow replay with the bare solver: admit in order; over budget, evict the oldest
    reserve records, checking that each is reserve (coefficient exactly 0) when it goes."""
    solver = IncrementalSVDD(C, SIGMA)
    sid_row, peak = {}, 0
    for t, x in enumerate(keys):
        sid_row[int(solver.add(x))] = t
        excess = len(solver) - budget
        if excess > 0 and solver.certified:
            for sid in solver.reserve_ids[:excess]:
                assert int(sid) in solver.reserve_ids.tolist()  # still reserve at its eviction
                assert solver.alpha[solver.ids.tolist().index(int(sid))] == 0.0
                solver.remove(int(sid))
        peak = max(peak, len(solver))
    return sorted(sid_row[int(s)] for s in solver.ids), peak


def test_certified_streaming_evicts_only_certified_records():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((50, 3))
    C = 1.0 / (0.3 * 50)
    budget = len(certified_selection(X, sigma=SIGMA, C=C))
    kept, peak = certified_streaming(X, budget, sigma=SIGMA, C=C)
    assert budget <= len(kept) <= peak
    # every eviction was of a record in the reserve set at the time: the kept set and the peak
    # are those of a shadow replay that checks this at each eviction
    assert (kept.tolist(), peak) == naive_certified_streaming(X, budget, C)
    assert len(kept) < len(X)  # the replay did evict
    # the final memory is exact for what it holds
    solver = IncrementalSVDD(C, SIGMA)
    solver.extend(X[kept])
    assert solver.kkt_residual() < 1e-9
    kept_all, _ = certified_streaming(X, 50, sigma=SIGMA, C=C)
    assert kept_all.tolist() == list(range(50))


def test_skewed_context_layout():
    ctx = skewed_redundancy_context(np.random.default_rng(6))
    assert ctx.keys.shape == (66, 4) and ctx.values.shape == (66, 12)
    assert ctx.group[:6].tolist() == list(range(6))
    assert len(ctx.test_queries) == len(ctx.warm_queries) == 12


@pytest.mark.parametrize("qpg", [2, 3, 5])
def test_skewed_context_gives_every_group_warm_and_held_out_queries(qpg):
    ctx = skewed_redundancy_context(0, rare=2, dense=2, copies=2, queries_per_group=qpg)
    for g in range(4):
        assert np.sum(ctx.warm_group == g) == (qpg + 1) // 2
        assert np.sum(ctx.test_group == g) == qpg // 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"queries_per_group": 1}, ValueError, "queries_per_group must be >= 2; got 1"),
    ({"copies": 0}, ValueError, "copies must be >= 1; got 0"),
    ({"d": 2.0}, TypeError, "d must be an int; got float"),
    ({"rare": 0, "dense": 0}, ValueError, "at least one group"),
])
def test_skewed_context_refuses_bad_sizes(kwargs, error, match):
    with pytest.raises(error, match=match):
        skewed_redundancy_context(0, **kwargs)


def test_certified_beats_kernel_mass_heavy_hitters_on_rare_groups():
    """A small version of examples/skewed_redundancy.py (10 trials instead of 60)."""
    rng = np.random.default_rng(7)
    cert, h2o = [], []
    for _ in range(10):
        ctx = skewed_redundancy_context(rng)
        keep = certified_selection(ctx.keys, sigma=SIGMA, C=1.0 / (0.45 * 66))
        queries = np.vstack([ctx.warm_queries, ctx.test_queries])
        hh = h2o_selection(ctx.keys, queries, len(keep), sigma=SIGMA, normalize=False)
        rare = np.isin(ctx.test_group, ctx.rare_groups)
        for sel, out in ((keep, cert), (hh, h2o)):
            o = uniform_rbf_readout(ctx.keys, ctx.values, ctx.test_queries, sigma=SIGMA,
                                    keep=sel)
            out.append(np.mean(o.argmax(1)[rare] == ctx.test_group[rare]))
    assert np.mean(cert) > np.mean(h2o) + 0.3
