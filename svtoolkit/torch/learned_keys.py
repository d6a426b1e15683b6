"""Learned keys: the key projections of a small trained SV-Attention language model.

The fourth forgetting regime of Forgetful Attention (arXiv:2607.12204, §4, App. C, "a
trained recall model's learned key projections") solves the gate on keys a trained model
actually produces, not on synthetic draws. :func:`learned_key_sets` makes such keys deterministically and quickly: it trains a tiny
:class:`svtoolkit.torch.TinyLM` with the hybrid SV layer (``attn="sv_hybrid"``) on the Python
standard library's own source (zero install, :mod:`svtoolkit.corpora`) for a fixed number of
steps, then runs held-out bytes (the validation split) through it and collects, per layer and
head, the keys the gate sees - ``W_k`` projections of the block's normalised input, RMS-
normalised per head (``||k|| = sqrt(D)``, the layer's convention) - in float64, cut into
contexts of consecutive tokens and deduplicated within 0.1 (the paper's protocol for real
streams).

Determinism: the training runs on one thread (``threadpoolctl.threadpool_limits(1)`` and one
Numba thread, both restored afterwards) from a fixed seed and a fixed corpus prefix, so a given
machine and set of versions reproduces the keys bit for bit; the stdlib corpus depends on the
Python version (its digest is recorded). Without ``threadpoolctl`` the thread count is left
alone (results are then reproducible for a fixed thread count). ``torch.set_num_threads`` is
deliberately not used: in torch 2.13 CPU builds an explicit ``set_num_threads(k >= 2)`` makes
batched ``torch.linalg.solve`` of matrices larger than about 150 unreliable (pytorch#142815).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..corpora import BatchSampler, byte_splits, corpus_digest, stdlib_source_bytes
from ..data import deduplicate
from .model import TinyLM

__all__ = ["LearnedKeys", "learned_key_sets", "LEARNED_KEYS_CONFIG"]

#: The default recipe (about 10 s on one thread of a 2-core x86 VM).
LEARNED_KEYS_CONFIG = dict(
    corpus_bytes=400_000,  # stdlib prefix: 90 % train, 5 % validation (held out), 5 % test
    d_model=32, n_layers=2, n_heads=2, block=64,
    attn_options={"chunk": 16, "C": 0.25, "fista_iters": 80},
    steps=120, batch_size=16, lr=3e-3, weight_decay=0.1,
    context=40,  # consecutive held-out tokens per key set
    contexts_per_head=24,
    dedup=0.1,
    seed=0,
)


@dataclass
class LearnedKeys:
    """Key sets from a trained model.

    Attributes
    ----------
    key_sets : list of ndarray of shape (n_i, D), float64
        One context of consecutive held-out tokens per entry, deduplicated within ``dedup``.
    origin : list of tuple (layer, head, window)
        Where each key set came from.
    head_dim : int
        D.
    sigma : float
        The layers' RBF width ``sqrt(2 D)`` (the width the gate uses on these keys).
    C : float
        The layers' box.
    train_bpb : tuple of float
        Training loss in bits per byte over the first and the last 10 steps (the model did
        learn: the second is well below the first).
    config : dict
        The recipe (see :data:`LEARNED_KEYS_CONFIG`).
    corpus_digest : str
        First 16 hex digits of the SHA-256 of the corpus bytes used.
    seconds : float
        Wall time of training and extraction.
    """

    key_sets: list
    origin: list
    head_dim: int
    sigma: float
    C: float
    train_bpb: tuple
    config: dict = field(default_factory=dict)
    corpus_digest: str = ""
    seconds: float = 0.0


def learned_key_sets(**overrides):
    """Train a tiny ``TinyLM(attn="sv_hybrid")`` on stdlib source and return its learned keys.

    Parameters
    ----------
    **overrides
        Entries of :data:`LEARNED_KEYS_CONFIG` to change (``steps``, ``seed``, ``context``, ...).

    Returns
    -------
    LearnedKeys

    Examples
    --------
    >>> keys = learned_key_sets(steps=2, contexts_per_head=1)  # doctest: +SKIP
    >>> keys.key_sets[0].shape[1] == keys.head_dim  # doctest: +SKIP
    True
    """
    unknown = set(overrides) - set(LEARNED_KEYS_CONFIG)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; choose from "
                         f"{sorted(LEARNED_KEYS_CONFIG)}")
    cfg = {**LEARNED_KEYS_CONFIG, **overrides}
    start = time.perf_counter()
    with _one_thread():
        data = stdlib_source_bytes(max_bytes=cfg["corpus_bytes"])
        splits = byte_splits(data)
        model, train_bpb = _train(cfg, splits.train)
        key_sets, origin = _extract(model, splits.val, cfg)
    layer = model.blocks[0].attn
    return LearnedKeys(key_sets=key_sets, origin=origin, head_dim=layer.head_dim,
                       sigma=layer.sigma, C=layer.C, train_bpb=train_bpb, config=cfg,
                       corpus_digest=corpus_digest(data),
                       seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _one_thread():
    """One OpenMP/BLAS thread (threadpoolctl, if installed) and one Numba thread; restored."""
    import numba

    numba_threads = numba.get_num_threads()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl ships with the verify extra
        limits = contextlib.nullcontext()
    else:
        limits = threadpool_limits(limits=1)
    numba.set_num_threads(1)
    try:
        with limits:
            yield
    finally:
        numba.set_num_threads(numba_threads)


def _train(cfg, train):
    torch.manual_seed(cfg["seed"])
    model = TinyLM(256, cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["block"],
                   attn="sv_hybrid", attn_options=cfg["attn_options"])
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg["weight_decay"]},
         {"params": vectors, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95))
    sampler = BatchSampler(train, batch_size=cfg["batch_size"], block=cfg["block"],
                           seed=cfg["seed"])
    steps = cfg["steps"]
    losses = []
    for step in range(steps):
        # cosine schedule to lr / 10
        lr = cfg["lr"] * (0.1 + 0.45 * (1.0 + math.cos(math.pi * step / max(1, steps))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sampler.sample()
        _, loss = model(torch.from_numpy(x), torch.from_numpy(y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item() / math.log(2.0))
    k = min(10, len(losses))
    return model.eval(), (float(np.mean(losses[:k])), float(np.mean(losses[-k:])))


@torch.no_grad()
def _extract(model, held_out, cfg):
    block, context = cfg["block"], cfg["context"]
    if context > block:
        raise ValueError(f"context ({context}) must be <= block ({block})")
    n_windows = min(cfg["contexts_per_head"], held_out.size // block)
    if n_windows < 1:
        raise ValueError("the held-out split is shorter than one block")
    idx = torch.from_numpy(held_out[: n_windows * block].astype(np.int64).reshape(n_windows,
                                                                                  block))
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(block))
    key_sets, origin = [], []
    for layer_number, blk in enumerate(model.blocks):
        attn = blk.attn
        keys = attn._heads(attn.k_proj(blk.ln_1(x)))  # (W, block, H, D)
        keys = F.rms_norm(keys, (attn.head_dim,)).to(torch.float64).numpy()
        for head in range(attn.n_heads):
            for window in range(n_windows):
                kept, _ = deduplicate(keys[window, :context, head], cfg["dedup"])
                key_sets.append(kept)
                origin.append((layer_number, head, window))
        x = blk(x)
    return key_sets, origin
