"""NorMuon: Muon with a per-neuron second moment (Li et al., arXiv:2510.05491).

Muon's orthogonalised update has equal singular values but very unequal row norms: some output
neurons get much larger updates than others. NorMuon evens them out with an Adam-like second moment
kept per output neuron, then restores the update's overall size:

    D_t = momentum direction of G_t (as Muon: EMA + Nesterov by default)
    O_t = NewtonSchulz(D_t)
    v_t = beta2 v_{t-1} + (1 - beta2) mean_over_fan_in(O_t * O_t)    one value per output neuron
    P_t = O_t / (sqrt(v_t) + eps)
    P_t <- P_t * ||O_t||_F / (||P_t||_F + eps)                      per matrix
    W_{t+1} = W_t - lr_t (s(W) P_t + lambda W_t)

An output neuron is a column of the repo's ``(fan_in, fan_out)`` kernel (a row of PyTorch's
``(out, in)`` weight), so ``v`` has the parameter's shape with the fan-in axes reduced to size 1:
one vector per matrix. It is replicated by the generic state-sharding rule (it matches no
parameter's shape), which costs ``fan_out`` floats per matrix.

This follows the official reference code (github.com/zichongli5/NorMuon, ``normuon_update``:
``eps = 1e-10``, ``beta2 = 0.95``, no bias correction, Frobenius-norm preservation then the shape
scale). The paper's Algorithm 1 writes the last step as ``0.2 sqrt(m n) / ||P_t||_F``, which is
the ``"moonlight"`` shape scale here (the default) when ``O_t`` is exactly orthogonal; the reference
code uses ``"jordan"``. Everything else (momentum forms, Newton-Schulz presets, batching, sharding,
parameter routing) is Muon's, see optim/muon.py.
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
    shape_factor,
    with_adam,
)


class NorMuonState(NamedTuple):
    """State of `scale_by_normuon`."""

    mu: optax.Updates  # momentum buffer M_t, shaped like the parameters
    nu: optax.Updates  # per-neuron second moment v_t: parameter shape with fan-in axes of size 1


def _nu_shape(shape: tuple[int, ...], axes: ns.MatrixAxes) -> tuple[int, ...]:
    _, fan_in, _ = ns.split_axes(shape, axes)
    return tuple(1 if i in fan_in else d for i, d in enumerate(shape))


def scale_by_normuon(
    beta: float = 0.95,
    beta2: float = 0.95,
    *,
    eps: float = 1e-10,
    momentum_form: str = "ema",
    nesterov: bool = True,
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
    """NorMuon's direction ``s(W) P_t`` (module docstring); other arguments as `scale_by_muon`.

    Args:
      beta: momentum coefficient.
      beta2: decay of the per-neuron second moment.
      eps: added to ``sqrt(v_t)`` and to ``||P_t||_F``.
    """
    check_choice("momentum_form", momentum_form, MOMENTUM_FORMS)
    check_choice("shape_scale", shape_scale, SHAPE_SCALES)
    check_choice("ns_dtype", ns_dtype, DTYPES)
    check_choice("mu_dtype", mu_dtype, DTYPES)
    check_choice("ns_sharding", ns_sharding, ns.SHARDING_MODES)
    check_choice("ns_batching", ns_batching, ns.BATCHING_MODES)
    ns.resolve(ns_coeffs)

    def init_fn(params):
        check_matrices(params, dimension_numbers, "normuon")
        axes = ns.matrix_axes_tree(params, dimension_numbers)
        return NorMuonState(
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
            nu=jax.tree.map(lambda p, ax: jnp.zeros(_nu_shape(p.shape, ax), jnp.float32), params, axes),
        )

    def normalize(o, nu, ax):
        _, fan_in, fan_out = ns.split_axes(o.shape, ax)
        nu = beta2 * nu + (1 - beta2) * jnp.mean(jnp.square(o), axis=fan_in, keepdims=True)
        p = o / (jnp.sqrt(nu) + eps)
        matrix = fan_in + fan_out
        o_norm = jnp.sqrt(jnp.sum(jnp.square(o), axis=matrix, keepdims=True))
        p_norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=matrix, keepdims=True))
        p = p * (o_norm / (p_norm + eps)) * shape_factor(o.shape, ax, shape_scale)
        return p, nu

    def update_fn(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        pairs = [
            momentum_direction(g, m, beta, momentum_form, nesterov)
            for g, m in zip(grads, treedef.flatten_up_to(state.mu), strict=True)
        ]
        ortho = ns.orthogonalize(
            treedef.unflatten([d for d, _ in pairs]),
            dimension_numbers,
            coeffs=ns_coeffs,
            steps=ns_steps,
            eps=ns_eps,
            dtype=ns_dtype,
            batching=ns_batching,
            sharding=ns_sharding,
        )
        axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, dimension_numbers))
        normalized = [
            normalize(o, nu, ax)
            for o, nu, ax in zip(treedef.flatten_up_to(ortho), treedef.flatten_up_to(state.nu), axes, strict=True)
        ]
        new_updates = treedef.unflatten([p.astype(g.dtype) for (p, _), g in zip(normalized, grads, strict=True)])
        return new_updates, NorMuonState(
            mu=treedef.unflatten([m.astype(mu_dtype) for _, m in pairs]),
            nu=treedef.unflatten([nu for _, nu in normalized]),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def normuon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    beta2: float = 0.95,
    eps: float = 1e-10,
    momentum_form: str = "ema",
    nesterov: bool = True,
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
    """NorMuon on hidden matrices, AdamW elsewhere; arguments as `optim.muon.muon` plus ``beta2``, ``eps``."""
    direction = scale_by_normuon(
        beta,
        beta2,
        eps=eps,
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
