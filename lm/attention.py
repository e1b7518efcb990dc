"""Causal grouped-query self-attention (the nnx module) and how it runs the attention op under a mesh.

Query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)`` (GQA, Ainslie et al.,
arXiv:2305.13245). `attend` asks the attention op (`kernels_pallas.attention.api.attention`) for
``model.attention`` (``auto``, ``xla``, ``cudnn``, ``pallas`` or ``tokamax``; the op owns the choice, its fallbacks
and their log lines). What it adds is the mesh: whether the sequence is sharded (over a ``context``
axis: `lm.parallel.context_attention`'s all-gather, ring or Ulysses attention), and for the Pallas
kernel a per-shard run (`sharding.partition.logical_shard_map`) in which batch and heads may be
sharded, the sequence may not, and the max logits are reduced over the batch shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from kernels_pallas.attention import api as attention_api
from lm import fp8, kv_cache, parscale, remat, rope, speedrun_blocks, speedrun_config
from lm.config import ModelConfig
from lm.layers import linear, split_heads
from lm.parallel import context_attention
from sharding import partition

_Q = ("batch", "seq", "heads", "head_dim")
_KV = ("batch", "seq", "kv_heads", "head_dim")


def _per_shard(run: attention_api.AttentionFn, *, track_max_logits: bool) -> attention_api.AttentionFn:
    """``run`` (a Pallas kernel) inside a logical `jax.shard_map`: batch and heads may be split, the sequence not."""
    if partition.logical_mesh_axes("heads") != partition.logical_mesh_axes("kv_heads"):
        raise ValueError(
            "model.attention=pallas needs heads and kv_heads sharded alike (query head h reads kv head h // group "
            "on each shard); give both logical axes the same rule"
        )

    def attention_kernel(q, k, v, *segment_ids):
        out, max_logits = run(q, k, v, *segment_ids)
        if not track_max_logits:
            return out
        batch_axes = partition.logical_mesh_axes("batch")
        return out, jax.lax.pmax(jax.lax.stop_gradient(max_logits), batch_axes) if batch_axes else max_logits

    out_logical = (_Q, ("heads",)) if track_max_logits else _Q

    def per_shard(q, k, v, segment_ids=None):
        args, specs = (q, k, v), [_Q, _KV, _KV]
        if segment_ids is not None:
            args, specs = (*args, segment_ids), [*specs, ("batch", "seq")]
        result = partition.logical_shard_map(attention_kernel, specs, out_logical, whole=("seq",))(*args)
        return result if track_max_logits else (result, None)

    return per_shard


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: str = "xla",
    track_max_logits: bool = False,
    segment_ids: jax.Array | None = None,
    context_parallel: str = "all_gather",
    zigzag: bool = False,
    window: int = 0,
    window_block: int = 1,
    window_limit: jax.Array | None = None,
):
    """Causal softmax attention, logits and softmax statistics in float32 (`attention_api.attention`).

    Args:
      q: ``(batch, seq, n_heads, head_dim)``; k, v: ``(batch, seq, n_kv_heads, head_dim)``.
      implementation: ``auto``, ``xla``, ``cudnn``, ``pallas`` or ``tokamax``.
      track_max_logits: also return the maximum pre-softmax logit of each query head over the
        batch and the causal (query, key) pairs, shape ``(n_heads,)``.
      segment_ids: ``(batch, seq)`` int or None; a query sees only keys of its own segment (document).
      context_parallel: with the sequence split over a ``context`` mesh axis, how keys and values
        reach the queries (`lm.parallel.context_attention`): ``all_gather``, ``ring`` or ``ulysses``.
      zigzag: the sequence is in the zig-zag layout of `lm.parallel.context_attention.model_order`.
      window, window_block: > 0: sliding-window attention (`kernels_pallas.attention.window`).
      window_limit: the window in blocks at this step, traced, inside the band of ``window`` (None: all of it).

    Returns:
      ``(out, max_logits)``: out ``(batch, seq, n_heads, head_dim)`` in q's dtype; max_logits is
      None unless tracked.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if context_attention.sequence_split() and not window:
        return context_attention.attend(
            q, k, v, mode=context_parallel, implementation=implementation, track_max_logits=track_max_logits,
            segment_ids=segment_ids, zigzag=zigzag,
        )
    return attention_api.attention(
        q,
        k,
        v,
        implementation=implementation,
        track_max_logits=track_max_logits,
        sequence_sharded=any(mesh.shape[a] > 1 for a in partition.logical_mesh_axes("seq")),
        per_shard=lambda run: _per_shard(run, track_max_logits=track_max_logits),
        segment_ids=segment_ids,
        window_size=window,
        window_block=window_block,
        window_limit=window_limit,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        dtype = cfg.compute_dtype
        out_scale = (2 * cfg.n_layers) ** -0.5
        self.cfg = cfg
        kw = {"dtype": dtype, "rngs": rngs, "fp8_recipe": fp8.recipe(cfg)}
        self.q_proj = linear(cfg.d_model, cfg.n_heads * cfg.head_dim, ("embed", "heads"), **kw)
        self.k_proj = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), **kw)
        self.v_proj = linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, ("embed", "kv_heads"), **kw)
        self.o_proj = linear(cfg.n_heads * cfg.head_dim, cfg.d_model, ("heads", "embed"), scale=out_scale, **kw)
        if cfg.qk_norm:
            self.q_norm = speedrun_blocks.norm(cfg, cfg.head_dim, "head_dim")
            self.k_norm = speedrun_blocks.norm(cfg, cfg.head_dim, "head_dim")
        self.window, self.layer = speedrun_config.layer_window(cfg, layer), layer
        if cfg.value_embeddings:
            self.v_lambdas = speedrun_blocks.scalars((0.5, 0.5))
        if cfg.parscale > 1:
            self.prefix = parscale.Prefix(cfg, rngs=rngs)

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys (both after RoPE at ``positions``) and values of ``x``, split into heads."""
        cfg = self.cfg
        q = split_heads(self.q_proj(x), cfg.n_heads, _Q)
        k = split_heads(self.k_proj(x), cfg.n_kv_heads, _KV)
        v = split_heads(self.v_proj(x), cfg.n_kv_heads, _KV)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.rotary_embedding(q, positions, cfg)
        if cfg.attention_scale:
            q = q * jnp.asarray(cfg.attention_scale * cfg.head_dim**0.5, q.dtype)  # the op's head_dim ** -0.5 then gives the scale
        return q, rope.rotary_embedding(k, positions, cfg), v

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, order: jax.typing.ArrayLike | None = None, ve: jax.Array | None = None,
        *, window_blocks: jax.Array | None = None,
    ):  # fmt: skip
        """``order``: the positions of ``x``'s rows when the model laid its sequence out zig-zag, else None;
        ``ve``: this block's value embedding ``(batch, seq, d_model)`` (`lm.speedrun_blocks.mix_values`);
        ``window_blocks``: the long window at this training step (`lm.speedrun_config.window_blocks`), or None."""
        cfg = self.cfg
        q, k, v = self._qkv(x, jnp.arange(x.shape[1]) if order is None else jnp.asarray(order))
        if cfg.value_embeddings:
            v = speedrun_blocks.mix_values(v, ve, self.v_lambdas[...])
        if cfg.parscale > 1:
            q, k, v = self.prefix.extend(q, k, v)
        q, k, v = checkpoint_name(q, remat.ATTN_Q), checkpoint_name(k, remat.ATTN_K), checkpoint_name(v, remat.ATTN_V)
        out, max_logits = attend(
            q,
            k,
            v,
            implementation=cfg.attention,
            track_max_logits=cfg.track_attn_logits,
            segment_ids=segment_ids,
            context_parallel=cfg.context_parallel,
            zigzag=order is not None,
            window=self.window,
            window_block=cfg.window_block,
            window_limit=None if window_blocks is None else speedrun_config.layer_window_blocks(cfg, self.layer, window_blocks),
        )
        out = checkpoint_name(out, remat.ATTN_CONTEXT)
        b, s = x.shape[:2]
        if cfg.parscale > 1:
            out = out[:, self.prefix.tokens :]
        return self.o_proj(out.reshape(b, s, -1)), max_logits

    def decode(
        self, x: jax.Array, cache: kv_cache.Cache, start: jax.Array, ve: jax.Array | None = None
    ) -> tuple[jax.Array, kv_cache.Cache]:
        """Attention of ``x`` ``(batch, s, d_model)`` (tokens at ``start ..``) over the cached keys and values.

        ``cache`` is one layer's ``{"k", "v": (batch, max_len, kv_heads, head_dim)}``; returns
        ``(out, cache with x's rows written)``. ``ve``: this block's value embedding, as in `__call__`;
        the layer's window, if any, at its full size.
        """
        cfg = self.cfg
        b, s = x.shape[:2]
        q, k, v = self._qkv(x, start + jnp.arange(s))
        if cfg.value_embeddings:
            v = speedrun_blocks.mix_values(v, ve, self.v_lambdas[...])
        cache = {"k": kv_cache.write(cache["k"], k, start), "v": kv_cache.write(cache["v"], v, start)}
        grouped = q.reshape(b, s, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim)
        scores = lambda keys: jnp.einsum("bskgd,btkd->bkgst", grouped, keys, preferred_element_type=jnp.float32)  # noqa: E731
        mix = lambda probs, values: jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), values)  # noqa: E731
        logits, visible_to = scores(cache["k"]), start
        if cfg.parscale > 1:
            # The prefix positions go first and every query sees them. Only the logits are joined: joining
            # the keys and values would copy the whole cache at every step.
            prefix_k, prefix_v = self.prefix.rows(cache["k"])
            logits, visible_to = jnp.concatenate([scores(prefix_k), logits], axis=-1), start + self.prefix.tokens
        probs = kv_cache.causal_softmax(logits * cfg.head_dim**-0.5, visible_to, window=self.window, block=cfg.window_block)
        if cfg.parscale > 1:
            t = self.prefix.tokens
            out = mix(probs[..., :t], prefix_v) + mix(probs[..., t:], cache["v"])
        else:
            out = mix(probs, cache["v"])
        return self.o_proj(out.reshape(b, s, -1)), cache
