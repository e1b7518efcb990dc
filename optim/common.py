"""Helpers shared by the optimizer families: argument checks and the matrix / AdamW split.

Two shapes of full optimizer, as spec bases (`optim.spec`) whose transform wraps the family's
``direction()``:

- `DirectionOptimizer` (SGD, Lion, CAME): one direction for every parameter, decoupled weight decay on
  leaves of two or more axes, the learning rate.
- `MatrixOptimizer` (Muon and its variants, Shampoo, SOAP): the direction on hidden matrices and AdamW
  on everything else (embeddings, LM head, norms, biases, scalars), `with_adam`; `AdamGroup` holds the
  AdamW group's hyperparameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from optim import labels, shapes, spec


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raises a ValueError listing the accepted values when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def static_int(name: str, value: Any, static_args: Sequence[str]) -> int:
    """``value`` as a Python int; a clear error when `optax.inject_hyperparams` made it an array."""
    try:
        return int(value)
    except jax.errors.ConcretizationTypeError:
        raise ValueError(
            f"{name} sets array shapes and must be a Python int; with optax.inject_hyperparams pass "
            f"static_args={tuple(static_args)}"
        ) from None


def check_floating(params: Any, family: str, fix: str) -> None:
    """Raises a ValueError naming the first non-floating leaf of ``params`` and ``fix``."""
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            where = "/".join(labels.path_names(path)) or "<root>"
            raise ValueError(f"{family} needs floating-point parameters, got {where} of dtype {p.dtype}; {fix}")


def with_adam(
    matrix_direction: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float,
    adam_lr_ratio: float,
    adam_learning_rate: optax.ScalarOrSchedule | None,
    adam_b1: float,
    adam_b2: float,
    adam_eps: float,
    param_labels: Callable[[Any], Any] | Any | None,
    decay_matrices: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """The full optimizer of a matrix family: its direction on "matrix" leaves, AdamW elsewhere.

    "matrix": ``chain(direction, add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``.
    "adam": ``adamw(adam_lr, adam_b1, adam_b2, adam_eps, weight_decay)``, decaying leaves of two or
    more axes (embeddings yes, norms and biases no). ``adam_lr`` is ``adam_learning_rate`` if given,
    else ``adam_lr_ratio * learning_rate`` (following the same schedule). Labels come from
    ``param_labels`` (a label tree or function) or `optim.labels.matrix_labels`. With
    ``decay_matrices=False`` the "matrix" chain has no decay step (a direction that decays itself).
    """
    if adam_learning_rate is None:
        if callable(learning_rate):

            def adam_learning_rate(count):
                return adam_lr_ratio * learning_rate(count)

        else:
            adam_learning_rate = adam_lr_ratio * learning_rate
    decay = [optax.add_decayed_weights(weight_decay)] if decay_matrices else []
    matrix = optax.chain(matrix_direction, *decay, optax.scale_by_learning_rate(learning_rate))
    adam = optax.adamw(
        adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay, mask=labels.decay_mask
    )
    return optax.partition(
        {labels.MATRIX: matrix, labels.ADAM: adam},
        labels.matrix_labels if param_labels is None else param_labels,
    )


def weight_decay_field() -> Any:
    """The ``weight_decay`` field of a full optimizer spec (a family's spec sets its default)."""
    return spec.param(valid="[0, inf)", doc="decoupled weight decay ``lambda`` (times the learning rate) on the leaves `optim.labels.decay_mask` picks.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamGroup:
    """The AdamW group of a matrix family (see `with_adam`).

    Attributes:
      adam_lr_ratio: the AdamW learning rate is this times the family's (same schedule).
      adam_b1: AdamW's first-moment decay.
      adam_b2: AdamW's second-moment decay.
      adam_eps: AdamW's epsilon.
      adam_learning_rate: a float or schedule replacing ``adam_lr_ratio * learning_rate``.
      param_labels: a label tree or function ("matrix" / "adam"); None: `optim.labels.matrix_labels`.
    """

    adam_lr_ratio: float = spec.param(1.0, valid="[0, inf)")
    adam_b1: float = spec.param(0.9, valid="[0, 1)")
    adam_b2: float = spec.param(0.95, valid="[0, 1)")
    adam_eps: float = spec.param(1e-8, valid="[0, inf)")
    adam_learning_rate: optax.ScalarOrSchedule | None = spec.code_only()
    param_labels: Callable[[Any], Any] | Any | None = spec.code_only()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatrixOptimizer(AdamGroup, spec.OptimizerSpec):
    """Full optimizer spec of a matrix family: ``direction()`` on hidden matrices, AdamW elsewhere.

    A family's spec inherits its direction spec (which defines ``direction()``) first, then this.
    """

    weight_decay: float = weight_decay_field()

    applies_weight_decay: ClassVar[bool] = True

    def transform(self) -> optax.GradientTransformationExtraArgs:
        full = with_adam(
            self.direction(),
            self.learning_rate,
            weight_decay=self.weight_decay,
            **spec.values(self, AdamGroup),
        )
        return shapes.checked(full, type(self).__name__.lower())


@dataclasses.dataclass(frozen=True, kw_only=True)
class DirectionOptimizer(spec.OptimizerSpec):
    """``chain(direction(), add_decayed_weights(weight_decay, decay_mask), scale_by_learning_rate(lr))``.

    Decay applies to leaves of two or more axes (`optim.labels.decay_mask`). A family's spec inherits
    its direction spec (which defines ``direction()``) first, then this.
    """

    weight_decay: float = weight_decay_field()

    applies_weight_decay: ClassVar[bool] = True

    def transform(self) -> optax.GradientTransformationExtraArgs:
        full = optax.chain(
            self.direction(),
            optax.add_decayed_weights(self.weight_decay, mask=labels.decay_mask),
            optax.scale_by_learning_rate(self.learning_rate),
        )
        return shapes.checked(full, type(self).__name__.lower())


def unzip(tree: Any, out: Any, n: int) -> tuple[Any, ...]:
    """``n`` trees shaped like ``tree`` from ``out`` (``tree`` with an ``n``-tuple at each leaf); ``n``
    empty trees when ``tree`` has no leaves (a branch of `optax.partition` that holds no parameter)."""
    treedef = jax.tree.structure(tree)
    rows = treedef.flatten_up_to(out)
    return tuple(treedef.unflatten([row[i] for row in rows]) for i in range(n))


try:  # optax's shapeless stand-in for the parameters (`optax.tree.map_params` initialises on it)
    from optax.tree_utils._state_utils import _ParamsPlaceholder as _OptaxPlaceholder
except ImportError:  # a later optax without it: `by_shapes` builds as usual
    _OptaxPlaceholder = ()


class ShapesUnknown:
    """Stands, as one pytree leaf, for a state part whose structure follows the parameters' shapes
    (Shampoo's block stacks, PSGD-Kron's factors, `quantize_state`'s codes) in a state initialised on
    `optax.tree.map_params`'s placeholder, which has no shapes. ``map_params`` then matches that
    part whole as non-parameter state (``transform_non_params`` receives it whole)."""

    def __repr__(self) -> str:
        return "ShapesUnknown()"


def is_placeholder(params: Any) -> bool:
    """Whether ``params`` is `optax.tree.map_params`'s shapeless stand-in for the parameters."""
    return isinstance(params, _OptaxPlaceholder)


def by_shapes(params: Any, build: Callable[[], Any]) -> Any:
    """``build()``, the state part that ``params``' shapes define; `ShapesUnknown` on optax's placeholder."""
    return ShapesUnknown() if is_placeholder(params) else build()
