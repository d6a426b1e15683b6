"""Near-orthogonal capacity: distinct items on near-orthogonal keys, then a filler block.

The fair capacity comparison of Forgetful Attention (arXiv:2607.12204), §5, Table 5.
"""

from __future__ import annotations

import numpy as np

from .._validation import check_int, check_real
from ._base import VectorTask, distinct_integers, rng_for

__all__ = ["near_orthogonal_capacity", "CAPACITY_ITEMS_SWEEP", "max_abs_cosine_bound"]

#: Numbers of distinct items for the sweep of Forgetful Attention (arXiv:2607.12204), §5,
#: Table 5. The paper names 8, 24 and 40; the steps between are a choice.
CAPACITY_ITEMS_SWEEP = (8, 16, 24, 32, 40)


def max_abs_cosine_bound(key_jitter):
    """Largest ``|cos|`` between two item keys of :func:`near_orthogonal_capacity`.

    Item keys are ``u_i + eps * w_i`` with ``u`` orthonormal and ``|w_i| = 1``, renormalised,
    so ``|<x_i, x_k>| <= 2 eps + eps**2`` before and ``|x_i| >= 1 - eps`` before
    renormalising: ``|cos| <= (2 eps + eps**2) / (1 - eps)**2``.

    Parameters
    ----------
    key_jitter : float
        ``eps`` in ``[0, 1)``.

    Returns
    -------
    float
    """
    eps = check_real(key_jitter, "key_jitter", min=0.0, max=1.0, include_max=False)
    return (2.0 * eps + eps**2) / (1.0 - eps) ** 2


def _near_orthogonal_keys(rng, n_rows, n_items, d_key, key_jitter):
    """(n_rows, n_items, d_key) unit keys: a random orthonormal frame plus a jitter of norm
    ``key_jitter`` in a random direction, renormalised."""
    frame, _ = np.linalg.qr(rng.standard_normal((n_rows, d_key, n_items)))
    keys = np.swapaxes(frame, 1, 2)
    direction = rng.standard_normal(keys.shape)
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    keys = keys + key_jitter * direction
    return keys / np.linalg.norm(keys, axis=-1, keepdims=True)


def near_orthogonal_capacity(n_examples, *, n_items=8, n_filler=20, n_queries=8, d_key=64,
                             d_value=8, key_jitter=0.05, filler_jitter=0.05,
                             query_noise=0.02, seed):
    """Distinct items on near-orthogonal unit keys, a fixed filler block, then queries.

    Sequence format (length ``n + F + m``, each token a vector of length
    ``d_key + d_value``)::

        [x_1; v_1] ... [x_n; v_n] | [f + e_1; 0] ... [f + e_F; 0] | [x_{a_1} + e'_1; 0] ...

    ``n = n_items`` item keys ``x_i`` are unit vectors, a random orthonormal frame each
    perturbed by a jitter of norm ``key_jitter`` and renormalised, so that ``|cos(x_i, x_k)|
    <= max_abs_cosine_bound(key_jitter)`` (0.114 at the default 0.05); values
    ``v_i ~ N(0, I_{d_value})``. A contiguous block of ``F = n_filler`` filler tokens follows:
    near-duplicates of one random unit centre ``f`` per sequence, ``e_t ~ filler_jitter *
    N(0, I) / sqrt(d_key)``, value exactly 0. Then ``m = n_queries`` queries ask distinct
    items ``a_j`` (uniform), ``e'_j ~ query_noise * N(0, I) / sqrt(d_key)``. Worked example,
    ``n = 2``, ``F = 2``, ``m = 2``::

        position  0         1         2         3         4              5
        token     [x1; v1]  [x2; v2]  [f+e1; 0] [f+e2; 0] [x2 + e'1; 0]  [x1 + e'2; 0]
        answers                                           1              0

    Vocabulary: continuous; keys in the first ``d_key`` coordinates, values in the last
    ``d_value``.

    Scored: each query position; the output is decoded to the nearest of the ``n`` item values
    and must be ``v_{a_j}`` (recall@1, nearest value).

    Chance: ``1 / n_items``.

    Parameters
    ----------
    n_examples : int
    n_items : int, default 8
        Distinct items; Table 5 grows them from 8 to 40 (:data:`CAPACITY_ITEMS_SWEEP`).
    n_filler : int, default 20
        The fixed filler block (``>= 0``).
    n_queries : int, default 8
        ``1 <= n_queries <= n_items``.
    d_key : int, default 64
        ``>= n_items`` (an orthonormal frame of ``n_items`` vectors must fit).
    d_value : int, default 8
    key_jitter : float, default 0.05
        Norm of the perturbation of each orthonormal key, in ``[0, 1)``; 0 gives exactly
        orthogonal keys.
    filler_jitter, query_noise : float, default 0.05, 0.02
        Expected norm (to first order) of the filler and query perturbations.
    seed : int

    Returns
    -------
    VectorTask
        ``candidates`` (N, n, d_value) are the item values; ``answer_positions`` equal
        ``answers`` (items come first).

    Raises
    ------
    ValueError
        A size out of range, ``n_queries > n_items``, ``d_key < n_items`` or
        ``key_jitter >= 1``.

    Notes
    -----
    Follows Forgetful Attention (arXiv:2607.12204), §5, Table 5: near-orthogonal content keys,
    a fixed block of 20 filler tokens, the number of distinct items grown (8 to 40), recall@1
    by nearest value. The paper does not give the key dimension, how near-orthogonal keys are
    built, what the filler tokens are, where the block sits or how many queries there are:
    the frame-plus-jitter construction, near-duplicate zero-value filler (as in its selective
    copying task), the block between items and queries, and 8 queries (as in its MQAR
    protocol) are choices, in the continuous ``[key; value]`` token form of its MQAR
    experiments.
    """
    n_examples = check_int(n_examples, "n_examples", min=1)
    n_items = check_int(n_items, "n_items", min=1)
    n_filler = check_int(n_filler, "n_filler", min=0)
    n_queries = check_int(n_queries, "n_queries", min=1)
    if n_queries > n_items:
        raise ValueError(f"n_queries must be <= n_items (queries ask distinct items); got "
                         f"n_queries={n_queries}, n_items={n_items}")
    d_key = check_int(d_key, "d_key", min=1)
    if d_key < n_items:
        raise ValueError(f"d_key must be >= n_items for {n_items} near-orthogonal keys; got "
                         f"d_key={d_key}")
    d_value = check_int(d_value, "d_value", min=1)
    max_abs_cosine_bound(key_jitter)  # validates key_jitter
    key_jitter = float(key_jitter)
    filler_jitter = check_real(filler_jitter, "filler_jitter", min=0.0)
    query_noise = check_real(query_noise, "query_noise", min=0.0)
    config = dict(n_examples=n_examples, n_items=n_items, n_filler=n_filler,
                  n_queries=n_queries, d_key=d_key, d_value=d_value, key_jitter=key_jitter,
                  filler_jitter=filler_jitter, query_noise=query_noise, seed=seed)
    rng = rng_for(seed, "near_orthogonal_capacity")

    keys = _near_orthogonal_keys(rng, n_examples, n_items, d_key, key_jitter)
    values = rng.standard_normal((n_examples, n_items, d_value))
    centre = rng.standard_normal((n_examples, 1, d_key))
    centre /= np.linalg.norm(centre, axis=-1, keepdims=True)
    scale = 1.0 / np.sqrt(d_key)
    inputs = np.zeros((n_examples, n_items + n_filler + n_queries, d_key + d_value))
    inputs[:, :n_items, :d_key] = keys
    inputs[:, :n_items, d_key:] = values
    inputs[:, n_items:n_items + n_filler, :d_key] = centre + filler_jitter * scale * \
        rng.standard_normal((n_examples, n_filler, d_key))
    asked = distinct_integers(rng, n_examples, n_queries, n_items)
    queries = np.take_along_axis(keys, asked[:, :, None], axis=1)
    inputs[:, n_items + n_filler:, :d_key] = queries + query_noise * scale * \
        rng.standard_normal(queries.shape)
    start = n_items + n_filler
    return VectorTask(
        inputs=inputs,
        query_positions=np.arange(start, start + n_queries, dtype=np.int64),
        targets=np.take_along_axis(values, asked[:, :, None], axis=1),
        candidates=values, answers=asked, answer_positions=asked.copy(), d_key=d_key,
        chance=1.0 / n_items, name="near_orthogonal_capacity", config=config)
