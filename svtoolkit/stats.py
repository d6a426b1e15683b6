"""Paired statistics for seed-matched comparisons of two methods.

A paired comparison has one result per seed for a *baseline* and a *treatment* run under the
same seed (initialisation, data order, matched budget), e.g. the validation bits per byte of
a sliding-window Transformer and of the SV hybrid in the matched-state protocol of
Forgetful Attention (arXiv:2607.12204), §8 and App. D. Lower values are better throughout
(losses, bits per byte); the sign conventions below follow from that.

* :func:`relative_improvements` - per-seed ``(baseline - treatment) / baseline``;
* :func:`mean_with_ci` - a mean with its t-based confidence interval;
* :func:`paired_t_test` - :func:`scipy.stats.ttest_rel` on the raw values;
* :func:`wilcoxon_signed_rank` - :func:`scipy.stats.wilcoxon` on the paired differences;
* :func:`cohens_dz` - Cohen's ``d_z`` of the paired differences;
* :func:`paired_comparison` - all of them at once (:class:`PairedComparison`).

For accuracy-like results (higher is better, often bimodal over seeds: a seed learns the task
or it does not):

* :func:`clopper_pearson` - the exact binomial interval of a success proportion;
* :func:`success_count` - how many seeds reach a stated threshold, with that interval
  (:class:`SuccessCount`);
* :func:`bootstrap_mean_ci` - a percentile bootstrap interval of the mean;
* :func:`paired_differences` - per-seed differences of a higher-is-better metric with the
  paired t and Wilcoxon tests (:class:`PairedDifference`).

Examples
--------
>>> from svtoolkit.stats import paired_comparison
>>> swa = [2.40, 2.35, 2.42, 2.38, 2.37]
>>> sv = [2.20, 2.21, 2.19, 2.22, 2.18]
>>> result = paired_comparison(swa, sv)
>>> round(result.mean_improvement, 4), result.wins, result.n
(0.0771, 5, 5)
>>> round(result.wilcoxon_p, 4)  # the smallest two-sided exact p-value at n = 5: 2 / 2**5
0.0625
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _stats

from ._validation import check_int, check_real

__all__ = [
    "PairedComparison",
    "PairedDifference",
    "SuccessCount",
    "bootstrap_mean_ci",
    "clopper_pearson",
    "cohens_dz",
    "mean_with_ci",
    "paired_comparison",
    "paired_differences",
    "paired_t_test",
    "relative_improvements",
    "success_count",
    "wilcoxon_signed_rank",
]


# ------------------------------------------------------------------------------ validation
def _as_sample(values, name, *, min_size=1):
    """A finite 1-d float64 copy of ``values`` with at least ``min_size`` entries."""
    if isinstance(values, (str, bytes)) or np.isscalar(values):
        raise TypeError(f"{name} must be a 1-d sequence of numbers; got {type(values).__name__}")
    arr = np.asarray(values)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers; got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-d; got shape {arr.shape}")
    if arr.size < min_size:
        raise ValueError(f"{name} needs at least {min_size} values; got {arr.size}")
    arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite; got {arr.tolist()}")
    return arr


def _as_pair(baseline, treatment):
    base = _as_sample(baseline, "baseline", min_size=2)
    treat = _as_sample(treatment, "treatment", min_size=2)
    if base.shape != treat.shape:
        raise ValueError(f"baseline and treatment must have the same length (one value per "
                         f"seed); got {base.size} and {treat.size}")
    return base, treat


def _check_confidence(confidence):
    return check_real(confidence, "confidence", min=0.0, max=1.0, include_min=False,
                      include_max=False)


# ------------------------------------------------------------------------------ statistics
def relative_improvements(baseline, treatment):
    """Per-pair relative improvement of the treatment, ``(b_i - t_i) / b_i``.

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        One value per seed (lower is better), ``n >= 2``; the baseline values must be
        positive.

    Returns
    -------
    ndarray of shape (n,)
        Positive where the treatment is better (lower) than its paired baseline.
    """
    base, treat = _as_pair(baseline, treatment)
    if (base <= 0).any():
        raise ValueError(f"baseline values must be positive for a relative improvement; "
                         f"got {base.tolist()}")
    return (base - treat) / base


def mean_with_ci(values, confidence=0.95):
    """Mean and t-based confidence interval ``mean +- t_{(1+c)/2, n-1} s / sqrt(n)``.

    Parameters
    ----------
    values : array_like of shape (n,)
        ``n >= 2`` finite numbers.
    confidence : float, default 0.95

    Returns
    -------
    mean, low, high : float
    """
    arr = _as_sample(values, "values", min_size=2)
    confidence = _check_confidence(confidence)
    mean = float(arr.mean())
    half = (float(_stats.t.ppf(0.5 + confidence / 2.0, arr.size - 1))
            * float(arr.std(ddof=1)) / math.sqrt(arr.size))
    return mean, mean - half, mean + half


def paired_t_test(baseline, treatment):
    """Two-sided paired t-test of ``baseline - treatment`` (:func:`scipy.stats.ttest_rel`).

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        ``n >= 2`` paired values.

    Returns
    -------
    t, p : float
        ``t > 0`` when the treatment is lower on average. When every difference is the same
        the statistic is ``+-inf`` with ``p = 0`` (or NaN for both when they are all 0)
        instead of scipy's cancellation warning.
    """
    base, treat = _as_pair(baseline, treatment)
    diff = base - treat
    if np.all(diff == diff[0]):
        if diff[0] == 0:
            return math.nan, math.nan
        return math.copysign(math.inf, diff[0]), 0.0
    with warnings.catch_warnings():
        # scipy flags differences whose spread is tiny next to their mean; the statistic
        # is still the exact formula, and a large t is the expected case here.
        warnings.filterwarnings("ignore", message="Precision loss occurred",
                                category=RuntimeWarning)
        result = _stats.ttest_rel(base, treat)
    return float(result.statistic), float(result.pvalue)


def wilcoxon_signed_rank(baseline, treatment):
    """Two-sided Wilcoxon signed-rank test of the paired differences
    (:func:`scipy.stats.wilcoxon`, zero differences dropped, exact distribution for small n).

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        ``n >= 2`` paired values.

    Returns
    -------
    statistic, p : float
        scipy's statistic (the smaller signed-rank sum) and two-sided p-value; NaN for both
        when every difference is 0. With n pairs the smallest attainable two-sided p-value is
        ``2 / 2**n`` (0.0625 at n = 5, 0.0156 at n = 7).
    """
    base, treat = _as_pair(baseline, treatment)
    if np.all(base == treat):
        return math.nan, math.nan
    result = _stats.wilcoxon(base, treat, zero_method="wilcox", alternative="two-sided")
    return float(result.statistic), float(result.pvalue)


def cohens_dz(baseline, treatment):
    """Cohen's ``d_z``: mean paired difference over its standard deviation (ddof 1).

    ``d_z = mean(b - t) / sd(b - t) = t / sqrt(n)`` with t the paired t statistic.

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        ``n >= 2`` paired values.

    Returns
    -------
    float
        Positive when the treatment is lower on average; ``+-inf`` when every difference is
        the same nonzero value, NaN when they are all 0.
    """
    base, treat = _as_pair(baseline, treatment)
    diff = base - treat
    if np.all(diff == diff[0]):
        return math.nan if diff[0] == 0 else math.copysign(math.inf, diff[0])
    return float(diff.mean() / diff.std(ddof=1))


@dataclass(frozen=True)
class PairedComparison:
    """Everything :func:`paired_comparison` computes (lower values are better).

    Attributes
    ----------
    n : int
        Number of pairs (seeds).
    baseline_mean, treatment_mean : float
    mean_improvement, ci_low, ci_high : float
        Mean relative improvement ``mean((b - t) / b)`` and its t-based confidence interval
        (fractions: 0.086 is 8.6 %).
    confidence : float
    t, t_p : float
        Paired t statistic and two-sided p-value on the raw values.
    wilcoxon_statistic, wilcoxon_p : float
    cohens_dz : float
    wins : int
        Pairs where the treatment is strictly lower.
    """

    n: int
    baseline_mean: float
    treatment_mean: float
    mean_improvement: float
    ci_low: float
    ci_high: float
    confidence: float
    t: float
    t_p: float
    wilcoxon_statistic: float
    wilcoxon_p: float
    cohens_dz: float
    wins: int

    def to_dict(self):
        """A plain dict of the fields (JSON-serialisable)."""
        return asdict(self)


def paired_comparison(baseline, treatment, *, confidence=0.95):
    """Paired comparison of a treatment against a baseline over seeds.

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        One value per seed, paired by position; lower is better; ``n >= 2``; baseline values
        positive.
    confidence : float, default 0.95
        Level of the interval of the mean relative improvement.

    Returns
    -------
    PairedComparison
    """
    confidence = _check_confidence(confidence)
    base, treat = _as_pair(baseline, treatment)
    mean, low, high = mean_with_ci(relative_improvements(base, treat), confidence)
    t, t_p = paired_t_test(base, treat)
    w, w_p = wilcoxon_signed_rank(base, treat)
    return PairedComparison(
        n=int(base.size), baseline_mean=float(base.mean()), treatment_mean=float(treat.mean()),
        mean_improvement=mean, ci_low=low, ci_high=high, confidence=confidence, t=t, t_p=t_p,
        wilcoxon_statistic=w, wilcoxon_p=w_p, cohens_dz=cohens_dz(base, treat),
        wins=int((treat < base).sum()))


# ------------------------------------------------------------------------------ accuracy-like
def clopper_pearson(successes, trials, confidence=0.95):
    """Exact (Clopper-Pearson) two-sided interval of a binomial proportion.

    ``low = Beta^-1((1 - c) / 2; k, n - k + 1)`` (0 when k = 0) and
    ``high = Beta^-1((1 + c) / 2; k + 1, n - k)`` (1 when k = n): the interval of
    :func:`scipy.stats.binomtest` ``(k, n).proportion_ci(c, method="exact")``.

    Parameters
    ----------
    successes, trials : int
        ``0 <= successes <= trials``, ``trials >= 1``.
    confidence : float, default 0.95

    Returns
    -------
    low, high : float
    """
    k = check_int(successes, "successes", min=0)
    n = check_int(trials, "trials", min=1)
    if k > n:
        raise ValueError(f"need successes <= trials; got successes={k}, trials={n}")
    confidence = _check_confidence(confidence)
    tail = (1.0 - confidence) / 2.0
    low = 0.0 if k == 0 else float(_stats.beta.ppf(tail, k, n - k + 1))
    high = 1.0 if k == n else float(_stats.beta.ppf(1.0 - tail, k + 1, n - k))
    return low, high


@dataclass(frozen=True)
class SuccessCount:
    """What :func:`success_count` computes.

    Attributes
    ----------
    successes, trials : int
        Values at or above ``threshold`` and all values ("2 of 3 seeds").
    threshold : float
    low, high : float
        Clopper-Pearson interval of the success probability.
    confidence : float
    """

    successes: int
    trials: int
    threshold: float
    low: float
    high: float
    confidence: float

    def to_dict(self):
        """A plain dict of the fields (JSON-serialisable)."""
        return asdict(self)

    def __str__(self):
        return (f"{self.successes} of {self.trials} >= {self.threshold:g} (exact "
                f"{self.confidence:.0%} CI of the rate {self.low:.2f}-{self.high:.2f})")


def success_count(values, threshold, *, confidence=0.95):
    """How many values reach ``threshold`` (``value >= threshold``), with the exact interval.

    Parameters
    ----------
    values : array_like of shape (n,)
        One result per seed (higher is better), ``n >= 1``.
    threshold : float
        The stated success level (e.g. recall@1 0.9), fixed before the run.
    confidence : float, default 0.95

    Returns
    -------
    SuccessCount
    """
    arr = _as_sample(values, "values")
    threshold = check_real(threshold, "threshold")
    k = int((arr >= threshold).sum())
    low, high = clopper_pearson(k, int(arr.size), confidence)
    return SuccessCount(successes=k, trials=int(arr.size), threshold=float(threshold), low=low,
                        high=high, confidence=_check_confidence(confidence))


def bootstrap_mean_ci(values, confidence=0.95, *, n_resamples=10_000, seed=0):
    """Percentile bootstrap interval of the mean (resampling the values with replacement).

    With few seeds the interval is coarse (with n = 3 the resampled means take at most 10
    distinct values) and never wider than the range of the values: read it together with the
    per-seed values and :func:`success_count`.

    Parameters
    ----------
    values : array_like of shape (n,)
        ``n >= 1`` finite numbers.
    confidence : float, default 0.95
    n_resamples : int, default 10000
    seed : int, default 0
        Seed of the resampling generator (``np.random.default_rng``).

    Returns
    -------
    mean, low, high : float
    """
    arr = _as_sample(values, "values")
    confidence = _check_confidence(confidence)
    n_resamples = check_int(n_resamples, "n_resamples", min=1)
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(int(n_resamples), arr.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(arr.mean()), float(low), float(high)


@dataclass(frozen=True)
class PairedDifference:
    """What :func:`paired_differences` computes (higher values are better).

    Attributes
    ----------
    n : int
    differences : list of float
        Per-pair ``treatment - baseline`` (positive: the treatment is better).
    mean_difference : float
    baseline_mean, treatment_mean : float
    t, t_p : float
        Paired t statistic of ``treatment - baseline`` and its two-sided p-value.
    wilcoxon_statistic, wilcoxon_p : float
    wins, ties : int
        Pairs where the treatment is strictly higher, and equal pairs.
    """

    n: int
    differences: list
    mean_difference: float
    baseline_mean: float
    treatment_mean: float
    t: float
    t_p: float
    wilcoxon_statistic: float
    wilcoxon_p: float
    wins: int
    ties: int

    def to_dict(self):
        """A plain dict of the fields (JSON-serialisable)."""
        return asdict(self)


def paired_differences(baseline, treatment):
    """Paired comparison of a higher-is-better metric (accuracy) over seeds.

    Parameters
    ----------
    baseline, treatment : array_like of shape (n,)
        One value per seed, paired by position, ``n >= 2``.

    Returns
    -------
    PairedDifference
        The tests are those of :func:`paired_t_test` and :func:`wilcoxon_signed_rank` with the
        roles swapped, so that ``t > 0`` means the treatment is higher.
    """
    base, treat = _as_pair(baseline, treatment)
    t, t_p = paired_t_test(treat, base)
    w, w_p = wilcoxon_signed_rank(treat, base)
    diff = treat - base
    return PairedDifference(
        n=int(base.size), differences=diff.tolist(), mean_difference=float(diff.mean()),
        baseline_mean=float(base.mean()), treatment_mean=float(treat.mean()), t=t, t_p=t_p,
        wilcoxon_statistic=w, wilcoxon_p=w_p, wins=int((diff > 0).sum()),
        ties=int((diff == 0).sum()))
