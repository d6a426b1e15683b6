"""One training loop for every model of the toolkit: AdamW, warm-up + cosine, clipping, seeds,
periodic evaluation, checkpoints that resume bit-identically.

The loop is deliberately small: per step it draws a batch, runs forward, cross-entropy with
``ignore_index = IGNORE_INDEX``, backward, gradient clipping, one AdamW step and one scheduler
step. Nothing in the step reads a value back from the device (losses are stored into a
preallocated device tensor and converted at evaluation time), so the loop adds little to the
model's own forward/backward cost (measured by ``benchmarks/trainer.py``).

Data comes as a *pure function of the step*: ``batch_at(step) -> (inputs, targets)``, two int64
tensors of shape (B, L) with ``IGNORE_INDEX`` where a position is not scored. Because the
batch of step s does not depend on anything but s, a resumed run draws exactly the batches the
uninterrupted run would have drawn. :class:`TokenBatches` is that function for a fixed
dataset (a fresh seeded permutation per epoch).

Any model whose forward maps ``inputs`` to logits of shape (B, L, V) (or to a tuple whose
first element is those logits, as :class:`svtoolkit.torch.TinyLM` does) plugs in, so every
layer of :data:`svtoolkit.torch.ATTENTION_LAYERS` trains through the same loop.

Examples
--------
>>> import torch
>>> from svtoolkit.torch import TinyLM
>>> from svtoolkit.torch.training import TrainConfig, seed_everything, train
>>> seed_everything(0)
>>> model = TinyLM(vocab=16, d_model=16, n_layers=1, n_heads=2, block=8)
>>> x = torch.randint(0, 16, (32, 8), generator=torch.Generator().manual_seed(0))
>>> result = train(model, (x, x.roll(-1, dims=1)), TrainConfig(steps=3, batch_size=8))
>>> len(result.losses), result.steps
(3, 3)
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_int, check_option, check_positive, check_real

__all__ = [
    "IGNORE_INDEX",
    "TokenBatches",
    "TrainConfig",
    "TrainResult",
    "adamw",
    "evaluate_tokens",
    "lr_factor",
    "resolve_device",
    "seed_everything",
    "token_evaluator",
    "token_loss",
    "train",
]

#: Target value of positions that are not scored (cross-entropy's ``ignore_index``).
IGNORE_INDEX = -100
#: What ``device`` may name ("auto": CUDA when available, else the CPU).
DEVICES = ("cpu", "cuda", "auto")

#: Config fields that change the trajectory: a checkpoint resumes only under equal values.
_TRAJECTORY_FIELDS = ("steps", "batch_size", "lr", "min_lr_ratio", "warmup_steps",
                      "weight_decay", "betas", "eps", "grad_clip", "seed")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters and bookkeeping of one training run.

    Attributes
    ----------
    steps : int, default 1000
        Optimiser steps.
    batch_size : int, default 16
        Sequences per step when :func:`train` is given ``(inputs, targets)`` tensors (a
        ``batch_at`` function decides its own batch size).
    lr : float, default 1e-3
        Peak learning rate (reached at the end of the warm-up).
    min_lr_ratio : float, default 0.1
        The cosine decays from ``lr`` to ``lr * min_lr_ratio`` at the last step.
    warmup_steps : int or None, default None
        Linear warm-up length; None means 5 % of ``steps`` (at least 1).
    weight_decay : float, default 0.1
        AdamW decoupled weight decay, applied to matrices and embeddings (parameters with
        ``ndim >= 2``) only, never to biases or LayerNorm gains.
    betas : tuple of float, default (0.9, 0.95)
        AdamW moment decay rates.
    eps : float, default 1e-8
        AdamW denominator epsilon.
    grad_clip : float, default 1.0
        Maximum global gradient 2-norm; 0 disables clipping.
    seed : int, default 0
        Seeds torch, NumPy's global generator and Python's ``random`` at the start of the run
        (:func:`seed_everything`) and the data order of :class:`TokenBatches`.
    eval_interval : int, default 0
        Evaluate every ``eval_interval`` steps (0: only at the end, if ``eval_at_end``).
    eval_at_end : bool, default True
        Also evaluate after the last step.
    metric : str, default "accuracy"
        Key of the evaluation dict that defines the best evaluation.
    mode : {"max", "min"}, default "max"
        Whether a larger or a smaller ``metric`` is better.
    device : {"cpu", "cuda", "auto"}, default "cpu"
        Where the model and the batches live; "auto" picks CUDA when it is available.
    checkpoint_path : str or None, default None
        File of the checkpoint (written atomically); None writes none.
    checkpoint_interval : int, default 0
        Write a checkpoint every this many steps (0: only after the last step, when
        ``checkpoint_path`` is set).
    sync_timing : bool, default False
        Synchronise CUDA after every step so that the recorded step times are true device
        times (on the CPU step times are always true times).
    """

    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    eval_interval: int = 0
    eval_at_end: bool = True
    metric: str = "accuracy"
    mode: str = "max"
    device: str = "cpu"
    checkpoint_path: str | None = None
    checkpoint_interval: int = 0
    sync_timing: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            check_int(getattr(self, name), name, min=1)
        for name in ("eval_interval", "checkpoint_interval", "seed"):
            check_int(getattr(self, name), name, min=0)
        if self.warmup_steps is not None:
            check_int(self.warmup_steps, "warmup_steps", min=1)
        for name in ("lr", "eps"):
            check_positive(getattr(self, name), name)
        for name in ("weight_decay", "grad_clip"):
            check_real(getattr(self, name), name, min=0.0)
        check_real(self.min_lr_ratio, "min_lr_ratio", min=0.0, max=1.0)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas!r}")
        object.__setattr__(self, "betas", betas)
        check_option(self.mode, "mode", ("max", "min"))
        check_option(self.device, "device", DEVICES)

    @property
    def warmup(self):
        """The warm-up length actually used (``warmup_steps`` or 5 % of ``steps``)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, self.steps // 20)


@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes
    ----------
    steps : int
        Steps completed (including those before a resume).
    losses : list of float
        Training loss of every step (by default the mean cross-entropy over the scored
        positions of the batch, nats; the ``loss`` given to :func:`train` otherwise); under
        DistributedDataParallel the mean over the ranks.
    lrs : list of float
        Learning rate used at every step.
    evals : list of dict
        One dict per evaluation: ``{"step": s, **metrics}``.
    best_metric, best_step : float or None, int or None
        Best ``config.metric`` over ``evals`` (per ``config.mode``) and its step.
    final_metrics : dict
        The metrics of the last evaluation (empty without one).
    step_time : dict
        ``median``, ``mean``, ``min``, ``max`` (seconds) and ``count`` of the steps run in this
        call (not those before a resume).
    step_times : list of float
        Every step's wall time in this call.
    wall_s : float
        Wall time of the call (evaluations and checkpoints included).
    device : str
    resumed_from : int or None
        Step of the checkpoint this run resumed from.
    config : dict
        The :class:`TrainConfig` as a dict.
    """

    steps: int
    losses: list
    lrs: list
    evals: list
    best_metric: float | None
    best_step: int | None
    final_metrics: dict
    step_time: dict
    step_times: list
    wall_s: float
    device: str
    resumed_from: int | None = None
    config: dict = field(default_factory=dict)

    def to_dict(self):
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ helpers
def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def seed_everything(seed):
    """Seed torch (CPU and every CUDA device), NumPy's global generator and ``random``.

    Parameters
    ----------
    seed : int
        A non-negative integer.
    """
    check_int(seed, "seed", min=0)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(device):
    """``torch.device`` for ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available).

    Raises
    ------
    ValueError
        For another name, or ``"cuda"`` on a machine without CUDA.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available")
        return torch.device("cuda")
    check_option(device, "device", DEVICES)
    return torch.device("cpu")


def lr_factor(step, steps, warmup, min_lr_ratio):
    """Learning-rate multiplier of step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup`` for ``step < warmup``, then a cosine from 1 down to
    ``min_lr_ratio``: ``r + (1 - r) (1 + cos(pi p)) / 2`` with progress
    ``p = (step - warmup) / (steps - warmup)`` clipped to [0, 1].
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


def adamw(model, config):
    """AdamW over ``model``'s trainable parameters, weight decay on ``ndim >= 2`` only.

    Parameters
    ----------
    model : nn.Module
    config : TrainConfig

    Returns
    -------
    torch.optim.AdamW
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                             betas=config.betas, eps=config.eps)


def _scheduler(optimizer, config):
    warmup, steps, ratio = config.warmup, config.steps, config.min_lr_ratio
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, warmup, ratio))


def _check_tokens(name, x):
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or x.ndim != 2:
        desc = (f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                else type(x).__name__)
        raise ValueError(f"{name} must be an int64 tensor of shape (N, L); got {desc}")


def _as_tokens(name, x):
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    _check_tokens(name, x)
    return x


class TokenBatches:
    """``batch_at(step)`` for a fixed token dataset: a new seeded permutation every epoch.

    Step s belongs to epoch ``e = s // (N // batch_size)``; epoch e visits the rows in the
    order ``np.random.default_rng([seed, e]).permutation(N)``, ``N // batch_size`` batches per
    epoch (the remainder of each permutation is not used). The batch of a step is therefore a
    pure function of ``(seed, step)``.

    Parameters
    ----------
    inputs, targets : int64 Tensor or ndarray of shape (N, L)
        Token ids and next-token targets (``IGNORE_INDEX`` where unscored).
    batch_size : int
        Rows per batch, ``1 <= batch_size <= N``.
    seed : int, default 0
    device : torch.device or str, optional
        Where the data is kept (moved once) and batches are returned.
    """

    def __init__(self, inputs, targets, *, batch_size, seed=0, device=None):
        inputs, targets = _as_tokens("inputs", inputs), _as_tokens("targets", targets)
        if inputs.shape != targets.shape:
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets "
                             f"{tuple(targets.shape)} must have the same shape")
        check_int(batch_size, "batch_size", min=1)
        if batch_size > inputs.shape[0]:
            raise ValueError(f"batch_size {batch_size} exceeds the {inputs.shape[0]} examples")
        check_int(seed, "seed", min=0)
        device = torch.device(device) if device is not None else inputs.device
        self.inputs, self.targets = inputs.to(device), targets.to(device)
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.per_epoch = inputs.shape[0] // self.batch_size
        self._epoch, self._order = None, None

    def __call__(self, step):
        epoch, index = divmod(int(step), self.per_epoch)
        if epoch != self._epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.inputs.shape[0])
            self._order = torch.from_numpy(perm).to(self.inputs.device)
            self._epoch = epoch
        rows = self._order[index * self.batch_size:(index + 1) * self.batch_size]
        return self.inputs[rows], self.targets[rows]


def _logits(model, inputs):
    out = model(inputs)
    return out[0] if isinstance(out, tuple) else out


def token_loss(logits, targets):
    """Mean cross-entropy over the scored positions (``targets != IGNORE_INDEX``), nats."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate_tokens(model, inputs, targets, *, batch_size=64):
    """Loss and accuracy of ``model`` over the scored positions of a token dataset.

    Parameters
    ----------
    model : nn.Module
        Maps int64 (B, L) to logits (B, L, V) (or a tuple starting with them).
    inputs, targets : int64 Tensor of shape (N, L)
    batch_size : int, default 64

    Returns
    -------
    dict
        ``loss`` (mean cross-entropy, nats), ``accuracy`` (fraction of scored positions whose
        arg-max logit is the target; recall@1 for a recall task) and ``scored`` (their count).
    """
    inputs, targets = _as_tokens("inputs", inputs), _as_tokens("targets", targets)
    if inputs.shape != targets.shape:
        raise ValueError("inputs and targets must have the same shape")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    scored = 0
    for start in range(0, inputs.shape[0], batch_size):
        x = inputs[start:start + batch_size].to(device)
        y = targets[start:start + batch_size].to(device)
        logits = _logits(model, x)
        mask = y != IGNORE_INDEX
        nll += F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        correct += ((logits.argmax(-1) == y) & mask).sum()
        scored += int(mask.sum())
    model.train(was_training)
    if scored == 0:
        raise ValueError("targets score no position (all are IGNORE_INDEX)")
    return {"loss": float(nll) / scored, "accuracy": int(correct) / scored, "scored": scored}


def token_evaluator(inputs, targets, *, batch_size=64):
    """``evaluate(model) -> dict`` for :func:`train`: :func:`evaluate_tokens` on fixed data."""
    inputs, targets = _as_tokens("inputs", inputs), _as_tokens("targets", targets)
    return lambda model: evaluate_tokens(model, inputs, targets, batch_size=batch_size)


# ------------------------------------------------------------------------------ checkpoints
def _rng_state():
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_checkpoint(path, payload):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def _plain(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _load_checkpoint(path, config):
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"resume: no checkpoint at {str(path)!r}")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    saved = ckpt["config"]
    differ = [f for f in _TRAJECTORY_FIELDS
              if _plain(saved.get(f)) != _plain(getattr(config, f))]
    if differ:
        raise ValueError(f"resume: the checkpoint was written with other {', '.join(differ)} "
                         f"({', '.join(f'{f}={saved[f]!r}' for f in differ)})")
    return ckpt


# ------------------------------------------------------------------------------ the loop
def _unwrap(model):
    """The module under a DistributedDataParallel/DataParallel wrapper (or the model)."""
    return model.module if isinstance(
        model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else model


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_better(value, best, mode):
    return best is None or (value > best if mode == "max" else value < best)


def _batch_source(data, config, device):
    if callable(data):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return TokenBatches(data[0], data[1], batch_size=config.batch_size,
                            seed=config.seed, device=device)
    raise TypeError("data must be a batch_at(step) function or an (inputs, targets) pair; "
                    f"got {type(data).__name__}")


def train(model, data, config=None, *, evaluate=None, resume=None, log=None, loss=None):
    """Train ``model`` with AdamW under the warm-up + cosine schedule.

    Parameters
    ----------
    model : nn.Module
        Maps int64 inputs (B, L) to logits (B, L, V) or ``(logits, ...)``; may be wrapped in
        ``DistributedDataParallel`` (the optimiser, clipping and checkpoints then use the
        wrapped module). It is moved to ``config.device``.
    data : callable or (inputs, targets)
        ``batch_at(step) -> (inputs, targets)`` (int64 tensors or arrays of shape (B, L), a
        pure function of the 0-based step), or a pair of int64 (N, L) tensors, served by
        :class:`TokenBatches` with ``config.batch_size`` and ``config.seed``.
    config : TrainConfig, optional
        Defaults to ``TrainConfig()``.
    evaluate : callable, optional
        ``evaluate(module) -> dict of float`` (e.g. :func:`token_evaluator`), run every
        ``config.eval_interval`` steps and after the last one (``config.eval_at_end``).
        Under DistributedDataParallel every rank calls it.
    resume : str or Path, optional
        Checkpoint to continue from (written by an earlier call with the same trajectory
        fields of ``config``); the run then continues exactly where it stopped - on the CPU
        bit-identically to an uninterrupted run.
    log : callable, optional
        Called with one line of text after every evaluation.
    loss : callable, optional
        ``loss(output, targets) -> scalar tensor`` in place of the token cross-entropy, with
        ``output`` the model's first output; batches are then moved to the device as they are
        (any dtype and shapes), e.g. continuous tokens and a mean-squared error. Everything
        else - schedule, clipping, seeds, evaluation, checkpoints - is the same loop.

    Returns
    -------
    TrainResult

    Raises
    ------
    ValueError
        For an unknown ``config.metric`` in the evaluation dict, a missing checkpoint or one
        written under another configuration, bad batches, a non-finite loss.
    TypeError
        For a ``data`` that is neither a function nor a pair.
    """
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig; got {type(config).__name__}")
    device = resolve_device(config.device)
    module = _unwrap(model)
    module.to(device)
    batch_at = _batch_source(data, config, device)
    optimizer = adamw(module, config)
    scheduler = _scheduler(optimizer, config)
    losses, evals, start_step, resumed_from = [], [], 0, None
    if resume is not None:
        ckpt = _load_checkpoint(resume, config)
        module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        _set_rng_state(ckpt["rng"])
        losses, evals = list(ckpt["losses"]), list(ckpt["evals"])
        start_step = resumed_from = int(ckpt["step"])
    else:
        seed_everything(config.seed)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    state = _LoopState(config, losses, evals)

    def checkpoint(step):
        if not config.checkpoint_path:
            return
        losses = state.all_losses(step)  # a collective under DDP: every rank takes part
        if rank0:
            _save_checkpoint(config.checkpoint_path, {
                "model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "rng": _rng_state(),
                "losses": losses, "evals": list(state.evals),
                "config": dataclasses.asdict(config)})

    params = [p for p in module.parameters() if p.requires_grad]
    sync = config.sync_timing and device.type == "cuda"
    begin = time.perf_counter()
    model.train()
    for step in range(start_step, config.steps):
        t0 = time.perf_counter()
        x, y = batch_at(step)
        if loss is None:
            x, y = _to_device(x, y, device)
            value = token_loss(_logits(model, x), y)
        else:
            x, y = torch.as_tensor(x).to(device), torch.as_tensor(y).to(device)
            value = loss(_logits(model, x), y)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip, foreach=True)
        optimizer.step()
        scheduler.step()
        state.record(step, value.detach())
        if sync:
            torch.cuda.synchronize(device)
        state.step_times.append(time.perf_counter() - t0)
        done = step + 1
        if evaluate is not None and _eval_due(done, config):
            state.evaluate(evaluate, module, done, log, begin)
        if config.checkpoint_interval and done % config.checkpoint_interval == 0 and (
                done < config.steps):
            checkpoint(done)
    checkpoint(config.steps)
    return state.result(device, resumed_from, time.perf_counter() - begin)


def _eval_due(done, config):
    if done == config.steps:
        return config.eval_at_end
    return config.eval_interval > 0 and done % config.eval_interval == 0


def _to_device(x, y, device):
    x, y = _as_tokens("inputs", x), _as_tokens("targets", y)
    if x.shape != y.shape:
        raise ValueError(f"a batch's inputs {tuple(x.shape)} and targets {tuple(y.shape)} "
                         "must have the same shape")
    if x.device != device:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


class _LoopState:
    """Losses (kept on the device until needed), evaluations and step times of one run."""

    def __init__(self, config, losses, evals):
        self.config = config
        self.previous = losses  # floats of the steps before a resume
        self.start = len(losses)
        self.buffer = None
        self.evals = evals
        self.step_times = []
        self.best, self.best_step = None, None
        for record in evals:
            self._update_best(record)

    def record(self, step, loss):
        if self.buffer is None:
            self.buffer = torch.empty(self.config.steps - self.start, dtype=loss.dtype,
                                      device=loss.device)
        self.buffer[step - self.start] = loss

    def all_losses(self, done):
        """Python floats of the losses of steps [0, done), averaged over the ranks."""
        if self.buffer is None:
            return list(self.previous)
        new = self.buffer[:done - self.start].detach().double()
        if _world_size() > 1:
            new = new.clone()
            torch.distributed.all_reduce(new)
            new /= _world_size()
        values = new.cpu().tolist()
        bad = [i + self.start for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise ValueError(f"the training loss is not finite from step {bad[0]} on")
        return self.previous + values

    def _update_best(self, record):
        if self.config.metric not in record:
            raise ValueError(f"config.metric {self.config.metric!r} is not among the "
                             f"evaluation's keys {sorted(k for k in record if k != 'step')}")
        value = record[self.config.metric]
        if _is_better(value, self.best, self.config.mode):
            self.best, self.best_step = value, record["step"]

    def evaluate(self, evaluate, module, done, log, begin):
        metrics = evaluate(module)
        if not isinstance(metrics, Mapping):
            raise TypeError(f"evaluate must return a dict; got {type(metrics).__name__}")
        record = {"step": done, **{k: float(v) for k, v in metrics.items()}}
        self._update_best(record)
        self.evals.append(record)
        if log is not None:
            loss = float(self.buffer[done - 1 - self.start])
            shown = "  ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step")
            log(f"step {done:6d}  train loss {loss:.4f}  {shown}  "
                f"{time.perf_counter() - begin:7.1f}s")

    def result(self, device, resumed_from, wall):
        config = self.config
        losses = self.all_losses(config.steps)
        times = self.step_times
        stats = ({"median": statistics.median(times), "mean": statistics.fmean(times),
                  "min": min(times), "max": max(times), "count": len(times)}
                 if times else {"median": None, "mean": None, "min": None, "max": None,
                                "count": 0})
        lrs = [config.lr * lr_factor(s, config.steps, config.warmup, config.min_lr_ratio)
               for s in range(config.steps)]
        return TrainResult(
            steps=config.steps, losses=losses, lrs=lrs, evals=list(self.evals),
            best_metric=self.best, best_step=self.best_step,
            final_metrics={k: v for k, v in self.evals[-1].items() if k != "step"}
            if self.evals else {},
            step_time=stats, step_times=list(times), wall_s=wall, device=str(device),
            resumed_from=resumed_from, config=dataclasses.asdict(config))
