"""Hyperparameter ranges are declared once, beside each field's default (`optim.spec.param`), and a
value outside its range is refused when the spec is made, with one line naming the argument, its
value and the valid range, for every registered optimizer (through its class, its public function
and its config block alike)."""

import dataclasses
import math

import jax.numpy as jnp
import optax
import pytest

from experiments.configs import default
from optim import build, registry, spec
from optim.adamw import adamw
from optim.cautious import cautious

NAMES = sorted(registry.OPTIMIZERS)


def make(cls, **fields):
    if issubclass(cls, spec.WrapperSpec):
        return cls(inner=optax.sgd(0.1), **fields)
    return cls(**fields)


def outside(interval: spec.Interval) -> list[float]:
    """Values just outside ``interval`` on each finite side."""
    values = []
    if not math.isinf(interval.low):
        values.append(interval.low - (1 if interval.low_closed else 0))
    if not math.isinf(interval.high):
        values.append(interval.high + (1 if interval.high_closed else 0))
    return values


@pytest.mark.parametrize("name", NAMES)
def test_every_numeric_hyperparameter_declares_a_range_that_holds_its_default(name):
    cls = registry.OPTIMIZERS[name]
    ranges = spec.field_ranges(cls)
    for key, value in spec.config_defaults(cls).items():
        if isinstance(value, bool) or not isinstance(value, int | float) or key == "seed":
            continue
        assert key in ranges, f"{name}.{key} declares no valid range"
        assert value in ranges[key], f"{name}.{key}={value} lies outside its own range {ranges[key].text}"
    if issubclass(cls, spec.OptimizerSpec):
        assert "learning_rate" in ranges


@pytest.mark.parametrize("name", NAMES)
def test_values_outside_the_range_are_refused_in_one_line(name):
    cls = registry.OPTIMIZERS[name]
    checked = 0
    for key, interval in spec.field_ranges(cls).items():
        for bad in outside(interval):
            bad = int(bad) if isinstance(spec.defaults(cls)[key], int) else float(bad)
            with pytest.raises(ValueError, match=rf"^{key}={bad!r} must be ") as error:
                make(cls, **{key: bad})
            assert "\n" not in str(error.value)
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize(
    ("name", "key", "value", "message"),
    [  # the reproductions of issue 34, item 11
        ("adamw", "b2", 1.0, r"b2=1.0 must be in \[0, 1\)"),
        ("normuon", "beta2", 1.5, r"beta2=1.5 must be in \[0, 1\)"),
        ("came", "b2", 1.5, r"b2=1.5 must be in \[0, 1\)"),
        ("soap", "b2", 1.5, r"b2=1.5 must be in \[0, 1\)"),
        ("mars_muon", "beta", 1.0, r"beta=1.0 must be in \[0, 1\)"),
        ("came", "clip_threshold", 0.0, r"clip_threshold=0.0 must be > 0"),
        ("shampoo", "precondition_every", 0, r"precondition_every=0 must be >= 1"),
        ("adamw", "learning_rate", -1e-3, r"learning_rate=-0.001 must be >= 0"),
        ("muon", "learning_rate", -1e-3, r"learning_rate=-0.001 must be >= 0"),
    ],
)
def test_the_issue_s_bad_values_name_argument_value_and_range(name, key, value, message):
    cls = registry.OPTIMIZERS[name]
    with pytest.raises(ValueError, match=message):
        make(cls, **{key: value})
    module = __import__(cls.__module__, fromlist=[name])
    with pytest.raises(ValueError, match=message):  # the public function
        getattr(module, name)(**{key: value})
    config = default.optimizer_config(name)
    config.warmup_steps = 0
    if key == "learning_rate":
        config.learning_rate = value
    else:
        config[name][key] = value
    with pytest.raises(ValueError, match=message):  # the config block, as training builds it
        build.build(config, 10)


def test_cautious_refuses_a_zero_eps():
    with pytest.raises(ValueError, match="eps=0 must be > 0"):
        cautious(optax.sgd(0.1), eps=0)


def test_schedules_and_injected_arrays_are_not_range_checked():
    make(registry.OPTIMIZERS["adamw"], learning_rate=optax.constant_schedule(1e-3))
    injected = optax.inject_hyperparams(adamw)(learning_rate=1e-3, b2=0.95)
    injected.init({"w": jnp.ones((2, 2))})


def test_interval_notation():
    interval = spec.Interval.parse("(0, 1]")
    assert 1.0 in interval and 0.5 in interval and 0.0 not in interval
    assert dataclasses.astuple(spec.Interval.parse("[1, inf)"))[1:] == (1.0, math.inf, True, False)
    with pytest.raises(ValueError, match="not an interval"):
        spec.Interval.parse("0..1")


@pytest.mark.parametrize("name", NAMES)
def test_declared_capabilities_match_the_fields(name):
    """What a spec declares (`optim.spec.Spec`) is what its fields and methods can honour."""
    cls = registry.OPTIMIZERS[name]
    fields = spec.defaults(cls)
    assert cls.replica_local == ("axis_name" in fields)
    assert cls.applies_weight_decay == ("weight_decay" in fields)
    assert not cls.applies_cautious or "cautious" in fields
    assert set(cls.static_args) <= set(fields)
    optimizer = make(cls)
    assert optimizer.for_replicas("data") == (dataclasses.replace(optimizer, axis_name="data") if cls.replica_local else optimizer)
