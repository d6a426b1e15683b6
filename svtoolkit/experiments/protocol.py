"""The fair training protocol of the synthetic studies, as pure functions (no torch).

Every method of a study is trained under the same :class:`Protocol`:

1. one run per learning rate of ``lr_grid``, on the training stream (fresh instances, each
   used once), with AdamW, a linear warm-up over ``warmup_steps`` and then a constant learning
   rate (the schedule does not depend on when a run stops);
2. every ``eval_interval`` steps the model is scored on the VALIDATION split (instances of
   their own seed, never used for the reported number);
3. a run stops at the plateau rule on validation (:func:`plateau_reached`) or at
   ``max_steps``, whichever comes first; the best-validation state is kept;
4. the learning rate is chosen by the best validation metric (:func:`choose_lr`, the mean over
   seeds of each run's best), and the reported number is that learning rate's
   best-validation checkpoint scored on the TEST split.

The token budget is ``max_steps * batch_size`` sequences for every method.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .._validation import check_int, check_option, check_real

__all__ = ["SPLIT_SEED_OFFSETS", "TRAIN_CHUNK_STEPS", "Protocol", "choose_lr", "plateau_reached",
           "split_seed", "train_chunk_seed"]

#: Seed of each split for training seed ``s``: ``s + offset``. The test offset is the one of
#: :func:`svtoolkit.tasks.heldout_seed`; the three streams never share a seed for s < 10 000.
SPLIT_SEED_OFFSETS = {"train": 0, "test": 10_000, "validation": 20_000}
#: Training instances (synthetic and recall studies alike) are generated in chunks of this many
#: steps, each a pure function of (seed, chunk) (:func:`train_chunk_seed`), so the stream does
#: not depend on when a run stops.
TRAIN_CHUNK_STEPS = 50


def split_seed(seed, split):
    """The generator seed of ``split`` ("train", "validation", "test") for training seed
    ``seed``."""
    check_option(split, "split", tuple(SPLIT_SEED_OFFSETS))
    return check_int(seed, "seed", min=0, max=9_999) + SPLIT_SEED_OFFSETS[split]


@dataclass(frozen=True)
class Protocol:
    """The training protocol shared by every method of one study at one scale.

    Attributes
    ----------
    lr_grid : tuple of float
        Peak learning rates tried for every method (decided before any run).
    max_steps : int
        Step cap; with ``batch_size`` it fixes the token budget of every method.
    batch_size : int
    eval_interval : int
        Validation every this many steps (and at the cap).
    min_steps : int
        The plateau rule is not applied before this many steps.
    plateau_fraction : float, default 0.2
        The window of the plateau rule: the last ``ceil(plateau_fraction * n)`` of the ``n``
        evaluations so far.
    plateau_rel : float, default 0.01
        The least relative improvement of the window's best over the best before it that
        counts as progress.
    warmup_steps : int
        Linear warm-up length (then the learning rate is constant).
    n_validation, n_test : int
        Instances of the two held-out splits.
    weight_decay, grad_clip, betas : AdamW settings (as in :mod:`svtoolkit.torch.training`).
    """

    lr_grid: tuple
    max_steps: int
    batch_size: int
    eval_interval: int
    min_steps: int
    warmup_steps: int
    n_validation: int
    n_test: int
    plateau_fraction: float = 0.2
    plateau_rel: float = 0.01
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple = (0.9, 0.95)

    def __post_init__(self):
        grid = tuple(float(lr) for lr in self.lr_grid)
        if not grid or any(not (math.isfinite(lr) and lr > 0) for lr in grid):
            raise ValueError(f"lr_grid must be non-empty positive numbers; got {self.lr_grid!r}")
        if len(set(grid)) != len(grid):
            raise ValueError(f"lr_grid must not repeat a value; got {self.lr_grid!r}")
        object.__setattr__(self, "lr_grid", grid)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        for name in ("max_steps", "batch_size", "eval_interval", "warmup_steps",
                     "n_validation", "n_test"):
            check_int(getattr(self, name), name, min=1)
        check_int(self.min_steps, "min_steps", min=0)
        if self.eval_interval > self.max_steps:
            raise ValueError(f"eval_interval ({self.eval_interval}) must be <= max_steps "
                             f"({self.max_steps})")
        check_real(self.plateau_fraction, "plateau_fraction", min=0.0, max=1.0,
                   include_min=False)
        check_real(self.plateau_rel, "plateau_rel", min=0.0)

    @property
    def token_budget_sequences(self):
        """Training sequences at the cap: ``max_steps * batch_size``."""
        return self.max_steps * self.batch_size

    def to_dict(self):
        """A JSON-serialisable dict (lists for the tuples)."""
        out = dataclasses.asdict(self)
        out["lr_grid"], out["betas"] = list(self.lr_grid), list(self.betas)
        return out

    def describe(self):
        """The protocol in one paragraph (for tables and docs)."""
        grid = ", ".join(f"{lr:g}" for lr in self.lr_grid)
        return (f"lr grid {{{grid}}} for every method; AdamW (betas {self.betas[0]:g}/"
                f"{self.betas[1]:g}, weight decay {self.weight_decay:g}, clip "
                f"{self.grad_clip:g}), {self.warmup_steps}-step linear warm-up then constant "
                f"lr; batch {self.batch_size}, at most {self.max_steps} steps (the same "
                f"budget of {self.token_budget_sequences} training sequences for every "
                f"method); validation on {self.n_validation} instances every "
                f"{self.eval_interval} steps; stop when the best of the last "
                f"{self.plateau_fraction:.0%} of evaluations is not >= "
                f"{self.plateau_rel:.0%} (relative) above the best before them, after at "
                f"least {self.min_steps} steps, or at the cap; lr chosen by the best mean "
                f"validation metric over seeds; reported: that lr's best-validation "
                f"checkpoint on {self.n_test} test instances")


def plateau_reached(values, *, fraction=0.2, rel=0.01, min_evals=1):
    """The plateau rule on a validation curve (higher is better).

    With ``n`` evaluations so far and a window of the last ``w = ceil(fraction * n)`` (at least
    1), the curve has plateaued when ``n >= min_evals``, ``n > w`` and the best value in the
    window does not exceed the best value before it by at least ``rel`` relative to the
    latter's magnitude: ``best_window < best_before + rel * |best_before|``.

    Parameters
    ----------
    values : sequence of float
        The validation metric of every evaluation so far, in order (higher is better; NaN
        counts as no progress).
    fraction : float, default 0.2
    rel : float, default 0.01
    min_evals : int, default 1

    Returns
    -------
    bool
    """
    n = len(values)
    w = max(1, math.ceil(fraction * n))
    if n < max(min_evals, 1) or n <= w:
        return False
    before = max(values[: n - w])
    window = [v for v in values[n - w:] if not math.isnan(v)]
    if not window:
        return True
    return max(window) < before + rel * abs(before)


def choose_lr(best_validation):
    """The learning rate with the best mean best-validation metric over seeds.

    Parameters
    ----------
    best_validation : dict
        ``{lr: [best validation metric of each seed's run]}`` (higher is better; NaN or None
        for a diverged run, which loses to any finite run).

    Returns
    -------
    float
        The chosen learning rate; ties go to the smaller one (listed first when sorted).

    Raises
    ------
    ValueError
        If ``best_validation`` is empty.
    """
    if not best_validation:
        raise ValueError("best_validation must hold at least one learning rate")

    def score(lr):
        values = best_validation[lr]
        if not values or any(v is None or math.isnan(v) for v in values):
            return -math.inf
        return sum(values) / len(values)

    best = None
    for lr in sorted(best_validation):
        if best is None or score(lr) > score(best):
            best = lr
    return best


def train_chunk_seed(seed, chunk):
    """The generator seed of training chunk ``chunk`` (0-based) of training seed ``seed``:
    ``1_000_000 + 1000 * seed + chunk``, distinct from every validation and test seed."""
    split_seed(seed, "train")
    return 1_000_000 + 1000 * int(seed) + check_int(chunk, "chunk", min=0, max=999)
