"""The optimizer settings that wrap any registered optimizer: ``optimizer.cautious_weight_decay``,
``optimizer.lookahead`` and ``optimizer.tail_average`` (modded-nanogpt's optimizer-track pieces).

Nested innermost first: `optim.cautious_weight_decay` (on the run's learning rate schedule; it
replaces the optimizer's own decay, which `optim.build` turns off), `optim.tail_average` (averages
the weights each step produces) and `optim.lookahead` (so the average is of the weights without the
lookahead, as in the record). Each is off at its default. Evaluation and export read the weights
through `optim.tail_average.evaluation_params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from optim.cautious_weight_decay import cautious_weight_decay
from optim.lookahead import lookahead
from optim.tail_average import tail_average

KEYS = ("cautious_weight_decay", "lookahead", "tail_average")
LOOKAHEAD = {"stepsize": 0.0, "ema": 0.99, "start": 0, "stop": 0}  # stepsize 0: off
TAIL_AVERAGE = {"start": 0, "horizon": 150.0, "blend": 0.6, "stop": 0}  # start 0: off


def block(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``config[key]`` over ``defaults``; a ValueError naming an unknown key."""
    given = dict(config.get(key) or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"optimizer.{key} has no key(s) {', '.join(unknown)}; its keys: {', '.join(defaults)}")
    return {**defaults, **given}


def active(config: Mapping[str, Any]) -> bool:
    """Whether the ``optimizer`` block ``config`` turns any of the settings on."""
    return bool(
        float(config.get("cautious_weight_decay") or 0.0)
        or block(config, "lookahead", LOOKAHEAD)["stepsize"]
        or block(config, "tail_average", TAIL_AVERAGE)["start"]
    )


def apply(
    tx: optax.GradientTransformation, config: Mapping[str, Any], schedule: optax.Schedule, peak: float
) -> optax.GradientTransformation:
    """``tx`` with the settings of the ``optimizer`` block ``config`` that are on; ``schedule`` is the
    run's learning rate, ``peak`` its largest value."""
    if cwd := float(config.get("cautious_weight_decay") or 0.0):
        tx = cautious_weight_decay(tx, cwd, schedule)
    tail = block(config, "tail_average", TAIL_AVERAGE)
    if tail["start"]:
        tx = tail_average(tx, start=int(tail["start"]), horizon=float(tail["horizon"]), blend=float(tail["blend"]), stop=int(tail["stop"]))
    look = block(config, "lookahead", LOOKAHEAD)
    if look["stepsize"]:
        tx = lookahead(
            tx,
            float(look["stepsize"]),
            ema=float(look["ema"]),
            start=int(look["start"]),
            stop=int(look["stop"]),
            ratio=lambda n: schedule(n) / peak,
        )
    return tx
