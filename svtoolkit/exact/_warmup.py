"""Warm-ups of the exact walk's kernels: :func:`warm_walk`, for a long-running process, and
:func:`prepare_changes`, which compiles the kernels of a change in two processes at once when
Numba's cache does not hold them (:func:`start_change_compilation` starts the second process
and lets the caller go on meanwhile).

The full warm-up of every layer's kernels is :func:`svtoolkit.warmup` (:mod:`svtoolkit._warmup`,
on the top floor: it imports the exact path, the memory and the batched path, which this
package must not).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

__all__ = ["warm_walk", "CHANGE_PLAN", "DELETION_ONLY", "change_kernels", "compile_kernels",
           "prepare_changes", "start_change_compilation", "ChangeCompilation"]

#: The order in which :func:`prepare_changes` compiles the kernels a change calls: per step,
#: (compiled here, compiled at the same time in a child process). A kernel compiles the
#: kernels it calls unless Numba's cache holds them, so each step uses only what the steps
#: before it put in the cache: ``_leave`` (which most of the walk calls) first, beside the
#: kernel that inserts a key, the rest state's choice of violator and the moving key's own
#: events; then the walk's event steps beside the rest state's correction and the start of a
#: walk; then the roots (the walk, the rest state and a deletion's crossing), whose callees
#: are all cached by then, beside the evaluations from the keys that nothing of the walk
#: calls and the pass that reads a rest state's sign violation. Seconds of each kernel
#: compiled in one process in this order, each after the ones before it, on an empty cache
#: (2-core Intel Xeon): _leave 3.5 (Numba's start included), insert_slot 1.2, worst_violator
#: 0.7, _finish_own 1.1, _step 2.6, _rho_step 0.6, _start 0.5, correct 1.7,
#: snap_margin_bounds 0.8, walk 1.4, settle 3.6 (a root's compilation optimises the callees
#: linked into it again), decision 0.8, fresh_gradients 0.6, _kkt_terms 0.3;
#: remove_and_settle 1.7 after settle (another run). Three small kernels the Python layer calls
#: on its own are in the plan too, on a side with time to spare: the removal of a slot, which
#: drops the warm-up anchor when the keys first reach n C >= 1 (an admission; a deletion's root
#: calls it too, so it goes before that root), and rho's optimal interval with the rounding
#: bound of sum(a) it is given (the rest state's snap calls that bound too), which every check
#: of a state out of warm-up reads (without them, the second and third ``memory add`` of a new
#: store compiled 1-2 s each). A kernel loaded from the cache brings its callees with it, so a
#: kernel the Python layer also calls directly is named here even when a planned one calls it.
CHANGE_PLAN = (
    (("insert_slot", "kernel_column", "worst_violator", "_finish_own", "sum_rounding",
      "delete_slot"), ("_leave",)),
    (("_step", "_rho_step"), ("correct", "snap_margin_bounds", "_start")),
    (("walk", "settle", "remove_and_settle"),
     ("decision", "fresh_gradients", "_kkt_terms", "sign_violation", "_rho_interval")),
)

#: The kernels of :data:`CHANGE_PLAN` that only a deletion calls (``IncrementalSVDD.remove``'s
#: one crossing, a root that calls the walk and the rest state again: 1.7 s of the 21 s the
#: plan compiles in one process). A command that only admits leaves them to its first
#: deletion (:func:`prepare_changes` with ``deletions=False``).
DELETION_ONLY = ("remove_and_settle",)

#: Seconds :func:`prepare_changes` waits for each step of its child process (about ten times
#: the slowest first change measured, 27 s on an Intel Xeon) before it goes on without it.
PARALLEL_COMPILE_TIMEOUT = 300.0


def warm_walk():
    """Load the kernels of the exact walk's everyday operations (add, remove, KKT residual).

    About a second in a fresh process once Numba's cache holds them, most of it Numba's one-time
    initialisation; a long-running process (the memory server) calls it at start so that its
    first change does not pay it.

    Returns
    -------
    IncrementalSVDD
        The small solver it ran (12 keys of dimension 3, two removed), for a fuller warm-up to
        go on with.
    """
    from .solver import IncrementalSVDD

    prepare_changes()
    X = np.random.default_rng(0).standard_normal((12, 3))
    solver = IncrementalSVDD(C=0.25, sigma=1.0)
    ids = solver.extend(X)
    solver.decision_function(X[:3])
    solver.kkt_residual()
    solver.remove(ids[0])
    solver.remove(int(solver.margin_ids[0]) if len(solver.margin_ids) else int(solver.ids[0]))
    return solver


def change_kernels():
    """The kernels an exact change of a memory store calls (admission, deletion, the check at
    load), each with the argument types it is called with: the kernels the Python layer
    calls, and the callees that :data:`CHANGE_PLAN` compiles first.

    Types are written with one letter per argument: ``M`` a float64 matrix (the keys, the
    margin rows, the inverse), ``V`` a float64 vector, ``I`` an int64 vector, ``s`` the int8
    status vector, ``B`` a bool vector, ``i`` int64, ``f`` float64, ``b`` bool; all arrays
    C-contiguous and writable, as the solver allocates them. A test checks that a change
    after :func:`prepare_changes` compiles nothing more, and that no step compiles a kernel
    another step compiled.

    Returns
    -------
    dict of str to (Dispatcher, tuple of numba types)
    """
    from numba import typeof

    from . import _consistency as CS
    from . import _rest as RS
    from . import _walk as W

    letters = {"M": typeof(np.zeros((1, 1))), "V": typeof(np.zeros(1)),
               "I": typeof(np.zeros(1, np.int64)), "s": typeof(np.zeros(1, np.int8)),
               "B": typeof(np.zeros(1, bool)), "i": typeof(1), "f": typeof(1.0),
               "b": typeof(True)}
    state = "MIVVsIIMMVVVVVIVI"  # WalkDriver._arrays(): Xt, ids, alpha, ..., blocked, fs, ist
    kernels = {
        "insert_slot": (W.insert_slot, "Vi" "MIVVsIIMIVVI" "b"),
        "decision": (W.decision, "MMViiffV"),
        "fresh_gradients": (W.fresh_gradients, "MViiffV"),
        "kernel_column": (W.kernel_column, "MiiifV"),
        "_kkt_terms": (CS._kkt_terms, "VVsiiff"),
        "sign_violation": (CS.sign_violation, "Vsi"),
        "_rho_interval": (CS._rho_interval, "VVsifff"),
        "sum_rounding": (RS.sum_rounding, "Vi"),
        "delete_slot": (W.delete_slot, "iMIVVsIIMII"),
        "worst_violator": (RS.worst_violator, "VsIMMVIVVB"),
        "_leave": (W._leave, "iiVVsIIMMVI"),
        "_start": (W._start, "iiVVsIIMMVI"),
        "_finish_own": (W._finish_own, "iiVVsIIMMVVfMVI"),
        "_rho_step": (W._rho_step, "MIVVsIIMMVVVIiif"),
        "_step": (W._step, state + "iif"),
        "correct": (RS.correct, state + "ib"),
        "snap_margin_bounds": (RS.snap_margin_bounds, "VVsIIMMVI"),
        "walk": (W.walk, state + "iibi"),
        "settle": (RS.settle, state + "iib"),
        "remove_and_settle": (RS.remove_and_settle, state + "iii"),
    }
    return {name: (d, tuple(letters[c] for c in code)) for name, (d, code) in kernels.items()}


def compile_kernels(names):
    """Compile (or load from Numba's cache) the kernels ``names`` of :func:`change_kernels`,
    without running them."""
    kernels = change_kernels()
    for name in names:
        dispatcher, types = kernels[name]
        dispatcher.compile(types)


def prepare_changes(deletions=True):
    """Compile the kernels of a change ahead of it, in two processes at once, when Numba's
    cache does not hold them and the process may use two CPUs.

    :func:`start_change_compilation`, then its :meth:`ChangeCompilation.finish`. On an empty
    cache, a first ``svtoolkit memory add`` took 10.0-11.8 s idle on a 2-core Intel Xeon (about
    21 s of compilation in one process) and 13.0-16.6 s beside a busy process (the second core
    is taken; two runs each at two hours of one day). With a warm cache, or one CPU, it does
    nothing (the kernels load, or compile, as they are first called).

    Parameters
    ----------
    deletions : bool, default True
        Also the kernels only a deletion calls (:data:`DELETION_ONLY`); False for a change
        that only admits (``svtoolkit memory add``).

    Returns
    -------
    bool
        Whether a child process compiled.
    """
    with start_change_compilation(deletions) as compiling:
        compiling.finish()
    return compiling.started


def start_change_compilation(deletions=True):
    """Start compiling the kernels of a change in a child process, when Numba's cache does not
    hold them and the process may use two CPUs; this process goes on meanwhile (the command
    line loads the store and checks the command's input) and compiles its share at
    :meth:`ChangeCompilation.finish`.

    Parameters
    ----------
    deletions : bool, default True
        As in :func:`prepare_changes`.

    Returns
    -------
    ChangeCompilation
        A context manager: leaving it stops a child that is still compiling (a command refused
        before its change compiles nothing more).
    """
    kernels = change_kernels()
    skip = () if deletions else DELETION_ONLY
    plan = [tuple(tuple(name for name in side if name not in skip) for side in step)
            for step in CHANGE_PLAN]
    needed = [kernels[name][0] for step in plan for side in step for name in side]
    if _usable_cpus() < 2 or all(_cached(d) for d in needed):
        return ChangeCompilation.nothing()
    return ChangeCompilation(plan, _start_compiling([there for _, there in plan]))


class ChangeCompilation:
    """The kernels of a change (:data:`CHANGE_PLAN`), compiling in a child process from
    :func:`start_change_compilation` on; :meth:`finish` compiles this process's share.

    In each step one side compiles here while the other compiles in the child (a fresh
    interpreter that imports this same package and writes the same Numba cache), and the next
    step waits for both. The child does not wait for this process: whatever of a step's
    callees this process has not compiled yet, it compiles itself. A child that fails or stops
    answering costs only time: what it did not compile compiles here.

    Attributes
    ----------
    started : bool
        Whether a child process was started (False: the cache held every kernel, or one CPU).
    """

    def __init__(self, plan, child):
        self._plan = plan
        self._child = child
        self.started = child is not None
        self._watchdog = None
        if child is not None:
            self._watchdog = threading.Timer(PARALLEL_COMPILE_TIMEOUT, child.kill)
            self._watchdog.daemon = True  # never keeps the interpreter alive
            self._watchdog.start()

    @classmethod
    def nothing(cls):
        """A compilation with nothing to do (``finish`` returns at once)."""
        return cls((), None)

    def finish(self):
        """Compile this process's share, step by step beside the child, then load the child's
        (compiled by then); nothing when no child was started. Called once."""
        if self._child is None:
            return
        for here, there in self._plan:
            compile_kernels(here)
            if there:
                self._child.stdout.readline()  # the child's step is done (or it died: b"")
        self._child.wait()
        self.close()
        compile_kernels(name for _, there in self._plan for name in there)  # loaded

    def close(self):
        """Stop the child if it is still compiling (an interrupted or refused command)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        child, self._child = self._child, None
        if child is not None:
            if child.poll() is None:
                child.kill()
            child.wait()
            child.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _usable_cpus():
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere, every CPU
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def _cached(dispatcher):
    """Whether Numba's cache index holds any compilation of ``dispatcher`` for this source
    (an index written for older source reads as empty). Numba has no public way to ask; if
    its private cache object changes, the answer is "cached" and the kernels compile as they
    are first called, as without :func:`prepare_changes`."""
    try:
        return bool(dispatcher._cache._cache_file._load_index())
    except Exception:  # noqa: BLE001 - any change inside Numba: take the serial path
        return True


def _start_compiling(steps):
    """A child interpreter that compiles each list of kernels in ``steps`` on this process's
    copy of the package and Numba cache, printing an empty line after each."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if env.get("NUMBA_CACHE_DIR"):  # read by the child from its own working directory
        env["NUMBA_CACHE_DIR"] = os.path.abspath(env["NUMBA_CACHE_DIR"])
    code = ("from svtoolkit.exact._warmup import compile_kernels\n"
            f"for step in {[list(step) for step in steps]!r}:\n"
            "    compile_kernels(step)\n"
            "    print(flush=True)\n")
    # run from the package's parent: "-c" puts the working directory first on sys.path, and
    # the caller's may hold another svtoolkit
    return subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
