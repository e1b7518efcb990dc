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
through it. This materialises the logits, ``(batch, heads, T, T)`` at most; the kernels never do. Causal
attention runs in query blocks (`causal_blocks`), each against only the keys at or before its last
position, so the ``T x T`` work above the diagonal is mostly skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The name of `attention`'s saved output and log-sum-exp, for remat policies that keep attention (`lm.remat`).
RESIDUAL_NAME = "xla_attention_residual"


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
    # Query head h = k * G + g at position i becomes row i * G + g of its kv head's block: one
    # (T G, d) x (d, T) product per (batch, kv head), with no copy of the keys per query head, and
    # a block of query positions is a block of rows.
    grouped = q.reshape(b, t, kv, h // kv, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * (h // kv), d)
    blocks = causal_blocks(t) if causal else 1
    out, row_max = _attention(
        grouped, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segment_ids, causal, float(scale), blocks
    )
    out = out.reshape(b, kv, t, h // kv, -1).transpose(0, 2, 1, 3, 4).reshape(b, t, h, v.shape[-1]).astype(q.dtype)
    if not return_max_logits:
        return out
    return out, jax.lax.stop_gradient(jnp.max(row_max.reshape(b, kv, t, h // kv), axis=(0, 2)).reshape(h))


def causal_blocks(seq_len: int) -> int:
    """How many query blocks causal attention splits ``seq_len`` into: 4 where it divides, else 1.

    Block ``i`` of ``n`` multiplies its queries only with the keys ``j < (i + 1) T / n``, so the
    ``T x T`` work is ``(n + 1) / (2 n)`` of the full square's (5/8 at 4 blocks) for ``n`` products per
    pass instead of one.
    """
    return 4 if seq_len % 4 == 0 and seq_len >= 64 else 1


def _row_blocks(q, t: int, blocks: int):
    """Grouped ``q`` ``(batch, kv, T G, d)`` as ``blocks`` ``(start, stop)`` row ranges and their key counts."""
    rows = q.shape[2] // blocks
    return [(i * rows, (i + 1) * rows, (i + 1) * t // blocks) for i in range(blocks)]


def _logit_mask(q_rows: tuple[int, int], keys: int, group: int, causal: bool, segment_ids, q_segments):
    """Allowed (row, key) pairs of a row block, ``(batch or 1, 1, rows, keys)``; None when all are allowed.

    Row ``r`` is query position ``r // group``. A causal block's mask compares two iotas, which XLA fuses into
    the masking; a NumPy mask was a constant of the program (gpt2-124m's train step at T = 1024 held 13 sets of
    its 4 block masks: 17.8 MB of StableHLO text, 0.36 MB without them). Segments make it data.
    """
    allowed = None
    if causal:
        shape = (q_rows[1] - q_rows[0], keys)
        positions = (q_rows[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)) // group
        allowed = (jax.lax.broadcasted_iota(jnp.int32, shape, 1) <= positions)[None, None]
    if segment_ids is not None:
        same = (q_segments[:, None, :, None] == segment_ids[:, None, None, :keys])
        allowed = same if allowed is None else allowed & same
    return allowed


def _probabilities(q, k, allowed, scale: float, lse=None):
    """Softmax of the masked logits of grouped ``q`` ``(batch, kv, rows, d)`` against ``k`` ``(batch, kv, keys, d)``.

    Normalised by ``lse`` when given (the backward pass), else by the rows' own statistics; returns
    ``(probabilities, row maxima, log-sum-exp)``, all float32.
    """
    logits = jnp.einsum("bkmd,bktd->bkmt", q, k, preferred_element_type=jnp.float32) * scale
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    if lse is not None:
        return jnp.exp(logits - lse[..., None]), None, lse
    row_max = jnp.max(logits, axis=-1)
    unnormalised = jnp.exp(logits - row_max[..., None])
    total = jnp.sum(unnormalised, axis=-1)
    return unnormalised / total[..., None], row_max, row_max + jnp.log(total)


def _blocks(q, k, segment_ids, causal: bool, blocks: int):
    """Per query block: its row slice, its keys' count and its mask (`_row_blocks`, `_logit_mask`)."""
    t = k.shape[2]
    group = q.shape[2] // t
    q_segments = None if segment_ids is None else jnp.repeat(segment_ids, group, axis=1)
    for start, stop, keys in _row_blocks(q, t, blocks):
        seg = None if q_segments is None else q_segments[:, start:stop]
        yield slice(start, stop), keys, _logit_mask((start, stop), keys, group, causal, segment_ids, seg)


def _forward(q, k, v, segment_ids, causal: bool, scale: float, blocks: int):
    """``(out, row maxima, log-sum-exp)``, one query block at a time against the keys it can see."""
    outs, maxima, lses = [], [], []
    for rows, keys, allowed in _blocks(q, k, segment_ids, causal, blocks):
        probs, row_max, lse = _probabilities(q[:, :, rows], k[:, :, :keys], allowed, scale)
        outs.append(jnp.einsum("bkmt,bktd->bkmd", probs.astype(v.dtype), v[:, :, :keys]))
        maxima.append(row_max)
        lses.append(lse)
    return (jnp.concatenate(x, axis=2) for x in (outs, maxima, lses))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, segment_ids, causal: bool, scale: float, blocks: int):
    """``(softmax(q k^T) v, row maxima)`` on grouped heads (`attention`); no gradient flows through the maxima."""
    out, row_max, _ = _forward(q, k, v, segment_ids, causal, scale, blocks)
    return out, row_max


def _attention_fwd(q, k, v, segment_ids, causal: bool, scale: float, blocks: int):
    out, row_max, lse = _forward(q, k, v, segment_ids, causal, scale, blocks)
    out = checkpoint_name(out, RESIDUAL_NAME)
    return (out, row_max), (q, k, v, segment_ids, out, checkpoint_name(lse, RESIDUAL_NAME))


def _attention_bwd(causal: bool, scale: float, blocks: int, residuals, cotangents):
    """The softmax backward from the saved log-sum-exp (FlashAttention-2, arXiv:2307.08691, tiled over query blocks).

    ``p = exp(s - lse)`` is recomputed, so no ``T x T`` array is kept between the passes;
    ``ds = p * (dp - rowsum(dO * O))``. The key and value gradients contract the ``T x T`` operand
    over its rows, an order XLA:CPU's products take without transposing it; a query block adds to the
    gradients of the keys it sees.
    """
    q, k, v, segment_ids, out, lse = residuals
    d_out = cotangents[0]
    f32 = jnp.float32
    t = k.shape[2]
    delta = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)
    dqs, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    for rows, keys, allowed in _blocks(q, k, segment_ids, causal, blocks):
        q_i, d_out_i, k_i, v_i = q[:, :, rows], d_out[:, :, rows], k[:, :, :keys], v[:, :, :keys]
        probs, _, _ = _probabilities(q_i, k_i, allowed, scale, lse[:, :, rows])
        dp = jnp.einsum("bkmd,bktd->bkmt", d_out_i, v_i, preferred_element_type=f32)
        ds = probs * (dp - delta[:, :, rows, None]) * scale
        dqs.append(jnp.einsum("bkmt,bktd->bkmd", ds.astype(k.dtype), k_i, preferred_element_type=f32))
        pad = ((0, 0), (0, 0), (0, t - keys), (0, 0))
        dv += jnp.pad(jnp.einsum("bkmt,bkmd->bktd", probs.astype(d_out.dtype), d_out_i, preferred_element_type=f32), pad)
        dk += jnp.pad(jnp.einsum("bkmt,bkmd->bktd", ds.astype(q.dtype), q_i, preferred_element_type=f32), pad)
    dq = jnp.concatenate(dqs, axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


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
