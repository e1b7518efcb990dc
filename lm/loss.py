"""Next-token cross-entropy in float32, with optional z-loss, and model FLOPs per token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.model import param_counts


def cross_entropy(logits: jax.Array, targets: jax.Array, *, z_loss: float = 0.0) -> tuple[jax.Array, dict]:
    """Mean over tokens of ``logsumexp(z) - z[target] + z_loss * logsumexp(z)^2``.

    The z-loss term (PaLM, arXiv:2204.02311) keeps the softmax normaliser near 1. All in float32,
    recomputed in the backward pass from ``logits`` (`jax.checkpoint`): left to autodiff, the backward
    pass would keep ``exp(logits)`` in float32, ``(batch, seq, vocab)``, twice the bytes of bf16 logits
    (3.1 GiB for gpt2-124m at 16 x 1024 tokens).

    Returns:
      ``(loss, metrics)`` with metrics ``nll`` (the cross-entropy alone, nats per token) and ``z_loss``.
    """
    nll, z_term = _nll_and_z_term(logits, targets, z_loss)
    return nll + z_term, {"nll": nll, "z_loss": z_term}


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _nll_and_z_term(logits: jax.Array, targets: jax.Array, z_loss: float) -> tuple[jax.Array, jax.Array]:
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.mean(log_z - target_logit), z_loss * jnp.mean(jnp.square(log_z))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6 N + 12 L H d_head T``.

    ``N`` counts the active matrix-multiply parameters, read off the parameter tree
    (`lm.model.param_counts`: the embedding lookup is free, the LM head is not, a routed expert
    stack counts ``experts_per_token / n_experts``), ``12 L H d_head T`` is attention's score and
    value products (PaLM, arXiv:2204.02311, App. B; the causal mask's savings are not counted, as
    is customary for MFU).
    """
    matmul_params = param_counts(cfg).active_matmul
    score_and_value = cfg.head_dim + (cfg.rope_head_dim if cfg.attention_type == "mla" else 0) + cfg.value_head_dim
    return 6.0 * matmul_params + 6.0 * cfg.n_layers * cfg.n_heads * score_and_value * seq_len
