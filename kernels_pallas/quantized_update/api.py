"""`quantized_update`: one fused step of AdamW or Lion on a parameter whose moments are quantized.

The backend follows the platform of the mesh in context, else JAX's default backend
(`kernels_pallas.backends`): ``triton`` on GPUs, ``mosaic_tpu`` on TPUs; on a CPU the
Triton kernel runs in interpret mode only (``interpret=True``; ``backend="mosaic_tpu"`` with it runs
the TPU interpreter).
Under a mesh, pass the parameter's `PartitionSpec` and the kernel runs per shard inside
`jax.shard_map` over the mesh axes not already manual (inside the replica-local train step, the
axes within a replica); the tiles must not straddle shards (`optim.quantization`'s layout rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import backends, varying
from kernels_pallas.backends import platform
from kernels_pallas.quantized_update import base, mosaic_tpu, reference, triton
from kernels_pallas.quantized_update.triton import BlockSizes

BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu}
_DEFAULT_BLOCK_SIZES = {"triton": BlockSizes(), "mosaic_tpu": mosaic_tpu.DEFAULT_BLOCK_SIZES}

__all__ = ["BACKENDS", "BlockSizes", "available", "quantized_update"]


def available(target: str | None = None) -> bool:
    """Whether a compiled kernel exists for platform ``target`` (default: `platform()`)."""
    return backends.compiles(target or platform())


def _rank1_maxima(rule, p3, g3, moments, layouts, scalars, shape, split_axes):
    """New row / column maxima of the rank-1 moments: XLA reduces the fused decode-and-update.

    ``split_axes``: the mesh axes splitting rows and columns (a shard's maxima are partial there).
    """
    if all(m.tile for m in layouts):
        return [None] * len(layouts)
    values = [reference.decode(m, q, shape) for m, q in zip(layouts, moments, strict=True)]
    _, values = rule.step(p3, g3, values, scalars)
    row_axes, col_axes = split_axes
    maxima = []
    for m, x in zip(layouts, values, strict=True):
        if m.tile:
            maxima.append(None)
            continue
        row, col = jnp.max(jnp.abs(x), axis=-1, keepdims=True), jnp.max(jnp.abs(x), axis=-2, keepdims=True)
        maxima.append((jax.lax.pmax(row, col_axes) if col_axes else row, jax.lax.pmax(col, row_axes) if row_axes else col))
    return maxima


def _local_update(rule, layouts, scalars, param, grad, moments, noise, *, block_sizes, backend, interpret, split_axes=((), ())):
    shape = param.shape
    b, rows, cols = shape3 = base.as_3d(shape)
    p3, g3 = param.reshape(shape3), grad.reshape(shape3)
    noise = [u.reshape(shape3) for u in noise] if noise else None
    maxima = _rank1_maxima(rule, p3.astype(jnp.float32), g3.astype(jnp.float32), moments, layouts, scalars, shape, split_axes)
    as3 = []
    for m, q, new in zip(layouts, moments, maxima, strict=True):
        codes = q[0].reshape(b, rows, -1)
        if m.tile:
            as3.append((codes, q[1].reshape(b, -(-rows // m.tile[0]), -(-cols // m.tile[1]))))
        else:
            as3.append((codes, q[1].reshape(b, rows, 1), q[2].reshape(b, 1, cols), *new))
    tiles = [m.tile for m in layouts if m.tile] or [(1, 1)]
    block = block_sizes.block(max(tiles))
    spec = base.Spec(rule, tuple(layouts), shape3, block, int(scalars.shape[0]), noise is not None, not interpret)
    update, new = BACKENDS[backend].fused_update(
        spec, scalars, p3, g3, as3, noise, num_warps=block_sizes.num_warps, interpret=interpret
    )
    out = []
    for m, q, n, mx in zip(layouts, moments, new, maxima, strict=True):
        codes = n[0].reshape(q[0].shape)
        if m.tile:
            out.append((codes, n[1].reshape(q[1].shape)))
        else:
            out.append((codes, mx[0].reshape(q[1].shape), mx[1].reshape(q[2].shape)))
    return update.reshape(shape), out


def quantized_update(
    rule: base.Rule,
    param: jax.Array,
    grad: jax.Array,
    moments: list[reference.QMoment],
    layouts: list[base.Moment],
    scalars: jax.Array,
    noise: list[jax.Array] | None = None,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    backend: str | None = None,
    spec: jax.P | None = None,
) -> tuple[jax.Array, list[reference.QMoment]]:
    """`reference.quantized_update` in one Pallas kernel per parameter; same arguments and results.

    Args:
      block_sizes: rows / columns per program (rounded up to whole tiles); default per backend.
      interpret: run in Pallas interpret mode (any platform; slow, for tests).
      backend: ``"triton"`` or ``"mosaic_tpu"``; default: the platform's (`kernels_pallas.backends`).
      spec: the parameter's `PartitionSpec` under the mesh in context: the kernel runs per shard in
        `jax.shard_map`, codes and block scales split like the parameter, rank-1 maxima all-reduced
        (``pmax``) over the mesh axes of the other matrix axis.
    """
    if param.shape != grad.shape or param.ndim == 0:
        raise ValueError(f"quantized_update: param {param.shape} and grad {grad.shape} must share one non-scalar shape")
    if len({m.bits for m in layouts}) != 1 or len(layouts) != len(rule.moments):
        raise ValueError(f"quantized_update: {type(rule).__name__} takes {len(rule.moments)} moments of one bit width")
    backend = backends.choose("quantized_update", platform(), backend, interpret, tuple(BACKENDS), "use reference.quantized_update")
    local = functools.partial(
        _local_update, rule, layouts, block_sizes=block_sizes or _DEFAULT_BLOCK_SIZES[backend], backend=backend, interpret=interpret
    )
    mesh = jax.sharding.get_abstract_mesh()
    # Inside an enclosing shard_map (the replica-local train step) only the axes left automatic are split here.
    free = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in getattr(mesh, "manual_axes", ()))
    inputs = (scalars, param, grad, moments, noise)
    if interpret:
        varying.check_interpretable("quantized_update", "use optimizer.state_kernel=xla on a CPU", *inputs)
    if spec is None or not free:
        return varying.call_opaque(local, *inputs)
    return varying.vary_like(_sharded(local, spec, free, layouts, *inputs), *inputs)


def _sharded(local, spec, free, layouts, scalars, param, grad, moments, noise):
    """``local`` per shard over mesh axes ``free``: every stored array split like the parameter (`optim.quantization`'s layout)."""
    full = (*spec, *(None,) * (param.ndim - len(spec)))
    lead, (row_axes, col_axes) = full[:-2], (full[-2:] if param.ndim >= 2 else (None, full[-1]))
    moment_specs = [
        (jax.P(*full), jax.P(*full)) if m.tile else (jax.P(*full), jax.P(*lead, row_axes, None), jax.P(*lead, None, col_axes))
        for m in layouts
    ]
    noise = [u.reshape(param.shape) for u in noise or ()]
    noise_specs = [jax.P(*full)] * len(noise)
    names = lambda axes: () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)  # noqa: E731
    per_shard = functools.partial(local, split_axes=(names(row_axes), names(col_axes)))
    return jax.shard_map(
        per_shard,
        in_specs=(jax.P(), jax.P(*full), jax.P(*full), moment_specs, noise_specs),
        out_specs=(jax.P(*full), moment_specs),
        axis_names=frozenset(free),
        check_vma=False,
    )(scalars, param, grad, moments, noise)
