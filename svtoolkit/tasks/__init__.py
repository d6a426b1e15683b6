"""Synthetic recall tasks of Forgetful Attention (arXiv:2607.12204) and Tensor Cache (NumPy).

Every generator is ``name(n_examples, *, ..., seed)``: deterministic for a given seed,
different for different seeds; held-out batches use :func:`heldout_seed` (``seed + 10_000``).

Token tasks (:class:`TokenTask`, next-token targets, :data:`IGNORE_INDEX` elsewhere):

* :func:`mqar` - Zoology's multi-query associative recall over distinct keys.
* :func:`tensor_cache_recall` - store-filler-query episodes (matched gaps, filler sweep,
  long gap, multistore).

Vector tasks (:class:`VectorTask`, continuous ``[key; value]`` tokens, nearest-value recall),
the form in which Forgetful Attention trains its sequence models:

* :func:`mqar_vectors` - multi-query associative recall (§5, Table 2).
* :func:`selective_copying` - informative tokens among near-duplicate filler (§5, Table 3).
* :func:`near_orthogonal_capacity` - distinct items on near-orthogonal keys (§5, Table 5).

Plus :func:`skewed_redundancy_context` (§5, Table 4), a key set for the selection policies.
See ``docs/tasks.md``.
"""

from ._base import (
    HELDOUT_OFFSET,
    IGNORE_INDEX,
    TokenTask,
    VectorTask,
    heldout_seed,
    nearest_value_accuracy,
    token_accuracy,
    train_and_heldout,
)
from .capacity import CAPACITY_ITEMS_SWEEP, max_abs_cosine_bound, near_orthogonal_capacity
from .mqar import MQAR_PAIRS_SWEEP, mqar, mqar_vectors
from .redundancy import SkewedContext, skewed_redundancy_context
from .selective_copying import SELECTIVE_COPYING_FILLER_SWEEP, selective_copying
from .tensor_cache_recall import (
    FILLER_SWEEP,
    LONG_GAPS,
    MATCHED_GAPS,
    TENSOR_CACHE_VARIANTS,
    TENSOR_CACHE_WINDOW,
    tensor_cache_recall,
)

__all__ = [
    "IGNORE_INDEX",
    "HELDOUT_OFFSET",
    "TokenTask",
    "VectorTask",
    "heldout_seed",
    "train_and_heldout",
    "token_accuracy",
    "nearest_value_accuracy",
    "mqar",
    "mqar_vectors",
    "MQAR_PAIRS_SWEEP",
    "selective_copying",
    "SELECTIVE_COPYING_FILLER_SWEEP",
    "near_orthogonal_capacity",
    "max_abs_cosine_bound",
    "CAPACITY_ITEMS_SWEEP",
    "tensor_cache_recall",
    "TENSOR_CACHE_VARIANTS",
    "TENSOR_CACHE_WINDOW",
    "MATCHED_GAPS",
    "FILLER_SWEEP",
    "LONG_GAPS",
    "SkewedContext",
    "skewed_redundancy_context",
]
