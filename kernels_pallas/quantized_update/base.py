r"""What the fused quantized-update kernels and their reference share: layouts, code search, the rules.

A quantized moment (`optim.quantization`'s layout) is ``uint8`` codes plus fp32 scales:

- block-wise: ``absmax`` per ``(tr, tc)`` tile, ``x = table[code] * absmax``;
- rank-1: row maxima ``r`` and column maxima ``c``, ``x_ij = table[code_ij] * min(r_i, c_j)``;

4-bit codes are packed two per byte along the last axis (column ``2k`` in the low nibble). Arrays are
viewed as ``(B, R, C)`` (leading axes flattened, a 1-D array as ``(1, 1, C)``), which is free.

Rounding to the nearest code is ``#{k : y > mid_k}``, the number of midpoints between adjacent sorted
table entries below ``y`` (ties go to the lower entry), found by a branch-free binary search over
the midpoints padded with ``+inf`` to ``2^bits`` entries: ``i <- i + s [y > mid_{i + s - 1}]`` for
``s = 2^(bits-1), ..., 1``. This is exactly `optim.quantization`'s guess-and-correct rounding.
Stochastic rounding picks the upper of the two entries around ``y`` when ``u < (y - lo) / (hi - lo)``
for a uniform ``u`` drawn with `optim.quantize_state`'s key stream.

The rules (one elementwise step, shared verbatim by the kernels and the reference, so the fp32
operations are the same ones ``optax`` performs):

- AdamW (Loshchilov & Hutter, arXiv:1711.05101; ``optax.adamw``), with ``t`` the new step count::

      m <- (1 - b1) g + b1 m,   v <- (1 - b2) g^2 + b2 v
      u  = -lr ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd p )

- Lion (Chen et al., arXiv:2302.06675, Alg. 2; `optim.lion`)::

      u = -lr ( sign(b1 m + (1 - b1) g) + wd p ),   m <- b2 m + (1 - b2) g
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Moment:
    """Static layout of one quantized moment.

    Attributes:
      table: the sorted code values (16 or 256 of them).
      tile: ``(tr, tc)`` of a block-wise moment; None for rank-1 normalisation.
    """

    table: tuple[float, ...]
    tile: tuple[int, int] | None

    @property
    def bits(self) -> int:
        return len(self.table).bit_length() - 1

    def values(self) -> np.ndarray:
        return np.asarray(self.table, np.float32)

    def search_points(self) -> np.ndarray:
        """Midpoints between adjacent entries, then ``+inf``: ``2^bits`` fp32 values."""
        t = self.values()
        return np.append((t[1:] + t[:-1]) / 2, np.float32(np.inf)).astype(np.float32)


Lookup = Callable[[jax.Array], jax.Array]  # int32 indices -> table values (a gather, in-kernel or XLA)


def nearest_code(y: jax.Array, points: Lookup, bits: int) -> jax.Array:
    """``#{k : y > mid_k}`` by a branch-free binary search; int32."""
    index = jnp.zeros(y.shape, jnp.int32)
    step = 1 << (bits - 1)
    while step:
        index = index + jnp.where(y > points(index + (step - 1)), step, 0)
        step >>= 1
    return index


def stochastic_code(y: jax.Array, nearest: jax.Array, values: Lookup, size: int, u: jax.Array) -> jax.Array:
    """The entry below or above ``y``, the upper one with probability ``(y - lo) / (hi - lo)``."""
    lo = jnp.clip(nearest - (values(nearest) > y).astype(jnp.int32), 0, size - 2)
    t_lo, t_hi = values(lo), values(lo + 1)
    p = jnp.clip((y - t_lo) / (t_hi - t_lo), 0.0, 1.0)
    return lo + (u < p).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW's moment and update rule (``optax.adamw``, ``eps_root = 0``); ``weight_decay = 0`` adds no term."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    moments = ("mu", "nu")

    def scalars(self, count: jax.Array, learning_rate: jax.Array) -> jax.Array:
        """``(-lr, 1 - b1^t, 1 - b2^t)`` for the new count ``t``, fp32, as optax computes them."""
        t = count.astype(jnp.int32)
        return jnp.stack([-jnp.asarray(learning_rate, jnp.float32), 1 - self.b1**t, 1 - self.b2**t]).astype(jnp.float32)

    def step(self, p: jax.Array, g: jax.Array, moments: list[jax.Array], s: Any) -> tuple[jax.Array, list[jax.Array]]:
        mu, nu = moments
        mu = (1 - self.b1) * g + self.b1 * mu
        nu = (1 - self.b2) * (g**2) + self.b2 * nu
        u = (mu / s[1]) / (jnp.sqrt(nu / s[2]) + self.eps)
        if self.weight_decay:
            u = u + self.weight_decay * p
        return s[0] * u, [mu, nu]


@dataclasses.dataclass(frozen=True)
class Lion:
    """Lion's moment and update rule (`optim.lion`)."""

    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.0

    moments = ("mu",)

    def scalars(self, count: jax.Array, learning_rate: jax.Array) -> jax.Array:
        del count
        return jnp.stack([-jnp.asarray(learning_rate, jnp.float32)]).astype(jnp.float32)

    def step(self, p: jax.Array, g: jax.Array, moments: list[jax.Array], s: Any) -> tuple[jax.Array, list[jax.Array]]:
        (mu,) = moments
        u = jnp.sign(self.b1 * mu + (1 - self.b1) * g)
        if self.weight_decay:
            u = u + self.weight_decay * p
        return s[0] * u, [self.b2 * mu + (1 - self.b2) * g]


Rule = AdamW | Lion


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of one kernel call (any backend)."""

    rule: Rule
    layouts: tuple[Moment, ...]
    shape3: tuple[int, int, int]
    block: tuple[int, int]
    n_scalars: int
    stochastic: bool
    masked: bool  # Triton: masked loads and stores (compiled); its interpreter pads blocks and takes no strided masks

    @property
    def parts(self) -> int:
        """Column phases a block is split into: 2 for 4-bit (one per nibble), else 1."""
        return 2 if self.layouts[0].bits == 4 else 1


def as_3d(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(B, R, C)`` view of an array of ``shape`` (leading axes flattened; 1-D as one row)."""
    if len(shape) == 1:
        return 1, 1, shape[0]
    return int(np.prod(shape[:-2], dtype=np.int64)), shape[-2], shape[-1]


@dataclasses.dataclass(frozen=True)
class Operands:
    """`pl.pallas_call`'s grid, arguments, specs, output shapes and aliases, the same for every backend.

    Arguments: scalars, the code tables (values, search points per moment), param, grad, then per moment
    its codes and absmax (block-wise) or codes, row, column, new row, new column maxima (rank-1), then the
    uniforms of stochastic rounding. Outputs: the update, then per moment its codes (and absmax), each
    written in place of its input.
    """

    grid: tuple[int, int, int]
    args: list[jax.Array]
    in_specs: list[Any]
    out_specs: list[Any]
    out_shape: list[jax.ShapeDtypeStruct]
    aliases: dict[int, int]


def operands(
    spec: Spec,
    scalars: jax.Array,
    param: jax.Array,
    grad: jax.Array,
    moments: list[tuple[jax.Array, ...]],
    noise: list[jax.Array] | None,
    small: Callable[[jax.Array], Any],
) -> Operands:
    """The kernel call's `Operands`; ``small(x)`` is the spec of the scalars and the code tables (backend memory)."""
    b, rows, cols = spec.shape3
    bm, bn = spec.block
    matrix = pl.BlockSpec((None, bm, bn), lambda z, i, j: (z, i, j))
    codes_spec = pl.BlockSpec((None, bm, bn // spec.parts), lambda z, i, j: (z, i, j))
    row_spec = pl.BlockSpec((None, bm, 1), lambda z, i, j: (z, i, 0))
    col_spec = pl.BlockSpec((None, 1, bn), lambda z, i, j: (z, 0, j))
    tables = [jnp.asarray(t) for m in spec.layouts for t in (m.values(), m.search_points())]
    args = [scalars, *tables, param, grad]
    in_specs = [small(scalars), *map(small, tables), matrix, matrix]
    out_shape, out_specs, aliases = [jax.ShapeDtypeStruct(spec.shape3, grad.dtype)], [matrix], {}

    def written_in_place(x, block_spec, dtype):
        aliases[len(args)] = len(out_shape)
        args.append(x)
        in_specs.append(block_spec)
        out_shape.append(jax.ShapeDtypeStruct(x.shape, dtype))
        out_specs.append(block_spec)

    for m, q in zip(spec.layouts, moments, strict=True):
        written_in_place(q[0], codes_spec, q[0].dtype)
        if m.tile:
            written_in_place(q[1], pl.BlockSpec((None, bm // m.tile[0], bn // m.tile[1]), lambda z, i, j: (z, i, j)), jnp.float32)
        else:
            args.extend(q[1:])
            in_specs.extend([row_spec, col_spec, row_spec, col_spec])
    if spec.stochastic:
        args.extend(noise)
        in_specs.extend([matrix] * len(noise))
    return Operands((b, pl.cdiv(rows, bm), pl.cdiv(cols, bn)), args, in_specs, out_specs, out_shape, aliases)


class KernelRefs(NamedTuple):
    """A kernel program's refs, named: `operands`' arguments, then its outputs, in the same order."""

    scalars: Any
    tables: list[Any]  # per moment: its values, then its search points
    param: Any
    grad: Any
    moments: list[list[Any]]  # per moment: codes, absmax (block-wise) or codes, row, col, new row, new col
    noise: list[Any | None]  # per moment: the uniforms of stochastic rounding, or None
    update: Any
    moments_out: list[Any]  # per moment: codes, then (block-wise) absmax


def kernel_refs(spec: Spec, refs: tuple[Any, ...]) -> KernelRefs:
    """Name the refs a `pl.pallas_call` over `operands` hands its kernel."""
    n = len(spec.layouts)
    scalars, *refs = refs
    tables, (param, grad, *refs) = refs[: 2 * n], refs[2 * n :]
    moments = []
    for m in spec.layouts:
        k = 2 if m.tile else 5
        moments.append(refs[:k])
        refs = refs[k:]
    noise, refs = (refs[:n], refs[n:]) if spec.stochastic else ([None] * n, refs)
    update, *moments_out = refs
    return KernelRefs(scalars, tables, param, grad, moments, noise, update, moments_out)


def split_outputs(spec: Spec, outs: list[jax.Array]) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
    """The update and, per moment, its new codes and (block-wise) absmax, from the kernel's outputs."""
    update, rest = outs[0], iter(outs[1:])
    return update, [(next(rest), next(rest)) if m.tile else (next(rest),) for m in spec.layouts]
