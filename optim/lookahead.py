"""EMA-Nesterov lookahead: evaluate the gradient ahead, along an EMA of past displacements.

Yau et al., "EMA-Nesterov" (arXiv:2605.25395), as modded-nanogpt's optimizer-track records #39-#46
wrap their whole optimizer (github.com/KellerJordan/modded-nanogpt at f411b3d, class
``EMA_Nesterov`` of ``records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/``). With
``x_n`` the weights after step ``n`` and ``b_n`` the lookahead buffer (``x_0`` the initial weights,
``b_0 = 0``), step ``n`` (from 0) is

    y_n = x_n + beta_n b_n                         the gradient is taken here
    x_{n+1} = y_n + U_n                            U_n: the inner optimizer's update at y_n
    b_{n+1} = gamma b_n + (1 - gamma) (x_{n+1} - x_n)
    beta_n = stepsize * r(n - 1)  for start <= n < stop, else 0

with ``r`` the learning rate's ratio to its peak (the record's scheduled stepsize: the rate set at
the previous step), or 1. As an optax transform the parameters the train step holds are the
lookahead points ``y``: the update returned at step ``n`` is ``y_{n+1} - y_n = U_n + beta_{n+1}
b_{n+1}``, and the state keeps ``x`` (the weights to evaluate and export, `optim.tail_average.
evaluation_params`) and ``b``. The record's defaults: ``gamma = 0.99``, ``stepsize = 0.3``, active
from step 300 to ``steps - 950``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import spec


class LookaheadState(NamedTuple):
    """State of `lookahead`."""

    count: jax.Array  # steps taken, int32
    x: optax.Params  # x_n: the weights without the lookahead, float32
    buffer: optax.Updates  # b_n: EMA of the displacements x_{n+1} - x_n, float32
    inner: optax.OptState  # the wrapped optimizer's state


def lookahead(
    inner: optax.GradientTransformation,
    stepsize: float,
    *,
    ema: float = 0.99,
    start: int = 0,
    stop: int = 0,
    ratio: Callable[[jax.Array], jax.Array] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` under EMA-Nesterov lookahead (module docstring).

    Args:
      inner: any optax optimizer whose updates are added to the parameters.
      stepsize: the lookahead's ``beta`` at the peak learning rate.
      ema: ``gamma``, the buffer's decay.
      start: the first step that looks ahead.
      stop: the step from which it no longer does; 0: never stops.
      ratio: ``r(n)``, the learning rate of step ``n`` over its peak; None: 1.
    """
    spec.check_value("stepsize", stepsize, "[0, inf)")
    spec.check_value("ema", ema, "[0, 1)")
    inner = optax.with_extra_args_support(inner)

    def beta(n: jax.Array) -> jax.Array:
        active = (n >= start) & ((n < stop) if stop else True)
        scale = 1.0 if ratio is None else ratio(jnp.maximum(n - 1, 0))
        return jnp.where(active, stepsize * scale, 0.0)

    def init_fn(params):
        return LookaheadState(
            count=jnp.zeros([], jnp.int32),
            x=jax.tree.map(lambda p: jnp.asarray(p, jnp.float32) + 0.0, params),  # a fresh buffer, never params itself
            buffer=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            inner=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("lookahead needs the parameters: call update(updates, state, params)")
        new, inner_state = inner.update(updates, state.inner, params, **extra_args)
        x = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u.astype(jnp.float32), params, new)
        buffer = jax.tree.map(lambda b, x1, x0: ema * b + (1 - ema) * (x1 - x0), state.buffer, x, state.x)
        count = optax.safe_increment(state.count)
        ahead = beta(count)
        out = jax.tree.map(lambda u, b: (u.astype(jnp.float32) + ahead * b).astype(u.dtype), new, buffer)
        return out, LookaheadState(count=count, x=x, buffer=buffer, inner=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
