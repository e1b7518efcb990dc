"""Causal grouped-query self-attention, and the one function that picks how attention is computed.

Query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)`` (GQA, Ainslie et al.,
arXiv:2305.13245). `attend` runs the implementation that ``model.attention`` names:

- ``xla``: `kernels_pallas.attention.reference`, the definition of correct (materialises the
  ``(batch, heads, T, T)`` float32 logits).
- ``cudnn``: `jax.nn.dot_product_attention(..., implementation="cudnn")` (GPU; bf16/fp16, head_dim
  <= 128 and a multiple of 8, equal q/v head dims). cuDNN does not report row statistics, so with
  ``track_attn_logits`` the per-head max logits come from `reference.max_logits`, a second
  pass over query blocks (one more ``Q K^T``, no ``T x T`` buffer, no gradient).
- ``pallas``: `kernels_pallas.attention.flash_attention` (FlashAttention-2; Triton on GPU, Mosaic on
  TPU, interpret mode on CPU: correct but slow, for tests); max logits from the kernel's row maxima.
  Under a mesh it runs per shard (`sharding.partition.logical_shard_map`): batch and heads may be
  sharded, the sequence may not.
- ``auto``: XLA on CPU, Pallas on TPU; on GPU cuDNN where it supports the call, else Pallas; XLA
  wherever the sequence is sharded. Each reason for leaving the first choice is logged once.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kernels_pallas.attention import api as flash_api
from kernels_pallas.attention import reference
from lm import kv_cache, remat
from lm.config import ModelConfig
from lm.layers import RMSNorm, linear, rotary_embedding, split_heads
from sharding import partition

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_Q = ("batch", "seq", "heads", "head_dim")
_KV = ("batch", "seq", "kv_heads", "head_dim")


def cudnn_unsupported(q: jax.Array, k: jax.Array, v: jax.Array, *, track_max_logits: bool) -> str | None:
    """Why cuDNN's fused attention cannot serve this call (None when it can), as `auto` sees it."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN flash attention takes bf16/fp16, not {q.dtype}"
    if q.shape[-1] > 128 or q.shape[-1] % 8:
        return f"cuDNN flash attention takes head_dim <= 128 and a multiple of 8, not {q.shape[-1]}"
    if v.shape[-1] != q.shape[-1]:
        return f"cuDNN flash attention takes equal q/v head dims, not {q.shape[-1]}/{v.shape[-1]}"
    if track_max_logits:
        return "cuDNN does not report the max logits that track_attn_logits needs"
    return None


def choose(
    implementation: str,
    platform: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    track_max_logits: bool,
    sequence_sharded: bool = False,
):
    """``(implementation to run, why auto left the platform's first choice, or None)``."""
    if implementation != "auto":
        return implementation, None
    if sequence_sharded and platform != "cpu":
        return "xla", "the sequence is sharded (context parallelism) and the fused kernels need whole sequences"
    if platform == "tpu":
        return "pallas", None
    if platform not in _GPU_PLATFORMS:
        return "xla", None
    reason = "ROCm has no cuDNN" if platform == "rocm" else cudnn_unsupported(q, k, v, track_max_logits=track_max_logits)
    return ("cudnn", None) if reason is None else ("pallas", reason)


def _pallas(q: jax.Array, k: jax.Array, v: jax.Array, *, track_max_logits: bool, platform: str, segment_ids=None):
    if partition.logical_mesh_axes("heads") != partition.logical_mesh_axes("kv_heads"):
        raise ValueError(
            "model.attention=pallas needs heads and kv_heads sharded alike (query head h reads kv head h // group "
            "on each shard); give both logical axes the same rule"
        )

    def kernel(q, k, v, *segments):
        out = flash_api.flash_attention(
            q, k, v, causal=True, segment_ids=segments[0] if segments else None,
            return_max_logits=track_max_logits, interpret=platform == "cpu",
        )  # fmt: skip
        if not track_max_logits:
            return out
        out, max_logits = out
        batch_axes = partition.logical_mesh_axes("batch")
        return out, jax.lax.pmax(jax.lax.stop_gradient(max_logits), batch_axes) if batch_axes else max_logits

    out_logical = (_Q, ("heads",)) if track_max_logits else _Q
    args, specs = ((q, k, v), [_Q, _KV, _KV]) if segment_ids is None else ((q, k, v, segment_ids), [_Q, _KV, _KV, ("batch", "seq")])
    result = partition.logical_shard_map(kernel, specs, out_logical, whole=("seq",))(*args)
    return result if track_max_logits else (result, None)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, *, implementation: str = "xla", track_max_logits: bool = False, segment_ids=None
):
    """Causal softmax attention, logits and softmax statistics in float32.

    Args:
      q: ``(batch, seq, n_heads, head_dim)``; k, v: ``(batch, seq, n_kv_heads, head_dim)``.
      implementation: ``auto``, ``xla``, ``cudnn`` or ``pallas`` (see the module docstring).
      track_max_logits: also return the maximum pre-softmax logit of each query head over the
        batch and the causal (query, key) pairs, shape ``(n_heads,)``.
      segment_ids: ``(batch, seq)`` int or None; a query sees only keys of its own segment (document).

    Returns:
      ``(out, max_logits)``: out ``(batch, seq, n_heads, head_dim)`` in q's dtype; max_logits is
      None unless tracked.
    """
    platform = flash_api.platform()
    mesh = jax.sharding.get_abstract_mesh()
    sequence_sharded = any(mesh.shape[a] > 1 for a in partition.logical_mesh_axes("seq"))
    chosen, reason = choose(
        implementation, platform, q, k, v, track_max_logits=track_max_logits, sequence_sharded=sequence_sharded
    )
    if reason is not None and reason not in _LOGGED:
        _LOGGED.add(reason)
        _log.info("model.attention=auto chose %s: %s", chosen, reason)
    if chosen == "pallas":
        return _pallas(q, k, v, track_max_logits=track_max_logits, platform=platform, segment_ids=segment_ids)
    if chosen == "cudnn":
        same = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        out = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, implementation="cudnn")
        return out, reference.max_logits(q, k, causal=True, segment_ids=segment_ids) if track_max_logits else None
    if chosen != "xla":
        raise ValueError(f"unknown attention implementation {implementation!r}; use one of auto, xla, cudnn, pallas")
    if track_max_logits:
        return reference.attention(q, k, v, causal=True, segment_ids=segment_ids, return_max_logits=True)
    return reference.attention(q, k, v, causal=True, segment_ids=segment_ids), None


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

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys (both after RoPE at ``positions``) and values of ``x``, split into heads."""
        cfg = self.cfg
        q = split_heads(self.q_proj(x), cfg.n_heads, _Q)
        k = split_heads(self.k_proj(x), cfg.n_kv_heads, _KV)
        v = split_heads(self.v_proj(x), cfg.n_kv_heads, _KV)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary_embedding(q, positions, cfg.rope_theta), rotary_embedding(k, positions, cfg.rope_theta), v

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None):
        cfg = self.cfg
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
        q, k, v = checkpoint_name(q, remat.ATTN_Q), checkpoint_name(k, remat.ATTN_K), checkpoint_name(v, remat.ATTN_V)
        out, max_logits = attend(
            q, k, v, implementation=cfg.attention, track_max_logits=cfg.track_attn_logits, segment_ids=segment_ids
        )
        out = checkpoint_name(out, remat.ATTN_CONTEXT)
        b, s = x.shape[:2]
        return self.o_proj(out.reshape(b, s, -1)), max_logits

    def decode(self, x: jax.Array, cache: kv_cache.Cache, start: jax.Array) -> tuple[jax.Array, kv_cache.Cache]:
        """Attention of ``x`` ``(batch, s, d_model)`` (tokens at ``start ..``) over the cached keys and values.

        ``cache`` is one layer's ``{"k", "v": (batch, max_len, kv_heads, head_dim)}``; returns
        ``(out, cache with x's rows written)``.
        """
        cfg = self.cfg
        b, s = x.shape[:2]
        q, k, v = self._qkv(x, start + jnp.arange(s))
        cache = {"k": kv_cache.write(cache["k"], k, start), "v": kv_cache.write(cache["v"], v, start)}
        grouped = q.reshape(b, s, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
        logits = jnp.einsum("bskgd,btkd->bkgst", grouped, cache["k"], preferred_element_type=jnp.float32)
        probs = kv_cache.causal_softmax(logits * cfg.head_dim**-0.5, start)
        out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), cache["v"])
        return self.o_proj(out.reshape(b, s, -1)), cache
