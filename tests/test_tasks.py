"""Synthetic tasks: determinism, layout, and that a rule-based oracle answers every query.

Each task gets a tiny oracle that reads only ``inputs`` (and the documented layout) and answers
the scored positions; it must reach accuracy 1.0, while a uniform guess must land near the
stated chance. Seeds: every generator call passes an explicit seed; guesses use
np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import numpy as np
import pytest

import svtoolkit.selection
from svtoolkit.tasks import (
    FILLER_SWEEP,
    IGNORE_INDEX,
    LONG_GAPS,
    MATCHED_GAPS,
    SELECTIVE_COPYING_FILLER_SWEEP,
    TENSOR_CACHE_WINDOW,
    TokenTask,
    VectorTask,
    heldout_seed,
    max_abs_cosine_bound,
    mqar,
    mqar_vectors,
    near_orthogonal_capacity,
    nearest_value_accuracy,
    selective_copying,
    skewed_redundancy_context,
    tensor_cache_recall,
    token_accuracy,
    train_and_heldout,
)
from svtoolkit.tasks.tensor_cache_recall import QUERY, STORE

GENERATORS = {
    "mqar": lambda n, seed: mqar(n, n_pairs=8, seq_len=64, vocab_size=128, seed=seed),
    "mqar_vectors": lambda n, seed: mqar_vectors(n, n_pairs=12, seed=seed),
    "selective_copying": lambda n, seed: selective_copying(n, n_filler=16, seed=seed),
    "capacity": lambda n, seed: near_orthogonal_capacity(n, n_items=12, d_key=16, seed=seed),
    "tc_matched": lambda n, seed: tensor_cache_recall(n, seed=seed),
    "tc_multistore": lambda n, seed: tensor_cache_recall(n, variant="multistore", seed=seed),
}


def _arrays(task):
    if isinstance(task, TokenTask):
        return [task.inputs, task.targets]
    return [task.inputs, task.targets, task.candidates, task.answers, task.answer_positions]


def _answer_alphabet(task):
    """The documented answer ids of a token task: (first id, count)."""
    c = task.config
    if task.name == "mqar":
        return c["vocab_size"] // 2, c["vocab_size"] - c["vocab_size"] // 2
    return 3 + c["n_keys"], c["n_values"]  # Tensor Cache: after the 3 markers and the keys


def _guess_accuracy(task, rng):
    """Accuracy of a uniform guess over the answer alphabet."""
    if isinstance(task, TokenTask):
        low, count = _answer_alphabet(task)
        assert task.chance == 1.0 / count
        scored = task.targets[task.scored]
        assert scored.min() >= low and scored.max() < low + count
        return token_accuracy(task, rng.integers(low, low + count, size=task.targets.shape))
    pick = rng.integers(0, task.candidates.shape[1], size=task.answers.shape)
    return nearest_value_accuracy(task, np.take_along_axis(task.candidates, pick[:, :, None],
                                                           axis=1))


def _assert_near_chance(acc, chance, n):
    se = np.sqrt(chance * (1 - chance) / n)
    assert abs(acc - chance) < 5 * se + 1e-12, (acc, chance)


# --- shared contract -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_data_other_seed_other_data(name):
    make = GENERATORS[name]
    a, b, c = make(20, 3), make(20, 3), make(20, 4)
    for x, y in zip(_arrays(a), _arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.inputs, c.inputs)
    assert a.config["seed"] == 3 and c.config["seed"] == 4


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_shapes_dtypes_and_config(name):
    task = GENERATORS[name](7, 0)
    assert task.config["n_examples"] == 7
    if isinstance(task, TokenTask):
        assert task.inputs.dtype == np.int64 and task.targets.dtype == np.int64
        assert task.inputs.shape == task.targets.shape and task.inputs.shape[0] == 7
        assert task.inputs.min() >= 0 and task.inputs.max() < task.vocab_size
        scored = task.targets[task.scored]
        assert scored.min() >= 0 and scored.max() < task.vocab_size
        assert set(np.unique(task.targets[~task.scored])) == {IGNORE_INDEX}
    else:
        N, L, width = task.inputs.shape
        m = len(task.query_positions)
        assert task.inputs.dtype == np.float64 and N == 7
        assert width == task.d_key + task.targets.shape[2]
        assert task.answers.dtype == np.int64 and task.answers.shape == (N, m)
        np.testing.assert_array_equal(task.query_positions, np.arange(L - m, L))
        np.testing.assert_array_equal(
            task.targets, np.take_along_axis(task.candidates, task.answers[:, :, None], 1))
        # the answer token carries the target value; query tokens carry no value
        rows = np.arange(N)[:, None]
        np.testing.assert_array_equal(task.values[rows, task.answer_positions], task.targets)
        assert not task.values[:, task.query_positions].any()
        assert task.queries.shape == (N, m, task.d_key)
        assert task.chance == 1.0 / task.candidates.shape[1]


def test_heldout_is_seed_plus_10000():
    kw = dict(n_pairs=4, n_queries=4, seq_len=32, vocab_size=64)
    train, held = train_and_heldout(mqar, 5, 6, seed=2, **kw)
    assert heldout_seed(2) == 10_002 and held.config["seed"] == 10_002
    np.testing.assert_array_equal(held.inputs, mqar(6, seed=10_002, **kw).inputs)
    assert train.inputs.shape == (5, 32)


@pytest.mark.parametrize("seed, error, match", [
    (-1, ValueError, "seed must be >= 0; got -1"),
    (True, TypeError, "seed must be an int; got bool"),
    (1.5, TypeError, "seed must be an int; got float"),
])
def test_bad_seed_is_refused(seed, error, match):
    with pytest.raises(error, match=match):
        mqar(2, seed=seed)


def test_scoring_helpers():
    task = mqar(4, n_pairs=3, n_queries=2, seq_len=16, vocab_size=32, seed=0)
    assert token_accuracy(task, np.where(task.scored, task.targets, 0)) == 1.0
    logits = np.zeros(task.targets.shape + (task.vocab_size,))
    assert token_accuracy(task, logits) == 0.0  # argmax 0 is never a value id
    with pytest.raises(ValueError, match="predictions must have shape"):
        token_accuracy(task, task.targets[:, :-1])
    vt = mqar_vectors(4, n_pairs=5, n_queries=3, seed=0)
    assert nearest_value_accuracy(vt, vt.targets) == 1.0
    with pytest.raises(ValueError, match="outputs must have shape"):
        nearest_value_accuracy(vt, vt.targets[:, :1])


# --- MQAR (tokens) -------------------------------------------------------------------------

def mqar_oracle(task):
    """Look the query key up in the key-value block and answer the value after it."""
    n = task.config["n_pairs"]
    block = task.inputs[:, : 2 * n]
    pred = np.zeros_like(task.targets)
    for i, t in zip(*np.nonzero(task.scored), strict=True):
        (p,) = np.nonzero(block[i, 0::2] == task.inputs[i, t])
        pred[i, t] = block[i, 2 * p[0] + 1]
    return pred


@pytest.mark.parametrize("n_pairs", [8, 16, 64])
def test_mqar_layout_and_oracle(n_pairs):
    task = mqar(300, n_pairs=n_pairs, n_queries=8, seq_len=256, vocab_size=256, seed=1)
    half = 128
    keys, values = task.inputs[:, 0 : 2 * n_pairs : 2], task.inputs[:, 1 : 2 * n_pairs : 2]
    assert keys.min() >= 1 and keys.max() < half and values.min() >= half
    for row_k, row_v in zip(keys, values, strict=True):
        assert len(set(row_k)) == n_pairs and len(set(row_v)) == n_pairs  # distinct
    rows, cols = np.nonzero(task.scored)
    assert np.all(np.bincount(rows) == 8)
    assert np.all(cols >= 2 * n_pairs) and np.all((cols - 2 * n_pairs) % 2 == 0)
    asked = task.inputs[rows, cols].reshape(300, 8)
    for row_a, row_k in zip(asked, keys, strict=True):
        assert len(set(row_a)) == 8 and set(row_a) <= set(row_k)
    assert token_accuracy(task, mqar_oracle(task)) == 1.0
    assert task.chance == 1 / 128
    _assert_near_chance(_guess_accuracy(task, np.random.default_rng(0)), task.chance, 2400)


def test_mqar_blank_fill_and_power_law_placement():
    task = mqar(400, n_pairs=4, n_queries=4, seq_len=208, vocab_size=64, random_fill=False,
                power_a=0.01, seed=2)
    rest = task.inputs[:, 8:]
    assert set(np.unique(rest[~task.scored[:, 8:]])) == {0}
    slots = (np.nonzero(task.scored)[1] - 8) // 2  # 100 slots
    uniform = mqar(400, n_pairs=4, n_queries=4, seq_len=208, vocab_size=64, power_a=1.0,
                   seed=2)
    slots_u = (np.nonzero(uniform.scored)[1] - 8) // 2
    # power law puts queries near the pairs; a = 1 spreads them uniformly (mean ~ 49.5)
    assert np.mean(slots < 10) > 0.5 and abs(slots_u.mean() - 49.5) < 4
    assert token_accuracy(uniform, mqar_oracle(uniform)) == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_pairs=8, n_queries=9), "n_queries must be <= n_pairs"),
    (dict(n_pairs=8, n_queries=8, seq_len=31), r"seq_len must be >= 2 \* n_pairs"),
    (dict(n_pairs=20, seq_len=128, vocab_size=40), "distinct keys need vocab_size >= 42"),
    (dict(n_pairs=0), "n_pairs must be >= 1"),
    (dict(power_a=0.0), "power_a must be finite and > 0"),
])
def test_mqar_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mqar(3, seed=0, **kwargs)


def test_mqar_refuses_a_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="random_fill must be a bool; got int"):
        mqar(3, seed=0, random_fill=1)


# --- vector tasks ----------------------------------------------------------------------------

def nearest_key_oracle(task, context):
    """Answer each query with the value of its nearest context key (positions ``context``)."""
    k = task.keys[:, context]
    d2 = ((task.queries[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1)
    nearest = d2.argmin(-1)
    return np.take_along_axis(task.values[:, context], nearest[:, :, None], axis=1)


@pytest.mark.parametrize("n_pairs", [8, 64])
def test_mqar_vectors_oracle_and_chance(n_pairs):
    task = mqar_vectors(200, n_pairs=n_pairs, n_queries=8, seed=5)
    assert task.inputs.shape == (200, n_pairs + 8, 16)
    assert all(len(set(row)) == 8 for row in task.answers)
    out = nearest_key_oracle(task, np.arange(n_pairs))
    assert nearest_value_accuracy(task, out) == 1.0
    _assert_near_chance(_guess_accuracy(task, np.random.default_rng(1)), 1 / n_pairs, 1600)
    with pytest.raises(ValueError, match="n_queries must be <= n_pairs"):
        mqar_vectors(2, n_pairs=4, n_queries=5, seed=0)


@pytest.mark.parametrize("n_filler", SELECTIVE_COPYING_FILLER_SWEEP)
def test_selective_copying_filler_and_oracle(n_filler):
    task = selective_copying(150, n_filler=n_filler, filler_jitter=0.05, seed=7)
    n_ctx = 8 + n_filler
    assert task.inputs.shape == (150, n_ctx + 1, 16) and task.chance == 0.125
    informative = np.abs(task.values[:, :n_ctx]).sum(-1) > 0
    assert np.all(informative.sum(1) == 8)
    rows = np.arange(150)[:, None]
    assert informative[rows, task.answer_positions].all()
    filler = task.keys[:, :n_ctx][~informative].reshape(150, n_filler, 8)
    spread = filler - filler.mean(axis=1, keepdims=True)
    assert np.abs(task.values[:, :n_ctx][~informative]).max() == 0.0  # zero-value filler
    assert np.sqrt((spread**2).mean()) < 0.06  # near-duplicates (jitter 0.05 per coordinate)
    out = nearest_key_oracle(task, np.arange(n_ctx))
    assert nearest_value_accuracy(task, out) == 1.0


def test_selective_copying_chance_and_errors():
    task = selective_copying(2000, n_filler=32, seed=8)
    _assert_near_chance(_guess_accuracy(task, np.random.default_rng(2)), 0.125, 2000)
    with pytest.raises(ValueError, match="n_queries must be <= n_informative"):
        selective_copying(2, n_informative=2, n_queries=3, seed=0)
    with pytest.raises(ValueError, match="filler_jitter must be finite and >= 0"):
        selective_copying(2, filler_jitter=-0.1, seed=0)


@pytest.mark.parametrize("n_items", [8, 40])
def test_capacity_keys_filler_block_and_oracle(n_items):
    task = near_orthogonal_capacity(100, n_items=n_items, seed=9)
    assert task.inputs.shape == (100, n_items + 20 + 8, 72)
    keys = task.keys[:, :n_items]
    np.testing.assert_allclose(np.linalg.norm(keys, axis=-1), 1.0, atol=1e-12)
    gram = np.einsum("nid,nkd->nik", keys, keys) - np.eye(n_items)
    bound = max_abs_cosine_bound(0.05)
    assert np.abs(gram).max() <= bound and 0.1 < bound < 0.12
    block = slice(n_items, n_items + 20)
    assert not task.values[:, block].any() and np.abs(task.values[:, :n_items]).min() > 0
    out = nearest_key_oracle(task, np.arange(n_items + 20))
    assert nearest_value_accuracy(task, out) == 1.0


def test_capacity_exactly_orthogonal_chance_and_errors():
    task = near_orthogonal_capacity(2000, n_items=16, n_queries=1, d_key=16, key_jitter=0.0,
                                    seed=10)
    keys = task.keys[:, :16]
    np.testing.assert_allclose(np.einsum("nid,nkd->nik", keys, keys),
                               np.broadcast_to(np.eye(16), (2000, 16, 16)), atol=1e-12)
    _assert_near_chance(_guess_accuracy(task, np.random.default_rng(3)), 1 / 16, 2000)
    with pytest.raises(ValueError, match="d_key must be >= n_items"):
        near_orthogonal_capacity(2, n_items=40, d_key=32, seed=0)
    with pytest.raises(ValueError, match=r"key_jitter must be finite and in \[0.0, 1.0\)"):
        near_orthogonal_capacity(2, key_jitter=1.0, seed=0)


# --- Tensor Cache recall -------------------------------------------------------------------

def tc_oracle(task):
    """Answer each query key with the value after its most recent stored occurrence."""
    pred = np.zeros_like(task.targets)
    for i, t in zip(*np.nonzero(task.scored), strict=True):
        row = task.inputs[i, :t]
        stored = np.nonzero((row[1:] == task.inputs[i, t]) & (row[:-1] == STORE))[0] + 1
        pred[i, t] = task.inputs[i, stored[-1] + 1]
    return pred


def _episode_gaps(task):
    """Per scored position: fillers between the last stored value and the QUERY marker."""
    gaps = []
    for i, t in zip(*np.nonzero(task.scored), strict=True):
        assert task.inputs[i, t - 1] == QUERY
        last_store = np.nonzero(task.inputs[i, :t] == STORE)[0][-1]
        between = task.inputs[i, last_store + 3 : t - 1]
        assert between.min() >= task.vocab_size - task.config["n_filler_tokens"]
        gaps.append(len(between))
    return np.array(gaps)


@pytest.mark.parametrize("variant, gap", [("matched", g) for g in MATCHED_GAPS]
                         + [("filler_sweep", g) for g in FILLER_SWEEP]
                         + [("long_gap", g) for g in LONG_GAPS[:2]]
                         + [("multistore", 24)])
def test_tensor_cache_gaps_exact_and_oracle(variant, gap):
    task = tensor_cache_recall(30, variant=variant, gap=gap, seed=11)
    E, s = task.config["n_episodes"], task.config["n_stores"]
    assert task.inputs.shape == (30, 1 + E * (3 * s + gap + 3))
    assert np.all(task.scored.sum(1) == E)
    assert np.all(_episode_gaps(task) == gap)
    assert token_accuracy(task, tc_oracle(task)) == 1.0
    # keys distinct within a sequence; the store is outside the W = 12 window at query time
    for row in task.inputs:
        stored = row[1:][row[:-1] == STORE]
        assert len(set(stored)) == E * s
    rows, cols = np.nonzero(task.scored)
    value_pos = [np.nonzero((task.inputs[i, :t] == task.inputs[i, t + 1]))[0][-1]
                 for i, t in zip(rows, cols, strict=True)]
    assert np.min(cols - np.array(value_pos)) > TENSOR_CACHE_WINDOW


def test_tensor_cache_long_gap_1024_and_chance():
    task = tensor_cache_recall(3, variant="long_gap", gap=1024, seed=12)
    assert task.inputs.shape == (3, 1024 + 7) and np.all(_episode_gaps(task) == 1024)
    big = tensor_cache_recall(400, seed=13)
    assert big.chance == 1 / 16
    _assert_near_chance(_guess_accuracy(big, np.random.default_rng(4)), 1 / 16, 2400)


@pytest.mark.parametrize("kwargs, match", [
    (dict(variant="nope"), "variant must be one of"),
    (dict(variant="matched", gap=30), r"gap of the 'matched' variant must be one of \(24, 36"),
    (dict(variant="filler_sweep", gap=200), r"must be in \[12, 192\]"),
    (dict(variant="multistore", n_stores=1), "the 'multistore' variant has n_stores=2"),
    (dict(variant="long_gap", n_episodes=2), "single-episode"),
    (dict(variant="custom", n_episodes=9, n_stores=2), "n_keys must be >= n_episodes"),
    (dict(variant="custom", gap=-1), "gap must be >= 0"),
])
def test_tensor_cache_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tensor_cache_recall(2, seed=0, **kwargs)


# --- skewed redundancy -----------------------------------------------------------------------

def test_skewed_redundancy_is_reexported_by_selection():
    assert svtoolkit.selection.skewed_redundancy_context is skewed_redundancy_context
    ctx = skewed_redundancy_context(np.random.default_rng(0))
    assert ctx.keys.shape == (66, 4) and list(ctx.rare_groups) == list(range(6))
    assert isinstance(ctx, svtoolkit.selection.SkewedContext)
    assert isinstance(mqar_vectors(1, seed=0), VectorTask)
