"""MARS-M: Muon on MARS's variance-reduced gradient (Liu, Yuan & Gu, arXiv:2510.21800; MARS: Yuan et
al., arXiv:2411.10438).

MARS replaces the stochastic gradient by a STORM-like estimate that subtracts the change of the
gradient between consecutive steps, scaled by ``gamma``:

    c_t = g_t + gamma * beta / (1 - beta) * (g_t - g_{t-1})
    c_t <- c_t / ||c_t||_F   if ||c_t||_F > 1          (clip_c=True; per matrix)
    M_t = beta M_{t-1} + (1 - beta) c_t
    O_t = NewtonSchulz(M_t)
    W_{t+1} = W_t - lr_t (0.2 sqrt(max(fan_in, fan_out)) O_t + lambda W_t)

This is MARS-M-approx, the variant of the paper's experiments: ``g_{t-1}`` is the previous step's
gradient (on the previous batch), kept in the state, so it costs one extra buffer and no extra
gradient evaluation; ``g_0 = 0``. Defaults follow the reference code (github.com/AGI-Arena/MARS,
``MARS_M/optimizers/mars_m.py``): ``beta = 0.95``, ``gamma = 0.025``, clipping on, no Nesterov,
Jordan's Newton-Schulz, Moonlight's shape scale, ``weight_decay = 0.1``, AdamW ``(0.9, 0.95)`` for
the other parameters. The reference clips each PyTorch parameter tensor; with scan-stacked layers the
norm here is taken per matrix, which is the same thing. Momentum forms, Newton-Schulz options,
batching, sharding and routing are Muon's (optim/muon.py): MARS-M is `optim.muon.scale_by_muon_core`
with the gradient correction plugged in before the momentum.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, spec
from optim import newton_schulz as ns
from optim.muon import MatrixStep, MuonDirection, scale_by_muon_core


class MarsMuonState(NamedTuple):
    """State of `scale_by_mars_muon`."""

    mu: optax.Updates  # momentum of the corrected gradients M_t, shaped like the parameters
    prev_grad: optax.Updates  # g_{t-1}, shaped like the parameters (zeros before the first step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarsMuonDirection(MuonDirection):
    """MARS-M's direction (module docstring); other fields as `optim.muon.MuonDirection`.

    Attributes:
      beta: momentum coefficient, also in the correction's ``beta / (1 - beta)``.
      gamma: strength of the gradient correction (0 gives Muon with clipped gradients).
      clip_c: divide ``c_t`` by its Frobenius norm when that exceeds 1.
    """

    gamma: float = spec.param(0.025, valid="[0, inf)")
    clip_c: bool = True
    nesterov: bool = False

    family: ClassVar[str] = "mars_muon"

    def direction(self) -> optax.GradientTransformation:
        correction = MatrixStep("prev_grad", self._init_prev, self._correct)
        return scale_by_muon_core(self, MarsMuonState, correction=correction)

    def _init_prev(self, p: jax.Array, ax: ns.MatrixAxes) -> jax.Array:
        return jnp.zeros(p.shape, self.mu_dtype)

    def _correct(self, g: jax.Array, prev: jax.Array, ax: ns.MatrixAxes) -> tuple[jax.Array, jax.Array]:
        """``(c_t, g_t)``: the corrected (clipped) gradient, and the gradient to keep as ``g_{t-1}``."""
        g32 = g.astype(jnp.float32)
        gamma, beta = jnp.asarray(self.gamma, jnp.float32), jnp.asarray(self.beta, jnp.float32)  # as injected
        c = g32 + gamma * beta / (1 - beta) * (g32 - prev.astype(jnp.float32))
        if self.clip_c:
            _, fan_in, fan_out = ns.split_axes(c.shape, ax)
            norm = jnp.sqrt(jnp.sum(jnp.square(c), axis=fan_in + fan_out, keepdims=True))
            c = c / jnp.maximum(norm, 1.0)
        return c, g.astype(self.mu_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MarsMuon(MarsMuonDirection, common.MatrixOptimizer):
    """MARS-M on hidden matrices, AdamW elsewhere; hyperparameters as `optim.muon.muon` plus ``gamma``, ``clip_c``."""

    learning_rate: optax.ScalarOrSchedule = 1.2e-2  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.1


scale_by_mars_muon = spec.function(
    MarsMuonDirection, "direction", name="scale_by_mars_muon", positional=("beta", "gamma")
)
mars_muon = spec.function(MarsMuon, name="mars_muon")
