"""`quantize_state`: keep any optimizer's state in 8 or 4 bits between steps.

Each step: dequantize the stored state -> run the inner transform in fp32 -> quantize the new state.

    8-bit (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861):
        every quantized leaf: blocks of ``block_size = 256`` elements, one fp32 absmax per block,
        the signed dynamic code, or the unsigned one for non-negative (second-moment) leaves.
    4-bit (Li et al., "Memory Efficient Optimizers with 4-bit States", arXiv:2309.01507; reference
    thu-ml/low-bit-optimizers ``lpmm/configs/default.yml``):
        first moments: blocks of ``block_size = 128``, the signed dynamic-exponent code;
        second moments: rank-1 (row and column maxima) normalisation per matrix and the zero-free
        linear code ``(i + 1) / 16``; 1-D second moments use blocks of 128 with the linear code.

Rounding is to the nearest code, or stochastic (``stochastic_rounding=True``, keyed by ``seed`` and
the step). Codes, tiles and the sharding of the stored arrays: `optim.quantization`.

Which leaves are quantized: a floating-point state leaf whose key path ends with a parameter's path
and which has that parameter's shape (Adam's ``mu``/``nu``, Lion's ``mu``, Muon's momentum, ...),
when ``mask(params)`` is True for that parameter. The default mask, `default_mask`, keeps
parameters under ``min_size = 4096`` elements and embedding tables (`optim.labels.is_embedding_path`)
in fp32, as the 8-bit paper does for stability. Counters, scalars and leaves of other shapes
(factored statistics, preconditioners) stay as they are. A leaf is a second moment (non-negative:
unsigned / rank-1 + linear code) when a key of the state path before the parameter's path is one of
``nonnegative_fields`` (optax's and SOAP's ``nu``, CAME's ``v``, Shampoo's ``graft_nu``, PyTorch's
``exp_avg_sq``); a field that goes negative must not be listed there, as the unsigned codes clamp
negatives to their smallest entry.

Sharding: each stored array keeps the parameter's rank; `sharding.partition.state_shardings` gives every
piece the parameter's mesh axes (a state-sharding rule that only matches parameter-shaped leaves would
replicate the scales and the 4-bit codes). The initial state is quantized behind an optimization
barrier, so XLA does not constant-fold the quantization of all-zero moments (seconds of compile time).

Fused kernel (``kernel=``): when ``fused`` says what ``inner`` is (`Fused`: AdamW or Lion, its
learning rate and decay mask; `optim.build` passes it), every parameter whose moments are all
quantized takes its step in one Pallas kernel (`kernels_pallas.quantized_update`): codes and scales
in, update and new codes and scales out, no fp32 moment in device memory. ``inner`` still runs for
everything else (its counters, unquantized leaves); its work on the kernel's leaves is dead code
that XLA removes under ``jit``. The stored state is the same either way, so checkpoints move between
the two. ``"auto"`` takes the kernel on GPUs when ``fused`` is given and either no multi-device mesh is in
context or ``param_specs`` says how the parameters are split (`experiments.run_spec` passes the specs
its logical rules give, so FSDP / TP runs keep the kernel: it runs per shard in `jax.shard_map`
over the mesh axes left automatic), XLA otherwise; ``"pallas"`` forces it (``interpret=True`` on a
CPU); ``"xla"`` never uses it.

Memory per parameter of AdamW's two moments: 8 bytes in fp32; 2 + 2 * 4/256 = 2.03 in 8 bits;
1 + 4/128 + rank-1 maxima ~ 1.04 in 4 bits (`optim.memory.state_bytes` counts it exactly).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import kernels_pallas.quantized_update as qu
from optim import labels
from optim import quantization as qz

NONNEGATIVE_FIELDS: tuple[str, ...] = ("nu", "nu_max", "v", "exp_avg_sq", "graft_nu")
DEFAULT_BLOCK = {8: 256, 4: 128}
KERNELS = ("auto", "xla", "pallas")


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


class QuantizedState(NamedTuple):
    """State of `quantize_state`."""

    count: jax.Array  # int32 steps taken; with the seed it keys stochastic rounding
    inner: Any  # the inner state, each quantized leaf a `BlockQuantized` / `Rank1Quantized` node


def default_mask(params: Any, *, min_size: int = 4096) -> Any:
    """True for parameters of at least ``min_size`` elements that are not embedding tables."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.size >= min_size and not labels.is_embedding_path(path), params
    )


def quantize_state(
    inner: optax.GradientTransformation,
    bits: int = 8,
    *,
    block_size: int = 0,
    min_size: int = 4096,
    mask: Callable[[Any], Any] | None = None,
    nonnegative_fields: tuple[str, ...] = NONNEGATIVE_FIELDS,
    stochastic_rounding: bool = False,
    seed: int = 0,
    kernel: str = "auto",
    fused: Fused | None = None,
    param_specs: Any = None,
    interpret: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that its parameter-shaped float state is stored in ``bits`` bits.

    Args:
      inner: any transform (a full optimizer or a ``scale_by_*``); it runs on the dequantized state.
      bits: 8 or 4.
      block_size: elements per block, a power of two; 0 picks 256 for 8 bits and 128 for 4 bits.
      min_size: parameters with fewer elements keep fp32 state (default mask only).
      mask: ``params -> pytree of bool``, True where that parameter's state is quantized; overrides
        `default_mask` (and ``min_size``) entirely.
      nonnegative_fields: state keys that mark second moments.
      stochastic_rounding: round to a random neighbouring code with probability given by distance.
      seed: seed of the stochastic rounding.
      kernel: ``"auto"``, ``"xla"`` or ``"pallas"``: who takes the step on quantized leaves (module
        docstring).
      fused: the description of ``inner`` the kernel needs; None (any other optimizer): XLA.
      param_specs: the parameters' `PartitionSpec` tree; under a mesh the kernel runs per shard.
      interpret: run the kernel in Pallas interpret mode (CPU tests).
    """
    if bits not in DEFAULT_BLOCK:
        raise ValueError(f"quantize_state: bits must be 8 or 4, got {bits}")
    block = block_size or DEFAULT_BLOCK[bits]
    qz.check_block_size(block)
    if kernel not in KERNELS:
        raise ValueError(f"quantize_state: kernel={kernel!r}; use one of {', '.join(KERNELS)}")
    if kernel == "pallas" and fused is None:
        raise ValueError("quantize_state: kernel='pallas' needs fused= (AdamW or Lion); use kernel='auto' to fall back to XLA")
    inner = optax.with_extra_args_support(inner)

    def quantize_new(x: jax.Array, nonnegative: bool) -> qz.Quantized:
        if bits == 4 and nonnegative and x.ndim >= 2:
            return qz.quantize_rank1(x, bits=4, code="linear")
        code = ("linear" if bits == 4 else "unsigned") if nonnegative else "signed"
        return qz.quantize_blockwise(x, bits=bits, code=code, block_size=block)

    def requantize(node: qz.Quantized, x: jax.Array, key: jax.Array | None) -> qz.Quantized:
        x = x.astype(node.dtype)
        if isinstance(node, qz.Rank1Quantized):
            return qz.quantize_rank1(x, bits=node.bits, code=node.code, key=key)
        return qz.quantize_blockwise(x, bits=node.bits, code=node.code, block_size=block, key=key)

    def init_fn(params: optax.Params) -> QuantizedState:
        wanted = (mask or (lambda p: default_mask(p, min_size=min_size)))(params)
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        by_path = {
            labels.path_names(path): (tuple(p.shape), bool(w))
            for (path, p), w in zip(flat, treedef.flatten_up_to(wanted), strict=True)
        }

        def convert(path, leaf):
            if leaf.ndim == 0 or not jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf
            names = labels.path_names(path)
            for start in range(len(names)):
                hit = by_path.get(names[start:])
                if hit is not None and hit[0] == leaf.shape:
                    return quantize_new(leaf, any(n in nonnegative_fields for n in names[:start])) if hit[1] else leaf
            return leaf

        return QuantizedState(
            count=jnp.zeros([], jnp.int32),
            inner=jax.tree_util.tree_map_with_path(convert, jax.lax.optimization_barrier(inner.init(params))),
        )

    def use_kernel() -> bool:
        if fused is None or kernel == "xla":
            return False
        if kernel == "pallas":
            return True
        return qu.available() and (param_specs is not None or jax.sharding.get_abstract_mesh().size <= 1)

    def update_fn(updates, state: QuantizedState, params=None, **extra_args):
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(state.inner, is_leaf=qz.is_quantized)
        nodes = [n for _, n in with_paths]
        key = jax.random.fold_in(jax.random.key(seed), state.count) if stochastic_rounding else None
        node_key = lambda i: None if key is None else jax.random.fold_in(key, i)  # noqa: E731
        fused_steps = {}
        if use_kernel():
            if params is None:
                raise ValueError("quantize_state with a fused kernel needs params in update(grads, state, params)")
            fused_steps = fused_kernel_steps(updates, state.count, params, with_paths, node_key)
        fused_nodes = {i: node for _, new in fused_steps.values() for i, node in new.items()}
        # The kernel's leaves enter ``inner`` as zeros: their fp32 work there is dead code under jit.
        inner_state = treedef.unflatten([
            jnp.zeros(n.shape, n.dtype) if i in fused_nodes else qz.dequantize(n) if qz.is_quantized(n) else n
            for i, n in enumerate(nodes)
        ])
        new_updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
        stored = [
            fused_nodes[i] if i in fused_nodes else requantize(n, x, node_key(i)) if qz.is_quantized(n) else x
            for i, (n, x) in enumerate(zip(nodes, treedef.flatten_up_to(new_inner), strict=True))
        ]
        if fused_steps:
            flat, update_def = jax.tree_util.tree_flatten(new_updates)
            flat = [fused_steps[j][0] if j in fused_steps else u for j, u in enumerate(flat)]
            new_updates = update_def.unflatten(flat)
        return new_updates, QuantizedState(count=optax.safe_increment(state.count), inner=treedef.unflatten(stored))

    def fused_kernel_steps(grads, count, params, with_paths, node_key):
        """``{param index: (update, {node index: new node})}`` for parameters whose moments are all quantized."""
        flat_params, param_def = jax.tree_util.tree_flatten_with_path(params)
        by_path = {labels.path_names(path): j for j, (path, _) in enumerate(flat_params)}
        moments: dict[int, dict[str, int]] = {}
        for i, (path, node) in enumerate(with_paths):
            if not qz.is_quantized(node):
                continue
            names = labels.path_names(path)
            for start in range(1, len(names)):
                j = by_path.get(names[start:])
                if j is not None and tuple(flat_params[j][1].shape) == tuple(node.shape):
                    moments.setdefault(j, {})[names[start - 1]] = i
                    break
        decay = param_def.flatten_up_to(fused.decay_mask(params))
        grads_flat = param_def.flatten_up_to(grads)
        specs = None if param_specs is None else param_def.flatten_up_to(param_specs)
        lr = fused.learning_rate(count) if callable(fused.learning_rate) else fused.learning_rate
        steps = {}
        for j, fields in moments.items():
            if not set(fused.rule.moments) <= set(fields):
                continue
            index = [fields[name] for name in fused.rule.moments]
            node_list = [with_paths[i][1] for i in index]
            rule = fused.rule if decay[j] else dataclasses.replace(fused.rule, weight_decay=0.0)
            layouts = [_layout(n) for n in node_list]
            noise = None
            if stochastic_rounding:
                noise = [qu.rounding_noise(node_key(i), m, n.shape) for i, m, n in zip(index, layouts, node_list)]
            update, new = qu.quantized_update(
                rule,
                flat_params[j][1],
                grads_flat[j],
                [_arrays(n) for n in node_list],
                layouts,
                rule.scalars(optax.safe_increment(count), lr),
                noise,
                interpret=interpret,
                spec=None if specs is None else specs[j],
            )
            steps[j] = (update, {i: _node_like(n, q) for i, n, q in zip(index, node_list, new)})
        return steps

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _layout(node: qz.Quantized) -> qu.Moment:
    table = tuple(float(v) for v in qz.code_table(node.code, node.bits))
    return qu.Moment(table, node.tile if isinstance(node, qz.BlockQuantized) else None)


def _arrays(node: qz.Quantized) -> tuple[jax.Array, ...]:
    return (node.codes, node.absmax) if isinstance(node, qz.BlockQuantized) else (node.codes, node.row, node.col)


def _node_like(node: qz.Quantized, arrays: tuple[jax.Array, ...]) -> qz.Quantized:
    if isinstance(node, qz.BlockQuantized):
        return dataclasses.replace(node, codes=arrays[0], absmax=arrays[1])
    return dataclasses.replace(node, codes=arrays[0], row=arrays[1], col=arrays[2])
