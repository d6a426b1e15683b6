"""Text shared by the continuous-token studies (selective copying, capacity, MQAR vector form):
the differences from Forgetful Attention (arXiv:2607.12204), §5, that their model and protocol
share. Each script adds its own."""

from __future__ import annotations

__all__ = ["VECTOR_DIFFERENCES"]

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
