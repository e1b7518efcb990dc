"""Autoregressive sampling with a KV cache: temperature, top-k and top-p (nucleus) filtering.

For next-token logits ``z`` the sampled distribution is ``softmax(z' / T)`` where ``z'`` keeps

- top-k: the ``k`` largest logits (others to ``-inf``); ``k = 0`` keeps all;
- top-p (Holtzman et al., arXiv:1904.09751): the smallest set of most probable tokens whose
  probability under ``softmax(z / T)`` reaches ``p``, i.e. token ``i`` (in decreasing order of
  probability) is kept when the mass of the tokens before it is ``< p``; ``p = 1`` keeps all.

Top-k applies first, then top-p on what it kept. ``T = 0`` is greedy decoding (argmax). Generation
runs the prompt through the model once (prefill, filling the cache), then one token per step under
`jax.lax.scan`, each step attending over the cache (`lm.kv_cache`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from lm import kv_cache
from lm import model as model_lib


def check_settings(temperature: float, top_k: int, top_p: float) -> None:
    """A one-line ValueError naming the fix for settings outside their ranges (temperature 0 is greedy)."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy decoding)")
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k={top_k} must be >= 0 and top_p={top_p} in (0, 1]")


def filter_logits(logits: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """``logits / temperature`` (float32) with the tokens outside top-k and top-p set to ``-inf``."""
    check_settings(temperature, top_k, top_p)
    if temperature == 0:
        raise ValueError("temperature=0 is greedy decoding (next_token), not a distribution to filter")
    logits = logits.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def next_token(rng: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """One token id per row of ``logits`` ``(batch, vocab)``; greedy when ``temperature == 0``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def make_generate(
    model_def: model_lib.ModelDef,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    valid_vocab: int | None = None,
) -> Callable[[model_lib.Params, jax.Array, jax.Array], jax.Array]:
    """A jitted ``generate(params, prompt, rng)``: ``prompt`` ``(batch, P)`` int32 followed by
    ``max_new_tokens`` sampled tokens, ``(batch, P + max_new_tokens)``.

    ``valid_vocab`` excludes the ids at and above it (a model vocabulary padded past the tokenizer's).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    check_settings(temperature, top_k, top_p)
    cfg = model_def.config

    def pick(rng, logits):
        if valid_vocab is not None:
            logits = jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, -jnp.inf)
        return next_token(rng, logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def generate(params: model_lib.Params, prompt: jax.Array, rng: jax.Array) -> jax.Array:
        batch, prompt_len = prompt.shape
        if prompt_len + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"the prompt's {prompt_len} tokens and max_new_tokens={max_new_tokens} need {prompt_len + max_new_tokens} "
                f"positions, beyond model.max_seq_len={cfg.max_seq_len}; shorten the prompt or decode fewer tokens"
            )
        cache = kv_cache.init(cfg, batch, prompt_len + max_new_tokens)
        logits, cache = model_lib.decode(model_def, params, prompt, cache, jnp.int32(0))
        rngs = jax.random.split(rng, max_new_tokens)
        first = pick(rngs[0], logits[:, -1])

        def step(carry, rng_and_position):
            token, cache = carry
            rng, position = rng_and_position
            logits, cache = model_lib.decode(model_def, params, token[:, None], cache, position)
            new = pick(rng, logits[:, -1])
            return (new, cache), new

        positions = prompt_len + jnp.arange(max_new_tokens - 1, dtype=jnp.int32)
        _, rest = jax.lax.scan(step, (first, cache), (rngs[1:], positions))
        return jnp.concatenate([prompt.astype(jnp.int32), first[:, None], rest.T], axis=1)

    return jax.jit(generate)
