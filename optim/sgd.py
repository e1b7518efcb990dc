"""SGD with heavy-ball or Nesterov momentum and decoupled weight decay, as a spec."""

from __future__ import annotations

import dataclasses

import optax

from optim import common, spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(common.DirectionOptimizer):
    """SGD with heavy-ball or Nesterov momentum and decoupled weight decay (leaves `optim.labels.decay_mask` picks).

    Attributes:
      momentum: the momentum coefficient (0: plain SGD).
      nesterov: Nesterov's look-ahead form of the momentum.
    """

    learning_rate: optax.ScalarOrSchedule = 0.15  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = spec.param(0.0, valid="[0, inf)")
    momentum: float = spec.param(0.9, valid="[0, 1)")
    nesterov: bool = False

    def direction(self) -> optax.GradientTransformation:
        if isinstance(self.momentum, int | float) and self.momentum == 0:  # not when injected (an array)
            return optax.identity()
        return optax.trace(decay=self.momentum, nesterov=self.nesterov)


sgd = spec.function(SGD, name="sgd")
