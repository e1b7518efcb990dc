"""Rematerialisation policies: which activations of a transformer block the backward pass keeps.

Without remat, autodiff keeps every intermediate the backward pass reads. Under ``scan_layers`` each
of them becomes a per-layer stacked buffer that the forward loop writes and the backward loop reads,
so elementwise intermediates that an unrolled XLA program would fuse away cost memory and bandwidth
there. The cheapest of them are never kept, whatever the policy: RMSNorm's float32 work, SwiGLU's
``silu(gate) * up`` and the loss's float32 softmax recompute from their inputs (`lm.layers.rms_norm`,
`lm.layers.swiglu_gate`, `lm.loss.cross_entropy`). A policy keeps only some of the rest and recomputes
the others from the block's input in the backward pass (Chen et al., "Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174; `jax.checkpoint` policies):

- ``none``: no remat, everything is kept.
- ``full``: only the block's input is kept; the whole block runs again in the backward pass.
- ``dots_saveable``: every matmul output, attention scores included.
- ``dots_with_no_batch_dims_saveable``: the outputs of matmuls against weights (the projections and
  the MLP), not attention's score and value products; norms, RoPE, SwiGLU and attention recompute.
- ``save_attention``: attention's inputs (q, k, v after RoPE) and output, and the softmax statistics
  (the XLA attention's log-sum-exp, the outputs of fused attention kernels), so attention's forward
  pass never runs again; the rest recomputes.
- ``dots_and_attention``: ``dots_with_no_batch_dims_saveable`` plus ``save_attention``: only
  elementwise work (norms, RoPE, SwiGLU's gate) recomputes.

The model marks the attention values with `checkpoint_name` and the names below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from kernels_pallas.attention import reference

ATTN_Q, ATTN_K, ATTN_V, ATTN_CONTEXT = "attn_q", "attn_k", "attn_v", "attn_context"
# With the XLA attention, also its backward pass's own residuals (its output and log-sum-exp).
ATTENTION_NAMES = (ATTN_Q, ATTN_K, ATTN_V, ATTN_CONTEXT, reference.RESIDUAL_NAME)

# Forward primitives of fused attention kernels whose outputs (context and softmax statistics) are
# their backward pass's residuals: cuDNN's through `jax.nn.dot_product_attention`, and Pallas calls.
_FUSED_ATTENTION_PRIMITIVES = ("dot_product_attention_fwd", "pallas_call")


@dataclasses.dataclass(frozen=True)
class _SaveAttention:
    """Saves the named attention values and the outputs of fused attention kernels."""

    def __call__(self, prim, *_, **params) -> bool:
        if prim.name == "name":
            return params["name"] in ATTENTION_NAMES
        return prim.name.startswith(_FUSED_ATTENTION_PRIMITIVES)


_dots_no_batch = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

POLICIES: dict[str, Callable[..., bool] | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": _dots_no_batch,
    "save_attention": _SaveAttention(),
    "dots_and_attention": jax.checkpoint_policies.save_from_both_policies(_dots_no_batch, _SaveAttention()),
}
NAMES = ("none", *POLICIES)
_ALIASES = {True: "full", False: "none", "true": "full", "false": "none"}


def canonical(remat: str | bool) -> str:
    """The policy name for ``remat``: a name in `NAMES`, or a bool (True is ``full``)."""
    key = remat.lower() if isinstance(remat, str) else remat
    name = _ALIASES.get(key, key)
    if name not in NAMES:
        raise ValueError(f"model.remat={remat!r} must be one of {', '.join(NAMES)} (true: full, false: none)")
    return name
