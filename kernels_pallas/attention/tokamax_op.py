"""tokamax's fused attention (`tokamax.dot_product_attention`) as an implementation of the attention op.

tokamax (openxla/tokamax, ``pip install spmdlab[tokamax]``; read at 0.0.12) picks its own kernel: with
``implementation=None`` its `api.dot_product_attention` tries ``mosaic`` (Mosaic GPU on sm90 / sm100 for
bf16/fp16 at default precision; Mosaic TPU from v5), then ``triton`` (its Pallas Triton kernel, any GPU),
then ``xla`` (any platform; materialises the ``(batch, heads, T, T)`` logits), taking the first whose
trace raises no ``NotImplementedError``. ``model.attention=tokamax`` takes that choice as it is: on a CPU
it is tokamax's XLA path, which is how the tests check the conventions below. Each kernel carries its
own backward (`Op.vjp`), chosen with its forward.

Conventions, read from tokamax's ``ops/attention/base.py`` and matched to `reference.attention`:

- layout ``(batch, seq, heads, head_dim)`` for q, k, v; grouped-query attention reads kv head
  ``h // (heads / kv_heads)`` for query head ``h`` (its "heads [0, 1] see kv head 0"), without repeats in
  the kernels; scale ``head_dim ** -0.5``; logits and softmax statistics in float32 on the kernels
  (Mosaic GPU refuses any other ``logits_dtype``);
- causal by ``is_causal=True``; segment ids as a boolean ``(batch, 1, T, T)`` same-segment mask, as the
  cuDNN route passes them (tokamax's ``Mask(k_start=...)`` form is cheaper but assumes every segment id
  is one contiguous run, which ``segment_ids`` does not promise);
- a static token window by ``local_window_size=(W - 1, 0)`` (keys ``[i - W + 1, i]``, `window`);
- tracked max logits (MuonClip) from `reference.max_logits`, as for cuDNN: tokamax's public call
  returns no softmax statistics;
- its kernels are Pallas calls that GSPMD cannot partition, so under a mesh it runs per shard (batch
  and heads split, whole sequences), as our kernel does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import extras
from kernels_pallas.attention import reference

WHAT = "model.attention=tokamax"


def _same_segment(segment_ids: jax.Array | None) -> jax.Array | None:
    return None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def run(q, k, v, segment_ids=None, *, track_max_logits: bool, platform: str):
    """``(out, max_logits or None)`` of causal attention by tokamax's own choice of kernel."""
    del platform  # tokamax reads the device itself
    tokamax = extras.tokamax(WHAT)
    reference.check_shapes(q, k, v, segment_ids)
    out = tokamax.dot_product_attention(q, k, v, mask=_same_segment(segment_ids), is_causal=True)
    return out, reference.max_logits(q, k, causal=True, segment_ids=segment_ids) if track_max_logits else None


def windowed(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, segment_ids: jax.Array | None = None) -> jax.Array:
    """A token window: query ``i`` sees keys ``[i - window + 1, i]`` of its own segment."""
    tokamax = extras.tokamax(WHAT)
    reference.check_shapes(q, k, v, segment_ids)
    return tokamax.dot_product_attention(
        q, k, v, mask=_same_segment(segment_ids), is_causal=True, local_window_size=(window - 1, 0)
    )


def unsupported(q: jax.Array, k: jax.Array, v: jax.Array, *, sequence_sharded: bool) -> str | None:
    """Why tokamax cannot serve attention over q, k, v (arrays or `jax.ShapeDtypeStruct`; None when it can).

    tokamax's dispatch ends in its XLA path, which takes any float q, k, v, so what is left is: the
    package imports; q, k, v floating and of one dtype (its Mosaic GPU backward raises ``ValueError``,
    not the ``NotImplementedError`` its dispatch falls back on, for mixed dtypes); whole sequences (its
    kernels run per shard).
    """
    if (reason := extras.tokamax_missing()) is not None:
        return reason
    if sequence_sharded:
        return "the sequence is sharded (context parallelism) and tokamax's kernels need whole sequences"
    if len({jnp.dtype(x.dtype) for x in (q, k, v)}) > 1 or not jnp.issubdtype(q.dtype, jnp.floating):
        return f"tokamax attention takes floating q, k, v of one dtype, not {q.dtype}/{k.dtype}/{v.dtype}"
    return None
