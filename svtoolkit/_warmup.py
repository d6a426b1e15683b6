"""Ahead-of-time compilation of every Numba kernel of svtoolkit (:func:`warmup`).

The first call of a ``@njit`` function in a fresh process pays its compilation, or the load of
its cached machine code. Benchmarks and the verification suite call :func:`warmup` before
timing anything, so that no measurement includes it; ``svtoolkit warmup`` runs it from the
command line. It lives on the top floor because it reaches every layer that defines kernels
(the RBF kernels, the exact walk, the memory, the batched path); the exact walk's own warm-up,
which a long-running memory server calls, is :func:`svtoolkit.exact._warmup.warm_walk`.

:func:`announce_compilation` prints one line when a kernel starts compiling because Numba's
cache does not hold it, so that a first command does not sit silent for a minute.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["warmup", "kernel_modules", "announce_compilation", "COMPILE_NOTICE"]

#: The line :func:`announce_compilation` prints. The figure: the first change of a memory store
#: on an empty cache (walk and settle kernels, :func:`svtoolkit.exact._warmup.prepare_changes`),
#: wall time on the 2-core machines measured: 10-15 s idle and 13-19 s beside a busy process
#: on an Intel Xeon (a first `memory add` 10.0-11.8 s idle and 13.0-16.6 s busy, a first
#: `forget` 11.7-14.1 s and 15.0-18.6 s, the spread between hours of one day; 27 s there before
#: the two-process compilation), 13-35 s on an AMD EPYC (25-33 s idle on its slow day, when
#: one process compiled every kernel in 42 s against the Intel Xeon's 17-21 s).
COMPILE_NOTICE = ("svtoolkit: compiling the solver's kernels, once (10-35 s; later runs "
                  "load them from Numba's cache; `svtoolkit warmup` compiles all of them "
                  "ahead of time)...")


def kernel_modules():
    """The modules that define ``@njit`` kernels, imported (each kernel is a module global)."""
    from . import _fista, kernels
    from .exact import _bulk, _consistency, _factor, _rest, _walk
    from .memory import _search

    return (kernels, _walk, _rest, _bulk, _consistency, _factor, _fista, _search)


def announce_compilation():
    """From now on, print :data:`COMPILE_NOTICE` to stderr when a kernel of svtoolkit starts
    compiling, once per process.

    Numba signals a compilation (its ``numba:compile`` event) only when a kernel is compiled
    for a signature that its cache does not hold: a load from the cache is no compilation and
    prints nothing. Calling this again adds no second line. The line goes to ``sys.stderr`` as
    it is when the compilation starts, and a stream that cannot take it is skipped: the notice
    never stops a compilation.
    """
    from numba.core import event

    class CompileNotice(event.Listener):
        def on_start(self, ev):
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            if _announced or not getattr(func, "__module__", "").startswith("svtoolkit."):
                return
            _announced.append(True)
            try:
                print(COMPILE_NOTICE, file=sys.stderr, flush=True)
            except (OSError, ValueError):  # stderr closed or gone: compile all the same
                pass

        def on_end(self, ev):
            pass

    if not _listening:
        _listening.append(True)
        event.register("numba:compile", CompileNotice())


# once per process: whether a listener is registered, and whether it has printed
_listening, _announced = [], []


def warmup() -> None:
    """Compile every Numba kernel of svtoolkit on tiny inputs.

    Covers the RBF kernels (:func:`svtoolkit.rbf_kernel`, Gram and cross), every kernel of the
    exact walk (one solver run: extend, decision, KKT residual, removals of a margin and of an
    error key, certified eviction, audit; the kernels of rarer paths are called directly with
    the solver's argument types), the search kernel of :class:`svtoolkit.ForgettableMemory`'s
    query, and the fused FISTA kernels of the batched path in float32 and float64. The test
    suite checks that no kernel is left uncompiled.
    """
    _warm_solver()
    _warm_memory()
    _warm_fista()


def _warm_solver():
    from .exact import IncrementalSVDD
    from .exact._warmup import warm_walk
    from .kernels import rbf_kernel

    rng = np.random.default_rng(0)
    X = rng.standard_normal((12, 3))
    rbf_kernel(X, sigma=1.0)
    rbf_kernel(X, X[:2], sigma=1.0)
    solver = warm_walk()
    solver.evict_reserve()
    solver.audit()
    # the bulk build (SMO + exact landing) of an extend into an empty solver
    IncrementalSVDD(C=0.05, sigma=1.0).extend(rng.standard_normal((64, 3)))
    _warm_gram_free_bulk(rng)
    _warm_solver_rare_paths(solver)


def _warm_gram_free_bulk(rng):
    # the Gram-free bulk build's kernels (taken above BULK_MAX_KEYS keys), with its types
    from .exact import _bulk as B

    n, C = 40, 0.05
    Xt = np.ascontiguousarray(rng.standard_normal((3, n + 1)))
    alpha = B.guess_start(Xt, n, 1.0, C, 16)
    grad = 2.0 * B.kernel_sums(Xt, n, 1.0, np.flatnonzero(alpha), alpha[alpha != 0.0])
    B.smo_cached(Xt, n, 1.0, C, B.SMO_TOL, 100, alpha, grad, *B.column_cache(n, 2))


def _warm_solver_rare_paths(solver):
    # kernels the solver calls only on paths tiny inputs do not take (the matrix-product
    # gradients of large wide problems, the audit of the margin rows), with the same types
    from .exact import _bulk as B
    from .exact import _consistency as CS
    from .exact import _walk as W
    from .exact._factor import bordered_inverse

    n = len(solver)
    Xt = np.ascontiguousarray(np.zeros((3, n)))
    W.kernel_column(Xt, n, 0, -1, 1.0, np.empty(n))
    W.anchor_terms(np.zeros(n), n, -1, np.zeros(n))
    # the in-walk refactorisation after a shrink on a small pivot (probe forced to fail)
    S = np.arange(2, dtype=np.int64)
    KSt = np.array([[0.0, -0.5], [-0.5, 0.0]])
    fs = np.zeros(W.FS_SIZE)
    fs[W._REFRESH_LIMIT] = W.REFRESH_PROBE_TOL
    status = np.full(2, W.MARGIN, dtype=np.int8)
    W.refresh_inverse_if_drifted(np.zeros((3, 3)), 2, S, KSt, status, 2, fs)
    # the bulk landing's key-by-key growth of the margin set (near duplicates in its margin)
    R, bk, vbuf = np.zeros((3, 3)), np.zeros(3), np.zeros(3)
    W._grow(R, 0, bk, 0.0)
    W._grow(R, 1, bk, W._schur(1, S, KSt, R, 1, bk, vbuf))
    # a fresh inverse by its Cholesky route (distant keys: K_SS = I, well conditioned)
    bordered_inverse(CS.bordered_matrix(S, np.full((2, 2), -1.0) + np.eye(2), 2), R)
    # a landing's bordered matrix, which it gathers only where the Cholesky route is refused
    B.bordered_margin_matrix(KSt, S)


def _warm_memory():
    # the search kernel behind ForgettableMemory.query, through the public API
    from .memory import ForgettableMemory

    memory = ForgettableMemory(sigma=1.0, C=0.5)
    for i in range(3):
        memory.add(np.full(2, float(i)), i)
    memory.query(np.zeros(2))


def _warm_fista():
    # the batched path's fused kernels, for both dtypes the torch layers train in
    from ._fista import fista_batch, fista_prefix_batch
    from ._rules import POWER_ITERS

    for dtype in (np.float32, np.float64):
        K = np.repeat(np.eye(4, dtype=dtype)[None], 2, axis=0)
        mask = np.ones((2, 4), dtype=bool)
        fista_batch(K, mask, 0.5, 2, POWER_ITERS, False, np.empty((2, 4), dtype=dtype))
        ends = np.array([2, 4], dtype=np.int64)
        fista_prefix_batch(K, mask, ends, 0.5, 2, POWER_ITERS, False,
                           np.empty((2, 2, 4), dtype=dtype))
