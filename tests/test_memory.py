"""ForgettableMemory: exact deletion, receipts, certified eviction, persistence, threads.

Seeds: every test draws from np.random.default_rng(<seed in the test>).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from _store_edit import edit_store

import svtoolkit.memory._atomic as atomic_module
import svtoolkit.memory._database as database_module
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

#: Fixed header of a version-2 single file: magic, format version, flags, header length.
HEADER = "<8sIIQ"
LEGACY_VERSION = 2
#: The version-2 fixture files (tests/data/make_memory_v2.py).
DATA = Path(__file__).parent / "data"
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


# A store database is tampered with as whoever can write the file would: rows changed through
# SQLite, the unkeyed seal recomputed (edit_store; reseal=False leaves the seal as it was). The
# single files of version 2 (still read, converted at the next save) are tampered with through
# their bytes, the trailing sha256 recomputed: tests/data/memory_v2.svtk, written by the code
# that wrote that format.
def _legacy_parts(data):
    """(header dict, array bytes) of an unsigned version-2 file."""
    _, version, flags, hlen = struct.unpack_from(HEADER, data, 0)
    assert (version, flags) == (LEGACY_VERSION, 0)  # an unsigned version-2 file
    start = struct.calcsize(HEADER)
    return json.loads(data[start:start + hlen]), bytearray(data[start + hlen:-32])


def _legacy_file(text, blob):
    body = struct.pack(HEADER, b"SVTKMEM\x00", LEGACY_VERSION, 0, len(text)) + text + bytes(blob)
    return body + hashlib.sha256(body).digest()


def _rewrite_legacy(path, mutate):
    """Apply ``mutate`` to the header dict and/or arrays of a version-2 file; recompute the
    checksum."""
    header, blob = _legacy_parts(path.read_bytes())
    mutate(header, blob)
    path.write_bytes(_legacy_file(json.dumps(header).encode(), blob))


def _write_raw_legacy_header(path, text):
    """Replace the header of a version-2 file by raw bytes ``text``; recompute the checksum."""
    _, blob = _legacy_parts(path.read_bytes())
    path.write_bytes(_legacy_file(text, blob))


def _array_offset(header, name, index):
    """Byte offset of element ``index`` of array ``name`` in a version-2 file's array bytes."""
    spec = next(a for a in header["arrays"] if a["name"] == name)
    return spec["offset"] + np.dtype(spec["dtype"]).itemsize * index


@pytest.fixture
def saved(tmp_path):
    mem, _ = gaussian_memory(seed=9, n=30)
    path = tmp_path / "m.svtk"
    mem.save(path)
    return path


@pytest.fixture
def legacy(tmp_path):
    """A copy of the unsigned version-2 fixture file."""
    path = tmp_path / "v2.svtk"
    shutil.copyfile(DATA / "memory_v2.svtk", path)
    return path


def _state(mem):
    """Everything a load restores: records (the digest), tombstones, counters, configuration,
    metadata, the rolling audit's cursor and the receipt chain."""
    return (mem.state_digest(), mem.record_ids, dict(mem.tombstones), mem.metadata,
            mem.revision, mem._next_auto, mem.budget, mem.min_similarity, mem._nu, mem._n0,
            mem._rolling.cursor(), mem._receipt_chain)


def _refused_or_unchanged(path, expected):
    """Load ``path``: a MemoryFileError, or a memory whose state is ``expected``. Returns
    whether it was refused."""
    try:
        loaded = ForgettableMemory.load(path)
    except MemoryFileError:
        return True
    assert _state(loaded) == expected
    return False


def _flip_at(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _offset_of(path, needle):
    data = path.read_bytes()
    assert data.count(needle) == 1, needle
    return data.index(needle)


def test_damaged_file_is_refused(saved):
    """A flipped byte in what the store holds is refused.

    A version-2 file was refused whatever byte flipped (its sha256 covered every byte). A store
    database is SQLite pages, part of which no reader reads (the unallocated space of a page,
    zeroed by secure_delete, and its slack): a byte flipped there changes nothing, so "a flip
    anywhere is refused" is no longer the property. What is: a flip in a record's value or key
    (the state digest), in the header (the seal) or in SQLite's page structure is refused, and
    a flip anywhere is refused or changes nothing (the next test).
    """
    mem = ForgettableMemory.load(saved)
    assert mem.get("k17") == {"i": 17} and mem.revision == 30
    value = _offset_of(saved, b'{"i":17}') + len(b'{"i":1')  # its 7 -> 6: canonical still
    key = _offset_of(saved, mem.key("k5").tobytes())  # lowest mantissa bit: the KKT checks pass
    header = _offset_of(saved, b'"revision":30') + len(b'"revision":')  # 30 -> 20
    previous = saved.read_bytes()
    for offset, match in [(value, "state digest mismatch"), (key, "state digest mismatch"),
                          (header, "seal mismatch"),
                          (16, r"not a readable store database \(file is not a database\)"),
                          (100, "not a readable store database")]:  # page size; page 1's type
        _flip_at(saved, offset)
        with pytest.raises(MemoryFileError, match=match):
            ForgettableMemory.load(saved)
        saved.write_bytes(previous)
    assert ForgettableMemory.load(saved).state_digest() == mem.state_digest()


def test_no_flipped_byte_changes_a_loaded_state(tmp_path):
    """Wherever a byte flips (a sample of positions, records and tombstones included), the
    store is refused or loads the state saved, never another one."""
    mem, _ = gaussian_memory(seed=9, n=30)
    mem.forget("k3")
    mem.evict_reserve(1)
    path = tmp_path / "m.svtk"
    mem.save(path)
    expected = _state(mem)
    data = path.read_bytes()
    damaged = tmp_path / "damaged.svtk"
    refused = 0
    for offset in np.random.default_rng(11).choice(len(data), size=600, replace=False):
        for stale in (damaged, tmp_path / "damaged.svtk-journal"):
            stale.unlink(missing_ok=True)
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        damaged.write_bytes(bytes(flipped))
        refused += _refused_or_unchanged(damaged, expected)
    assert 0 < refused < 600  # both kinds of bytes were drawn


def test_truncated_and_foreign_files_are_refused(saved, tmp_path):
    data = saved.read_bytes()
    expected = _state(ForgettableMemory.load(saved))
    for size in (len(data) - 4096, len(data) // 2, 4096, 50):  # the last page dropped, ...
        saved.write_bytes(data[:size])
        with pytest.raises(MemoryFileError, match="not a readable store database"):
            ForgettableMemory.load(saved)
    for size in range(0, len(data), 256):  # a cut in a page's unused tail changes nothing
        saved.write_bytes(data[:size])
        _refused_or_unchanged(saved, expected)
    other = tmp_path / "other"
    other.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(MemoryFileError, match="not an svtoolkit memory file"):
        ForgettableMemory.load(other)
    other.write_bytes(b"SVTK")
    with pytest.raises(MemoryFileError, match="too short"):
        ForgettableMemory.load(other)
    other.unlink()
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE meta(name TEXT PRIMARY KEY, value BLOB)")
    con.commit()
    con.close()
    with pytest.raises(MemoryFileError, match="an SQLite database, but not an svtoolkit "
                                              "memory store"):
        ForgettableMemory.load(other)
    saved.write_bytes(data)
    _set_pragma(saved, "application_id", 0x12345678)
    with pytest.raises(MemoryFileError, match="an SQLite database, but not an svtoolkit "
                                              "memory store"):
        ForgettableMemory.load(saved)


def _set_pragma(path, name, value):
    con = sqlite3.connect(path)
    try:
        con.execute(f"PRAGMA {name} = {int(value)}")
        con.commit()
    finally:
        con.close()


def test_other_format_version_is_refused(saved, legacy):
    _set_pragma(saved, "user_version", FORMAT_VERSION + 1)
    with pytest.raises(MemoryFileError, match=f"unsupported store database version "
                                              f"{FORMAT_VERSION + 1}"):
        ForgettableMemory.load(saved)
    _set_pragma(saved, "user_version", FORMAT_VERSION)
    ForgettableMemory.load(saved)
    edit_store(saved, header=lambda h: {**h, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(MemoryFileError, match=f"header does not describe a "
                                              f"version-{FORMAT_VERSION} store"):
        ForgettableMemory.load(saved)
    data = bytearray(legacy.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)  # a single file of no known version
    legacy.write_bytes(bytes(data))
    with pytest.raises(MemoryFileError, match=f"unsupported format version {FORMAT_VERSION + 1}"):
        ForgettableMemory.load(legacy)


def _margin_slots(path):
    return ForgettableMemory.load(path)._solver.state_dict()["S"]


def test_tampered_coefficient_off_its_partition_is_refused_structurally(saved):
    def bump(arrays):
        arrays["alpha"][0] += 1e-3

    edit_store(saved, arrays=bump)
    with pytest.raises(MemoryFileError, match="inconsistent solver state: .*coefficients"):
        ForgettableMemory.load(saved)


def test_tampered_coefficients_that_keep_the_structure_fail_the_kkt_check(saved):
    """Mass moved between two margin coefficients: sum and box intact, optimality not."""
    S = _margin_slots(saved)
    assert len(S) >= 2

    def shift(arrays):
        arrays["alpha"][S[0]] += 1e-4
        arrays["alpha"][S[1]] -= 1e-4

    edit_store(saved, arrays=shift)
    with pytest.raises(MemoryFileError, match="kkt residual .* exceeds"):
        ForgettableMemory.load(saved)
    assert KKT_TOL < 1e-4


@pytest.mark.parametrize("name, figure, store", [("grad", "grad drift", "saved"),
                                                 ("R", "inverse residual", "saved"),
                                                 # a database stores no margin rows
                                                 ("KSt", "margin rows drift", "legacy")])
def test_tampered_solver_arrays_are_refused(request, name, figure, store):
    """The arrays later deletions build on: a wrong one would make them inexact."""
    path = request.getfixturevalue(store)
    if store == "saved":
        def nudge(arrays):
            arrays[name].reshape(-1)[1] += 1e-3

        edit_store(path, arrays=nudge)
    else:
        def nudge(header, blob):
            i = _array_offset(header, name, 1)
            struct.pack_into("<d", blob, i, struct.unpack_from("<d", blob, i)[0] + 1e-3)

        _rewrite_legacy(path, nudge)
    with pytest.raises(MemoryFileError, match=f"{figure} .* exceeds"):
        ForgettableMemory.load(path)
    ForgettableMemory.load(path, check_kkt=False)  # structurally sound: only the numbers lie


def test_a_store_on_dense_collinear_keys_saves_loads_and_forgets(tmp_path):
    """500 collinear keys (sigma = 0.1 x the median distance, nu = 0.01): the build is an
    active-set build whose margin set is numerically singular, so even a fresh inverse of it
    is ~1e-2 off (above the load's 1e-6). The load used to refuse the saved store as
    corrupted; it now accepts an inverse within INVERSE_FLOOR_FACTOR of a fresh one's
    residual - and still refuses a nudged one (the test above)."""
    t = np.random.default_rng(0).uniform(0.0, 1.0, 500)
    X = np.c_[t, 2.0 * t + 0.5]
    d = np.sqrt(((X[:, None] - X[None]) ** 2).sum(-1))[np.triu_indices(500, 1)]
    mem = ForgettableMemory(sigma=0.1 * float(np.median(d)), nu=0.01, n0=500)
    mem.extend(X, [f"v{i}" for i in range(500)], record_ids=[f"r{i}" for i in range(500)])
    path = tmp_path / "m.svtk"
    mem.save(path)
    loaded = ForgettableMemory.load(path, verify="full")
    assert loaded.state_digest() == mem.state_digest()
    receipt = loaded.forget(loaded.partition()["margin"][0])
    assert receipt.kkt_residual <= KKT_TOL
    loaded.save(path)
    assert len(ForgettableMemory.load(path, verify="full")) == 499


def test_margin_rows_are_recomputed_bit_for_bit_at_load(tmp_path):
    """What replaces the stored margin kernel rows (and margin positions): a load recomputes
    them with the bits of the saved memory's maintained ones, after full and incremental
    saves."""
    mem, X = gaussian_memory(seed=8, n=50, budget=40)
    mem.forget(mem.record_ids[3])
    mem.edit(mem.record_ids[4], key=X[4] + 0.3)
    path = tmp_path / "m.svtk"
    mem.save(path)
    for step in range(3):
        loaded = ForgettableMemory.load(path)
        want, got = mem._solver.state_dict(), loaded._solver.state_dict()
        assert want["KSt"].shape[0] >= 2  # margin rows to compare
        for name in ("KSt", "spos"):
            assert np.array_equal(got[name], want[name]), (step, name)
        loaded.forget(loaded.record_ids[step])
        loaded.add(X[step] + 0.7, "new", record_id=f"n{step}")
        loaded.save(path)  # written as a change of the database
        mem = loaded


def test_tampered_value_is_refused_by_the_digest(saved):
    edit_store(saved, sql=[("UPDATE records SET value = ? WHERE sid = "
                            "(SELECT MIN(sid) FROM records)", (json.dumps("forged"),))])
    with pytest.raises(MemoryFileError, match="state digest mismatch"):
        ForgettableMemory.load(saved)


def _header_edit(edit):
    """A store edit: ``edit`` (dict -> dict) applied to the header, the seal recomputed."""
    return lambda path: edit_store(path, header=edit)


def _sql_edit(statement, params=(), header=None, reseal=True):
    return lambda path: edit_store(path, sql=[(statement, params)], header=header,
                                   reseal=reseal)


def _tombstone(record_id, reason, when):
    """A store edit: a tombstone row appended (the next sequence number), counted in the
    header, the seal recomputed."""
    return _sql_edit("INSERT INTO tombstones VALUES ((SELECT COALESCE(MAX(seq), -1) + 1 FROM "
                     "tombstones), ?, ?, ?)", (record_id, reason, when),
                     header=lambda h: {**h, "n_tombstones": h["n_tombstones"] + 1})


_LAST_RECORD = "(SELECT MAX(sid) FROM records)"


@pytest.mark.parametrize("edit, match", [
    (_header_edit(lambda h: {**h, "arrays": {**h["arrays"], "R": [n + 1 for n in h["arrays"]
                                                                  ["R"]]}}), "does not fit"),
    (_header_edit(lambda h: {k: v for k, v in h.items() if k != "config"}),
     "malformed contents"),
    (_sql_edit(f"DELETE FROM records WHERE sid = {_LAST_RECORD}",
               header=lambda h: {**h, "n_records": h["n_records"] - 1}),
     "record table does not match"),
    (_sql_edit(f"DELETE FROM records WHERE sid = {_LAST_RECORD}"),
     "record or tombstone count disagrees with its header"),
    (_sql_edit(f"UPDATE records SET sid = 1000000 WHERE sid = {_LAST_RECORD}"),
     "record table does not match"),
    (_sql_edit(f"UPDATE records SET key = substr(key, 1, 16) WHERE sid = {_LAST_RECORD}"),
     "record table does not match"),
    (_sql_edit(f"UPDATE records SET value = '{{not json' WHERE sid = {_LAST_RECORD}"),
     "malformed contents"),
    (_tombstone("x", "stolen", 0.0), "unknown tombstone"),
    (_tombstone("k0", "forgotten", 0.0), "both held and tombstoned"),
    (_header_edit(lambda h: {**h, "config": {**h["config"], "C": 123.0}}),
     "configuration disagrees"),
    (_tombstone("x", "forgotten", 1e300), "tombstone of 'x' has time 1e\\+300"),
    (_tombstone("x", "forgotten", -1.0), "has time -1.0"),
    (_tombstone("x", "forgotten", "five"), "has time 'five'"),
    (_header_edit(lambda h: {**h, "next_auto": -3}), "next_auto must be an integer >= 0; got -3"),
    (_header_edit(lambda h: {**h, "revision": -5}), "revision must be an integer >= 0; got -5"),
    (_header_edit(lambda h: {**h, "revision": 2.5}),
     "revision must be an integer >= 0; got 2.5"),
    (_header_edit(lambda h: {**h, "metadata_json": '{"a": "\\ud800"}'}), "malformed contents"),
    (_sql_edit("DROP TABLE tombstones", reseal=False), "lacks the tables \\['tombstones'\\]"),
    (_sql_edit("DELETE FROM meta WHERE name = 'array:fs'", reseal=False),
     "meta row 'array:fs' is missing"),
    (_sql_edit("DELETE FROM slots WHERE name = 'grad'"), "slot array 'grad' holds 0 entries"),
    (_sql_edit("INSERT INTO slots VALUES ('grad', 7, x'00')"), "slot blocks are not contiguous"),
])
def test_malformed_contents_are_refused(saved, edit, match):
    edit(saved)
    with pytest.raises(MemoryFileError, match=match):
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
def test_malformed_legacy_contents_are_refused(legacy, mutate, match):
    """The version-2 reader's refusals (dtypes, offsets, tombstone lists and triples are its
    own: a database's columns fix them)."""
    ForgettableMemory.load(legacy)  # the fixture itself loads
    _rewrite_legacy(legacy, mutate)
    with pytest.raises(MemoryFileError, match=match):
        ForgettableMemory.load(legacy)


_NOT_AN_OBJECT = [b"[]", b'"svtoolkit"', b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"]


_NOT_AN_OBJECT_REFUSALS = ["header is a JSON list, not an object",
                           "header is a JSON str, not an object", "nested too deeply",
                           "header is not valid UTF-8 JSON"]


@pytest.mark.parametrize("text, match", list(zip(_NOT_AN_OBJECT, _NOT_AN_OBJECT_REFUSALS)))
def test_header_that_is_not_an_object_is_refused(saved, text, match):
    edit_store(saved, header_text=text)
    with pytest.raises(MemoryFileError, match=match):
        ForgettableMemory.load(saved)


@pytest.mark.parametrize("text, match", list(zip(_NOT_AN_OBJECT, _NOT_AN_OBJECT_REFUSALS)))
def test_legacy_header_that_is_not_an_object_is_refused(legacy, text, match):
    _write_raw_legacy_header(legacy, text)
    with pytest.raises(MemoryFileError, match=match):
        ForgettableMemory.load(legacy)


def test_a_file_saved_with_tombstones_still_loads(saved):
    mem = ForgettableMemory.load(saved)
    mem.forget("k4")
    mem.evict_reserve(1)
    mem.save(saved)
    loaded = ForgettableMemory.load(saved)
    assert loaded.tombstones == mem.tombstones and len(loaded.tombstones) == 2


def _full_write_case(kind, saved, tmp_path):
    """(memory with a change, target, the record the change removed): a save of the memory
    to the target writes a whole new database (temporary file, rename). The target holds a
    copy of ``saved`` (the memory is bound to ``saved``, not to it) or a version-2 file (the
    save converts it); it is alone in its directory."""
    target = tmp_path / "full" / f"{kind}.svtk"
    target.parent.mkdir()
    if kind == "database":
        shutil.copyfile(saved, target)
        mem, gone = ForgettableMemory.load(saved), "k0"
    else:
        shutil.copyfile(DATA / "memory_v2.svtk", target)
        mem, gone = ForgettableMemory.load(target), "k4"
    mem.forget(gone)
    return mem, target, gone


@pytest.mark.parametrize("kind", ["database", "legacy"])
def test_crash_during_save_keeps_the_previous_file(saved, tmp_path, monkeypatch, kind):
    mem, target, gone = _full_write_case(kind, saved, tmp_path)
    previous = target.read_bytes()
    calls = {"n": 0}
    real = atomic_module._write_chunk

    def failing(fh, chunk):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("simulated crash: disk full")
        real(fh, chunk)

    monkeypatch.setattr(atomic_module, "_write_chunk", failing)
    with pytest.raises(OSError, match="simulated crash"):
        mem.save(target)
    assert calls["n"] == 3
    assert target.read_bytes() == previous
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # temp removed
    assert gone in ForgettableMemory.load(target)


@pytest.mark.parametrize("kind", ["database", "legacy"])
def test_hard_kill_during_save_keeps_the_previous_file(saved, tmp_path, kind):
    mem, target, gone = _full_write_case(kind, saved, tmp_path)
    previous = target.read_bytes()
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory as m
        import svtoolkit.memory._atomic as atomic
        mem = m.ForgettableMemory.load({str(saved if kind == "database" else target)!r})
        mem.forget({gone!r})
        real, calls = atomic._write_chunk, [0]
        def dying(fh, chunk):
            calls[0] += 1
            if calls[0] == 3:
                fh.flush()
                os._exit(9)  # no cleanup, no exception handlers: a crash
            real(fh, chunk)
        atomic._write_chunk = dying
        mem.save({str(target)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    assert target.read_bytes() == previous
    assert gone in ForgettableMemory.load(target)


def test_crash_during_incremental_save_keeps_the_previous_state(saved, monkeypatch):
    """A save to the database the memory was loaded from writes one transaction: a failure in
    it rolls back, and the change stays pending for the next save."""
    mem = ForgettableMemory.load(saved)
    before = (mem.record_ids, mem.state_digest())
    mem.forget("k0")
    real = database_module._write_slots

    def failing(*args):
        real(*args)  # the records and tombstones are written already
        raise OSError("simulated crash: disk full")

    monkeypatch.setattr(database_module, "_write_slots", failing)
    with pytest.raises(OSError, match="simulated crash"):
        mem.save(saved)
    again = ForgettableMemory.load(saved)
    assert (again.record_ids, again.state_digest()) == before
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]  # no journal left
    monkeypatch.undo()
    mem.save(saved)
    again = ForgettableMemory.load(saved)
    assert "k0" not in again and again.state_digest() == mem.state_digest()


def _kill_during_incremental_save(path):
    """Load ``path``, forget k0 and save it back, dying (``os._exit``) in the transaction
    after its last write, before the commit. Returns (record ids, digest) before the forget."""
    before = ForgettableMemory.load(path)
    script = textwrap.dedent(f"""
        import os
        import svtoolkit.memory as m
        import svtoolkit.memory._database as database
        mem = m.ForgettableMemory.load({str(path)!r})
        mem.forget("k0")
        real = database._write_meta
        def dying(*args):
            real(*args)
            os._exit(9)  # no cleanup, no rollback: a crash before the commit
        database._write_meta = dying
        mem.save({str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == 9, proc.stderr.decode()
    return before.record_ids, before.state_digest()


def test_hard_kill_during_incremental_save_keeps_the_previous_state(saved):
    before = _kill_during_incremental_save(saved)
    again = ForgettableMemory.load(saved)
    assert (again.record_ids, again.state_digest()) == before
    again.forget("k0")
    again.save(saved)  # the store is writable again; its commit deletes the journal
    assert "k0" not in ForgettableMemory.load(saved)
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]


def test_hard_kill_during_incremental_save_leaves_no_journal_after_a_whole_write(saved,
                                                                             tmp_path):
    """A load leaves a killed writer's journal alone (a reader cannot tell it from a live
    writer's); the next write removes it, also a whole new database renamed over the store
    (the journal holds the replaced file's pages, the record being forgotten included)."""
    _kill_during_incremental_save(saved)
    mem = ForgettableMemory.load(saved)
    key = mem.key("k0").tobytes()
    assert any(key in p.read_bytes() for p in saved.parent.iterdir() if p.name != saved.name)
    mem.forget("k0")
    (tmp_path / "other").mkdir()
    mem.save(tmp_path / "other" / "m.svtk")  # now bound elsewhere: the next save is whole
    mem.save(saved)
    assert sorted(p.name for p in saved.parent.iterdir() if p.is_file()) == [saved.name]
    assert key not in saved.read_bytes() and "k0" not in ForgettableMemory.load(saved)


def test_save_replaces_atomically_and_cleans_up(saved):
    mem = ForgettableMemory.load(saved)
    mem.forget("k5")
    mem.save(saved)
    assert "k5" not in ForgettableMemory.load(saved)
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


# ------------------------------------------------------------------ threads
@pytest.mark.parametrize("write", ["new", "change"])
def test_concurrent_saves_never_resurrect_a_forgotten_record(tmp_path, monkeypatch, write):
    """An older save still writing must not land over a newer one (the lock is held): a save
    that writes a new database (slow in its file writes) or a change of the one the memory is
    bound to (slow in its transaction)."""
    mem = ForgettableMemory(sigma=1.0, C=0.5)
    mem.add([0.0, 0.0], "secret", record_id="a")
    mem.add([3.0, 0.0], "b", record_id="b")
    path = tmp_path / "m.svtk"
    if write == "change":
        mem.save(path)
        mem.edit("b", value="b2")  # what the older save writes
    started, release, errors = threading.Event(), threading.Event(), []
    module, seam = (atomic_module, "_write_chunk") if write == "new" else \
        (database_module, "_write_slots")
    real = getattr(module, seam)

    def slow(*args):
        if threading.current_thread().name == "old-save" and not started.is_set():
            started.set()
            release.wait(timeout=0.5)  # the older save is slow to reach the disk
        real(*args)

    def old_save():
        try:
            mem.save(path)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    monkeypatch.setattr(module, seam, slow)
    old = threading.Thread(target=old_save, name="old-save")
    old.start()
    assert started.wait(timeout=30)
    mem.forget("a")  # with the lock held through the write, this waits for the old save
    mem.save(path)
    release.set()
    old.join()
    assert not errors
    loaded = ForgettableMemory.load(path)
    assert loaded.record_ids == mem.record_ids == ["b"]
    assert loaded.state_digest() == mem.state_digest()


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
