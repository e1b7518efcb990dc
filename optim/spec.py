"""Optimizer specs: each optimizer's hyperparameters declared once, as a frozen dataclass.

A spec class is the one home of an optimizer's hyperparameters and their defaults: its fields. Groups
that several optimizers share (Newton-Schulz and momentum for the Muon family, the AdamW group of a
matrix family) are dataclasses of their own that a spec inherits, so each field and its default is
written once. A spec instance builds its optax transform. From the class come

- its public function (`function`), e.g. ``optim.muon.muon(learning_rate, *, beta=0.95, ...)``:
  a real signature listing every field with its default, so it is called like an optax alias and
  works under `optax.inject_hyperparams`;
- the keys of its config block ``optimizer.<name>`` in the experiments (`config_defaults`): every
  field but the common keys (`COMMON_KEYS`) and the code-only fields (`code_only`: callables,
  schedules, label trees).

Class-level declarations of an `OptimizerSpec`: ``extra_args``, the keyword arguments its ``update``
needs beyond ``(updates, state, params)`` (MuonClip's ``attn_max_logits``), which the train step
must supply; ``static_args``, the fields that set array shapes and must stay Python values under
`optax.inject_hyperparams`. A common key that is also a field is applied by the optimizer itself:
``weight_decay`` by every optimizer that has one, ``cautious`` by MuonClip (which masks Muon's update
but not its QK-clip); the registry wraps the other common keys around the optimizer.

*Wrappers* (`WrapperSpec`: DiLoCo, PowerSGD) run another optimizer, ``inner``: a registered name in
a config (``optimizer.diloco.inner = "sgd"``, that optimizer's own block configuring it), or an optax
transform from code. Specs with an ``axis_name`` field are built for replicas (`optim.cross_replica`):
the replica-local train step gives them its replica axis.

Adding an optimizer: one file in `optim/` with its spec (fields, defaults, ``transform``) and one
line in `optim.registry.OPTIMIZERS`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import optax

# Keys of the ``optimizer`` config block that every optimizer shares; never a family key.
COMMON_KEYS = ("learning_rate", "weight_decay", "cautious")
CONFIGURABLE = (bool, int, float, str)


def code_only(default: Any = None) -> Any:
    """A field set from code only (a callable, a schedule, a label tree): never a config key."""
    return dataclasses.field(default=default, metadata={"code_only": True})


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """A full optimizer (direction, weight decay, learning rate): what the registry builds.

    Every registered spec gives ``learning_rate`` (a float or an optax schedule) its default.
    """

    learning_rate: optax.ScalarOrSchedule

    extra_args: ClassVar[tuple[str, ...]] = ()
    static_args: ClassVar[tuple[str, ...]] = ()

    def transform(self) -> optax.GradientTransformation:
        raise NotImplementedError(f"{type(self).__name__} must define transform()")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrapperSpec:
    """An optimizer around another one, ``inner``: a registered optimizer's name or an optax transform.

    A name builds that optimizer at its spec's defaults (`optim.registry.build` builds it from its
    config block instead, with the run's schedule); its learning rate is the wrapper's.
    """

    inner: str | optax.GradientTransformation = "adamw"

    extra_args: ClassVar[tuple[str, ...]] = ()
    static_args: ClassVar[tuple[str, ...]] = ()

    def inner_transform(self) -> optax.GradientTransformation:
        if not isinstance(self.inner, str):
            return self.inner
        from optim import registry  # the registry imports every optimizer module, this one's users included

        cls = registry.spec_class(self.inner)
        return cls(learning_rate=defaults(cls)["learning_rate"]).transform()

    def transform(self) -> optax.GradientTransformation:
        raise NotImplementedError(f"{type(self).__name__} must define transform()")


def defaults(cls: type) -> dict[str, Any]:
    """Every field of the spec class ``cls`` with its default (`dataclasses.MISSING` where it has none)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def values(obj: Any, cls: type) -> dict[str, Any]:
    """The values in ``obj`` of the fields of ``cls`` (a part of ``obj``'s spec, e.g. its direction)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}


def config_defaults(cls: type[OptimizerSpec]) -> dict[str, Any]:
    """The family keys of ``cls`` with their defaults: fields that are neither common keys nor code-only."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in COMMON_KEYS or f.metadata.get("code_only"):
            continue
        if not isinstance(f.default, CONFIGURABLE):
            raise TypeError(f"{cls.__name__}.{f.name}: a config key needs a bool/int/float/str default, or code_only()")
        out[f.name] = f.default
    return out


def function(
    cls: type, method: str = "transform", *, name: str, positional: Sequence[str] | None = None
) -> Callable[..., optax.GradientTransformation]:
    """The public function ``name(*positional, **other_fields) -> cls(...).<method>()``.

    ``positional`` defaults to ``learning_rate`` (``inner`` for a `WrapperSpec`).
    Its signature lists every field of ``cls`` with its default (``positional`` first, the rest
    keyword-only), which is what `optax.inject_hyperparams` reads; its docstring is the class's.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if positional is None:
        positional = ("inner",) if issubclass(cls, WrapperSpec) else ("learning_rate",)

    def parameter(field: dataclasses.Field, kind: Any) -> inspect.Parameter:
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        return inspect.Parameter(field.name, kind, default=default, annotation=field.type)

    signature = inspect.Signature(
        [parameter(fields[n], inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in positional]
        + [parameter(f, inspect.Parameter.KEYWORD_ONLY) for n, f in fields.items() if n not in positional]
    )

    def build(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        return getattr(cls(**signature.bind(*args, **kwargs).arguments), method)()

    build.__signature__ = signature  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = name
    build.__module__ = cls.__module__
    build.__doc__ = cls.__doc__
    return build
