"""Eviction and selection policies at a matched token budget (Forgetful Attention §5-6).

Every policy returns the indices of the keys it keeps; :func:`uniform_rbf_readout` then reads
the kept keys with the *same* uniform RBF readout, so that only the selection differs:

* :func:`certified_selection` - the support set (margin and error sets, coefficient > 0) of the
  exact fp64 solver; query-independent. Its size is the budget the other policies get.
* :func:`h2o_selection` - heavy hitters (Zhang et al. 2023): the top-``budget`` keys by
  accumulated attention from a set of queries. Passing the evaluation queries gives the
  *oracle* form; passing an earlier, disjoint set gives the *warm* form.
* :func:`h2o_streaming` - the streaming heavy-hitter cache: keys arrive one at a time, each
  attends over the cache and adds its attention to the scores, and the lowest-scoring key is
  evicted whenever the cache exceeds the budget (optionally protecting a recent window).
* :func:`certified_streaming` - the causal counterpart: keys are admitted one at a time into a
  :class:`~svtoolkit.ForgettableMemory` with a budget, which evicts reserve keys (coefficient
  exactly 0) by exact decrement. Eviction is decided before any future query is known.
* :func:`recency_selection`, :func:`random_selection`.

Attention in the H2O policies uses the same RBF kernel as the readout:
``p(q, i) = k(q, x_i) / sum_j k(q, x_j)`` (``normalize=True``, the attention probability H2O
accumulates) or the raw kernel mass ``k(q, x_i)`` (``normalize=False``, what the public
reference code of the paper accumulates).

:func:`skewed_redundancy_context` builds the paper's skewed-redundancy task (§5); it lives in
:mod:`svtoolkit.tasks.redundancy` and is re-exported here under the same name.
"""

from __future__ import annotations

import warnings

import numpy as np

from ._validation import as_keys, check_int
from .exact import IncrementalSVDD
from .kernels import rbf_kernel
from .tasks.redundancy import SkewedContext, skewed_redundancy_context

__all__ = [
    "certified_selection",
    "h2o_scores",
    "h2o_selection",
    "h2o_streaming",
    "certified_streaming",
    "recency_selection",
    "random_selection",
    "uniform_rbf_readout",
    "skewed_redundancy_context",
    "SkewedContext",
]


def _check_keep(keep, n):
    """Row indices from ``keep``: a boolean mask of length ``n`` or distinct integer indices.

    Parameters
    ----------
    keep : array_like of bool or int
    n : int
        Number of rows.

    Returns
    -------
    ndarray of int64

    Raises
    ------
    TypeError
        Neither booleans nor integers (e.g. floats, which would be truncated silently).
    ValueError
        Empty, not 1-D, a mask of another length, or an index negative, ``>= n`` or repeated.
    """
    keep = np.asarray(keep)
    if keep.ndim != 1:
        raise ValueError(f"keep must be 1-D (indices or a boolean mask); got shape {keep.shape}")
    if keep.size == 0:
        raise ValueError("keep is empty: a readout needs at least one kept key")
    if keep.dtype == bool:
        if keep.size != n:
            raise ValueError(f"keep as a boolean mask must have length {n}; got {keep.size}")
        keep = np.flatnonzero(keep)
        if keep.size == 0:
            raise ValueError("keep is empty: the boolean mask selects no key")
        return keep.astype(np.int64)
    if not np.issubdtype(keep.dtype, np.integer):
        raise TypeError(f"keep must hold integer row indices or be a boolean mask; got dtype "
                        f"{keep.dtype}")
    if keep.min() < 0 or keep.max() >= n:
        raise ValueError(f"keep indices must be in [0, {n}); got {keep.min()} .. {keep.max()}")
    if np.unique(keep).size != keep.size:
        raise ValueError("keep has repeated indices (a key would be counted more than once)")
    return keep.astype(np.int64)


def certified_selection(keys, *, sigma, C):
    """Indices of the support set (coefficient > 0) of the exact solver over ``keys``.

    Parameters
    ----------
    keys : array_like of shape (n, d)
        Admitted in row order.
    sigma, C : float
        Kernel width and box constraint (``n * C >= 1`` for a certified answer).

    Returns
    -------
    ndarray of int64
        Sorted row indices of the margin and error sets. The complement (reserve set) has
        coefficient exactly 0.

    Raises
    ------
    ValueError
        ``n * C < 1``: the keys cannot hold the optimum and nothing is certified.
    """
    keys = as_keys(keys, "keys")
    solver = IncrementalSVDD(C, sigma)
    ids = solver.extend(keys)
    if not solver.certified:
        raise ValueError(f"n * C = {len(keys) * solver.C:.4g} < 1: the solver is in warm-up "
                         "and certifies nothing")
    support = np.concatenate([solver.margin_ids, solver.error_ids])
    return np.flatnonzero(np.isin(ids, support)).astype(np.int64)


def h2o_scores(keys, queries, *, sigma, normalize=True):
    """Accumulated attention each key receives from ``queries``.

    Returns
    -------
    ndarray of shape (n,)
        ``sum_q p(q, i)`` with ``p`` the RBF attention probability (``normalize=True``) or the
        raw kernel value (``normalize=False``).
    """
    keys = as_keys(keys, "keys")
    queries = as_keys(queries, "queries", d=keys.shape[1])
    K = rbf_kernel(queries, keys, sigma=sigma)
    if normalize:
        K = K / np.maximum(K.sum(axis=1, keepdims=True), np.finfo(float).tiny)
    return K.sum(axis=0)


def _top(scores, budget):
    """Indices of the ``budget`` largest scores (ties: earlier index first), sorted."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return np.sort(order[:budget]).astype(np.int64)


def h2o_selection(keys, queries, budget, *, sigma, normalize=True):
    """Heavy hitters: the ``budget`` keys with the most accumulated attention from ``queries``.

    Oracle form: pass the evaluation queries. Warm form: pass queries seen earlier.

    Returns
    -------
    ndarray of int64, sorted
    """
    keys = as_keys(keys, "keys")
    budget = check_int(budget, "budget", min=1, max=len(keys))
    return _top(h2o_scores(keys, queries, sigma=sigma, normalize=normalize), budget)


def h2o_streaming(keys, budget, *, sigma, normalize=True, recent=0):
    """Streaming heavy-hitter cache over keys arriving in row order.

    Each arriving key joins the cache, attends over the cache (itself included) and adds its
    attention to every cached key's score; while the cache exceeds ``budget`` the key with the
    lowest score outside the ``recent`` most recent ones is evicted (ties: oldest first).

    Returns
    -------
    ndarray of int64, sorted
        Row indices in the cache at the end of the stream.
    """
    keys = as_keys(keys, "keys")
    n = len(keys)
    budget = check_int(budget, "budget", min=1, max=n)
    recent = check_int(recent, "recent", min=0, max=budget - 1)  # recent < budget
    K = rbf_kernel(keys, sigma=sigma)
    cache = []
    score = np.zeros(n)
    for t in range(n):
        cache.append(t)
        idx = np.asarray(cache)
        att = K[t, idx]
        if normalize:
            att = att / att.sum()
        score[idx] += att
        if len(cache) > budget:
            candidates = idx[: len(idx) - recent] if recent else idx
            victim = candidates[np.lexsort((candidates, score[candidates]))[0]]
            cache.remove(int(victim))
    return np.sort(np.asarray(cache, dtype=np.int64))


def certified_streaming(keys, budget, *, sigma, C):
    """Online certified eviction: admit keys in row order into a budgeted memory.

    Uses :class:`~svtoolkit.ForgettableMemory` (``budget`` given): after each admission that
    exceeds the budget, reserve keys are evicted by exact decrement, oldest first. When the
    support set alone exceeds the budget the memory holds more (no certified eviction is
    possible); ``peak`` reports the largest size after an admission's evictions.

    The certificate covers each eviction at the time it is made. The final set need not be
    the support set of the whole stream: a key evicted as reserve could have become support
    after later admissions (the scope of the certificate, Forgetful Attention §5).

    Returns
    -------
    kept : ndarray of int64, sorted
    peak : int
        Largest number of keys held once each admission's evictions are done. It does not
        count the transient state inside an admission, which holds one key more (the new key
        before any eviction): ``peak == budget`` means the budget held after every admission.
    """
    from .memory import BudgetExceededWarning, ForgettableMemory

    keys = as_keys(keys, "keys")
    budget = check_int(budget, "budget", min=1, max=len(keys))
    mem = ForgettableMemory(sigma=sigma, C=C, budget=budget)
    peak = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BudgetExceededWarning)
        for t, key in enumerate(keys):
            mem.add(key, t, record_id=str(t))
            peak = max(peak, len(mem))
    kept = np.sort(np.array([int(r) for r in mem.record_ids], dtype=np.int64))
    return kept, peak


def recency_selection(n, budget):
    """The last ``budget`` of ``n`` keys (a sliding window)."""
    n = check_int(n, "n", min=1)
    budget = check_int(budget, "budget", min=1, max=n)
    return np.arange(n - budget, n, dtype=np.int64)


def random_selection(n, budget, rng):
    """``budget`` of ``n`` keys uniformly at random (``rng``: a numpy Generator or a seed)."""
    n = check_int(n, "n", min=1)
    budget = check_int(budget, "budget", min=1, max=n)
    rng = np.random.default_rng(rng)
    return np.sort(rng.choice(n, size=budget, replace=False)).astype(np.int64)


def uniform_rbf_readout(keys, values, queries, *, sigma, keep=None):
    """Uniform RBF readout ``o(q) = sum_i k(q, x_i) v_i / sum_i k(q, x_i)`` over kept keys.

    Parameters
    ----------
    keys : array_like of shape (n, d)
    values : array_like of shape (n, dv)
    queries : array_like of shape (m, d)
    sigma : float
    keep : array_like of int or bool, optional
        Distinct row indices of the kept keys, or a boolean mask of length n (all keys by
        default). Must select at least one key.

    Returns
    -------
    ndarray of shape (m, dv)
        Rows where every kernel value underflows to 0 are 0.

    Raises
    ------
    TypeError
        ``keep`` holds neither integers nor booleans.
    ValueError
        Mismatched shapes, or ``keep`` empty, out of range, repeated, or a mask of the wrong
        length.
    """
    keys = as_keys(keys, "keys")
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape[0] != keys.shape[0]:
        raise ValueError(f"values must have shape ({keys.shape[0]}, dv); got {values.shape}")
    if keep is not None:
        keep = _check_keep(keep, keys.shape[0])
        keys, values = keys[keep], values[keep]
    W = rbf_kernel(as_keys(queries, "queries", d=keys.shape[1]), keys, sigma=sigma)
    total = W.sum(axis=1, keepdims=True)
    return np.divide(W @ values, total, out=np.zeros((W.shape[0], values.shape[1])),
                     where=total > 0)
