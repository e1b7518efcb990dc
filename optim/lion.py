"""Lion: the sign of an interpolated momentum (Chen et al., "Symbolic Discovery of Optimization
Algorithms", arXiv:2302.06675, Algorithm 2).

For each parameter ``w`` with gradient ``g_t``:

    c_t = b1 m_{t-1} + (1 - b1) g_t
    u_t = sign(c_t)
    m_t = b2 m_{t-1} + (1 - b2) g_t
    w_t = w_{t-1} - lr_t (u_t + lambda w_{t-1})

Defaults ``b1 = 0.9``, ``b2 = 0.99`` (the paper's). Every update entry is +-1, so Lion wants a
learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (the paper's advice; the
default ``weight_decay = 1.0`` is 10x the repository's AdamW default, so ``lr * lambda`` stays similar
at a 10x smaller ``lr``). One state buffer: 4 bytes per parameter in fp32, 1 with
`optim.quantize_state`. Matches ``optax.lion`` (tests/optim/test_lion.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

import kernels_pallas.quantized_update as qu
from optim import common, shapes, spec
from optim.quantize_state import Fused


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`."""

    mu: optax.Updates  # momentum m_t, shaped like the parameters


@dataclasses.dataclass(frozen=True, kw_only=True)
class LionDirection:
    """The Lion direction ``sign(b1 m + (1 - b1) g)``; momentum ``m <- b2 m + (1 - b2) g``.

    Attributes:
      b1: interpolation between momentum and gradient for the update.
      b2: decay of the momentum.
    """

    b1: float = spec.param(0.9, valid="[0, 1]")
    b2: float = spec.param(0.99, valid="[0, 1)")

    def direction(self) -> optax.GradientTransformation:
        b1, b2 = self.b1, self.b2

        def init_fn(params: optax.Params) -> ScaleByLionState:
            common.check_floating(params, "lion", "mask it out")
            return ScaleByLionState(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

        def update_fn(updates: optax.Updates, state: ScaleByLionState, params: optax.Params | None = None):
            del params
            shapes.check_like(updates, state.mu, "lion")
            direction = jax.tree.map(lambda g, m: jnp.sign(b1 * m + (1 - b1) * g).astype(g.dtype), updates, state.mu)
            mu = jax.tree.map(lambda g, m: (b2 * m + (1 - b2) * g).astype(m.dtype), updates, state.mu)
            return direction, ScaleByLionState(mu=mu)

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lion(LionDirection, common.DirectionOptimizer):
    """Lion with decoupled weight decay on weights, not norm scales or biases (`optim.labels.decay_mask`).

    ``w <- w - lr (sign(b1 m + (1 - b1) g) + weight_decay w)``.
    """

    learning_rate: optax.ScalarOrSchedule = 1.2e-3  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 1.0

    def fused_update(self) -> Fused:
        """This optimizer for `optim.quantize_state`'s fused kernel."""
        return Fused(qu.Lion(b1=self.b1, b2=self.b2, weight_decay=self.weight_decay), self.learning_rate)


scale_by_lion = spec.function(LionDirection, "direction", name="scale_by_lion", positional=("b1", "b2"))
lion = spec.function(Lion, name="lion")
