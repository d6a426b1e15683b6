"""The two task containers, seeds and scoring shared by every generator in this package.

A generator ``name(n_examples, *, ..., seed)`` returns either

* a :class:`TokenTask` - integer token sequences with next-token targets at the scored
  positions (the form of Zoology's MQAR and of the Tensor Cache recall episodes), or
* a :class:`VectorTask` - continuous tokens ``[key; value]`` with a value to reproduce at each
  query position, scored by nearest value (the form the Forgetful Attention experiments feed to
  their sequence models through a linear embedding).

Both are deterministic for a given ``seed``; different seeds give different data. Training and
held-out batches come from different seeds: :func:`heldout_seed` (``seed + 10_000``) and
:func:`train_and_heldout` are the convention the experiments use.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .._validation import check_int

__all__ = [
    "IGNORE_INDEX",
    "HELDOUT_OFFSET",
    "TokenTask",
    "VectorTask",
    "heldout_seed",
    "train_and_heldout",
    "token_accuracy",
    "nearest_value_accuracy",
]

#: Target value at positions that are not scored (PyTorch's ``cross_entropy`` default).
IGNORE_INDEX = -100
#: Held-out data use ``seed + HELDOUT_OFFSET`` (see :func:`heldout_seed`).
HELDOUT_OFFSET = 10_000


@dataclass(frozen=True)
class TokenTask:
    """A batch of token sequences with next-token targets at the scored positions.

    A model reads ``inputs[:, :t + 1]`` causally and predicts ``targets[:, t]``; recall@1 is
    the fraction of scored positions (``targets != IGNORE_INDEX``) where its argmax equals the
    target (:func:`token_accuracy`).

    Attributes
    ----------
    inputs : ndarray of int64 of shape (N, L)
        Token ids in ``[0, vocab_size)``.
    targets : ndarray of int64 of shape (N, L)
        The token to predict at scored positions, :data:`IGNORE_INDEX` elsewhere.
    vocab_size : int
    chance : float
        Accuracy of a uniform guess over the answer alphabet at a scored position.
    name : str
    config : dict
        Every parameter that defined the batch, ``seed`` included.
    """

    inputs: np.ndarray
    targets: np.ndarray
    vocab_size: int
    chance: float
    name: str
    config: dict

    @property
    def scored(self):
        """ndarray of bool of shape (N, L): the positions that are scored."""
        return self.targets != IGNORE_INDEX


@dataclass(frozen=True)
class VectorTask:
    """A batch of continuous-token sequences, scored by nearest value at the query positions.

    Every token is one vector ``[key; value]`` of length ``d_key + d_value``; a query token is
    ``[query key; 0]``. A model reads ``inputs[:, :t + 1]`` causally and outputs a value vector
    at each query position ``t``; recall@1 is the fraction of queries whose output is nearest
    (Euclidean) to the right candidate value (:func:`nearest_value_accuracy`).

    Attributes
    ----------
    inputs : ndarray of float64 of shape (N, L, d_key + d_value)
    query_positions : ndarray of int64 of shape (m,)
        Positions of the query tokens (the same in every sequence: the last ``m``).
    targets : ndarray of float64 of shape (N, m, d_value)
        The value each query must reproduce, ``candidates[i, answers[i, j]]``.
    candidates : ndarray of float64 of shape (N, c, d_value)
        The values nearest-value decoding chooses among.
    answers : ndarray of int64 of shape (N, m)
        Index into ``candidates`` of the right value.
    answer_positions : ndarray of int64 of shape (N, m)
        Position in ``inputs`` of the context token that holds the answer.
    d_key : int
    chance : float
        Accuracy of a uniform guess among the ``c`` candidates, ``1 / c``.
    name : str
    config : dict
        Every parameter that defined the batch, ``seed`` included.
    """

    inputs: np.ndarray
    query_positions: np.ndarray
    targets: np.ndarray
    candidates: np.ndarray
    answers: np.ndarray
    answer_positions: np.ndarray
    d_key: int
    chance: float
    name: str
    config: dict

    @property
    def keys(self):
        """ndarray of shape (N, L, d_key): the key half of every token (query keys included)."""
        return self.inputs[..., : self.d_key]

    @property
    def values(self):
        """ndarray of shape (N, L, d_value): the value half of every token (0 for queries)."""
        return self.inputs[..., self.d_key:]

    @property
    def queries(self):
        """ndarray of shape (N, m, d_key): the query keys."""
        return self.inputs[:, self.query_positions, : self.d_key]


def heldout_seed(seed):
    """The seed of the held-out batch that goes with training seed ``seed``: ``seed + 10_000``.

    Raises
    ------
    TypeError
        ``seed`` is not an integer (a bool is refused).
    ValueError
        ``seed`` is negative.
    """
    return check_int(seed, "seed", min=0) + HELDOUT_OFFSET


def train_and_heldout(generator, n_train, n_heldout, *, seed, **kwargs):
    """A training batch from ``seed`` and a held-out batch from :func:`heldout_seed` (seed).

    Parameters
    ----------
    generator : callable
        A task generator of this package, e.g. :func:`svtoolkit.tasks.mqar`.
    n_train, n_heldout : int
        Number of examples in each batch.
    seed : int
    **kwargs
        Passed to both calls (the task parameters must match).

    Returns
    -------
    (TokenTask, TokenTask) or (VectorTask, VectorTask)
    """
    train = generator(n_train, seed=seed, **kwargs)
    return train, generator(n_heldout, seed=heldout_seed(seed), **kwargs)


def token_accuracy(task, predictions):
    """Recall@1 of predicted tokens over the scored positions of ``task``.

    Parameters
    ----------
    task : TokenTask
    predictions : array_like of int of shape (N, L), or of float of shape (N, L, V)
        Predicted token ids, or logits (their argmax over the last axis is taken).

    Returns
    -------
    float

    Raises
    ------
    ValueError
        Shapes do not match ``task.targets``.
    """
    pred = np.asarray(predictions)
    if pred.ndim == 3:
        pred = pred.argmax(axis=-1)
    if pred.shape != task.targets.shape:
        raise ValueError(f"predictions must have shape {task.targets.shape} (ids) or "
                         f"{task.targets.shape + (task.vocab_size,)} (logits); got "
                         f"{np.shape(predictions)}")
    scored = task.scored
    return float((pred[scored] == task.targets[scored]).mean())


def nearest_value_accuracy(task, outputs):
    """Recall@1 by nearest value: the fraction of queries decoded to the right candidate.

    Parameters
    ----------
    task : VectorTask
    outputs : array_like of shape (N, m, d_value)
        The model's value vector at each query position.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        ``outputs`` does not have the shape of ``task.targets``.
    """
    out = np.asarray(outputs, dtype=np.float64)
    if out.shape != task.targets.shape:
        raise ValueError(f"outputs must have shape {task.targets.shape}; got {out.shape}")
    d2 = ((out[:, :, None, :] - task.candidates[:, None, :, :]) ** 2).sum(axis=-1)
    return float((d2.argmin(axis=-1) == task.answers).mean())


# --- sampling helpers shared by the generators --------------------------------------------

def rng_for(seed, stream):
    """A Generator for ``seed`` and a task-specific ``stream`` label.

    The label keeps tasks that share a seed from sharing random draws.
    """
    return np.random.default_rng([check_int(seed, "seed", min=0), zlib.crc32(stream.encode())])


def distinct_integers(rng, n_rows, size, high):
    """``size`` distinct integers from ``[0, high)`` per row, uniformly, in random order.

    Returns
    -------
    ndarray of int64 of shape (n_rows, size)
    """
    out = np.empty((n_rows, size), dtype=np.int64)
    todo = np.arange(n_rows)
    # Sparse draws (few expected collisions): draw with replacement, redraw the rows that
    # collide. Dense draws: rank uniform scores over the whole range, in row blocks.
    if size * (size - 1) <= 4 * high:
        for _ in range(200):
            if todo.size == 0:
                return out
            draw = rng.integers(0, high, size=(todo.size, size))
            srt = np.sort(draw, axis=1)
            ok = (srt[:, 1:] != srt[:, :-1]).all(axis=1)
            out[todo[ok]] = draw[ok]
            todo = todo[~ok]
    block = max(1, 4_000_000 // high)
    for start in range(0, todo.size, block):
        rows = todo[start:start + block]
        score = rng.random((rows.size, high))
        part = np.argpartition(score, size - 1, axis=1)[:, :size]
        order = np.argsort(np.take_along_axis(score, part, axis=1), axis=1)
        out[rows] = np.take_along_axis(part, order, axis=1)
    return out
