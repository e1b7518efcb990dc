r"""Block-wise 8-bit and 4-bit quantization of optimizer-state arrays.

Two layouts, each a pytree node holding ``uint8`` codes plus fp32 scales, with the array's shape,
dtype, bit width and code table as static metadata:

- `BlockQuantized` (block-wise absmax, "8-bit Optimizers via Block-wise Quantization", Dettmers et
  al., arXiv:2110.02861; 4-bit first moments of "Memory Efficient Optimizers with 4-bit States", Li
  et al., arXiv:2309.01507). A block is a tile of ``block_size`` elements; each block stores
  ``absmax = max |x|`` and every element the index of the code-table entry nearest ``x / absmax``.
  Decoding is ``x = table[code] * absmax``.
- `Rank1Quantized` (rank-1 normalisation, arXiv:2309.01507 Sec. 4.2, for second moments). Each
  matrix of the array stores its row maxima ``r_i = max_j |x_ij|`` and column maxima
  ``c_j = max_i |x_ij|``; an element is coded relative to ``min(r_i, c_j)``. Decoding is
  ``x_ij = table[code_ij] * min(r_i, c_j)``.

- `MinMaxQuantized` (block-wise asymmetric, uniform levels: MicroAdam's error feedback, Modoranu
  et al., arXiv:2405.15593, ``asymm_block_quant`` of IST-DASLab). A block (a tile, as above) stores
  ``lo = min x`` and ``hi = max x``; with ``u = (hi - lo) / (2^bits - 1)`` an element stores
  ``floor((x - lo) / u + 1/2)`` and decodes to ``lo + code u`` (a constant block stores code 0).

Code tables (sorted; a code is an index into its table):

- ``"signed"`` / ``"unsigned"``: the *dynamic* code of arXiv:2110.02861 (Dettmers 2015,
  arXiv:1511.04561). Bit patterns are a sign bit (signed only), ``E`` zeros giving the magnitude
  ``10^-E``, an indicator bit, and the remaining bits as a linear fraction in ``(0.1, 1)``. The
  values are the fraction-interval midpoints times ``10^-E`` for ``E = 0 .. bits-2``, plus ``0`` and
  ``1``. The unsigned table spends the sign bit on one more fraction bit. The 4-bit signed table is
  the paper's "DE" (dynamic exponent) map. Matches ``create_dynamic_map`` of bitsandbytes and of
  thu-ml/low-bit-optimizers (``lpmm/functional.py``).
- ``"linear"``: ``(i + 1) / 2^bits`` for ``i = 0 .. 2^bits - 1``, the zero-free linear map of
  arXiv:2309.01507 for second moments (a zero code would turn ``m / sqrt(v)`` into ``m / eps``).

Layout (what a fused kernel reads and writes in place). For an array of shape ``(*lead, R, C)``
(a 1-D array of length ``C`` is treated as ``(1, C)``):

- ``codes``: ``uint8``, shape ``(*lead, R, C)`` for 8 bits; ``(*lead, R, ceil(C / 2))`` for 4 bits,
  byte ``k`` of a row holding column ``2k`` in its low nibble and column ``2k + 1`` in its high nibble.
- ``BlockQuantized.absmax``: fp32, ``(*lead, ceil(R / tr), ceil(C / tc))``; tile ``(tr, tc)`` with
  ``tr * tc = block_size`` (`tile_shape`: 16 x 16 for 256, 8 x 16 for 128; shorter and wider when
  ``R < tr``). Block ``(a, b)`` covers rows ``a*tr .. a*tr+tr-1`` and columns ``b*tc .. b*tc+tc-1``;
  ragged edge tiles hold fewer elements. Leading axes index separate tiles.
- ``Rank1Quantized.row`` / ``.col``: fp32, ``(*lead, R, 1)`` and ``(*lead, 1, C)``.

Every stored array has the rank of the original, and each of its axes is either the original axis,
that axis cut into whole tiles, or an axis of size 1. Sharding follows the parameter: each array takes
the parameter's `PartitionSpec` on every axis it splits evenly, and the mesh axes of a size-1 axis move
to the other matrix axis (`sharding.partition.state_shardings`), so every piece is spread over the same
devices as the parameter.

Blocks are 2-D tiles rather than the papers' runs of consecutive elements of the flattened tensor so
that they follow the sharding: FSDP shards ``embed``, which is the *last* axis of an output projection,
where runs of 256 consecutive elements cross shard boundaries whenever ``C / n_shards < 256``.
**Blocks never straddle shard boundaries** when each shard of the last two axes holds whole tiles,
i.e. the per-shard lengths of ``R`` and ``C`` are multiples of ``tr`` and ``tc`` (16 for the 8-bit
default; true of every model dimension that is a multiple of ``16 x`` its mesh-axis size); leading
axes can be sharded freely. Otherwise that axis of the scales is replicated and XLA moves the
straddling values, which stays correct but costs communication. Rank-1 maxima along a sharded axis
take one all-reduce of a vector per step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CODES = ("signed", "unsigned", "linear")


@functools.lru_cache(maxsize=None)
def code_table(code: str, bits: int) -> np.ndarray:
    """The sorted ``2**bits`` values of code ``code`` ("signed", "unsigned" or "linear"), float32."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if code == "linear":
        return ((np.arange(2**bits) + 1) / 2**bits).astype(np.float32)
    if code not in CODES:
        raise ValueError(f"unknown code {code!r}; use one of {', '.join(CODES)}")
    signed = code == "signed"
    magnitudes = []
    for e in range(bits - 1):  # 10^-e, with one fraction bit fewer per extra exponent zero
        n = 2 ** (bits - 2 - e) * (1 if signed else 2)
        edges = np.linspace(0.1, 1.0, n + 1)
        magnitudes.append(10.0**-e * (edges[:-1] + edges[1:]) / 2)
    mags = np.concatenate(magnitudes)
    values = np.concatenate([[0.0, 1.0], mags, -mags if signed else []])
    return np.sort(values).astype(np.float32)


def check_block_size(block_size: int, name: str = "block_size") -> None:
    """Raises a ValueError naming ``name`` unless ``block_size`` is a power of two >= 2."""
    if block_size < 2 or block_size & (block_size - 1):
        below = 1 << max(block_size.bit_length() - 1, 1)
        raise ValueError(f"{name}={block_size} must be a power of two >= 2, e.g. {below}")


def tile_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, int]:
    """The ``(rows, cols)`` tile of ``block_size`` elements used for an array of ``shape``.

    Square-ish (``cols = 2^ceil(log2(block_size) / 2)``), with fewer rows and more columns when the
    array has fewer rows than that; a 1-D array gets ``(1, block_size)``.
    """
    check_block_size(block_size)
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = 2 ** ((block_size.bit_length()) // 2)
    tr = min(block_size // cols, 1 << max(rows - 1, 0).bit_length())
    return tr, block_size // tr


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """An array stored as block-wise absmax codes (layout in the module docstring)."""

    codes: jax.Array  # uint8 codes, 4-bit ones packed two per byte along the last axis
    absmax: jax.Array  # fp32 max |x| per tile, (*lead, ceil(R / tr), ceil(C / tc))
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    bits: int = _static()
    code: str = _static()
    tile: tuple[int, int] = _static()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rank1Quantized:
    """An array of >= 2 axes stored with rank-1 (row and column maxima) normalisation."""

    codes: jax.Array  # uint8 codes, 4-bit ones packed two per byte along the last axis
    row: jax.Array  # fp32 max |x| per row of each matrix, (*lead, R, 1)
    col: jax.Array  # fp32 max |x| per column of each matrix, (*lead, 1, C)
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    bits: int = _static()
    code: str = _static()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MinMaxQuantized:
    """An array stored as block-wise asymmetric uniform codes (`quantize_minmax`)."""

    codes: jax.Array  # uint8 codes, 4-bit ones packed two per byte along the last axis
    lo: jax.Array  # fp32 min x per tile, (*lead, ceil(R / tr), ceil(C / tc))
    hi: jax.Array  # fp32 max x per tile, same shape
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    bits: int = _static()
    tile: tuple[int, int] = _static()


Quantized = BlockQuantized | Rank1Quantized | MinMaxQuantized


def is_quantized(x: Any) -> bool:
    return isinstance(x, BlockQuantized | Rank1Quantized | MinMaxQuantized)


def _guess(y: jax.Array, code: str, bits: int) -> jax.Array:
    """An index at most one entry away from the table entry nearest ``y``, by arithmetic (no search).

    Dynamic codes: ``y``'s decade ``e = floor(-log10 |y|)`` holds ``n_e = k 2^(bits-2-e)`` fraction
    codes (``k = 1`` signed, 2 unsigned), ``n_e - k`` magnitudes lie in the smaller decades, and the
    fraction interval is ``j = floor((|y| 10^e - 0.1) / 0.9 n_e)``. Rounding of ``log10`` near a
    decade boundary moves the guess by at most one entry.
    """
    if code == "linear":
        return jnp.clip(jnp.round(y * 2**bits) - 1, 0, 2**bits - 1).astype(jnp.int32)
    k = 1 if code == "signed" else 2
    mag = jnp.abs(y)
    e = jnp.clip(jnp.floor(-jnp.log10(mag)), 0, bits - 2)  # |y| = 0 gives the smallest decade
    n_e = k * jnp.exp2(bits - 2 - e)
    j = jnp.clip(jnp.floor((mag * jnp.exp(e * np.log(10.0)) - 0.1) / 0.9 * n_e), 0, n_e - 1)
    zero = 2 ** (bits - 1) - 1 if code == "signed" else 0  # index of the code 0
    rank = 1 + (n_e - k) + j  # position of the magnitude above the code 0
    return (zero + jnp.where(y < 0, -rank, rank)).astype(jnp.int32)


def _round(y: jax.Array, code: str, bits: int, key: jax.Array | None) -> jax.Array:
    """Index of the table entry nearest ``y`` (``key=None``) or a stochastic rounding to a neighbour.

    Nearest: from a guess ``c`` within one entry of it, ``c - 1 + [y > mid_{c-1}] + [y > mid_c]`` with
    ``mid`` the midpoints between adjacent entries. Stochastic: ``lo <= y <= hi`` adjacent entries,
    pick ``hi`` with probability ``(y - lo) / (hi - lo)`` (unbiased inside the table's range).
    """
    table = code_table(code, bits)
    mid = jnp.asarray((table[1:] + table[:-1]) / 2)
    c = jnp.clip(_guess(y, code, bits), 1, len(table) - 2)
    nearest = c - 1 + (y > mid[c - 1]) + (y > mid[c])
    if key is None:
        return nearest.astype(jnp.uint8)
    t = jnp.asarray(table)
    lo = jnp.clip(nearest - (t[nearest] > y), 0, len(table) - 2)
    p = jnp.clip((y - t[lo]) / (t[lo + 1] - t[lo]), 0.0, 1.0)
    return (lo + (jax.random.uniform(key, y.shape) < p)).astype(jnp.uint8)


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    if bits == 8:
        return codes
    cols = codes.shape[-1]
    codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, cols % 2)])
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(packed: jax.Array, bits: int, cols: int) -> jax.Array:
    if bits == 8:
        return packed
    pairs = jnp.stack([packed & 15, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], -1)[..., :cols]


def as_matrix(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a leaf of ``shape`` is tiled as: itself with >= 2 axes, a vector as one row."""
    if not shape:
        raise ValueError("cannot quantize a scalar; keep scalar state leaves unquantized")
    return shape if len(shape) >= 2 else (1, *shape)


def tiles(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``(*lead, R, C)`` -> ``(*lead, nR, tr, nC, tc)``, zero-padded to whole tiles."""
    (tr, tc), (rows, cols) = tile, x.shape[-2:]
    nr, nc = -(-rows // tr), -(-cols // tc)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, nr * tr - rows), (0, nc * tc - cols)])
    return x.reshape(*x.shape[:-2], nr, tr, nc, tc)


def untile(t: jax.Array, rows: int, cols: int) -> jax.Array:
    """The inverse of `tiles`: ``(*lead, nR, tr, nC, tc)`` -> ``(*lead, rows, cols)``, padding dropped."""
    *lead, nr, tr, nc, tc = t.shape
    return t.reshape(*lead, nr * tr, nc * tc)[..., :rows, :cols]


def quantize_blockwise(
    x: jax.Array,
    *,
    bits: int = 8,
    code: str = "signed",
    block_size: int = 256,
    key: jax.Array | None = None,
) -> BlockQuantized:
    """Block-wise absmax quantization of ``x`` (any shape with at least one axis).

    ``absmax_b = max_{i in b} |x_i|``; ``code_i = argmin_k |table_k - x_i / absmax_b|`` (nearest, or
    stochastic rounding when ``key`` is given). An all-zero block stores ``absmax = 0`` and decodes to
    zeros. Values outside the table's range (negatives under "unsigned"/"linear") clamp to its ends.
    """
    matrix = as_matrix(x.shape)
    tile = tile_shape(x.shape, block_size)
    t = tiles(x.astype(jnp.float32).reshape(matrix), tile)
    absmax = jnp.max(jnp.abs(t), axis=(-3, -1))
    y = t / jnp.where(absmax > 0, absmax, 1.0)[..., :, None, :, None]
    codes = untile(_round(y, code, bits, key), *matrix[-2:])
    return BlockQuantized(
        codes=_pack(codes, bits).reshape(*x.shape[:-1], -1),
        absmax=absmax if x.ndim >= 2 else absmax[0],
        shape=tuple(x.shape),
        dtype=jnp.dtype(x.dtype).name,
        bits=bits,
        code=code,
        tile=tile,
    )


def quantize_rank1(
    x: jax.Array, *, bits: int = 4, code: str = "linear", key: jax.Array | None = None
) -> Rank1Quantized:
    """Rank-1 normalised quantization of ``x`` with at least two axes (the last two are the matrix).

    ``r_i = max_j |x_ij|``, ``c_j = max_i |x_ij|``, ``code_ij = argmin_k |table_k - x_ij / min(r_i, c_j)|``.
    Leading axes are batch axes: each matrix has its own maxima.
    """
    if x.ndim < 2:
        raise ValueError(f"rank-1 quantization needs >= 2 axes, got shape {x.shape}; use quantize_blockwise")
    xf = x.astype(jnp.float32)
    row = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    col = jnp.max(jnp.abs(xf), axis=-2, keepdims=True)
    scale = jnp.minimum(row, col)
    codes = _round(xf / jnp.where(scale > 0, scale, 1.0), code, bits, key)
    return Rank1Quantized(
        codes=_pack(codes, bits),
        row=row,
        col=col,
        shape=tuple(x.shape),
        dtype=jnp.dtype(x.dtype).name,
        bits=bits,
        code=code,
    )


def quantize_minmax(x: jax.Array, *, bits: int = 4, block_size: int = 256) -> MinMaxQuantized:
    """Block-wise asymmetric quantization of ``x``: per tile ``lo = min x``, ``hi = max x`` (over the
    tile's own elements, not its padding), ``code = floor((x - lo) / u + 1/2)``, ``u = (hi - lo) / (2^bits - 1)``."""
    matrix = as_matrix(x.shape)
    tile = tile_shape(x.shape, block_size)
    xm = x.astype(jnp.float32).reshape(matrix)
    inside = tiles(jnp.ones(matrix, bool), tile)
    t = tiles(xm, tile)
    lo = jnp.min(jnp.where(inside, t, jnp.inf), axis=(-3, -1))
    hi = jnp.max(jnp.where(inside, t, -jnp.inf), axis=(-3, -1))
    step = ((hi - lo) / (2**bits - 1))[..., :, None, :, None]
    y = jnp.where(step > 0, (t - lo[..., :, None, :, None]) / jnp.where(step > 0, step, 1.0), 0.0)
    codes = untile(jnp.clip(jnp.floor(y + 0.5), 0, 2**bits - 1).astype(jnp.uint8), *matrix[-2:])
    squeeze = (lambda a: a) if x.ndim >= 2 else (lambda a: a[0])
    return MinMaxQuantized(
        codes=_pack(codes, bits).reshape(*x.shape[:-1], -1),
        lo=squeeze(lo),
        hi=squeeze(hi),
        shape=tuple(x.shape),
        dtype=jnp.dtype(x.dtype).name,
        bits=bits,
        tile=tile,
    )


def dequantize(q: Quantized) -> jax.Array:
    """The array ``q`` encodes, in its original shape and dtype."""
    if isinstance(q, MinMaxQuantized):
        return _dequantize_minmax(q)
    table = jnp.asarray(code_table(q.code, q.bits))
    matrix = as_matrix(q.shape)
    codes = _unpack(q.codes, q.bits, q.shape[-1]).reshape(matrix)
    if isinstance(q, Rank1Quantized):
        x = table[codes] * jnp.minimum(q.row, q.col)
    else:
        absmax = q.absmax if len(q.shape) >= 2 else q.absmax[None]
        x = untile(tiles(table[codes], q.tile) * absmax[..., :, None, :, None], *matrix[-2:])
    return x.reshape(q.shape).astype(q.dtype)


def _dequantize_minmax(q: MinMaxQuantized) -> jax.Array:
    matrix = as_matrix(q.shape)
    codes = _unpack(q.codes, q.bits, q.shape[-1]).reshape(matrix).astype(jnp.float32)
    lo, hi = (q.lo, q.hi) if len(q.shape) >= 2 else (q.lo[None], q.hi[None])
    step = ((hi - lo) / (2**q.bits - 1))[..., :, None, :, None]
    x = untile(lo[..., :, None, :, None] + tiles(codes, q.tile) * step, *matrix[-2:])
    return x.reshape(q.shape).astype(q.dtype)
