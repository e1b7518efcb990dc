"""Grouped matmul for GPUs: Pallas Triton kernels for ``gmm`` (forward and dlhs) and ``tgmm`` (drhs).

``gmm``: grid ``(work items, n tiles)`` (`kernels_pallas.gmm.base.work_items`): each program
multiplies its whole row tile by ``rhs[group]`` over a loop of ``block_k`` slices in float32 and
stores only its group's rows (a masked store), so items sharing a tile write disjoint rows and no
atomics are needed. Surplus items skip all work. With ``transpose_rhs`` it multiplies by ``rhs[group]^T``,
which is dlhs without materialising a transposed ``rhs``.

``tgmm``: grid ``(G, k tiles, n tiles)``; a program loops over the row tiles its group touches,
zeroes the rows outside the group and accumulates ``lhs_tile^T @ dout_tile``; an empty group stores
zeros. Operands whose sizes are not multiples of the tiles are zero-padded (a copy only then), so
partial tiles need no masked loads; ``tl.dot`` takes tiles of at least 16.

Shared memory: Triton pipelines the operand tiles of the K loop (``gmm``: ``block_m x block_k`` and
``block_k x block_n``; ``tgmm``: ``block_m x block_k`` and ``block_m x block_n``) over ``num_stages``
buffers; `shared_bytes` bounds that from above and a tiling over an H100's 227 KiB is refused before it
meets the GPU. Operands of ``2**31`` or more elements are refused (int32 offsets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import backends
from kernels_pallas.attention.base import dot_nn, dot_nt, dot_tn
from kernels_pallas.gmm.base import Tiling, cdiv, group_bounds, pad_to, work_items

DEFAULT_TILING = Tiling()
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes one H100 thread block may use
_INT32_FIX = "split the rows into calls of fewer than 2**31 elements or use model.moe_matmul=ragged_dot"

__all__ = ["DEFAULT_TILING", "SHARED_MEMORY_LIMIT", "Tiling", "gmm", "shared_bytes", "tgmm", "work_items"]


def num_stages(tiling: Tiling, dtype) -> int:
    """The tiling's pipeline stages, by operand item size where it names none (`Tiling`)."""
    return tiling.num_stages or (3 if jnp.dtype(dtype).itemsize <= 2 else 2)


def shared_bytes(kernel: str, tiling: Tiling, dtype) -> int:
    """Upper bound on the shared memory of ``kernel`` (``gmm`` or ``tgmm``): its pipelined operand tiles."""
    bm, bk, bn = tiling.block_m, tiling.block_k, tiling.block_n
    tiles = bm * bk + (bk * bn if kernel == "gmm" else bm * bn)
    return num_stages(tiling, dtype) * tiles * jnp.dtype(dtype).itemsize


def _compiler_params(kernel: str, tiling: Tiling, dtype, interpret) -> plgpu.CompilerParams:
    need = shared_bytes(kernel, tiling, dtype)
    if not interpret and need > SHARED_MEMORY_LIMIT:
        raise ValueError(
            f"{kernel}: {tiling} with {jnp.dtype(dtype).name} operands needs up to {need // 1024} KiB of shared memory, over "
            f"the {SHARED_MEMORY_LIMIT // 1024} KiB of an H100 block; lower num_stages, block_k or block_n"
        )
    return plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=num_stages(tiling, dtype))


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, lhs_ref, rhs_ref, out_ref, *, tiling: Tiling, num_k: int, transpose_rhs: bool):
    bm, bk, bn = tiling.block_m, tiling.block_k, tiling.block_n
    w, j = pl.program_id(0), pl.program_id(1)
    group, tile, start, end = group_ref[w], tile_ref[w], start_ref[w], end_ref[w]

    @pl.when(end > start)
    def _():
        row_slice, col_slice = pl.ds(tile * bm, bm), pl.ds(j * bn, bn)

        def body(kb, acc):
            x = lhs_ref[row_slice, pl.ds(kb * bk, bk)]
            if transpose_rhs:
                return acc + dot_nt(x, rhs_ref[group, col_slice, pl.ds(kb * bk, bk)])
            return acc + dot_nn(x, rhs_ref[group, pl.ds(kb * bk, bk), col_slice])

        acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((bm, bn), jnp.float32))
        rows = tile * bm + jnp.arange(bm)
        mine = ((rows >= start) & (rows < end))[:, None] & jnp.ones((1, bn), bool)
        plgpu.store(out_ref.at[row_slice, col_slice], acc.astype(out_ref.dtype), mask=mine)


@functools.partial(jax.jit, static_argnames=("tiling", "transpose_rhs", "out_dtype", "interpret"))
def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiling: Tiling = DEFAULT_TILING,
    transpose_rhs: bool = False,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """``(m, n)``: ``lhs[i] @ rhs[g(i)]`` (``@ rhs[g(i)]^T`` with ``transpose_rhs``), 0 past the groups."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = out_dtype or lhs.dtype
    lhs_p = pad_to(pad_to(lhs, 0, tiling.block_m), 1, tiling.block_k)
    rhs_p = pad_to(pad_to(rhs, 2 if transpose_rhs else 1, tiling.block_k), 1 if transpose_rhs else 2, tiling.block_n)
    items = work_items(group_sizes, m, tiling.block_m)
    n_padded = n + (-n % tiling.block_n)
    backends.check_int32_offsets("gmm", _INT32_FIX, lhs_p, rhs_p, jax.ShapeDtypeStruct((lhs_p.shape[0], n_padded), out_dtype))
    kernel = functools.partial(_gmm_kernel, tiling=tiling, num_k=lhs_p.shape[1] // tiling.block_k, transpose_rhs=transpose_rhs)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((lhs_p.shape[0], n_padded), out_dtype),
        grid=(items[0].shape[0], n_padded // tiling.block_n),
        compiler_params=_compiler_params("gmm", tiling, lhs.dtype, interpret),
        interpret=interpret,
        name="gmm_dlhs" if transpose_rhs else "gmm",
    )(*items, lhs_p, rhs_p)
    written = jnp.arange(m)[:, None] < jnp.sum(group_sizes)  # rows past the groups are never stored
    return jnp.where(written, out[:m, :n], 0).astype(out_dtype)


def _tgmm_kernel(start_ref, end_ref, lhs_ref, dout_ref, out_ref, *, tiling: Tiling):
    bm, bk, bn = tiling.block_m, tiling.block_k, tiling.block_n
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[g], end_ref[g]

    def body(t, acc):
        rows = t * bm + jnp.arange(bm)
        x = lhs_ref[pl.ds(t * bm, bm), pl.ds(i * bk, bk)]
        x = jnp.where(((rows >= start) & (rows < end))[:, None], x, jnp.zeros_like(x))
        return acc + dot_tn(x, dout_ref[pl.ds(t * bm, bm), pl.ds(j * bn, bn)])

    acc = jax.lax.fori_loop(start // bm, cdiv(end, bm), body, jnp.zeros((bk, bn), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret"))
def tgmm(
    lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, tiling: Tiling = DEFAULT_TILING, out_dtype=jnp.float32, interpret: bool = False
) -> jax.Array:
    """``(G, k, n)``: ``sum_{i in g} lhs[i]^T dout[i]`` per group ``g`` (0 for an empty group)."""
    (m, k), n, num_groups = lhs.shape, dout.shape[1], group_sizes.shape[0]
    lhs_p = pad_to(pad_to(lhs, 0, tiling.block_m), 1, tiling.block_k)
    dout_p = pad_to(pad_to(dout, 0, tiling.block_m), 1, tiling.block_n)
    out_shape = jax.ShapeDtypeStruct((num_groups, lhs_p.shape[1], dout_p.shape[1]), out_dtype)
    backends.check_int32_offsets("tgmm", _INT32_FIX, lhs_p, dout_p, out_shape)
    starts, ends = group_bounds(group_sizes, m)
    k_tiles, n_tiles = lhs_p.shape[1] // tiling.block_k, dout_p.shape[1] // tiling.block_n
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, tiling=tiling),
        out_shape=out_shape,
        grid=(num_groups, k_tiles, n_tiles),
        out_specs=pl.BlockSpec((None, tiling.block_k, tiling.block_n), lambda g, i, j: (g, i, j)),
        compiler_params=_compiler_params("tgmm", tiling, lhs.dtype, interpret),
        interpret=interpret,
        name="tgmm",
    )(starts, ends, lhs_p, dout_p)
    return out[:, :k, :n]
