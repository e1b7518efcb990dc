"""Builds optimizers by name from the ``optimizer`` config block.

The config block has common keys (``name``, ``learning_rate``, ``schedule``, ``warmup_steps``,
``min_lr_ratio``, ``decay_fraction``, ``weight_decay``, ``grad_clip_norm``, ``cautious``,
``state_bits``) and one sub-block per registered optimizer holding its family-specific keys, e.g.
``optimizer.sgd.momentum``. Those sub-blocks are generated from each optimizer function's keyword
defaults (`family_defaults`), so adding an optimizer is one line in `OPTIMIZERS` and its keys appear
in the config by themselves.

Every registered function has the signature ``fn(learning_rate, *, weight_decay=..., **family)``
and returns an `optax.GradientTransformation` (or ``...ExtraArgs``). A function that also takes
``cautious`` gets the common key as a keyword and applies the mask itself (MuonClip masks Muon's
update but not its QK-clip rescale); every other optimizer is wrapped whole.

*Wrappers* have the signature ``fn(inner, **family)``: ``optimizer.<name>.inner`` names another
registered optimizer, built from its own block and the common keys and handed over as ``inner``
(DiLoCo, PowerSGD). In a replica-local run (``build(..., replica_axis=...)``) an optimizer that
takes ``axis_name`` gets the replica axis and does its own collectives (DeMo, DiLoCo, PowerSGD);
any other gets the replica mean of the gradients first (data parallelism).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import optax

from optim import labels, schedules
from optim import cross_replica, demo, diloco, powersgd
from optim.came import came
from optim.cautious import cautious
from optim.lion import lion
from optim.mars_muon import mars_muon
from optim.muon import muon
from optim.muon_clip import muon_clip
from optim.normuon import normuon
from optim.quantize_state import quantize_state
from optim.shampoo import shampoo
from optim.soap import soap


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter, arXiv:1711.05101) with decay on leaves of two or more axes."""
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=labels.decay_mask)


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """SGD with heavy-ball or Nesterov momentum and decoupled weight decay (leaves of >= 2 axes)."""
    return optax.chain(
        optax.trace(decay=momentum, nesterov=nesterov) if momentum else optax.identity(),
        optax.add_decayed_weights(weight_decay, mask=labels.decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


OPTIMIZERS: dict[str, Callable[..., Any]] = {
    "adamw": adamw,
    "sgd": sgd,
    "muon": muon,
    "normuon": normuon,
    "muon_clip": muon_clip,
    "mars_muon": mars_muon,
    "lion": lion,
    "came": came,
    "shampoo": shampoo,
    "soap": soap,
    "demo": demo.demo,
    "diloco": diloco.diloco,
    "streaming_diloco": diloco.streaming_diloco,
    "powersgd": powersgd.powersgd,
}

# A parameter-layout check per optimizer: fn(family config, abstract params, param shardings, replica axis).
LAYOUT_CHECKS: dict[str, Callable[..., None]] = {
    "demo": lambda family, params, shardings, axis: demo.check_chunk_layout(
        params, shardings, int(family.get("chunk", 64)), replica_axis=axis
    ),
}

# Optimizers whose update takes the model's per-head max attention logits (``attn_max_logits``).
NEEDS_ATTN_LOGITS = frozenset({"muon_clip"})

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
)

_CONFIGURABLE = (bool, int, float, str)
# Common keys passed to an optimizer that takes them as keywords (rather than applied around it).
ROUTED_KEYS = ("weight_decay", "cautious")


def is_wrapper(name: str) -> bool:
    """Whether optimizer ``name`` wraps another one (its first parameter is ``inner``)."""
    return next(iter(inspect.signature(_lookup(name)).parameters)) == "inner"


def family_defaults(name: str) -> dict[str, Any]:
    """The family-specific keyword defaults of optimizer ``name`` (the keys of ``optimizer.<name>``)."""
    fn = _lookup(name)
    out = {"inner": "adamw"} if is_wrapper(name) else {}
    for param in inspect.signature(fn).parameters.values():
        if param.name in ("learning_rate", *ROUTED_KEYS) or param.kind is not param.KEYWORD_ONLY:
            continue
        if isinstance(param.default, _CONFIGURABLE):
            out[param.name] = param.default
    return out


def default_weight_decay(name: str) -> float:
    param = inspect.signature(_lookup(name)).parameters.get("weight_decay")
    return float(param.default) if param is not None else 0.0


def _lookup(name: str) -> Callable[..., Any]:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; set optimizer.name to one of {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]


def build(
    config: Mapping[str, Any], total_steps: int, *, replica_axis: str | None = None
) -> optax.GradientTransformation:
    """The optimizer described by an ``optimizer`` config block, for a run of ``total_steps``.

    The result is ``chain(clip_by_global_norm, <name>(schedule, ...))``; no clipping when
    ``grad_clip_norm`` is 0 or None. ``state_bits`` 8 or 4 wraps the optimizer in
    `optim.quantize_state.quantize_state` (0: fp32 state); ``cautious=True`` then wraps it in
    `optim.cautious.cautious` (its whole update, weight decay included), or is passed to optimizers
    that take a ``cautious`` keyword. The clip stays outside both:
    it scales the gradient by one positive factor, so the cautious sign mask is unchanged by it.
    A wrapper's ``inner`` gets ``state_bits`` and ``cautious`` instead of the wrapper.

    With ``replica_axis`` (the replica-local train step) optimizers that take ``axis_name`` receive
    it; any other is preceded by `optim.cross_replica.mean_over_replicas` (before the clip).
    """
    fn = _lookup(config["name"])
    params = inspect.signature(fn).parameters
    family = dict(config.get(config["name"], {}) or {})
    if is_wrapper(config["name"]):
        inner_name = family.pop("inner", "adamw")
        if is_wrapper(inner_name) or inner_name in NEEDS_ATTN_LOGITS:
            raise ValueError(f"optimizer.{config['name']}.inner={inner_name!r} cannot run inside {config['name']}; pick e.g. adamw")
        inner = build({**config, "name": inner_name, "grad_clip_norm": None}, total_steps)
        if "axis_name" in params:
            family["axis_name"] = replica_axis
        try:
            tx = fn(inner, **family)
        except TypeError as e:
            raise ValueError(f"optimizer {config['name']!r} rejected its config keys {sorted(family)}: {e}") from e
    else:
        tx = _build_single(fn, config, family, total_steps, replica_axis)
    clip = config.get("grad_clip_norm")
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(float(clip)), tx)
    if replica_axis and "axis_name" not in params:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    return tx


def _build_single(fn, config, family, total_steps, replica_axis):
    params = inspect.signature(fn).parameters
    schedule = learning_rate_fn(config, total_steps)
    weight_decay = config.get("weight_decay")  # None: the optimizer's own default
    if weight_decay is not None and "weight_decay" in params:
        family["weight_decay"] = float(weight_decay)
    cautious_inside = bool(config.get("cautious")) and "cautious" in params
    if cautious_inside:  # the optimizer masks only the part of its update that should be masked
        family["cautious"] = True
    if "axis_name" in params:
        family["axis_name"] = replica_axis
    try:
        tx = fn(schedule, **family)
    except TypeError as e:
        raise ValueError(f"optimizer {config['name']!r} rejected its config keys {sorted(family)}: {e}") from e
    state_bits = int(config.get("state_bits") or 0)
    if state_bits not in (0, 4, 8):
        raise ValueError(f"optimizer.state_bits={state_bits}: use 0 (fp32 state), 8 or 4")
    if state_bits:
        tx = quantize_state(tx, bits=state_bits)
    if config.get("cautious") and not cautious_inside:
        tx = cautious(tx)
    return tx


def check_layout(config: Mapping[str, Any], params: Any, shardings: Any, replica_axis: str | None = None) -> None:
    """Runs the layout check of the configured optimizer (or of a wrapper's inner one), if it has one."""
    name = config["name"]
    if is_wrapper(name):
        name = (config.get(name) or {}).get("inner", "adamw")
    if name in LAYOUT_CHECKS:
        LAYOUT_CHECKS[name](config.get(name) or {}, params, shardings, replica_axis)


def learning_rate_fn(config: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """The schedule `build` uses, for logging the learning rate."""
    return schedules.make_schedule(
        config.get("schedule", "cosine"),
        float(config["learning_rate"]),
        total_steps,
        warmup_steps=int(config.get("warmup_steps", 0)),
        min_lr_ratio=float(config.get("min_lr_ratio", 0.1)),
        decay_fraction=float(config.get("decay_fraction", 0.2)),
    )
