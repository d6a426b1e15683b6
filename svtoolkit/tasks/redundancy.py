"""The skewed-redundancy context of the matched-budget selection experiment.

Forgetful Attention (arXiv:2607.12204), §5, Table 4: rare groups of one key each and dense
groups of near-duplicate keys, probed by queries at the group centres. The selection policies
that read it live in :mod:`svtoolkit.selection`, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validation import check_int

__all__ = ["SkewedContext", "skewed_redundancy_context"]


def _check_sizes(**sizes):
    """Each ``name=(value, minimum)``: value must be an int (not a bool) >= minimum."""
    for name, (value, minimum) in sizes.items():
        check_int(value, name, min=minimum)


@dataclass(frozen=True)
class SkewedContext:
    """A skewed-redundancy context; see :func:`skewed_redundancy_context`.

    Attributes
    ----------
    keys : ndarray of shape (n, d)
    group : ndarray of int of shape (n,)
        Group of each key; the rare groups come first.
    values : ndarray of shape (n, groups)
        One-hot group of each key.
    warm_queries : ndarray of shape (groups * ceil(q / 2), d)
        Queries seen before eviction (the warm heavy-hitter scores use them).
    warm_group : ndarray of int
    test_queries : ndarray of shape (groups * floor(q / 2), d)
        Held-out queries (evaluated).
    test_group : ndarray of int
    rare_groups : ndarray of int of shape (rare,)
    """

    keys: np.ndarray
    group: np.ndarray
    values: np.ndarray
    warm_queries: np.ndarray
    warm_group: np.ndarray
    test_queries: np.ndarray
    test_group: np.ndarray
    rare_groups: np.ndarray


def skewed_redundancy_context(rng, *, d=4, rare=6, dense=6, copies=10, spread=1.5,
                              jitter=0.15, query_jitter=0.05, queries_per_group=2):
    """The skewed-redundancy context of Forgetful Attention (arXiv:2607.12204), §5.

    ``rare + dense`` group centres from ``spread * N(0, I_d)``; the rare groups hold one key
    each and come first, the dense groups ``copies`` keys each; every key is its centre plus
    ``jitter * N(0, I_d)``. Each group gets ``queries_per_group`` queries at its centre plus
    ``query_jitter * N(0, I_d)``; alternate ones are *warm* (seen before eviction) and
    *held out* (evaluated). The defaults give the paper's 6 rare and 6 dense groups of 10
    (``n = 66`` keys, 12 effective items, two queries per group); ``d``, ``spread`` and the
    jitters are those of the paper's public reference code.

    Parameters
    ----------
    rng : numpy.random.Generator or int or None
        Source of randomness (passed to ``numpy.random.default_rng``).
    d, rare, dense, copies, queries_per_group : int
    spread, jitter, query_jitter : float

    Returns
    -------
    SkewedContext
        ``keys`` (n, d), ``group`` (n,), ``values`` (n, groups) one-hot, ``warm_queries``,
        ``warm_group``, ``test_queries``, ``test_group``, ``rare_groups`` (the first ``rare``).

    Raises
    ------
    ValueError
        A size that is not an integer in range: ``d, copies >= 1``, ``rare, dense >= 0`` with
        at least one group, ``queries_per_group >= 2`` (every group needs a warm and a
        held-out query).
    """
    _check_sizes(d=(d, 1), rare=(rare, 0), dense=(dense, 0), copies=(copies, 1),
                 queries_per_group=(queries_per_group, 2))
    if rare + dense < 1:
        raise ValueError("rare + dense must be >= 1 (at least one group)")
    rng = np.random.default_rng(rng)
    groups = rare + dense
    centres = spread * rng.standard_normal((groups, d))
    group = np.concatenate([np.arange(rare), np.repeat(np.arange(rare, groups), copies)])
    keys = centres[group] + jitter * rng.standard_normal((len(group), d))
    qgroup = np.repeat(np.arange(groups), queries_per_group)
    queries = centres[qgroup] + query_jitter * rng.standard_normal((len(qgroup), d))
    warm = np.tile(np.arange(queries_per_group), groups) % 2 == 0  # alternate within a group
    return SkewedContext(
        keys=keys, group=group, values=np.eye(groups)[group],
        warm_queries=queries[warm], warm_group=qgroup[warm],
        test_queries=queries[~warm], test_group=qgroup[~warm],
        rare_groups=np.arange(rare),
    )
