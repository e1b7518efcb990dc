"""Grouped matmul for TPUs: Pallas Mosaic kernels for ``gmm`` (forward and dlhs) and ``tgmm`` (drhs).

The blocking follows jax's megablox (`jax/experimental/pallas/ops/tpu/megablox`): the work items of
`kernels_pallas.gmm.base.work_items` (group, row tile, row range) are prefetched into scalar memory
and pick each grid step's blocks, so the kernels only ever multiply whole ``(block_m, block_k)`` x
``(block_k, block_n)`` tiles on the MXU, accumulating in a float32 VMEM scratch over the innermost
``k`` axis of the grid.

``gmm``, grid ``(n tiles, work items, k tiles)``: item ``w`` multiplies row tile ``tile[w]`` of lhs by
``rhs[group[w]]``; after the last ``k`` step it writes only its group's rows into the output tile,
``out = where(row in [start, end), acc, out)``. Consecutive items that share a row tile keep the same
output block, which stays resident in VMEM between grid steps (it is written back to HBM when the
block changes), so the groups of a straddled tile fill it in turn. With ``transpose_rhs`` the rhs
block is ``(block_n, block_k)`` of ``rhs[group]`` and multiplies transposed: dlhs without a
transposed copy.

``tgmm``, grid ``(k tiles, n tiles, work items)``: the output block ``drhs[group[w]]`` stays resident
over the consecutive items of one group; the first item zeroes the accumulator, every item adds
``lhs_tile^T @ dout_tile`` with rows outside ``[start, end)`` zeroed, the last writes. Empty groups
are never visited and come out 0 (set in XLA). Operands are zero-padded to whole tiles (a copy only
when they are not), so partial tiles need no masked loads. Not yet compiled or timed on a TPU: the
tests run it in TPU interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.attention.base import dot_nn, dot_nt, dot_tn
from kernels_pallas.gmm.base import Tiling, group_bounds, pad_to, work_items

DEFAULT_TILING = Tiling(block_m=128, block_k=128, block_n=128)

__all__ = ["DEFAULT_TILING", "gmm", "tgmm"]


def _interpret(interpret):
    """``interpret=True`` means the TPU interpreter (it simulates VMEM and the DMAs, poisons fresh buffers)."""
    return pltpu.InterpretParams() if interpret is True else interpret


def _rows_in_item(tile, start, end, shape: tuple[int, int]) -> jax.Array:
    """``(block_m, cols)`` mask of the tile's rows inside ``[start, end)``."""
    rows = tile * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= start) & (rows < end)


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs: bool):
    del group_ref  # used by the index maps only
    w, kb = pl.program_id(1), pl.program_id(2)

    @pl.when(kb == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dot = dot_nt if transpose_rhs else dot_nn
    acc_ref[...] += dot(lhs_ref[...], rhs_ref[...])

    @pl.when(kb == pl.num_programs(2) - 1)
    def _():
        mine = _rows_in_item(tile_ref[w], start_ref[w], end_ref[w], acc_ref.shape)
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("tiling", "transpose_rhs", "out_dtype", "interpret"))
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiling: Tiling = DEFAULT_TILING,
    transpose_rhs: bool = False,
    out_dtype=None,
    interpret=False,
) -> jax.Array:
    """``(m, n)``: ``lhs[i] @ rhs[g(i)]`` (``@ rhs[g(i)]^T`` with ``transpose_rhs``), 0 past the groups."""
    bm, bk, bn = tiling.block_m, tiling.block_k, tiling.block_n
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = out_dtype or lhs.dtype
    lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
    rhs_p = pad_to(pad_to(rhs, 2 if transpose_rhs else 1, bk), 1 if transpose_rhs else 2, bn)
    items = work_items(group_sizes, m, bm)
    n_padded = n + (-n % bn)
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((None, bn, bk), lambda j, w, kb, group, tile, start, end: (group[w], j, kb))
    else:
        rhs_spec = pl.BlockSpec((None, bk, bn), lambda j, w, kb, group, tile, start, end: (group[w], kb, j))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n_padded // bn, items[0].shape[0], lhs_p.shape[1] // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda j, w, kb, group, tile, start, end: (tile[w], kb)), rhs_spec],
        out_specs=pl.BlockSpec((bm, bn), lambda j, w, kb, group, tile, start, end: (tile[w], j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs),
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_padded), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL, pltpu.ARBITRARY, pltpu.ARBITRARY)),
        interpret=_interpret(interpret),
        name="gmm",
    )(*items, lhs_p, rhs_p)
    written = jnp.arange(m)[:, None] < jnp.sum(group_sizes)  # rows past the groups are never written
    return jnp.where(written, out[:m, :n], 0).astype(out_dtype)


def _tgmm_kernel(group_ref, tile_ref, start_ref, end_ref, lhs_ref, dout_ref, out_ref, acc_ref):
    w, last = pl.program_id(2), pl.num_programs(2) - 1
    group = group_ref[w]
    first_of_group = (w == 0) | (group_ref[jnp.maximum(w - 1, 0)] != group)
    last_of_group = (w == last) | (group_ref[jnp.minimum(w + 1, last)] != group)

    @pl.when(first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = lhs_ref[...]
    x = jnp.where(_rows_in_item(tile_ref[w], start_ref[w], end_ref[w], x.shape), x, jnp.zeros_like(x))
    acc_ref[...] += dot_tn(x, dout_ref[...])

    @pl.when(last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, tiling: Tiling = DEFAULT_TILING, out_dtype=jnp.float32, interpret=False
) -> jax.Array:
    """``(G, k, n)``: ``sum_{i in g} lhs[i]^T dout[i]`` per group ``g`` (0 for an empty group)."""
    bm, bk, bn = tiling.block_m, tiling.block_k, tiling.block_n
    (m, k), n, num_groups = lhs.shape, dout.shape[1], group_sizes.shape[0]
    lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
    dout_p = pad_to(pad_to(dout, 0, bm), 1, bn)
    items = work_items(group_sizes, m, bm)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(lhs_p.shape[1] // bk, dout_p.shape[1] // bn, items[0].shape[0]),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, w, group, tile, start, end: (tile[w], i)),
            pl.BlockSpec((bm, bn), lambda i, j, w, group, tile, start, end: (tile[w], j)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, w, group, tile, start, end: (group[w], i, j)),
        scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
    )
    out = pl.pallas_call(
        _tgmm_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, lhs_p.shape[1], dout_p.shape[1]), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY)),
        interpret=_interpret(interpret),
        name="tgmm",
    )(*items, lhs_p, dout_p)
    starts, ends = group_bounds(group_sizes, m)
    visited = (ends > starts)[:, None, None]  # an empty group's block is never written
    return jnp.where(visited, out[:, :k, :n], 0).astype(out_dtype)
