"""ForgettableMemory: exact deletion, receipts, certified eviction, persistence, threads.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import svtoolkit.memory._atomic as atomic_module
import svtoolkit.memory._table as table_module
from svtoolkit import IncrementalSVDD, SolverFailure
from svtoolkit.memory import (
    MAX_RECORD_ID_BYTES,
    MAX_VALUE_BYTES,
    MAX_VALUE_DEPTH,
    FORMAT_VERSION,
    KKT_TOL,
    BudgetExceededWarning,
    DeletionReceipt,
    ForgettableMemory,
    Hit,
    MemoryFileError,
)

#: Fixed header of a version-2 file: magic, format version, flags, header length.
HEADER = "<8sIIQ"
#: Tolerances: exact path vs a fresh solve (decision function) and the KKT residual.
FRESH_TOL = 1e-9
KKT_OK = 1e-9


def gaussian_memory(seed=0, n=40, d=3, nu=0.3, sigma=1.5, **kwargs):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    mem = ForgettableMemory(sigma=sigma, nu=nu, n0=n, **kwargs)
    for i, x in enumerate(X):
        mem.add(x, {"i": i}, record_id=f"k{i}")
    return mem, X


def snapshot(mem):
    return (mem.state_digest(), len(mem), mem.revision, mem.record_ids,
            dict(mem.tombstones))


def fresh_decision(mem, probes):
    solver = IncrementalSVDD(mem.C, mem.sigma)
    solver.extend(np.vstack([mem.key(r) for r in mem.record_ids]))
    return solver.decision_function(probes)


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"C": 0.1, "nu": 0.5, "n0": 10}, ValueError, "either C or nu"),
    ({}, ValueError, "give C, or nu together with n0"),
    ({"nu": 0.5}, ValueError, "give C, or nu together with n0"),
    ({"C": 0.1, "budget": 5}, ValueError, "budget \\* C < 1"),
    ({"C": 0.1, "budget": 20.0}, TypeError, "budget must be an int"),
    ({"C": 0.1, "budget": 0}, ValueError, "budget must be >= 1"),
    ({"C": 0.1, "min_similarity": 1.5}, ValueError, "min_similarity must be in"),
    ({"C": 0.1, "metadata": [1]}, TypeError, "metadata must be a dict"),
    ({"C": -1.0}, ValueError, "C must be finite and > 0"),
])
def test_constructor_rejects_bad_configuration(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ForgettableMemory(sigma=1.0, **kwargs)


def test_nu_is_converted_once():
    mem = ForgettableMemory(sigma=1.0, nu=0.25, n0=40)
    assert mem.C == 1.0 / (0.25 * 40)


# ------------------------------------------------------------------ add and query
def test_add_query_and_auto_ids():
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([5.0, 5.0], "taken", record_id="r1")
    first = mem.add([0.0, 0.0], "origin")
    second = mem.add([3.0, 0.0], "east")
    assert (first, second) == ("r0", "r2")  # "r1" is in use, so it is skipped
    assert [h.value for h in mem.query([2.9, 0.1])] == ["east"]
    assert mem.query([10.0, -10.0]) == []  # nothing supports it: "no record"
    assert mem.get("r2") == "east" and "r2" in mem and len(mem) == 3


def test_support_threshold_is_the_kernel_similarity():
    mem = ForgettableMemory(sigma=2.0, C=1.0, min_similarity=0.5)
    mem.add([0.0], "zero", record_id="z")
    radius = 2.0 * np.sqrt(np.log(2.0))  # k(q, x) = 0.5 exactly at this distance
    assert mem.query([0.99 * radius])[0].record_id == "z"
    assert mem.query([1.01 * radius]) == []
    assert mem.query([1.01 * radius], min_similarity=0.4)[0].score == pytest.approx(
        np.exp(-(1.01 * radius) ** 2 / 4.0), rel=1e-12)


def test_query_ranks_by_similarity_and_weights_are_the_sv_readout():
    mem, X = gaussian_memory(seed=1, n=50)
    hits = mem.query(X[3] + 0.01, k=len(mem), min_similarity=1e-300)
    assert all(isinstance(h, Hit) for h in hits) and len(hits) == len(mem)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert sum(h.weight for h in hits) == pytest.approx(1.0, abs=1e-12)
    reserve = set(mem.partition()["reserve"])
    assert reserve, "the test needs reserve records"
    assert all(h.weight == 0.0 for h in hits if h.record_id in reserve)
    assert all(h.weight > 0.0 for h in hits if h.record_id not in reserve)


@pytest.mark.parametrize("k, match", [(0, "k must be an integer >= 1"),
                                      (1.5, "k must be an integer >= 1"),
                                      (True, "k must be an integer >= 1")])
def test_query_rejects_bad_k(k, match):
    mem, X = gaussian_memory(n=10)
    with pytest.raises(ValueError, match=match):
        mem.query(X[0], k=k)


def test_query_rejects_bad_vector():
    mem, X = gaussian_memory(n=10)
    with pytest.raises(ValueError, match="q has dimension 2, expected 3"):
        mem.query([0.0, 1.0])
    with pytest.raises(ValueError, match="q contains NaN"):
        mem.query([0.0, np.nan, 1.0])


@pytest.mark.parametrize("key, value, rid, exc, match", [
    ([0.0, 1.0], "v", None, ValueError, "key has dimension 2, expected 3"),
    ([0.0, np.nan, 1.0], "v", None, ValueError, "key contains NaN"),
    ([0.0, np.inf, 1.0], "v", None, ValueError, "key contains inf"),
    (["a", "b", "c"], "v", None, TypeError, "key must be numeric"),
    ([[0.0, 1.0, 2.0]], "v", None, ValueError, "key must be 1-D"),
    ([0.0, 1.0, 2.0], {1, 2}, None, TypeError, "JSON-serialisable"),
    ([0.0, 1.0, 2.0], float("nan"), None, TypeError, "JSON-serialisable"),
    ([0.0, 1.0, 2.0], (1, 2), None, TypeError, "JSON round trip"),
    ([0.0, 1.0, 2.0], {1: "a"}, None, TypeError, "JSON round trip"),
    ([0.0, 1.0, 2.0], "v", "k0", ValueError, "duplicate record id 'k0'"),
    ([0.0, 1.0, 2.0], "v", 7, TypeError, "record_id must be a str"),
    ([0.0, 1.0, 2.0], "v", "", ValueError, "non-empty"),
])
def test_bad_add_raises_and_changes_nothing(key, value, rid, exc, match):
    mem, _ = gaussian_memory(n=12)
    before = snapshot(mem)
    with pytest.raises(exc, match=match):
        mem.add(key, value, record_id=rid)
    assert snapshot(mem) == before


def test_values_are_json_copies():
    mem = ForgettableMemory(sigma=1.0, C=1.0)
    value = {"name": "Zoë", "tags": ["a", 1, 2.5, None, True], "nested": {"x": []}}
    mem.add([0.0], value, record_id="v")
    got = mem.get("v")
    assert got == value
    got["tags"].append("mutated")
    assert mem.get("v") == value  # the stored value is not aliased


@pytest.mark.parametrize("call, match", [
    (lambda m: m.add([0.0, 1.0, 2.0], "v", record_id="bad\ud800"), "record_id contains an "
     "unpaired UTF-16 surrogate"),
    (lambda m: m.add([0.0, 1.0, 2.0], "x\udcff"), "value contains an unpaired"),
    (lambda m: m.add([0.0, 1.0, 2.0], {"k\ud800": [1]}), "value contains an unpaired"),
    (lambda m: m.edit("k2", value="\udc80"), "value contains an unpaired"),
    (lambda m: m.edit("k2", key=[0.0, 1.0, 2.0], value=["\ud800"]),
     "value contains an unpaired"),
])
def test_unpaired_surrogates_are_refused_before_anything_changes(tmp_path, call, match):
    mem, _ = gaussian_memory(n=12)
    before = snapshot(mem)
    with pytest.raises(ValueError, match=match):
        call(mem)
    assert snapshot(mem) == before and len(mem._solver) == len(mem)
    mem.save(tmp_path / "m.svtk")  # the state is still whole
    assert ForgettableMemory.load(tmp_path / "m.svtk").state_digest() == before[0]


def test_metadata_with_a_surrogate_is_refused():
    with pytest.raises(ValueError, match="metadata contains an unpaired UTF-16 surrogate"):
        ForgettableMemory(sigma=1.0, C=0.5, metadata={"note": "\ud800"})


def test_too_deep_value_is_a_value_error():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    mem, _ = gaussian_memory(n=12)
    before = snapshot(mem)
    with pytest.raises(ValueError, match="value is nested too deeply"):
        mem.add([0.0, 1.0, 2.0], deep)
    assert snapshot(mem) == before


def test_new_record_ids_are_bounded_in_length():
    mem, _ = gaussian_memory(n=12)
    longest = "\u00e9" * (MAX_RECORD_ID_BYTES // 2)  # two UTF-8 bytes each: exactly the bound
    mem.add([0.0, 1.0, 2.0], "v", record_id=longest)
    before = snapshot(mem)
    refused = rf"record_id is {MAX_RECORD_ID_BYTES + 2} bytes of UTF-8, more than the longest"
    with pytest.raises(ValueError, match=refused):
        mem.add([0.0, 1.0, 2.5], "v", record_id=longest + "\u00e9")
    with pytest.raises(ValueError, match=r"bytes of UTF-8, more than the longest"):
        mem.extend([[5.0, 5.0, 5.0]], ["v"], record_ids=["x" * (MAX_RECORD_ID_BYTES + 1)])
    assert snapshot(mem) == before
    mem.forget(longest)


def _nested(depth):
    value = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_values_are_bounded_in_depth_and_size_and_an_accepted_one_round_trips(tmp_path):
    mem, _ = gaussian_memory(n=12)
    mem.add([0.0, 1.0, 2.0], _nested(MAX_VALUE_DEPTH), record_id="deepest")
    before = snapshot(mem)
    with pytest.raises(ValueError, match=rf"value is nested too deeply: more than "
                                         rf"{MAX_VALUE_DEPTH} levels"):
        mem.add([0.0, 1.0, 2.5], _nested(MAX_VALUE_DEPTH + 1))
    with pytest.raises(ValueError, match=r"value is nested too deeply"):
        mem.edit("k1", value=[_nested(MAX_VALUE_DEPTH)])
    with pytest.raises(ValueError, match=rf"more than the largest accepted \({MAX_VALUE_BYTES}"):
        mem.add([0.0, 1.0, 2.5], "x" * (MAX_VALUE_BYTES - 1))  # two quotes make it too large
    with pytest.raises(ValueError, match=r"metadata is nested too deeply"):
        ForgettableMemory(sigma=1.0, C=0.5, metadata={"m": _nested(MAX_VALUE_DEPTH)})
    assert snapshot(mem) == before
    mem.add([0.0, 1.0, 2.5], "x" * (MAX_VALUE_BYTES - 2), record_id="largest")
    mem.save(tmp_path / "m.svtk")
    again = ForgettableMemory.load(tmp_path / "m.svtk")
    assert again.get("deepest") == _nested(MAX_VALUE_DEPTH)
    assert [h.record_id for h in again.query([0.0, 1.0, 2.0])] == ["deepest"]


@pytest.mark.parametrize("call", [
    lambda m: m.add([9.0, 9.0, 9.0], "new", record_id="new"),
    lambda m: m.edit("k2", key=[9.0, 9.0, 9.0]),
    lambda m: m.edit("k2", value="new"),
])
def test_a_failing_leaf_hash_changes_neither_memory_nor_solver(monkeypatch, call):
    """The record's hash is computed before the solver admits anything."""
    mem, _ = gaussian_memory(n=12)
    before = snapshot(mem) + (mem.get("k2"),)

    def broken(*args):
        raise RuntimeError("simulated failure while hashing the record")

    monkeypatch.setattr(table_module, "record_leaf", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        call(mem)
    assert snapshot(mem) + (mem.get("k2"),) == before and len(mem._solver) == len(mem)


def test_failed_add_uses_up_no_automatic_id(monkeypatch):
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    assert mem.add([0.0, 0.0], "a") == "r0"
    before = snapshot(mem)

    def failing(key):
        raise SolverFailure("simulated")

    monkeypatch.setattr(mem._solver, "add", failing)
    with pytest.raises(SolverFailure, match="simulated"):
        mem.add([1.0, 1.0], "x")
    assert snapshot(mem) == before
    monkeypatch.undo()
    assert mem.add([2.0, 2.0], "y") == "r1"


def test_membership_of_a_non_str_is_false():
    mem, _ = gaussian_memory(n=5)
    assert "k1" in mem and [1] not in mem and {"k1"} not in mem and 1 not in mem


def test_add_can_return_an_id_that_the_budget_evicted_at_once():
    """Documented in add(): a new reserve record with no older reserve record goes first."""
    mem = ForgettableMemory(sigma=1.0, C=1.0, budget=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetExceededWarning)
        for x in ([0.0, 0.0], [0.1, 0.0], [5.0, 5.0]):
            mem.add(x, "v")
        rid = mem.add([0.05, 0.0], "v")
    assert mem.last_evicted == (rid,) and rid not in mem
    assert mem.tombstones[rid][0] == "evicted"


# ------------------------------------------------------------------ exact deletion
def test_forget_equals_fresh_solve_after_every_step():
    rng = np.random.default_rng(2)
    mem, X = gaussian_memory(seed=2, n=45, d=4, nu=0.3)
    probes = np.vstack([X, X + 0.1 * rng.standard_normal(X.shape)])
    victims = rng.permutation(mem.record_ids)[:25]
    for rid in victims:
        receipt = mem.forget(rid, audit=True)
        assert receipt.kkt_residual <= KKT_OK
        assert receipt.audit_deviation <= FRESH_TOL
        dev = np.max(np.abs(mem.decision_function(probes) - fresh_decision(mem, probes)))
        assert dev <= FRESH_TOL
        assert rid not in mem


def test_forgotten_record_is_never_answered():
    rng = np.random.default_rng(3)
    mem = ForgettableMemory(sigma=1.0, C=0.2)
    centres = 6.0 * np.eye(6)
    for i, c in enumerate(centres):
        mem.add(c, f"fact {i}", record_id=f"f{i}")
    assert mem.query(centres[2])[0].value == "fact 2"
    mem.forget("f2")
    assert mem.query(centres[2]) == []  # "no record", not the old value
    for q in rng.standard_normal((200, 6)) * 4.0:
        hits = mem.query(q, k=10, min_similarity=1e-300)
        assert all(h.record_id != "f2" and h.value != "fact 2" for h in hits)
    others = [mem.query(c)[0].value for i, c in enumerate(centres) if i != 2]
    assert others == [f"fact {i}" for i in range(6) if i != 2]


def test_forget_bad_ids_raise_and_change_nothing():
    mem, _ = gaussian_memory(n=12)
    mem.forget("k3")
    before = snapshot(mem)
    with pytest.raises(KeyError, match="'k3' was already forgotten"):
        mem.forget("k3")
    with pytest.raises(KeyError, match="unknown record id 'nope'"):
        mem.forget("nope")
    with pytest.raises(KeyError, match="record ids are str"):
        mem.forget(3)
    with pytest.raises(KeyError, match="already forgotten"):
        mem.get("k3")
    assert snapshot(mem) == before


def test_receipt_chains_digests():
    mem, _ = gaussian_memory(n=20)
    digest = mem.state_digest()
    receipts = [mem.forget(r) for r in ("k1", "k5", "k9")]
    for r in receipts:
        assert isinstance(r, DeletionReceipt) and r.operation == "forget"
        assert r.digest_before == digest and r.digest_after != digest
        digest = r.digest_after
        assert r.audit_deviation is None and r.certified
    assert digest == mem.state_digest()
    assert [r.time for r in receipts] == sorted(r.time for r in receipts)
    assert receipts[-1].n_records == 17
    for r in receipts:  # the receipt's time is the operation's, as in the tombstone
        assert r.time == mem.tombstones[r.record_id][1]
    assert json.loads(json.dumps(receipts[0].to_dict()))["time_utc"].endswith("Z")
    assert mem.forget("k2", verify=False).kkt_residual is None


def test_reuse_of_a_forgotten_id_is_allowed():
    mem, X = gaussian_memory(n=10)
    mem.forget("k0")
    mem.add(X[0], "again", record_id="k0")
    assert mem.get("k0") == "again" and "k0" not in mem.tombstones


def test_forget_down_to_empty_and_warm_up():
    mem = ForgettableMemory(sigma=1.0, C=0.3)
    for i in range(5):
        mem.add([float(i)], i, record_id=str(i))
    assert mem.certified
    for i in range(5):
        receipt = mem.forget(str(i), audit=True)
    assert not mem.certified and len(mem) == 0 and receipt.audit_deviation is None
    assert mem.query([0.0]) == []
    with pytest.raises(ValueError, match="at least one record"):
        mem.decision_function([[0.0]])


# ------------------------------------------------------------------ edit
def test_edit_key_is_exact_remove_and_add():
    mem, X = gaussian_memory(seed=4, n=30)
    new_key = np.random.default_rng(40).standard_normal(3)  # not a copy of a held key (seed 4
    # would repeat X[0]: with duplicate keys the coefficients, and so the weights, are not unique)
    receipt = mem.edit("k7", key=new_key, value="tokyo", audit=True)
    assert receipt.operation == "edit" and receipt.audit_deviation <= FRESH_TOL
    assert mem.record_ids[-1] == "k7" and mem.get("k7") == "tokyo"
    np.testing.assert_array_equal(mem.key("k7"), new_key)
    probes = np.vstack([X, new_key])
    assert np.max(np.abs(mem.decision_function(probes) - fresh_decision(mem, probes))) \
        <= FRESH_TOL
    # the old key has no residual influence: at the old key the memory answers exactly as a
    # memory built from scratch from the records it now holds, and no held key sits there
    ref = ForgettableMemory(sigma=mem.sigma, C=mem.C)
    for rid in mem.record_ids:
        ref.add(mem.key(rid), mem.get(rid), record_id=rid)
    got = mem.query(X[7], k=len(mem), min_similarity=1e-300)
    want = ref.query(X[7], k=len(ref), min_similarity=1e-300)
    assert [h.record_id for h in got] == [h.record_id for h in want]
    np.testing.assert_allclose([h.weight for h in got], [h.weight for h in want], rtol=0,
                               atol=FRESH_TOL)
    assert max(h.score for h in got) < 1.0


def test_edit_value_only_keeps_the_solver_state():
    mem, X = gaussian_memory(n=25)
    probes = X + 0.05
    f_before = mem.decision_function(probes)
    order = mem.record_ids
    receipt = mem.edit("k4", value=None)  # None is a value (JSON null)
    assert mem.get("k4") is None and mem.record_ids == order
    np.testing.assert_array_equal(mem.decision_function(probes), f_before)
    assert receipt.digest_after != receipt.digest_before


def test_bad_edit_raises_and_changes_nothing():
    mem, _ = gaussian_memory(n=12)
    mem.forget("k1")
    before = snapshot(mem)
    with pytest.raises(ValueError, match="edit needs a new value, a new key, or both"):
        mem.edit("k2")
    with pytest.raises(ValueError, match="key contains NaN"):
        mem.edit("k2", key=[np.nan, 0.0, 0.0])
    with pytest.raises(KeyError, match="already forgotten"):
        mem.edit("k1", value=3)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        mem.edit("k2", value=object())
    assert snapshot(mem) == before


# ------------------------------------------------------------------ certified eviction
def test_evict_reserve_changes_no_decision_value():
    mem, X = gaussian_memory(seed=5, n=60, nu=0.2)
    probes = np.vstack([X, 2.0 * np.random.default_rng(5).standard_normal((30, 3))])
    f_before = mem.decision_function(probes)
    reserve = mem.partition()["reserve"]
    q = X[10] + 0.02
    support_weights = {h.record_id: h.weight for h in mem.query(q, k=len(mem),
                                                                 min_similarity=1e-300)
                       if h.weight > 0}
    evicted = mem.evict_reserve()
    assert list(evicted) == reserve and mem.last_evicted == evicted
    assert all(mem.tombstones[r][0] == "evicted" for r in evicted)
    assert np.max(np.abs(mem.decision_function(probes) - f_before)) <= 1e-12
    after = {h.record_id: h.weight for h in mem.query(q, k=len(mem), min_similarity=1e-300)}
    assert after.keys() == support_weights.keys()
    for rid, w in after.items():
        assert w == pytest.approx(support_weights[rid], abs=1e-12)
    with pytest.raises(KeyError, match="already evicted"):
        mem.forget(evicted[0])


def test_budget_evicts_reserve_oldest_first():
    rng = np.random.default_rng(6)
    mem = ForgettableMemory(sigma=1.5, nu=0.2, n0=60, budget=45)
    shadow = ForgettableMemory(sigma=1.5, nu=0.2, n0=60)  # same records, no budget
    X = rng.standard_normal((60, 3))
    n_evicted = 0
    for i, x in enumerate(X):
        mem.add(x, i, record_id=str(i))
        shadow.add(x, i, record_id=str(i))
        evicted = list(mem.last_evicted)
        # evicted = the oldest reserve records of the state right after the admission
        assert evicted == shadow.partition()["reserve"][: len(evicted)]
        for rid in evicted:
            shadow.forget(rid, verify=False)
        n_evicted += len(evicted)
        assert mem.record_ids == shadow.record_ids and len(mem) <= 45
        assert mem.over_budget is False
    assert n_evicted == 15
    assert mem.audit().fresh_deviation <= FRESH_TOL


def test_budget_below_support_warns_and_grows():
    rng = np.random.default_rng(7)
    mem = ForgettableMemory(sigma=0.3, C=0.1, budget=10)  # tiny sigma: every key is support
    X = 5.0 * rng.standard_normal((14, 2))
    with pytest.warns(BudgetExceededWarning, match="more than the budget 10"):
        for i, x in enumerate(X):
            mem.add(x, i)
    assert mem.over_budget and len(mem) == 14 and mem.audit().over_budget


# ------------------------------------------------------------------ persistence
def test_round_trip_is_bit_exact_and_continues_identically(tmp_path):
    mem, X = gaussian_memory(seed=8, n=50, budget=40)
    assert len(mem.tombstones) == 10  # evicted by the budget
    held = mem.record_ids
    mem.forget(held[3])
    mem.edit(held[4], value=["edited", 1])
    path = tmp_path / "m.svtk"
    mem.save(path)
    loaded = ForgettableMemory.load(path)
    assert loaded.state_digest() == mem.state_digest()  # covers alpha and rho bits
    assert loaded._solver.rho == mem._solver.rho
    np.testing.assert_array_equal(loaded._solver.alpha, mem._solver.alpha)
    assert loaded.record_ids == mem.record_ids and loaded.tombstones == mem.tombstones
    assert (loaded.budget, loaded.min_similarity, loaded.revision) == \
        (mem.budget, mem.min_similarity, mem.revision)
    probes = X + 0.03
    np.testing.assert_array_equal(loaded.decision_function(probes), mem.decision_function(probes))
    # the same next operations give the same states, bit for bit
    for m in (mem, loaded):
        m.forget(held[10])
        m.add(X[3] + 0.5, "new", record_id="n")
    assert loaded.state_digest() == mem.state_digest()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_empty_memory_round_trip(tmp_path):
    mem = ForgettableMemory(sigma=1.0, C=0.5, metadata={"encoder": "x"})
    mem.save(tmp_path / "e")
    loaded = ForgettableMemory.load(tmp_path / "e")
    assert len(loaded) == 0 and loaded.metadata == {"encoder": "x"}
    assert loaded.state_digest() == mem.state_digest()
    grown = ForgettableMemory(sigma=1.0, C=0.5)
    grown.add([1.0, 2.0], "a", record_id="a")
    grown.forget("a")
    grown.save(tmp_path / "g")
    again = ForgettableMemory.load(tmp_path / "g")
    with pytest.raises(ValueError, match="key has dimension 3, expected 2"):
        again.add([1.0, 2.0, 3.0], "b")
    again.add([0.5, 0.5], "b", record_id="b")
    assert again.query([0.5, 0.5])[0].value == "b"


def _rewrite(path, mutate):
    """Apply ``mutate`` to the header dict and/or arrays of a saved file; recompute checksum."""
    data = path.read_bytes()
    _, _, flags, hlen = struct.unpack_from(HEADER, data, 0)
    assert flags == 0  # an unsigned file
    start = struct.calcsize(HEADER)
    header = json.loads(data[start:start + hlen])
    blob = bytearray(data[start + hlen:-32])
    mutate(header, blob)
    text = json.dumps(header).encode()
    body = struct.pack(HEADER, b"SVTKMEM\x00", FORMAT_VERSION, 0, len(text)) + text + \
        bytes(blob)
    path.write_bytes(body + hashlib.sha256(body).digest())


def _alpha_offset(header, index):
    spec = next(a for a in header["arrays"] if a["name"] == "alpha")
    return spec["offset"] + 8 * index


@pytest.fixture
def saved(tmp_path):
    mem, _ = gaussian_memory(seed=9, n=30)
    path = tmp_path / "m.svtk"
    mem.save(path)
    return path


def test_damaged_file_is_refused(saved):
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError, match="checksum mismatch"):
        ForgettableMemory.load(saved)


def test_truncated_and_foreign_files_are_refused(saved, tmp_path):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    with pytest.raises(MemoryFileError, match="checksum mismatch"):
        ForgettableMemory.load(saved)
    other = tmp_path / "other"
    other.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(MemoryFileError, match="not an svtoolkit memory file"):
        ForgettableMemory.load(other)
    other.write_bytes(b"SVTK")
    with pytest.raises(MemoryFileError, match="too short"):
        ForgettableMemory.load(other)


def test_other_format_version_is_refused(saved):
    data = bytearray(saved.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    saved.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError, match=f"unsupported format version {FORMAT_VERSION + 1}"):
        ForgettableMemory.load(saved)


def _array_offset(header, name, index):
    spec = next(a for a in header["arrays"] if a["name"] == name)
    return spec["offset"] + np.dtype(spec["dtype"]).itemsize * index


def _margin_slots(path):
    solver = ForgettableMemory.load(path)._solver.state_dict()
    return solver["S"], solver["Xt"].shape


def test_tampered_coefficient_off_its_partition_is_refused_structurally(saved):
    def bump(header, blob):
        i = _alpha_offset(header, 0)
        a = struct.unpack_from("<d", blob, i)[0]
        struct.pack_into("<d", blob, i, a + 1e-3)

    _rewrite(saved, bump)
    with pytest.raises(MemoryFileError, match="inconsistent solver state: .*coefficients"):
        ForgettableMemory.load(saved)


def test_tampered_coefficients_that_keep_the_structure_fail_the_kkt_check(saved):
    """Mass moved between two margin coefficients: sum and box intact, optimality not."""
    S, _ = _margin_slots(saved)
    assert len(S) >= 2

    def shift(header, blob):
        for slot, delta in ((S[0], 1e-4), (S[1], -1e-4)):
            i = _array_offset(header, "alpha", int(slot))
            struct.pack_into("<d", blob, i, struct.unpack_from("<d", blob, i)[0] + delta)

    _rewrite(saved, shift)
    with pytest.raises(MemoryFileError, match="kkt residual .* exceeds"):
        ForgettableMemory.load(saved)
    assert KKT_TOL < 1e-4


@pytest.mark.parametrize("name, figure", [("grad", "grad drift"),
                                          ("R", "inverse residual"),
                                          ("KSt", "margin rows drift")])
def test_tampered_solver_arrays_are_refused(saved, name, figure):
    """The arrays later deletions build on: a wrong one would make them inexact."""
    def nudge(header, blob):
        i = _array_offset(header, name, 1)
        struct.pack_into("<d", blob, i, struct.unpack_from("<d", blob, i)[0] + 1e-3)

    _rewrite(saved, nudge)
    with pytest.raises(MemoryFileError, match=f"{figure} .* exceeds"):
        ForgettableMemory.load(saved)
    ForgettableMemory.load(saved, check_kkt=False)  # structurally sound: only the numbers lie


def test_tampered_value_is_refused_by_the_digest(saved):
    def edit_value(header, blob):
        header["records"][0][2] = json.dumps("forged")

    _rewrite(saved, edit_value)
    with pytest.raises(MemoryFileError, match="state digest mismatch"):
        ForgettableMemory.load(saved)


@pytest.mark.parametrize("mutate, match", [
    (lambda h, b: h["arrays"][0].update(dtype="|O"), "refused dtype"),
    (lambda h, b: h["arrays"][0].update(offset=10**9), "does not fit"),
    (lambda h, b: h.pop("records"), "malformed contents"),
    (lambda h, b: h["records"].pop(), "record table does not match"),
    (lambda h, b: h["records"][0].__setitem__(2, "{not json"), "malformed contents"),
    (lambda h, b: h["tombstones"].append(["x", "stolen", 0.0]), "unknown tombstone"),
    (lambda h, b: h["tombstones"].append([h["records"][0][0], "forgotten", 0.0]),
     "both held and tombstoned"),
    (lambda h, b: h["config"].update(C=123.0), "configuration disagrees"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", float("nan")]),
     "tombstone of 'x' has time nan"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", float("inf")]), "has time inf"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", 1e300]), "has time 1e\\+300"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", -1.0]), "has time -1.0"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", "5"]), "has time '5'"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten", True]), "has time True"),
    (lambda h, b: h["tombstones"].append(["x", "forgotten"]), "not a \\[record_id, reason"),
    (lambda h, b: h["tombstones"].extend([["x", "evicted", 1.0], ["x", "evicted", 2.0]]),
     "tombstoned twice"),
    (lambda h, b: h.update(tombstones={"x": 1}), "tombstones must be a list"),
    (lambda h, b: h.update(next_auto=-3), "next_auto must be an integer >= 0; got -3"),
    (lambda h, b: h.update(revision=-5), "revision must be an integer >= 0; got -5"),
    (lambda h, b: h.update(revision=2.5), "revision must be an integer >= 0; got 2.5"),
    (lambda h, b: h.update(metadata_json='{"a": "\\ud800"}'), "malformed contents"),
])
def test_malformed_contents_are_refused(saved, mutate, match):
    _rewrite(saved, mutate)
    with pytest.raises(MemoryFileError, match=match):
        ForgettableMemory.load(saved)


def _write_raw_header(path, text):
    """Replace the header of a saved file by raw bytes ``text``; recompute the checksum."""
    data = path.read_bytes()
    _, _, _, hlen = struct.unpack_from(HEADER, data, 0)
    start = struct.calcsize(HEADER)
    body = struct.pack(HEADER, b"SVTKMEM\x00", FORMAT_VERSION, 0, len(text)) + text + \
        data[start + hlen:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("text, match", [
    (b"[]", "header is a JSON list, not an object"),
    (b'"svtoolkit"', "header is a JSON str, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"\xff\xfe", "header is not valid UTF-8 JSON"),
])
def test_header_that_is_not_an_object_is_refused(saved, text, match):
    _write_raw_header(saved, text)
    with pytest.raises(MemoryFileError, match=match):
        ForgettableMemory.load(saved)


def test_a_file_saved_with_tombstones_still_loads(saved):
    mem = ForgettableMemory.load(saved)
    mem.forget("k4")
    mem.evict_reserve(1)
    mem.save(saved)
    loaded = ForgettableMemory.load(saved)
    assert loaded.tombstones == mem.tombstones and len(loaded.tombstones) == 2


def test_crash_during_save_keeps_the_previous_file(saved, monkeypatch):
    previous = saved.read_bytes()
    mem = ForgettableMemory.load(saved)
    mem.forget("k0")
    calls = {"n": 0}
    real = atomic_module._write_chunk

    def failing(fh, chunk, hasher):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("simulated crash: disk full")
        real(fh, chunk, hasher)

    monkeypatch.setattr(atomic_module, "_write_chunk", failing)
    with pytest.raises(OSError, match="simulated crash"):
        mem.save(saved)
    assert saved.read_bytes() == previous
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # temp removed
    assert "k0" in ForgettableMemory.load(saved)


def test_hard_kill_during_save_keeps_the_previous_file(saved):
    previous = saved.read_bytes()
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory as m
        import svtoolkit.memory._atomic as atomic
        mem = m.ForgettableMemory.load({str(saved)!r})
        mem.forget("k0")
        real, calls = atomic._write_chunk, [0]
        def dying(fh, chunk, hasher):
            calls[0] += 1
            if calls[0] == 3:
                fh.flush()
                os._exit(9)  # no cleanup, no exception handlers: a crash
            real(fh, chunk, hasher)
        atomic._write_chunk = dying
        mem.save({str(saved)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    assert saved.read_bytes() == previous
    assert "k0" in ForgettableMemory.load(saved)


def test_save_replaces_atomically_and_cleans_up(saved):
    mem = ForgettableMemory.load(saved)
    mem.forget("k5")
    mem.save(saved)
    assert "k5" not in ForgettableMemory.load(saved)
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


# ------------------------------------------------------------------ threads
def test_concurrent_saves_never_resurrect_a_forgotten_record(tmp_path, monkeypatch):
    """An older save still writing must not rename over a newer one (the lock is held)."""
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([0.0, 0.0], "secret", record_id="a")
    mem.add([3.0, 0.0], "b", record_id="b")
    path = tmp_path / "m.svtk"
    started, release, errors = threading.Event(), threading.Event(), []
    real = atomic_module._write_chunk

    def slow(fh, chunk, hasher):
        if threading.current_thread().name == "old-save" and not started.is_set():
            started.set()
            release.wait(timeout=0.5)  # the older save is slow to reach the disk
        real(fh, chunk, hasher)

    def old_save():
        try:
            mem.save(path)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    monkeypatch.setattr(atomic_module, "_write_chunk", slow)
    old = threading.Thread(target=old_save, name="old-save")
    old.start()
    assert started.wait(timeout=30)
    mem.forget("a")  # with the lock held through the write, this waits for the old save
    mem.save(path)
    release.set()
    old.join()
    assert not errors
    assert ForgettableMemory.load(path).record_ids == mem.record_ids == ["b"]


def _observe(mem, q):
    """One query's full answer (every held record, with its weight); it identifies the state."""
    return tuple((h.record_id, h.weight) for h in mem.query(q, k=10_000, min_similarity=1e-300))


def test_concurrent_queries_never_see_a_half_applied_operation():
    rng = np.random.default_rng(10)
    X = rng.standard_normal((70, 3))
    probes = rng.standard_normal((3, 3))
    script = [("add", i) for i in range(30)]
    live = list(range(30))
    for i in range(30, 70):  # interleave adds and forgets; never re-add a removed key
        script.append(("add", i))
        live.append(i)
        victim = live.pop(int(rng.integers(len(live) - 1)))
        script.append(("forget", victim))

    def apply(mem, op):
        kind, i = op
        if kind == "add":
            mem.add(X[i], i, record_id=str(i))
        else:
            mem.forget(str(i), verify=False)

    # serial replay: for each probe, the answer after every prefix of the script
    replay = ForgettableMemory(sigma=1.5, C=0.05)
    valid = [{_observe(replay, q): 0} for q in probes]
    for r, op in enumerate(script, start=1):
        apply(replay, op)
        for table, q in zip(valid, probes, strict=True):
            table.setdefault(_observe(replay, q), r)

    mem = ForgettableMemory(sigma=1.5, C=0.05)
    done = threading.Event()
    seen = [[] for _ in probes]  # one reader per probe
    errors = []

    def reader(q, out):
        try:
            while not done.is_set():
                out.append(_observe(mem, q))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=pair)
               for pair in zip(probes, seen, strict=True)]
    for t in threads:
        t.start()
    try:
        for op in script:
            apply(mem, op)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors
    assert sum(len(s) for s in seen) > 50
    for table, s in zip(valid, seen, strict=True):
        revisions = [table.get(obs) for obs in s]
        assert None not in revisions, "a query saw a state no serial replay produces"
        assert revisions == sorted(revisions), "a reader went back in time"


def test_public_names_are_exported():
    import svtoolkit

    for name in ("ForgettableMemory", "DeletionReceipt", "Hit", "MemoryFileError",
                 "BudgetExceededWarning"):
        assert name in svtoolkit.__all__ and hasattr(svtoolkit, name)


def test_no_warnings_on_normal_use(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mem, X = gaussian_memory(n=15)
        mem.forget("k1", audit=True)
        mem.save(tmp_path / "w")
        ForgettableMemory.load(tmp_path / "w").audit()
