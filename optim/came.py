"""CAME: Confidence-guided Adaptive Memory Efficient optimization (Luo et al., arXiv:2307.02047,
Algorithm 1; reference code yangluo7/CAME ``came_pytorch/CAME.py``).

Adafactor's factored second moment plus a factored "confidence" that rescales the momentum. For a
matrix ``G`` (``n x m``, the last two axes of a leaf; leading axes are batch axes):

    r_t = b2 r_{t-1} + (1 - b2) mean_j(G^2 + eps1)        row statistics, (n, 1)
    c_t = b2 c_{t-1} + (1 - b2) mean_i(G^2 + eps1)        column statistics, (1, m)
    U_t = G / sqrt(r_t c_t / mean_i(r_t))                  Adafactor's factored v_t
    U_t <- U_t / max(1, RMS(U_t) / d)                      update clipping
    m_t = b1 m_{t-1} + (1 - b1) U_t
    I_t = (U_t - m_t)^2 + eps2                             instability
    R_t = b3 R_{t-1} + (1 - b3) mean_j(I_t)                (n, 1)
    C_t = b3 C_{t-1} + (1 - b3) mean_i(I_t)                (1, m)
    w_t = w_{t-1} - lr_t (m_t / sqrt(R_t C_t / mean_i(R_t)) + lambda w_{t-1})

Leaves that are not factored (fewer than two axes, or a last-two-axes side below
``min_dim_size_to_factor``) keep a full ``v_t = b2 v + (1 - b2)(G^2 + eps1)``, ``U_t = G / sqrt(v_t)``,
and step along ``m_t`` (no confidence term), as in the reference. Defaults are the paper's:
``b1, b2, b3 = 0.9, 0.999, 0.9999``, ``eps1, eps2 = 1e-30, 1e-16``, ``d = 1``; no bias correction.

Choices where the reference is per tensor: for a stack of matrices ``(*batch, n, m)`` the factored
statistics and the RMS are per matrix, which equals the reference on each unstacked matrix.
``min_dim_size_to_factor = 128`` follows optax's Adafactor (the reference factors every tensor of two
or more axes; set it to 1 for that), so that stacks of vectors such as scan-stacked norm scales
``(layers, d)`` keep a full second moment. Factored statistics keep both matrix axes (size 1 where
reduced), so they take the parameter's sharding on the axes they keep (`sharding.partition.state_shardings`).
Under `optax.inject_hyperparams`, pass ``static_args=("min_dim_size_to_factor",)``: it decides shapes.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, shapes, spec


class ScaleByCameState(NamedTuple):
    """State of `scale_by_came`; factored fields are ``(1,)`` placeholders on unfactored leaves and vice versa (checkpoints cannot hold empty arrays)."""

    mu: optax.Updates  # m_t, EMA of the clipped update, shaped like the parameters
    v_row: optax.Updates  # r_t, (*batch, n, 1) EMA of row means of G^2 + eps1
    v_col: optax.Updates  # c_t, (*batch, 1, m) EMA of column means of G^2 + eps1
    v: optax.Updates  # v_t, full EMA of G^2 + eps1 for unfactored leaves
    res_row: optax.Updates  # R_t, (*batch, n, 1) EMA of row means of the instability
    res_col: optax.Updates  # C_t, (*batch, 1, m) EMA of column means of the instability


def _factored(shape: tuple[int, ...], min_dim: int) -> bool:
    return len(shape) >= 2 and min(shape[-2:]) >= min_dim


def _inv_sqrt_factored(row: jax.Array, col: jax.Array) -> jax.Array:
    """``1 / sqrt(row col / mean_i(row))``, the reciprocal root of the rank-1 estimate."""
    return jax.lax.rsqrt(row / jnp.mean(row, axis=-2, keepdims=True)) * jax.lax.rsqrt(col)


def _rms(x: jax.Array) -> jax.Array:
    axes = (-2, -1) if x.ndim >= 2 else None
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=x.ndim >= 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CameDirection:
    """The CAME direction (module docstring), without learning rate or weight decay.

    Attributes:
      b1: decay of the momentum ``m``.
      b2: decay of the (factored) second moment.
      b3: decay of the factored instability.
      eps1: added to ``G^2``.
      eps2: added to the instability ``(U - m)^2``.
      clip_threshold: ``d``, the largest RMS of the preconditioned update ``U``.
      min_dim_size_to_factor: factor a leaf's last two axes only when both are at least this long.
    """

    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.999, valid="[0, 1)")
    b3: float = spec.param(0.9999, valid="[0, 1)")
    eps1: float = spec.param(1e-30, valid="(0, inf)")
    eps2: float = spec.param(1e-16, valid="(0, inf)")
    clip_threshold: float = spec.param(1.0, valid="(0, inf)")
    min_dim_size_to_factor: int = spec.param(128, valid="[1, inf)")

    static_args: ClassVar[tuple[str, ...]] = ("min_dim_size_to_factor",)

    def direction(self) -> optax.GradientTransformation:
        return _scale_by_came(self)


def _scale_by_came(h: CameDirection) -> optax.GradientTransformation:
    min_dim = common.static_int("min_dim_size_to_factor", h.min_dim_size_to_factor, h.static_args)

    def init_fn(params: optax.Params) -> ScaleByCameState:
        common.check_floating(params, "came", "mask it out")

        def zeros(shape):
            return jnp.zeros(shape, jnp.float32)

        def row(p):
            return zeros((*p.shape[:-1], 1) if _factored(p.shape, min_dim) else (1,))

        def col(p):
            return zeros((*p.shape[:-2], 1, p.shape[-1]) if _factored(p.shape, min_dim) else (1,))

        def full(p):
            return zeros((1,) if _factored(p.shape, min_dim) else p.shape)

        return ScaleByCameState(
            mu=jax.tree.map(lambda p: zeros(p.shape), params),
            v_row=jax.tree.map(row, params),
            v_col=jax.tree.map(col, params),
            v=jax.tree.map(full, params),
            res_row=jax.tree.map(row, params),
            res_col=jax.tree.map(col, params),
        )

    def leaf_update(g, m, v_row, v_col, v, res_row, res_col):
        g32 = g.astype(jnp.float32)
        g2 = jnp.square(g32) + h.eps1
        if _factored(g.shape, min_dim):
            v_row = h.b2 * v_row + (1 - h.b2) * jnp.mean(g2, axis=-1, keepdims=True)
            v_col = h.b2 * v_col + (1 - h.b2) * jnp.mean(g2, axis=-2, keepdims=True)
            u = g32 * _inv_sqrt_factored(v_row, v_col)
        else:
            v = h.b2 * v + (1 - h.b2) * g2
            u = g32 * jax.lax.rsqrt(v)
        u = u / jnp.maximum(1.0, _rms(u) / h.clip_threshold)
        m = h.b1 * m + (1 - h.b1) * u
        if _factored(g.shape, min_dim):
            res = jnp.square(u - m) + h.eps2
            res_row = h.b3 * res_row + (1 - h.b3) * jnp.mean(res, axis=-1, keepdims=True)
            res_col = h.b3 * res_col + (1 - h.b3) * jnp.mean(res, axis=-2, keepdims=True)
            direction = m * _inv_sqrt_factored(res_row, res_col)
        else:
            direction = m
        return direction.astype(g.dtype), (m, v_row, v_col, v, res_row, res_col)

    def update_fn(updates: optax.Updates, state: ScaleByCameState, params: optax.Params | None = None):
        del params
        shapes.check_like(updates, state.mu, "came")
        treedef = jax.tree.structure(updates)
        flat = [treedef.flatten_up_to(x) for x in (updates, *state)]
        out = [leaf_update(*args) for args in zip(*flat, strict=True)]
        direction = treedef.unflatten([d for d, _ in out])
        fields = [treedef.unflatten([s[i] for _, s in out]) for i in range(len(state))]
        return direction, ScaleByCameState(*fields)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Came(CameDirection, common.DirectionOptimizer):
    """CAME with decoupled weight decay on weights, not norm scales or biases (`optim.labels.decay_mask`).

    ``w <- w - lr (came_direction + weight_decay w)``; ``weight_decay = 0`` as in the reference.
    Hyperparameters: `CameDirection`.
    """

    learning_rate: optax.ScalarOrSchedule = 3.75e-4  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.0


scale_by_came = spec.function(
    CameDirection, "direction", name="scale_by_came", positional=tuple(spec.defaults(CameDirection))
)
came = spec.function(Came, name="came")
