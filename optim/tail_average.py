"""Tail averaging: an EMA of the weights over the end of training, blended in for evaluation.

modded-nanogpt's optimizer-track records #45 and #46 (github.com/KellerJordan/modded-nanogpt at
f411b3d, "Tail-EMA final readout", ``TAILEMA_*`` in
``records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/``): from step ``start`` the run
keeps ``a`` with ``a <- x`` at ``start`` and ``a <- a + (x - a) / horizon`` after every later step
(until ``stop``, 0: to the end), and evaluates

    theta_eval = (1 - blend) x + blend a          (the record: horizon 150, blend 0.6, start 2400)

where ``x`` are the weights after the step. Training never sees ``a``. `tail_average` wraps any
optimizer and keeps ``a`` (and the blend in force, 0 before ``start``) in its state, so checkpoints
carry it; `evaluation_params` gives ``theta_eval`` from the parameters and the optimizer state, which
the trainer's validation and every reader of a checkpoint (evaluate, sample, export) use. Under
`optim.lookahead.lookahead` (which wraps this), ``x`` are its weights without the lookahead, as in
the record. The record leaves the token embedding out of the average; here every leaf is averaged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import spec
from optim.lookahead import LookaheadState


class TailAverageState(NamedTuple):
    """State of `tail_average`."""

    count: jax.Array  # steps taken, int32
    weight: jax.Array  # the blend in force: ``blend`` from step ``start`` on, else 0; float32
    average: optax.Params  # a: the tail EMA of the weights, float32
    inner: optax.OptState  # the wrapped optimizer's state


def tail_average(
    inner: optax.GradientTransformation, *, start: int, horizon: float = 150.0, blend: float = 0.6, stop: int = 0
) -> optax.GradientTransformationExtraArgs:
    """``inner`` unchanged, with the tail EMA of the weights it produces kept in the state (module docstring).

    Args:
      inner: any optax optimizer whose updates are added to the parameters.
      start: the step count (steps taken) at which the average starts from the weights.
      horizon: the EMA's horizon in steps (its weight on new weights is ``1 / horizon``).
      blend: the average's share of the evaluated weights.
      stop: the step count from which the average no longer moves; 0: never stops.
    """
    spec.check_value("start", start, "[1, inf)")
    spec.check_value("horizon", horizon, "[1, inf)")
    spec.check_value("blend", blend, "[0, 1]")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return TailAverageState(
            count=jnp.zeros([], jnp.int32),
            weight=jnp.zeros([], jnp.float32),
            average=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            inner=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("tail_average needs the parameters: call update(updates, state, params)")
        new, inner_state = inner.update(updates, state.inner, params, **extra_args)
        count = optax.safe_increment(state.count)
        moving = (count > start) & ((count < stop) if stop else True)

        def leaf(a, p, u):
            x = p.astype(jnp.float32) + u.astype(jnp.float32)
            return jnp.where(count == start, x, jnp.where(moving, a + (x - a) / horizon, a))

        average = jax.tree.map(leaf, state.average, params, new)
        weight = jnp.where(count >= start, jnp.float32(blend), 0.0)
        return new, TailAverageState(count=count, weight=weight, average=average, inner=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find(opt_state: Any, kind: type) -> Any:
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kind)) if isinstance(s, kind)]
    return found[0] if found else None


def evaluation_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """The weights to evaluate and export: ``params``, or the lookahead's ``x`` under `optim.lookahead`,
    blended with the tail average under `tail_average` once it has started; in ``params``' dtypes."""
    look, tail = _find(opt_state, LookaheadState), _find(opt_state, TailAverageState)
    base = params if look is None else look.x
    if tail is not None:

        def blend(x, a):  # the weight is a scalar, or one per replica (a leading axis) in a replica-local run
            w = jnp.reshape(tail.weight, tail.weight.shape + (1,) * (x.ndim - tail.weight.ndim))
            return (1 - w) * x.astype(jnp.float32) + w * a

        base = jax.tree.map(blend, base, tail.average)
    return jax.tree.map(lambda x, p: jnp.asarray(x, p.dtype), base, params)
