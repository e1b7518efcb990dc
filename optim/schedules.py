"""Learning-rate schedules by name: ``constant``, ``cosine``, ``linear`` and ``wsd``.

Every schedule starts with a linear warmup from 0 to ``peak`` over ``warmup_steps`` and then:

- ``constant``: ``peak``.
- ``cosine``: ``peak * (r + (1 - r) * (1 + cos(pi * t)) / 2)``, ``t`` in [0, 1] over the remaining
  steps, ``r = min_lr_ratio``.
- ``linear``: ``peak * (1 - (1 - r) * t)``.
- ``wsd`` (warmup-stable-decay, Hu et al. 2024, arXiv:2404.06395): ``peak`` until the last
  ``decay_fraction`` of the run, then a linear decay to ``r * peak``.
"""

from __future__ import annotations

import optax

SCHEDULES = ("constant", "cosine", "linear", "wsd")
DEFAULT_WARMUP_STEPS = 20
DEFAULT_MIN_LR_RATIO = 0.1
DEFAULT_DECAY_FRACTION = 0.2


def default_warmup(total_steps: int) -> int:
    """Warmup steps when none are given: ``min(20, total_steps // 10)``, so short runs warm up briefly."""
    return min(DEFAULT_WARMUP_STEPS, max(total_steps, 0) // 10)


def make_schedule(
    name: str,
    peak: float,
    total_steps: int,
    *,
    warmup_steps: int = 0,
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO,
    decay_fraction: float = DEFAULT_DECAY_FRACTION,
) -> optax.Schedule:
    """Returns the schedule ``name`` for a run of ``total_steps`` steps. A setting the schedule does not
    read (``min_lr_ratio`` by ``constant``, ``decay_fraction`` by all but ``wsd``) must keep its default."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; set optimizer.schedule to one of {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"optimizer.warmup_steps={warmup_steps} must lie in [0, steps={total_steps}]")
    if not 0.0 <= decay_fraction <= 1.0:
        raise ValueError(f"optimizer.decay_fraction={decay_fraction} must lie in [0, 1]")
    if not 0.0 <= min_lr_ratio <= 1.0:  # above 1 the schedule ends above its peak; below 0 it ascends the loss
        raise ValueError(f"optimizer.min_lr_ratio={min_lr_ratio} must lie in [0, 1]")
    unread = {"decay_fraction": (decay_fraction, DEFAULT_DECAY_FRACTION)} if name != "wsd" else {}
    if name == "constant":
        unread["min_lr_ratio"] = (min_lr_ratio, DEFAULT_MIN_LR_RATIO)
    for key, (value, default) in unread.items():
        if value != default:
            raise ValueError(
                f"optimizer.{key}={value} is not read by schedule {name!r}; leave it at {default}, or pick a schedule that reads it"
            )
    floor = peak * min_lr_ratio
    rest = max(total_steps - warmup_steps, 1)
    if name == "constant":
        after = optax.constant_schedule(peak)
    elif name == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=min_lr_ratio)
    elif name == "linear":
        after = optax.linear_schedule(peak, floor, rest)
    else:
        decay = int(round(decay_fraction * rest))
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, max(decay, 1))],
            [rest - decay],
        )
    if warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), after], [warmup_steps])
