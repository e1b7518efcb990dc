"""Helpers for optimizers that see each data-parallel replica's own gradients.

In a replica-local train step (``experiments/train_lib.py``) the update function runs inside a
`jax.shard_map` over a mesh axis, once per replica, on that replica's local gradients. An optimizer
built for that setting takes ``axis_name`` and decides itself what crosses the network (DeMo,
DiLoCo, PowerSGD); ``axis_name=None`` means a single replica (no collectives), so the same
transform also runs on one device or under plain GSPMD data parallelism. Any other optimizer gets
the replica mean of the gradients first (`mean_over_replicas`), which is ordinary data parallelism.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from optim import quantization

EXCHANGES = ("float32", "bfloat16", "int8", "int4")
_BLOCK = 256  # elements per quantization block of an exchanged vector


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


def check_exchange(exchange: str) -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: use one of {', '.join(EXCHANGES)}")


def _encode(x: jax.Array, exchange: str):
    if exchange == "bfloat16":
        return x.astype(jnp.bfloat16)
    return quantization.quantize_blockwise(x, bits=8 if exchange == "int8" else 4, code="signed", block_size=_BLOCK)


def _decode(encoded) -> jax.Array:
    if isinstance(encoded, quantization.BlockQuantized):
        return quantization.dequantize(encoded).astype(jnp.float32)
    return encoded.astype(jnp.float32)


def quantized_mean(x: jax.Array, axis_name: str | None, exchange: str = "float32") -> jax.Array:
    """Replica mean of a 1-D fp32 vector sent as ``exchange`` values, accumulated in fp32.

    ``float32`` is one all-reduce. Otherwise a ring all-reduce done by hand, so that every byte on
    the wire is low-precision but every sum is fp32: the vector is cut into one chunk per replica,
    encoded (bfloat16, or block-wise absmax int8 / int4 codes with one fp32 scale per 256 values,
    `optim.quantization`), chunk ``r`` of every replica goes to replica ``r`` (all-to-all), which
    decodes and averages them in fp32, encodes the mean and all-gathers it. Each value is rounded
    twice (before and after the sum).
    """
    check_exchange(exchange)
    if axis_name is None:
        return x
    if exchange == "float32":
        return jax.lax.pmean(x, axis_name)
    n, replicas = x.shape[0], jax.lax.axis_size(axis_name)
    rows = -(-n // (replicas * _BLOCK))
    chunks = jnp.pad(x, (0, replicas * rows * _BLOCK - n)).reshape(replicas, rows, _BLOCK)
    received = jax.tree.map(
        lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True), _encode(chunks, exchange)
    )  # row r now holds replica r's copy of this replica's chunk
    mine = jnp.mean(_decode(received), axis=0, keepdims=True)
    gathered = jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name, tiled=True), _encode(mine, exchange))
    if isinstance(gathered, quantization.BlockQuantized):
        gathered = dataclasses.replace(gathered, shape=chunks.shape)  # the codes now hold every replica's chunk
    return _decode(gathered).reshape(-1)[:n]


def sync_period(steps: int):
    """A named scope for collectives that run once every ``steps`` steps (a synchronisation with its
    own period); `experiments.bench_comm` reads it from the compiled HLO to amortise their bytes."""
    return jax.named_scope(f"sync_period_{steps}")
