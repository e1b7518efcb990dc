"""Per-element input features of the MLP learned optimizer, after Metz et al.'s ``AdafacMLPLOpt``.

For a parameter tensor ``p`` with gradient ``g`` the accumulators are (``d`` a decay, all fp32):

    m_k   <- d_k m_k + (1 - d_k) g                     momenta, K_m decays
    nu    <- d_v nu + (1 - d_v) g^2                    second moment, one decay
    r_j   <- a_j r_j + (1 - a_j) mean_col(g^2 + eps)   Adafactor row factor,  (..., rows, 1)
    c_j   <- a_j c_j + (1 - a_j) mean_row(g^2 + eps)   Adafactor column factor, (..., 1, cols)
    v_j    = r_j c_j / mean_row(r_j)                   the factored second-moment estimate

A leaf is a stack of *tensors* (`tensor_axes`): its trailing two axes for a matrix (the
``(*batch, fan_in, fan_out)`` kernel layout of `optim.labels`: leading axes are scan-stacked layers or
experts), its last axis for a vector by role (a norm scale or bias, stacked ``(layers, d)`` or not),
none for a scalar. Each tensor is an independent problem, so a scan-stacked leaf gets exactly the
steps its layers would get as separate leaves. A matrix is factored as the reference factors its two
largest axes: ``r_j`` averages over the longer side (``mean_col`` above when ``cols >= rows``; over
rows when ``rows > cols``), ``c_j`` over the shorter one. A vector keeps the unfactored ``v_j`` in
``r_j`` (``c_j`` is then an unused size-1 leaf, so every tensor's state has the same fields). Row and
column factors keep the leaf's rank, so `sharding.partition.state_shardings` shards them along the
parameter's other axis.

The per-element features, 28 for the default decays (K_m = 3 momenta, one ``nu``, K_a = 3 Adafactor
decays; with ``q = rsqrt``):

    g, p, m_k, nu, m_k q(nu), q(nu), g q(v_j), r_j, c_j, q(r_j), q(c_j), m_j q(v_j)

each normalised over its tensor (per layer of a stack) by its second moment,
``x / sqrt(mean(x^2) + 1e-5)``, then the time
features ``tanh(t / s - 1)`` with ``t = step / num_steps`` for the scales `TIME_SCALES`, which are
not normalised. This is the feature set of ``AdafacMLPLOpt`` (google/learned_optimization,
``learned_optimizers/adafac_mlp_lopt.py``; Metz et al., "Practical tradeoffs between memory, compute,
and performance in learned optimizers", arXiv:2203.11860), with the time embedding taken relative to
the run's length (the reference uses absolute step counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optim import labels

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


def tensor_axes(path: Sequence[Any], shape: tuple[int, ...]) -> int:
    """How many trailing axes of a leaf form one tensor: 2 for a matrix, 1 for a vector by role
    (`optim.labels.is_vector`: a 1-D leaf, or a stacked norm scale or bias), 0 for a scalar."""
    if not shape:
        return 0
    return 1 if labels.is_vector(path, shape) else 2


def factored_axes(shape: tuple[int, ...]) -> tuple[int, int]:
    """The axes ``(a_r, a_c)`` that the row and column factors of a matrix average over: the longer
    of its two axes first (the reference's two largest axes; the columns on a tie)."""
    return (-1, -2) if shape[-1] >= shape[-2] else (-2, -1)


def _factor_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    a_r, a_c = factored_axes(shape)
    return tuple(1 if i == a_r % len(shape) else n for i, n in enumerate(shape)), tuple(
        1 if i == a_c % len(shape) else n for i, n in enumerate(shape)
    )


def init_accumulators(p: jax.Array, num_momenta: int, num_adafactor: int, axes: int) -> TensorAccumulators:
    """Zero accumulators for a leaf of ``axes`` tensor axes (`tensor_axes`), each in its own buffer."""

    def zeros(shape):  # a fresh buffer per field: a donating jit step must never see one twice
        return jnp.zeros(shape, jnp.float32)

    if axes == 2:
        row_shape, col_shape = _factor_shapes(p.shape)
    else:
        row_shape, col_shape = p.shape, (1,) * p.ndim
    return TensorAccumulators(
        mu=tuple(zeros(p.shape) for _ in range(num_momenta)),
        nu=zeros(p.shape),
        row=tuple(zeros(row_shape) for _ in range(num_adafactor)),
        col=tuple(zeros(col_shape) for _ in range(num_adafactor)),
    )


def _ema(old: jax.Array, new: jax.Array, decay: jax.Array) -> jax.Array:
    return decay * old + (1 - decay) * new


def update_accumulators(acc: TensorAccumulators, g: jax.Array, decays: Decays, axes: int) -> TensorAccumulators:
    """The accumulators after gradient ``g`` (fp32) of a leaf of ``axes`` tensor axes."""
    sq = jnp.square(g)
    mu = tuple(_ema(m, g, decays.momentum[k]) for k, m in enumerate(acc.mu))
    nu = _ema(acc.nu, sq, decays.rms[0])
    if axes == 2:
        a_r, a_c = factored_axes(g.shape)
        row_stat = jnp.mean(sq + FACTOR_EPS, axis=a_r, keepdims=True)
        col_stat = jnp.mean(sq + FACTOR_EPS, axis=a_c, keepdims=True)
        row = tuple(_ema(r, row_stat, decays.adafactor[j]) for j, r in enumerate(acc.row))
        col = tuple(_ema(c, col_stat, decays.adafactor[j]) for j, c in enumerate(acc.col))
    else:
        row = tuple(_ema(r, sq + FACTOR_EPS, decays.adafactor[j]) for j, r in enumerate(acc.row))
        col = acc.col
    return TensorAccumulators(mu, nu, row, col)


def normalize(x: jax.Array, axes: int) -> jax.Array:
    """``x / sqrt(mean(x^2) + 1e-5)`` over the ``axes`` tensor axes before the last (the feature axis)."""
    over = tuple(range(x.ndim - 1 - axes, x.ndim - 1))
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=over, keepdims=True) + NORMALIZE_EPS)


def time_features(step: jax.Array, num_steps: jax.Array) -> jax.Array:
    """``tanh(t / s - 1)`` for ``s`` in `TIME_SCALES`, ``t = step / num_steps``: shape (len(TIME_SCALES),)."""
    t = jnp.asarray(step, jnp.float32) / jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0)
    return jnp.tanh(t / jnp.asarray(TIME_SCALES, jnp.float32) - 1.0)


def features(p: jax.Array, g: jax.Array, acc: TensorAccumulators, time: jax.Array, axes: int) -> jax.Array:
    """The feature array ``(*p.shape, num_features)`` of a leaf of ``axes`` tensor axes, from the
    updated accumulators."""
    p, g = p.astype(jnp.float32), g.astype(jnp.float32)
    q_nu = jax.lax.rsqrt(acc.nu + 1e-6)
    raw = [g, p, *acc.mu, acc.nu, *(m * q_nu for m in acc.mu), q_nu]
    factored = axes == 2
    for j, (r, c) in enumerate(zip(acc.row, acc.col, strict=True)):
        if factored:
            v = r * c / jnp.mean(r, axis=factored_axes(g.shape)[1], keepdims=True)
            r, c = jnp.broadcast_to(r, g.shape), jnp.broadcast_to(c, g.shape)
        else:
            v = c = r
        q_v = jax.lax.rsqrt(v + 1e-30)
        # Pair momentum j with Adafactor decay j, as the reference does (m_j exists for j < K_m).
        m = acc.mu[min(j, len(acc.mu) - 1)]
        raw += [g * q_v, r, c, jax.lax.rsqrt(r + 1e-8), jax.lax.rsqrt(c + 1e-8), m * q_v]
    stacked = normalize(jnp.stack(raw, axis=-1), axes)
    return jnp.concatenate([stacked, jnp.broadcast_to(time, (*g.shape, time.shape[0]))], axis=-1)
