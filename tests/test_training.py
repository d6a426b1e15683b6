"""The trainer: schedule, clipping, seeds, data order, evaluation, checkpoints that resume
bit-identically on the CPU, every attention layer plugging in, argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from svtoolkit.torch import ATTENTION_LAYERS, TinyLM  # noqa: E402
from svtoolkit.torch.training import (  # noqa: E402
    IGNORE_INDEX,
    TokenBatches,
    TrainConfig,
    adamw,
    evaluate_tokens,
    lr_factor,
    resolve_device,
    seed_everything,
    token_evaluator,
    train,
)

SEED = 4242
VOCAB, LENGTH = 12, 10
# small windows / chunks so that LENGTH crosses their boundaries
TINY_OPTIONS = {
    "softmax": {},
    "sliding_window": {"window": 4},
    "streaming_llm": {"sinks": 1, "window": 4},
    "linear": {"chunk": 4},
    "deltanet": {"chunk": 4},
    "gated_deltanet": {"chunk": 4},
    "tensor_cache": {"window": 4, "chunk": 4},
    "infini": {"segment": 4},
    "sv": {"chunk": 4, "C": 0.25},
    "sv_hybrid": {"chunk": 4, "C": 0.25},
}


def successor_task(n=96, seed=SEED):
    """target = (input + 1) mod V on the second half of each row, IGNORE_INDEX elsewhere."""
    rng = np.random.default_rng(seed)
    inputs = torch.from_numpy(rng.integers(0, VOCAB, (n, LENGTH)))
    targets = (inputs + 1) % VOCAB
    targets[:, :LENGTH // 2] = IGNORE_INDEX
    return inputs, targets


def tiny_model(attn="softmax", dropout=0.0, seed=SEED):
    seed_everything(seed)
    return TinyLM(VOCAB, 16, 1, 2, LENGTH, attn=attn, attn_options=TINY_OPTIONS[attn],
                  dropout=dropout)


# ------------------------------------------------------------------------------ config
def test_config_is_frozen_and_checked():
    config = TrainConfig()
    with pytest.raises(dataclasses_frozen_error(), match="cannot assign to field 'steps'"):
        config.steps = 3
    assert TrainConfig(steps=100).warmup == 5 and TrainConfig(steps=10).warmup == 1
    assert TrainConfig(warmup_steps=7).warmup == 7
    assert TrainConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)
    for kwargs, message in [({"steps": 0}, "steps must be >= 1; got 0"),
                            ({"lr": -1.0}, "lr must be finite and > 0; got -1.0"),
                            ({"grad_clip": -1}, "grad_clip must be finite and >= 0.0; got -1.0"),
                            ({"min_lr_ratio": 2},
                             r"min_lr_ratio must be finite and in \[0.0, 1.0\]"),
                            ({"betas": (0.9,)}, "betas must be two numbers"),
                            ({"mode": "best"}, "mode must be one of 'max', 'min'; got 'best'"),
                            ({"device": "tpu"},
                             "device must be one of 'cpu', 'cuda', 'auto'; got 'tpu'"),
                            ({"warmup_steps": 0}, "warmup_steps must be >= 1; got 0")]:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**kwargs)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    steps, warmup, ratio = 20, 4, 0.1
    factors = [lr_factor(s, steps, warmup, ratio) for s in range(steps)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert lr_factor(steps, steps, warmup, ratio) == pytest.approx(ratio)
    middle = warmup + (steps - warmup) // 2
    assert lr_factor(middle, steps, warmup, ratio) == pytest.approx(ratio + (1 - ratio) / 2)
    result = train(tiny_model(), successor_task(), TrainConfig(steps=6, batch_size=8, lr=0.01,
                                                               warmup_steps=2))
    assert result.lrs == [0.01 * lr_factor(s, 6, 2, 0.1) for s in range(6)]


def test_weight_decay_applies_to_matrices_only():
    model = tiny_model()
    groups = adamw(model, TrainConfig(weight_decay=0.3)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert all(p.dim() >= 2 for p in groups[0]["params"])
    assert all(p.dim() < 2 for p in groups[1]["params"])
    assert groups[0]["betas"] == (0.9, 0.95)


# ------------------------------------------------------------------------------ data
def test_token_batches_are_a_pure_function_of_the_step_and_visit_every_row_per_epoch():
    inputs, targets = successor_task(n=20)
    batches = TokenBatches(inputs, targets, batch_size=6, seed=3)
    assert batches.per_epoch == 3
    epoch0 = torch.cat([batches(s)[0] for s in range(3)])
    rows = {tuple(r) for r in inputs.tolist()}
    assert len({tuple(r) for r in epoch0.tolist()}) == 18 and {
        tuple(r) for r in epoch0.tolist()} <= rows
    later = batches(7)
    again = TokenBatches(inputs, targets, batch_size=6, seed=3)
    assert torch.equal(again(7)[0], later[0]) and torch.equal(again(7)[1], later[1])
    assert not torch.equal(batches(3)[0], batches(0)[0])  # a new permutation per epoch
    other_seed = TokenBatches(inputs, targets, batch_size=6, seed=4)
    assert not torch.equal(other_seed(0)[0], batches(0)[0])
    x, y = batches(1)
    assert torch.equal(y[:, LENGTH // 2:], (x[:, LENGTH // 2:] + 1) % VOCAB)


def test_token_batches_refuse_bad_data():
    inputs, targets = successor_task(n=8)
    with pytest.raises(ValueError, match="inputs must be an int64 tensor of shape"):
        TokenBatches(inputs.float(), targets, batch_size=2)
    with pytest.raises(ValueError, match="must have the same shape"):
        TokenBatches(inputs, targets[:, :-1], batch_size=2)
    with pytest.raises(ValueError, match="batch_size 9 exceeds the 8 examples"):
        TokenBatches(inputs, targets, batch_size=9)
    with pytest.raises(TypeError, match="data must be a batch_at"):
        train(tiny_model(), inputs, TrainConfig(steps=1))


def test_evaluate_tokens_scores_only_unignored_positions():
    class Oracle(torch.nn.Module):
        """Logits that put all mass on (input + 1) mod V, except at position 7."""

        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            logits = torch.nn.functional.one_hot((x + 1) % VOCAB, VOCAB).float() * 50
            logits[:, 7] = torch.nn.functional.one_hot(x[:, 7] % VOCAB, VOCAB).float() * 50
            return logits + self.dummy

    inputs, targets = successor_task(n=10)
    metrics = evaluate_tokens(Oracle(), inputs, targets, batch_size=3)
    assert metrics["scored"] == 10 * 5
    assert metrics["accuracy"] == pytest.approx(4 / 5)
    assert metrics["loss"] == pytest.approx(50 / 5, rel=1e-6)
    with pytest.raises(ValueError, match="score no position"):
        evaluate_tokens(Oracle(), inputs, torch.full_like(targets, IGNORE_INDEX))


# ------------------------------------------------------------------------------ training
def test_training_learns_a_simple_task_and_tracks_the_best_evaluation():
    inputs, targets = successor_task()
    config = TrainConfig(steps=60, batch_size=16, lr=0.02, eval_interval=20, seed=1)
    lines = []
    result = train(tiny_model(), (inputs, targets), config,
                   evaluate=token_evaluator(inputs, targets), log=lines.append)
    assert [e["step"] for e in result.evals] == [20, 40, 60] and len(lines) == 3
    assert result.final_metrics["accuracy"] > 0.9  # chance is 1/12
    assert result.best_metric == max(e["accuracy"] for e in result.evals)
    assert result.best_step in (20, 40, 60)
    assert np.mean(result.losses[-5:]) < 0.5 * np.mean(result.losses[:5])
    assert result.step_time["count"] == 60
    assert result.step_time["min"] <= result.step_time["median"] <= result.step_time["max"]
    assert result.device == "cpu" and result.config["steps"] == 60
    assert result.to_dict()["evals"] == result.evals


def test_clipping_bounds_the_last_gradient_norm():
    inputs, targets = successor_task()
    norms = {}
    for clip in (0.0, 1e-3):
        model = tiny_model()
        train(model, (inputs, targets), TrainConfig(steps=3, batch_size=8, grad_clip=clip))
        norms[clip] = float(torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
    assert norms[1e-3] <= 1e-3 * (1 + 1e-5) < norms[0.0]


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    inputs, targets = successor_task()
    runs = [train(tiny_model(dropout=0.1), (inputs, targets),
                  TrainConfig(steps=5, batch_size=8, seed=s)).losses for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


class Interrupt(RuntimeError):
    pass


def test_resuming_from_a_checkpoint_continues_bit_identically(tmp_path):
    """Dropout on (the RNG state matters), evaluation every 2 steps, a checkpoint every 3; the
    run is killed during step 5 and resumed from the step-3 checkpoint by a fresh model."""
    inputs, targets = successor_task()
    path = tmp_path / "ckpt" / "run.pt"
    config = TrainConfig(steps=8, batch_size=8, lr=0.01, eval_interval=2, seed=9,
                         checkpoint_path=str(path), checkpoint_interval=3)
    evaluate = token_evaluator(inputs, targets)
    straight = tiny_model(dropout=0.2)
    reference = train(straight, (inputs, targets), config, evaluate=evaluate)

    batches = TokenBatches(inputs, targets, batch_size=8, seed=9)

    def dying(step):
        if step == 4:
            raise Interrupt("killed")
        return batches(step)

    with pytest.raises(Interrupt, match="killed"):
        train(tiny_model(dropout=0.2), dying, config, evaluate=evaluate)
    assert torch.load(path, weights_only=False)["step"] == 3
    resumed_model = tiny_model(dropout=0.2, seed=SEED + 1)  # other init: the checkpoint wins
    torch.manual_seed(12345)  # and other global RNG states
    np.random.seed(1)
    resumed = train(resumed_model, (inputs, targets), config, evaluate=evaluate, resume=path)
    assert resumed.resumed_from == 3 and resumed.step_time["count"] == 5
    assert resumed.losses == reference.losses
    assert resumed.evals == reference.evals
    for (name, a), b in zip(straight.state_dict().items(), resumed_model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    final = torch.load(path, weights_only=False)
    assert final["step"] == 8 and final["losses"] == reference.losses


def test_resume_refuses_a_missing_or_foreign_checkpoint(tmp_path):
    inputs, targets = successor_task()
    path = tmp_path / "run.pt"
    with pytest.raises(ValueError, match="no checkpoint at"):
        train(tiny_model(), (inputs, targets), TrainConfig(steps=2, batch_size=8), resume=path)
    train(tiny_model(), (inputs, targets),
          TrainConfig(steps=2, batch_size=8, checkpoint_path=str(path)))
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="written with other steps, lr"):
        train(model, (inputs, targets), TrainConfig(steps=3, batch_size=8, lr=0.5),
              resume=path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_evaluation_metric_must_exist():
    inputs, targets = successor_task()
    with pytest.raises(ValueError, match="config.metric 'bpb' is not among"):
        train(tiny_model(), (inputs, targets), TrainConfig(steps=1, batch_size=8, metric="bpb"),
              evaluate=token_evaluator(inputs, targets))


@pytest.mark.parametrize("name", sorted(ATTENTION_LAYERS))
def test_every_attention_layer_trains_through_the_loop(name):
    inputs, targets = successor_task(n=16)
    model = tiny_model(name)
    before = [p.detach().clone() for p in model.parameters()]
    result = train(model, (inputs, targets), TrainConfig(steps=2, batch_size=4, lr=0.01),
                   evaluate=token_evaluator(inputs, targets))
    assert all(math.isfinite(v) for v in result.losses)
    assert 0.0 <= result.final_metrics["accuracy"] <= 1.0
    changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                         strict=True))
    assert changed > len(before) // 2


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of 'cpu', 'cuda', 'auto'; got 'gpu'"):
        resolve_device("gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_runs_and_learns():
    inputs, targets = successor_task()
    config = TrainConfig(steps=60, batch_size=16, lr=0.02, device="cuda", sync_timing=True)
    model = tiny_model()
    result = train(model, (inputs, targets), config, evaluate=token_evaluator(inputs, targets))
    assert next(model.parameters()).is_cuda and result.device.startswith("cuda")
    assert result.final_metrics["accuracy"] > 0.9
