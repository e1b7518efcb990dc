"""Grouped matmul in plain XLA: the definition of correct for the gmm kernels.

Rows of ``lhs`` ``(m, k)`` come in ``G`` consecutive groups of ``group_sizes[g]`` rows; group ``g``
multiplies by its own matrix ``rhs[g]`` ``(k, n)``::

    out[i] = lhs[i] @ rhs[g(i)],   g(i) = the g with offsets[g] <= i < offsets[g + 1]
    offsets = [0, cumsum(group_sizes)];  rows at or past offsets[G] are 0

Its gradients are ``dlhs[i] = dout[i] @ rhs[g(i)]^T`` (a grouped matmul with transposed ``rhs``) and
``drhs[g] = sum_{i in g} lhs[i]^T dout[i]`` (``tgmm``; 0 for an empty group). This is
`jax.lax.ragged_dot`, whose signature `kernels_pallas.gmm.gmm` shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, preferred_element_type=None) -> jax.Array:
    """``(m, n)`` grouped product of ``lhs`` ``(m, k)`` and ``rhs`` ``(G, k, n)``."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``(G, k, n)``: per group, ``lhs[rows of g]^T @ dout[rows of g]``, float32."""
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)])
    rows = jnp.arange(lhs.shape[0])
    member = (rows[None, :] >= offsets[:-1, None]) & (rows[None, :] < offsets[1:, None])  # (G, m)
    masked = jnp.where(member[:, :, None], lhs[None].astype(jnp.float32), 0.0)
    return jnp.einsum("gmk,mn->gkn", masked, dout.astype(jnp.float32))


def check_shapes(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    """A one-line ValueError naming the fix when the operands do not fit together."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"gmm takes lhs (m, k), rhs (G, k, n), group_sizes (G,); got {lhs.shape}, {rhs.shape}, {group_sizes.shape}")
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(
            f"lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}: rhs needs lhs's k and one matrix per group"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, not {group_sizes.dtype}")
