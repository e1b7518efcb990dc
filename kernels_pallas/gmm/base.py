"""What the gmm backends share: tile sizes, padding, and the work items a grouped matmul visits.

Rows are cut into ``block_m`` tiles; a tile that straddles a group boundary is visited once per group
it holds (a *work item* ``(group, tile)``), at most ``cdiv(m, block_m) + G - 1`` of them, in order of
group then tile, listed in XLA before the kernel runs (Triton reads them from memory, Mosaic TPU
prefetches them into scalar memory to pick its blocks). Empty groups yield no item; surplus items
(the bound is not reached when groups align with tiles) repeat the last real item's group and tile
with no rows, so a backend whose output tile stays resident while consecutive items share it (Mosaic
TPU) never visits another tile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile sizes, and Triton's warps and pipeline stages per program (unused by Mosaic TPU).

    Triton takes powers of two >= 16; a compiled TPU kernel needs ``block_m`` a multiple of 8 and
    ``block_k``, ``block_n`` multiples of 128 (interpret mode takes any size). ``num_stages=None``
    takes 3 for 2-byte operands and 2 for 4-byte ones, which keeps the default tiles inside an H100's
    shared memory (`kernels_pallas.gmm.triton`; checked for sm_90a by ``experiments/check_sm90.py``).
    8 warps: at 4, a 128 x 128 float32 accumulator spills registers.
    """

    block_m: int = 128
    block_k: int = 64
    block_n: int = 128
    num_warps: int = 8
    num_stages: int | None = None


def cdiv(a, b: int):
    return (a + b - 1) // b


def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pads ``x`` along ``axis`` to a multiple of ``multiple`` (no copy when it is one)."""
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """``(starts, ends)`` of each group's rows, clipped to ``m``."""
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    return starts, ends


def work_items(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, ...]:
    """``(group, tile, start, end)`` per work item, ``cdiv(m, block_m) + G - 1`` of them.

    Item ``w`` covers the rows ``[start, end)`` of ``group`` inside row tile ``tile``; surplus items
    have ``start == end`` and the last real item's group and tile.
    """
    num_groups = group_sizes.shape[0]
    num_items = cdiv(m, block_m) + num_groups - 1
    starts, ends = group_bounds(group_sizes, m)
    first, last = starts // block_m, (ends - 1) // block_m
    tiles = jnp.where(ends > starts, last - first + 1, 0)
    done = jnp.cumsum(tiles)
    w = jnp.arange(num_items, dtype=jnp.int32)
    w_real = jnp.minimum(w, jnp.maximum(done[-1] - 1, 0))
    group = jnp.minimum(jnp.searchsorted(done, w_real, side="right"), num_groups - 1).astype(jnp.int32)
    tile = jnp.clip(first[group] + w_real - (done[group] - tiles[group]), 0, cdiv(m, block_m) - 1)
    valid = w < done[-1]
    row0 = tile * block_m
    start = jnp.where(valid, jnp.maximum(starts[group], row0), 0)
    end = jnp.where(valid, jnp.minimum(ends[group], row0 + block_m), 0)
    return group, tile, start, end
