"""Store-filler-query associative recall episodes of the Tensor Cache paper.

Tensor Cache: Eviction-conditioned Associative Memory for Transformers, §4.3 (matched gaps
and the evaluation filler sweep) and App. B (long-gap single-store and multistore variants).
"""

from __future__ import annotations

import numpy as np

from .._validation import check_int, check_option
from ._base import IGNORE_INDEX, TokenTask, distinct_integers, rng_for

__all__ = [
    "tensor_cache_recall",
    "TENSOR_CACHE_VARIANTS",
    "TENSOR_CACHE_WINDOW",
    "MATCHED_GAPS",
    "FILLER_SWEEP",
    "LONG_GAPS",
    "BOS",
    "STORE",
    "QUERY",
]

#: Sliding-window length of the paper's recall experiments (a model setting, recorded here
#: because every gap is chosen so that the store has left this window at query time).
TENSOR_CACHE_WINDOW = 12
#: Matched training/evaluation gaps (Tensor Cache, §4.3, Table 1).
MATCHED_GAPS = (24, 36, 48)
#: Evaluation filler lengths at training gap 24 (Tensor Cache, §4.3). The paper gives the
#: range 12 .. 192; the doubling steps between are a choice.
FILLER_SWEEP = (12, 24, 48, 96, 192)
#: Gaps of the long-gap single-store variant (Tensor Cache, App. B.1, Table 5).
LONG_GAPS = (128, 256, 512, 1024)

#: Marker ids: beginning of sequence, "store" and "query".
BOS, STORE, QUERY = 0, 1, 2

#: Named variants: default gap, allowed gaps, episodes per sequence, stored pairs per episode.
TENSOR_CACHE_VARIANTS = {
    "matched": dict(gap=24, gaps=MATCHED_GAPS, n_episodes=6, n_stores=1),
    "filler_sweep": dict(gap=24, gaps=(12, 192), n_episodes=6, n_stores=1),
    "long_gap": dict(gap=128, gaps=LONG_GAPS, n_episodes=1, n_stores=1),
    "multistore": dict(gap=24, gaps=(24,), n_episodes=6, n_stores=2),
    "custom": dict(gap=24, gaps=None, n_episodes=6, n_stores=1),
}


def _resolve(variant, gap, n_episodes, n_stores):
    """Defaults of ``variant`` for the arguments left as None, and the variant's checks."""
    check_option(variant, "variant", tuple(TENSOR_CACHE_VARIANTS))
    spec = TENSOR_CACHE_VARIANTS[variant]
    gap = check_int(spec["gap"] if gap is None else gap, "gap", min=0)
    n_episodes = check_int(spec["n_episodes"] if n_episodes is None else n_episodes,
                           "n_episodes", min=1)
    n_stores = check_int(spec["n_stores"] if n_stores is None else n_stores, "n_stores", min=1)
    if variant == "filler_sweep":
        if not spec["gaps"][0] <= gap <= spec["gaps"][1]:
            raise ValueError(f"gap of the 'filler_sweep' variant must be in [12, 192]; got "
                             f"{gap}")
    elif spec["gaps"] is not None and gap not in spec["gaps"]:
        raise ValueError(f"gap of the {variant!r} variant must be one of {spec['gaps']}; got "
                         f"{gap} (use variant='custom' for other gaps)")
    if variant != "custom" and n_stores != spec["n_stores"]:
        raise ValueError(f"the {variant!r} variant has n_stores={spec['n_stores']}; got "
                         f"{n_stores} (use variant='custom')")
    if variant == "long_gap" and n_episodes != 1:
        raise ValueError(f"the 'long_gap' variant is single-episode (n_episodes=1); got "
                         f"{n_episodes} (use variant='custom')")
    return gap, n_episodes, n_stores


def tensor_cache_recall(n_examples, *, variant="matched", gap=None, n_episodes=None,
                        n_stores=None, n_keys=16, n_values=16, n_filler_tokens=16, seed):
    """Store-filler-query associative-recall episodes for a windowed model.

    Sequence format: ``BOS`` then ``E = n_episodes`` episodes, each::

        STORE k_1 v_1 [STORE k_2 v_2 ...] f f ... f QUERY k_a v_a
                                          \\_ g _/

    ``s = n_stores`` stored (key, value) pairs, exactly ``g = gap`` filler tokens, then a query
    for one of the episode's stored keys (uniform) followed by its value. Length
    ``L = 1 + E * (3 s + g + 3)``. Keys are distinct across the whole sequence (so no episode
    rebinds an earlier key); values are uniform with replacement; fillers are uniform over
    the filler ids. Worked example, ``E = 1``, ``s = 1``, ``g = 3``, ``n_keys = n_values =
    n_filler_tokens = 4``::

        position  0  1  2  3   4   5   6  7  8  9
        inputs    0  1  5  9  12  14  13  2  5  9
        targets   .  .  .  .   .   .   .  .  9  .      (. = IGNORE_INDEX)

    Vocabulary (``K = n_keys``, ``V = n_values``): ``BOS = 0``, ``STORE = 1``, ``QUERY = 2``;
    keys ``3 .. 3 + K - 1``; values ``3 + K .. 3 + K + V - 1``; fillers from ``3 + K + V``;
    ``vocab_size = 3 + K + V + n_filler_tokens``.

    Scored: the query key's position in every episode, whose target is the stored value (the
    next token); ``E`` positions per sequence. The distance from that position back to the
    queried value is ``g + 2`` (plus ``3`` per later store in the episode), so for every
    named variant's gaps (``g >= 12``) the store has left a ``W = 12`` window.

    Chance: ``1 / n_values`` (0.0625 at the default 16; the paper's "near chance (~6%)",
    ``log N ~ 2.77`` for ``N = 16``).

    Parameters
    ----------
    n_examples : int
    variant : {"matched", "filler_sweep", "long_gap", "multistore", "custom"}
        ``"matched"``: the main task, gaps :data:`MATCHED_GAPS` (24, 36, 48), 6 episodes of
        one store (§4.3, Table 1). ``"filler_sweep"``: the same episodes at an evaluation
        filler length in [12, 192] (:data:`FILLER_SWEEP`) for a model trained at gap 24
        (§4.3, OOD calibration). ``"long_gap"``: one episode, one store, gaps
        :data:`LONG_GAPS` (128 .. 1024; App. B.1). ``"multistore"``: two stored pairs per
        episode at gap 24 (App. B.2). ``"custom"``: no checks on gap, episodes or stores.
    gap : int, optional
        Filler tokens between the (last) store and the query; the variant's default if None.
    n_episodes, n_stores : int, optional
        Episodes per sequence and stored pairs per episode; the variant's if None.
    n_keys, n_values, n_filler_tokens : int, default 16
        Alphabet sizes; ``n_keys >= n_episodes * n_stores`` (distinct keys).
    seed : int

    Returns
    -------
    TokenTask
        ``inputs``, ``targets`` of shape (N, L), int64; ``config`` records the resolved gap,
        episodes and stores, and the window ``W = 12``.

    Raises
    ------
    ValueError
        Unknown variant, a gap outside the variant's set, a variant's fixed property
        overridden, a size out of range, or too few keys for distinct keys.

    Notes
    -----
    Follows Tensor Cache: Eviction-conditioned Associative Memory for Transformers, §4.3
    (store-filler-query episodes, matched gaps ``g in {24, 36, 48}`` with ``W = 12``, the
    evaluation filler sweep ``F_eval in {12, ..., 192}`` at training gap 24, chance ~6%) and
    App. B (long-gap single-episode single-store task at gaps 128 .. 1024; multistore at gap
    24 with two stored pairs per episode). The paper does not give the episode layout or the
    alphabets; choices here: marker tokens, 16 keys, 16 values (consistent with its chance
    level and ``log N``), 16 filler ids, one query per episode (in the multistore variant
    it asks one of the two stored keys), distinct keys within a sequence, six episodes per
    sequence. Its Full-KV state figures (398/542/686 kB at gaps 24/36/48, 254 kB at
    ``F_eval = 12``) are consistent with ``1 + 6 (g + 9)`` tokens per sequence, i.e. six
    episodes with nine non-filler tokens each; this layout has six (``1 + 6 (g + 6)``), so
    state sizes measured on it are smaller for the same gap. The ``long_gap`` length is
    ``g + 7`` here.
    """
    n_examples = check_int(n_examples, "n_examples", min=1)
    gap, n_episodes, n_stores = _resolve(variant, gap, n_episodes, n_stores)
    n_keys = check_int(n_keys, "n_keys", min=1)
    n_values = check_int(n_values, "n_values", min=1)
    n_filler_tokens = check_int(n_filler_tokens, "n_filler_tokens", min=1)
    if n_keys < n_episodes * n_stores:
        raise ValueError(f"n_keys must be >= n_episodes * n_stores = {n_episodes * n_stores} "
                         f"(keys are distinct within a sequence); got {n_keys}")
    config = dict(n_examples=n_examples, variant=variant, gap=gap, n_episodes=n_episodes,
                  n_stores=n_stores, n_keys=n_keys, n_values=n_values,
                  n_filler_tokens=n_filler_tokens, window=TENSOR_CACHE_WINDOW, seed=seed)
    rng = rng_for(seed, "tensor_cache_recall")

    key0, value0 = 3, 3 + n_keys
    filler0 = value0 + n_values
    ep_len = 3 * n_stores + gap + 3
    E, s, N = n_episodes, n_stores, n_examples
    keys = key0 + distinct_integers(rng, N, E * s, n_keys).reshape(N, E, s)
    values = value0 + rng.integers(0, n_values, size=(N, E, s))
    asked = rng.integers(0, s, size=(N, E, 1))

    episode = np.empty((N, E, ep_len), dtype=np.int64)
    episode[:, :, 0:3 * s:3] = STORE
    episode[:, :, 1:3 * s:3] = keys
    episode[:, :, 2:3 * s:3] = values
    episode[:, :, 3 * s:3 * s + gap] = filler0 + rng.integers(0, n_filler_tokens,
                                                              size=(N, E, gap))
    episode[:, :, -3] = QUERY
    episode[:, :, -2] = np.take_along_axis(keys, asked, axis=2)[..., 0]
    episode[:, :, -1] = np.take_along_axis(values, asked, axis=2)[..., 0]
    inputs = np.concatenate([np.full((N, 1), BOS, dtype=np.int64),
                             episode.reshape(N, E * ep_len)], axis=1)

    targets = np.full_like(inputs, IGNORE_INDEX)
    scored = 1 + np.arange(E) * ep_len + ep_len - 2
    targets[:, scored] = inputs[:, scored + 1]
    return TokenTask(inputs=inputs, targets=targets,
                     vocab_size=filler0 + n_filler_tokens, chance=1.0 / n_values,
                     name=f"tensor_cache_recall/{variant}", config=config)
