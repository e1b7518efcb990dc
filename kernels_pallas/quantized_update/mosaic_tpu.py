r"""The fused quantized update for TPUs: one Pallas Mosaic program per ``(bm, bn)`` block, no gathers.

Same contract as the Triton kernel (`triton`): load a block of parameters, gradients, codes and
scales, decode, apply the rule (`base`), find the new scales, requantize with the same rounding,
store the update and write codes and scales over their inputs (``input_output_aliases``). What is
TPU-specific is that Mosaic has no vector gather from a 256-entry table, so every table access is
an exact gather-free formulation over the sorted code (held in SMEM, read as scalars in a loop):

- decode: ``x = sum_k [code = k] t_k``, i.e. a select per entry;
- nearest rounding: ``code = #{k : y > mid_k}``, the count the binary search of `base.nearest_code`
  computes (it finds the same number of midpoints below ``y``);
- stochastic rounding: ``lo = clip(#{k : t_k <= y} - 1, 0, 2^bits - 2)``, the largest entry not
  above ``y`` (which is what `base.stochastic_code` derives from the nearest code), with ``t_lo``,
  ``t_hi`` selected in the same loop; then the same ``u < (y - t_lo) / (t_hi - t_lo)``.

The cost is ``O(2^bits)`` vector operations per element (cheap for 4 bits; for 8 bits it makes the
step compute-bound, which is the price of exactness without a gather). Layout work avoids lane
reshapes: a tile's absmax is expanded to its lanes and reduced from them one ``tc``-lane segment at
a time; 4-bit codes are split into nibbles and interleaved into columns ``2k`` / ``2k + 1`` (and
packed back) by exact 0/1 matrix products on the MXU (small integers, fp32 accumulation).

Edge blocks read undefined values outside the array (the pipeline clips its copies) and drop writes
there; every value read is masked by the array bounds first. On hardware Mosaic wants the last two
block dimensions multiples of ``(8, 128)``, for the absmax blocks ``(bm / tr, bn / tc)`` too:
`DEFAULT_BLOCK_SIZES` satisfies that for 16 x 16 and 8 x 16 tiles. Tested exactly against the
reference in TPU interpret mode on CPU; not yet compiled or timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.quantized_update import base
from kernels_pallas.quantized_update.triton import BlockSizes

DEFAULT_BLOCK_SIZES = BlockSizes(rows=128, cols=2048)
_NIBBLE_CHUNK = 128  # packed columns interleaved per matrix product


def _decode(codes: jax.Array, table_ref, size: int) -> jax.Array:
    """``table[codes]`` by one select per entry."""

    def body(k, x):
        return jnp.where(codes == k, table_ref[k], x)

    return jax.lax.fori_loop(0, size, body, jnp.zeros(codes.shape, jnp.float32))


def _nearest(y: jax.Array, points_ref, size: int) -> jax.Array:
    """``#{k : y > mid_k}`` (``mid_{size-1} = +inf`` is never passed)."""

    def body(k, n):
        return n + (y > points_ref[k]).astype(jnp.int32)

    return jax.lax.fori_loop(0, size - 1, body, jnp.zeros(y.shape, jnp.int32))


def _stochastic(y: jax.Array, table_ref, size: int, u: jax.Array) -> jax.Array:
    """`base.stochastic_code` without a gather: the bracketing entries are selected while counting."""

    def body(k, carry):
        lo, t_lo, t_hi = carry
        above = table_ref[k] <= y
        return jnp.where(above, k, lo), jnp.where(above, table_ref[k], t_lo), jnp.where(above, table_ref[k + 1], t_hi)

    start = (jnp.zeros(y.shape, jnp.int32), jnp.full(y.shape, table_ref[0]), jnp.full(y.shape, table_ref[1]))
    lo, t_lo, t_hi = jax.lax.fori_loop(1, size - 1, body, start)
    p = jnp.clip((y - t_lo) / (t_hi - t_lo), 0.0, 1.0)
    return lo + (u < p).astype(jnp.int32)


def _segments(bn: int, tc: int) -> jax.Array:
    """Each lane's tile column within the block, ``(1, bn)``."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1) // tc


def _rows_repeated(x: jax.Array, tr: int) -> jax.Array:
    """``(k1, bn)`` -> ``(k1 tr, bn)``, each row repeated ``tr`` times (a sublane broadcast)."""
    k1, bn = x.shape
    return jnp.broadcast_to(x[:, None, :], (k1, tr, bn)).reshape(k1 * tr, bn)


def _expand(absmax: jax.Array, tile: tuple[int, int], bn: int) -> jax.Array:
    """Per-tile values ``(k1, k2)`` -> per element ``(k1 tr, bn)``."""
    tr, segment = tile[0], _segments(bn, tile[1])
    lanes = jnp.zeros((absmax.shape[0], bn), jnp.float32)
    for c in range(absmax.shape[1]):
        lanes = jnp.where(segment == c, absmax[:, c : c + 1], lanes)
    return _rows_repeated(lanes, tr)


def _tile_max(a: jax.Array, tile: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """Max of non-negative ``a`` ``(bm, bn)`` per tile: ``(k1, k2)`` and expanded back to ``(bm, bn)``."""
    (tr, tc), (bm, bn) = tile, a.shape
    k1, k2 = bm // tr, bn // tc
    rows = jnp.max(a.reshape(k1, tr, bn), axis=1)
    segment, column = _segments(bn, tc), jax.lax.broadcasted_iota(jnp.int32, (1, k2), 1)
    compact, lanes = jnp.zeros((k1, k2), jnp.float32), jnp.zeros((k1, bn), jnp.float32)
    for c in range(k2):
        m = jnp.max(jnp.where(segment == c, rows, 0.0), axis=1, keepdims=True)
        compact, lanes = jnp.where(column == c, m, compact), jnp.where(segment == c, m, lanes)
    return compact, _rows_repeated(lanes, tr)


def _spread(width: int, phase: int, weight: float = 1.0) -> jax.Array:
    """``(width, 2 width)`` 0/``weight`` matrix taking packed column ``k`` to column ``2k + phase``."""
    k = jax.lax.broadcasted_iota(jnp.int32, (width, 2 * width), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (width, 2 * width), 1)
    return jnp.where(j == 2 * k + phase, weight, 0.0).astype(jnp.float32)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Packed 4-bit codes ``(bm, bn / 2)`` -> one code per column ``(bm, bn)``, int32."""
    chunks = []
    for start in range(0, packed.shape[1], _NIBBLE_CHUNK):
        p = packed[:, start : start + _NIBBLE_CHUNK]
        width = p.shape[1]
        low, high = (p & 15).astype(jnp.float32), (p >> 4).astype(jnp.float32)
        chunks.append(_dot(low, _spread(width, 0)) + _dot(high, _spread(width, 1)))
    return jnp.concatenate(chunks, axis=1).astype(jnp.int32) if len(chunks) > 1 else chunks[0].astype(jnp.int32)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    """Codes ``(bm, bn)`` (0..15) -> bytes ``(bm, bn / 2)``: ``codes[2k] + 16 codes[2k + 1]``."""
    chunks = []
    for start in range(0, codes.shape[1], 2 * _NIBBLE_CHUNK):
        c = codes[:, start : start + 2 * _NIBBLE_CHUNK].astype(jnp.float32)
        width = c.shape[1] // 2
        chunks.append(_dot(c, (_spread(width, 0) + _spread(width, 1, 16.0)).T))
    packed = jnp.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
    return packed.astype(jnp.int32)


def _kernel(*refs, spec: base.Spec):
    bm, bn = spec.block
    s_ref, tables, p_ref, g_ref, moment_in, noise, u_ref, moment_out = base.kernel_refs(spec, refs)

    _, rows_total, cols_total = spec.shape3
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    valid = (rows < rows_total) & (cols < cols_total)
    scalars = [s_ref[k] for k in range(spec.n_scalars)]

    p = jnp.where(valid, p_ref[...].astype(jnp.float32), 0.0)
    g = jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0)
    values = []
    for idx, (m, ins) in enumerate(zip(spec.layouts, moment_in)):
        codes = _unpack_nibbles(ins[0][...].astype(jnp.int32)) if spec.parts == 2 else ins[0][...].astype(jnp.int32)
        scale = _expand(ins[1][...], m.tile, bn) if m.tile else jnp.minimum(ins[1][...], ins[2][...])
        values.append(jnp.where(valid, _decode(codes, tables[2 * idx], len(m.table)) * scale, 0.0))
    update, values = spec.rule.step(p, g, values, scalars)
    u_ref[...] = update.astype(u_ref.dtype)

    out = iter(moment_out)
    for idx, (m, ins, x) in enumerate(zip(spec.layouts, moment_in, values)):
        x = jnp.where(valid, x, 0.0)
        if m.tile:
            absmax, scale = _tile_max(jnp.abs(x), m.tile)
        else:
            scale = jnp.minimum(ins[3][...], ins[4][...])
        y = x / jnp.where(scale > 0, scale, 1.0)
        values_ref, points_ref = tables[2 * idx], tables[2 * idx + 1]
        if noise[idx] is None:
            codes = _nearest(y, points_ref, len(m.table))
        else:
            codes = _stochastic(y, values_ref, len(m.table), noise[idx][...])
        codes = jnp.where(valid, codes, 0)
        codes_ref = next(out)
        codes_ref[...] = (_pack_nibbles(codes) if spec.parts == 2 else codes).astype(jnp.uint8)
        if m.tile:
            next(out)[...] = absmax


def fused_update(
    spec: base.Spec,
    scalars: jax.Array,
    param: jax.Array,
    grad: jax.Array,
    moments: list[tuple[jax.Array, ...]],
    noise: list[jax.Array] | None,
    *,
    num_warps: int = 4,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
    """`triton.fused_update`'s contract on a TPU; ``interpret=True`` runs the TPU interpreter.

    ``num_warps`` is ignored (a Triton setting, accepted so that `api` calls every backend alike).
    """
    del num_warps
    if spec.parts == 2 and spec.block[1] % 2:
        raise ValueError(f"4-bit blocks need an even column count, got {spec.block[1]}")
    ops = base.operands(spec, scalars, param, grad, moments, noise, small=lambda _: pl.BlockSpec(memory_space=pltpu.SMEM))
    outs = pl.pallas_call(
        functools.partial(_kernel, spec=spec),
        grid=ops.grid,
        in_specs=ops.in_specs,
        out_specs=ops.out_specs,
        out_shape=ops.out_shape,
        # jax 0.10's TPU interpreter returns an aliased buffer padded to whole blocks: alias compiled only.
        input_output_aliases=ops.aliases if interpret is False else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="quantized_update",
    )(*ops.args)
    return base.split_outputs(spec, outs)
