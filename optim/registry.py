"""Builds optimizers by name from the ``optimizer`` config block.

Each registered optimizer is a spec class (`optim.spec`): a frozen dataclass of its hyperparameters
with their defaults, which builds the optax transform. The config block has common keys (``name``,
``learning_rate``, ``schedule``, ``warmup_steps``, ``min_lr_ratio``, ``decay_fraction``,
``weight_decay``, ``grad_clip_norm``, ``cautious``, ``state_bits``, ``state_kernel``) and one sub-block per registered
optimizer with its family keys, e.g. ``optimizer.sgd.momentum``: the spec's fields other than the
common keys and the code-only fields (`family_defaults`). ``learning_rate`` and ``weight_decay`` left
unset (None) take the spec's defaults. Adding an optimizer is its file in `optim/` and one line in
`OPTIMIZERS`.

*Wrappers* (`optim.spec.WrapperSpec`: DiLoCo, Streaming DiLoCo, PowerSGD) name their inner optimizer
in ``optimizer.<wrapper>.inner``; it is built like a top-level optimizer from its own block and the
common keys (learning rate and schedule, weight decay, ``state_bits``, ``cautious``), and the clip
stays outside the wrapper. In a replica-local run (``build(..., replica_axis=...)``) an optimizer
built for replicas (a spec with an ``axis_name`` field: DeMo, DiLoCo, PowerSGD) gets the replica
axis and does its own collectives; any other gets the replica mean of the gradients first (data
parallelism).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optax

import kernels_pallas.quantized_update as qu
from optim import common, cross_replica, labels, schedules, spec
from optim.cautious import cautious
from optim.came import Came
from optim.demo import DeMo, check_chunk_layout
from optim.diloco import DiLoCo, StreamingDiLoCo
from optim.learned.mlp_lopt import LOpt
from optim.lion import Lion
from optim.mars_muon import MarsMuon
from optim.muon import Muon
from optim.muon_clip import MuonClip
from optim.normuon import NorMuon
from optim.powersgd import PowerSGD
from optim.quantize_state import Fused, quantize_state
from optim.shampoo import Shampoo
from optim.soap import Soap


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamW(spec.OptimizerSpec):
    """AdamW (Loshchilov & Hutter, arXiv:1711.05101) with decay on leaves of two or more axes."""

    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def transform(self) -> optax.GradientTransformation:
        return optax.adamw(
            self.learning_rate,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            mask=labels.decay_mask,
        )

    def fused_update(self) -> Fused:
        """This optimizer for `quantize_state`'s fused kernel."""
        return Fused(qu.AdamW(b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay), self.learning_rate)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SGD(common.DirectionOptimizer):
    """SGD with heavy-ball or Nesterov momentum and decoupled weight decay (leaves of >= 2 axes)."""

    learning_rate: optax.ScalarOrSchedule = 0.15  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False

    def direction(self) -> optax.GradientTransformation:
        if isinstance(self.momentum, int | float) and self.momentum == 0:  # not when injected (an array)
            return optax.identity()
        return optax.trace(decay=self.momentum, nesterov=self.nesterov)


adamw = spec.function(AdamW, name="adamw")
sgd = spec.function(SGD, name="sgd")

Spec = spec.OptimizerSpec | spec.WrapperSpec

OPTIMIZERS: dict[str, type[Spec]] = {
    "adamw": AdamW,
    "sgd": SGD,
    "muon": Muon,
    "normuon": NorMuon,
    "muon_clip": MuonClip,
    "mars_muon": MarsMuon,
    "lion": Lion,
    "came": Came,
    "shampoo": Shampoo,
    "soap": Soap,
    "demo": DeMo,
    "diloco": DiLoCo,
    "streaming_diloco": StreamingDiLoCo,
    "powersgd": PowerSGD,
    "lopt": LOpt,
}

# Optimizers whose update takes the model's per-head max attention logits (``attn_max_logits``).
NEEDS_ATTN_LOGITS = frozenset(name for name, cls in OPTIMIZERS.items() if "attn_max_logits" in cls.extra_args)
# Optimizers built for replicas (`optim.cross_replica`): their update does its own collectives.
CROSS_REPLICA = frozenset(name for name, cls in OPTIMIZERS.items() if "axis_name" in spec.defaults(cls))

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
)


def spec_class(name: str) -> type[Spec]:
    """The spec class registered as ``name``; a ValueError listing the names otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; set optimizer.name to one of {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]


def family_defaults(name: str) -> dict[str, Any]:
    """The family keys of optimizer ``name`` with their defaults (the keys of ``optimizer.<name>``)."""
    return spec.config_defaults(spec_class(name))


def is_wrapper(name: str) -> bool:
    return issubclass(spec_class(name), spec.WrapperSpec)


def inner_name(config: Mapping[str, Any]) -> str | None:
    """The registered name of a wrapper's inner optimizer (None when ``config`` is no wrapper)."""
    name = config["name"]
    if not is_wrapper(name):
        return None
    inner = (config.get(name) or {}).get("inner") or spec.defaults(spec_class(name))["inner"]
    if inner not in OPTIMIZERS or is_wrapper(inner) or inner in NEEDS_ATTN_LOGITS or inner in CROSS_REPLICA:
        raise ValueError(
            f"optimizer.{name}.inner={inner!r} cannot run inside {name}; name a single-replica optimizer, e.g. adamw or sgd"
        )
    return inner


def make_spec(
    config: Mapping[str, Any], total_steps: int, *, replica_axis: str | None = None, param_specs: Any = None
) -> Spec:
    """The spec an ``optimizer`` config block describes: family keys, common keys it takes, the schedule.

    A wrapper's ``inner`` becomes that optimizer's transform, built by `build` (with ``param_specs``);
    a spec built for replicas gets ``axis_name=replica_axis``.
    """
    name = config["name"]
    cls = spec_class(name)
    family = dict(config.get(name, {}) or {})
    keys = spec.config_defaults(cls)
    unknown = sorted(set(family) - set(keys))
    if unknown:
        raise ValueError(f"optimizer.{name} has no key(s) {', '.join(unknown)}; its keys: {', '.join(sorted(keys))}")
    fields = spec.defaults(cls)
    if "axis_name" in fields:
        family["axis_name"] = replica_axis
    if "num_steps" in fields and not family.get("num_steps"):  # a learned optimizer's time features
        family["num_steps"] = total_steps
    inner = inner_name(config)
    if inner is not None:
        family["inner"] = build({**config, "name": inner, "grad_clip_norm": None}, total_steps, param_specs=param_specs)
        return cls(**family)
    weight_decay = config.get("weight_decay")  # None: the spec's own default
    if weight_decay is not None:
        if "weight_decay" not in fields:
            raise ValueError(f"optimizer {name!r} has no weight decay; leave optimizer.weight_decay unset")
        family["weight_decay"] = float(weight_decay)
    if config.get("cautious") and "cautious" in fields:  # it masks only the part of its update that should be
        family["cautious"] = True
    return cls(learning_rate=learning_rate_fn(config, total_steps), **family)


def build(
    config: Mapping[str, Any], total_steps: int, *, replica_axis: str | None = None, param_specs: Any = None
) -> optax.GradientTransformation:
    """The optimizer described by an ``optimizer`` config block, for a run of ``total_steps``.

    The result is ``chain(clip_by_global_norm, <spec>.transform())``; no clipping when
    ``grad_clip_norm`` is 0 or None. ``state_bits`` 8 or 4 wraps the optimizer in
    `optim.quantize_state.quantize_state` (0: fp32 state), its step taken by the fused kernel per
    ``state_kernel`` (auto, xla, pallas; pallas on a CPU runs in interpret mode, for tests) where the
    spec has ``fused_update`` (AdamW, Lion); ``cautious=True`` then wraps it in
    `optim.cautious.cautious` (its whole update, weight decay included), or is passed to a spec with
    a ``cautious`` field. The clip stays outside both: it scales the gradient by one positive
    factor, so the cautious sign mask is unchanged by it. A wrapper's inner optimizer gets
    ``state_bits`` and ``cautious`` instead of the wrapper.

    With ``replica_axis`` (the replica-local train step) a spec built for replicas receives it; any
    other optimizer is preceded by `optim.cross_replica.mean_over_replicas` (before the clip).

    ``param_specs`` (the parameters' mesh `PartitionSpec`s, from the logical rules; inside a replica
    in a replica-local run) lets the fused kernel run per shard under a mesh (`quantize_state`).
    """
    state_bits = int(config.get("state_bits") or 0)
    if state_bits not in (0, 4, 8):
        raise ValueError(f"optimizer.state_bits={state_bits}: use 0 (fp32 state), 8 or 4")
    optimizer = make_spec(config, total_steps, replica_axis=replica_axis, param_specs=param_specs)
    tx = optimizer.transform()
    if not isinstance(optimizer, spec.WrapperSpec):
        if state_bits:
            kernel = config.get("state_kernel") or "auto"
            fused = optimizer.fused_update() if hasattr(optimizer, "fused_update") else None
            interpret = qu.api.platform() == "cpu"
            tx = quantize_state(tx, bits=state_bits, kernel=kernel, fused=fused, param_specs=param_specs, interpret=interpret)
        if config.get("cautious") and not hasattr(optimizer, "cautious"):
            tx = cautious(tx)
    clip = config.get("grad_clip_norm")
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(float(clip)), tx)
    if replica_axis and config["name"] not in CROSS_REPLICA:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    return tx


def check_layout(config: Mapping[str, Any], params: Any, shardings: Any, replica_axis: str | None = None) -> None:
    """Raises a ValueError naming the fix when the parameters' layout does not suit the optimizer.

    DeMo's DCT chunks must not straddle shards (`optim.demo.check_chunk_layout`).
    """
    if config["name"] == "demo":
        chunk = (config.get("demo") or {}).get("chunk", spec.defaults(DeMo)["chunk"])
        check_chunk_layout(params, shardings, int(chunk), replica_axis=replica_axis)


def learning_rate_fn(config: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """The schedule `build` uses, for logging the learning rate; peak ``learning_rate`` or the spec's default."""
    peak = config.get("learning_rate")
    if peak is None:  # a wrapper's learning rate is its inner optimizer's
        peak = spec.defaults(spec_class(inner_name(config) or config["name"]))["learning_rate"]
    return schedules.make_schedule(
        config.get("schedule", "cosine"),
        float(peak),
        total_steps,
        warmup_steps=int(config.get("warmup_steps", 0)),
        min_lr_ratio=float(config.get("min_lr_ratio", 0.1)),
        decay_fraction=float(config.get("decay_fraction", 0.2)),
    )
