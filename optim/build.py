"""Builds an optimizer from the ``optimizer`` config block of an experiment.

The block has common keys (`COMMON_KEYS`: ``name``, ``learning_rate``, ``schedule``, ...) and one
sub-block per registered optimizer (`optim.registry`) with its family keys, e.g.
``optimizer.sgd.momentum`` (`optim.spec.config_defaults`). ``learning_rate`` and ``weight_decay`` left unset
(None) take the spec's defaults.

A wrapper (`optim.spec.WrapperSpec`: DiLoCo, Streaming DiLoCo, PowerSGD) names its inner optimizer
in ``optimizer.<wrapper>.inner``; it is built like a top-level optimizer from its own block and the
common keys (learning rate and schedule, weight decay, ``state_bits``, ``cautious``), and the clip
stays outside the wrapper. In a replica-local run (``replica_axis``) a `replica_local` spec gets the
replica axis and does its own collectives; any other optimizer gets the replica mean of the
gradients first (data parallelism). Everything else the builder needs to know of an optimizer its
spec declares (`optim.spec`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

import kernels_pallas.quantized_update as qu
from optim import cross_replica, quantize_state_fused, registry, run_wrappers, schedules, spec
from optim.cautious import cautious
from optim.quantize_state import quantize_state

COMMON_KEYS = (
    "name",
    "learning_rate",
    "schedule",
    "warmup_steps",
    "min_lr_ratio",
    "decay_fraction",
    "weight_decay",
    "grad_clip_norm",
    "cautious",
    "state_bits",
    "state_kernel",
    *run_wrappers.KEYS,
)


def inner_name(config: Mapping[str, Any]) -> str | None:
    """The registered name of a wrapper's inner optimizer (None when ``config`` names no wrapper)."""
    name = config["name"]
    cls = registry.spec_class(name)
    if not issubclass(cls, spec.WrapperSpec):
        return None
    inner = (config.get(name) or {}).get("inner") or cls.default_inner
    inner_cls = registry.OPTIMIZERS.get(inner)
    if inner_cls is None or issubclass(inner_cls, spec.WrapperSpec) or inner_cls.extra_args or inner_cls.replica_local:
        raise ValueError(
            f"optimizer.{name}.inner={inner!r} cannot run inside {name}; name a single-replica optimizer, e.g. adamw or sgd"
        )
    return inner


def make_spec(
    config: Mapping[str, Any], total_steps: int, *, replica_axis: str | None = None, param_specs: Any = None
) -> spec.Spec:
    """The spec an ``optimizer`` config block describes, for a run of ``total_steps``.

    A wrapper's ``inner`` becomes that optimizer's transform, built by `build` (with ``param_specs``).
    """
    name = config["name"]
    cls = registry.spec_class(name)
    family = dict(config.get(name, {}) or {})
    keys = spec.config_defaults(cls)
    unknown = sorted(set(family) - set(keys))
    if unknown:
        raise ValueError(f"optimizer.{name} has no key(s) {', '.join(unknown)}; its keys: {', '.join(sorted(keys))}")
    family.pop("inner", None)
    inner = inner_name(config)
    if inner is not None:
        off = dict.fromkeys(run_wrappers.KEYS)  # the run-level settings wrap the wrapper, not its inner optimizer
        inner_tx = build({**config, "name": inner, "grad_clip_norm": None, **off}, total_steps, param_specs=param_specs)
        optimizer = cls(inner=inner_tx, **family)
    else:
        weight_decay = config.get("weight_decay")  # None: the spec's own default
        if config.get("cautious_weight_decay") and cls.applies_weight_decay:  # it replaces the uniform decay
            if weight_decay:
                raise ValueError("optimizer.cautious_weight_decay replaces optimizer.weight_decay; leave that unset or 0")
            weight_decay = 0.0
        if weight_decay is not None:
            if not cls.applies_weight_decay:
                raise ValueError(f"optimizer {name!r} has no weight decay; leave optimizer.weight_decay unset")
            family["weight_decay"] = float(weight_decay)
        if config.get("cautious") and cls.applies_cautious:  # it masks only the part of its update that should be
            family["cautious"] = True
        optimizer = cls(learning_rate=learning_rate_fn(config, total_steps), **family)
    return optimizer.for_run(total_steps).for_replicas(replica_axis)


def build(
    config: Mapping[str, Any], total_steps: int, *, replica_axis: str | None = None, param_specs: Any = None
) -> optax.GradientTransformation:
    """The optimizer described by an ``optimizer`` config block, for a run of ``total_steps``.

    The result is ``chain(clip_by_global_norm, <spec>.transform())``; no clipping when
    ``grad_clip_norm`` is 0 or None. ``state_bits`` 8 or 4 wraps the optimizer in
    `optim.quantize_state.quantize_state` (0: fp32 state), its step taken by the fused kernel per
    ``state_kernel`` (auto, xla, pallas; pallas on a CPU runs in interpret mode, for tests) where the
    spec offers a `fused_update` (AdamW, Lion); ``cautious=True`` then wraps it in
    `optim.cautious.cautious` (its whole update, weight decay included), unless the spec
    `applies_cautious` itself. The clip stays outside both: it scales the gradient by one positive
    factor, so the cautious sign mask is unchanged by it. A wrapper's inner optimizer gets
    ``state_bits`` and ``cautious`` instead of the wrapper.

    ``cautious_weight_decay``, ``tail_average`` and ``lookahead`` wrap the result (`optim.run_wrappers`);
    ``cautious_weight_decay`` turns the optimizer's own decay off.

    With ``replica_axis`` (the replica-local train step) a `replica_local` spec receives it; any
    other optimizer is preceded by `optim.cross_replica.mean_over_replicas` (before the clip).

    ``param_specs`` (the parameters' mesh `PartitionSpec`s, from the logical rules; inside a replica
    in a replica-local run) lets the fused kernel run per shard under a mesh (`quantize_state`).
    """
    optimizer = make_spec(config, total_steps, replica_axis=replica_axis, param_specs=param_specs)
    return transform(optimizer, config, total_steps, replica_axis=replica_axis, param_specs=param_specs)


def transform(
    optimizer: spec.Spec,
    config: Mapping[str, Any],
    total_steps: int,
    *,
    replica_axis: str | None = None,
    param_specs: Any = None,
) -> optax.GradientTransformation:
    """``optimizer``'s transform (from `make_spec`) with the common keys of ``config`` applied around it and
    the run wrappers around that (see `build`)."""
    state_bits = int(config.get("state_bits") or 0)
    if state_bits not in (0, 4, 8):
        raise ValueError(f"optimizer.state_bits={state_bits}: use 0 (fp32 state), 8 or 4")
    kernel = config.get("state_kernel") or "auto"
    if kernel not in quantize_state_fused.KERNELS:  # checked with fp32 state too, where it does nothing
        raise ValueError(f"optimizer.state_kernel={kernel!r} must be one of {', '.join(quantize_state_fused.KERNELS)}")
    tx = optimizer.transform()
    if not isinstance(optimizer, spec.WrapperSpec):
        if state_bits:
            interpret = qu.api.platform() == "cpu"
            tx = quantize_state(
                tx, bits=state_bits, kernel=kernel, fused=optimizer.fused_update(), param_specs=param_specs, interpret=interpret
            )
        if config.get("cautious") and not optimizer.applies_cautious:
            tx = cautious(tx)
    clip = config.get("grad_clip_norm")
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(float(clip)), tx)
    if replica_axis and not optimizer.replica_local:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    if not run_wrappers.active(config):
        return tx
    return run_wrappers.apply(tx, config, learning_rate_fn(config, total_steps), peak_learning_rate(config))


def peak_learning_rate(config: Mapping[str, Any]) -> float:
    """``learning_rate``, or when None the spec's default (a wrapper's: its inner optimizer's), range-checked."""
    cls = registry.spec_class(inner_name(config) or config["name"])
    peak = config.get("learning_rate")
    if peak is None:
        peak = spec.defaults(cls)["learning_rate"]
    spec.check_value("learning_rate", peak, spec.field_ranges(cls)["learning_rate"])
    return float(peak)


# The settings of an optimizer block that shape its learning-rate schedule (`learning_rate_fn`), besides the run's length.
SCHEDULE_KEYS = ("learning_rate", "schedule", "warmup_steps", "min_lr_ratio", "decay_fraction")


def learning_rate_fn(config: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """The schedule `build` uses, for logging the learning rate: from `peak_learning_rate`, over
    ``warmup_steps`` or, when None, `schedules.default_warmup`."""
    return schedules.make_schedule(
        config.get("schedule", "cosine"),
        peak_learning_rate(config),
        total_steps,
        warmup_steps=int(warmup if (warmup := config.get("warmup_steps", 0)) is not None else schedules.default_warmup(total_steps)),
        min_lr_ratio=float(config.get("min_lr_ratio", schedules.DEFAULT_MIN_LR_RATIO)),
        decay_fraction=float(config.get("decay_fraction", schedules.DEFAULT_DECAY_FRACTION)),
    )
