"""`flash_attention`: the public entry point, one `custom_vjp` over every backend's kernels.

The backend follows the platform of the mesh in context (`jax.set_mesh`), else of
`jax.default_backend()`: ``triton`` on GPUs, ``mosaic_tpu`` on TPUs. On a CPU either backend runs in
interpret mode only (``interpret=True``), which is how the tests check them. The math, the recurrences and the
masking are in `base`; the definition of correct is `reference.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import backends, varying
from kernels_pallas.attention import base, mosaic_tpu, reference, triton
from kernels_pallas.attention.base import BlockSizes
from kernels_pallas.backends import platform

BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu}

__all__ = ["BACKENDS", "BlockSizes", "flash_attention", "platform"]


def _forward(q, k, v, segment_ids, backend: str, spec: base.Spec):
    return varying.call_opaque(lambda *a: BACKENDS[backend].forward(*a, spec), q, k, v, segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, segment_ids, backend: str, spec: base.Spec):
    out, row_max, _ = _forward(q, k, v, segment_ids, backend, spec)
    return out, row_max


def _flash_fwd(q, k, v, segment_ids, backend: str, spec: base.Spec):
    out, row_max, residuals = _forward(q, k, v, segment_ids, backend, spec)
    return (out, row_max), residuals


def _flash_bwd(backend: str, spec: base.Spec, residuals, cotangents):
    d_out, _ = cotangents  # the row maxima are a statistic (QK-clip's input): no gradient flows through them
    dq, dk, dv = varying.call_opaque(lambda r, d: BACKENDS[backend].backward(r, d, spec), residuals, d_out)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    segment_ids: jax.Array | None = None,
    return_max_logits: bool = False,
    block_sizes: BlockSizes | None = None,
    interpret: bool | object = False,
    backend: str | None = None,
):
    """Softmax attention without a ``T x T`` buffer in either direction (FlashAttention-2, arXiv:2307.08691).

    Same contract as `reference.attention`: q ``(batch, seq, heads, head_dim)``, k ``(batch, seq,
    kv_heads, head_dim)``, v ``(batch, seq, kv_heads, v_head_dim)`` (grouped-query attention reads
    each kv head for ``heads / kv_heads`` query heads without repeating it), logits and softmax
    statistics in float32 for float32, bfloat16 or float16 inputs.

    Args:
      causal: query ``i`` sees keys ``j <= i``.
      sm_scale: logit scale; default ``head_dim ** -0.5``.
      segment_ids: ``(batch, seq)`` int; queries see keys of their own segment only (packed documents).
      return_max_logits: also return the per-head maximum logit, ``(heads,)`` float32, from the
        kernel's row maxima (no extra pass); it carries no gradient.
      block_sizes: tile sizes; `None` fields take the backend's defaults.
      interpret: run the kernels in Pallas interpret mode (any platform, slow; for tests). The TPU
        backend also takes a `jax.experimental.pallas.tpu.InterpretParams`.
      backend: ``"triton"`` or ``"mosaic_tpu"``; default: the platform's (`kernels_pallas.backends`).

    Returns:
      ``(batch, seq, heads, v_head_dim)`` in q's dtype, or ``(out, max_logits)``.
    """
    reference.check_shapes(q, k, v, segment_ids)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"flash_attention takes q, k, v of one dtype among float32, bfloat16, float16; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers; got {segment_ids.dtype}")
    backend = backends.choose("flash_attention", platform(), backend, interpret, tuple(BACKENDS), "use reference.attention")
    spec = base.Spec(
        causal=causal,
        sm_scale=float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale),
        block_sizes=block_sizes or BlockSizes(),
        interpret=interpret,
        return_row_max=return_max_logits,
    )
    segment_ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
    q, k, v, segment_ids = varying.unify(q, k, v, segment_ids)
    if interpret:
        varying.check_interpretable("flash_attention", "use model.attention=xla on a CPU", q)
    out, row_max = _flash(q, k, v, segment_ids, backend, spec)
    if not return_max_logits:
        return out
    return out, jnp.max(row_max, axis=(0, 2))
