"""A restored solver is the same solver: ``copy()``, ``from_state_dict`` and estimator pickles
carry every setting that steers later operations, so the same operations give the same bits.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from svtoolkit import IncrementalSVDD

pytest.importorskip("sklearn")

from svtoolkit.sklearn import IncrementalOneClassSVM  # noqa: E402


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if isinstance(sa[key], np.ndarray):
            assert np.array_equal(sa[key], sb[key]), key
        else:
            assert sa[key] == sb[key], key


def test_restored_solvers_take_the_same_steps_on_a_large_margin_set():
    """2,048 keys in d = 384, every one on the margin: a fresh factorisation of this inverse
    probes above PROBE_TOL, so the solver calibrated its probe tolerance upwards. A restored
    solver that fell back to PROBE_TOL polished after these removals where the original did
    not, and ended on other bits."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((2048, 384))
    est = IncrementalOneClassSVM(nu=0.05, gamma=1 / 64).fit(X)
    original = est.solver_
    assert len(original.margin_ids) == 2048
    twins = {
        "copy": original.copy(),
        "state_dict": IncrementalSVDD.from_state_dict(original.state_dict()),
        "pickle": pickle.loads(pickle.dumps(est)).solver_,
    }
    victims = original.margin_ids[:6]
    solvers = {"original": original, **twins}
    polishes = {}
    for name, solver in solvers.items():
        before = solver.n_polishes
        for victim in victims:
            solver.remove(victim)
        polishes[name] = solver.n_polishes - before
    for name, twin in twins.items():
        assert polishes[name] == polishes["original"], name
        assert_same_state(twin, original)


def test_restored_solvers_keep_the_audit_schedule_and_the_event_limit(monkeypatch):
    rng = np.random.default_rng(1)
    s = IncrementalSVDD(0.1, 1.5, audit_every=4)
    s.extend(rng.standard_normal((30, 3)))  # 30 operations: the next audit is 2 away
    s.max_events = 10_000
    new_keys = rng.standard_normal((3, 3))
    twins = [s.copy(), IncrementalSVDD.from_state_dict(s.state_dict()),
             IncrementalSVDD.from_state_dict(pickle.loads(pickle.dumps(s.state_dict())))]
    audits = []
    for solver in [s, *twins]:
        log = []
        real_audit = solver.audit
        monkeypatch.setattr(solver, "audit",
                            lambda real=real_audit, log=log, sv=solver: (log.append(len(sv)),
                                                                         real())[1])
        assert solver.max_events == 10_000
        for x in new_keys:
            solver.add(x)
        for _ in range(3):
            solver.remove(solver.ids[0])
        audits.append(log)
    assert audits[0] == [32, 30]  # after operations 32 (an add) and 36 (a removal)
    assert audits[1:] == [audits[0]] * 3


def test_a_format_3_state_loads_with_its_probe_threshold_and_takes_the_same_steps():
    """Format 3 kept the rest state's probe threshold in a field of its own and ``fs`` as four
    floats; format 4 keeps both probe thresholds in ``fs``. A format-3 state of a solver whose
    in-walk refresh threshold is at its default loads into the same solver."""
    import svtoolkit.exact._walk as W

    rng = np.random.default_rng(2)
    s = IncrementalSVDD(0.05, 1.2)
    s.extend(rng.standard_normal((60, 4)))
    s._fs[W._PROBE_LIMIT] = 3e-11  # as a calibration after a fresh factorisation would set it
    state = s.state_dict()
    assert state["format"] == 4 and state["fs"][W._REFRESH_LIMIT] == W.REFRESH_PROBE_TOL
    old = dict(state, format=3, fs=state["fs"][:4].copy(), probe_tol=3e-11)
    restored = IncrementalSVDD.from_state_dict(old)
    assert_same_state(restored, s)
    x = rng.standard_normal(4)
    for solver in (s, restored):
        solver.remove(solver.margin_ids[0])
        solver.add(x)
    assert_same_state(restored, s)


def test_a_probe_threshold_above_the_old_ceiling_is_restored():
    """A well-conditioned margin set whose fresh inverse probes above PROBE_TOL_MAX / 4 keeps
    4x that probe as its threshold; ``copy()`` and ``from_state_dict`` carry it (the loader
    used to refuse thresholds above PROBE_TOL_MAX). The threshold is set here as such a
    calibration would set it."""
    import svtoolkit.exact._walk as W

    s = IncrementalSVDD(1.0 / 30.0, 1.0)
    s.extend(np.random.default_rng(47).standard_normal((60, 64)))
    s._fs[W._PROBE_LIMIT] = 2.5e-8
    for restored in (s.copy(), IncrementalSVDD.from_state_dict(s.state_dict())):
        assert_same_state(restored, s)
        assert restored._fs[W._PROBE_LIMIT] == 2.5e-8
