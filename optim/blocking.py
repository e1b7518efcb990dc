"""Reshaping, block partitioning and block stacking for Kronecker-factored optimizers (Shampoo, SOAP).

A parameter of shape ``(*batch, *dims)`` is seen as ``prod(batch)`` independent tensors (the repo's
layout convention: leading axes are scan-stacked layers or expert stacks, see `optim.labels`). Its
tensor dims are optionally merged (``merge_small_dims``: adjacent dims are multiplied together while
the product stays <= a limit, size-1 dims dropped, as in distributed Shampoo, arXiv:2002.09018, and
SOAP's ``merge_dims``). Each dim at most ``max_precond_dim`` long is *preconditioned*: it is cut
into blocks of ``block_size`` (the last block of a dim may be shorter) and every block keeps one
``(b, b)`` factor matrix per preconditioned dim. Longer dims are kept whole and get no factor.

Equal-shape blocks of one parameter form a *region*: a regular grid that one reshape turns into a
``(M, *block_shape)`` array, so no Python loop runs over blocks (a 2-D tensor has at most four
regions: full x full, full x ragged, ragged x full, ragged x ragged).

Factor matrices of all parameters are *stacked*: every ``(b, b)`` matrix of one group (same ``b``,
and whatever else the optimizer keys on, e.g. Shampoo's root exponent) lives in one
``(n_blocks, b, b)`` array, and no device holds all statistics (the distributed Shampoo designs of
arXiv:2002.09018 and arXiv:2309.06497). Shapes and placement are kept apart:

- *Shape*: a stack holds exactly its ``n_blocks`` real blocks, so the optimizer state depends on
  the parameters and hyperparameters only, never on the mesh. A checkpoint restores onto any mesh
  (only shardings change), and ``jax.eval_shape(tx.init, ...)`` is the same inside and outside
  ``jax.set_mesh``.
- *Storage*: `stack_spec` puts each mesh axis on the first of (block axis, rows, columns) that it
  still splits evenly, so a stack is spread over all devices whenever its block count or its block
  side divides by the device count (block sides are usually multiples of 128).
- *Computation*: batched eigendecompositions, QR and Newton iterations need whole matrices on a
  device. `spread_blocks` pads a stack with identity blocks to a multiple of the device count (at
  most ``D - 1`` extra blocks) for the duration of that computation only, shards it along the block
  axis over all mesh axes, and cuts the result back to ``n_blocks``.

Padding the *stored* stack to a multiple of the device count (this module's earlier layout) made
the state's shape mesh-dependent, so a checkpoint saved on 8 devices did not restore on 1; a fixed
mesh-independent multiple wastes memory on small meshes and still fails to divide on large ones;
re-padding on restore would make every reader of a checkpoint know about the padding.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sharding import partition

HIGHEST = jax.lax.Precision.HIGHEST
# Precision of the statistics and preconditioning matmuls (`matmul_precision`).
MATMUL_PRECISIONS = ("auto", "highest", "high")


def matmul_precision(name: str) -> jax.lax.Precision:
    """``"highest"``: full fp32 products; ``"high"``: bf16x3 on TPU, TF32 on GPU (about 3x and 8x
    faster there, relative error ~1e-6 and ~1e-3); ``"auto"``: ``"highest"`` on CPU, where it costs
    nothing, else ``"high"``. Eigendecompositions, QR and matrix roots always run in full fp32.
    """
    if name not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {name!r}")
    if name == "auto":
        name = "highest" if jax.default_backend() == "cpu" else "high"
    return HIGHEST if name == "highest" else jax.lax.Precision.HIGH


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Merges adjacent dims while their product stays <= ``max_dim``; drops size-1 dims.

    ``(1, 2, 512, 1, 2048, 3, 4)`` with ``max_dim=1024`` -> ``(1024, 2048, 12)``.
    """
    merged: list[int] = []
    for d in shape:
        if d == 1:
            continue
        if merged and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(merged)


@dataclasses.dataclass(frozen=True)
class Segment:
    """``count`` consecutive blocks of length ``size`` along one dim, starting at ``start``."""

    start: int
    count: int
    size: int


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one parameter is reshaped and cut into blocks (static: depends on the shape only)."""

    shape: tuple[int, ...]  # the parameter's shape
    batch: int  # number of independent tensors (product of the batch axes)
    dims: tuple[int, ...]  # tensor dims after merging
    preconditioned: tuple[bool, ...]  # per dim: does it get factor matrices
    segments: tuple[tuple[Segment, ...], ...]  # per dim: its runs of equal blocks

    @property
    def rank(self) -> int:
        """Number of preconditioned dims (Shampoo's k)."""
        return sum(self.preconditioned)

    @property
    def regions(self) -> tuple[tuple[Segment, ...], ...]:
        """Every combination of one segment per dim, last dim fastest."""
        return tuple(itertools.product(*self.segments))

    def region_size(self, region: Sequence[Segment]) -> int:
        """Number of blocks in ``region`` (over all batch entries)."""
        return self.batch * math.prod(s.count for s in region)

    def to_blocks(self, x: jax.Array) -> list[jax.Array]:
        """One ``(M, *block_shape)`` array per region."""
        x = x.reshape(self.batch, *self.dims)
        out = []
        for region in self.regions:
            k = len(region)
            r = x[(slice(None),) + tuple(slice(s.start, s.start + s.count * s.size) for s in region)]
            r = r.reshape(self.batch, *(v for s in region for v in (s.count, s.size)))
            r = r.transpose((0,) + tuple(1 + 2 * i for i in range(k)) + tuple(2 + 2 * i for i in range(k)))
            out.append(r.reshape(-1, *(s.size for s in region)))
        return out

    def from_blocks(self, blocks: Sequence[jax.Array]) -> jax.Array:
        """Inverse of `to_blocks`."""
        pieces = []
        for region, r in zip(self.regions, blocks, strict=True):
            k = len(region)
            r = r.reshape(self.batch, *(s.count for s in region), *(s.size for s in region))
            r = r.transpose((0,) + tuple(a for i in range(k) for a in (1 + i, 1 + k + i)))
            pieces.append(r.reshape(self.batch, *(s.count * s.size for s in region)))
        for axis in reversed(range(len(self.dims))):
            n = len(self.segments[axis])
            pieces = [jnp.concatenate(pieces[i : i + n], axis=1 + axis) for i in range(0, len(pieces), n)]
        return pieces[0].reshape(self.shape)


def tensor_layout(
    shape: Sequence[int],
    *,
    block_size: int,
    max_precond_dim: int,
    merge_dims: bool,
    batch_leading_axes: bool,
) -> TensorLayout:
    """The layout of a parameter of ``shape``.

    Args:
      shape: the parameter's shape.
      block_size: longest block side along a preconditioned dim.
      max_precond_dim: dims longer than this (after merging) get no factor matrix.
      merge_dims: merge adjacent small dims (`merge_small_dims`, limit ``block_size``).
      batch_leading_axes: axes before the last two are batch axes (independent tensors); otherwise
        every axis is a tensor dim.
    """
    shape = tuple(int(d) for d in shape)
    n_batch = max(len(shape) - 2, 0) if batch_leading_axes else 0
    dims = shape[n_batch:]
    dims = merge_small_dims(dims, block_size) if merge_dims else tuple(d for d in dims if d > 1)
    preconditioned = tuple(1 < d <= max_precond_dim for d in dims)
    segments = []
    for d, pre in zip(dims, preconditioned, strict=True):
        if not pre:
            segments.append((Segment(0, 1, d),))
            continue
        full, rem = divmod(d, block_size)
        segs = [Segment(0, full, block_size)] if full else []
        if rem:
            segs.append(Segment(full * block_size, 1, rem))
        segments.append(tuple(segs))
    return TensorLayout(shape, math.prod(shape[:n_batch]), dims, preconditioned, tuple(segments))


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where the factor matrices of one (region, dim) live: rows ``start:start+count`` of ``group``."""

    group: str
    start: int
    count: int


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """Where every factor matrix of a parameter tree lives in the stacked ``(n, b, b)`` arrays."""

    tensors: tuple[TensorLayout | None, ...]  # per leaf; None: no factor matrices
    slots: tuple[tuple[tuple[Slot | None, ...], ...], ...]  # per leaf, region, dim
    groups: tuple[tuple[str, int, int], ...]  # (key, block side b, number of real blocks)


def stack_layout(tensors: Sequence[TensorLayout | None], group_key: Callable[[int, TensorLayout], str]) -> StackLayout:
    """Assigns every factor matrix a row of its group's stack; ``group_key(b, layout)`` names groups."""
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    slots = []
    for t in tensors:
        leaf_slots = []
        for region in t.regions if t is not None else ():
            region_slots = []
            for seg, pre in zip(region, t.preconditioned, strict=True):
                if not pre:
                    region_slots.append(None)
                    continue
                key = group_key(seg.size, t)
                if sizes.setdefault(key, seg.size) != seg.size:
                    raise ValueError(f"group {key!r} mixes block sizes {sizes[key]} and {seg.size}")
                n = t.region_size(region)
                region_slots.append(Slot(key, counts.get(key, 0), n))
                counts[key] = counts.get(key, 0) + n
            leaf_slots.append(tuple(region_slots))
        slots.append(tuple(leaf_slots))
    groups = tuple((k, sizes[k], counts[k]) for k in sorted(counts))
    return StackLayout(tuple(tensors), tuple(slots), groups)


class BlockStacks(dict):
    """``{group key: (n_blocks, b, b) array}``, stored in the layout of `stack_spec` (a pytree node).

    A distinct type so that `annotate_block_shardings` finds these arrays inside any optax state.
    """


jax.tree_util.register_pytree_with_keys(
    BlockStacks,
    lambda d: (tuple((jax.tree_util.DictKey(k), d[k]) for k in sorted(d)), tuple(sorted(d))),
    lambda keys, values: BlockStacks(zip(keys, values, strict=True)),
    flatten_func=lambda d: (tuple(d[k] for k in sorted(d)), tuple(sorted(d))),
)


def mesh_axes() -> tuple[tuple[str, ...], int]:
    """The ambient mesh's axes that GSPMD partitions and their device count (``(), 1`` without a mesh).

    Inside a `jax.shard_map` (a replica-local train step) the manual axes are left out.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), 1
    axes = partition.auto_axes(mesh)
    return axes, math.prod(mesh.shape[a] for a in axes)


def stack_spec(shape: Sequence[int], mesh_shape: Mapping[str, int]) -> jax.P:
    """Where a ``(n, b, b)`` stack is stored: each mesh axis on the first dim it still splits evenly.

    Dims are tried in the order block axis, rows, columns, so with ``n`` divisible by the device
    count the stack is split by whole blocks; an axis that divides none of them replicates.
    """
    assigned: list[list[str]] = [[] for _ in shape]
    for name, size in mesh_shape.items():
        for dim, axes in zip(shape, assigned, strict=True):
            if dim % (size * math.prod(mesh_shape[a] for a in axes)) == 0:
                axes.append(name)
                break
    return jax.P(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in assigned))


def constrain_blocks(x: jax.Array) -> jax.Array:
    """Pins a stack ``x`` to its storage layout (`stack_spec`) on the ambient mesh; no-op without one."""
    axes, _ = mesh_axes()
    if not axes:
        return x
    mesh_shape = jax.sharding.get_abstract_mesh().shape
    return jax.lax.with_sharding_constraint(x, stack_spec(x.shape, {a: mesh_shape[a] for a in axes}))


def block_sharding(mesh: jax.sharding.Mesh, shape: Sequence[int], replica_axis: str | None = None) -> jax.NamedSharding:
    """The sharding of a ``(n_blocks, b, b)`` stack stored on ``mesh`` (`stack_spec`), never over ``replica_axis``."""
    return jax.NamedSharding(mesh, stack_spec(shape, {a: n for a, n in mesh.shape.items() if a != replica_axis}))


def spread_blocks(fn: Callable[..., Any], *stacks: jax.Array) -> Any:
    """``fn(*stacks)`` with whole blocks spread evenly over every device of the ambient mesh.

    The ``(n, b, b)`` inputs (same ``n``) are padded with identity blocks to a multiple of the device
    count and sharded along the block axis over all mesh axes, so each device runs ``fn`` on its
    ``n_padded / D`` matrices. Every output is cut back to its first ``n`` rows.
    """
    axes, size = mesh_axes()
    n = stacks[0].shape[0]
    extra = -n % size
    if extra:
        stacks = tuple(jnp.concatenate([x, identity_fill(extra, x.shape[-1]).astype(x.dtype)]) for x in stacks)
    if axes:
        stacks = tuple(jax.lax.with_sharding_constraint(x, jax.P(axes)) for x in stacks)
    return jax.tree.map(lambda y: y[:n], fn(*stacks))


def annotate_block_shardings(abstract_state: Any, mesh: jax.sharding.Mesh, replica_axis: str | None = None) -> Any:
    """Gives every array inside a `BlockStacks` of ``abstract_state`` its `block_sharding` on ``mesh``.

    With ``replica_axis`` (a replica-local run, where each replica holds its own stacks) the stacks
    are spread over the other axes only, as `constrain_blocks` places them inside the replica.

    Other leaves are returned unchanged. Feed the result to `sharding.partition.state_shardings`
    (which keeps a leaf's own ``.sharding``) to get ``out_shardings`` for ``jit(tx.init)``::

        abstract = annotate_block_shardings(jax.eval_shape(tx.init, params), mesh)
        shardings = partition.state_shardings(abstract, params, param_shardings, mesh)
        state = jax.jit(tx.init, out_shardings=shardings)(params)
    """

    def annotate(node):
        if not isinstance(node, BlockStacks):
            return node
        return BlockStacks(
            {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=block_sharding(mesh, v.shape, replica_axis))
                for k, v in node.items()
            }
        )

    return jax.tree.map(annotate, abstract_state, is_leaf=lambda x: isinstance(x, BlockStacks))


class _Opaque:
    """A `BlockStacks` hidden from pytree traversal (a leaf), for `map_params`."""

    def __init__(self, stacks: BlockStacks):
        self.stacks = stacks


def map_params(
    initable: Any,
    f: Callable[..., Any],
    state: Any,
    /,
    *rest: Any,
    transform_non_params: Callable[..., Any] | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Any:
    """`optax.tree.map_params` for states that hold `BlockStacks` (Shampoo, SOAP), and any other.

    optax finds the parameter-shaped parts of a state by initialising ``initable`` on a placeholder,
    which has no shapes; a stack's group keys come from the parameters' shapes, so its placeholder
    state has none and the trees cannot be matched. Here every `BlockStacks` is matched whole and
    counts as non-parameter state: ``transform_non_params`` maps each of its arrays.
    """
    init = initable.init if hasattr(initable, "init") else initable
    is_stack = lambda x: isinstance(x, BlockStacks)  # noqa: E731

    def hide(tree: Any) -> Any:
        return jax.tree.map(lambda x: _Opaque(x) if is_stack(x) else x, tree, is_leaf=is_stack)

    def non_params(x: Any) -> Any:
        if transform_non_params is None:
            return x
        if isinstance(x, _Opaque):
            return _Opaque(BlockStacks({k: transform_non_params(v) for k, v in x.stacks.items()}))
        return transform_non_params(x)

    out = optax.tree.map_params(
        lambda p: hide(init(p)), f, hide(state), *rest, transform_non_params=non_params, is_leaf=is_leaf
    )
    return jax.tree.map(lambda x: x.stacks if isinstance(x, _Opaque) else x, out, is_leaf=lambda x: isinstance(x, _Opaque))


def stack(layout: StackLayout, mats: Sequence[Sequence[Sequence[jax.Array | None]]]) -> BlockStacks:
    """Concatenates per-(leaf, region, dim) ``(count, b, b)`` matrices into stacks in their storage layout."""
    parts: dict[str, list[jax.Array]] = {key: [] for key, _, _ in layout.groups}
    for leaf_slots, leaf_mats in zip(layout.slots, mats, strict=True):
        for region_slots, region_mats in zip(leaf_slots, leaf_mats, strict=True):
            for slot, m in zip(region_slots, region_mats, strict=True):
                if slot is not None:
                    parts[slot.group].append(m)
    out = BlockStacks()
    for key, _, _ in layout.groups:
        arrays = parts[key]
        out[key] = constrain_blocks(jnp.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0])
    return out


def unstack(layout: StackLayout, stacks: BlockStacks) -> list[list[list[jax.Array | None]]]:
    """Inverse of `stack`: the ``(count, b, b)`` matrices of every (leaf, region, dim)."""
    return [
        [[None if s is None else stacks[s.group][s.start : s.start + s.count] for s in region] for region in leaf]
        for leaf in layout.slots
    ]


def identity_fill(n: int, b: int) -> jax.Array:
    return jnp.broadcast_to(jnp.eye(b, dtype=jnp.float32), (n, b, b))


def zeros_fill(n: int, b: int) -> jax.Array:
    return jnp.zeros((n, b, b), jnp.float32)


def _along(x: jax.Array, axis: int) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """``x`` (M, *block) as (M, n_axis, rest) with block axis ``axis`` second, and the way back."""
    moved = jnp.moveaxis(x, 1 + axis, 1)
    shape = moved.shape

    def back(y: jax.Array) -> jax.Array:
        return jnp.moveaxis(y.reshape(shape), 1, 1 + axis)

    return moved.reshape(shape[0], shape[1], -1), back


def factor_statistic(blocks: jax.Array, axis: int, precision: jax.lax.Precision = HIGHEST) -> jax.Array:
    """``G_(axis) G_(axis)^T`` per block: the gradient contracted with itself over all dims but ``axis``."""
    g, _ = _along(blocks.astype(jnp.float32), axis)
    return jnp.einsum("mik,mjk->mij", g, g, precision=precision)


def apply_factor(
    blocks: jax.Array, mats: jax.Array, axis: int, *, transpose: bool = False, precision: jax.lax.Precision = HIGHEST
) -> jax.Array:
    """Multiplies each block along ``axis`` by its matrix: ``mats @ X`` (``mats^T @ X`` if ``transpose``)."""
    x, back = _along(blocks, axis)
    spec = "mji,mjk->mik" if transpose else "mij,mjk->mik"
    return back(jnp.einsum(spec, mats, x, precision=precision))


def apply_factors(
    regions: Sequence[jax.Array],
    mats: Sequence[Sequence[jax.Array | None]],
    *,
    transpose: bool = False,
    precision: jax.lax.Precision = HIGHEST,
) -> list[jax.Array]:
    """`apply_factor` along every dim that has a matrix, for each region of one parameter."""
    out = []
    for rb, region_mats in zip(regions, mats, strict=True):
        for axis, m in enumerate(region_mats):
            if m is not None:
                rb = apply_factor(rb, m, axis, transpose=transpose, precision=precision)
        out.append(rb)
    return out


def factor_statistics(
    layout: StackLayout, blocks: Sequence[Sequence[jax.Array] | None], precision: jax.lax.Precision = HIGHEST
) -> BlockStacks:
    """`factor_statistic` of every (leaf, region, preconditioned dim), stacked like the state."""
    outer = [
        [
            [None if slot is None else factor_statistic(rb, axis, precision) for axis, slot in enumerate(region_slots)]
            for rb, region_slots in zip(leaf_blocks or (), leaf_slots, strict=True)
        ]
        for leaf_blocks, leaf_slots in zip(blocks, layout.slots, strict=True)
    ]
    return stack(layout, outer)


def layout_tree(
    params: Any, make: Callable[[jax.Array], TensorLayout | None]
) -> tuple[list[jax.Array], jax.tree_util.PyTreeDef, list[TensorLayout | None]]:
    """Flattens ``params`` and builds each leaf's layout with ``make``, checking dtypes."""
    leaves, treedef = jax.tree.flatten(params)
    for leaf in leaves:
        dtype = np.dtype(leaf.dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"parameter of shape {leaf.shape} has dtype {dtype}; Kronecker-factored optimizers take "
                "real floating-point parameters only (route other leaves elsewhere with optax.partition)"
            )
    return leaves, treedef, [make(leaf) for leaf in leaves]
