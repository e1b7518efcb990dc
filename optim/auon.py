"""AuON: Muon's momentum bounded by a hyperbolic-cosine RMS scale instead of Newton-Schulz (Maity,
"AuON: A Linear-time Alternative to Semi-Orthogonal Momentum Updates", arXiv:2509.24320).

For each hidden matrix ``W`` (``(*batch, fan_in, fan_out)``, each matrix of a stack on its own) with
momentum direction ``D_t`` (Muon's: EMA + Nesterov by default) and ``N`` entries per matrix:

    X_t = D_t / (||D_t||_F + 1e-7)
    r_t = sqrt(mean(cosh(gamma X_t)^2))                     the RMS of cosh over the matrix
    U_t = X_t / (r_t + 1e-8)
    W_{t+1} = W_t - lr_t (s(W) U_t + lambda W_t)

Linear in the matrix size: no matrix product, where Newton-Schulz costs three per step (15 for Jordan's 5).
``U_t`` keeps the direction and the ratios of ``D_t`` and has Frobenius norm ``1 / (r_t + 1e-8) <= 1``;
a spiky ``X_t`` (heavy tails) raises ``r_t`` and shrinks the step (the paper's "emergency brake").

Sources: the paper's Section 3.1 equations (``gamma = 1``, the default) and the authors' code
(github.com/ryyzn9/AuON): the training script of the paper's experiments (``Auon_Adam_train.py``:
Jordan's EMA-Nesterov momentum with ``beta = 0.95``, the bound above, Jordan's shape scale
``sqrt(max(1, fan_out / fan_in))``, AdamW at 0.1 times AuON's learning rate for the other
parameters) and its later ``auon/optimizer.py``, which adds ``gamma`` (1.5 there) inside the cosh. That
later file divides the *unnormalised* ``D_t`` by ``r_t``, which is not scale-invariant as the paper
says the update is; this module follows the paper. The Hybrid-AuON variant (one Newton-Schulz step
first) is not here. Default learning rate: the paper's language-model setting, ``0.055``, unswept here.

Momentum forms, routing and state are Muon's (optim/muon.py): AuON is `optim.muon.scale_by_muon_core`
with this bound as its ``orthogonalize``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from optim import common, spec
from optim import newton_schulz as ns
from optim.muon import MatrixMomentum, MuonState, scale_by_muon_core


def cosh_rms_bound(d: jax.Array, axes: ns.MatrixAxes, gamma: jax.typing.ArrayLike = 1.0) -> jax.Array:
    """``U`` of the module docstring for every matrix of ``d`` (float32)."""
    _, fan_in, fan_out = ns.split_axes(d.shape, axes)
    matrix = fan_in + fan_out
    d = d.astype(jnp.float32)
    x = d / (jnp.sqrt(jnp.sum(jnp.square(d), axis=matrix, keepdims=True)) + 1e-7)
    r = jnp.sqrt(jnp.mean(jnp.square(jnp.cosh(jnp.asarray(gamma, jnp.float32) * x)), axis=matrix, keepdims=True))
    return x / (r + 1e-8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuonDirection(MatrixMomentum):
    """AuON's direction ``s(W) U_t`` (module docstring); other fields as `optim.muon.MatrixMomentum`.

    Attributes:
      gamma: scale of the normalised momentum inside the cosh (the paper: 1; the authors' later code: 1.5).
    """

    gamma: float = spec.param(1.0, valid="(0, inf)")
    shape_scale: str = "jordan"

    family: ClassVar[str] = "auon"

    def orthogonalize(self, tree: Any, axes: ns.AxesSpec) -> Any:
        return jax.tree.map(lambda d, ax: cosh_rms_bound(d, ax, self.gamma), tree, ns.matrix_axes_tree(tree, axes))

    def direction(self) -> optax.GradientTransformation:
        return scale_by_muon_core(self, MuonState)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Auon(AuonDirection, common.MatrixOptimizer):
    """AuON on hidden matrices, AdamW (at ``adam_lr_ratio`` of the rate) elsewhere; the authors' settings."""

    learning_rate: optax.ScalarOrSchedule = 0.055  # the paper's language-model setting, unswept here
    weight_decay: float = 0.01  # the authors' README example
    adam_lr_ratio: float = 0.1  # the authors' training script: AdamW at 0.1 x AuON's rate


scale_by_auon = spec.function(AuonDirection, "direction", name="scale_by_auon", positional=("beta",))
auon = spec.function(Auon, name="auon")
