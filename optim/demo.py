r"""DeMo: decoupled momentum, of which replicas share only the fast-moving DCT components (Peng,
Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870, Algorithm 1; defaults
and the chunked DCT follow the reference implementation bloc97/DeMo).

Every replica ``w`` keeps its own momentum ``delta_w`` of each parameter, fed by its *local* gradient:

    delta_w = beta delta_w + lr_t g_w                       # beta = 0.999 (compression_decay)
    C_w     = DCT(delta_w)                                  # orthonormal DCT-II over chunks
    S_w     = top-k of C_w per chunk, by |C|                # k = 32 of chunk x chunk coefficients
    delta_w = delta_w - IDCT(S_w)                           # error feedback: keep what was not sent
    A       = for each coefficient, the mean of S_w over the replicas that picked it (0 if none)
    theta   = theta (1 - lr_t lambda) - lr_t sign(IDCT(A))  # decoupled weight decay, signSGD

Chunks: each of the tensor's (last two, or last one for vectors) dims is cut into chunks of the largest
divisor of its length that is <= ``chunk`` (default 64); a matrix chunk is ``(c1, c2)`` and has its own
2-D DCT and top-k. Leading axes (scan-stacked layers) are batch axes. Only the ``(index, value)``
pairs cross the network (one all-gather each), optionally as int16 indices and bfloat16 values (the
error feedback then keeps the bfloat16 rounding too).

Aggregation is deterministic and the same on every replica: the reference's ``scatter_reduce`` over
all gathered pairs is order-dependent on GPUs and lets replicas drift. Here each replica's pairs
(whose indices are distinct) are scattered into a dense array one replica at a time, in replica order,
and sums and pick counts are divided at the end.

Sharding: within a replica a chunk must not straddle shards (a chunked reshape across shard
boundaries would move data); `check_chunk_layout` verifies that from the parameters' shardings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import einops
import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import common, labels, shapes, spec
from sharding import partition

_HI = jax.lax.Precision.HIGHEST


class ScaleByDeMoState(NamedTuple):
    """State of `scale_by_demo` (local to each replica)."""

    count: jax.Array  # steps taken, for the learning-rate schedule
    delta: optax.Updates  # the momentum residual delta_w (fp32, shaped like the parameters)


def chunk_size(length: int, chunk: int) -> int:
    """The largest divisor of ``length`` that is at most ``chunk``."""
    return max(d for d in range(1, min(length, chunk) + 1) if length % d == 0)


def dct_axes(path: Sequence[Any], shape: tuple[int, ...]) -> int:
    """How many trailing axes of a leaf the DCT runs over: 2 for matrices, 1 for vectors and scalars."""
    return 1 if labels.is_vector(path, shape) else 2


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II: ``D[k, i] = s_k cos(pi (2 i + 1) k / (2 n))``, ``s_0 = sqrt(1/n)``, else ``sqrt(2/n)``."""
    k, i = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    d = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def _chunks(shape: tuple[int, ...], axes: int, chunk: int) -> tuple[int, ...]:
    return tuple(chunk_size(n, chunk) for n in shape[len(shape) - axes :])


def encode(x: jax.Array, chunks: tuple[int, ...]) -> jax.Array:
    """Chunked DCT of the trailing ``len(chunks)`` axes: ``(..., n1[, n2])`` -> ``(..., y[, x], c1 [* c2])``."""
    d = [jnp.asarray(dct_matrix(c)) for c in chunks]
    if len(chunks) == 1:
        blocks = einops.rearrange(x, "... (y h) -> ... y h", h=chunks[0])
        return jnp.einsum("...yh,ah->...ya", blocks, d[0], precision=_HI)
    blocks = einops.rearrange(x, "... (y h) (x w) -> ... y x h w", h=chunks[0], w=chunks[1])
    coeffs = jnp.einsum("...yxhw,ah,bw->...yxab", blocks, d[0], d[1], precision=_HI)
    return einops.rearrange(coeffs, "... a b -> ... (a b)")


def decode(coeffs: jax.Array, chunks: tuple[int, ...]) -> jax.Array:
    """Inverse of `encode` (the transposed orthonormal DCT)."""
    d = [jnp.asarray(dct_matrix(c)) for c in chunks]
    if len(chunks) == 1:
        return einops.rearrange(jnp.einsum("...ya,ah->...yh", coeffs, d[0], precision=_HI), "... y h -> ... (y h)")
    coeffs = einops.rearrange(coeffs, "... (a b) -> ... a b", a=chunks[0])
    blocks = jnp.einsum("...yxab,ah,bw->...yxhw", coeffs, d[0], d[1], precision=_HI)
    return einops.rearrange(blocks, "... y x h w -> ... (y h) (x w)")


def _scatter(shape: tuple[int, ...], idx: jax.Array, values: jax.Array) -> jax.Array:
    """A dense ``shape`` array holding ``values`` at ``idx`` along the last axis (indices distinct per row)."""
    return jnp.put_along_axis(jnp.zeros(shape, values.dtype), idx.astype(jnp.int32), values, axis=-1, inplace=False)


def mean_over_pickers(shape: tuple[int, ...], idx: jax.Array, values: jax.Array) -> jax.Array:
    """Aggregate of gathered pairs ``idx``, ``values`` ``(R, ..., k)``: per coefficient, the mean of the
    values of the replicas that picked it (0 where none did); summed in replica order."""

    def dense(i, v):
        return _scatter(shape, i, v.astype(jnp.float32)), _scatter(shape, i, jnp.ones(v.shape, jnp.float32))

    def add(carry, pair):
        return jax.tree.map(jnp.add, carry, dense(*pair)), None

    (total, count), _ = jax.lax.scan(add, dense(idx[0], values[0]), (idx[1:], values[1:]))
    return total / jnp.maximum(count, 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeMoDirection:
    """The DeMo direction ``sign(IDCT(A))`` (no weight decay, no step size; see the module docstring).

    ``learning_rate`` scales the gradient entering the momentum (``delta = beta delta + lr_t g``), as
    in the reference; the full optimizer scales the step by it too.

    Attributes:
      learning_rate: a float or schedule.
      beta: momentum decay (the reference's ``compression_decay``).
      topk: coefficients sent per chunk.
      chunk: the largest DCT chunk side; each dim uses its largest divisor <= chunk.
      value_dtype: float32 or bfloat16 values on the wire.
      index_dtype: int32 or int16 indices on the wire.
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica).
    """

    learning_rate: optax.ScalarOrSchedule
    beta: float = spec.param(0.999, valid="[0, 1)")
    topk: int = spec.param(32, valid="[1, inf)")
    chunk: int = spec.param(64, valid="[1, inf)")
    value_dtype: str = "float32"
    index_dtype: str = "int32"
    axis_name: str | None = spec.code_only()

    replica_local: ClassVar[bool] = True

    def direction(self) -> optax.GradientTransformation:
        beta, axis_name, value_dtype, index_dtype = self.beta, self.axis_name, self.value_dtype, self.index_dtype
        topk, chunk = (common.static_int(n, getattr(self, n), DeMo.static_args) for n in ("topk", "chunk"))
        if isinstance(beta, float | int) and not 0 <= beta < 1 or topk < 1 or chunk < 1:
            raise ValueError(f"demo needs 0 <= beta < 1 (got {beta}), topk >= 1 (got {topk}) and chunk >= 1 (got {chunk})")
        common.check_choice("demo value_dtype", value_dtype, ("float32", "bfloat16"))
        common.check_choice("demo index_dtype", index_dtype, ("int32", "int16"))
        if index_dtype == "int16" and chunk * chunk > np.iinfo(np.int16).max:
            raise ValueError(f"demo index_dtype='int16' holds indices < 32768 but a {chunk}x{chunk} chunk has {chunk * chunk}; use int32")
        lr = self.learning_rate if callable(self.learning_rate) else (lambda _, lr=self.learning_rate: lr)

        def init_fn(params):
            common.check_floating(params, "demo", "mask it out")
            return ScaleByDeMoState(jnp.zeros((), jnp.int32), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

        def leaf_direction(path, g, delta, step_lr):
            shape = g.shape or (1,)
            chunks = _chunks(shape, dct_axes(path, shape), chunk)
            delta = beta * delta.reshape(shape) + step_lr * g.reshape(shape).astype(jnp.float32)
            coeffs = encode(delta, chunks)
            _, idx = jax.lax.top_k(jnp.abs(coeffs), min(topk, coeffs.shape[-1]))
            values = jnp.take_along_axis(coeffs, idx, axis=-1).astype(value_dtype)
            idx = idx.astype(index_dtype)
            delta = delta - decode(_scatter(coeffs.shape, idx, values.astype(jnp.float32)), chunks)
            if axis_name is not None:
                idx, values = jax.lax.all_gather(idx, axis_name), jax.lax.all_gather(values, axis_name)
            else:
                idx, values = idx[None], values[None]
            update = jnp.sign(decode(mean_over_pickers(coeffs.shape, idx, values), chunks))
            return update.reshape(g.shape).astype(g.dtype), delta.reshape(g.shape)

        def update_fn(updates, state, params=None):
            del params
            shapes.check_like(updates, state.delta, "demo")
            step_lr = lr(state.count)
            leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
            deltas = treedef.flatten_up_to(state.delta)
            out = [leaf_direction(path, g, d, step_lr) for (path, g), d in zip(leaves, deltas, strict=True)]
            if not out:
                return updates, ScaleByDeMoState(state.count + 1, state.delta)
            directions, deltas = (treedef.unflatten(column) for column in zip(*out, strict=True))
            return directions, ScaleByDeMoState(state.count + 1, deltas)

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeMo(DeMoDirection, common.DirectionOptimizer):
    """DeMo: ``theta <- theta - lr_t (sign(IDCT(A)) + weight_decay theta)``; decay on weights (`optim.labels.decay_mask`).

    Defaults are the reference's (``compression_decay=0.999``, ``compression_topk=32``,
    ``compression_chunk=64``, ``weight_decay=0``). Like other sign methods it wants a learning rate
    several times smaller than AdamW's.
    """

    learning_rate: optax.ScalarOrSchedule = 1e-3
    weight_decay: float = 0.0

    static_args = ("topk", "chunk", "value_dtype", "index_dtype")

    def check_layout(self, params: Any, shardings: Any, replica_axis: str | None = None) -> None:
        check_chunk_layout(params, shardings, int(self.chunk), replica_axis=replica_axis)


scale_by_demo = spec.function(DeMoDirection, "direction", name="scale_by_demo")
demo = spec.function(DeMo, name="demo")


def check_chunk_layout(params: Any, shardings: Any, chunk: int = 64, *, replica_axis: str | None = None) -> None:
    """Raises a ValueError naming the fix when a DCT chunk of a parameter would straddle two shards.

    ``shardings``: a `jax.NamedSharding` per parameter (the model's, without a replica axis).
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings), strict=True):
        shape = tuple(leaf.shape) or (1,)
        axes = dct_axes(path, shape)
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        for dim in range(len(shape) - axes, len(shape)):
            names = partition.mesh_axes_of(spec[dim])
            ways = int(np.prod([sharding.mesh.shape[a] for a in names if a != replica_axis]))
            c = chunk_size(shape[dim], chunk)
            if ways > 1 and (shape[dim] // ways) % c:
                raise ValueError(
                    f"demo: {jax.tree_util.keystr(path)} dimension {dim} ({shape[dim]}) is split {ways} ways over {names}, and "
                    f"its DCT chunks of {c} would straddle shards of {shape[dim] // ways}; set optimizer.demo.chunk to a "
                    f"divisor of {shape[dim] // ways} or shard that dimension fewer ways"
                )
