"""Scion: momentum, then a norm-constrained linear minimisation oracle per layer (Pethick, Xie,
Antonakopoulos, Zhu, Silveti-Falls and Cevher, "Training Deep Learning Models with Norm-Constrained
LMOs", arXiv:2502.07529).

Each leaf ``W`` with gradient ``G`` has a norm ``||.||`` chosen by its role and a radius ``rho``; the
LMO of the ball of radius ``rho`` is ``lmo(M) = argmin_{||S|| <= rho} <M, S> = -rho d(M)``:

    M_t = (1 - alpha) M_{t-1} + alpha G_t            alpha = ``momentum`` (1 - the usual momentum)
    W_{t+1} = (1 - lr_t) W_t - lr_t rho d(M_t)       constrained=True (Scion; the iterates stay in the ball)
    W_{t+1} = W_t - lr_t rho d(M_t)                  constrained=False (unconstrained Scion)

The constrained step is a Frank-Wolfe step, ``W <- (1 - lr) W + lr lmo(M)``: decoupled weight decay of
exactly ``lr`` on every leaf (Section 3 of the paper). The directions ``d``, by role (`scion_labels`),
with the repo's ``(fan_in, fan_out)`` kernels (PyTorch's ``(d_out, d_in)`` transposed):

- ``"spectral"`` (hidden matrices, the RMS -> RMS operator norm): ``d = s NewtonSchulz(M)`` per
  matrix, ``s = sqrt(fan_out / fan_in)``, or ``max(1, s)`` with ``spectral_max`` (the reference's
  ``Spectral(max=True)``); radius ``radius``.
- ``"embedding"`` (token and position tables ``(vocab, width)``, the 1 -> RMS norm): every row
  normalised to RMS 1, ``d_i = M_i / (||M_i|| / sqrt(width) + 1e-8)`` (the reference's
  ``ColNorm(transpose=True)``); radius ``embedding_radius``.
- ``"head"`` (untied LM heads ``(width, vocab)``, the RMS -> inf norm): ``d = sign(M) / fan_in``
  (``Sign()``); radius ``head_radius``.
- ``"vector"`` (norm scales, biases, scalars): ``d = M / (RMS(M) + 1e-8)`` over the last axis
  (``BiasRMS``); radius ``vector_radius``.

Reference matched step by step (tests/optim/test_scion.py, a float64 NumPy transcription):
github.com/LIONS-EPFL/scion ``scion.py`` (``Scion.step``, the norms above, Jordan's Newton-Schulz).
Defaults are its modded-nanogpt group settings (embedding ColNorm radius 1, hidden Spectral(max)
radius 3, head Sign radius 10, ``lr = 0.01``, ``momentum = 0.1``), unswept here. A tied embedding
(also the LM head) is labelled ``"embedding"``; the reference's weight-sharing example instead uses
Sign on it: pass ``param_labels`` to choose. The momentum is kept for every leaf (``momentum = 1``
gives ``M_t = G_t``, the reference's no-buffer case, to rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from optim import labels, shapes, spec
from optim import newton_schulz as ns
from optim.muon import NewtonSchulz, check_matrices

SPECTRAL, EMBEDDING, HEAD, VECTOR = "spectral", "embedding", "head", "vector"
_EPS = 1e-8  # the reference's, in every norm but the spectral one


def scion_labels(params: Any) -> Any:
    """Every leaf's role: hidden matrices (`optim.labels.matrix_labels`) ``"spectral"``, LM heads
    ``"head"``, other vocabulary / position tables ``"embedding"``, everything else ``"vector"``."""
    matrix = labels.matrix_labels(params)

    def label(path, leaf, kind):
        if kind == labels.MATRIX:
            return SPECTRAL
        if getattr(leaf, "ndim", 0) >= 2 and labels.is_embedding_path(path, labels.READOUT_NAMES):
            return HEAD
        if getattr(leaf, "ndim", 0) >= 2 and labels.is_embedding_path(path):
            return EMBEDDING
        return VECTOR

    return jax.tree_util.tree_map_with_path(label, params, matrix)


def _stateless(direction: Callable[[Any], Any]) -> optax.GradientTransformation:
    def update_fn(updates, state, params=None, **extra):
        del params, extra
        return direction(updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _in_gradient_dtype(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with its updates cast to the incoming gradients' dtypes (its momentum is float32)."""

    def update_fn(updates, state, params=None, **extra):
        out, state = inner.update(updates, state, params, **extra)
        return jax.tree.map(lambda u, g: u.astype(g.dtype), out, updates), state

    return optax.GradientTransformation(inner.init, update_fn)


def row_rms_direction(m: jax.Array) -> jax.Array:
    """``M / (RMS(M) + 1e-8)`` over the last axis (a scalar: its sign, to ``1e-8``)."""
    m = m.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(jnp.square(m), axis=-1, keepdims=True)) if m.ndim else jnp.abs(m)
    return m / (rms + _EPS)


def sign_direction(m: jax.Array) -> jax.Array:
    """``sign(M) / fan_in`` for a ``(*batch, fan_in, fan_out)`` leaf."""
    return jnp.sign(m.astype(jnp.float32)) / m.shape[-2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScionDirection(NewtonSchulz):
    """Scion's direction ``rho d(M_t)`` per leaf role (module docstring), no learning rate.

    Attributes:
      momentum: ``alpha`` in ``M <- (1 - alpha) M + alpha G``; 1 - the usual momentum.
      radius: radius of the hidden matrices' spectral ball.
      spectral_max: scale ``max(1, sqrt(fan_out / fan_in))`` instead of ``sqrt(fan_out / fan_in)``.
      embedding_radius: radius of the embeddings' row-RMS ball.
      head_radius: radius of the LM head's sign (max-norm) ball.
      vector_radius: radius of the norm scales' and biases' RMS ball.
      param_labels: a tree or function of roles (``"spectral"``, ``"embedding"``, ``"head"``,
        ``"vector"``); None: `scion_labels`.
      (ns_*: `optim.muon.NewtonSchulz`.)
    """

    momentum: float = spec.param(0.1, valid="(0, 1]")
    radius: float = spec.param(3.0, valid="(0, inf)")
    spectral_max: bool = True
    embedding_radius: float = spec.param(1.0, valid="(0, inf)")
    head_radius: float = spec.param(10.0, valid="(0, inf)")
    vector_radius: float = spec.param(1.0, valid="(0, inf)")
    param_labels: Callable[[Any], Any] | Any | None = spec.code_only()

    family: ClassVar[str] = "scion"

    def _spectral(self, tree: Any) -> Any:
        ortho = self.orthogonalize(tree, None)

        def scale(o):
            fan_in, fan_out = ns.fans(o.shape, ns.MatrixAxes())
            s = (fan_out / fan_in) ** 0.5
            return o * (max(1.0, s) if self.spectral_max else s)

        return jax.tree.map(scale, ortho)

    def direction(self) -> optax.GradientTransformation:
        def scaled_lmo(r, fn):
            return _stateless(lambda tree: jax.tree.map(lambda x: r * x, fn(tree)))

        def spectral_init(params):
            check_matrices(params, None, self.family)
            return optax.EmptyState()

        spectral = scaled_lmo(self.radius, self._spectral)
        lmos = {
            SPECTRAL: optax.GradientTransformation(spectral_init, spectral.update),
            EMBEDDING: scaled_lmo(self.embedding_radius, lambda t: jax.tree.map(row_rms_direction, t)),
            HEAD: scaled_lmo(self.head_radius, lambda t: jax.tree.map(sign_direction, t)),
            VECTOR: scaled_lmo(self.vector_radius, lambda t: jax.tree.map(row_rms_direction, t)),
        }
        return _in_gradient_dtype(
            optax.chain(
                # 1 - momentum in float32, as under optax.inject_hyperparams (where momentum is an array)
                optax.ema(1 - jnp.asarray(self.momentum, jnp.float32), debias=False, accumulator_dtype=jnp.float32),
                optax.partition(lmos, scion_labels if self.param_labels is None else self.param_labels),
            )
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scion(ScionDirection, spec.OptimizerSpec):
    """Scion with its own weight decay form: ``constrained`` (module docstring).

    Attributes:
      constrained: ``W <- (1 - lr) W - lr rho d(M)`` (True) or ``W <- W - lr rho d(M)``.
    """

    learning_rate: optax.ScalarOrSchedule = 0.01  # the reference's modded-nanogpt setting, unswept here
    constrained: bool = True

    def transform(self) -> optax.GradientTransformationExtraArgs:
        full = optax.chain(
            self.direction(),
            optax.add_decayed_weights(1.0 if self.constrained else 0.0),
            optax.scale_by_learning_rate(self.learning_rate),
        )
        return shapes.checked(full, "scion")


scale_by_scion = spec.function(ScionDirection, "direction", name="scale_by_scion", positional=("momentum",))
scion = spec.function(Scion, name="scion")
