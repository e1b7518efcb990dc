"""Causal grouped-query self-attention.

`attend` is the one place attention math happens; a Pallas kernel plugs in there when a backend
has one. Query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)`` (GQA, Ainslie et al.,
arXiv:2305.13245).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lm import remat
from lm.config import ModelConfig
from lm.layers import RMSNorm, linear, rotary_embedding, split_heads


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, track_max_logits: bool = False):
    """Causal softmax attention, logits and softmax in float32.

    Args:
      q: ``(batch, seq, n_heads, head_dim)``; k, v: ``(batch, seq, n_kv_heads, head_dim)``.
      track_max_logits: also return the maximum pre-softmax logit of each query head over the
        batch and the causal (query, key) pairs, shape ``(n_heads,)``.

    Returns:
      ``(out, max_logits)``: out ``(batch, seq, n_heads, head_dim)`` in q's dtype; max_logits is
      None unless tracked.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) * (d**-0.5)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    logits = jnp.where(causal, logits, -jnp.inf)
    max_logits = jnp.max(logits, axis=(0, 3, 4)).reshape(h) if track_max_logits else None
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v)
    return out.reshape(b, s, h, d), max_logits


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = cfg.compute_dtype
        out_scale = (2 * cfg.n_layers) ** -0.5
        self.cfg = cfg
        self.q_proj = linear(cfg.d_model, cfg.n_heads * cfg.head_dim, ("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        self.v_proj = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        self.o_proj = linear(
            cfg.n_heads * cfg.head_dim, cfg.d_model, ("heads", "embed"), dtype=dtype, rngs=rngs, scale=out_scale
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, "head_dim", eps=cfg.norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, "head_dim", eps=cfg.norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array):
        cfg = self.cfg
        q = split_heads(self.q_proj(x), cfg.n_heads, ("batch", "seq", "heads", "head_dim"))
        k = split_heads(self.k_proj(x), cfg.n_kv_heads, ("batch", "seq", "kv_heads", "head_dim"))
        v = split_heads(self.v_proj(x), cfg.n_kv_heads, ("batch", "seq", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = jnp.arange(x.shape[1])
        q = rotary_embedding(q, positions, cfg.rope_theta)
        k = rotary_embedding(k, positions, cfg.rope_theta)
        q, k, v = checkpoint_name(q, remat.ATTN_Q), checkpoint_name(k, remat.ATTN_K), checkpoint_name(v, remat.ATTN_V)
        out, max_logits = attend(q, k, v, track_max_logits=cfg.track_attn_logits)
        out = checkpoint_name(out, remat.ATTN_CONTEXT)
        b, s = x.shape[:2]
        return self.o_proj(out.reshape(b, s, -1)), max_logits
