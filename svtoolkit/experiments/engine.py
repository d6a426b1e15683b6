"""One cell of a synthetic study: one (method, setting, seed, learning rate) run under the
fair protocol, in a deterministic single-threaded environment. Imports torch.

A cell is a JSON dict (its canonical text is its key in the cells file, so every field here
- task, model, layer options, protocol - is part of the key)::

    {"study": "vector" | "token", "task": {"generator": name, **task parameters},
     "model": {...}, "method": key of METHODS, "layer": name, "options": {...},
     "protocol": Protocol.to_dict(), "lr": float, "seed": int, "device": "cpu" | "cuda"}

:func:`run_cell` trains it and returns the learning curve, the best validation metric and the
test scores of the best-validation checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time

import numpy as np
import torch
from torch import nn

from .protocol import TRAIN_CHUNK_STEPS, Protocol, plateau_reached, split_seed, train_chunk_seed

__all__ = ["VectorRecallModel", "pinned_threads", "probe_step_time", "run_cell"]


@contextlib.contextmanager
def pinned_threads():
    """One thread in every native pool for the duration of the block.

    threadpoolctl limits OpenMP (the pool torch's CPU kernels use) and every BLAS to one
    thread; torch is then checked (and set) to one intra-op thread; Numba's parallel kernels
    (the batched gate's FISTA) to one thread. The previous counts are restored on exit.
    """
    import numba
    from threadpoolctl import threadpool_limits

    numba_before = numba.get_num_threads()
    with threadpool_limits(limits=1):
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # one thread never meets the multi-thread solve defect
        numba.set_num_threads(1)
        try:
            yield
        finally:
            numba.set_num_threads(numba_before)


def _seed_all(seed):
    from svtoolkit.torch.training import seed_everything

    seed_everything(seed)


# ------------------------------------------------------------------------------ tasks
def make_task(task, n, seed):
    """Instances of the cell's task: ``svtoolkit.tasks.<generator>(n, seed=seed, **params)``."""
    import svtoolkit.tasks as tasks

    params = {k: v for k, v in task.items() if k != "generator"}
    return getattr(tasks, task["generator"])(n, seed=seed, **params)


class VectorRecallModel(nn.Module):
    """Linear token embedding -> one attention layer -> linear value head.

    Parameters
    ----------
    d_in, d_value : int
        Token width ``d_key + d_value`` and output width.
    d_model, n_heads : int
    layer : str
        Name in :data:`svtoolkit.torch.ATTENTION_LAYERS`.
    options : dict
        The layer's options.

    Notes
    -----
    ``forward(x)`` maps float (B, T, d_in) to (B, T, d_value); ``exact=True`` runs the SV
    layers' exact fp64 gate (``forward_exact``).
    """

    def __init__(self, d_in, d_value, d_model, n_heads, layer, options):
        super().__init__()
        from svtoolkit.torch import ATTENTION_LAYERS

        self.embed = nn.Linear(d_in, d_model)
        self.attn = ATTENTION_LAYERS[layer](d_model, n_heads, **options)
        self.head = nn.Linear(d_model, d_value)

    def forward(self, x, exact=False):
        h = self.embed(x)
        return self.head(self.attn.forward_exact(h) if exact else self.attn(h))


class _Vector:
    """The continuous-token studies: MSE on the query outputs, recall@1 by nearest value."""

    @staticmethod
    def build(task, model, layer, options):
        return VectorRecallModel(task.inputs.shape[-1], task.targets.shape[-1],
                                 model["d_model"], model["n_heads"], layer, options)

    @staticmethod
    def tensors(task):
        return (torch.from_numpy(task.inputs).float(), torch.from_numpy(task.targets).float(),
                torch.from_numpy(task.query_positions))

    @staticmethod
    def loss(model, data, rows, device, autocast):
        x, y, qpos = data
        with autocast():
            out = model(x[rows].to(device))
        return nn.functional.mse_loss(out[:, qpos.to(device)].float(), y[rows].to(device))

    @staticmethod
    def outputs(model, task, device, autocast, exact=False, batch=100):
        qpos = torch.from_numpy(task.query_positions)
        outs = []
        with torch.no_grad():
            for start in range(0, task.inputs.shape[0], batch):
                x = torch.from_numpy(task.inputs[start:start + batch]).float().to(device)
                with (contextlib.nullcontext() if exact else autocast()):
                    out = model(x, exact=exact)
                outs.append(out[:, qpos].double().cpu().numpy())
        return np.concatenate(outs)

    @classmethod
    def metric(cls, model, task, device, autocast):
        from svtoolkit.tasks import nearest_value_accuracy

        return nearest_value_accuracy(task, cls.outputs(model, task, device, autocast))

    @classmethod
    def score(cls, model, task, layer, device, autocast):
        from svtoolkit.tasks import nearest_value_accuracy

        out = cls.outputs(model, task, device, autocast)
        scores = {"recall_at_1": nearest_value_accuracy(task, out),
                  "mse": float(np.mean((out - task.targets) ** 2))}
        if layer in ("sv", "sv_hybrid"):
            scores["recall_at_1_exact"] = nearest_value_accuracy(
                task, cls.outputs(model, task, device, autocast, exact=True))
            support, informative = _support_sizes(model, task, device)
            scores.update(support_mean=float(support.mean()),
                          support_informative_mean=float(informative.mean()),
                          context_len=int(task.query_positions[0]))
        return scores


def _support_sizes(model, task, device, batch=100):
    """Per instance and head: keys with alpha > 0 of the exact fp64 gate of boundary 0 (the
    queries sit in the chunk after the context), and how many of those are informative
    (nonzero value part); an ungated head reads every key."""
    n_ctx = int(task.query_positions[0])
    informative_tok = np.abs(task.values[:, :n_ctx]).sum(-1) > 0
    sizes, info = [], []
    with torch.no_grad():
        for start in range(0, task.inputs.shape[0], batch):
            x = torch.from_numpy(task.inputs[start:start + batch]).float().to(device)
            gate = model.attn.gate(model.embed(x), exact=True)
            alpha = gate.alpha[:, :, 0, :n_ctx].cpu().numpy()
            held = np.where(gate.gated[:, :, 0].cpu().numpy()[..., None], alpha > 0, True)
            sizes.append(held.sum(-1))
            info.append((held & informative_tok[start:start + batch, None, :]).sum(-1))
    return np.concatenate(sizes), np.concatenate(info)


class _Token:
    """The token studies (Zoology MQAR): cross-entropy at the scored positions, recall@1 by
    arg-max."""

    @staticmethod
    def build(task, model, layer, options):
        from svtoolkit.torch import TinyLM

        return TinyLM(task.vocab_size, model["d_model"], model["n_layers"], model["n_heads"],
                      task.inputs.shape[1], attn=layer, attn_options=options)

    @staticmethod
    def tensors(task):
        return torch.from_numpy(task.inputs), torch.from_numpy(task.targets)

    @staticmethod
    def loss(model, data, rows, device, autocast):
        from svtoolkit.torch.training import token_loss

        x, y = data
        with autocast():
            out = model(x[rows].to(device))
        logits = out[0] if isinstance(out, tuple) else out
        return token_loss(logits.float(), y[rows].to(device))

    @staticmethod
    def metric(model, task, device, autocast):
        from svtoolkit.torch.training import evaluate_tokens

        with autocast():
            return evaluate_tokens(model, torch.from_numpy(task.inputs),
                                   torch.from_numpy(task.targets))["accuracy"]

    @staticmethod
    def score(model, task, layer, device, autocast):
        from svtoolkit.torch.training import evaluate_tokens

        with autocast():
            s = evaluate_tokens(model, torch.from_numpy(task.inputs),
                                torch.from_numpy(task.targets))
        return {"recall_at_1": s["accuracy"], "loss": s["loss"]}


STUDIES = {"vector": _Vector, "token": _Token}


# ------------------------------------------------------------------------------ the cell
def _autocast_for(device, layer):
    """bf16 autocast on CUDA for the layers where it is safe; the SV layers (ridged solve,
    FISTA) and every CPU run stay in full precision."""
    if device.type == "cuda" and layer not in ("sv", "sv_hybrid"):
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def run_cell(cell):
    """Train one (method, setting, seed, lr) cell under the protocol and score it.

    Returns
    -------
    dict
        ``curve`` (one record per evaluation: ``step``, ``train_loss`` - the mean over the
        steps since the previous evaluation - and ``val``), ``best_val``, ``best_step``,
        ``stopped_at``, ``stop_reason`` ("plateau", "cap" or "diverged"), ``test`` (scores of
        the best-validation checkpoint on the test split), ``chance``, ``params``,
        ``step_time_median_s``, ``train_s``, ``threads`` (the pools' counts inside the cell).
    """
    from svtoolkit.torch.training import TrainConfig, adamw, resolve_device

    from .record import thread_state

    protocol = Protocol(**cell["protocol"])
    seed, lr, layer = int(cell["seed"]), float(cell["lr"]), cell["layer"]
    study = STUDIES[cell["study"]]
    device = resolve_device(cell["device"])
    autocast = _autocast_for(device, layer)
    begin = time.perf_counter()
    with pinned_threads():
        threads = thread_state()
        validation = make_task(cell["task"], protocol.n_validation,
                               split_seed(seed, "validation"))
        test = make_task(cell["task"], protocol.n_test, split_seed(seed, "test"))
        _seed_all(seed)
        model = study.build(validation, cell["model"], layer, cell["options"]).to(device)
        config = TrainConfig(steps=protocol.max_steps, batch_size=protocol.batch_size, lr=lr,
                             weight_decay=protocol.weight_decay, betas=protocol.betas,
                             grad_clip=protocol.grad_clip)
        optimizer = adamw(model, config)
        warmup = protocol.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup))
        params = [p for p in model.parameters() if p.requires_grad]
        min_evals = math.ceil(protocol.min_steps / protocol.eval_interval)
        curve, losses, step_times = [], [], []
        best_val, best_step, best_state = -math.inf, 0, copy.deepcopy(model.state_dict())
        stop_reason, data, chunk = "cap", None, -1
        _seed_all(seed)
        model.train()
        step = 0
        for step in range(1, protocol.max_steps + 1):
            t0 = time.perf_counter()
            c, r = divmod(step - 1, TRAIN_CHUNK_STEPS)
            if c != chunk:
                chunk = c
                data = study.tensors(make_task(cell["task"],
                                               TRAIN_CHUNK_STEPS * protocol.batch_size,
                                               train_chunk_seed(seed, c)))
            rows = slice(r * protocol.batch_size, (r + 1) * protocol.batch_size)
            loss = study.loss(model, data, rows, device, autocast)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if protocol.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, protocol.grad_clip, foreach=True)
            optimizer.step()
            scheduler.step()
            value = float(loss.detach())
            step_times.append(time.perf_counter() - t0)
            if not math.isfinite(value):
                stop_reason = "diverged"
                break
            losses.append(value)
            if step % protocol.eval_interval == 0 or step == protocol.max_steps:
                model.eval()
                val = float(study.metric(model, validation, device, autocast))
                model.train()
                curve.append({"step": step, "train_loss": statistics.fmean(losses),
                              "val": val})
                losses = []
                if val > best_val:
                    best_val, best_step = val, step
                    best_state = copy.deepcopy(model.state_dict())
                if plateau_reached([p["val"] for p in curve], fraction=protocol.plateau_fraction,
                                   rel=protocol.plateau_rel, min_evals=min_evals):
                    stop_reason = "plateau"
                    break
        train_s = time.perf_counter() - begin
        model.load_state_dict(best_state)
        model.eval()
        scores = study.score(model, test, layer, device, autocast)
    return {"curve": curve, "best_val": best_val if curve else None, "best_step": best_step,
            "stopped_at": step, "stop_reason": stop_reason, "test": scores,
            "chance": test.chance, "params": sum(p.numel() for p in model.parameters()),
            "step_time_median_s": statistics.median(step_times), "train_s": train_s,
            "threads": threads, "device": str(device)}


def probe_step_time(cell, steps=3):
    """Median seconds of one training step of ``cell`` (``steps + 1`` steps of a shortened
    copy of it, validation and test on one batch each)."""
    p = dict(cell["protocol"])
    n = steps + 1
    p.update(max_steps=n, eval_interval=n, min_steps=0, warmup_steps=1,
             n_validation=p["batch_size"], n_test=p["batch_size"])
    return run_cell({**cell, "protocol": p})["step_time_median_s"]
