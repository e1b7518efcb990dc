"""Hyperball optimizers: hidden matrices kept on the sphere of their initial Frobenius norm
(levanter's MuonH and AdamH: stanford-crfm/levanter, ``levanter.optim.adamh`` and its ``muonH`` config).

For each hidden matrix ``W`` (per matrix of a ``(*batch, fan_in, fan_out)`` leaf), with ``u_t`` a
base optimizer's direction and ``R = ||W_t||_F``:

    V = W_t - lr_t R u_t / max(||u_t||_F, 1e-10)
    W_{t+1} = R V / max(||V||_F, 1e-10)
            = W_t + (rho - 1) W_t - lr_t R rho u_t / max(||u_t||_F, 1e-10),   rho = R / max(||V||_F, 1e-10)

The step keeps ``||W||_F`` (up to float rounding), so every matrix stays on the sphere of its
initial norm, and ``lr_t`` is a *relative* step: before the projection the step has length
``lr_t ||W_t||_F``.
The base directions:

- `muon_hyperball` (MuonH): ``u_t = NewtonSchulz(D_t)``, Muon's momentum direction (EMA +
  Nesterov, beta 0.95); Muon's shape scale cancels in ``u / ||u||``.
- `adam_hyperball` (AdamH): ``u_t = m_hat_t / (sqrt(v_hat_t) + eps)``, bias-corrected Adam.

Hyperball matrices take no weight decay (the sphere replaces it; levanter's rule for the learning
rate is ``sqrt(lr * weight_decay)`` of the decayed optimizer). Everything else (embeddings, LM head,
norms, biases) is AdamW at ``adam_lr_ratio * learning_rate`` with ``weight_decay`` on the leaves
`optim.labels.decay_mask` picks (levanter: plain Adam, no decay; its AdamH also takes the LM head,
which here stays with AdamW as in every matrix family: pass ``param_labels`` to move it).

Reference matched step by step (tests/optim/test_hyperball.py, a float64 NumPy transcription of the
levanter files): the radius is the current norm, as in levanter's MuonH; its AdamH stores
``||W_0||_F`` at ``init`` instead, the same number up to the rounding of earlier steps. Taking the
current norm costs no state and makes ``lr_t = 0`` leave ``W`` exactly unchanged (``rho = 1``). The
update is the second form above, levanter AdamH's (which computes ``||V||^2`` in closed form,
``||W||^2 - 2 lr R <W, u> / ||u|| + lr^2 R^2``). A zero matrix has ``R = 0`` and stays zero.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, labels, shapes, spec
from optim import newton_schulz as ns
from optim.muon import MuonDirection, check_matrices

_FLOOR = 1e-10  # levanter's floor on both Frobenius norms


class HyperballState(NamedTuple):
    """State of `hyperball`."""

    count: jax.Array  # steps taken, int32 (the learning rate schedule's argument)
    inner: optax.OptState  # the base direction's state


def _matrix_norm(x: jax.Array, ax: ns.MatrixAxes) -> jax.Array:
    _, fan_in, fan_out = ns.split_axes(x.shape, ax)
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=fan_in + fan_out, keepdims=True))


def hyperball(
    direction: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    dimension_numbers: ns.AxesSpec = None,
) -> optax.GradientTransformation:
    """The full update ``W_{t+1} - W_t`` of the module docstring, with ``u_t`` from ``direction``."""

    def init_fn(params):
        return HyperballState(count=jnp.zeros([], jnp.int32), inner=direction.init(params))

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("hyperball needs the parameters: call update(grads, state, params)")
        u, inner = direction.update(updates, state.inner, params, **extra)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        axes = ns.matrix_axes_tree(params, dimension_numbers)

        def step(w, u, ax, g):
            w = w.astype(jnp.float32)
            r = _matrix_norm(w, ax)
            u_hat = u.astype(jnp.float32) / jnp.maximum(_matrix_norm(u, ax), _FLOOR)
            rho = r / jnp.maximum(_matrix_norm(w - lr * r * u_hat, ax), _FLOOR)
            return (w * (rho - 1) - lr * r * rho * u_hat).astype(g.dtype)

        out = jax.tree.map(step, params, u, axes, updates)
        return out, HyperballState(count=optax.safe_increment(state.count), inner=inner)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HyperballOptimizer(common.AdamGroup, spec.OptimizerSpec):
    """A hyperball family's full optimizer: `hyperball` of ``base()`` on hidden matrices, AdamW elsewhere.

    Attributes:
      weight_decay: decoupled weight decay of the AdamW group only (hyperball matrices take none).
    """

    weight_decay: float = common.weight_decay_field()

    applies_weight_decay: ClassVar[bool] = True
    family: ClassVar[str] = "hyperball"

    def base(self) -> optax.GradientTransformation:
        raise NotImplementedError(f"{type(self).__name__} must define base()")

    def transform(self) -> optax.GradientTransformation:
        lr, ratio = self.learning_rate, self.adam_lr_ratio
        adam_lr = self.adam_learning_rate
        if adam_lr is None:
            adam_lr = (lambda count: ratio * lr(count)) if callable(lr) else ratio * lr
        adam = optax.adamw(
            adam_lr, self.adam_b1, self.adam_b2, self.adam_eps, weight_decay=self.weight_decay, mask=labels.decay_mask
        )
        matrix = hyperball(self.base(), lr, self._axes())
        full = optax.partition(
            {labels.MATRIX: matrix, labels.ADAM: adam},
            labels.matrix_labels if self.param_labels is None else self.param_labels,
        )
        return shapes.checked(full, type(self).__name__.lower())

    def _axes(self) -> ns.AxesSpec:
        return None


def _checked(tx: optax.GradientTransformation, axes: ns.AxesSpec, family: str) -> optax.GradientTransformation:
    def init_fn(params):
        check_matrices(params, axes, family)
        return tx.init(params)

    return optax.GradientTransformation(init_fn, tx.update)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonHyperball(MuonDirection, HyperballOptimizer):
    """MuonH: `hyperball` of Muon's direction (other fields as `optim.muon.MuonDirection`)."""

    learning_rate: optax.ScalarOrSchedule = 0.02  # relative step; unswept here (see the module docstring)
    weight_decay: float = 0.1
    adam_lr_ratio: float = spec.param(0.15, valid="[0, inf)")  # AdamW group at 3e-3, the AdamW default

    family: ClassVar[str] = "muon_hyperball"

    def base(self) -> optax.GradientTransformation:
        return self.direction()

    def _axes(self) -> ns.AxesSpec:
        return self.dimension_numbers


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamHyperball(HyperballOptimizer):
    """AdamH: `hyperball` of Adam's direction.

    Attributes:
      b1: Adam's first-moment decay on the hyperball matrices.
      b2: Adam's second-moment decay on the hyperball matrices.
      eps: Adam's epsilon on the hyperball matrices.
    """

    learning_rate: optax.ScalarOrSchedule = 0.02  # relative step; unswept here (see the module docstring)
    weight_decay: float = 0.1
    adam_lr_ratio: float = spec.param(0.15, valid="[0, inf)")
    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="[0, inf)")

    family: ClassVar[str] = "adam_hyperball"

    def base(self) -> optax.GradientTransformation:
        return _checked(optax.scale_by_adam(self.b1, self.b2, self.eps, mu_dtype=jnp.float32), None, self.family)


muon_hyperball = spec.function(MuonHyperball, name="muon_hyperball")
adam_hyperball = spec.function(AdamHyperball, name="adam_hyperball")
