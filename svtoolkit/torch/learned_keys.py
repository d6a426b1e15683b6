"""Learned keys: the key projections of small trained SV-Attention models.

The fourth forgetting regime of Forgetful Attention (arXiv:2607.12204, §4, App. C, "a
trained recall model's learned key projections") solves the gate on keys a trained model
actually produces, not on synthetic draws. Two sources, both deterministic and quick:

* :func:`recall_key_sets` - the paper's source: a trained multi-query associative-recall
  model (:class:`RecallModel`, trained by :func:`train_recall_model` on the continuous MQAR of
  :func:`svtoolkit.tasks.mqar_vectors` through :func:`svtoolkit.torch.training.train`); the
  keys are its ``W_k`` projections of held-out fact tokens. The same model is the subject of
  ``examples/trained_recall_memory.py`` (forgetting, editing and eviction on it).
* :func:`learned_key_sets` - a language model's keys: it trains a tiny
  :class:`svtoolkit.torch.TinyLM` with the hybrid SV layer (``attn="sv_hybrid"``) on the Python
  standard library's own source (zero install, :mod:`svtoolkit.corpora`) for a fixed number of
  steps, then runs held-out bytes (the validation split) through it and collects, per layer and
  head, the keys the gate sees - ``W_k`` projections of the block's normalised input, RMS-
  normalised per head (``||k|| = sqrt(D)``) with the layer's default ``qk_norm="rms"``, raw with
  ``qk_norm="none"`` in the recipe's ``attn_options`` - in float64, cut into
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
import copy
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..corpora import BatchSampler, byte_splits, corpus_digest, stdlib_source_bytes
from ..data import deduplicate
from .layers.sv import CausalSVAttention
from .model import TinyLM

__all__ = [
    "LearnedKeys",
    "learned_key_sets",
    "LEARNED_KEYS_CONFIG",
    "RECALL_MODEL_CONFIG",
    "RecallModel",
    "TrainedRecallModel",
    "train_recall_model",
    "recall_key_sets",
]

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
        _, keys, _ = attn._qkv(blk.ln_1(x))  # (W, block, H, D), normalised as the layer does
        keys = keys.to(torch.float64).numpy()
        for head in range(attn.n_heads):
            for window in range(n_windows):
                kept, _ = deduplicate(keys[window, :context, head], cfg["dedup"])
                key_sets.append(kept)
                origin.append((layer_number, head, window))
        # the block's forward written out (eval mode: no dropout), independent of the
        # backbone's streaming options
        x = x + attn(blk.ln_1(x))
        x = x + blk.mlp(blk.ln_2(x))
    return key_sets, origin


# --------------------------------------------------------------------------------------------
# a trained multi-query associative-recall model (the paper's source of learned keys)
# --------------------------------------------------------------------------------------------

#: The recall model's recipe (about 10 s on one thread). Forgetful Attention's recall model
#: (§6, Fig. 4) has one head, d_model 32, 8 facts of 8-dimensional keys and values, C = 0.2,
#: kernel width 2 and 500 steps of batch 16 at lr 3e-3 in its public reference code; the
#: toolkit's layer RMS-normalises keys and queries, so the width 2 acts on keys of norm
#: ``sqrt(D)`` here (the choice of this recipe, not a published value).
RECALL_MODEL_CONFIG = dict(
    n_facts=8, n_queries=4, d_key=8, d_value=8, key_noise=0.02,
    d_model=32, n_heads=1, C=0.2, sigma=2.0, fista_iters=80,
    steps=500, batch_size=16, lr=3e-3, weight_decay=0.1, seed=0,
    n_heldout=200,
    context=40,  # fact tokens per key set of recall_key_sets
    contexts=24,
    dedup=0.1,
)


class RecallModel(nn.Module):
    """Linear embedding -> :class:`CausalSVAttention` -> linear value head.

    Each token is one continuous vector ``[key; value]`` (a fact) or ``[query; 0]``; the SV
    chunk is the number of facts, so the queries (after the facts) read one gate fit on all
    the facts.

    Parameters
    ----------
    d_in, d_value : int
        Token width ``d_key + d_value`` and output width.
    d_model, n_heads : int
    n_facts : int
        Facts per context in training (the SV chunk).
    C, sigma : float
        Box and RBF width of the gate.
    fista_iters : int
    """

    def __init__(self, d_in, d_value, d_model, n_heads, *, n_facts, C, sigma, fista_iters=80):
        super().__init__()
        self.embed = nn.Linear(d_in, d_model)
        self.attn = CausalSVAttention(d_model, n_heads, C=C, sigma=sigma, chunk=n_facts,
                                      fista_iters=fista_iters)
        self.head = nn.Linear(d_model, d_value)

    def forward(self, x, exact=False):
        """x (B, T, d_in) -> (B, T, d_value); ``exact=True`` runs the fp64 exact gate."""
        h = self.embed(x)
        y = self.attn.forward_exact(h) if exact else self.attn(h)
        return self.head(y)

    def _float64(self):
        """The model in float64: itself if it already is, else a copy (float32 weights are
        float64 values exactly, so the copy computes the same function more precisely)."""
        if self.embed.weight.dtype == torch.float64:
            return self
        return copy.deepcopy(self).double()

    @torch.no_grad()
    def project(self, x):
        """Learned projections of tokens x (N, d_in): q, k, v, each (N, H, D), float64.

        ``q`` and ``k`` are RMS-normalised per head as the layer's gate and readout see them.
        """
        model = self._float64()
        h = model.embed(torch.as_tensor(np.asarray(x), dtype=torch.float64))
        q, k, v = model.attn._qkv(h[None])
        return q[0].numpy(), k[0].numpy(), v[0].numpy()

    @torch.no_grad()
    def decode(self, readout):
        """Readouts (m, H, Dv) of the attention -> the model's value vectors (m, d_value)."""
        model = self._float64()
        r = torch.as_tensor(np.asarray(readout), dtype=torch.float64)
        return model.head(model.attn.o_proj(r.flatten(-2))).numpy()


@dataclass
class TrainedRecallModel:
    """A trained :class:`RecallModel` and how it was made.

    Attributes
    ----------
    model : RecallModel
        In eval mode, float32.
    recall_at_1 : float
        Held-out recall@1 (nearest value) on the batched gate it trained with.
    recall_at_1_exact : float
        The same on the exact fp64 gate (``forward_exact``).
    train_loss : tuple of float
        Mean query MSE over the first and the last 10 steps.
    config : dict
    seconds : float
    """

    model: RecallModel
    recall_at_1: float
    recall_at_1_exact: float
    train_loss: tuple
    config: dict = field(default_factory=dict)
    seconds: float = 0.0


def _recall_config(overrides):
    unknown = set(overrides) - set(RECALL_MODEL_CONFIG)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; choose from "
                         f"{sorted(RECALL_MODEL_CONFIG)}")
    return {**RECALL_MODEL_CONFIG, **overrides}


def _recall_task(cfg, n_examples, seed, n_facts=None):
    from ..tasks import mqar_vectors

    return mqar_vectors(n_examples, n_pairs=cfg["n_facts"] if n_facts is None else n_facts,
                        n_queries=cfg["n_queries"], d_key=cfg["d_key"], d_value=cfg["d_value"],
                        key_noise=cfg["key_noise"], seed=seed)


def train_recall_model(*, device="cpu", **overrides):
    """Train a :class:`RecallModel` on continuous MQAR with the toolkit's trainer.

    Loss: mean-squared error of the query outputs against the bound values (through
    :func:`svtoolkit.torch.training.train`'s ``loss=``: AdamW 0.9/0.95, clip 1.0, 5 % warm-up,
    cosine to lr / 10); one fresh instance per example (seed ``seed``), scored on
    ``n_heldout`` instances of :func:`svtoolkit.tasks.heldout_seed` ``(seed)``. Runs on one
    thread (see the module notes), so a machine and set of versions reproduces it bit for bit.

    Parameters
    ----------
    device : {"cpu", "cuda", "auto"}, default "cpu"
        Where it trains (:func:`svtoolkit.torch.training.resolve_device`); the exact-gate
        score runs on the CPU, and the returned model is on the CPU.
    **overrides
        Entries of :data:`RECALL_MODEL_CONFIG` to change.

    Returns
    -------
    TrainedRecallModel
    """
    from ..tasks import heldout_seed, nearest_value_accuracy
    from .training import TrainConfig, resolve_device, seed_everything, train

    cfg = _recall_config(overrides)
    device = resolve_device(device)
    start = time.perf_counter()
    with _one_thread():
        task = _recall_task(cfg, cfg["steps"] * cfg["batch_size"], cfg["seed"])
        heldout = _recall_task(cfg, cfg["n_heldout"], heldout_seed(cfg["seed"]))
        seed_everything(cfg["seed"])
        model = RecallModel(task.inputs.shape[-1], cfg["d_value"], cfg["d_model"],
                            cfg["n_heads"], n_facts=cfg["n_facts"], C=cfg["C"],
                            sigma=cfg["sigma"], fista_iters=cfg["fista_iters"]).to(device)
        inputs = torch.from_numpy(task.inputs).float()
        targets = torch.from_numpy(task.targets).float()
        qpos = torch.from_numpy(task.query_positions).to(device)

        def batch_at(step):
            rows = slice(step * cfg["batch_size"], (step + 1) * cfg["batch_size"])
            return inputs[rows], targets[rows]

        def query_mse(output, target):
            return F.mse_loss(output[:, qpos], target)

        config = TrainConfig(steps=cfg["steps"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                             weight_decay=cfg["weight_decay"], seed=cfg["seed"],
                             warmup_steps=max(1, cfg["steps"] // 20), device=device.type)
        result = train(model, batch_at, config, loss=query_mse)
        model = model.cpu().eval()
        qpos = qpos.cpu()
        with torch.no_grad():
            x = torch.from_numpy(heldout.inputs).float()
            scores = [nearest_value_accuracy(
                heldout, model(x, exact=exact)[:, qpos].double().numpy())
                for exact in (False, True)]
    k = min(10, len(result.losses))
    losses = (float(np.mean(result.losses[:k])), float(np.mean(result.losses[-k:])))
    return TrainedRecallModel(model=model, recall_at_1=scores[0], recall_at_1_exact=scores[1],
                              train_loss=losses, config=cfg,
                              seconds=time.perf_counter() - start)


def recall_key_sets(trained=None, **overrides):
    """Key sets of a trained recall model: its ``W_k`` projections of held-out fact tokens.

    Parameters
    ----------
    trained : TrainedRecallModel, optional
        The model to read (default: :func:`train_recall_model` ``(**overrides)``).
    **overrides
        Entries of :data:`RECALL_MODEL_CONFIG` (``context``, ``contexts``, ``dedup`` shape the
        key sets).

    Returns
    -------
    LearnedKeys
        ``contexts * n_heads`` key sets, each the keys the gate sees (RMS-normalised, float64)
        of ``context`` fact tokens of one held-out instance, deduplicated within ``dedup``;
        ``origin`` is ``(0, head, instance)``; ``train_bpb`` holds the training MSE (first and
        last 10 steps) in place of bits per byte.
    """
    from ..tasks import heldout_seed

    cfg = _recall_config(overrides)
    start = time.perf_counter()
    if trained is None:
        trained = train_recall_model(**overrides)
    task = _recall_task(cfg, cfg["contexts"], heldout_seed(cfg["seed"]) + 1,
                        n_facts=cfg["context"])
    model = trained.model
    key_sets, origin = [], []
    for instance in range(cfg["contexts"]):
        facts = task.inputs[instance, :cfg["context"]]
        _, keys, _ = model.project(facts)
        for head in range(keys.shape[1]):
            kept, _ = deduplicate(keys[:, head], cfg["dedup"])
            key_sets.append(kept)
            origin.append((0, head, instance))
    layer = model.attn
    return LearnedKeys(key_sets=key_sets, origin=origin, head_dim=layer.head_dim,
                       sigma=layer.sigma, C=layer.C, train_bpb=trained.train_loss, config=cfg,
                       corpus_digest="", seconds=time.perf_counter() - start + trained.seconds)
