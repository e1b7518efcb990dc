"""Kernels inside a type-checked `jax.shard_map`: the manual mesh axes a value varies over.

Under ``jax.shard_map(..., check_vma=True)`` (the replica-local train step, ``config.replicas``) every
value's type records the manual mesh axes it varies over. A `pallas_call` there must be told how its
outputs vary, and a `custom_vjp` must return gradients typed like its primal inputs. The kernels'
entry points therefore give their inputs one common set of axes (`unify`) and run each kernel through
`call_opaque`: inside a `jax.shard_map` over no further axes that does not check types, its outputs
cast back to the inputs' axes. Pallas's interpreter cannot run on typed values at all (it mixes typed
and untyped values in its grid loop), so `check_interpretable` turns that case into an error naming
the XLA path; compiled kernels are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (empty outside a type-checked `jax.shard_map`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older releases call it ``vma``
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _axes_of(trees: tuple[Any, ...]) -> frozenset[str]:
    return frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(trees)))


def vary_like(tree: Any, *like: Any) -> Any:
    """Each array of ``tree`` cast to vary over every manual axis some array of ``like`` varies over."""
    axes = _axes_of(like)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def unify(*args: Any) -> tuple[Any, ...]:
    """``args`` (None allowed) all cast to the union of their manual axes."""
    return vary_like(args, *args)


def call_opaque(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` out of reach of an enclosing type check, its outputs typed like ``args``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not getattr(mesh, "manual_axes", ()):
        return fn(*args)
    out = jax.shard_map(fn, in_specs=jax.P(), out_specs=jax.P(), axis_names=frozenset(), check_vma=False)(*args)
    return vary_like(out, *args)


def check_interpretable(kernel: str, fix: str, *args: Any) -> None:
    """Raise if interpret mode would see values typed as varying over manual mesh axes."""
    axes = _axes_of(args)
    if axes:
        raise ValueError(
            f"{kernel}: Pallas interpret mode cannot run inside a jax.shard_map that checks manual axes "
            f"(here {sorted(axes)}, e.g. the replica-local train step of config.replicas): {fix}. "
            "Compiled GPU and TPU kernels are unaffected."
        )
