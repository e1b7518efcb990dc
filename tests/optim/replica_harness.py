"""Runs an optimizer on W replicas inside `jax.shard_map`, as the replica-local train step does."""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

AXIS = "replicas"


def run_replicas(
    tx: optax.GradientTransformation,
    params: Any,
    data: Any,
    grad_fn: Callable[[Any, Any], Any] = lambda params, grads: grads,
) -> tuple[Any, Any, Any]:
    """Steps every replica ``w`` with gradients ``grad_fn(params_w, data[w, t])`` for ``t < T``.

    As in training, the state is made outside, every replica gets a copy (one slice each), and one
    jitted step runs per ``t``.

    Args:
      tx: the optimizer; build it with ``axis_name=AXIS`` to let it talk across replicas.
      params: the common starting point (one model).
      data: pytree of arrays ``(W, T, ...)``: replica ``w``'s input at step ``t``.
      grad_fn: gradient of the loss at ``params`` on one input; default: the input is the gradient.

    Returns:
      ``(params, updates, state)``: params after each step ``(W, T, ...)``, the updates ``(W, T, ...)``
      and the final optimizer state ``(W, ...)``, as NumPy arrays.
    """
    leaf = jax.tree.leaves(data)[0]
    n, steps = leaf.shape[:2]
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])

    def body(params, state, inputs):
        params, state, inputs = jax.tree.map(lambda x: x[0], (params, state, inputs))
        updates, state = tx.update(grad_fn(params, inputs), state, params)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(params, updates), updates, state))

    spec = jax.P(AXIS)
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    params, state = jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), (params, jax.jit(tx.init)(params)))
    trajectory, updates = [], []
    for t in range(steps):
        params, u, state = step(params, state, jax.tree.map(lambda x: x[:, t], data))
        trajectory.append(params)
        updates.append(u)
    stack = lambda trees: jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs], axis=1), *trees)  # noqa: E731
    return stack(trajectory), stack(updates), jax.tree.map(np.asarray, state)


def local_adam_reference(w0, grads, lr, k_x, k_u, k_v, *, b1=0.9, b2=0.999, omega=1.0, wd=0.0, eps=1e-8):
    """Per replica quasi-hyperbolic Adam in float64 (``omega = 1``, ``wd = 0``: Adam, bias-corrected as
    `optax.adam`, DES-LOC's local step): ``((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)``
    plus decoupled decay; ``x``, ``u``, ``v`` replaced by their replica mean before step ``t`` when ``t``
    is a multiple of their period."""
    replicas, steps = grads.shape[:2]
    x = np.repeat(w0[None].astype(np.float64), replicas, 0)
    u, v = np.zeros_like(x), np.zeros_like(x)
    mean = lambda a: np.broadcast_to(a.mean(0), a.shape)  # noqa: E731
    out = []
    for t in range(1, steps + 1):
        g = grads[:, t - 1]
        u = mean(u) if t % k_u == 0 else u
        v = mean(v) if t % k_v == 0 else v
        x = mean(x) if t % k_x == 0 else x
        u = b1 * u + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        d = ((1 - omega) * g + omega * u / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        x = x - lr * (d + wd * x)
        out.append(x)
    return np.stack(out, axis=1)
