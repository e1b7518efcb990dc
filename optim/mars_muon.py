"""MARS-M: Muon on MARS's variance-reduced gradient (Liu, Yuan & Gu, arXiv:2510.21800; MARS: Yuan et
al., arXiv:2411.10438).

MARS replaces the stochastic gradient by a STORM-like estimate that subtracts the change of the
gradient between consecutive steps, scaled by ``gamma``:

    c_t = g_t + gamma * beta / (1 - beta) * (g_t - g_{t-1})
    c_t <- c_t / ||c_t||_F   if ||c_t||_F > 1          (clip_c=True; per matrix)
    M_t = beta M_{t-1} + (1 - beta) c_t
    O_t = NewtonSchulz(M_t)
    W_{t+1} = W_t - lr_t (0.2 sqrt(max(fan_in, fan_out)) O_t + lambda W_t)

This is MARS-M-approx, the variant of the paper's experiments: ``g_{t-1}`` is the previous step's
gradient (on the previous batch), kept in the state, so it costs one extra buffer and no extra
gradient evaluation; ``g_0 = 0``. Defaults follow the reference code (github.com/AGI-Arena/MARS,
``MARS_M/optimizers/mars_m.py``): ``beta = 0.95``, ``gamma = 0.025``, clipping on, no Nesterov,
Jordan's Newton-Schulz, Moonlight's shape scale, ``weight_decay = 0.1``, AdamW ``(0.9, 0.95)`` for
the other parameters. The reference clips each PyTorch parameter tensor; with scan-stacked layers the
norm here is taken per matrix, which is the same thing. Momentum forms, Newton-Schulz options,
batching, sharding and routing are Muon's (optim/muon.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import newton_schulz as ns
from optim.muon import (
    DTYPES,
    MOMENTUM_FORMS,
    SHAPE_SCALES,
    check_choice,
    check_matrices,
    momentum_direction,
    orthogonalize_and_scale,
    with_adam,
)


class MarsMuonState(NamedTuple):
    """State of `scale_by_mars_muon`."""

    mu: optax.Updates  # momentum of the corrected gradients M_t, shaped like the parameters
    prev_grad: optax.Updates  # g_{t-1}, shaped like the parameters (zeros before the first step)


def scale_by_mars_muon(
    beta: float = 0.95,
    gamma: float = 0.025,
    *,
    clip_c: bool = True,
    momentum_form: str = "ema",
    nesterov: bool = False,
    ns_coeffs: ns.Coeffs = "jordan",
    ns_steps: int = 0,
    ns_dtype: str = "float32",
    ns_eps: float = 1e-7,
    shape_scale: str = "moonlight",
    mu_dtype: str = "float32",
    ns_batching: str = "auto",
    ns_sharding: str = "as_is",
    dimension_numbers: ns.AxesSpec = None,
) -> optax.GradientTransformation:
    """MARS-M's direction (module docstring); other arguments as `optim.muon.scale_by_muon`.

    Args:
      beta: momentum coefficient, also in the correction's ``beta / (1 - beta)``.
      gamma: strength of the gradient correction (0 gives Muon with clipped gradients).
      clip_c: divide ``c_t`` by its Frobenius norm when that exceeds 1.
    """
    check_choice("momentum_form", momentum_form, MOMENTUM_FORMS)
    check_choice("shape_scale", shape_scale, SHAPE_SCALES)
    check_choice("ns_dtype", ns_dtype, DTYPES)
    check_choice("mu_dtype", mu_dtype, DTYPES)
    check_choice("ns_sharding", ns_sharding, ns.SHARDING_MODES)
    check_choice("ns_batching", ns_batching, ns.BATCHING_MODES)
    ns.resolve(ns_coeffs)

    def init_fn(params):
        check_matrices(params, dimension_numbers, "mars_muon")
        return MarsMuonState(
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
            prev_grad=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
        )

    def corrected(g, prev, ax):
        g = g.astype(jnp.float32)
        c = g + gamma * beta / (1 - beta) * (g - prev.astype(jnp.float32))
        if clip_c:
            _, fan_in, fan_out = ns.split_axes(c.shape, ax)
            norm = jnp.sqrt(jnp.sum(jnp.square(c), axis=fan_in + fan_out, keepdims=True))
            c = c / jnp.maximum(norm, 1.0)
        return c

    def update_fn(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, dimension_numbers))
        pairs = [
            momentum_direction(corrected(g, prev, ax), m, beta, momentum_form, nesterov)
            for g, prev, m, ax in zip(
                grads, treedef.flatten_up_to(state.prev_grad), treedef.flatten_up_to(state.mu), axes, strict=True
            )
        ]
        ortho = orthogonalize_and_scale(
            treedef.unflatten([d for d, _ in pairs]),
            dimension_numbers,
            coeffs=ns_coeffs,
            steps=ns_steps,
            eps=ns_eps,
            dtype=ns_dtype,
            batching=ns_batching,
            sharding=ns_sharding,
            kind=shape_scale,
        )
        new_updates = jax.tree.map(lambda o, g: o.astype(g.dtype), ortho, updates)
        return new_updates, MarsMuonState(
            mu=treedef.unflatten([m.astype(mu_dtype) for _, m in pairs]),
            prev_grad=jax.tree.map(lambda g: g.astype(mu_dtype), updates),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def mars_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    gamma: float = 0.025,
    clip_c: bool = True,
    momentum_form: str = "ema",
    nesterov: bool = False,
    ns_coeffs: ns.Coeffs = "jordan",
    ns_steps: int = 0,
    ns_dtype: str = "float32",
    ns_eps: float = 1e-7,
    shape_scale: str = "moonlight",
    weight_decay: float = 0.1,
    adam_lr_ratio: float = 1.0,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    mu_dtype: str = "float32",
    ns_batching: str = "auto",
    ns_sharding: str = "as_is",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    param_labels: Callable[[Any], Any] | Any | None = None,
    dimension_numbers: ns.AxesSpec = None,
) -> optax.GradientTransformationExtraArgs:
    """MARS-M on hidden matrices, AdamW elsewhere; arguments as `optim.muon.muon` plus ``gamma``, ``clip_c``."""
    direction = scale_by_mars_muon(
        beta,
        gamma,
        clip_c=clip_c,
        momentum_form=momentum_form,
        nesterov=nesterov,
        ns_coeffs=ns_coeffs,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        ns_eps=ns_eps,
        shape_scale=shape_scale,
        mu_dtype=mu_dtype,
        ns_batching=ns_batching,
        ns_sharding=ns_sharding,
        dimension_numbers=dimension_numbers,
    )
    return with_adam(
        direction,
        learning_rate,
        weight_decay=weight_decay,
        adam_lr_ratio=adam_lr_ratio,
        adam_learning_rate=adam_learning_rate,
        adam_b1=adam_b1,
        adam_b2=adam_b2,
        adam_eps=adam_eps,
        param_labels=param_labels,
    )
