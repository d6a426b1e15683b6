"""Multi-query associative recall (MQAR) over distinct keys, in token and vector form.

:func:`mqar` is the token task of Arora et al., "Zoology: Measuring and Improving Recall in
Efficient Language Models", ICLR 2024. :func:`mqar_vectors` is the continuous form in which
Forgetful Attention (arXiv:2607.12204), §5 (Table 2) trains its causal sequence models: each
context token carries one (key, value) pair, so retrieval is content-addressed.
"""

from __future__ import annotations

import numpy as np

from .._validation import check_bool, check_int, check_positive, check_real
from ._base import (
    IGNORE_INDEX,
    TokenTask,
    VectorTask,
    distinct_integers,
    rng_for,
)

__all__ = ["mqar", "mqar_vectors", "MQAR_PAIRS_SWEEP"]

#: Numbers of key-value pairs for the sweep of Forgetful Attention (arXiv:2607.12204), §5,
#: Table 2. The paper gives the end points (8 and 64); the doubling steps between are a choice.
MQAR_PAIRS_SWEEP = (8, 16, 32, 64)


def _power_law_slots(rng, n_rows, n_slots, size, power_a):
    """``size`` distinct slots of ``[0, n_slots)`` per row, drawn without replacement with
    probability proportional to ``w_s = (s + 1) ** (power_a - 1)``, in the order drawn.

    The ``size`` smallest of ``E_s / w_s`` with ``E_s ~ Exp(1)``, in increasing order, are
    distributed as sequential weighted sampling without replacement (an exponential race),
    which vectorises over rows.
    """
    race = rng.standard_exponential((n_rows, n_slots))
    race *= np.arange(1, n_slots + 1, dtype=np.float64) ** (1.0 - power_a)
    first = np.argpartition(race, size - 1, axis=1)[:, :size]
    order = np.argsort(np.take_along_axis(race, first, axis=1), axis=1)
    return np.take_along_axis(first, order, axis=1)


def mqar(n_examples, *, n_pairs=8, n_queries=8, seq_len=256, vocab_size=8192, power_a=0.01,
         random_fill=True, seed):
    """Token multi-query associative recall over distinct keys (Zoology's MQAR).

    Sequence format (length ``L = seq_len``)::

        k_1 v_1 k_2 v_2 ... k_n v_n | x x k_a x x x k_b x ... x

    The first ``2 n`` tokens bind ``n = n_pairs`` distinct keys to distinct values. The rest
    is ``(L - 2 n) // 2`` two-token slots (plus one trailing token when ``L`` is odd); ``m =
    n_queries`` slots, drawn without replacement with probability proportional to
    ``(s + 1) ** (power_a - 1)`` (``s`` = slot index, so small gaps are likelier), hold one
    queried key each at the slot's first position; the queried keys are ``m`` distinct keys of
    the context. Every other token (``x``) is drawn uniformly from the whole vocabulary
    (``random_fill=True``) or is the blank id 0. Worked example, ``n = 2``, ``m = 2``,
    ``L = 12``, ``vocab_size = 16``, ``random_fill=False``::

        position  0  1  2   3  4  5  6  7  8  9  10 11
        inputs    3  9  5  14  0  0  5  0  0  0  3  0
        targets   .  .  .   .  .  . 14  .  .  .  9  .      (. = IGNORE_INDEX)

    Vocabulary: 0 is the blank (fill) id; keys are ``1 .. vocab_size // 2 - 1``; values are
    ``vocab_size // 2 .. vocab_size - 1``. With ``random_fill=True`` a fill token may take any
    id, keys and values included (as in Zoology).

    Scored: the position of each query key, whose target is the value bound to that key
    (next-token convention: the model reads the query key and must emit its value). Exactly
    ``m`` positions per sequence are scored.

    Chance: ``1 / (vocab_size - vocab_size // 2)``, a uniform guess over the value alphabet (a
    guess among the ``n`` values present in the context would get ``1 / n``).

    Parameters
    ----------
    n_examples : int
        Number of sequences ``N`` (>= 1).
    n_pairs : int, default 8
        Distinct key-value pairs per sequence (Forgetful Attention, Table 2, sweeps 8 to 64,
        :data:`MQAR_PAIRS_SWEEP`).
    n_queries : int, default 8
        Queries per sequence, ``1 <= n_queries <= n_pairs`` (Table 2 uses 8).
    seq_len : int, default 256
        Must be ``>= 2 * n_pairs + 2 * n_queries``.
    vocab_size : int, default 8192
        Zoology's default; needs ``vocab_size // 2 - 1 >= n_pairs`` distinct keys.
    power_a : float, default 0.01
        Power-law exponent of the query placement (1.0 = uniform over slots).
    random_fill : bool, default True
    seed : int

    Returns
    -------
    TokenTask
        ``inputs``, ``targets`` of shape (N, seq_len), int64.

    Raises
    ------
    ValueError
        A size out of range, ``seq_len`` too short for the pairs and queries, or too small a
        vocabulary for ``n_pairs`` distinct keys.

    Notes
    -----
    Follows Arora et al., "Zoology: Measuring and Improving Recall in Efficient Language
    Models", ICLR 2024 (multi-query AR: key-value block first, power-law query placement, key
    and value vocabularies split at ``vocab_size // 2``). Deliberate differences:

    * ``n_queries`` is independent of ``n_pairs`` (Zoology queries every key once); the
      queried keys are a uniformly random subset of the context's keys. This is the protocol
      of Forgetful Attention (arXiv:2607.12204), §5, Table 2 (``n_query = 8`` while the
      number of distinct pairs grows).
    * Forgetful Attention itself trains on the continuous form (:func:`mqar_vectors`), in
      which each token carries a whole (key, value) pair; this token form is provided for
      token-level models.
    * No multi-pass repetition of the key-value block (Zoology's ``num_passes``) and no
      even-length restriction (a trailing fill token is appended when ``seq_len`` is odd).
    """
    n_examples = check_int(n_examples, "n_examples", min=1)
    n_pairs = check_int(n_pairs, "n_pairs", min=1)
    n_queries = check_int(n_queries, "n_queries", min=1)
    if n_queries > n_pairs:
        raise ValueError(f"n_queries must be <= n_pairs (queries ask distinct keys); got "
                         f"n_queries={n_queries}, n_pairs={n_pairs}")
    seq_len = check_int(seq_len, "seq_len", min=2)
    if seq_len < 2 * n_pairs + 2 * n_queries:
        raise ValueError(f"seq_len must be >= 2 * n_pairs + 2 * n_queries = "
                         f"{2 * n_pairs + 2 * n_queries}; got {seq_len}")
    vocab_size = check_int(vocab_size, "vocab_size", min=4)
    n_key_ids = vocab_size // 2 - 1
    if n_key_ids < n_pairs:
        raise ValueError(f"vocab_size={vocab_size} gives {n_key_ids} key ids (1 .. "
                         f"{vocab_size // 2 - 1}); n_pairs={n_pairs} distinct keys need "
                         f"vocab_size >= {2 * (n_pairs + 1)}")
    power_a = check_positive(power_a, "power_a")
    random_fill = check_bool(random_fill, "random_fill")
    config = dict(n_examples=n_examples, n_pairs=n_pairs, n_queries=n_queries,
                  seq_len=seq_len, vocab_size=vocab_size, power_a=power_a,
                  random_fill=bool(random_fill), seed=seed)
    rng = rng_for(seed, "mqar")

    half = vocab_size // 2
    keys = 1 + distinct_integers(rng, n_examples, n_pairs, n_key_ids)
    values = half + distinct_integers(rng, n_examples, n_pairs, vocab_size - half)
    if random_fill:
        inputs = rng.integers(0, vocab_size, size=(n_examples, seq_len), dtype=np.int64)
    else:
        inputs = np.zeros((n_examples, seq_len), dtype=np.int64)
    inputs[:, 0:2 * n_pairs:2] = keys
    inputs[:, 1:2 * n_pairs:2] = values

    slots = _power_law_slots(rng, n_examples, (seq_len - 2 * n_pairs) // 2, n_queries,
                             power_a)
    asked = distinct_integers(rng, n_examples, n_queries, n_pairs)
    pos = 2 * n_pairs + 2 * slots
    rows = np.arange(n_examples)[:, None]
    inputs[rows, pos] = np.take_along_axis(keys, asked, axis=1)
    targets = np.full((n_examples, seq_len), IGNORE_INDEX, dtype=np.int64)
    targets[rows, pos] = np.take_along_axis(values, asked, axis=1)
    return TokenTask(inputs=inputs, targets=targets, vocab_size=vocab_size,
                     chance=1.0 / (vocab_size - half), name="mqar", config=config)


def mqar_vectors(n_examples, *, n_pairs=8, n_queries=8, d_key=8, d_value=8, key_noise=0.02,
                 seed):
    """Continuous multi-query associative recall over distinct keys (the vector form).

    Sequence format (length ``n + m``, each token a vector of length ``d_key + d_value``)::

        [k_1; v_1] [k_2; v_2] ... [k_n; v_n] [q_1; 0] ... [q_m; 0]

    with keys ``k_i ~ N(0, I_{d_key})`` (distinct with probability 1), values
    ``v_i ~ N(0, I_{d_value})``, and queries ``q_j = k_{a_j} + key_noise * N(0, I_{d_key})``
    for ``m`` distinct pairs ``a_j`` drawn uniformly. Worked example, ``n = 3``, ``m = 2``::

        position  0         1         2         3              4
        token     [k1; v1]  [k2; v2]  [k3; v3]  [k3 + e; 0]    [k1 + e'; 0]
        answers                                 2              0

    Vocabulary: continuous; there are no ids. Keys live in the first ``d_key`` coordinates,
    values in the last ``d_value`` (0 for a query token).

    Scored: each query position ``n + j``; the model's output there is decoded to the nearest
    of the ``n`` context values (:func:`~svtoolkit.tasks.nearest_value_accuracy`) and must be
    ``v_{a_j}`` (recall@1, nearest value).

    Chance: ``1 / n_pairs``.

    Parameters
    ----------
    n_examples : int
    n_pairs : int, default 8
        Distinct pairs per sequence (Forgetful Attention, Table 2, sweeps 8 to 64).
    n_queries : int, default 8
        ``1 <= n_queries <= n_pairs``; Table 2 uses 8.
    d_key, d_value : int, default 8
    key_noise : float, default 0.02
        Per-coordinate standard deviation of the query perturbation.
    seed : int

    Returns
    -------
    VectorTask
        ``inputs`` (N, n + m, d_key + d_value); ``candidates`` are the context values (N, n,
        d_value); ``answer_positions`` equal ``answers`` (the pairs come first).

    Raises
    ------
    ValueError
        A size out of range or ``n_queries > n_pairs``.

    Notes
    -----
    Follows Forgetful Attention (arXiv:2607.12204), §5 (Table 2: causal multi-query recall over
    distinct keys, ``n_query = 8``, recall@1) in the form of the paper's public reference code:
    memory tokens first, then query tokens, Gaussian keys and values, query noise 0.02,
    decoding to the nearest stored value; MQAR itself is from Arora et al., ICLR 2024. The
    paper does not state ``d_key``, ``d_value`` or the noise level; the defaults are those of
    its reference code's recall experiments (8, 8, 0.02). Deliberate difference: the queried
    pairs are distinct (each key asked at most once, as in Zoology) where the reference code
    draws them with replacement.
    """
    n_examples = check_int(n_examples, "n_examples", min=1)
    n_pairs = check_int(n_pairs, "n_pairs", min=1)
    n_queries = check_int(n_queries, "n_queries", min=1)
    if n_queries > n_pairs:
        raise ValueError(f"n_queries must be <= n_pairs (queries ask distinct keys); got "
                         f"n_queries={n_queries}, n_pairs={n_pairs}")
    d_key = check_int(d_key, "d_key", min=1)
    d_value = check_int(d_value, "d_value", min=1)
    key_noise = check_real(key_noise, "key_noise", min=0.0)
    config = dict(n_examples=n_examples, n_pairs=n_pairs, n_queries=n_queries, d_key=d_key,
                  d_value=d_value, key_noise=key_noise, seed=seed)
    rng = rng_for(seed, "mqar_vectors")

    keys = rng.standard_normal((n_examples, n_pairs, d_key))
    values = rng.standard_normal((n_examples, n_pairs, d_value))
    asked = distinct_integers(rng, n_examples, n_queries, n_pairs)
    queries = np.take_along_axis(keys, asked[:, :, None], axis=1)
    queries = queries + key_noise * rng.standard_normal(queries.shape)
    inputs = np.zeros((n_examples, n_pairs + n_queries, d_key + d_value))
    inputs[:, :n_pairs, :d_key] = keys
    inputs[:, :n_pairs, d_key:] = values
    inputs[:, n_pairs:, :d_key] = queries
    return VectorTask(
        inputs=inputs,
        query_positions=np.arange(n_pairs, n_pairs + n_queries, dtype=np.int64),
        targets=np.take_along_axis(values, asked[:, :, None], axis=1),
        candidates=values, answers=asked, answer_positions=asked.copy(), d_key=d_key,
        chance=1.0 / n_pairs, name="mqar_vectors", config=config)
