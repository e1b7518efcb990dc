"""NorMuon: Muon with a per-neuron second moment (Li et al., arXiv:2510.05491).

Muon's orthogonalised update has equal singular values but very unequal row norms: some output
neurons get much larger updates than others. NorMuon evens them out with an Adam-like second moment
kept per output neuron, then restores the update's overall size:

    D_t = momentum direction of G_t (as Muon: EMA + Nesterov by default)
    O_t = NewtonSchulz(D_t)
    v_t = beta2 v_{t-1} + (1 - beta2) mean_over_fan_in(O_t * O_t)    one value per output neuron
    P_t = O_t / (sqrt(v_t) + eps)
    P_t <- P_t * ||O_t||_F / (||P_t||_F + eps)                      per matrix
    W_{t+1} = W_t - lr_t (s(W) P_t + lambda W_t)

An output neuron is a column of the repo's ``(fan_in, fan_out)`` kernel (a row of PyTorch's
``(out, in)`` weight), so ``v`` has the parameter's shape with the fan-in axes reduced to size 1:
one vector per matrix. It is replicated by the generic state-sharding rule (it matches no
parameter's shape), which costs ``fan_out`` floats per matrix.

This follows the official reference code (github.com/zichongli5/NorMuon, ``normuon_update``:
``eps = 1e-10``, ``beta2 = 0.95``, no bias correction, Frobenius-norm preservation then the shape
scale). The paper's Algorithm 1 writes the last step as ``0.2 sqrt(m n) / ||P_t||_F``, which is
the ``"moonlight"`` shape scale here (the default) when ``O_t`` is exactly orthogonal; the reference
code uses ``"jordan"``. Everything else (momentum forms, Newton-Schulz presets, batching, sharding,
parameter routing) is Muon's, see optim/muon.py: NorMuon is `optim.muon.scale_by_muon_core` with the
per-neuron normalisation plugged in after Newton-Schulz.
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


class NorMuonState(NamedTuple):
    """State of `scale_by_normuon`."""

    mu: optax.Updates  # momentum buffer M_t, shaped like the parameters
    nu: optax.Updates  # per-neuron second moment v_t: parameter shape with fan-in axes of size 1


def _nu_shape(shape: tuple[int, ...], axes: ns.MatrixAxes) -> tuple[int, ...]:
    _, fan_in, _ = ns.split_axes(shape, axes)
    return tuple(1 if i in fan_in else d for i, d in enumerate(shape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NorMuonDirection(MuonDirection):
    """NorMuon's direction ``s(W) P_t`` (module docstring); other fields as `optim.muon.MuonDirection`.

    Attributes:
      beta2: decay of the per-neuron second moment.
      eps: added to ``sqrt(v_t)`` and to ``||P_t||_F``.
    """

    beta2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-10, valid="(0, inf)")

    family: ClassVar[str] = "normuon"

    def direction(self) -> optax.GradientTransformation:
        return scale_by_muon_core(self, NorMuonState, normalization=MatrixStep("nu", self._init_nu, self._normalize))

    def _init_nu(self, p: jax.Array, ax: ns.MatrixAxes) -> jax.Array:
        return jnp.zeros(_nu_shape(p.shape, ax), jnp.float32)

    def _normalize(self, o: jax.Array, nu: jax.Array, ax: ns.MatrixAxes) -> tuple[jax.Array, jax.Array]:
        """``(P_t, v_t)`` from ``O_t`` and ``v_{t-1}``, before the shape scale."""
        _, fan_in, fan_out = ns.split_axes(o.shape, ax)
        nu = self.beta2 * nu + (1 - self.beta2) * jnp.mean(jnp.square(o), axis=fan_in, keepdims=True)
        p = o / (jnp.sqrt(nu) + self.eps)
        matrix = fan_in + fan_out
        o_norm = jnp.sqrt(jnp.sum(jnp.square(o), axis=matrix, keepdims=True))
        p_norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=matrix, keepdims=True))
        return p * (o_norm / (p_norm + self.eps)), nu


@dataclasses.dataclass(frozen=True, kw_only=True)
class NorMuon(NorMuonDirection, common.MatrixOptimizer):
    """NorMuon on hidden matrices, AdamW elsewhere; hyperparameters as `optim.muon.muon` plus ``beta2``, ``eps``."""

    learning_rate: optax.ScalarOrSchedule = 1.2e-2  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.1


scale_by_normuon = spec.function(NorMuonDirection, "direction", name="scale_by_normuon", positional=("beta", "beta2"))
normuon = spec.function(NorMuon, name="normuon")
