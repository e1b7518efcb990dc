"""The fused quantized update for GPUs: one Pallas program (lowered through Triton) per ``(bm, bn)`` block.

Each program loads its block of parameters, gradients, codes and scales, decodes the moments with a
gather from the code table, applies the rule (`base`), finds each new tile's absmax, rounds with the
binary search of `base.nearest_code` (or stochastically, from uniforms drawn outside with
`optim.quantize_state`'s key stream) and stores the update, the codes and the absmax; codes and
scales are written over their inputs (``input_output_aliases``), so no fp32 copy of a moment exists
in device memory. A block holds whole ``(tr, tc)`` tiles; ragged edges are masked loads and stores,
so nothing is padded or copied. 4-bit blocks are handled as their even and odd columns (one nibble
each, strided loads), so the packed codes are never interleaved in registers.

Rank-1 moments (4-bit second moments) take their new row and column maxima as inputs: `api` computes
them first with an XLA reduction over the same fused decode-and-update, which does not store the
moment either. Parameters of ``2**31`` or more elements are refused (the kernel's offsets are int32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import backends
from kernels_pallas.quantized_update import base


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows and columns of one program's block, rounded to whole tiles; ``num_warps`` for Triton."""

    rows: int = 32
    cols: int = 128
    num_warps: int = 4

    def __post_init__(self):
        for name in ("rows", "cols", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name}={value} must be a power of two")

    def block(self, tile: tuple[int, int]) -> tuple[int, int]:
        return max(self.rows, tile[0]), max(self.cols, tile[1])


def _expand(a: jax.Array, tr: int, width: int) -> jax.Array:
    """``(k1, k2)`` per-tile values -> ``(k1 tr, k2 width)`` per element."""
    k1, k2 = a.shape
    return jnp.broadcast_to(a[:, None, :, None], (k1, tr, k2, width)).reshape(k1 * tr, k2 * width)


def _tile_max(x: jax.Array, tr: int, width: int) -> jax.Array:
    rows, cols = x.shape
    return jnp.max(jnp.max(x.reshape(rows // tr, tr, cols // width, width), axis=3), axis=1)


def _tile_mask(tile: tuple[int, int], shape3: tuple[int, int, int], i, j, bm: int, bn: int) -> jax.Array:
    """Which tiles of block ``(i, j)`` exist, ``(bm / tr, bn / tc)``."""
    (tr, tc), (_, rows, cols) = tile, shape3
    k1, k2 = bm // tr, bn // tc
    tile_rows = i * k1 + jax.lax.broadcasted_iota(jnp.int32, (k1, 1), 0)
    tile_cols = j * k2 + jax.lax.broadcasted_iota(jnp.int32, (1, k2), 1)
    return (tile_rows < -(-rows // tr)) & (tile_cols < -(-cols // tc))


def _kernel(*refs, spec: base.Spec):
    bm, bn = spec.block
    parts, width = spec.parts, spec.block[1] // spec.parts
    s_ref, tables, p_ref, g_ref, moment_in, noise, u_ref, moment_out = base.kernel_refs(spec, refs)

    _, rows_total, cols_total = spec.shape3
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    scalars = [s_ref[k] for k in range(spec.n_scalars)]

    def cols_of(part):
        return j * bn + part + parts * jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def columns(part):
        return pl.ds(part, width, stride=parts) if parts > 1 else slice(None)

    valid = [(rows < rows_total) & (cols_of(k) < cols_total) for k in range(parts)]
    code_cols = -(-cols_total // parts)
    code_valid = (rows < rows_total) & (j * width + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < code_cols)

    def read(ref, mask):
        return plgpu.load(ref, mask=mask, other=0) if spec.masked else ref[...]

    def write(ref, value, mask):
        if spec.masked:
            plgpu.store(ref, value, mask=mask)
        else:
            ref[...] = value

    def load(ref, part, mask):
        return read(ref.at[:, columns(part)], mask)

    packed = [read(ins[0], code_valid).astype(jnp.int32) for ins in moment_in]
    tile_valid = [_tile_mask(m.tile, spec.shape3, i, j, bm, bn) if m.tile else None for m in spec.layouts]
    old_absmax = [read(ins[1], ok) if m.tile else None for m, ins, ok in zip(spec.layouts, moment_in, tile_valid)]
    results = []
    for part in range(parts):
        ok = valid[part]
        p = jnp.where(ok, load(p_ref, part, ok).astype(jnp.float32), 0.0)
        g = jnp.where(ok, load(g_ref, part, ok).astype(jnp.float32), 0.0)
        values = []
        for idx, (m, ins) in enumerate(zip(spec.layouts, moment_in)):
            codes = packed[idx] if parts == 1 else (packed[idx] >> (4 * part)) & 15
            if m.tile:
                scale = _expand(old_absmax[idx], m.tile[0], m.tile[1] // parts)
            else:
                row, col = ins[1], ins[2]
                scale = jnp.minimum(read(row, rows < rows_total), load(col, part, cols_of(part) < cols_total))
            table = tables[2 * idx]
            values.append(jnp.where(ok, table[codes] * scale, 0.0))
        update, values = spec.rule.step(p, g, values, scalars)
        write(u_ref.at[:, columns(part)], update.astype(u_ref.dtype), ok)
        results.append([jnp.where(ok, v, 0.0) for v in values])

    out = iter(moment_out)
    for idx, (m, ins) in enumerate(zip(spec.layouts, moment_in)):
        xs = [results[part][idx] for part in range(parts)]
        if m.tile:
            tr, w = m.tile[0], m.tile[1] // parts
            absmax = functools.reduce(jnp.maximum, [_tile_max(jnp.abs(x), tr, w) for x in xs])
            scales = [_expand(absmax, tr, w)] * parts
        else:
            new_row, new_col = ins[3], ins[4]
            r = read(new_row, rows < rows_total)
            scales = [jnp.minimum(r, load(new_col, part, cols_of(part) < cols_total)) for part in range(parts)]
        codes = 0
        for part, (x, scale) in enumerate(zip(xs, scales)):
            y = x / jnp.where(scale > 0, scale, 1.0)
            points, values = tables[2 * idx + 1], tables[2 * idx]
            c = base.nearest_code(y, lambda k, points=points: points[k], m.bits)
            if noise[idx] is not None:
                u = load(noise[idx], part, valid[part])
                c = base.stochastic_code(y, c, lambda k, values=values: values[k], len(m.table), u)
            codes = codes | (jnp.where(valid[part], c, 0) << (4 * part))
        write(next(out), codes.astype(jnp.uint8), code_valid)
        if m.tile:
            write(next(out), absmax, tile_valid[idx])


def fused_update(
    spec: base.Spec,
    scalars: jax.Array,
    param: jax.Array,
    grad: jax.Array,
    moments: list[tuple[jax.Array, ...]],
    noise: list[jax.Array] | None,
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
    """One kernel call on ``(B, R, C)`` arrays; moments as ``(codes, absmax)`` or ``(codes, row, col, new_row, new_col)``.

    Codes ``(B, R, ceil(C / parts))``, absmax ``(B, nR, nC)``, rows ``(B, R, 1)``, columns ``(B, 1, C)``.
    Returns the update ``(B, R, C)`` and, per moment, its new codes and (block-wise) absmax.
    """
    backends.check_int32_offsets(
        "quantized_update", "split the parameter into smaller arrays or use optimizer.state_kernel=xla", param, grad, *(noise or ())
    )
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    ops = base.operands(spec, scalars, param, grad, moments, noise, small=full)
    outs = pl.pallas_call(
        functools.partial(_kernel, spec=spec),
        grid=ops.grid,
        in_specs=ops.in_specs,
        out_specs=ops.out_specs,
        out_shape=ops.out_shape,
        input_output_aliases=ops.aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="quantized_update",
    )(*ops.args)
    return base.split_outputs(spec, outs)
