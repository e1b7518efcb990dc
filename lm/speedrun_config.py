"""The speedrun options of `lm.config.ModelConfig`: their checks and their per-layer layout.

modded-nanogpt's GPT-2 speedrun (github.com/KellerJordan/modded-nanogpt, track 1) trains a model with
options this module names; `lm.speedrun_blocks` computes them. Layer ``l`` of ``n``:

- value embeddings (``value_embeddings = k``): table ``l`` for ``l < k``, table ``l - (n - k)`` for
  ``l >= n - k``, none in between (the record's "012 ... 012" pattern);
- windows (``attention_window = W``, ``window_pattern``): ``W`` for an ``L``, ``W / 2`` for an ``S``;
  with ``window_warmup = K`` they grow during training (`window_blocks`, `layer_window_blocks`);
- U-net skips: blocks ``0 .. n/2 - 1`` are the encoder, the rest the decoder.

Nothing here imports `lm.config`, which calls `problems` from its own checks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

MLP_ACTIVATIONS = ("swiglu", "relu2")


def skipped_attention(cfg: Any) -> frozenset[int]:
    """The blocks without attention (``model.skip_attention``, comma-separated layer indices)."""
    return frozenset(int(x) for x in str(cfg.skip_attention).replace(" ", "").split(",") if x)


def layer_dependent(cfg: Any) -> bool:
    """Whether blocks differ by layer or read more than the previous block's output: such a stack runs
    unrolled (`lm.speedrun_blocks.run_blocks`), never scanned."""
    return bool(cfg.value_embeddings or cfg.unet_skips or cfg.x0_mixing or cfg.skip_attention or cfg.window_pattern)


def layer_window(cfg: Any, layer: int) -> int:
    """Attention window of block ``layer`` in tokens; 0: full causal attention."""
    if not cfg.attention_window:
        return 0
    short = cfg.window_pattern and cfg.window_pattern[layer].upper() == "S"
    return cfg.attention_window // 2 if short else cfg.attention_window


def window_blocks(cfg: Any, step: jax.typing.ArrayLike) -> jax.Array:
    """The long window at training ``step`` in blocks of ``B = window_block`` tokens, growing over ``K = window_warmup``
    steps as record 21's ``next_multiple_of_n(1728 * step / K, n=128)`` tokens (``1728 = W - B / 2`` for ``W = 1792``)::

        n_t = max(1, ceil((W - B / 2) min(t, K) / (K B)))      from 1 block at t = 0 to W / B at t = K

    in exact integer arithmetic (``(2W - B) t`` over ``2 B K``)."""
    w, b, k = cfg.attention_window, cfg.window_block, cfg.window_warmup
    t = jnp.minimum(jnp.asarray(step, jnp.int32), k)
    return jnp.maximum(1, -(-(2 * w - b) * t // (2 * b * k)))


def layer_window_blocks(cfg: Any, layer: int, long_blocks: jax.Array) -> jax.Array:
    """Block ``layer``'s window in blocks when the long one is ``long_blocks``: all of it for an ``L``, half
    (at least one block, as the record's block mask keeps the diagonal block) for an ``S``."""
    short = cfg.window_pattern and cfg.window_pattern[layer].upper() == "S"
    return jnp.maximum(long_blocks // 2, 1) if short else long_blocks


def attended_keys(cfg: Any, seq_len: int) -> int:
    """Keys per query summed over the blocks with attention, counting every key of a full causal
    layer (``seq_len``) and at most ``window`` of a windowed one: FLOPs per token's attention factor."""
    skipped = skipped_attention(cfg)
    return sum(min(seq_len, layer_window(cfg, layer) or seq_len) for layer in range(cfg.n_layers) if layer not in skipped)


def value_table(cfg: Any, layer: int) -> int | None:
    """Which value-embedding table block ``layer`` mixes into its values, or None."""
    k, n = cfg.value_embeddings, cfg.n_layers
    if layer < k:
        return layer
    if layer >= n - k:
        return layer - (n - k)
    return None


def problems(cfg: Any) -> list[str]:
    """What is wrong with the speedrun options of ``cfg``, each with its fix."""
    out = []
    if cfg.mlp_activation not in MLP_ACTIVATIONS:
        out.append(f"model.mlp_activation={cfg.mlp_activation!r} must be one of {', '.join(MLP_ACTIVATIONS)}")
    if cfg.zero_init_head and cfg.tie_embeddings:
        out.append("model.zero_init_head needs an untied head: set model.tie_embeddings=False")
    if cfg.logit_softcap < 0 or cfg.attention_scale < 0:
        out.append("model.logit_softcap and model.attention_scale must be >= 0 (0: off / head_dim ** -0.5)")
    if cfg.embed_vocab_size and (cfg.tie_embeddings or not 0 < cfg.embed_vocab_size <= cfg.vocab_size):
        out.append(
            f"model.embed_vocab_size={cfg.embed_vocab_size} must be in (0, model.vocab_size={cfg.vocab_size}] with "
            "model.tie_embeddings=False (a head padded wider than the embeddings)"
        )
    if cfg.value_embeddings and (cfg.value_embeddings < 0 or 2 * cfg.value_embeddings > cfg.n_layers):
        out.append(f"model.value_embeddings={cfg.value_embeddings} must be in [0, model.n_layers / 2]")
    if cfg.value_embeddings and cfg.n_kv_heads * cfg.head_dim != cfg.d_model:
        out.append("model.value_embeddings needs model.n_kv_heads * model.head_dim == model.d_model (a table row is one token's values)")
    if cfg.unet_skips and cfg.n_layers % 2:
        out.append(f"model.unet_skips pairs encoder and decoder blocks: model.n_layers={cfg.n_layers} must be even")
    skipped = skipped_attention(cfg)
    if any(not 0 <= i < cfg.n_layers for i in skipped):
        out.append(f"model.skip_attention={cfg.skip_attention!r} names layers outside [0, model.n_layers={cfg.n_layers})")
    if cfg.attention_window < 0 or cfg.window_block < 1 or cfg.attention_window % (2 * cfg.window_block if cfg.window_pattern else cfg.window_block):
        out.append(
            f"model.attention_window={cfg.attention_window} must be >= 0 and a multiple of model.window_block={cfg.window_block} "
            "(twice it with a window_pattern, whose short windows are half as long)"
        )
    if cfg.window_warmup < 0 or (cfg.window_warmup and (not cfg.attention_window or cfg.scan_layers)):
        out.append(
            f"model.window_warmup={cfg.window_warmup} must be >= 0 and needs a model.attention_window to grow to in an "
            "unrolled stack (model.scan_layers=False)"
        )
    if cfg.window_pattern and (len(cfg.window_pattern) != cfg.n_layers or set(cfg.window_pattern.upper()) - {"L", "S"}):
        out.append(f"model.window_pattern={cfg.window_pattern!r} needs one letter L (long) or S (short) per layer")
    if layer_dependent(cfg) and cfg.scan_layers:
        out.append(
            "model.value_embeddings, unet_skips, x0_mixing, skip_attention and window_pattern make blocks differ by layer or "
            "read earlier blocks' outputs, which a scan over one block cannot; set model.scan_layers=False"
        )
    if (cfg.value_embeddings or cfg.attention_window or skipped or cfg.attention_scale) and cfg.attention_type != "gqa":
        out.append("model.value_embeddings, attention_window, skip_attention and attention_scale apply to gqa attention only")
    if skipped and cfg.track_attn_logits:
        out.append("model.track_attn_logits needs attention in every block; clear model.skip_attention")
    if cfg.attention_window and cfg.track_attn_logits:
        out.append("model.track_attn_logits needs full attention (windowed attention keeps no max logits); set model.attention_window=0")
    if cfg.mlp_activation != "swiglu" and cfg.n_experts:
        out.append("model.mlp_activation applies to dense blocks; MoE experts are SwiGLU")
    return out
