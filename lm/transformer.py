"""The decoder-only transformer, written for one device; GSPMD partitions it from logical names.

    h_0 = E[tokens]
    h_l = h_{l-1} + Attn(RMSNorm(h_{l-1}));  h_l = h_l + SwiGLU(RMSNorm(h_l))
    logits = RMSNorm(h_L) @ W_out            (W_out = E^T when embeddings are tied)

With ``model.parscale = P > 1`` the blocks run on P streams of each sequence and the final states are
mixed before the head (ParScale, `lm/parscale.py`).

With ``scan_layers`` the blocks' parameters are stacked along a leading ``layers`` axis and one block
is compiled and scanned over depth, so compile time does not grow with the number of layers; on XLA:CPU
the scan is unrolled by default (`layers_per_iteration`), which is faster there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm import fp8, kv_cache, lightning, parscale, speedrun_blocks, speedrun_config
from lm import remat as remat_lib
from lm.attention import Attention
from lm.config import ModelConfig
from lm.layers import Embed, SwiGLU, linear
from lm.mla import MultiHeadLatentAttention
from lm.moe import MoE
from lm.parallel import context_attention, pipeline
from sharding.partition import constrain

ACTIVATION = ("batch", "seq", "embed")


class Block(nnx.Module):
    """One pre-norm block; its MLP is a routed MoE (`lm/moe.py`) when ``moe``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False, layer: int = 0):
        dtype = cfg.compute_dtype
        self.x0_mixing = cfg.x0_mixing
        if cfg.x0_mixing:
            self.x0_lambdas = speedrun_blocks.scalars((1.0, 0.0))
        self.attn_norm = speedrun_blocks.norm(cfg, cfg.d_model, "embed")
        if layer in speedrun_config.skipped_attention(cfg):
            self.attn = None
        elif lightning.is_lightning_layer(cfg, layer):
            self.attn = lightning.LightningAttention(cfg, layer, rngs=rngs)
        elif cfg.attention_type == "mla":
            self.attn = MultiHeadLatentAttention(cfg, rngs=rngs)
        else:
            self.attn = Attention(cfg, rngs=rngs, layer=layer)
        self.mlp_norm = speedrun_blocks.norm(cfg, cfg.d_model, "embed")
        if moe:
            self.mlp = MoE(cfg, rngs=rngs)
        elif cfg.mlp_activation == "relu2":
            self.mlp = speedrun_blocks.ReluSquaredMLP(
                cfg.d_model, cfg.mlp_dim, out_scale=(2 * cfg.n_layers) ** -0.5, dtype=dtype, rngs=rngs, fp8_recipe=fp8.recipe(cfg)
            )
        else:
            self.mlp = SwiGLU(
                cfg.d_model, cfg.mlp_dim, out_scale=(2 * cfg.n_layers) ** -0.5, dtype=dtype, rngs=rngs, fp8_recipe=fp8.recipe(cfg)
            )

    def __call__(
        self, x: jax.Array, segment_ids: jax.Array | None = None, order: np.ndarray | None = None,
        x0: jax.Array | None = None, ve: jax.Array | None = None, window_blocks: jax.Array | None = None,
    ):  # fmt: skip
        """``x -> (x', (attention max logits or None, MoE statistics or None))``; tokens attend within their segment.

        ``order``: the positions of ``x``'s rows when the sequence is in the zig-zag layout
        (`lm.parallel.context_attention.model_order`), else None (in order). ``x0`` (x0 mixing) and
        ``ve`` (this block's value embedding) come from `lm.speedrun_blocks.run_blocks`; ``window_blocks``: the
        long attention window at this training step (`lm.speedrun_config.window_blocks`), None: the full window.
        """
        max_logits = None
        if self.x0_mixing and x0 is not None:
            lambdas = self.x0_lambdas[...].astype(x.dtype)
            x = lambdas[0] * x + lambdas[1] * x0
        if self.attn is not None:
            window = {} if window_blocks is None else {"window_blocks": window_blocks}
            attn_out, max_logits = self.attn(self.attn_norm(x), segment_ids, order, *(() if ve is None else (ve,)), **window)
            x = constrain(x + attn_out, ACTIVATION)
        mlp_out = self.mlp(self.mlp_norm(x))
        mlp_out, moe_stats = mlp_out if isinstance(self.mlp, MoE) else (mlp_out, None)
        x = constrain(x + mlp_out, ACTIVATION)
        return x, (max_logits, moe_stats)

    def decode(
        self, x: jax.Array, cache: kv_cache.Cache, start: jax.Array, x0: jax.Array | None = None, ve: jax.Array | None = None
    ) -> tuple[jax.Array, kv_cache.Cache]:
        """The block on new tokens at ``start ..``, attending over and extending this layer's ``cache``; ``x0``
        and ``ve`` as in `__call__` (a block without attention passes its cache through)."""
        if self.x0_mixing and x0 is not None:
            lambdas = self.x0_lambdas[...].astype(x.dtype)
            x = lambdas[0] * x + lambdas[1] * x0
        if self.attn is not None:
            attn_out, cache = self.attn.decode(self.attn_norm(x), cache, start, *(() if ve is None else (ve,)))
            x = x + attn_out
        h = self.mlp_norm(x)
        return x + (self.mlp(h, decoding=True)[0] if isinstance(self.mlp, MoE) else self.mlp(h)), cache


def _block_fn(
    cfg: ModelConfig, segment_ids: jax.Array | None, order: np.ndarray | None = None, *, straight_line: bool,
    window_blocks: jax.Array | None = None,
):  # fmt: skip
    """``(block, x) -> block(x, segment_ids, order)`` under the config's remat policy (`lm/remat.py`), with
    ``window_blocks`` (`Block.__call__`) when given.

    ``straight_line``: the blocks run as straight-line code (unrolled layers, or a fully unrolled
    scan), where CSE could merge the backward pass's recomputation with the forward pass and undo the
    remat, so it gets prevent_cse's optimisation barriers; a rolled scan body is not merged with its
    neighbours and needs none.
    """
    kw = {} if window_blocks is None else {"window_blocks": window_blocks}
    call = lambda blk, h, *extra: blk(h, segment_ids, order, *extra, **kw)  # noqa: E731
    if cfg.remat == "none":
        return call
    return nnx.remat(call, policy=remat_lib.POLICIES[cfg.remat], prevent_cse=straight_line)


def document_segments(cfg: ModelConfig, tokens: jax.Array) -> jax.Array | None:
    """Segment ids for document masking: segment k is the tokens from the k-th separator on (a separator opens its document)."""
    return None if cfg.document_separator is None else jnp.cumsum(tokens == cfg.document_separator, axis=1)


def in_model_layout(cfg: ModelConfig, x: jax.Array | None) -> jax.Array | None:
    """``x`` ``(batch, seq, ...)`` permuted along ``seq`` into the model's layout (`lm.parallel.context_attention.model_order`)."""
    order = None if x is None else context_attention.model_order(cfg.context_parallel, x.shape[1])
    return x if order is None else constrain(x[:, order], ("batch", "seq", *(None,) * (x.ndim - 2)))


def layers_per_iteration(cfg: ModelConfig, n_blocks: int) -> int:
    """Blocks per iteration of the scan over ``n_blocks`` stacked blocks: ``cfg.scan_unroll``, or with 0
    (auto) all of them on XLA:CPU without remat where XLA optimises, and one otherwise.

    XLA:CPU keeps a rolled scan's residuals for the backward pass in zero-filled ``(layers, ...)``
    stacks written and read by dynamic slices; fully unrolled they are plain buffers and the step is
    faster (docs/benchmarks.md section 14, 2 cores: `tiny` 1.20x, `small` 1.06x; compile time no
    higher). Under a remat policy the scan stays rolled: in straight-line code XLA:CPU schedules the
    recomputation early and keeps what it should free (temporaries of a `tiny` gradient with
    ``remat="full"``: 43 MiB rolled, 125 MiB unrolled, as without remat). It also stays rolled when
    XLA is told to skip most optimisations (``jax_disable_most_optimizations``: compile time before
    run time): at XLA's lowest level the unrolled `tiny` step compiles in 0.82 CPU-s instead of 0.48
    and gains only 0.09 CPU-s a step (docs/benchmarks.md 22k). On accelerators one block per
    iteration keeps compile time flat in depth.
    """
    if cfg.scan_unroll:
        return min(cfg.scan_unroll, n_blocks)
    optimised = not jax.config.read("jax_disable_most_optimizations")
    return n_blocks if jax.default_backend() == "cpu" and cfg.remat == "none" and optimised else 1


def scan_blocks(cfg: ModelConfig, blocks: Block, x: jax.Array, segment_ids: jax.Array | None, order: np.ndarray | None = None):
    """The stacked ``blocks`` (leading ``layers`` axis) scanned over ``x``: ``(x', per-layer aux)``."""
    n_blocks = jax.tree.leaves(nnx.state(blocks, nnx.Param))[0].shape[0]
    unroll = layers_per_iteration(cfg, n_blocks)
    scan = nnx.scan(
        _block_fn(cfg, segment_ids, order, straight_line=unroll == n_blocks),
        in_axes=(0, nnx.Carry),
        out_axes=(nnx.Carry, 0),
        unroll=unroll,
        transform_metadata={nnx.PARTITION_NAME: "layers"},
    )
    return scan(blocks, x)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = cfg.compute_dtype
        self.embed = Embed(
            cfg.embed_vocab_size or cfg.vocab_size,
            cfg.d_model,
            dtype=dtype,
            param_dtype=jnp.float32,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(cfg.d_model**-0.5), ("vocab", "embed")),
            rngs=rngs,
        )
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs, moe=cfg.n_experts > 0)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs, moe=cfg.is_moe_layer(i), layer=i) for i in range(cfg.n_layers)])
        self.final_norm = speedrun_blocks.norm(cfg, cfg.d_model, "embed")
        if cfg.zero_init_head:
            self.lm_head = speedrun_blocks.zero_head(cfg, rngs)
        elif not cfg.tie_embeddings:
            self.lm_head = linear(
                cfg.d_model, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs, fp8_recipe=fp8.recipe(cfg, head=True)
            )
        if cfg.parscale > 1:
            self.aggregate = parscale.Aggregator(cfg, rngs=rngs)
        if cfg.x0_mixing:
            self.embed_norm = speedrun_blocks.norm(cfg, cfg.d_model, "embed")
        if cfg.value_embeddings:
            self.value_embeds = speedrun_blocks.value_tables(cfg, rngs)
        if cfg.unet_skips:
            self.skip_weights = speedrun_blocks.scalars([1.0] * (cfg.n_layers - cfg.n_layers // 2))

    def __call__(self, tokens: jax.Array, *, return_aux: bool = False, model_layout: bool = False, window_blocks: jax.Array | None = None):
        """Logits ``(batch, seq, vocab)`` for ``tokens`` ``(batch, seq)``.

        Under a ``context`` split with ring or all-gather attention the sequence runs in zig-zag
        layout (`lm.parallel.context_attention.model_order`): tokens and segment ids are permuted once here and
        RoPE reads the permuted positions. The logits are inverted to sequence order unless
        ``model_layout`` (for a token-mean loss, whose targets `in_model_layout` permutes alike).

        With ``return_aux`` returns ``(logits, aux)``; ``aux["attn_max_logits"]`` is
        ``(n_layers, n_heads)`` when ``track_attn_logits`` is on; ``aux["moe"]`` holds the MoE
        layers' statistics stacked over those layers (`lm.moe.balancing_losses`) in an MoE model.
        ``window_blocks``: the long attention window at this training step (`features`).
        """
        features, aux = self.features(tokens, window_blocks)
        logits = self.head(features)
        order = context_attention.model_order(self.cfg.context_parallel, tokens.shape[1])
        if order is not None and not model_layout:
            logits = constrain(logits[:, np.argsort(order)], ("batch", "seq", "vocab"))
        return (logits, aux) if return_aux else logits

    def features(self, tokens: jax.Array, window_blocks: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """``(RMSNorm(h_L), aux)``: the head's input ``(batch, seq, d_model)`` in the model's layout, and `__call__`'s aux.

        ``window_blocks``: a traced long window in blocks (`lm.speedrun_config.window_blocks`) for the unrolled stack's
        windowed attention; None: every window at its full ``model.attention_window``."""
        cfg = self.cfg
        segment_ids = document_segments(cfg, tokens)  # from the tokens in order
        order = context_attention.model_order(cfg.context_parallel, tokens.shape[1])
        tokens, segment_ids = in_model_layout(cfg, tokens), in_model_layout(cfg, segment_ids)
        x = self._streams(constrain(self.embed(tokens), ACTIVATION))
        if cfg.scan_layers and pipeline.stage_count() > 1:
            run_group = lambda blocks, h, seg: scan_blocks(cfg, blocks, h, seg, order)[0]  # noqa: E731
            x = pipeline.run_stack(self.blocks, x, segment_ids, run_group, cfg)
            max_logits = moe_stats = None
        elif cfg.scan_layers:
            x, (max_logits, moe_stats) = scan_blocks(cfg, self.blocks, x, segment_ids, order)
        else:
            run_block = _block_fn(cfg, segment_ids, order, straight_line=True, window_blocks=window_blocks)
            if speedrun_config.layer_dependent(cfg):
                x, per_layer = speedrun_blocks.run_blocks(self, tokens, x, run_block)
            else:
                per_layer = []
                for block in self.blocks:
                    x, layer_aux = run_block(block, x)
                    per_layer.append(layer_aux)
            max_logits = jnp.stack([m for m, _ in per_layer]) if cfg.track_attn_logits else None
            moe_layers = [stats for _, stats in per_layer if stats is not None]
            moe_stats = jax.tree.map(lambda *xs: jnp.stack(xs), *moe_layers) if moe_layers else None
        aux = {"attn_max_logits": max_logits} if cfg.track_attn_logits else {}
        if moe_stats is not None:
            aux["moe"] = moe_stats
        return self._final_states(x), aux

    def head_matrix(self) -> tuple[jax.Array, bool]:
        """The LM head's float32 weight and whether its vocabulary axis comes first: the tied embedding
        ``(vocab, d_model)``, or the untied ``lm_head`` kernel ``(d_model, vocab)``."""
        if self.cfg.tie_embeddings:
            return self.embed.embedding[...], True
        return self.lm_head.kernel[...], False

    def head(self, features: jax.Array) -> jax.Array:
        """Logits ``(batch, seq, vocab)`` in the compute dtype (float32 under a soft-cap) from `features`' output."""
        logits = self.embed.attend(features) if self.cfg.tie_embeddings else self.lm_head(features)
        return constrain(speedrun_blocks.softcap(logits, self.cfg.logit_softcap), ("batch", "seq", "vocab"))

    def _streams(self, x: jax.Array) -> jax.Array:
        """The embedded tokens ``(B, S, D)`` as the decoder's input: ``(B P, S, D)`` for ParScale's P streams."""
        return parscale.expand(x, self.cfg.parscale) if self.cfg.parscale > 1 else x

    def _final_states(self, x: jax.Array) -> jax.Array:
        """``RMSNorm(h_L)``, the P streams' aggregated (`lm.parscale.Aggregator`) with ParScale."""
        h = self.final_norm(x)
        return self.aggregate(h) if self.cfg.parscale > 1 else h

    def _logits(self, x: jax.Array) -> jax.Array:
        return self.head(self._final_states(x))

    def decode(self, tokens: jax.Array, cache: kv_cache.Cache, start: jax.Array) -> tuple[jax.Array, kv_cache.Cache]:
        """Logits ``(batch, s, vocab)`` of ``tokens`` ``(batch, s)`` at positions ``start ..``, and the cache.

        ``cache`` (`lm.kv_cache`) holds the earlier positions' keys and values (or MLA latents); the
        returned one also holds ``tokens``'. With ``start=0`` and an empty cache this is prefill and
        equals ``__call__``'s logits; an MoE model with a ``capacity_factor`` decodes dropless, so it equals
        ``__call__`` at ``capacity_factor=0``.
        """
        x = self._streams(constrain(self.embed(tokens), ACTIVATION))
        if speedrun_config.layer_dependent(self.cfg):
            layer_caches = iter([jax.tree.map(lambda c, i=i: c[i], cache) for i in range(self.cfg.n_layers)])
            run_block = lambda block, h, x0, ve: block.decode(h, next(layer_caches), start, x0, ve)  # noqa: E731  in layer order
            x, per_layer = speedrun_blocks.run_blocks(self, tokens, x, run_block)
            cache = jax.tree.map(lambda *c: jnp.stack(c), *per_layer)
        elif self.cfg.scan_layers:
            scan = nnx.scan(
                lambda block, h, layer_cache: block.decode(h, layer_cache, start),
                in_axes=(0, nnx.Carry, 0),
                out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            x, cache = scan(self.blocks, x, cache)
        elif self.cfg.attention_type == "lightning":
            x, cache = lightning.decode_blocks(self.cfg, self.blocks, x, cache, start)
        else:
            per_layer = []
            for i, block in enumerate(self.blocks):
                x, layer_cache = block.decode(x, jax.tree.map(lambda c: c[i], cache), start)  # noqa: B023
                per_layer.append(layer_cache)
            cache = jax.tree.map(lambda *c: jnp.stack(c), *per_layer)
        return self._logits(x), cache
