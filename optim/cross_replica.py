"""Helpers for optimizers that see each data-parallel replica's own gradients.

In a replica-local train step (``experiments/train_lib.py``) the update function runs inside a
`jax.shard_map` over a mesh axis, once per replica, on that replica's local gradients. An optimizer
built for that setting takes ``axis_name`` and decides itself what crosses the network (DeMo,
DiLoCo, PowerSGD); ``axis_name=None`` means a single replica (no collectives), so the same
transform also runs on one device or under plain GSPMD data parallelism. Any other optimizer gets
the replica mean of the gradients first (`mean_over_replicas`), which is ordinary data parallelism.
"""

from __future__ import annotations

import jax
import optax


def replica_count(axis_name: str | None) -> int:
    """Number of replicas along ``axis_name`` (1 for None); call inside the `shard_map`."""
    return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def mean_over_replicas(axis_name: str | None) -> optax.GradientTransformation:
    """``g <- mean_r g_r``: one all-reduce of the gradients over ``axis_name`` (data parallelism)."""

    def update_fn(updates, state, params=None):
        del params
        if axis_name is None:
            return updates, state
        return jax.lax.pmean(updates, axis_name), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
