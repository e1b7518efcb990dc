"""The unfused quantized update in plain XLA: dequantize -> rule -> requantize, the definition of correct.

Bit for bit the step `optim.quantize_state` takes for an AdamW or Lion leaf (tests/kernels_pallas/
quantized_update check it), written on raw arrays so that `kernels_pallas` imports jax only. Layouts,
rounding and rules: `base`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.quantized_update import base

QMoment = tuple[jax.Array, ...]  # (codes, absmax) or (codes, row, col), in optim.quantization's shapes


def _tiled(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``(B, R, C)`` -> ``(B, nR, tr, nC, tc)``, zero-padded to whole tiles."""
    (tr, tc), (b, rows, cols) = tile, x.shape
    nr, nc = -(-rows // tr), -(-cols // tc)
    x = jnp.pad(x, [(0, 0), (0, nr * tr - rows), (0, nc * tc - cols)])
    return x.reshape(b, nr, tr, nc, tc)


def _untiled(t: jax.Array, rows: int, cols: int) -> jax.Array:
    b, nr, tr, nc, tc = t.shape
    return t.reshape(b, nr * tr, nc * tc)[:, :rows, :cols]


def unpack(codes: jax.Array, bits: int, shape3: tuple[int, int, int]) -> jax.Array:
    """Codes as ``(B, R, C)`` int32 (4-bit: low nibble = even column)."""
    codes = codes.reshape(*shape3[:2], -1).astype(jnp.int32)
    if bits == 8:
        return codes
    return jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(*shape3[:2], -1)[..., : shape3[2]]


def pack(codes: jax.Array, bits: int, shape: tuple[int, ...]) -> jax.Array:
    """``(B, R, C)`` codes as stored for an array of ``shape`` (uint8, 4-bit packed two per byte)."""
    codes = codes.astype(jnp.uint8)
    if bits == 4:
        codes = jnp.pad(codes, [(0, 0), (0, 0), (0, codes.shape[-1] % 2)])
        pairs = codes.reshape(*codes.shape[:2], -1, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    return codes.reshape(*shape[:-1], -1)


def scale_of(moment: base.Moment, scales: tuple[jax.Array, ...], shape3: tuple[int, int, int]) -> jax.Array:
    """Each element's scale, ``(B, R, C)``: its tile's absmax, or ``min(r_i, c_j)``."""
    b, rows, cols = shape3
    if moment.tile is None:
        row, col = scales
        return jnp.minimum(row.reshape(b, rows, 1), col.reshape(b, 1, cols))
    (absmax,) = scales
    absmax = absmax.reshape(b, -(-rows // moment.tile[0]), 1, -(-cols // moment.tile[1]), 1)
    return _untiled(jnp.broadcast_to(absmax, (*absmax.shape[:2], moment.tile[0], absmax.shape[3], moment.tile[1])), rows, cols)


def decode(moment: base.Moment, q: QMoment, shape: tuple[int, ...]) -> jax.Array:
    """The fp32 values of a quantized moment, ``(B, R, C)``."""
    shape3 = base.as_3d(shape)
    codes = unpack(q[0], moment.bits, shape3)
    return jnp.asarray(moment.values())[codes] * scale_of(moment, q[1:], shape3)


def rounding_noise(key: jax.Array, moment: base.Moment, shape: tuple[int, ...]) -> jax.Array:
    """The uniforms `optim.quantization` draws from ``key`` for an array of ``shape``, as ``(B, R, C)``.

    Block-wise it draws them over the zero-padded tiled array ``(*lead, nR, tr, nC, tc)``; rank-1
    over the array itself.
    """
    b, rows, cols = base.as_3d(shape)
    if moment.tile is None:
        return jax.random.uniform(key, shape).reshape(b, rows, cols)
    (tr, tc), lead = moment.tile, shape[:-2]
    tiled = (*lead, -(-rows // tr), tr, -(-cols // tc), tc)
    return _untiled(jax.random.uniform(key, tiled).reshape(b, *tiled[-4:]), rows, cols)


def encode(
    moment: base.Moment, x: jax.Array, shape: tuple[int, ...], noise: jax.Array | None = None
) -> QMoment:
    """Quantizes ``x`` ``(B, R, C)`` fp32 into ``moment``'s layout for an array of ``shape``."""
    cols = x.shape[-1]
    if moment.tile is None:
        row = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        col = jnp.max(jnp.abs(x), axis=-2, keepdims=True)
        scales = (row.reshape(*shape[:-1], 1), col.reshape(*shape[:-2], 1, cols))
        scale = jnp.minimum(row, col)
    else:
        absmax = jnp.max(jnp.abs(_tiled(x, moment.tile)), axis=(2, 4))
        scales = (absmax.reshape(*shape[:-2], *absmax.shape[1:]) if len(shape) >= 2 else absmax[0, 0],)
        scale = scale_of(moment, (absmax,), x.shape)
    y = x / jnp.where(scale > 0, scale, 1.0)
    points, values = jnp.asarray(moment.search_points()), jnp.asarray(moment.values())
    codes = base.nearest_code(y, lambda i: points[i], moment.bits)
    if noise is not None:
        codes = base.stochastic_code(y, codes, lambda i: values[i], len(moment.table), noise)
    return (pack(codes, moment.bits, shape), *scales)


def quantized_update(
    rule: base.Rule,
    param: jax.Array,
    grad: jax.Array,
    moments: list[QMoment],
    layouts: list[base.Moment],
    scalars: jax.Array,
    noise: list[jax.Array] | None = None,
) -> tuple[jax.Array, list[QMoment]]:
    """One step of ``rule`` on one parameter: ``(update, new quantized moments)``.

    ``scalars`` is ``rule.scalars(count, lr)``; ``noise`` (one ``(B, R, C)`` uniform array per moment,
    `rounding_noise`) turns on stochastic rounding.
    """
    shape3 = base.as_3d(param.shape)
    p = param.astype(jnp.float32).reshape(shape3)
    g = grad.astype(jnp.float32).reshape(shape3)
    values = [decode(m, q, param.shape) for m, q in zip(layouts, moments, strict=True)]
    update, values = rule.step(p, g, values, scalars)
    noise = noise or [None] * len(layouts)
    new = [encode(m, x, param.shape, u) for m, x, u in zip(layouts, values, noise, strict=True)]
    return update.reshape(param.shape).astype(grad.dtype), new
