"""The modules and the block stack of modded-nanogpt's GPT-2 speedrun options (`lm.speedrun_config`).

Record 21 of github.com/KellerJordan/modded-nanogpt (track 1, 2025-01-26; `train_gpt.py` in its log)
defines, for blocks ``l = 0 .. n - 1`` with ``x0 = RMSNorm(E[tokens])``::

    ReLU^2 MLP          mlp(x) = W_down relu(W_up x)^2                        (So et al., arXiv:2109.08668)
    x0 mixing           x <- a_l x + b_l x0,   (a_l, b_l) learned, init (1, 0)
    value embeddings    v <- c_l v + d_l V_t[tokens]  for the blocks with a table t (else v <- c_l v),
                        (c_l, d_l) learned, init (0.5, 0.5)              (value residual, arXiv:2410.17897)
    U-net skips         encoder blocks l < n/2 push their outputs; decoder block n/2 + i first adds
                        w_i * (the last pushed output, popped), w learned, init 1
    soft-cap            logits <- c tanh(z / c)                                  (Gemma 2, arXiv:2408.00118)
    head                untied, initialised to zero

The record's ``30 sigmoid(z / 7.5)`` is ``15 tanh(z / 15) + 15``: a soft-cap of 15 shifted by a
constant, which no softmax sees. Its norms have no scale (``model.norm_scale=False``: `ScalelessRMSNorm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lm import fp8, speedrun_config
from lm.layers import Embed, RMSNorm, linear, rms_norm
from sharding.partition import constrain


class ScalelessRMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x^2) + eps)`` in float32, no parameter (PyTorch's ``F.rms_norm`` without a weight)."""

    def __init__(self, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, jnp.ones((), jnp.float32), self.eps, self.dtype)


def norm(cfg, dim: int, axis_name: str) -> RMSNorm | ScalelessRMSNorm:
    """The model's RMSNorm over ``dim`` features: with a learned scale unless ``model.norm_scale=False``."""
    if cfg.norm_scale:
        return RMSNorm(dim, axis_name, eps=cfg.norm_eps, dtype=cfg.compute_dtype)
    return ScalelessRMSNorm(eps=cfg.norm_eps, dtype=cfg.compute_dtype)


def scalars(init: Sequence[float]) -> nnx.Param:
    """A float32 vector of learned scalars (replicated; an element-wise optimizer's by `optim.labels`)."""
    return nnx.Param(jnp.asarray(init, jnp.float32), out_sharding=(None,))


@jax.checkpoint
def relu_squared(x: jax.Array) -> jax.Array:
    """``relu(x)^2``, recomputed in the backward pass (as `lm.layers.swiglu_gate`)."""
    return jnp.square(jax.nn.relu(x))


class ReluSquaredMLP(nnx.Module):
    """``down(relu(up(x))^2)``."""

    def __init__(
        self, d_model: int, hidden: int, *, out_scale: float, dtype: jnp.dtype, rngs: nnx.Rngs, fp8_recipe: fp8.Recipe | None = None
    ):
        self.up_proj = linear(d_model, hidden, ("embed", "mlp"), dtype=dtype, rngs=rngs, fp8_recipe=fp8_recipe)
        self.down_proj = linear(hidden, d_model, ("mlp", "embed"), dtype=dtype, rngs=rngs, scale=out_scale, fp8_recipe=fp8_recipe)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(constrain(relu_squared(self.up_proj(x)), ("batch", "seq", "mlp")))


def zero_head(cfg, rngs: nnx.Rngs) -> nnx.Linear:
    """The untied LM head ``(d_model, vocab)``, all zeros (every token equally likely at step 0)."""
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed", "vocab"))
    return nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype, param_dtype=jnp.float32, kernel_init=init, rngs=rngs
    )


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(logits / cap)`` in float32; ``cap = 0`` leaves the logits as they are."""
    return logits if not cap else cap * jnp.tanh(logits.astype(jnp.float32) / cap)


def value_tables(cfg, rngs: nnx.Rngs) -> nnx.List:
    """``model.value_embeddings`` token tables ``(vocab, d_model)``, initialised like the token embedding."""
    rows = cfg.embed_vocab_size or cfg.vocab_size
    init = nnx.with_partitioning(nnx.initializers.normal(cfg.d_model**-0.5), ("vocab", "embed"))
    return nnx.List([
        Embed(rows, cfg.d_model, dtype=cfg.compute_dtype, param_dtype=jnp.float32, embedding_init=init, rngs=rngs)
        for _ in range(cfg.value_embeddings)
    ])


def mix_values(v: jax.Array, ve: jax.Array | None, lambdas: jax.Array) -> jax.Array:
    """``c v + d ve`` (``c v`` without a table), ``ve`` ``(batch, seq, d_model)`` split into ``v``'s heads."""
    mixed = lambdas[0].astype(v.dtype) * v
    return mixed if ve is None else mixed + lambdas[1].astype(v.dtype) * ve.reshape(v.shape)


def run_blocks(model, tokens: jax.Array, x: jax.Array, run_block: Callable) -> tuple[jax.Array, list]:
    """The unrolled stack with x0 mixing, value embeddings and U-net skips (module docstring).

    ``model``: the `lm.transformer.Transformer`; ``x``: the embedded ``tokens``; ``run_block(block, x,
    x0, ve) -> (x', aux)``. Returns the last block's output and each block's aux.
    """
    cfg = model.cfg
    if cfg.x0_mixing:
        x = model.embed_norm(x)
    x0, skips, per_layer = x, [], []
    tables = [table(tokens) for table in model.value_embeds] if cfg.value_embeddings else []
    encoder = cfg.n_layers // 2 if cfg.unet_skips else cfg.n_layers
    for layer, block in enumerate(model.blocks):
        if layer >= encoder:
            x = x + model.skip_weights[...][layer - encoder].astype(x.dtype) * skips.pop()
        t = speedrun_config.value_table(cfg, layer) if tables else None
        x, aux = run_block(block, x, x0, None if t is None else tables[t])
        if cfg.unet_skips and layer < encoder:
            skips.append(x)
        per_layer.append(aux)
    return x, per_layer
