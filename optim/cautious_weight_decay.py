"""Cautious weight decay: decay only the coordinates that the step already shrinks.

Chen, Liang, Liu et al., "Cautious Weight Decay" (arXiv:2510.12402), Algorithm 1: with ``u_t`` the
optimizer's direction (``x <- x - eta_t u_t``),

    x_{t+1} = x_t - eta_t (u_t + lambda 1[u_t * x_t >= 0] * x_t)

so the decay acts only where the update and the weight agree in sign (where ``|x|`` is already
shrinking). `cautious_weight_decay` wraps any optax optimizer, whose update ``U_t = -eta_t u_t`` is
added to the parameters: ``U_t <- U_t - eta_t lambda 1[-U_t * x_t >= 0] x_t`` on the leaves of
``mask`` (default `optim.labels.decay_mask`: matrices and embeddings, not norms or biases), with
``eta_t`` the ``learning_rate`` schedule. The optimizer's own (uniform) decay should be off;
``optimizer.cautious_weight_decay`` in `optim.build` turns it off. modded-nanogpt's optimizer-track
record #46 (f411b3d) uses it on Muon's matrices with ``lambda = 0.025`` and a strict ``> 0`` mask
(the paper's ``>= 0`` differs only where an update entry is exactly 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import labels, spec


class CautiousWeightDecayState(NamedTuple):
    """State of `cautious_weight_decay`."""

    count: jax.Array  # steps taken, int32 (the learning rate schedule's argument)
    inner: optax.OptState  # the wrapped optimizer's state


def cautious_weight_decay(
    inner: optax.GradientTransformation,
    weight_decay: float,
    learning_rate: optax.ScalarOrSchedule,
    *,
    mask: Any | Callable[[Any], Any] = labels.decay_mask,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` (a full optimizer, its decay off) plus the cautious decay ``lambda = weight_decay``.

    Args:
      inner: any optax optimizer whose updates are added to the parameters.
      weight_decay: ``lambda``.
      learning_rate: ``eta_t``: a float or a schedule of the step count.
      mask: a boolean tree like the parameters, or a function of them, picking the decayed leaves.
    """
    spec.check_value("weight_decay", weight_decay, "[0, inf)")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return CautiousWeightDecayState(count=jnp.zeros([], jnp.int32), inner=inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("cautious_weight_decay needs the parameters: call update(updates, state, params)")
        new, inner_state = inner.update(updates, state.inner, params, **extra_args)
        eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
        decayed = mask(params) if callable(mask) else mask

        def leaf(u, p, on):
            if not on:
                return u
            p32, u32 = p.astype(jnp.float32), u.astype(jnp.float32)
            return (u32 - eta * weight_decay * jnp.where(-u32 * p32 >= 0, p32, 0.0)).astype(u.dtype)

        out = jax.tree.map(leaf, new, params, decayed)
        return out, CautiousWeightDecayState(count=optax.safe_increment(state.count), inner=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
