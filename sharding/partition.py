"""Shardings from logical names: parameters, optimizer state, batches and activations.

The rule set in force is set once per run with `use_rules` (a context manager); `constrain` reads it
to pin an activation's layout from its logical names, and is a no-op when no mesh is set, so model
code runs unchanged on one device. `logical_shard_map` runs a kernel GSPMD cannot partition (a
Pallas call) per shard, with specs from the same logical names.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from sharding import rules as rules_lib

_RULES: contextvars.ContextVar[rules_lib.Rules] = contextvars.ContextVar("logical_rules", default=rules_lib.make_rules())


@contextlib.contextmanager
def use_rules(rules: rules_lib.Rules) -> Iterator[None]:
    """Makes ``rules`` the logical-to-mesh rules seen by `constrain` inside the block."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def current_rules() -> rules_lib.Rules:
    return _RULES.get()


def auto_axes(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` that GSPMD partitions: all but those an enclosing `jax.shard_map` made manual."""
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in mesh.axis_names if a not in manual)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` on ``x`` from logical axis names, under the ambient mesh.

    Inside a `jax.shard_map` (e.g. the replica-local train step) the manual axes are left out: each
    replica constrains only its own slice over the axes that remain automatic.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = rules_lib.logical_to_mesh_spec(logical, current_rules().activations, auto_axes(mesh))
    return jax.lax.with_sharding_constraint(x, spec)


Logical = tuple[str | None, ...]


def _is_logical(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def logical_mesh_axes(name: str) -> tuple[str, ...]:
    """The mesh axes of the mesh in context that the activation rules map logical ``name`` onto.

    Inside a `logical_shard_map` these are the axes to reduce over (e.g. a max over ``batch``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    spec = rules_lib.logical_to_mesh_spec((name,), current_rules().activations, mesh.axis_names)
    return mesh_axes_of(spec[0])


def logical_shard_map(
    fn: Any,
    in_logical: Sequence[Logical],
    out_logical: Any,
    *,
    whole: Sequence[str] = (),
    check_vma: bool = False,
) -> Any:
    """``fn`` run per shard inside `jax.shard_map`, its specs derived from logical axis names.

    For kernels that cannot be partitioned by GSPMD (Pallas calls): each positional array argument
    gets a `PartitionSpec` from its logical names under the activation rules in force, and so does
    each output (``out_logical`` is a pytree of logical-name tuples matching ``fn``'s result). With
    no mesh in context ``fn`` is called as is.

    Args:
      fn: the per-shard function; it sees local shards.
      in_logical: one tuple of logical names per positional argument.
      out_logical: logical names of the outputs, same structure as ``fn``'s result.
      whole: logical axes ``fn`` needs unsplit on every device (e.g. ``seq`` for attention);
        a rule that shards one is an error that names the fix.
      check_vma: passed to `jax.shard_map`; Pallas calls are opaque to its varying-axes check.
    """

    def sharded(*args):
        mesh = jax.sharding.get_abstract_mesh()
        free = auto_axes(mesh) if not mesh.empty else ()
        if not free:
            return fn(*args)
        if len(args) != len(in_logical):
            raise ValueError(f"logical_shard_map: {len(args)} arguments but {len(in_logical)} logical specs")
        table = current_rules().activations
        to_spec = lambda names: rules_lib.logical_to_mesh_spec(names, table, free)  # noqa: E731
        name = getattr(fn, "__name__", repr(fn))
        for logical in (*in_logical, *jax.tree.leaves(out_logical, is_leaf=_is_logical)):
            for axis_name, axes in zip(logical, to_spec(logical), strict=True):
                ways = int(np.prod([mesh.shape[a] for a in mesh_axes_of(axes)]))
                if axis_name in whole and ways > 1:
                    raise ValueError(
                        f"{name} needs logical axis {axis_name!r} whole on each device, but the rules shard it over mesh "
                        f"axes {mesh_axes_of(axes)}; use rules that leave it unsharded (--config.rule_overrides='{axis_name}=')"
                    )
        for index, (arg, logical) in enumerate(zip(args, in_logical, strict=True)):
            for dim, (size, axes) in enumerate(zip(arg.shape, to_spec(logical), strict=True)):
                ways = int(np.prod([mesh.shape[a] for a in mesh_axes_of(axes)]))
                if size % ways:
                    raise ValueError(
                        f"{name}: argument {index} has shape {arg.shape}; dimension {dim} ({logical[dim]!r}, {size}) does not "
                        f"split over mesh axes {mesh_axes_of(axes)} of size {ways}; change the mesh or override the rule for {logical[dim]!r}"
                    )
        in_specs = tuple(to_spec(logical) for logical in in_logical)
        out_specs = jax.tree.map(to_spec, out_logical, is_leaf=_is_logical)
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(free), check_vma=check_vma
        )(*args)

    return sharded


def named_shardings(logical_specs: Any, mesh: jax.sharding.Mesh, rules: rules_lib.Rules, abstract: Any = None) -> Any:
    """Maps a pytree of logical parameter `PartitionSpec`s (from `nnx.get_partition_spec`) to `NamedSharding`s.

    ``abstract``: the parameters' shapes (same tree), so that optional mesh axes (`sharding.rules`)
    go only where they split a dimension evenly.
    """
    is_spec = lambda x: isinstance(x, jax.P)  # noqa: E731

    def sharding(spec: jax.P, shape: tuple[int, ...] | None) -> jax.NamedSharding:
        mesh_spec = rules_lib.logical_to_mesh_spec(tuple(spec), rules.params, mesh.axis_names, shape=shape, axis_sizes=mesh.shape)
        return jax.NamedSharding(mesh, mesh_spec)

    if abstract is None:
        return jax.tree.map(lambda spec: sharding(spec, None), logical_specs, is_leaf=is_spec)
    return jax.tree.map(lambda spec, leaf: sharding(spec, leaf.shape), logical_specs, abstract, is_leaf=is_spec)


def check_divisible(abstract: Any, shardings: Any) -> None:
    """Raises a ValueError naming the array, dimension and fix when a sharded dimension does not divide."""
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings), strict=True):
        for dim, axes in enumerate(sharding.spec):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            ways = int(np.prod([sharding.mesh.shape[a] for a in names]))
            if leaf.shape[dim] % ways:
                raise ValueError(
                    f"{jax.tree_util.keystr(path)} has shape {leaf.shape}; dimension {dim} ({leaf.shape[dim]}) does not "
                    f"split over mesh axes {names} of size {ways}. Change the model size, the mesh, or override the rule "
                    "for that logical axis (--config.rule_overrides)"
                )


def _names(path: Any) -> tuple[str, ...]:
    return tuple(jax.tree_util.keystr((key,), simple=True) for key in path)


def mesh_axes_of(axes: Any) -> tuple[str, ...]:
    """The mesh axes of one entry of a `PartitionSpec` (None, a name, or a tuple of names)."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def _spec_like(shape: tuple[int, ...], sharding: jax.NamedSharding) -> jax.P:
    """A parameter's spec carried over to a state leaf of the same rank but other shape.

    Each axis keeps the parameter's mesh axes when they split it evenly. Mesh axes an axis cannot
    take (a reduced axis of length 1, as in factored or rank-1 statistics) move to the last free axis
    they split evenly, so a row statistic of a column-sharded matrix is spread over the same devices.
    """
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    ways = lambda axes: int(np.prod([sharding.mesh.shape[a] for a in mesh_axes_of(axes)]))  # noqa: E731
    out, freed = [], []
    for dim, axes in zip(shape, spec, strict=True):
        fits = bool(mesh_axes_of(axes)) and dim > 0 and dim % ways(axes) == 0
        out.append(axes if fits else None)
        freed += [] if fits else list(mesh_axes_of(axes))
    for i in reversed(range(len(shape))):
        if freed and out[i] is None and shape[i] > 0 and shape[i] % ways(freed) == 0:
            out[i] = freed[0] if len(freed) == 1 else tuple(freed)
            break
    return jax.P(*out)


def state_shardings(
    abstract_state: Any, params: Any, param_shardings: Any, mesh: jax.sharding.Mesh | None = None
) -> Any:
    """Shardings for any optimizer state, derived from the parameters' shardings.

    A state leaf belongs to a parameter when the parameter's key path ends the leaf's path, or the
    leaf's path without its last key (a field of a per-parameter node, e.g. a quantized moment's
    ``.codes``); the longest such parameter path wins. A leaf of the parameter's shape takes its
    sharding exactly; a leaf of the same rank but another shape (quantization scales, factored
    moments, packed codes) takes `_spec_like`. Leaves with no parameter keep a `NamedSharding` they
    carry on a mesh of this shape (an optimizer's stacked blocks) or are replicated (counters).

    Args:
      abstract_state: the state, or `jax.eval_shape(tx.init, params)`.
      params: the parameter pytree (arrays or `ShapeDtypeStruct`s).
      param_shardings: `NamedSharding` per parameter, same structure as ``params``.
      mesh: the mesh for replicated leaves; default: the parameters' mesh.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    shardings = treedef.flatten_up_to(param_shardings)
    by_path = {_names(path): (tuple(leaf.shape), s) for (path, leaf), s in zip(flat, shardings, strict=True)}
    if mesh is None:
        if not shardings:
            raise ValueError("state_shardings needs a mesh when there are no parameters")
        mesh = shardings[0].mesh
    replicated = jax.NamedSharding(mesh, jax.P())

    def pick(path, leaf):
        names, shape = _names(path), tuple(getattr(leaf, "shape", ()))
        for end in (len(names), len(names) - 1):
            for start in range(end):
                hit = by_path.get(names[start:end])
                if hit is not None and hit[0] == shape:
                    return hit[1]
                if hit is not None and len(hit[0]) == len(shape):
                    return jax.NamedSharding(mesh, _spec_like(shape, hit[1]))
        own = getattr(leaf, "sharding", None)
        if isinstance(own, jax.NamedSharding) and own.mesh.shape == mesh.shape:
            return own
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def stacked(sharding: jax.NamedSharding, axis: str) -> jax.NamedSharding:
    """The sharding of an array with one more leading axis, split over mesh ``axis`` (one slice per replica).

    ``axis`` is removed from the other dimensions' specs (a block stack spread over every mesh axis
    keeps the axes left inside a replica).
    """
    rest = []
    for axes in sharding.spec:
        kept = tuple(a for a in mesh_axes_of(axes) if a != axis)
        rest.append(kept[0] if len(kept) == 1 else (kept or None))
    return jax.NamedSharding(sharding.mesh, jax.P(axis, *rest))


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` held by the first addressable device (from the arrays' shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard_shape)) * leaf.dtype.itemsize
    return total
