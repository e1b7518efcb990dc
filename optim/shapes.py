"""Trace-time shape checks: a gradient that does not fit the state gets an error naming its leaf."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optim import labels


def check_like(updates: Any, like: Any, family: str) -> None:
    """Raises a ValueError naming the first leaf of ``updates`` whose shape differs from its
    counterpart in ``like`` (a state tree that mirrors the parameters), or the tree mismatch."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    try:
        mirrors = treedef.flatten_up_to(like)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{family}: the gradient tree does not match the parameters its state was built for: {e}") from None
    for (path, g), m in zip(flat, mirrors, strict=True):
        if tuple(g.shape) != tuple(m.shape):
            where = "/".join(labels.path_names(path)) or "<root>"
            raise ValueError(
                f"{family}: the gradient of {where} has shape {tuple(g.shape)} but its parameter {tuple(m.shape)}; "
                "pass gradients shaped like the parameters the state was built for"
            )


def checked(tx: optax.GradientTransformation, family: str) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its gradients checked against the parameters at trace time (`check_like`), where its
    update gets them; for transforms whose state does not mirror every parameter (optax's AdamW, SGD
    without momentum). Same state as ``tx``."""
    tx = optax.with_extra_args_support(tx)

    def update(updates, state, params=None, **extra_args):
        if params is not None:
            check_like(updates, params, family)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update)
