"""Shardings from logical names: parameters, optimizer state, batches and activations.

The rule set in force is set once per run with `use_rules` (a context manager); `constrain` reads it
to pin an activation's layout from its logical names, and is a no-op when no mesh is set, so model
code runs unchanged on one device.
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


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` on ``x`` from logical axis names, under the ambient mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = rules_lib.logical_to_mesh_spec(logical, current_rules().activations, mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, spec)


def named_shardings(logical_specs: Any, mesh: jax.sharding.Mesh, rules: rules_lib.Rules) -> Any:
    """Maps a pytree of logical parameter `PartitionSpec`s (from `nnx.get_partition_spec`) to `NamedSharding`s."""
    return jax.tree.map(
        lambda spec: jax.NamedSharding(mesh, rules_lib.logical_to_mesh_spec(tuple(spec), rules.params, mesh.axis_names)),
        logical_specs,
        is_leaf=lambda x: isinstance(x, jax.P),
    )


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


def _shape_key(leaf: Any) -> tuple[int, ...]:
    return tuple(getattr(leaf, "shape", ()))


def state_shardings(abstract_state: Any, params: Any, param_shardings: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shardings for an optimizer state: leaves shaped like a parameter take that parameter's sharding.

    Works for any optax state. A leaf is matched to a parameter by walking the state's key path from
    the end: the longest suffix of the state path that is a parameter path with the same shape wins.
    Leaves with no matching parameter (counters, scalars) are replicated, except leaves that carry
    their own ``.sharding`` (from an optimizer that stacks blocks, e.g. Shampoo), which keep it.

    Args:
      abstract_state: the state, or `jax.eval_shape(tx.init, params)`.
      params: the parameter pytree (arrays or `ShapeDtypeStruct`s).
      param_shardings: `NamedSharding` per parameter, same structure as ``params``.
      mesh: the mesh that replicated leaves live on.
    """
    by_path = {}
    for (path, leaf), sharding in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_shardings), strict=True
    ):
        by_path[tuple(str(k) for k in path)] = (_shape_key(leaf), sharding)
    replicated = jax.NamedSharding(mesh, jax.P())

    def pick(path, leaf):
        keys = tuple(str(k) for k in path)
        shape = _shape_key(leaf)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        own = getattr(leaf, "sharding", None)
        if isinstance(own, jax.NamedSharding) and own.mesh.shape == mesh.shape:
            return own
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` held by the first addressable device (from the arrays' shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard_shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard_shape)) * leaf.dtype.itemsize
    return total
