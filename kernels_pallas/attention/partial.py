"""Attention over one block of keys, with its log-sum-exp: the piece that ring attention combines.

For queries ``q`` (``S_q`` rows) and one key/value block (``S_k`` rows) the forward returns the
block's normalised output, its row log-sum-exp (natural units) and row max, all float32::

    o_b = softmax_b(s) v_b,   lse_b = log sum_{j in b} exp(s_j),   m_b = max_{j in b} s_j

so that results over disjoint key blocks merge exactly (`merge`)::

    lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

The backward of one block takes the *merged* output ``o`` and ``lse`` of the whole key set (what
the forward saved), so each block's probabilities ``p = exp(s - lse)`` are final and its gradients
are exact parts of the whole (FlashAttention-2's backward, `base`, per block)::

    delta = rowsum(dO * o),  dV_b = p^T dO,  dS = p (dO V_b^T - delta),
    dQ += sm_scale dS K_b,  dK_b = sm_scale dS^T Q

Masking: ``causal`` compares row and column *indices* within the block (the caller arranges blocks
so that this is the causal order, or passes ``causal=False`` for a block wholly in the past); query
and key segment ids (packed documents) come separately. A row that sees no key of the block gets a
vanishing weight in `merge` (lse ``-inf`` from XLA, a huge negative number from the kernels).

Two implementations: ``xla`` (plain einsums) and ``pallas`` (the flash kernels of `triton` /
`mosaic_tpu`, which already compute the base-2 lse for their own backward; ``interpret`` runs them
on a CPU). Blocks of the kernels need ``S_q == S_k``. cuDNN reports no lse (`api.block_implementation`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import backends
from kernels_pallas.attention import base, mosaic_tpu, triton

Result = tuple[jax.Array, jax.Array, jax.Array]  # out (b, s, h, dv) f32; lse, row_max (b, h, s) f32
_BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu}
IMPLEMENTATIONS = ("xla", "pallas")


def _allowed(s_q: int, s_k: int, causal: bool, q_seg, kv_seg):
    """``(batch or 1, s_q, s_k)`` bool, or None when every pair is allowed."""
    allowed = jnp.tril(jnp.ones((1, s_q, s_k), bool)) if causal else None
    if q_seg is not None:
        same = q_seg[:, :, None] == kv_seg[:, None, :]
        allowed = same if allowed is None else allowed & same
    return allowed


def _logits(q, k, sm_scale: float, allowed):
    """``(b, kv, g, s_q, s_k)`` float32 logits, ``-inf`` where masked."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    logits = jnp.einsum("bskgd,btkd->bkgst", q.reshape(b, s, kv, h // kv, d), k, preferred_element_type=jnp.float32) * sm_scale
    return logits if allowed is None else jnp.where(allowed[:, None, None], logits, -jnp.inf)


def _heads_major(x, b: int, h: int, s: int):
    """``(b, kv, g, s)`` -> ``(b, h, s)``: query head ``h = kv * G + g``."""
    return x.reshape(b, h, s)


def _xla_forward(q, k, v, q_seg, kv_seg, causal: bool, sm_scale: float) -> Result:
    b, s, h, _ = q.shape
    logits = _logits(q, k, sm_scale, _allowed(s, k.shape[1], causal, q_seg, kv_seg))
    row_max = jnp.max(logits, axis=-1)
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - shift[..., None])
    total = jnp.sum(weights, axis=-1)
    safe = jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, shift + jnp.log(safe), -jnp.inf)
    out = jnp.einsum("bkgst,btkd->bskgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out / jnp.moveaxis(safe, -1, 1)[..., None]).reshape(b, s, h, v.shape[-1])
    return out, _heads_major(lse, b, h, s), _heads_major(row_max, b, h, s)


def _xla_backward(q, k, v, q_seg, kv_seg, out, lse, d_out, causal: bool, sm_scale: float):
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    logits = _logits(q, k, sm_scale, _allowed(s, k.shape[1], causal, q_seg, kv_seg))
    p = jnp.exp(logits - lse.reshape(b, kv, g, s)[..., None])  # exactly 0 where masked (-inf)
    d_out = d_out.astype(jnp.float32).reshape(b, s, kv, g, -1)
    delta = jnp.einsum("bskgd,bskgd->bkgs", out.astype(jnp.float32).reshape(d_out.shape), d_out)
    dv = jnp.einsum("bkgst,bskgd->btkd", p, d_out)
    dp = jnp.einsum("bskgd,btkd->bkgst", d_out, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * sm_scale
    dq = jnp.einsum("bkgst,btkd->bskgd", ds, k.astype(jnp.float32)).reshape(b, s, h, d)
    dk = jnp.einsum("bkgst,bskgd->btkd", ds, q.astype(jnp.float32).reshape(b, s, kv, g, d))
    return dq, dk, dv


def _spec(sm_scale: float, causal: bool, interpret) -> base.Spec:
    return base.Spec(causal=causal, sm_scale=sm_scale, block_sizes=base.BlockSizes(), interpret=interpret, return_row_max=True)


def _segments(q_seg, kv_seg):
    return None if q_seg is None else (q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))


def _check_square(q, k):
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"the Pallas partial-attention block takes as many queries as keys; got {q.shape[1]} and {k.shape[1]}")


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    *,
    causal: bool,
    sm_scale: float | None = None,
    implementation: str = "xla",
    interpret: bool = False,
    backend: str | None = None,
) -> Result:
    """``(out, lse, row_max)`` of ``q`` ``(b, S_q, h, d)`` over the block ``k, v`` ``(b, S_k, kv, d|dv)``.

    out ``(b, S_q, h, dv)``, lse and row_max ``(b, h, S_q)``, all float32 (the kernels' out is in q's
    dtype, widened). ``implementation``: ``xla`` or ``pallas`` (``backend`` as `api.flash_attention`).
    """
    scale = float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    if implementation == "xla":
        return _xla_forward(q, k, v, q_segment_ids, kv_segment_ids, causal, scale)
    _check_square(q, k)
    name = backends.choose("flash_attention", backends.platform(), backend, interpret, tuple(_BACKENDS), "use implementation='xla'")
    out, row_max, residuals = _BACKENDS[name].forward(q, k, v, _segments(q_segment_ids, kv_segment_ids), _spec(scale, causal, interpret))
    return out.astype(jnp.float32), residuals[-1] / base.LOG2E, row_max


def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    causal: bool,
    sm_scale: float | None = None,
    implementation: str = "xla",
    interpret: bool = False,
    backend: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` float32 of one block, from the merged ``out`` and ``lse`` of the whole key set."""
    scale = float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    if implementation == "xla":
        return _xla_backward(q, k, v, q_segment_ids, kv_segment_ids, out, lse, d_out, causal, scale)
    _check_square(q, k)
    name = backends.choose("flash_attention", backends.platform(), backend, interpret, tuple(_BACKENDS), "use implementation='xla'")
    residuals = (q, k, v, _segments(q_segment_ids, kv_segment_ids), out.astype(q.dtype), lse * base.LOG2E)
    grads = _BACKENDS[name].backward(residuals, d_out.astype(q.dtype), _spec(scale, causal, interpret))
    return tuple(g.astype(jnp.float32) for g in grads)


def merge(a: Result, b: Result) -> Result:
    """The log-sum-exp combination of two blocks' results over the same queries (module docstring)."""
    (out_a, lse_a, max_a), (out_b, lse_b, max_b) = a, b
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    share = lambda w: jnp.moveaxis(jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0), 1, 2)[..., None]  # noqa: E731
    return out_a * share(weight_a) + out_b * share(weight_b), lse, jnp.maximum(max_a, max_b)
