"""Per-element input features of the MLP learned optimizer, after Metz et al.'s ``AdafacMLPLOpt``.

For a parameter tensor ``p`` with gradient ``g`` the accumulators are (``d`` a decay, all fp32):

    m_k   <- d_k m_k + (1 - d_k) g                     momenta, K_m decays
    nu    <- d_v nu + (1 - d_v) g^2                    second moment, one decay
    r_j   <- a_j r_j + (1 - a_j) mean_col(g^2 + eps)   Adafactor row factor,  (..., rows, 1)
    c_j   <- a_j c_j + (1 - a_j) mean_row(g^2 + eps)   Adafactor column factor, (..., 1, cols)
    v_j    = r_j c_j / mean_row(r_j)                   the factored second-moment estimate

on the last two axes (the ``(*batch, fan_in, fan_out)`` kernel layout of `optim.labels`); a tensor of
fewer than two axes keeps the unfactored ``v_j`` in ``r_j`` (``c_j`` is then an unused size-1 leaf,
so every tensor's state has the same fields). Row and column factors keep the tensor's rank, so
`sharding.partition.state_shardings` shards them along the parameter's other axis.

The per-element features, 28 for the default decays (K_m = 3 momenta, one ``nu``, K_a = 3 Adafactor
decays; with ``q = rsqrt``):

    g, p, m_k, nu, m_k q(nu), q(nu), g q(v_j), r_j, c_j, q(r_j), q(c_j), m_j q(v_j)

each normalised over its tensor by its second moment, ``x / sqrt(mean(x^2) + 1e-5)``, then the time
features ``tanh(t / s - 1)`` with ``t = step / num_steps`` for the scales `TIME_SCALES`, which are
not normalised. This is the feature set of ``AdafacMLPLOpt`` (google/learned_optimization,
``learned_optimizers/adafac_mlp_lopt.py``; Metz et al., "Practical tradeoffs between memory, compute,
and performance in learned optimizers", arXiv:2203.11860), with the time embedding taken relative to
the run's length (the reference uses absolute step counts).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

TIME_SCALES = (0.03, 0.1, 0.3, 1.0, 3.0)
FACTOR_EPS = 1e-30  # Adafactor's epsilon_1: keeps the factors of an all-zero gradient positive
NORMALIZE_EPS = 1e-5


class Decays(NamedTuple):
    """Decay rates of the accumulators (arrays: they may be meta-learned)."""

    momentum: jax.Array  # (K_m,); a tuple of floats for the initial decays
    rms: jax.Array  # (1,)
    adafactor: jax.Array  # (K_a,)


class TensorAccumulators(NamedTuple):
    """Accumulators of one parameter tensor."""

    mu: tuple[jax.Array, ...]  # K_m momenta, each shaped like the tensor
    nu: jax.Array  # second moment, shaped like the tensor
    row: tuple[jax.Array, ...]  # K_a row factors (..., rows, 1), or the unfactored v for < 2 axes
    col: tuple[jax.Array, ...]  # K_a column factors (..., 1, cols), or a size-1 placeholder for < 2 axes


def num_features(num_momenta: int = 3, num_adafactor: int = 3) -> int:
    """Length of the feature vector of one element: the normalised features and the time features."""
    return 4 + 2 * num_momenta + 6 * num_adafactor + len(TIME_SCALES)


def is_factored(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2


def init_accumulators(p: jax.Array, num_momenta: int, num_adafactor: int) -> TensorAccumulators:
    zeros = jnp.zeros(p.shape, jnp.float32)
    if is_factored(p.shape):
        row = jnp.zeros((*p.shape[:-1], 1), jnp.float32)
        col = jnp.zeros((*p.shape[:-2], 1, p.shape[-1]), jnp.float32)
    else:
        row, col = zeros, jnp.zeros((1,) * p.ndim, jnp.float32)
    return TensorAccumulators(
        mu=(zeros,) * num_momenta, nu=zeros, row=(row,) * num_adafactor, col=(col,) * num_adafactor
    )


def _ema(old: jax.Array, new: jax.Array, decay: jax.Array) -> jax.Array:
    return decay * old + (1 - decay) * new


def update_accumulators(acc: TensorAccumulators, g: jax.Array, decays: Decays) -> TensorAccumulators:
    """The accumulators after gradient ``g`` (fp32)."""
    sq = jnp.square(g)
    mu = tuple(_ema(m, g, decays.momentum[k]) for k, m in enumerate(acc.mu))
    nu = _ema(acc.nu, sq, decays.rms[0])
    if is_factored(g.shape):
        row_stat = jnp.mean(sq + FACTOR_EPS, axis=-1, keepdims=True)
        col_stat = jnp.mean(sq + FACTOR_EPS, axis=-2, keepdims=True)
        row = tuple(_ema(r, row_stat, decays.adafactor[j]) for j, r in enumerate(acc.row))
        col = tuple(_ema(c, col_stat, decays.adafactor[j]) for j, c in enumerate(acc.col))
    else:
        row = tuple(_ema(r, sq + FACTOR_EPS, decays.adafactor[j]) for j, r in enumerate(acc.row))
        col = acc.col
    return TensorAccumulators(mu, nu, row, col)


def normalize(x: jax.Array) -> jax.Array:
    """``x / sqrt(mean(x^2) + 1e-5)`` over every axis but the last (the feature axis)."""
    axes = tuple(range(x.ndim - 1))
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + NORMALIZE_EPS)


def time_features(step: jax.Array, num_steps: jax.Array) -> jax.Array:
    """``tanh(t / s - 1)`` for ``s`` in `TIME_SCALES`, ``t = step / num_steps``: shape (len(TIME_SCALES),)."""
    t = jnp.asarray(step, jnp.float32) / jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0)
    return jnp.tanh(t / jnp.asarray(TIME_SCALES, jnp.float32) - 1.0)


def features(p: jax.Array, g: jax.Array, acc: TensorAccumulators, time: jax.Array) -> jax.Array:
    """The feature array ``(*p.shape, num_features)`` of one tensor, from the updated accumulators."""
    p, g = p.astype(jnp.float32), g.astype(jnp.float32)
    q_nu = jax.lax.rsqrt(acc.nu + 1e-6)
    raw = [g, p, *acc.mu, acc.nu, *(m * q_nu for m in acc.mu), q_nu]
    factored = is_factored(g.shape)
    for j, (r, c) in enumerate(zip(acc.row, acc.col, strict=True)):
        if factored:
            v = r * c / jnp.mean(r, axis=-2, keepdims=True)
            r, c = jnp.broadcast_to(r, g.shape), jnp.broadcast_to(c, g.shape)
        else:
            v = c = r
        q_v = jax.lax.rsqrt(v + 1e-30)
        # Pair momentum j with Adafactor decay j, as the reference does (m_j exists for j < K_m).
        m = acc.mu[min(j, len(acc.mu) - 1)]
        raw += [g * q_v, r, c, jax.lax.rsqrt(r + 1e-8), jax.lax.rsqrt(c + 1e-8), m * q_v]
    stacked = normalize(jnp.stack(raw, axis=-1))
    return jnp.concatenate([stacked, jnp.broadcast_to(time, (*g.shape, time.shape[0]))], axis=-1)
