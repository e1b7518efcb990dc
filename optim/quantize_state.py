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

Memory per parameter of AdamW's two moments: 8 bytes in fp32; 2 + 2 * 4/256 = 2.03 in 8 bits;
1 + 4/128 + rank-1 maxima ~ 1.04 in 4 bits (`optim.memory.state_bytes` counts it exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import labels
from optim import quantization as qz

NONNEGATIVE_FIELDS: tuple[str, ...] = ("nu", "nu_max", "v", "exp_avg_sq", "graft_nu")
DEFAULT_BLOCK = {8: 256, 4: 128}


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
    """
    if bits not in DEFAULT_BLOCK:
        raise ValueError(f"quantize_state: bits must be 8 or 4, got {bits}")
    block = block_size or DEFAULT_BLOCK[bits]
    qz.check_block_size(block)
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

    def update_fn(updates, state: QuantizedState, params=None, **extra_args):
        nodes, treedef = jax.tree.flatten(state.inner, is_leaf=qz.is_quantized)
        inner_state = treedef.unflatten([qz.dequantize(n) if qz.is_quantized(n) else n for n in nodes])
        updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
        key = jax.random.fold_in(jax.random.key(seed), state.count) if stochastic_rounding else None
        stored = [
            requantize(n, x, None if key is None else jax.random.fold_in(key, i)) if qz.is_quantized(n) else x
            for i, (n, x) in enumerate(zip(nodes, treedef.flatten_up_to(new_inner), strict=True))
        ]
        return updates, QuantizedState(count=optax.safe_increment(state.count), inner=treedef.unflatten(stored))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
