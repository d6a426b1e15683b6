"""Selective copying: a few informative (content, value) tokens among near-duplicate filler.

The task of Forgetful Attention (arXiv:2607.12204), §5, Table 3, after the selective-copying
task of Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", 2024.
"""

from __future__ import annotations

import numpy as np

from .._validation import check_int, check_real
from ._base import VectorTask, distinct_integers, rng_for

__all__ = ["selective_copying", "SELECTIVE_COPYING_FILLER_SWEEP"]

#: Filler counts of Forgetful Attention (arXiv:2607.12204), §5, Table 3.
SELECTIVE_COPYING_FILLER_SWEEP = (8, 16, 32, 64, 120)


def selective_copying(n_examples, *, n_filler=8, n_informative=8, n_queries=1, d_key=8,
                      d_value=8, filler_jitter=0.05, query_noise=0.02, seed):
    """Informative (content, value) tokens scattered among near-duplicate zero-value filler.

    Sequence format (length ``n + F + m``, each token a vector of length
    ``d_key + d_value``): ``n = n_informative`` informative tokens ``[c_i; v_i]`` and
    ``F = n_filler`` filler tokens ``[f + filler_jitter * e; 0]`` in a random arrangement,
    followed by ``m = n_queries`` probe tokens ``[c_{a_j} + query_noise * e'; 0]``. Content keys
    ``c_i ~ N(0, I_{d_key})``, values ``v_i ~ N(0, I_{d_value})``, one filler centre
    ``f ~ N(0, I_{d_key})`` per sequence, ``e, e' ~ N(0, I)``; the probed tokens ``a_j`` are
    distinct and uniform. Worked example, ``n = 2``, ``F = 3``, ``m = 1``::

        position  0          1         2          3          4         5
        token     [f+e1; 0]  [c1; v1]  [f+e2; 0]  [f+e3; 0]  [c2; v2]  [c2 + e'; 0]
        answers                                                        1

    Vocabulary: continuous; keys in the first ``d_key`` coordinates, values in the last
    ``d_value``. Filler values are exactly 0; filler keys are near-duplicates of ``f``.

    Scored: each probe position; the output is decoded to the nearest of the ``n``
    informative values and must be ``v_{a_j}`` (recall@1).

    Chance: ``1 / n_informative`` (0.125 at the default 8).

    Parameters
    ----------
    n_examples : int
    n_filler : int, default 8
        ``F >= 0``; Table 3 sweeps :data:`SELECTIVE_COPYING_FILLER_SWEEP` (8 to 120).
    n_informative : int, default 8
    n_queries : int, default 1
        Probes per sequence, ``1 <= n_queries <= n_informative``.
    d_key, d_value : int, default 8
    filler_jitter : float, default 0.05
        Per-coordinate standard deviation of a filler key around the filler centre.
    query_noise : float, default 0.02
        Per-coordinate standard deviation of a probe around its content key.
    seed : int

    Returns
    -------
    VectorTask
        ``candidates`` (N, n, d_value) are the informative values in order of position;
        ``answer_positions`` (N, m) the positions of the probed informative tokens.

    Raises
    ------
    ValueError
        A size out of range or ``n_queries > n_informative``.

    Notes
    -----
    Follows Forgetful Attention (arXiv:2607.12204), §5, Table 3: 8 informative (content,
    value) tokens among ``F`` near-duplicate zero-value filler tokens, the probe reproduces
    one informative token's value, recall@1 with chance 0.125. The paper does not state the
    token dimensions, the filler spread or the arrangement; they are choices here, made in
    the continuous ``[key; value]`` token form its MQAR experiments use. Deliberate differences
    from Gu & Dao's selective copying (2024): the answer is one probed value, addressed by
    content, not the whole ordered list of informative tokens; filler is near-duplicate keys
    with zero value rather than a noise token id.
    """
    n_examples = check_int(n_examples, "n_examples", min=1)
    n_filler = check_int(n_filler, "n_filler", min=0)
    n_informative = check_int(n_informative, "n_informative", min=1)
    n_queries = check_int(n_queries, "n_queries", min=1)
    if n_queries > n_informative:
        raise ValueError(f"n_queries must be <= n_informative (probes ask distinct tokens); "
                         f"got n_queries={n_queries}, n_informative={n_informative}")
    d_key = check_int(d_key, "d_key", min=1)
    d_value = check_int(d_value, "d_value", min=1)
    filler_jitter = check_real(filler_jitter, "filler_jitter", min=0.0)
    query_noise = check_real(query_noise, "query_noise", min=0.0)
    config = dict(n_examples=n_examples, n_filler=n_filler, n_informative=n_informative,
                  n_queries=n_queries, d_key=d_key, d_value=d_value,
                  filler_jitter=filler_jitter, query_noise=query_noise, seed=seed)
    rng = rng_for(seed, "selective_copying")

    n_ctx = n_informative + n_filler
    content = rng.standard_normal((n_examples, n_informative, d_key))
    values = rng.standard_normal((n_examples, n_informative, d_value))
    centre = rng.standard_normal((n_examples, 1, d_key))
    inputs = np.zeros((n_examples, n_ctx + n_queries, d_key + d_value))
    inputs[:, :n_ctx, :d_key] = centre + filler_jitter * rng.standard_normal(
        (n_examples, n_ctx, d_key))
    pos = np.sort(distinct_integers(rng, n_examples, n_informative, n_ctx), axis=1)
    rows = np.arange(n_examples)[:, None]
    inputs[rows, pos, :d_key] = content
    inputs[rows, pos, d_key:] = values

    asked = distinct_integers(rng, n_examples, n_queries, n_informative)
    probes = np.take_along_axis(content, asked[:, :, None], axis=1)
    inputs[:, n_ctx:, :d_key] = probes + query_noise * rng.standard_normal(probes.shape)
    return VectorTask(
        inputs=inputs,
        query_positions=np.arange(n_ctx, n_ctx + n_queries, dtype=np.int64),
        targets=np.take_along_axis(values, asked[:, :, None], axis=1),
        candidates=values, answers=asked,
        answer_positions=np.take_along_axis(pos, asked, axis=1),
        d_key=d_key, chance=1.0 / n_informative, name="selective_copying", config=config)
