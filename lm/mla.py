"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, Sec. 2.1).

Keys and values of all heads come from one low-rank latent per token, and position enters through a
separate, decoupled RoPE part shared by all heads. With ``H`` heads, no-RoPE width ``d_n``
(``model.head_dim``), RoPE width ``d_r`` (``model.rope_head_dim``), value width ``d_v``
(``model.v_head_dim``) and latent width ``r`` (``model.kv_lora_rank``), for a token ``x``::

    c    = RMSNorm(x W_dkv)                      (r,)        the only per-token state a cache keeps,
    k_r  = RoPE(x W_kr)                          (d_r,)      with the shared RoPE key
    k_h  = [c W_uk^h ; k_r],   v_h = c W_uv^h    (d_n + d_r,), (d_v,)
    q_h  = [q_n^h ; RoPE(q_r^h)],  [q_n ; q_r] = x W_q   or   RMSNorm(x W_dq) W_uq   (q_lora_rank > 0)
    o    = concat_h softmax(q_h k_h^T / sqrt(d_n + d_r)) v_h  W_o

Training materialises ``k_h, v_h`` and runs the shared attention implementations (`lm.attention.attend`,
``model.attention``: XLA, cuDNN or the Pallas flash kernel, which takes ``d_v != d_n + d_r``). With the
sequence split over a ``context`` axis, the latent ``c`` and the RoPE key ``k_r`` (``r + d_r`` numbers
per token instead of ``H (d_n + d_r + d_v)``) are what the all-gather or the ring sends; each shard
expands the block it holds (`lm.parallel.context_attention.Compressed`).
Decoding absorbs the up-projections (Sec. 2.1.3): ``q_h . k_h = (q_n^h W_uk^h^T) . c + q_r^h . k_r`` and
``p v_h = (p c) W_uv^h``, so attention runs against the cached latents and no per-head key or value is
ever formed. The equations are the paper's (9)-(19); the latent and the RoPE key come from two matrices
here (``kv_down``, ``k_rope_proj``) rather than one concatenated projection, so each has its own logical axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lm import kv_cache, remat, rope
from lm.attention import attend
from lm.config import ModelConfig
from lm.layers import RMSNorm, linear, split_heads
from lm.parallel import context_attention
from sharding.partition import constrain

_HEADS = ("batch", "seq", "heads", "head_dim")
_LATENT = ("batch", "seq", "latent")
_SOURCE = ("batch", "seq", None)  # a latent or the RoPE key, whole on each context shard


def _expand(head_dim: int, w_uk: jax.Array, w_uv: jax.Array, latent: jax.Array, k_rope: jax.Array):
    """Per-head ``(k, v)`` of a shard from its latents and RoPE keys: ``k_h = [c W_uk^h ; k_r]``, ``v_h = c W_uv^h``.

    ``w_uk`` ``(r, heads * head_dim)`` and ``w_uv`` ``(r, heads * v_head_dim)`` hold this shard's heads.
    """
    b, s, _ = latent.shape
    heads = w_uk.shape[1] // head_dim
    k_nope = jnp.einsum("bsr,rn->bsn", latent, w_uk).reshape(b, s, heads, head_dim)
    v = jnp.einsum("bsr,rn->bsn", latent, w_uv).reshape(b, s, heads, -1)
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (b, s, heads, k_rope.shape[-1]))
    return jnp.concatenate([k_nope, k_rope], axis=-1), v


class MultiHeadLatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = cfg.compute_dtype
        d, h, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
        self.cfg = cfg
        q_width = h * (cfg.head_dim + cfg.rope_head_dim)
        if cfg.q_lora_rank:
            self.q_down = linear(d, cfg.q_lora_rank, ("embed", "latent"), dtype=dtype, rngs=rngs)
            self.q_norm = RMSNorm(cfg.q_lora_rank, "latent", eps=cfg.norm_eps, dtype=dtype)
            self.q_up = linear(cfg.q_lora_rank, q_width, ("latent", "heads"), dtype=dtype, rngs=rngs)
        else:
            self.q_proj = linear(d, q_width, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.kv_down = linear(d, r, ("embed", "latent"), dtype=dtype, rngs=rngs)
        self.kv_norm = RMSNorm(r, "latent", eps=cfg.norm_eps, dtype=dtype)
        self.k_rope_proj = linear(d, cfg.rope_head_dim, ("embed", "head_dim"), dtype=dtype, rngs=rngs)
        self.k_up = linear(r, h * cfg.head_dim, ("latent", "heads"), dtype=dtype, rngs=rngs)
        self.v_up = linear(r, h * cfg.value_head_dim, ("latent", "heads"), dtype=dtype, rngs=rngs)
        self.o_proj = linear(
            h * cfg.value_head_dim, d, ("heads", "embed"), dtype=dtype, rngs=rngs, scale=(2 * cfg.n_layers) ** -0.5
        )

    def _queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(q_n, RoPE(q_r))``: ``(batch, seq, heads, head_dim)`` and ``(..., rope_head_dim)``, times `lm.rope.softmax_scale_factor`."""
        cfg = self.cfg
        q = self.q_up(self.q_norm(self.q_down(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = split_heads(q, cfg.n_heads, _HEADS)
        q_nope, q_rope = q[..., : cfg.head_dim], rope.rotary_embedding(q[..., cfg.head_dim :], positions, cfg)
        if (scale := rope.softmax_scale_factor(cfg)) != 1.0:  # YaRN's softmax scale, on the queries
            q_nope, q_rope = q_nope * scale, q_rope * scale
        return q_nope, q_rope

    def _latent(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(c, k_r)``: the normalised latent ``(batch, seq, r)`` and the RoPE key ``(batch, seq, d_r)``."""
        latent = constrain(self.kv_norm(self.kv_down(x)), _LATENT)
        k_rope = rope.rotary_embedding(self.k_rope_proj(x)[:, :, None, :], positions, self.cfg)[:, :, 0]
        return latent, k_rope

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, order: jax.typing.ArrayLike | None = None):
        """``(out, max_logits)`` for ``x`` ``(batch, seq, d_model)``; ``order`` as `lm.attention.Attention`'s.

        Keys and values are materialised per head, except with the sequence split over a ``context``
        axis: then the latent and the RoPE key cross the wire and each shard expands them (`_expand`).
        """
        cfg = self.cfg
        b, s = x.shape[:2]
        positions = jnp.arange(s) if order is None else jnp.asarray(order)
        q_nope, q_rope = self._queries(x, positions)
        latent, k_rope = self._latent(x, positions)
        q = checkpoint_name(constrain(jnp.concatenate([q_nope, q_rope], axis=-1), _HEADS), remat.ATTN_Q)
        if context_attention.sequence_split():
            up = tuple(w.kernel[...].astype(latent.dtype) for w in (self.k_up, self.v_up))
            # K and V form per shard from these two (`_expand`): they carry the key and value names the remat policies keep.
            latent, k_rope = checkpoint_name(latent, remat.ATTN_V), checkpoint_name(k_rope, remat.ATTN_K)
            compressed = context_attention.Compressed(
                (latent, k_rope), (_SOURCE, _SOURCE), up, ((None, "heads"),) * 2, functools.partial(_expand, cfg.head_dim)
            )
            out, max_logits = context_attention.attend_compressed(
                q, compressed, mode=cfg.context_parallel, implementation=cfg.attention, track_max_logits=cfg.track_attn_logits,
                segment_ids=segment_ids, zigzag=order is not None,
            )
        else:
            k_nope = split_heads(self.k_up(latent), cfg.n_heads, _HEADS)
            v = split_heads(self.v_up(latent), cfg.n_heads, _HEADS)
            k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (b, s, cfg.n_heads, cfg.rope_head_dim))
            k = constrain(jnp.concatenate([k_nope, k_rope], axis=-1), _HEADS)
            k, v = checkpoint_name(k, remat.ATTN_K), checkpoint_name(v, remat.ATTN_V)
            out, max_logits = attend(
                q,
                k,
                v,
                implementation=cfg.attention,
                track_max_logits=cfg.track_attn_logits,
                segment_ids=segment_ids,
                context_parallel=cfg.context_parallel,
            )
        out = checkpoint_name(out, remat.ATTN_CONTEXT)
        return self.o_proj(out.reshape(b, s, -1)), max_logits

    def decode(self, x: jax.Array, cache: kv_cache.Cache, start: jax.Array) -> tuple[jax.Array, kv_cache.Cache]:
        """Attention of ``x`` (tokens at ``start ..``) over the cached latents, up-projections absorbed.

        Args:
          x: ``(batch, s, d_model)``.
          cache: one layer's ``{"latent": (batch, max_len, r), "k_rope": (batch, max_len, d_r)}``.
          start: position of ``x``'s first token.

        Returns:
          ``(out (batch, s, d_model), cache with x's rows written)``.
        """
        cfg = self.cfg
        b, s = x.shape[:2]
        positions = start + jnp.arange(s)
        q_nope, q_rope = self._queries(x, positions)
        latent, k_rope = self._latent(x, positions)
        cache = {"latent": kv_cache.write(cache["latent"], latent, start), "k_rope": kv_cache.write(cache["k_rope"], k_rope, start)}
        w_uk = self.k_up.kernel[...].reshape(cfg.kv_lora_rank, cfg.n_heads, cfg.head_dim).astype(q_nope.dtype)
        w_uv = self.v_up.kernel[...].reshape(cfg.kv_lora_rank, cfg.n_heads, cfg.value_head_dim).astype(q_nope.dtype)
        q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)
        logits = jnp.einsum("bshr,btr->bhst", q_latent, cache["latent"], preferred_element_type=jnp.float32)
        logits += jnp.einsum("bshp,btp->bhst", q_rope, cache["k_rope"], preferred_element_type=jnp.float32)
        probs = kv_cache.causal_softmax(logits * (cfg.head_dim + cfg.rope_head_dim) ** -0.5, start)
        context_latent = jnp.einsum("bhst,btr->bshr", probs.astype(latent.dtype), cache["latent"])
        out = jnp.einsum("bshr,rhv->bshv", context_latent, w_uv)
        return self.o_proj(out.reshape(b, s, -1)), cache
