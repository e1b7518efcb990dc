"""Optimizer specs: each optimizer's hyperparameters declared once, as a frozen dataclass.

A spec class is the one home of an optimizer's hyperparameters: its fields, each with its default,
its valid range (`param`: ``valid="[0, 1)"``, checked when a spec is made) and its documentation
(``doc=`` beside the field, or the ``Attributes:`` section of the class that declares it). Groups
that several optimizers share (Newton-Schulz and momentum for the Muon family, the AdamW group of a
matrix family) are dataclasses of their own that a spec inherits, so each field is written once. A
spec instance builds its optax transform. From the class come

- its public function (`function`), e.g. ``optim.muon.muon(learning_rate, *, beta=0.95, ...)``: a
  real signature with every field, its default and its resolved type, so it is called like an optax
  alias and works under `optax.inject_hyperparams`, and an ``Args:`` section gathered from every class
  on the spec's MRO;
- the family keys of its config block ``optimizer.<name>`` (`config_defaults`): every field but the
  common keys (`COMMON_KEYS`) and the code-only fields (`code_only`: callables, schedules, label
  trees), and a wrapper's ``inner``.

A spec also *declares* what it needs and offers, as class attributes and methods whose defaults
(on `Spec`) do nothing, so nothing needs to infer them from field names:

- ``extra_args``: keyword arguments its ``update`` needs beyond ``(updates, state, params)``
  (MuonClip's ``attn_max_logits``), which the train step must supply;
- ``static_args``: fields that set array shapes and stay Python values under `optax.inject_hyperparams`;
- ``replica_local``: built for replicas (`optim.cross_replica`): its update does its own
  collectives over the ``axis_name`` field, which `for_replicas` sets;
- ``applies_weight_decay`` / ``applies_cautious``: it applies the common key ``weight_decay`` /
  ``cautious`` itself (MuonClip masks Muon's update but not its QK-clip); `optim.build` wraps the rest;
- `for_run`: the spec for a run of known length (a learned optimizer's time features);
- `fused_update`: its step as `quantize_state`'s fused kernel takes it (AdamW, Lion);
- `check_layout`: raises when the parameters' sharding does not suit it (DeMo's DCT chunks).

*Wrappers* (`WrapperSpec`: DiLoCo, PowerSGD) take another optimizer's transform, ``inner``; in a
config it is a registered name (``optimizer.diloco.inner``), which `optim.build` resolves.

Adding an optimizer: one file in `optim/` with its spec and one line in `optim.registry.OPTIMIZERS`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import optax

# Keys of the ``optimizer`` config block that every optimizer shares; never a family key.
COMMON_KEYS = ("learning_rate", "weight_decay", "cautious")
CONFIGURABLE = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A range of valid values, written as in mathematics: ``"[0, 1)"``, ``"(0, inf)"``."""

    text: str
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        match = re.fullmatch(r"\s*([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])\s*", text)
        if match is None:
            raise ValueError(f"valid={text!r} is not an interval such as '[0, 1)' or '(0, inf)'")
        left, low, high, right = match.groups()
        return cls(text.strip(), float(low), float(high), left == "[", right == "]")

    def __contains__(self, x: float) -> bool:
        above = x >= self.low if self.low_closed else x > self.low
        below = x <= self.high if self.high_closed else x < self.high
        return above and below

    def condition(self) -> str:
        """The range as a reader checks it: ``>= 0``, ``> 0`` or ``in [0, 1)``."""
        if math.isinf(self.high) and not math.isinf(self.low):
            return f"{'>=' if self.low_closed else '>'} {self.low:g}"
        return f"in {self.text}"


def param(default: Any = dataclasses.MISSING, *, valid: str | None = None, doc: str | None = None) -> Any:
    """A hyperparameter field: its default, its valid range (an `Interval`) and its documentation."""
    metadata = {}
    if valid is not None:
        metadata["valid"] = Interval.parse(valid)
    if doc is not None:
        metadata["doc"] = doc
    return dataclasses.field(default=default, metadata=metadata)


def code_only(default: Any = None, *, doc: str | None = None) -> Any:
    """A field set from code only (a callable, a schedule, a label tree): never a config key."""
    return dataclasses.field(default=default, metadata={"code_only": True} | ({"doc": doc} if doc else {}))


def check_value(name: str, value: Any, valid: str | Interval) -> None:
    """Raises a ValueError naming ``name``, ``value`` and the range when a Python number is outside ``valid``."""
    interval = Interval.parse(valid) if isinstance(valid, str) else valid
    if isinstance(value, bool) or not isinstance(value, int | float):
        return  # a schedule, or an array under `optax.inject_hyperparams`
    if math.isnan(value) or value not in interval:
        raise ValueError(f"{name}={value!r} must be {interval.condition()}")


def field_ranges(cls: type) -> dict[str, Interval]:
    """The valid range of each field of ``cls`` that has one, from the nearest class on its MRO that declares it."""
    out: dict[str, Interval] = {}
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            out |= {f.name: f.metadata["valid"] for f in dataclasses.fields(c) if "valid" in f.metadata}
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in out.items() if k in names}


def check_ranges(obj: Any) -> None:
    """`check_value` for every field of the spec ``obj`` with a declared range (`param`'s ``valid``)."""
    for name, interval in field_ranges(type(obj)).items():
        check_value(name, getattr(obj, name), interval)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    """What every spec declares; each default here means "does not need / offer it"."""

    extra_args: ClassVar[tuple[str, ...]] = ()
    static_args: ClassVar[tuple[str, ...]] = ()
    replica_local: ClassVar[bool] = False
    applies_weight_decay: ClassVar[bool] = False
    applies_cautious: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every spec checks its fields' ranges when made, after its own ``__post_init__`` checks."""
        super().__init_subclass__(**kwargs)
        own_checks = getattr(cls, "__post_init__", None)

        def __post_init__(self) -> None:
            if own_checks is not None:
                own_checks(self)
            check_ranges(self)

        cls.__post_init__ = __post_init__  # type: ignore[method-assign]

    def for_run(self, total_steps: int) -> Spec:
        """This spec for a run of ``total_steps``; unchanged unless the optimizer needs the run's length."""
        del total_steps
        return self

    def for_replicas(self, axis_name: str | None) -> Spec:
        """This spec in a replica-local step over ``axis_name``: a `replica_local` spec takes the axis."""
        return dataclasses.replace(self, axis_name=axis_name) if self.replica_local else self

    def fused_update(self) -> Any:
        """`optim.quantize_state.Fused` when `quantize_state`'s fused kernel can take this step; else None."""
        return None

    def check_layout(self, params: Any, shardings: Any, replica_axis: str | None = None) -> None:
        """Raises a ValueError naming the fix when the parameters' layout does not suit the optimizer."""
        del params, shardings, replica_axis

    def transform(self) -> optax.GradientTransformation:
        raise NotImplementedError(f"{type(self).__name__} must define transform()")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSpec(Spec):
    """A full optimizer (direction, weight decay, learning rate): what the registry holds.

    Attributes:
      learning_rate: a float or an optax schedule of the step count.
    """

    # inf is refused by no optimizer's arithmetic: its steps are non-finite, which the train step skips and counts.
    learning_rate: optax.ScalarOrSchedule = param(valid="[0, inf]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrapperSpec(Spec):
    """An optimizer around another one, ``inner`` (an optax transform), which sets the learning rate.

    In a config, ``optimizer.<wrapper>.inner`` names a registered optimizer (``default_inner``
    unless set), which `optim.build` builds from its own block and the common keys.

    Attributes:
      inner: the optimizer this one runs (any optax transform).
    """

    inner: optax.GradientTransformation = dataclasses.field(metadata={"code_only": True})

    default_inner: ClassVar[str] = "adamw"


def defaults(cls: type) -> dict[str, Any]:
    """Every field of the spec class ``cls`` with its default (`dataclasses.MISSING` where it has none)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def values(obj: Any, cls: type) -> dict[str, Any]:
    """The values in ``obj`` of the fields of ``cls`` (a part of ``obj``'s spec, e.g. its direction)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}


def config_defaults(cls: type) -> dict[str, Any]:
    """The family keys of ``cls`` with their defaults: fields that are neither common keys nor code-only,
    and a wrapper's ``inner``, the registered name of its inner optimizer (``default_inner``)."""
    out = {"inner": cls.default_inner} if issubclass(cls, WrapperSpec) else {}
    for f in dataclasses.fields(cls):
        if f.name in COMMON_KEYS or f.metadata.get("code_only"):
            continue
        if not isinstance(f.default, CONFIGURABLE):
            raise TypeError(f"{cls.__name__}.{f.name}: a config key needs a bool/int/float/str default, or code_only()")
        out[f.name] = f.default
    return out


def _attribute_docs(cls: type) -> dict[str, str]:
    """The entries of the ``Attributes:`` section of ``cls``'s own docstring, by name."""
    return _section_entries(cls.__dict__.get("__doc__") or "", "Attributes")


def arg_docs(fn: Callable[..., Any]) -> dict[str, str]:
    """The entries of the ``Args:`` section of ``fn``'s docstring, by name, one line each."""
    return _section_entries(fn.__doc__ or "", "Args")


def _section_entries(docstring: str, title: str) -> dict[str, str]:
    doc = inspect.cleandoc(docstring)
    section = re.search(rf"^{title}:\n((?:[ \t]+.*\n?|\n)*)", doc, flags=re.MULTILINE)
    if section is None:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in section.group(1).splitlines():
        entry = re.match(r"^  (\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            entries[name] = entry.group(2).strip()
        elif name and line.startswith("   "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def field_docs(cls: type) -> dict[str, str]:
    """One line of documentation per field of ``cls``, from the nearest class on its MRO that documents
    it: a field's ``doc`` (`param`) or an entry of that class's ``Attributes:`` section."""
    out: dict[str, str] = {}
    for c in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(c):
            continue
        own = {f.name: f.metadata["doc"] for f in dataclasses.fields(c) if "doc" in f.metadata}
        out |= own | _attribute_docs(c)
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in out.items() if k in names}


def _args_section(cls: type, parameters: Sequence[inspect.Parameter]) -> str:
    docs, ranges = field_docs(cls), field_ranges(cls)
    lines = ["Args:"]
    for p in parameters:
        text = docs.get(p.name, "(undocumented)")
        valid = ranges.get(p.name)
        extra = f" Valid: {valid.text}." if valid is not None else ""
        default = "" if p.default is inspect.Parameter.empty else f" Default: {p.default!r}."
        lines.append(f"  {p.name}: {text}{extra}{default}")
    return "\n".join(lines)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def function(
    cls: type, method: str = "transform", *, name: str, positional: Sequence[str] | None = None
) -> Callable[..., optax.GradientTransformation]:
    """The public function ``name(*positional, **other_fields) -> cls(...).<method>()``.

    ``positional`` defaults to ``learning_rate`` (``inner`` for a `WrapperSpec`). Its signature
    lists every field of ``cls`` with its default and resolved type (``positional`` first, the rest
    keyword-only), which is what `optax.inject_hyperparams` reads; its docstring is the class's
    followed by an ``Args:`` section of every field (`field_docs`). Values out of their declared
    range raise a ValueError (`check_ranges`).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _type_hints(cls)
    if positional is None:
        positional = ("inner",) if issubclass(cls, WrapperSpec) else ("learning_rate",)

    def parameter(field: dataclasses.Field, kind: Any) -> inspect.Parameter:
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        return inspect.Parameter(field.name, kind, default=default, annotation=hints.get(field.name, field.type))

    parameters = [parameter(fields[n], inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in positional] + [
        parameter(f, inspect.Parameter.KEYWORD_ONLY) for n, f in fields.items() if n not in positional
    ]
    signature = inspect.Signature(parameters, return_annotation=optax.GradientTransformation)

    def build(*args: Any, **kwargs: Any) -> optax.GradientTransformation:
        obj = cls(**signature.bind(*args, **kwargs).arguments)
        check_ranges(obj)
        return getattr(obj, method)()

    build.__signature__ = signature  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = name
    build.__module__ = cls.__module__
    build.spec_class = cls  # type: ignore[attr-defined]
    build.__doc__ = f"{inspect.cleandoc(cls.__doc__ or '')}\n\n{_args_section(cls, parameters)}\n"
    return build
