"""Softmax attention in plain XLA: the definition of correct for every attention kernel.

For query head ``h`` at position ``i`` and key position ``j``, with ``G = H / K`` query heads per key
head (grouped-query attention, Ainslie et al., arXiv:2305.13245; query head ``h`` reads key head
``h // G``)::

    s_ij = sm_scale * <q_i^h, k_j^(h // G)>                        (float32)
    s_ij = -inf where j is masked: j > i (causal) or seg_i != seg_j (packed documents)
    p_ij = exp(s_ij - lse_i),   lse_i = log sum_j exp(s_ij)
    o_i^h = sum_j p_ij v_j^(h // G)

``sm_scale`` defaults to ``head_dim ** -0.5``. The value head dim may differ from the query/key head
dim (multi-head latent attention). ``max_logits[h] = max_{b, i, j unmasked} s_ij`` is the per-head
maximum pre-softmax logit that QK-clip (MuonClip) reads; it is a statistic, so no gradient flows
through it. This materialises the ``(batch, heads, T, T)`` logits; the kernels never do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> None:
    """Raises a one-line ValueError naming the fix when q, k, v, segment_ids do not fit together."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention takes (batch, seq, heads, head_dim) arrays; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    (b, t, h, d), (bk, tk, kv, dk), (bv, tv, kvv, _) = q.shape, k.shape, v.shape
    if (bk, tk, kv) != (bv, tv, kvv) or dk != d or (bk, tk) != (b, t):
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: k and v need q's batch and sequence length, "
            "k needs q's head_dim and v k's number of heads (self-attention)"
        )
    if h % kv:
        raise ValueError(f"{h} query heads do not split into groups over {kv} key/value heads; use a divisor of {h}")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids has shape {segment_ids.shape}; expected (batch, seq) = {(b, t)}")


def mask(seq_len: int, *, causal: bool, segment_ids: jax.Array | None) -> jax.Array | None:
    """Allowed (query, key) pairs, ``(batch or 1, seq, seq)`` bool, or None when all are allowed."""
    allowed = jnp.tril(jnp.ones((1, seq_len, seq_len), bool)) if causal else None
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed = same if allowed is None else allowed & same
    return allowed


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    segment_ids: jax.Array | None = None,
    return_max_logits: bool = False,
):
    """Softmax attention, logits and softmax in float32.

    Args:
      q: ``(batch, seq, heads, head_dim)``.
      k: ``(batch, seq, kv_heads, head_dim)``; ``heads`` must be a multiple of ``kv_heads``.
      v: ``(batch, seq, kv_heads, v_head_dim)``.
      causal: query ``i`` sees keys ``j <= i``.
      sm_scale: logit scale; default ``head_dim ** -0.5``.
      segment_ids: ``(batch, seq)`` int; queries see only keys of the same segment.
      return_max_logits: also return the per-head maximum unmasked logit, ``(heads,)`` float32.

    Returns:
      ``(batch, seq, heads, v_head_dim)`` in q's dtype, or ``(out, max_logits)``.
    """
    check_shapes(q, k, v, segment_ids)
    b, t, h, d = q.shape
    kv = k.shape[2]
    scale = d**-0.5 if sm_scale is None else sm_scale
    grouped = q.reshape(b, t, kv, h // kv, d)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=jnp.float32) * scale
    allowed = mask(t, causal=causal, segment_ids=segment_ids)
    if allowed is not None:
        logits = jnp.where(allowed[:, None, None], logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v).reshape(b, t, h, v.shape[-1]).astype(q.dtype)
    if not return_max_logits:
        return out
    return out, jax.lax.stop_gradient(jnp.max(logits, axis=(0, 3, 4)).reshape(h))


def max_logits(
    q: jax.Array,
    k: jax.Array,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    segment_ids: jax.Array | None = None,
    block_q: int = 512,
) -> jax.Array:
    """``attention(..., return_max_logits=True)[1]`` without the ``T x T`` buffer.

    Scans over query blocks of ``block_q`` rows, so at most ``(batch, heads, block_q, T)`` logits
    exist at a time. For implementations that do not report their row statistics (cuDNN).
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    scale = d**-0.5 if sm_scale is None else sm_scale
    block_q = min(block_q, t)
    n_blocks = -(-t // block_q)
    pad = n_blocks * block_q - t
    q_blocks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n_blocks, block_q, kv, h // kv, d)
    q_segments = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad))).reshape(b, n_blocks, block_q)
    key_pos = jnp.arange(t)

    def block_max(index):
        q_block = q_blocks[:, index]
        logits = jnp.einsum("bskgd,btkd->bkgst", q_block, k, preferred_element_type=jnp.float32) * scale
        query_pos = index * block_q + jnp.arange(block_q)
        allowed = jnp.broadcast_to((query_pos < t)[:, None], (block_q, t))[None]
        if causal:
            allowed = allowed & (key_pos[None, :] <= query_pos[:, None])
        if q_segments is not None:
            allowed = allowed & (q_segments[:, index, :, None] == segment_ids[:, None, :])
        return jnp.max(jnp.where(allowed[:, None, None], logits, -jnp.inf), axis=(0, 3, 4)).reshape(h)

    return jax.lax.stop_gradient(jnp.max(jax.lax.map(block_max, jnp.arange(n_blocks)), axis=0))
