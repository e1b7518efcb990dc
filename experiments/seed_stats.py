r"""Statistics over seeds for optimizer comparisons: a t-interval of a mean and Welch's t-test.

For ``n`` values with mean ``m`` and sample standard deviation ``s`` (``n - 1`` in the denominator),
the two-sided ``level`` interval of the mean is

    m +- t_{(1 + level) / 2, n - 1} s / sqrt(n),

which assumes the seeds' values are roughly normal: with 3 seeds ``t_{0.975, 2} = 4.30``, so the
interval is wide, as it should be. Welch's test compares two means without assuming equal variances:

    t = (m_a - m_b) / sqrt(s_a^2 / n_a + s_b^2 / n_b)
    nu = (s_a^2 / n_a + s_b^2 / n_b)^2 / ((s_a^2 / n_a)^2 / (n_a - 1) + (s_b^2 / n_b)^2 / (n_b - 1))
    p = 2 P(T_nu > |t|)

The t distribution is scipy's (`scipy.stats.t`; scipy is a dependency of jax).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from scipy import stats


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval (None where fewer than two values)."""

    mean: float
    low: float | None
    high: float | None
    n: int


@dataclasses.dataclass(frozen=True)
class Welch:
    """Welch's t statistic of ``mean(a) - mean(b)``, its degrees of freedom and the two-sided p-value."""

    t: float
    df: float
    p: float


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The ``level`` t-interval of the mean of ``values`` (see the module docstring)."""
    if not values:
        raise ValueError("t_interval needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Interval(mean, None, None, len(values))
    half = stats.t.ppf((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def welch(a: Sequence[float], b: Sequence[float]) -> Welch | None:
    """Welch's test of equal means of ``a`` and ``b``; None when a group has fewer than two values or
    both have zero spread (no test is possible)."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return None
    t = (statistics.fmean(a) - statistics.fmean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return Welch(t, df, float(2 * stats.t.sf(abs(t), df)))
