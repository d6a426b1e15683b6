"""What the synthetic studies (selective copying, capacity, MQAR) share: the learning-rate grid
and the ``--quick`` protocol, decided once for every study, and the differences from Forgetful
Attention (arXiv:2607.12204), §5, that the continuous-token studies' model and protocol share
(each script adds its own)."""

from __future__ import annotations

from .protocol import Protocol

__all__ = ["LM_LR_GRID", "LR_GRID", "QUICK_PROTOCOL", "VECTOR_DIFFERENCES"]

#: The learning-rate grid of every method at default and paper scale.
LR_GRID = (3e-4, 1e-3, 3e-3, 1e-2)
#: The learning-rate grid of the language-model studies (Tensor Cache recall, matched state,
#: long context) at the default scale: two values around the rates their earlier fixed
#: protocols used (1e-3 to 3e-3), for the 2-core budget; their ``--paper`` scale uses
#: :data:`LR_GRID`.
LM_LR_GRID = (1e-3, 3e-3)
#: ``--quick``: a pipeline check in seconds (its numbers mean nothing).
QUICK_PROTOCOL = Protocol(lr_grid=(1e-2, 3e-3), max_steps=6, batch_size=8, eval_interval=2,
                          min_steps=2, warmup_steps=1, n_validation=16, n_test=16)

VECTOR_DIFFERENCES = (
    "model: not stated in the paper; here a linear token embedding, ONE attention layer and "
    "a linear value head (no MLP, norm, residual or positions: the tasks are "
    "content-addressed)",
    "loss: not stated; here the mean-squared error of the query outputs against their values",
    "training budget, batch, learning rate, width and seeds are not stated; here the same "
    "protocol for every method: a learning-rate grid, validation on a split of its own, a "
    "plateau rule, the lr chosen on validation, its best-validation checkpoint scored on a "
    "separate test split",
    "the SV chunk is the context length, so the queries read one gate fit on the whole "
    "context (the block gate); C = 0.25, sigma = 2 on the raw projections (the paper's "
    "layer), FISTA 80 iterations, ridge 1e-3",
    "SV state = mean over test instances and heads of |S u E| (alpha > 0) of the exact fp64 "
    "gate on the trained model's keys; the paper does not say per head or how it averages",
    "state is not matched: each recurrence carries n_heads matrices of head_dim x head_dim",
)
