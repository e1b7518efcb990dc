"""Tokens-to-target and time-to-target speedups read off validation curves.

A curve is a list of ``(x, loss)`` points with ``x`` increasing: tokens seen, or seconds of training.
An optimizer's speedup over a baseline (AdamW in `experiments.compare_optimizers`) follows
"Fantastic Pretraining Optimizers and Where to Find Them" (Wen et al., arXiv:2509.02046) and AlgoPerf
(Dahl et al., arXiv:2306.07179): the target is the baseline's *final* validation loss, and

    speedup = x_baseline(target) / x_optimizer(target),

where ``x(target)`` is the first point at which a curve reaches the target, linearly interpolated
between the two evaluations around the crossing. An optimizer that never reaches the target within
its budget has no speedup; all that is known is that it is below ``x_baseline(target) / budget``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

Curve = Sequence[tuple[float, float]]


def x_to_target(curve: Curve, target: float) -> float | None:
    """The first ``x`` at which ``curve`` reaches ``loss <= target``, or None if it never does.

    Between evaluations the loss is taken as linear in ``x``. Before the first evaluation nothing is
    known, so a curve already at the target there reaches it at its first ``x``. Non-finite losses
    (a diverged run) never reach the target.
    """
    previous = None
    for x, loss in curve:
        if math.isfinite(loss) and loss <= target:
            if previous is None or not math.isfinite(previous[1]):
                return float(x)
            x0, y0 = previous
            return float(x0 + (y0 - target) / (y0 - loss) * (x - x0))
        previous = (x, loss)
    return None


@dataclasses.dataclass(frozen=True)
class Speedup:
    """An optimizer's speedup over the baseline at the baseline's final loss."""

    target: float  # the baseline's final validation loss
    baseline_x: float  # tokens (or seconds) the baseline needs to reach the target
    x: float | None  # what the optimizer needs; None: not reached within its budget
    budget: float  # the optimizer's last x

    @property
    def value(self) -> float | None:
        """``baseline_x / x``; None when the target was not reached."""
        return None if self.x is None else self.baseline_x / self.x

    @property
    def upper_bound(self) -> float:
        """What the speedup is known to be below when the target was not reached."""
        return self.baseline_x / self.budget

    def __str__(self) -> str:
        if self.value is None:
            return f"<{self.upper_bound:.2f}x (not reached)"
        return f"{self.value:.2f}x"


def speedup(baseline: Curve, curve: Curve) -> Speedup:
    """The speedup of ``curve`` over ``baseline`` at the baseline's final loss (see the module docstring)."""
    if not baseline or not curve:
        raise ValueError("speedup needs two non-empty curves of (x, loss) points")
    target = float(baseline[-1][1])
    if not math.isfinite(target):
        raise ValueError(f"the baseline's final loss is {target}; a diverged baseline sets no target")
    baseline_x = x_to_target(baseline, target)
    return Speedup(target, baseline_x, x_to_target(curve, target), float(curve[-1][0]))


def mean_curve(curves: Sequence[Curve]) -> list[tuple[float, float]]:
    """Pointwise mean of curves evaluated at the same points (seeds of one setting)."""
    lengths = {len(c) for c in curves}
    if len(lengths) != 1:
        raise ValueError(f"curves to average must have the same number of points, got lengths {sorted(lengths)}")
    return [(sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)) for points in zip(*curves)]
