"""How much memory an optimizer state takes, and how it is laid out over devices.

`state_bytes` counts the exact bytes of any state pytree (arrays, `jax.ShapeDtypeStruct`s from
`jax.eval_shape`, NumPy arrays or Python scalars), so ``state_bytes(jax.eval_shape(tx.init, params))``
costs nothing. Quantized states (`optim.quantize_state`) are pytrees of ``uint8`` codes and fp32
scales, so they are counted like any other state.

`state_shardings` places state leaves that do not mirror a parameter's shape but keep its rank
(quantization scales, factored second moments, 4-bit packed codes) on the parameter's mesh axes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optim import labels

_FOUR_BIT = {"int4", "uint4", "float4_e2m1fn"}


def state_bytes(state: Any) -> int:
    """The exact number of bytes held by the leaves of ``state`` (global, not per device).

    4-bit dtypes count half a byte per element, rounded up per leaf.
    """
    total = 0
    for leaf in jax.tree.leaves(state):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            leaf = np.asarray(leaf)
            shape, dtype = leaf.shape, leaf.dtype
        size = int(np.prod(shape, dtype=np.int64))
        total += -(-size // 2) if np.dtype(dtype).name in _FOUR_BIT else size * np.dtype(dtype).itemsize
    return total


def _spec_like(shape: tuple[int, ...], sharding: jax.NamedSharding) -> jax.P:
    """The parameter's spec on each axis of ``shape`` that its mesh axes split evenly.

    Mesh axes that an axis cannot take (a reduced axis of length 1, as in rank-1 or factored
    statistics) move to the last axis that has none and that they split evenly, so a row statistic
    of a column-sharded matrix is still spread over the same devices.
    """
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))

    def names(axes):
        return (axes,) if isinstance(axes, str) else tuple(axes or ())

    def size(axes):
        return int(np.prod([sharding.mesh.shape[a] for a in names(axes)], dtype=np.int64))

    out, freed = [], []
    for dim, axes in zip(shape, spec, strict=True):
        fits = names(axes) and dim > 0 and dim % size(axes) == 0
        out.append(axes if fits else None)
        freed += [] if fits else list(names(axes))
    for i in reversed(range(len(shape))):
        if freed and out[i] is None and shape[i] > 0 and shape[i] % size(freed) == 0:
            out[i] = freed[0] if len(freed) == 1 else tuple(freed)
            break
    return jax.P(*out)


def state_shardings(state: Any, params: Any, param_shardings: Any) -> Any:
    """A `jax.NamedSharding` for every leaf of ``state`` (arrays or `jax.ShapeDtypeStruct`s).

    A state leaf belongs to a parameter when the parameter's key path is a suffix of the leaf's
    path, or of the leaf's path without its last key (the field of a quantized node such as
    ``.absmax``). The longest such parameter with the leaf's rank wins; the leaf then takes the
    parameter's `PartitionSpec` on every axis whose length the spec's mesh axes divide (a leaf of the
    parameter's shape takes its sharding exactly; an axis cut into whole tiles keeps its mesh axes; the
    mesh axes of a reduced axis of length 1 move to a free axis they divide). Other leaves (counters,
    scalars) are replicated.

    Args:
      state: the optimizer state, or ``jax.eval_shape(tx.init, params)``.
      params: the parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
      param_shardings: a `jax.NamedSharding` per parameter, same structure as ``params``.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    shardings = treedef.flatten_up_to(param_shardings)
    by_path = {labels.path_names(path): (tuple(p.shape), s) for (path, p), s in zip(flat, shardings, strict=True)}
    if not by_path:
        raise ValueError("state_shardings needs at least one parameter to take the mesh from")
    mesh = shardings[0].mesh

    def pick(path, leaf):
        names, shape = labels.path_names(path), tuple(leaf.shape)
        for end in (len(names), len(names) - 1):
            for start in range(end):
                hit = by_path.get(names[start:end])
                if hit is not None and hit[0] == shape:
                    return hit[1]
                if hit is not None and len(hit[0]) == len(shape):
                    return jax.NamedSharding(mesh, _spec_like(shape, hit[1]))
        return jax.NamedSharding(mesh, jax.P())

    return jax.tree_util.tree_map_with_path(pick, state)
