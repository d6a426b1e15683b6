"""Paired statistics: hand-computed values, scipy agreement, sign conventions, bad input."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from svtoolkit.stats import (
    PairedComparison,
    cohens_dz,
    mean_with_ci,
    paired_comparison,
    paired_t_test,
    relative_improvements,
    wilcoxon_signed_rank,
)


@pytest.fixture
def pair():
    rng = np.random.default_rng(0)
    base = 2.4 + 0.05 * rng.standard_normal(7)
    treat = base * (1 - 0.08 - 0.02 * rng.standard_normal(7))
    return base, treat


def test_relative_improvements_by_hand():
    got = relative_improvements([2.0, 4.0], [1.5, 5.0])
    np.testing.assert_allclose(got, [0.25, -0.25])


def test_mean_with_ci_matches_t_formula():
    values = np.array([0.1, 0.2, 0.15, 0.05])
    mean, low, high = mean_with_ci(values, 0.95)
    half = sps.t.ppf(0.975, 3) * values.std(ddof=1) / 2.0
    assert mean == pytest.approx(0.125)
    assert (low, high) == pytest.approx((0.125 - half, 0.125 + half))
    _, low90, high90 = mean_with_ci(values, 0.90)
    assert low < low90 < high90 < high


def test_t_test_and_dz_agree_with_definitions(pair):
    base, treat = pair
    diff = base - treat
    t_hand = diff.mean() / (diff.std(ddof=1) / math.sqrt(diff.size))
    t, p = paired_t_test(base, treat)
    assert t == pytest.approx(t_hand)
    assert p == pytest.approx(2 * sps.t.sf(abs(t_hand), diff.size - 1))
    assert cohens_dz(base, treat) == pytest.approx(t_hand / math.sqrt(diff.size))
    assert t > 0  # the treatment is lower: positive statistic


def test_wilcoxon_exact_extremes():
    base = [2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6]
    better = [b - 0.1 * (i + 1) for i, b in enumerate(base)]
    stat, p = wilcoxon_signed_rank(base, better)
    assert stat == 0.0
    assert p == pytest.approx(2 / 2**7)  # every pair on one side: the smallest exact p


def test_paired_comparison_fields(pair):
    base, treat = pair
    result = paired_comparison(base, treat)
    assert isinstance(result, PairedComparison)
    rel = (base - treat) / base
    assert result.mean_improvement == pytest.approx(rel.mean())
    assert result.ci_low < result.mean_improvement < result.ci_high
    assert result.wins == int((treat < base).sum())
    assert result.n == 7
    assert result.t_p == pytest.approx(sps.ttest_rel(base, treat).pvalue)
    assert result.wilcoxon_p == pytest.approx(sps.wilcoxon(base, treat).pvalue)
    assert set(result.to_dict()) >= {"t", "wilcoxon_p", "cohens_dz", "ci_low"}


def test_swapping_arms_flips_signs(pair):
    base, treat = pair
    assert paired_t_test(treat, base)[0] == pytest.approx(-paired_t_test(base, treat)[0])
    assert cohens_dz(treat, base) == pytest.approx(-cohens_dz(base, treat))


def test_constant_differences_do_not_warn():
    base = np.array([2.0, 2.1, 2.2])
    assert paired_t_test(base, base - 0.25) == (math.inf, 0.0)
    assert cohens_dz(base, base - 0.25) == math.inf
    assert all(math.isnan(v) for v in paired_t_test(base, base))
    assert all(math.isnan(v) for v in wilcoxon_signed_rank(base, base))


@pytest.mark.parametrize(("baseline", "treatment", "exc", "match"), [
    ([2.0, 2.1, 2.2], [2.0, 2.1], ValueError, "same length"),
    ([2.0], [1.0], ValueError, "at least 2"),
    ([2.0, np.nan], [1.0, 1.0], ValueError, "finite"),
    ([[2.0, 2.1]], [[1.0, 1.0]], ValueError, "1-d"),
    ("ab", [1.0, 1.0], TypeError, "sequence of numbers"),
    ([True, False], [1.0, 1.0], TypeError, "real numbers"),
])
def test_bad_input(baseline, treatment, exc, match):
    with pytest.raises(exc, match=match):
        paired_comparison(baseline, treatment)


def test_bad_confidence_and_nonpositive_baseline():
    with pytest.raises(ValueError, match="confidence"):
        paired_comparison([2.0, 2.1], [1.0, 1.1], confidence=1.0)
    with pytest.raises(ValueError, match="positive"):
        relative_improvements([0.0, 2.0], [1.0, 1.0])
