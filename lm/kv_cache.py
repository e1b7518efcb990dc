"""Key/value caches for autoregressive decoding, and the causal softmax over a cache.

A cache is a dict of arrays with a leading ``layers`` axis and room for ``max_len`` positions:

- grouped-query attention keeps keys and values, ``k, v: (layers, batch, max_len, kv_heads, head_dim)``;
- multi-head latent attention keeps only the normalised latent and the shared RoPE key,
  ``latent: (layers, batch, max_len, kv_lora_rank)``, ``k_rope: (layers, batch, max_len, rope_head_dim)``
  (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1.3): ``kv_lora_rank + rope_head_dim`` numbers per token and
  layer instead of ``2 * kv_heads * head_dim``;
- lightning attention (`lm.lightning`) keeps each lightning layer's float32 state,
  ``state: (lightning layers, batch, heads, head_dim, head_dim)``, the same size at any length, and
  ``k, v`` for its softmax layers only (``model.softmax_attention_every``).

A decode call takes ``s`` new tokens at positions ``start .. start + s - 1``, writes their entries at
those rows and lets query ``i`` see cache rows ``j <= start + i``. Rows past what has been written are
never seen, so the cache starts as zeros. Prefill is the same call with the whole prompt at ``start=0``.

With ParScale (``model.parscale = P > 1``, `lm.parscale`) a cache for ``batch`` sequences holds the
``batch * P`` rows of their streams (row ``b P + i``: stream ``i`` of sequence ``b``); the streams'
prefix keys and values are parameters, read from the model at every step, not cache rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lm.config import ModelConfig

Cache = dict[str, jax.Array]


def shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """The shape of each cache entry of a model with config ``cfg``."""
    lead = (cfg.n_layers, batch * cfg.parscale, max_len)
    if cfg.attention_type == "lightning":
        n_softmax = cfg.n_layers // cfg.softmax_attention_every if cfg.softmax_attention_every else 0
        state = {"state": (cfg.n_layers - n_softmax, batch, cfg.n_heads, cfg.head_dim, cfg.head_dim)}
        kv = (n_softmax, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
        return {**state, "k": kv, "v": kv} if n_softmax else state
    if cfg.attention_type == "mla":
        return {"latent": (*lead, cfg.kv_lora_rank), "k_rope": (*lead, cfg.rope_head_dim)}
    return {"k": (*lead, cfg.n_kv_heads, cfg.head_dim), "v": (*lead, cfg.n_kv_heads, cfg.head_dim)}


def init(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
    """An empty cache (zeros in the compute dtype; a lightning state in float32) for ``batch`` sequences of up to ``max_len`` tokens."""
    if max_len > cfg.max_seq_len:
        raise ValueError(f"a cache of {max_len} positions exceeds model.max_seq_len={cfg.max_seq_len}; decode fewer tokens")
    dtype = lambda name: jnp.float32 if name == "state" else cfg.compute_dtype
    return {name: jnp.zeros(shape, dtype(name)) for name, shape in shapes(cfg, batch, max_len).items()}


def write(entry: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """``entry`` ``(batch, max_len, ...)`` with rows ``start ..`` replaced by ``new`` ``(batch, s, ...)``."""
    return jax.lax.dynamic_update_slice_in_dim(entry, new.astype(entry.dtype), start, axis=1)


def causal_softmax(logits: jax.Array, start: jax.Array, *, window: int = 0, block: int = 1) -> jax.Array:
    """Softmax over cache rows of float32 ``logits`` ``(..., s, max_len)`` for queries at ``start + i``; with a
    ``window`` of tokens in blocks of ``block``, only rows inside it (`kernels_pallas.attention.window`)."""
    s, max_len = logits.shape[-2:]
    rows, queries = jnp.arange(max_len)[None, :], start + jnp.arange(s)[:, None]
    visible = rows <= queries
    if window:
        visible = visible & (queries // block - rows // block < window // block)
    return jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
