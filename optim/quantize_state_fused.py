"""The fused-kernel path of `optim.quantize_state`: AdamW / Lion steps taken on quantized moments.

When `quantize_state` is told what its inner optimizer is (`Fused`: AdamW or Lion, its learning
rate and decay mask; `optim.build` passes it), every parameter whose moments are all quantized
takes its step in one Pallas kernel (`kernels_pallas.quantized_update`): codes and scales in, update
and new codes and scales out, no fp32 moment in device memory. The inner optimizer still runs for
everything else (its counters, unquantized leaves); its work on the kernel's leaves is dead code
that XLA removes under ``jit``. The stored state is the same either way, so checkpoints move between
the two.

Who takes the step (``kernel``): ``"auto"`` the kernel on GPUs when ``fused`` is given and either no
multi-device mesh is in context or ``param_specs`` says how the parameters are split (the kernel then
runs per shard in `jax.shard_map` over the mesh axes left automatic), XLA otherwise; ``"pallas"``
always (``interpret=True`` on a CPU); ``"xla"`` never.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

import kernels_pallas.quantized_update as qu
from optim import labels
from optim import quantization as qz

KERNELS = ("auto", "xla", "pallas")

# ``{index of a quantized leaf of the inner state: (its key-path names, its node)}``.
QuantizedLeaves = dict[int, tuple[tuple[str, ...], qz.Quantized]]
# ``{parameter index: (its update, {index of a quantized leaf: its new node})}``.
FusedSteps = dict[int, tuple[jax.Array, dict[int, qz.Quantized]]]


@dataclasses.dataclass(frozen=True)
class Fused:
    """What the fused kernel must know of an inner optimizer to take its step on quantized leaves.

    Attributes:
      rule: `kernels_pallas.quantized_update.AdamW` or ``.Lion`` with the inner optimizer's
        hyper-parameters, ``weight_decay`` included.
      learning_rate: the inner optimizer's learning rate or schedule (of the step count).
      decay_mask: ``params -> pytree of bool``, where weight decay applies.
    """

    rule: qu.AdamW | qu.Lion
    learning_rate: optax.ScalarOrSchedule
    decay_mask: Callable[[Any], Any] = labels.decay_mask


def check_kernel(kernel: str, fused: Fused | None) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"quantize_state: kernel={kernel!r}; use one of {', '.join(KERNELS)}")
    if kernel == "pallas" and fused is None:
        raise ValueError("quantize_state: kernel='pallas' needs fused= (AdamW or Lion); use kernel='auto' to fall back to XLA")


def fused_steps(
    fused: Fused | None,
    *,
    kernel: str,
    param_specs: Any,
    interpret: bool,
    stochastic_rounding: bool,
) -> Callable[..., FusedSteps]:
    """``steps(grads, count, params, quantized, node_key) -> FusedSteps`` (empty where XLA takes the step).

    ``quantized``: `QuantizedLeaves`; ``node_key(i)``: the stochastic-rounding key of leaf ``i``
    (None: round to nearest). A parameter takes the kernel's step when every moment its rule reads
    (``fused.rule.moments``, e.g. ``mu`` and ``nu``) is quantized.
    """
    check_kernel(kernel, fused)

    def use_kernel() -> bool:  # at trace time: the mesh in context decides "auto"
        if fused is None or kernel == "xla":
            return False
        if kernel == "pallas":
            return True
        return qu.available() and (param_specs is not None or jax.sharding.get_abstract_mesh().size <= 1)

    def steps(grads: Any, count: jax.Array, params: Any, quantized: QuantizedLeaves, node_key) -> FusedSteps:
        if not use_kernel():
            return {}
        if params is None:
            raise ValueError("quantize_state with a fused kernel needs params in update(grads, state, params)")
        flat_params, param_def = jax.tree_util.tree_flatten_with_path(params)
        decay = param_def.flatten_up_to(fused.decay_mask(params))
        grads_flat = param_def.flatten_up_to(grads)
        specs = None if param_specs is None else param_def.flatten_up_to(param_specs)
        lr = fused.learning_rate(count) if callable(fused.learning_rate) else fused.learning_rate
        out = {}
        for j, fields in _moments(flat_params, quantized).items():
            if not set(fused.rule.moments) <= set(fields):
                continue
            index = [fields[name] for name in fused.rule.moments]
            nodes = [quantized[i][1] for i in index]
            rule = fused.rule if decay[j] else dataclasses.replace(fused.rule, weight_decay=0.0)
            layouts = [_layout(n) for n in nodes]
            noise = None
            if stochastic_rounding:
                noise = [qu.rounding_noise(node_key(i), m, n.shape) for i, m, n in zip(index, layouts, nodes, strict=True)]
            update, new = qu.quantized_update(
                rule,
                flat_params[j][1],
                grads_flat[j],
                [_arrays(n) for n in nodes],
                layouts,
                rule.scalars(optax.safe_increment(count), lr),
                noise,
                interpret=interpret,
                spec=None if specs is None else specs[j],
            )
            out[j] = (update, {i: _node_like(n, q) for i, n, q in zip(index, nodes, new, strict=True)})
        return out

    return steps


def _moments(flat_params: list, quantized: QuantizedLeaves) -> dict[int, dict[str, int]]:
    """``{parameter index: {moment field name: quantized leaf index}}``: a leaf belongs to the
    parameter whose path ends its own and whose shape it has; the key before that path names it."""
    by_path = {labels.path_names(path): j for j, (path, _) in enumerate(flat_params)}
    moments: dict[int, dict[str, int]] = {}
    for i, (names, node) in quantized.items():
        for start in range(1, len(names)):
            j = by_path.get(names[start:])
            if j is not None and tuple(flat_params[j][1].shape) == tuple(node.shape):
                moments.setdefault(j, {})[names[start - 1]] = i
                break
    return moments


def _layout(node: qz.Quantized) -> qu.Moment:
    table = tuple(float(v) for v in qz.code_table(node.code, node.bits))
    return qu.Moment(table, node.tile if isinstance(node, qz.BlockQuantized) else None)


def _arrays(node: qz.Quantized) -> tuple[jax.Array, ...]:
    return (node.codes, node.absmax) if isinstance(node, qz.BlockQuantized) else (node.codes, node.row, node.col)


def _node_like(node: qz.Quantized, arrays: tuple[jax.Array, ...]) -> qz.Quantized:
    if isinstance(node, qz.BlockQuantized):
        return dataclasses.replace(node, codes=arrays[0], absmax=arrays[1])
    return dataclasses.replace(node, codes=arrays[0], row=arrays[1], col=arrays[2])
