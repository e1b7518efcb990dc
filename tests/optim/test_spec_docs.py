"""Every public optimizer function generated from a spec (`optim.spec.function`) shows a resolved
signature and documents every parameter in an ``Args:`` section gathered from the spec's MRO."""

import importlib
import inspect
import pkgutil

import pytest

import optim
from optim import registry, spec


def public_functions():
    found = {}
    for info in pkgutil.walk_packages(optim.__path__, "optim."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if callable(value) and hasattr(value, "spec_class") and value.__module__ == info.name and not name.startswith("_"):
                found[f"{info.name}.{name}"] = value
    return found


FUNCTIONS = public_functions()


def test_every_registered_optimizer_has_a_generated_public_function():
    assert {f.spec_class for f in FUNCTIONS.values()} >= set(registry.OPTIMIZERS.values())


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_parameter_is_documented_once_with_a_resolved_type(name):
    function = FUNCTIONS[name]
    parameters = inspect.signature(function).parameters
    args = function.__doc__.split("\nArgs:\n", 1)[1]
    documented = [line.split(":", 1)[0].strip() for line in args.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert documented == list(parameters)
    assert "(undocumented)" not in args
    for p in parameters.values():
        assert not isinstance(p.annotation, str), f"{name}({p.name}: {p.annotation!r}) is an unresolved annotation"


def test_a_field_is_documented_where_it_is_declared():
    from optim.muon import muon

    docs = spec.field_docs(muon.spec_class)
    assert docs["ns_steps"].startswith("Newton-Schulz steps")  # optim.muon.NewtonSchulz
    assert docs["adam_b1"] == "AdamW's first-moment decay."  # optim.common.AdamGroup
    assert docs["learning_rate"].startswith("a float or an optax schedule")  # optim.spec.OptimizerSpec
    assert "Valid: [0, 1). Default: 0.95." in muon.__doc__.split("  beta:", 1)[1].splitlines()[0]
