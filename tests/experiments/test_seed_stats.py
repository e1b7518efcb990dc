"""Seed statistics: hand-checkable cases and scipy's own Welch test."""

import math

import numpy as np
import pytest
from scipy import stats

from experiments import seed_stats


def test_t_interval_of_three_seeds_uses_t_with_two_degrees_of_freedom():
    got = seed_stats.t_interval([100.0, 200.0, 300.0])
    half = 4.302653 * 100 / math.sqrt(3)  # t_{0.975, 2} from any table; sample sd 100
    assert (got.mean, got.n) == (200.0, 3)
    assert got.low == pytest.approx(200 - half) and got.high == pytest.approx(200 + half)
    assert seed_stats.t_interval([5.0]) == seed_stats.Interval(5.0, None, None, 1)
    with pytest.raises(ValueError, match="level=1.5 must be in"):
        seed_stats.t_interval([1.0, 2.0], level=1.5)


def test_welch_by_hand_with_two_degrees_of_freedom():
    """a = (0, 2), b = (3, 5): variances 2, t = -3 / sqrt(2), df = 2, where P(|T_2| > |t|) = 1 - |t| / sqrt(2 + t^2)."""
    got = seed_stats.welch([0.0, 2.0], [3.0, 5.0])
    t = -3 / math.sqrt(2)
    assert got.t == pytest.approx(t) and got.df == pytest.approx(2.0)
    assert got.p == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t))


def test_welch_matches_scipy_on_unequal_sizes_and_spreads():
    rng = np.random.default_rng(0)
    a, b = list(rng.normal(1.0, 0.1, 3)), list(rng.normal(1.2, 0.5, 5))
    got, want = seed_stats.welch(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert got.t == pytest.approx(want.statistic) and got.p == pytest.approx(want.pvalue)
    assert got.df == pytest.approx(want.df)
    assert seed_stats.welch([1.0], b) is None and seed_stats.welch([1.0, 1.0], [2.0, 2.0]) is None
