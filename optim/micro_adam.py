"""MicroAdam: Adam statistics from a window of Top-K sparse gradients, with 4-bit error feedback
(Modoranu et al., "MicroAdam: Accurate Adaptive Optimization with Low Space Overhead and Provable
Convergence", arXiv:2405.15593, Algorithm 1; reference IST-DASLab/ISTA-DASLab-Optimizers
``micro_adam.py`` and its CUDA kernels).

For each parameter, with gradient ``g_t``, step ``t >= 1`` and ``Q`` the 4-bit block-wise min-max
quantiser (`optim.quantization.quantize_minmax`):

    a_t = g_t + Q^-1(e_t)                               gradient plus the error feedback
    I_t = TopK_k(|a_t|) in each block of B elements       (indices within the block)
    V_t = a_t[I_t];  a_t[I_t] = 0
    e_{t+1} = Q(a_t)                                    the residual, 4 bits
    window slot (t - 1) mod m <- (I_t, V_t)
    M_t = sum_j b1^age_j scatter(I_j, V_j),   S_t = sum_j b2^age_j scatter(I_j, V_j^2)
    u_t = c1 M_t / (sqrt(c2 S_t) + eps),  c1 = (1 - b1) / (1 - b1^t),  c2 = (1 - b2) / (1 - b2^t)
    u_t <- u_t + alpha Q^-1(e_{t+1});  e_{t+1} <- Q((1 - alpha) Q^-1(e_{t+1}))     only if alpha > 0
    w_{t+1} = w_t - lr_t (u_t + lambda w_t)

with ``age_j = (t - 1 - j) mod m`` of slot ``j`` (0 for the newest), entries repeated across slots
adding up, and ``k = ceil(density B)``. The update is sparse: non-zero only where the window holds
an index, unless ``alpha > 0`` (the reference's pretraining option) hands that share of the error
feedback to every step. Defaults are the reference's: ``m = 10``, ``density = 0.01``, ``alpha = 0``,
``b1, b2, eps = 0.9, 0.999, 1e-8``; it decays every parameter it is given, here the leaves `optim.labels.decay_mask` picks.

Blocks are tiles of the last two axes (`optim.quantization.tile_shape`), for Top-K (``topk_block``
elements, 32 x 32 by default) and for the quantiser (``quant_block``, 16 x 16), so that a block never
straddles a shard boundary when each shard of those axes holds whole tiles: then the step has no
collective at all under GSPMD (Top-K by a stable sort, as ``lax.top_k`` is replicated; scatters
mapped per block axis); otherwise it is as correct but XLA moves the straddling values. Ragged edge tiles are
zero-padded and Top-K may pick a padding position (a zero, as a real zero would be). The reference
cuts the flattened tensor into runs instead (``topk_block`` from the GPU's shared memory, ~29k
elements on an H100) and stores bf16 gradients and bf16 quantiser ranges; here the error feedback
is computed in fp32 and its ranges stored in fp32, the window's values in bf16 as in the reference.
The reference's ``alpha = -2`` (the quantisation error added to the weights) is not here.

Memory per parameter (`optim.memory.state_bytes` of the state; tests/optim/test_micro_adam.py):
error feedback ``1/2 + 8 / quant_block`` bytes, window ``m k (2 + 2) / topk_block`` bytes (int16
index, bf16 value): ``0.5 + 0.031 + 0.430 = 0.96`` bytes = 7.7 bits at the defaults (AdamW: 8 bytes).
`optim.quantize_state` (``state_bits``) finds no parameter-shaped floating state here to quantize.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, spec
from optim import quantization as qz


class MicroAdamState(NamedTuple):
    """State of `scale_by_micro_adam`."""

    count: jax.Array  # steps taken, int32
    error_codes: optax.Updates  # e_t's 4-bit codes per parameter (`optim.quantization.MinMaxQuantized`)
    error_lo: optax.Updates  # e_t's per-tile minima, fp32
    error_hi: optax.Updates  # e_t's per-tile maxima, fp32
    indices: optax.Updates  # window indices within blocks, int16, (*lead, blocks_R, blocks_C * m * k)
    values: optax.Updates  # window values, bf16, same shape


def block_count(shape: tuple[int, ...], tile: tuple[int, int]) -> tuple[int, int]:
    """Tiles along the last two axes of ``shape`` (a 1-D shape is one row)."""
    rows, cols = (shape[-2] if len(shape) >= 2 else 1), shape[-1]
    return -(-rows // tile[0]), -(-cols // tile[1])


def _blocks(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """``(*lead, R, C)`` (or ``(C,)``) -> ``(*lead, nR, nC, tr tc)``, zero-padded."""
    m = x.reshape(qz.as_matrix(x.shape))
    t = qz.tiles(m, tile)
    t = jnp.moveaxis(t, -3, -2)
    return t.reshape(*t.shape[:-2], tile[0] * tile[1])


def _unblocks(b: jax.Array, tile: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
    matrix = qz.as_matrix(shape)
    t = b.reshape(*b.shape[:-1], *tile)
    return qz.untile(jnp.moveaxis(t, -2, -3), *matrix[-2:]).reshape(shape)


def _window_shape(shape: tuple[int, ...], tile: tuple[int, int], m: int, k: int) -> tuple[int, ...]:
    """The parameter's rank: ``(*lead, nR, nC m k)``; a 1-D parameter ``(nC m k,)``."""
    n_rows, n_cols = block_count(shape, tile)
    return (*shape[:-2], n_rows, n_cols * m * k) if len(shape) >= 2 else (n_cols * m * k,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroAdamDirection:
    """MicroAdam's direction ``u_t`` (module docstring).

    Attributes:
      b1: decay of the first moment over the window.
      b2: decay of the second moment over the window.
      eps: added to ``sqrt(c2 S_t)``.
      window: ``m``, the number of sparse gradients kept.
      density: the fraction ``k / B`` of each Top-K block kept (``k = ceil(density B)``).
      topk_block: elements per Top-K block ``B`` (a power of two <= 32768: indices are int16).
      quant_block: elements per block of the 4-bit error-feedback quantiser (a power of two).
      alpha: the share of the error feedback added to each step (0: sparse steps, the default).
    """

    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.999, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    window: int = spec.param(10, valid="[1, inf)")
    density: float = spec.param(0.01, valid="(0, 1]")
    topk_block: int = spec.param(1024, valid="[2, 32768]")
    quant_block: int = spec.param(256, valid="[2, inf)")
    alpha: float = spec.param(0.0, valid="[0, 1)")

    static_args: ClassVar[tuple[str, ...]] = ("window", "density", "topk_block", "quant_block")

    def direction(self) -> optax.GradientTransformation:
        names = self.static_args
        m = common.static_int("window", self.window, names)
        topk_block = common.static_int("topk_block", self.topk_block, names)
        quant_block = common.static_int("quant_block", self.quant_block, names)
        qz.check_block_size(topk_block, "topk_block")
        qz.check_block_size(quant_block, "quant_block")
        try:
            k = math.ceil(float(self.density) * topk_block)
        except jax.errors.ConcretizationTypeError:
            raise ValueError(f"density sets array shapes; with optax.inject_hyperparams pass static_args={names}") from None
        b1, b2, eps, alpha = self.b1, self.b2, self.eps, self.alpha
        dense = not (isinstance(alpha, int | float) and alpha == 0)  # an injected alpha is an array

        def init_fn(params):
            common.check_floating(params, "micro_adam", "mask it out")

            def window(p, dtype):
                return jnp.zeros(_window_shape(p.shape, qz.tile_shape(p.shape, topk_block), m, k), dtype)

            def zero_error(p):  # what quantize_minmax stores for zeros: codes 0, ranges [0, 0]
                node = jax.eval_shape(lambda: qz.quantize_minmax(jnp.zeros(p.shape, jnp.float32), block_size=quant_block))
                return dataclasses.replace(node, **{f: jnp.zeros(getattr(node, f).shape, getattr(node, f).dtype) for f in ("codes", "lo", "hi")})

            return MicroAdamState(
                jnp.zeros([], jnp.int32),
                *_error_fields(jax.tree.map(zero_error, params), params),
                indices=jax.tree.map(lambda p: window(p, jnp.int16), params),
                values=jax.tree.map(lambda p: window(p, jnp.bfloat16), params),
            )

        def update_fn(updates, state, params=None):
            del params
            count = optax.safe_increment(state.count)
            t = count.astype(jnp.float32)
            slot = (count - 1) % m
            ages = ((count - 1 - jnp.arange(m)) % m).astype(jnp.float32)
            c1 = (1 - b1) / (1 - b1**t)
            c2 = (1 - b2) / (1 - b2**t)
            grads, treedef = jax.tree.flatten(updates)
            errors = [
                qz.MinMaxQuantized(c, lo, hi, g.shape, "float32", 4, qz.tile_shape(g.shape, quant_block))
                for g, c, lo, hi in zip(
                    grads, *(treedef.flatten_up_to(x) for x in (state.error_codes, state.error_lo, state.error_hi)), strict=True
                )
            ]
            out, new_errors, new_indices, new_values = [], [], [], []
            for g, e, idx, val in zip(
                grads, errors, treedef.flatten_up_to(state.indices), treedef.flatten_up_to(state.values), strict=True
            ):
                tile = qz.tile_shape(g.shape, topk_block)
                a = _blocks(g.astype(jnp.float32) + qz.dequantize(e).astype(jnp.float32), tile)
                blocks, size = a.shape[:-1], a.shape[-1]
                top = jnp.argsort(-jnp.abs(a), axis=-1, stable=True)[..., :k]  # lax.top_k replicates under GSPMD
                kept = jnp.take_along_axis(a, top, axis=-1)
                idx = _write(idx, top.astype(jnp.int16), slot, blocks, m, k)
                val = _write(val, kept.astype(jnp.bfloat16), slot, blocks, m, k)
                v = val.reshape(*blocks, m, k).astype(jnp.float32)
                # One scatter per leaf: a[I_t] (to zero it), then both moments' sums over the window.
                zeros = jnp.zeros((*blocks, k), v.dtype)
                zeros_window = jnp.zeros((*blocks, m * k), v.dtype)
                sums = _scatter(
                    jnp.concatenate([top, idx.reshape(*blocks, m * k).astype(top.dtype)], axis=-1),
                    jnp.stack([
                        jnp.concatenate([kept, zeros_window], axis=-1),
                        jnp.concatenate([zeros, (b1 ** ages[:, None] * v).reshape(*blocks, m * k)], axis=-1),
                        jnp.concatenate([zeros, (b2 ** ages[:, None] * v * v).reshape(*blocks, m * k)], axis=-1),
                    ], axis=-1),
                    size,
                )
                residual = _unblocks(a - sums[..., 0], tile, g.shape)
                e = qz.quantize_minmax(residual, bits=4, block_size=quant_block)
                new_indices.append(idx)
                new_values.append(val)
                u = _unblocks(c1 * sums[..., 1] / (jnp.sqrt(c2 * sums[..., 2]) + eps), tile, g.shape)
                if dense:
                    e_full = qz.dequantize(e)
                    u = u + alpha * e_full
                    kept_back = qz.quantize_minmax((1 - alpha) * e_full, bits=4, block_size=quant_block)
                    e = jax.tree.map(lambda new, old: jnp.where(alpha > 0, new, old), kept_back, e)  # exact at 0
                new_errors.append(e)
                out.append(u.astype(g.dtype))
            unflat = treedef.unflatten
            error = _error_fields(unflat(new_errors), updates)
            return unflat(out), MicroAdamState(count, *error, unflat(new_indices), unflat(new_values))

        return optax.GradientTransformation(init_fn, update_fn)


def _error_fields(error: optax.Updates, like: optax.Updates) -> tuple[optax.Updates, ...]:
    """The codes, minima and maxima trees of a tree of `MinMaxQuantized` (plain arrays: containers
    such as `flax.nnx.Optimizer` box each state leaf, which a pytree node in a leaf's place breaks)."""
    nodes = jax.tree.structure(like).flatten_up_to(error)
    return tuple(jax.tree.unflatten(jax.tree.structure(like), [getattr(n, f) for n in nodes]) for f in ("codes", "lo", "hi"))


def _write(window: jax.Array, new: jax.Array, slot: jax.Array, blocks: tuple[int, ...], m: int, k: int) -> jax.Array:
    """``window`` (stored shape) with slot ``slot`` of every block set to ``new`` (``(*blocks, k)``)."""
    w = window.reshape(*blocks, m, k)
    w = jnp.where((jnp.arange(m) == slot)[:, None], new[..., None, :], w)
    return w.reshape(window.shape)


def _scatter(indices: jax.Array, values: jax.Array, size: int) -> jax.Array:
    """Per block, ``out[indices] += values`` into zeros: ``(*blocks, n)``, ``(*blocks, n, c)`` -> ``(*blocks, size, c)``.

    Mapped over each block axis in turn, never over a flattened one, so the blocks keep their sharding.
    """

    def one(i, v):
        return jnp.zeros((size, v.shape[-1]), v.dtype).at[i].add(v)

    for _ in range(indices.ndim - 1):
        one = jax.vmap(one)
    return one(indices, values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MicroAdam(MicroAdamDirection, common.DirectionOptimizer):
    """MicroAdam with decoupled weight decay on weights, not norm scales or biases."""

    learning_rate: optax.ScalarOrSchedule = 3e-3  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.0  # the reference's default


scale_by_micro_adam = spec.function(MicroAdamDirection, "direction", name="scale_by_micro_adam", positional=("b1", "b2"))
micro_adam = spec.function(MicroAdam, name="micro_adam")
