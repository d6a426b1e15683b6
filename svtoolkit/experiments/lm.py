"""Language-model cells under the fair protocol (imports torch).

The language-model studies - Tensor Cache recall (Tensor Cache, Tables 1, 4, 5, 6, 9), the
matched-state comparison (Forgetful Attention (arXiv:2607.12204), §8) and the long-context
streaming evaluation (Tensor Cache, Table 2(b)) - train a :class:`svtoolkit.torch.TinyLM`
per (method, setting, seed, learning rate) cell under the :class:`~.protocol.Protocol` of the
synthetic studies (:func:`train_under_protocol`): AdamW with a linear warm-up then a constant
learning rate, the VALIDATION loss every ``eval_interval`` steps, the plateau rule on it, the
best-validation state kept; the learning rate is chosen afterwards on validation
(:mod:`~.lm_summary`) and the reported numbers are that learning rate's best-validation
checkpoint on the TEST split. The validation metric of every language-model study is a loss
(lower is better: the answer NLL, bits per byte); the plateau rule and the lr choice read its
negation.

Three kinds of cell:

* ``"lm_recall"`` (:func:`run_recall_cell`): :func:`svtoolkit.tasks.tensor_cache_recall`
  episodes; training instances in chunks seeded by :func:`~.protocol.train_chunk_seed`,
  validation and test instances from :func:`~.protocol.split_seed`;
* ``"lm_bytes"`` (:func:`run_bytes_cell`): a byte corpus of :mod:`svtoolkit.corpora`; training
  windows drawn by ``np.random.default_rng([seed, step])`` (the same data order for every
  method of a seed), validation on the first ``n_validation`` windows of ``block`` bytes of the
  validation split, test on the first ``n_test`` windows of the test split;
* ``"lm_stream"`` (:func:`run_stream_cell`): a trained ``lm_bytes`` cell's saved
  best-validation model streamed over the validation bytes far past its block (Tensor Cache,
  Table 2(b)).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from .engine import pinned_threads
from .protocol import TRAIN_CHUNK_STEPS, Protocol, plateau_reached, split_seed, train_chunk_seed

__all__ = ["PeakMemory", "build_lm", "filler_evals", "load_byte_splits",
           "measure_sv_state", "probe_step_time", "recall_sequence_length", "run_bytes_cell",
           "run_cell", "run_recall_cell", "run_stream_cell", "stream_records", "stream_start",
           "streaming_state_bytes", "train_under_protocol", "weights_path"]


# ------------------------------------------------------------------------------ training
def train_under_protocol(model, batch_at, validate, protocol, lr, *, seed, device):
    """Train ``model`` under ``protocol`` at learning rate ``lr``; keep the best-validation
    state.

    Parameters
    ----------
    model : TinyLM
        On ``device``; left holding the best-validation weights.
    batch_at : callable
        ``batch_at(step) -> (x, y)``, int64 tensors of shape (batch_size, L) for step
        ``1 .. max_steps`` (targets ``IGNORE_INDEX`` where not scored).
    validate : callable
        ``validate(model) -> float``, the validation loss (lower is better).
    protocol : Protocol
    lr : float
    seed : int
    device : torch.device

    Returns
    -------
    dict
        ``curve`` (per evaluation: ``step``, ``train_loss`` - the mean since the previous
        evaluation - and ``val_loss``), ``best_val_loss`` (None if no evaluation ran),
        ``best_step``, ``stopped_at``, ``stop_reason`` ("plateau", "cap" or "diverged"),
        ``step_time_median_s``, ``train_s``.
    """
    from svtoolkit.torch.training import TrainConfig, adamw, seed_everything, token_loss

    config = TrainConfig(steps=protocol.max_steps, batch_size=protocol.batch_size, lr=lr,
                         weight_decay=protocol.weight_decay, betas=protocol.betas,
                         grad_clip=protocol.grad_clip)
    optimizer = adamw(model, config)
    warmup = protocol.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: min(1.0, (s + 1) / warmup))
    params = [p for p in model.parameters() if p.requires_grad]
    min_evals = math.ceil(protocol.min_steps / protocol.eval_interval)
    curve, losses, step_times = [], [], []
    best, best_step, best_state = math.inf, 0, copy.deepcopy(model.state_dict())
    stop_reason, step = "cap", 0
    begin = time.perf_counter()
    seed_everything(seed)
    model.train()
    for step in range(1, protocol.max_steps + 1):
        t0 = time.perf_counter()
        x, y = batch_at(step)
        out = model(x.to(device))
        logits = out[0] if isinstance(out, tuple) else out
        loss = token_loss(logits.float(), y.to(device))
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
            val = float(validate(model))
            model.train()
            curve.append({"step": step, "train_loss": statistics.fmean(losses),
                          "val_loss": val})
            losses = []
            if val < best:
                best, best_step = val, step
                best_state = copy.deepcopy(model.state_dict())
            # the rule reads "higher is better": the negated loss (NaN counts as no progress)
            if plateau_reached([-p["val_loss"] for p in curve],
                               fraction=protocol.plateau_fraction, rel=protocol.plateau_rel,
                               min_evals=min_evals):
                stop_reason = "plateau"
                break
    model.load_state_dict(best_state)
    model.eval()
    return {"curve": curve, "best_val_loss": best if math.isfinite(best) else None,
            "best_step": best_step, "stopped_at": step, "stop_reason": stop_reason,
            "step_time_median_s": statistics.median(step_times),
            "train_s": time.perf_counter() - begin}


def build_lm(vocab, model, layer, options):
    """A :class:`svtoolkit.torch.TinyLM` from a cell's ``model`` dict (``d_model``,
    ``n_layers``, ``n_heads``, ``block``; optional ``mlp_ratio``, ``positions``, ``ntk``)."""
    from svtoolkit.torch import TinyLM

    extra = {k: model[k] for k in ("mlp_ratio", "positions", "ntk") if k in model}
    return TinyLM(vocab, model["d_model"], model["n_layers"], model["n_heads"], model["block"],
                  attn=layer, attn_options=dict(options), **extra)


# ------------------------------------------------------------------------------ recall
def recall_sequence_length(variant, gap, n_episodes=6):
    """Tokens per sequence of a :func:`svtoolkit.tasks.tensor_cache_recall` variant."""
    if variant == "long_gap":
        return 1 + gap + 6
    stores = 2 if variant == "multistore" else 1
    return 1 + n_episodes * (3 * stores + gap + 3)


def filler_evals(fillers, train_length, n_episodes=6):
    """Evaluation sets of the filler sweep that fit the trained positions.

    TinyLM's positions are learned, so a sequence longer than the training one would read
    untrained position embeddings; each ``F_eval`` keeps as many of the ``n_episodes``
    episodes as fit in the training length (fewer for long fillers) and is dropped if not
    even one fits.

    Returns
    -------
    list of dict
        ``{"name": "filler_<f>", "variant": "filler_sweep", "gap": f, "n_episodes": e}``.
    """
    evals = []
    for f in fillers:
        episodes = min(n_episodes, (train_length - 1) // (f + 6))
        if episodes >= 1:
            evals.append({"name": f"filler_{f}", "variant": "filler_sweep", "gap": int(f),
                          "n_episodes": int(episodes)})
    return evals


def _recall_task(spec, n, seed):
    from svtoolkit.tasks import tensor_cache_recall

    extra = {"n_episodes": spec["n_episodes"]} if "n_episodes" in spec else {}
    return tensor_cache_recall(n, variant=spec["variant"], gap=spec["gap"], seed=seed, **extra)


def _float_bytes(obj):
    """Bytes of the floating-point tensors in a (nested) streaming state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.is_floating_point() else 0
    if dataclasses.is_dataclass(obj):
        return sum(_float_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(_float_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(_float_bytes(x) for x in obj.values())
    return 0


def streaming_state_bytes(model, tokens):
    """Streaming-state bytes after one sequence, summed over the blocks.

    Parameters
    ----------
    model : TinyLM
        With learned positions.
    tokens : LongTensor of shape (1, L)

    Returns
    -------
    int
        Bytes of the floating-point tensors of every block's ``forward_with_state`` state
        (KV cache, ring buffer, fast-weight memory, normaliser; integer bookkeeping is not
        counted).
    """
    was_training = model.training
    model.eval()
    total = 0
    with torch.no_grad():
        x = model.tok_emb(tokens) + model.pos_emb(torch.arange(tokens.shape[1],
                                                               device=tokens.device))
        for block in model.blocks:
            y, state = block.attn.forward_with_state(block.ln_1(x))
            total += _float_bytes(state)
            x = x + y
            x = x + block.mlp(block.ln_2(x))
    model.train(was_training)
    return total


def run_recall_cell(cell):
    """Train one Tensor Cache recall cell under the protocol and score it on every evaluation
    set.

    ``cell = {"study": "lm_recall", "task": {"variant", "gap"}, "evals": [{"name", "variant",
    "gap"[, "n_episodes"]}], "model": {...}, "method", "layer", "options", "protocol", "lr",
    "seed", "device"}``; validation is the answer NLL of the main task.

    Returns
    -------
    dict
        :func:`train_under_protocol`'s record plus ``test`` (per evaluation set: ``accuracy``,
        ``nll``, ``scored``, ``length``, ``n_episodes``, ``state_bytes``), ``chance``,
        ``params``, ``threads``, ``device``.
    """
    from svtoolkit.torch.training import evaluate_tokens, resolve_device, seed_everything

    from .record import thread_state

    protocol = Protocol(**cell["protocol"])
    seed, lr = int(cell["seed"]), float(cell["lr"])
    device = resolve_device(cell["device"])
    spec = {"variant": cell["task"]["variant"], "gap": cell["task"]["gap"]}
    with pinned_threads():
        threads = thread_state()
        validation = _recall_task(spec, protocol.n_validation, split_seed(seed, "validation"))
        val_x = torch.from_numpy(validation.inputs)
        val_y = torch.from_numpy(validation.targets)
        seed_everything(seed)
        model = build_lm(validation.vocab_size, {**cell["model"],
                                                 "block": validation.inputs.shape[1]},
                         cell["layer"], cell["options"]).to(device)
        chunk_data = {}

        def batch_at(step):
            c, r = divmod(step - 1, TRAIN_CHUNK_STEPS)
            if c not in chunk_data:
                chunk_data.clear()
                task = _recall_task(spec, TRAIN_CHUNK_STEPS * protocol.batch_size,
                                    train_chunk_seed(seed, c))
                chunk_data[c] = (torch.from_numpy(task.inputs), torch.from_numpy(task.targets))
            x, y = chunk_data[c]
            rows = slice(r * protocol.batch_size, (r + 1) * protocol.batch_size)
            return x[rows], y[rows]

        run = train_under_protocol(
            model, batch_at, lambda m: evaluate_tokens(m, val_x, val_y)["loss"], protocol, lr,
            seed=seed, device=device)
        scores = {}
        for e in cell["evals"]:
            task = _recall_task(e, protocol.n_test, split_seed(seed, "test"))
            inputs = torch.from_numpy(task.inputs)
            got = evaluate_tokens(model, inputs, torch.from_numpy(task.targets))
            scores[e["name"]] = {
                "accuracy": got["accuracy"], "nll": got["loss"], "scored": got["scored"],
                "length": int(inputs.shape[1]), "n_episodes": int(task.config["n_episodes"]),
                "state_bytes": streaming_state_bytes(model, inputs[:1].to(device))}
    return {**run, "test": scores, "chance": validation.chance, "params": model.num_params(),
            "threads": threads, "device": str(device)}


# ------------------------------------------------------------------------------ bytes
#: corpus spec (as JSON text) -> ByteSplits, per process (a plain dict: the cell functions are
#: pickled to joblib workers by reference to this module).
_SPLITS = {}


def load_byte_splits(corpus):
    """``ByteSplits`` of ``{"name": corpus name, "max_bytes": int or None}`` or ``{"file":
    path, "max_bytes": ...}`` (read once per process)."""
    import json

    from svtoolkit.corpora import byte_splits, corpus_file_splits, load_corpus

    key = json.dumps(corpus, sort_keys=True)
    if key not in _SPLITS:
        if corpus.get("file"):
            splits = corpus_file_splits(corpus["file"], max_bytes=corpus.get("max_bytes"))
        else:
            splits = byte_splits(load_corpus(corpus["name"], max_bytes=corpus.get("max_bytes")))
        _SPLITS.clear()
        _SPLITS[key] = splits
    return _SPLITS[key]


def _windows(data, n, block):
    """The first ``n`` non-overlapping windows of ``block`` bytes: (inputs, targets), (n, block)
    int64 each."""
    n = min(n, (data.size - 1) // block)
    if n < 1:
        raise ValueError(f"a split of {data.size} bytes holds no window of {block + 1} bytes")
    flat = data[: n * block + 1].astype(np.int64)
    return (torch.from_numpy(flat[:-1].reshape(n, block).copy()),
            torch.from_numpy(flat[1:].reshape(n, block).copy()))


def _byte_batches(train_bytes, block, batch_size, seed):
    n = train_bytes.size - block - 1

    def batch_at(step):
        starts = np.random.default_rng([seed, step]).integers(0, n, size=batch_size)
        w = torch.from_numpy(train_bytes[starts[:, None] + np.arange(block + 1)]
                             .astype(np.int64))
        return w[:, :-1], w[:, 1:]

    return batch_at


def _bits_per_byte(model, inputs, targets, batch_size=16):
    from svtoolkit.torch.training import evaluate_tokens

    return evaluate_tokens(model, inputs, targets, batch_size=batch_size)["loss"] / math.log(2)


def measure_sv_state(model, windows):
    """Mean number of long-range keys the SV hybrid reads with a nonzero weight.

    Runs ``windows`` (int64 (n, block)) through the model, takes each SV layer's input and
    solves its gate at every chunk boundary some query reads, on the exact fp64 path
    (``gate(x, exact=True)``: the certified partition, the memory exact streaming inference
    keeps) and on the batched training path.

    Returns
    -------
    dict
        ``exact``, ``batched``, ``margin``, ``error`` (means over windows, layers, heads and
        boundaries), ``per_layer``, ``windows``, ``boundaries``.
    """
    layers = [block.attn for block in model.blocks]
    inputs = {}
    hooks = [layer.register_forward_hook(
        lambda module, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, layer in enumerate(layers)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(windows.to(next(model.parameters()).device))
            per_layer = []
            for i, layer in enumerate(layers):
                exact, batched = layer.gate(inputs[i], exact=True), layer.gate(inputs[i])
                inside = exact.multipliers() > 0
                error = (exact.alpha >= exact.C * (1 - 1e-9)) & inside
                per_layer.append({
                    "exact": float(inside.sum(-1).double().mean()),
                    "batched": float((batched.multipliers() > 0).sum(-1).double().mean()),
                    "margin": float((inside & ~error).sum(-1).double().mean()),
                    "error": float(error.sum(-1).double().mean()),
                    "boundaries": len(exact.ends)})
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    mean = {k: statistics.fmean(row[k] for row in per_layer)
            for k in ("exact", "batched", "margin", "error")}
    return {**mean, "per_layer": per_layer, "windows": int(windows.shape[0]),
            "boundaries": per_layer[0]["boundaries"]}


def weights_path(cell):
    """Where a byte cell with ``save_weights`` keeps its best-validation weights:
    ``<weights_dir>/<sha256 of the cell key, 16 hex>.pt``."""
    import hashlib

    from svtoolkit.sweep import cell_key

    digest = hashlib.sha256(cell_key(cell).encode()).hexdigest()[:16]
    return Path(cell["weights_dir"]) / f"{cell['method']}-{digest}.pt"


def run_bytes_cell(cell):
    """Train one byte-level language-model cell under the protocol; score it on the test
    split.

    ``cell = {"study": "lm_bytes", "corpus": {...}, "model": {...}, "method", "layer",
    "options", "protocol", "lr", "seed", "device"}`` plus, optionally, ``"state_windows":
    int`` (measure the SV hybrid's state on that many validation windows) and
    ``"weights_dir"`` (save the best-validation weights there, :func:`weights_path`).

    Returns
    -------
    dict
        :func:`train_under_protocol`'s record (``val_loss`` in bits per byte) plus
        ``test_bpb``, ``params``, ``params_no_positions``, ``state`` (when measured),
        ``weights`` (file name, when saved), ``threads``, ``device``.
    """
    from svtoolkit.torch.training import resolve_device, seed_everything

    from .record import thread_state

    protocol = Protocol(**cell["protocol"])
    seed, lr = int(cell["seed"]), float(cell["lr"])
    device = resolve_device(cell["device"])
    block = cell["model"]["block"]
    with pinned_threads():
        threads = thread_state()
        splits = load_byte_splits(cell["corpus"])
        val_x, val_y = _windows(splits.val, protocol.n_validation, block)
        seed_everything(seed)
        model = build_lm(256, cell["model"], cell["layer"], cell["options"]).to(device)
        run = train_under_protocol(
            model, _byte_batches(splits.train, block, protocol.batch_size, seed),
            lambda m: _bits_per_byte(m, val_x, val_y), protocol, lr, seed=seed, device=device)
        test_x, test_y = _windows(splits.test, protocol.n_test, block)
        out = {**run, "test_bpb": _bits_per_byte(model, test_x, test_y),
               "params": model.num_params(),
               "params_no_positions": model.num_params(positions=False),
               "threads": threads, "device": str(device)}
        if cell.get("state_windows"):
            out["state"] = measure_sv_state(model, val_x[: cell["state_windows"]])
        if cell.get("weights_dir"):
            path = weights_path(cell)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            torch.save(model.cpu().state_dict(), tmp)
            os.replace(tmp, path)
            out["weights"] = path.name
    return out


def run_cell(cell):
    """Dispatch on ``cell["study"]``: :func:`run_recall_cell`, :func:`run_bytes_cell` or
    :func:`run_stream_cell`."""
    runners = {"lm_recall": run_recall_cell, "lm_bytes": run_bytes_cell,
               "lm_stream": run_stream_cell}
    if cell.get("study") not in runners:
        raise ValueError(f"cell['study'] must be one of {sorted(runners)}; got "
                         f"{cell.get('study')!r}")
    return runners[cell["study"]](cell)


def probe_step_time(cell, steps=3):
    """Median seconds of one training step of ``cell`` (``steps + 1`` steps of a shortened
    copy of it, validation and test on one batch each, nothing saved or measured)."""
    p = dict(cell["protocol"])
    n = steps + 1
    p.update(max_steps=n, eval_interval=n, min_steps=0, warmup_steps=1,
             n_validation=p["batch_size"], n_test=p["batch_size"])
    short = {k: v for k, v in cell.items() if k not in ("weights_dir", "state_windows")}
    return run_cell({**short, "protocol": p})["step_time_median_s"]


# ------------------------------------------------------------------------------ streaming
class PeakMemory:
    """Peak memory growth of a stream: CUDA allocator stats, else the process's peak RSS.

    On the CPU: the growth of the peak resident set (``VmHWM`` of ``/proc/self/status``, reset
    through ``/proc/self/clear_refs`` at :meth:`start`) over the resident set at the start
    (``tracemalloc`` would not see torch's allocations). On CUDA:
    ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    """

    def __init__(self, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.base = 0

    @property
    def how(self):
        if self.cuda:
            return "torch.cuda.max_memory_allocated minus the allocation at the stream start"
        return ("process peak RSS (VmHWM, reset via /proc/self/clear_refs) minus RSS at the "
                "stream start")

    @staticmethod
    def _status(field):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{field} not in /proc/self/status")

    def start(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        import ctypes

        try:  # give freed heap back first, so the baseline is what is live
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        self.base = self._status("VmRSS")

    def peak(self):
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        return int(self._status("VmHWM") - self.base)


def stream_start(val_bytes, eval_seed, needed):
    """Start of the evaluation stream of one seed (the same for every method and L):
    ``np.random.default_rng([eval_seed])``."""
    if val_bytes.size < needed + 1:
        raise ValueError(f"the validation split ({val_bytes.size} bytes) is shorter than one "
                         f"evaluation stream ({needed + 1} bytes)")
    return int(np.random.default_rng([eval_seed]).integers(0, val_bytes.size - needed))


def stream_records(model, tokens, lengths, decode, memory, max_length, sv_budget=None):
    """Stream ``tokens`` (1, N) and record NLL, state, peak memory and decode speed at each L.

    The bytes go through ``TinyLM.forward_with_state`` in chunks of ``block``; at every
    ``L`` of ``lengths`` the mean NLL of the first ``L`` predictions (nats) is recorded with
    the retained state bytes (``state.nbytes()``), then the next ``decode`` tokens are fed one
    at a time through ``TinyLM.step`` (they count towards the longer L) and timed.

    Returns
    -------
    list of dict
        ``{"L", "nll", "state_bytes", "decode_tok_s", "peak_bytes"[, "sv_over_budget"]}``.
    """
    import torch.nn.functional as F

    block = model.block
    state = model.init_state(1, max_length=max_length, sv_budget=sv_budget)
    memory.start()
    nll_sum, pos, records = 0.0, 0, []
    sync = (lambda: torch.cuda.synchronize(tokens.device)) if tokens.is_cuda else (lambda: None)

    def score(logits, start):
        targets = tokens[0, start + 1:start + 1 + logits.shape[1]]
        return float(F.cross_entropy(logits[0].double(), targets, reduction="sum"))

    with torch.no_grad():
        for L in lengths:
            while pos < L:
                size = min(block, L - pos)
                logits, state = model.forward_with_state(tokens[:, pos:pos + size], state)
                nll_sum += score(logits, pos)
                pos += size
            record = {"L": L, "nll": nll_sum / L, "state_bytes": state.nbytes()}
            if sv_budget is not None:  # boundaries where the support alone exceeded it
                record["sv_over_budget"] = sum(getattr(s, "over_budget", 0)
                                               for s in state.layers)
            sync()
            t0 = time.perf_counter()
            for _ in range(decode):
                logits, state = model.step(tokens[:, pos], state)
                nll_sum += score(logits[:, None], pos)
                pos += 1
            sync()
            record["decode_tok_s"] = decode / (time.perf_counter() - t0)
            record["peak_bytes"] = memory.peak()
            records.append(record)
    return records


def run_stream_cell(cell):
    """Stream a trained byte cell's best-validation model over one evaluation seed's
    validation bytes.

    ``cell = {"study": "lm_stream", "train": <the lm_bytes cell, with weights_dir>,
    "eval_seed": int, "lengths": [int, ...] (tokens), "decode_tokens": int, "needed": int
    (bytes of the stream, the same for every method so that all start at the same byte),
    "one_stream_per_length": bool (NTK scaling by L / block: Full KV), "sv_budget": int or
    None}``.

    Returns
    -------
    dict
        ``start``, ``records`` (:func:`stream_records`, with ``bpb``), ``eval_s``,
        ``memory_measure``, ``device``.
    """
    from svtoolkit.torch.training import resolve_device

    train = cell["train"]
    device = resolve_device(train["device"])
    lengths, decode = list(cell["lengths"]), int(cell["decode_tokens"])
    with pinned_threads():
        model = build_lm(256, train["model"], train["layer"], train["options"])
        model.load_state_dict(torch.load(weights_path(train), map_location="cpu",
                                         weights_only=True))
        model.to(device).eval()
        splits = load_byte_splits(train["corpus"])
        needed = int(cell["needed"])
        start = stream_start(splits.val, int(cell["eval_seed"]), needed)
        tokens = torch.from_numpy(splits.val[start:start + needed + 1].astype(np.int64))[None]
        tokens = tokens.to(device)
        memory = PeakMemory(device)
        begin = time.perf_counter()
        if cell.get("one_stream_per_length"):
            records = [stream_records(model, tokens, [L], decode, memory, max_length=L)[0]
                       for L in lengths]
        else:
            records = stream_records(model, tokens, lengths, decode, memory, max_length=None,
                                     sv_budget=cell.get("sv_budget"))
    for r in records:
        r["bpb"] = r["nll"] / math.log(2)
    return {"start": start, "records": records, "eval_s": time.perf_counter() - begin,
            "memory_measure": memory.how, "device": str(device)}
