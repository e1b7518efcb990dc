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

Layout: `QuantizedState` keeps the inner state with each quantized leaf replaced by a scalar zero
(a placeholder of its dtype), and the quantized nodes beside it (``quantized``, nested under the
leaf's key path), so no container of the inner state (``flax.nnx.Optimizer`` boxes every state leaf
in a variable) ever holds a pytree where an array was; `QuantizedState.view` puts the nodes back in
place for inspection.

Fused kernel (``kernel=``, ``fused=``): AdamW and Lion take their step on the codes directly
(`optim.quantize_state_fused`).

Under `optax.inject_hyperparams`, ``bits``, ``block_size`` and ``min_size`` set the stored arrays'
shapes and must be static (``static_args=STATIC_ARGS``) when given; their defaults are None, which
optax leaves out of the injected hyperparameters, so ``inject_hyperparams(quantize_state)(inner)`` works.

Memory per parameter of AdamW's two moments: 8 bytes in fp32; 2 + 2 * 4/256 = 2.03 in 8 bits;
1 + 4/128 + rank-1 maxima ~ 1.04 in 4 bits (`optim.memory.state_bytes` counts it exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, labels
from optim import quantization as qz
from optim.quantize_state_fused import Fused, fused_steps

NONNEGATIVE_FIELDS: tuple[str, ...] = ("nu", "nu_max", "v", "exp_avg_sq", "graft_nu")
DEFAULT_BLOCK = {8: 256, 4: 128}
STATIC_ARGS = ("bits", "block_size", "min_size")

__all__ = ["Fused", "QuantizedState", "STATIC_ARGS", "default_mask", "quantize_state"]  # Fused: re-exported


class QuantizedState(NamedTuple):
    """State of `quantize_state`."""

    count: jax.Array  # int32 steps taken; with the seed it keys stochastic rounding
    inner: Any  # the inner state, each quantized leaf replaced by a scalar zero of its dtype
    quantized: dict[str, Any]  # {index of the leaf among inner's leaves: {its key path: its node}}

    def view(self) -> Any:
        """The inner state with each quantized leaf's node (`BlockQuantized` / `Rank1Quantized`) in its place."""
        leaves, treedef = jax.tree.flatten(self.inner)
        for i, node in _nodes(self.quantized).items():
            leaves[i] = node
        return treedef.unflatten(leaves)


def _nodes(quantized: dict[str, Any]) -> dict[int, qz.Quantized]:
    return {int(i): jax.tree.leaves(tree, is_leaf=qz.is_quantized)[0] for i, tree in quantized.items()}


def _nest(names: tuple[str, ...], node: qz.Quantized) -> Any:
    """``node`` under nested dicts named by ``names`` (so state shardings follow the parameter's path)."""
    for name in reversed(names):
        node = {name: node}
    return node


def default_mask(params: Any, *, min_size: int = 4096) -> Any:
    """True for parameters of at least ``min_size`` elements that are not embedding tables."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.size >= min_size and not labels.is_embedding_path(path), params
    )


def quantize_state(
    inner: optax.GradientTransformation,
    bits: int | None = None,
    *,
    block_size: int | None = None,
    min_size: int | None = None,
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
      bits: 8 or 4; None: 8.
      block_size: elements per block, a power of two; 0 or None picks 256 for 8 bits and 128 for 4 bits.
      min_size: parameters with fewer elements keep fp32 state (default mask only); None: 4096.
      mask: ``params -> pytree of bool``, True where that parameter's state is quantized; overrides
        `default_mask` (and ``min_size``) entirely.
      nonnegative_fields: state keys that mark second moments.
      stochastic_rounding: round to a random neighbouring code with probability given by distance.
      seed: seed of the stochastic rounding.
      kernel: ``"auto"``, ``"xla"`` or ``"pallas"``: who takes the step on quantized leaves
        (`optim.quantize_state_fused`).
      fused: the description of ``inner`` the kernel needs; None (any other optimizer): XLA.
      param_specs: the parameters' `PartitionSpec` tree; under a mesh the kernel runs per shard.
      interpret: run the kernel in Pallas interpret mode (CPU tests).
    """
    bits = 8 if bits is None else common.static_int("bits", bits, STATIC_ARGS)
    if bits not in DEFAULT_BLOCK:
        raise ValueError(f"quantize_state: bits must be 8 or 4, got {bits}")
    block = common.static_int("block_size", 0 if block_size is None else block_size, STATIC_ARGS) or DEFAULT_BLOCK[bits]
    qz.check_block_size(block)
    min_size = 4096 if min_size is None else common.static_int("min_size", min_size, STATIC_ARGS)
    kernel_steps = fused_steps(
        fused, kernel=kernel, param_specs=param_specs, interpret=interpret, stochastic_rounding=stochastic_rounding
    )
    return _quantized(
        optax.with_extra_args_support(inner),
        codec=_Codec(bits, block, nonnegative_fields),
        mask=mask or (lambda p: default_mask(p, min_size=min_size)),
        seed=seed if stochastic_rounding else None,
        kernel_steps=kernel_steps,
    )


class _Codec(NamedTuple):
    """How a new state leaf is stored: its bits, block size, and which fields are second moments."""

    bits: int
    block: int
    nonnegative_fields: tuple[str, ...]

    def quantize(self, x: jax.Array, names: tuple[str, ...]) -> qz.Quantized:
        """A new node for ``x``, the state leaf at ``names`` (a second moment if a name says so)."""
        nonnegative = any(n in self.nonnegative_fields for n in names)
        if self.bits == 4 and nonnegative and x.ndim >= 2:
            return qz.quantize_rank1(x, bits=4, code="linear")
        code = ("linear" if self.bits == 4 else "unsigned") if nonnegative else "signed"
        return qz.quantize_blockwise(x, bits=self.bits, code=code, block_size=self.block)

    def requantize(self, node: qz.Quantized, x: jax.Array, key: jax.Array | None) -> qz.Quantized:
        """``x`` stored like ``node`` (same code, bits and layout)."""
        x = x.astype(node.dtype)
        if isinstance(node, qz.Rank1Quantized):
            return qz.quantize_rank1(x, bits=node.bits, code=node.code, key=key)
        return qz.quantize_blockwise(x, bits=node.bits, code=node.code, block_size=self.block, key=key)


def _quantized(
    inner: optax.GradientTransformationExtraArgs,
    *,
    codec: _Codec,
    mask: Callable[[Any], Any],
    seed: int | None,
    kernel_steps: Callable[..., Any],
) -> optax.GradientTransformationExtraArgs:
    """The generic wrapper: dequantize -> ``inner`` in fp32 -> requantize, ``kernel_steps`` taking over
    the parameters it fuses (`optim.quantize_state_fused.fused_steps`)."""

    def init_fn(params: optax.Params) -> QuantizedState:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        by_path = {
            labels.path_names(path): (tuple(p.shape), bool(w))
            for (path, p), w in zip(flat, treedef.flatten_up_to(mask(params)), strict=True)
        }

        def node_for(names: tuple[str, ...], leaf: jax.Array) -> qz.Quantized | None:
            if leaf.ndim == 0 or not jnp.issubdtype(leaf.dtype, jnp.floating):
                return None
            for start in range(len(names)):
                hit = by_path.get(names[start:])
                if hit is not None and hit[0] == leaf.shape:
                    return codec.quantize(leaf, names[:start]) if hit[1] else None
            return None

        if common.is_placeholder(params):  # `optax.tree.map_params`: no shapes, nothing to quantize
            return QuantizedState(jnp.zeros([], jnp.int32), inner.init(params), common.ShapesUnknown())
        state = jax.lax.optimization_barrier(inner.init(params))
        leaves, state_def = jax.tree_util.tree_flatten_with_path(state)
        stored, quantized = [], {}
        for i, (path, leaf) in enumerate(leaves):
            names = labels.path_names(path)
            node = node_for(names, leaf)
            stored.append(leaf if node is None else jnp.zeros((), leaf.dtype))
            if node is not None:
                quantized[str(i)] = _nest(names, node)
        return QuantizedState(jnp.zeros([], jnp.int32), state_def.unflatten(stored), quantized)

    def update_fn(updates, state: QuantizedState, params=None, **extra_args):
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(state.inner)
        nodes = _nodes(state.quantized)
        key = None if seed is None else jax.random.fold_in(jax.random.key(seed), state.count)
        node_key = lambda i: None if key is None else jax.random.fold_in(key, i)  # noqa: E731
        named = {i: (labels.path_names(with_paths[i][0]), node) for i, node in nodes.items()}
        fused = kernel_steps(updates, state.count, params, named, node_key)
        fused_nodes = {i: node for _, new in fused.values() for i, node in new.items()}
        # The kernel's leaves enter ``inner`` as zeros: their fp32 work there is dead code under jit.
        inner_state = treedef.unflatten([
            jnp.zeros(nodes[i].shape, nodes[i].dtype) if i in fused_nodes else qz.dequantize(nodes[i]) if i in nodes else x
            for i, (_, x) in enumerate(with_paths)
        ])
        new_updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
        new_leaves = treedef.flatten_up_to(new_inner)
        new_nodes = {
            i: fused_nodes[i] if i in fused_nodes else codec.requantize(node, new_leaves[i], node_key(i))
            for i, node in nodes.items()
        }
        stored = [with_paths[i][1] if i in nodes else x for i, x in enumerate(new_leaves)]
        quantized = {
            i: jax.tree.map(lambda _, new=new_nodes[int(i)]: new, tree, is_leaf=qz.is_quantized)
            for i, tree in state.quantized.items()
        }
        if fused:
            flat, update_def = jax.tree_util.tree_flatten(new_updates)
            new_updates = update_def.unflatten([fused[j][0] if j in fused else u for j, u in enumerate(flat)])
        return new_updates, QuantizedState(optax.safe_increment(state.count), treedef.unflatten(stored), quantized)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
