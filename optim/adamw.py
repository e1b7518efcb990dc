"""AdamW (Loshchilov & Hutter, arXiv:1711.05101) as a spec: optax's `optax.adamw` with the decay mask
of `optim.labels.decay_mask` and a fused quantized-state step (`optim.quantize_state`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import optax

import kernels_pallas.quantized_update as qu
from optim import labels, shapes, spec
from optim.quantize_state import Fused


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamW(spec.OptimizerSpec):
    """AdamW (Loshchilov & Hutter, arXiv:1711.05101) with decay on the leaves `optim.labels.decay_mask` picks.

    Attributes:
      weight_decay: decoupled weight decay ``lambda`` (multiplied by the learning rate).
      b1: first-moment decay.
      b2: second-moment decay.
      eps: added to the root of the second moment.
    """

    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = spec.param(0.1, valid="[0, inf)")
    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="[0, inf)")

    applies_weight_decay: ClassVar[bool] = True

    def transform(self) -> optax.GradientTransformationExtraArgs:
        adamw = optax.adamw(
            self.learning_rate,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            mask=labels.decay_mask,
        )
        return shapes.checked(adamw, "adamw")

    def fused_update(self) -> Fused:
        """This optimizer for `quantize_state`'s fused kernel."""
        return Fused(qu.AdamW(b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay), self.learning_rate)


adamw = spec.function(AdamW, name="adamw")
