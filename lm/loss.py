"""Next-token cross-entropy in float32, with optional z-loss, and model FLOPs per token.

`next_token_loss` is the training loss of a model on a batch. Above a size (``model.loss_chunk``) it
fuses the LM head into the loss and runs both over chunks of tokens (`chunked_cross_entropy`), so the
``(tokens, vocab)`` logits never exist whole: for `gpt2-124m` at 16 x 1024 tokens they are 1.6 GiB in
bf16 and 3.3 GiB in float32, more than all the layers' saved activations together.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from lm import lightning, speedrun_config
from lm import model as model_lib
from lm.config import ModelConfig
from lm.model import param_counts
from lm.parallel import vocab_parallel
from sharding.partition import auto_axes, constrain, logical_mesh_axes

# `model.loss_chunk=auto`: the most float32 logits bytes one chunk may hold, a fraction of the device's memory
# (where it reports one; AUTO_CHUNK_BYTES where not, as a CPU, or if more); smaller steps run whole. Chunks cost
# time (each adds the head's float32 gradient, V x d, into the running sum): on one H200 (141 GB) gpt2-124m
# 16x1024 ran at 401k tokens/s whole, 380k in 4 chunks, 372k in 16; llama-1b 8x2048 61.2k whole, 58.3k in 4,
# 55.9k in 32 (docs/benchmarks.md 23), so they are kept for logits that would take a real share of memory.
AUTO_CHUNK_BYTES = 256 * 2**20
AUTO_MEMORY_FRACTION = 1 / 16


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


def loss_chunks(cfg: ModelConfig, batch: int, seq: int, token_shards: int = 1, device_memory: int | None = None) -> int:
    """How many chunks the head + loss of ``batch x seq`` tokens runs in under ``cfg.loss_chunk`` (1: whole).

    A chunk takes every row of the batch and ``seq / n`` positions, so ``n`` divides ``seq``: the
    smallest such ``n`` whose chunks hold at most ``loss_chunk`` tokens on each device (``auto``: as many
    tokens as `auto_chunk_bytes` of float32 logits hold), the tokens split over ``token_shards`` devices.
    Counted per device, not per step: a step over 128 devices whose chunks held the limit in all would
    run 128 times the loop trips, each reducing the head's whole gradient across devices.
    """
    if cfg.loss_chunk == "none" or cfg.logit_softcap:  # the fused head has no soft-cap: whole logits
        return 1
    limit = auto_chunk_bytes(device_memory) // (4 * cfg.vocab_size) if cfg.loss_chunk == "auto" else int(cfg.loss_chunk)
    return next((n for n in range(1, seq + 1) if seq % n == 0 and batch * (seq // n) <= limit * token_shards), seq)


def auto_chunk_bytes(device_memory: int | None) -> int:
    """Float32 logits bytes per chunk under ``loss_chunk=auto``: `AUTO_MEMORY_FRACTION` of ``device_memory``
    (bytes), at least `AUTO_CHUNK_BYTES` (all of it where the memory is unknown)."""
    return max(AUTO_CHUNK_BYTES, int(AUTO_MEMORY_FRACTION * (device_memory or 0)))


_ASSUMED_DEVICE_MEMORY: contextvars.ContextVar[int | None] = contextvars.ContextVar("assumed_device_memory", default=None)


@contextlib.contextmanager
def assume_device_memory(nbytes: int) -> Iterator[None]:
    """Size ``loss_chunk=auto``'s chunks inside this block for devices of ``nbytes`` memory, not this process's
    (a plan for another machine compiled on fake CPU devices: `experiments.plan`)."""
    token = _ASSUMED_DEVICE_MEMORY.set(int(nbytes))
    try:
        yield
    finally:
        _ASSUMED_DEVICE_MEMORY.reset(token)


def _device_memory() -> int | None:
    """Bytes of memory per device: `assume_device_memory`'s, else this process's first device's if it reports
    them (GPUs and TPUs do, CPUs do not)."""
    assumed = _ASSUMED_DEVICE_MEMORY.get()
    if assumed is not None:
        return assumed
    stats = jax.local_devices()[0].memory_stats()
    return (stats or {}).get("bytes_limit")


def _token_shards() -> int:
    """Devices the activation rules split a step's tokens over (``batch`` and ``seq``) on the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    split = {*logical_mesh_axes("batch"), *logical_mesh_axes("seq")} & set(auto_axes(mesh))
    return math.prod(mesh.shape[a] for a in split)


def next_token_loss(
    model_def: model_lib.ModelDef, params: model_lib.Params, tokens: jax.Array, *, z_loss: float = 0.0,
    window_blocks: jax.Array | None = None,
) -> tuple[jax.Array, dict, dict]:  # fmt: skip
    """``(loss, metrics, aux)`` of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]`` (`cross_entropy`'s loss and metrics).

    Runs the LM head and the loss in `loss_chunks` chunks (`chunked_cross_entropy`), or whole as
    `cross_entropy` of the model's logits; a token mean, so both run in the model's sequence layout.
    ``window_blocks``: the attention window at this training step (`lm.speedrun_config.window_blocks`).
    """
    inputs, targets = tokens[:, :-1], model_lib.in_model_layout(model_def, tokens[:, 1:])
    n = loss_chunks(model_def.config, *inputs.shape, _token_shards(), _device_memory())
    if vocab_parallel.active(model_def.config):  # the head's vocabulary split over `stage` (lm/parallel/vocab_parallel.py)
        h, (head, vocab_first), aux = model_lib.features(model_def, params, inputs, window_blocks)
        return *vocab_parallel.cross_entropy(h, head, targets, z_loss=z_loss, vocab_first=vocab_first), aux
    if n == 1:
        logits, aux = model_lib.apply(model_def, params, inputs, return_aux=True, model_layout=True, window_blocks=window_blocks)
        return *cross_entropy(logits, targets, z_loss=z_loss), aux
    h, (head, vocab_first), aux = model_lib.features(model_def, params, inputs, window_blocks)
    return *chunked_cross_entropy(h, head, targets, z_loss=z_loss, chunks=n, vocab_first=vocab_first), aux


def weighted_nll(
    model_def: model_lib.ModelDef, params: model_lib.Params, tokens: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(sum_t w_t nll_t, sum_t w_t)`` over the targets ``tokens[:, 1:]``, ``weights`` ``(batch, seq)`` one per
    target: a validation set that is not whole batches (padding weighted 0) as its exact token mean. The head
    runs in `loss_chunks` chunks as in `next_token_loss` (forward only)."""
    cfg = model_def.config
    if vocab_parallel.active(cfg):
        raise ValueError("a validation set of partial batches needs the whole vocabulary per device; set data.val_tokens to whole batches")
    inputs, targets = tokens[:, :-1], model_lib.in_model_layout(model_def, tokens[:, 1:])
    weights = model_lib.in_model_layout(model_def, weights).astype(jnp.float32)
    n = loss_chunks(cfg, *inputs.shape, _token_shards(), _device_memory())
    if n == 1:
        nll = _token_nll(model_lib.apply(model_def, params, inputs, model_layout=True), targets)
    else:
        h, (head, vocab_first), _ = model_lib.features(model_def, params, inputs)
        w = head.astype(h.dtype)
        chunk = lambda xs: _token_nll(_chunk_logits(xs[0], w, vocab_first), xs[1])
        nll = _from_chunks(jax.lax.map(chunk, (_to_chunks(h, n), _to_chunks(targets, n))))
    return jnp.sum(weights * nll), jnp.sum(weights)


def _token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``logsumexp(z) - z[target]`` per token, float32."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def chunked_cross_entropy(
    h: jax.Array, head: jax.Array, targets: jax.Array, *, z_loss: float = 0.0, chunks: int, vocab_first: bool
) -> tuple[jax.Array, dict]:
    """`cross_entropy` of the logits ``h @ head``, computed ``chunks`` token chunks at a time, never whole.

    ``h`` ``(batch, seq, d)`` in the compute dtype; ``head`` ``(vocab, d)`` when ``vocab_first`` (tied
    embeddings) else ``(d, vocab)``, cast to ``h``'s dtype; ``targets`` ``(batch, seq)``. Chunk ``i`` is
    every row's positions ``i, i + n, i + 2n, ...`` (a sequence split over devices stays split). Each
    chunk's logits ``z = h_c W`` are float32 (products accumulate in float32, as with the whole bf16
    logits, which are then rounded to bf16); the forward pass keeps ``lse = logsumexp(z)`` per token,
    and a `custom_vjp` backward recomputes each chunk's ``z`` and forms

        dL/dz = (g_nll + 2 z_loss g_z lse) softmax(z) / N - g_nll onehot(target) / N,

    from which ``dh = dz W^T`` and ``dW += h^T dz`` (accumulated over chunks in float32) follow. So
    at most one chunk's ``(batch, seq / n, vocab)`` float32 logits exist at a time, at the cost of
    computing the logits twice (once more than autodiff; the whole-logits path under remat does the
    same). Liger-Kernel's fused linear cross-entropy and MaxText's vocabulary tiling do alike.
    """
    if h.shape[1] % chunks:
        raise ValueError(f"{chunks} loss chunks do not divide the sequence length {h.shape[1]}")
    nll, z_term = _fused_head_loss(h, head, targets.astype(jnp.int32), float(z_loss), chunks, vocab_first)
    return nll + z_term, {"nll": nll, "z_loss": z_term}


def _to_chunks(x: jax.Array, n: int) -> jax.Array:
    """``(batch, seq, ...)`` -> ``(n, batch, seq / n, ...)``; chunk ``i`` holds positions ``i, i + n, ...``."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // n, n, *x.shape[2:]), 2, 0)


def _from_chunks(x: jax.Array) -> jax.Array:
    n, b, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape(b, c * n, *x.shape[3:])


def _chunk_logits(h: jax.Array, w: jax.Array, vocab_first: bool) -> jax.Array:
    spec = "bcd,vd->bcv" if vocab_first else "bcd,dv->bcv"
    return constrain(jnp.einsum(spec, h, w, preferred_element_type=jnp.float32), ("batch", "seq", "vocab"))


def _target_mask(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_head_loss(h, head, targets, z_loss: float, chunks: int, vocab_first: bool):
    return _fused_forward(h, head, targets, z_loss, chunks, vocab_first)[0]


def _fused_forward(h, head, targets, z_loss, chunks, vocab_first):
    w = head.astype(h.dtype)

    def body(totals, xs):
        hc, tc = xs
        logits = _chunk_logits(hc, w, vocab_first)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.sum(jnp.where(_target_mask(logits, tc), logits, 0.0), axis=-1)
        return (totals[0] + jnp.sum(lse - target_logit), totals[1] + jnp.sum(jnp.square(lse))), lse

    zero = jnp.zeros((), jnp.float32)
    (nll_sum, square_sum), lse = jax.lax.scan(body, (zero, zero), (_to_chunks(h, chunks), _to_chunks(targets, chunks)))
    count = math.prod(targets.shape)
    return (nll_sum / count, z_loss * square_sum / count), (h, head, targets, lse)


def _fused_backward(z_loss, chunks, vocab_first, residuals, cotangents):
    h, head, targets, lse = residuals
    g_nll, g_z = cotangents
    w = head.astype(h.dtype)
    scale = 1.0 / math.prod(targets.shape)
    dw_spec = "bcd,bcv->vd" if vocab_first else "bcd,bcv->dv"
    dh_spec = "bcv,vd->bcd" if vocab_first else "bcv,dv->bcd"

    def body(dw, xs):
        hc, tc, lse_c = xs
        logits = _chunk_logits(hc, w, vocab_first)
        weight = (g_nll + 2.0 * z_loss * g_z * lse_c) * scale
        dz = jnp.exp(logits - lse_c[..., None]) * weight[..., None] - jnp.where(_target_mask(logits, tc), g_nll * scale, 0.0)
        dz = dz.astype(h.dtype)
        dh = jnp.einsum(dh_spec, dz, w, preferred_element_type=jnp.float32).astype(h.dtype)
        return dw + jnp.einsum(dw_spec, hc, dz, preferred_element_type=jnp.float32), dh

    dw, dh = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), (_to_chunks(h, chunks), _to_chunks(targets, chunks), lse))
    return _from_chunks(dh), dw.astype(head.dtype), None


_fused_head_loss.defvjp(_fused_forward, _fused_backward)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6 N + 12 L H d_head T``.

    ``N`` counts the active matrix-multiply parameters, read off the parameter tree
    (`lm.model.param_counts`: the embedding lookup is free, the LM head is not, a routed expert
    stack counts ``experts_per_token / n_experts``), ``12 L H d_head T`` is attention's score and
    value products (PaLM, arXiv:2204.02311, App. B; the causal mask's savings are not counted, as
    is customary for MFU), ``L T`` summed over the blocks with attention, each over at most its window
    (`lm.speedrun_config.attended_keys`). With ParScale's ``P`` streams (`lm.parscale`) the blocks' weights and
    attention run ``P`` times, over ``T`` plus the prefix positions; the aggregation and the head once.
    """
    counts = param_counts(cfg)
    matmul_params = counts.active_matmul + (cfg.parscale - 1) * counts.stream_matmul
    keys = seq_len + (cfg.parscale_prefix_tokens if cfg.parscale > 1 else 0)
    score_and_value = cfg.head_dim + (cfg.rope_head_dim if cfg.attention_type == "mla" else 0) + cfg.value_head_dim
    if cfg.attention_type == "lightning":  # linear attention: O(d B + d^2) per token (lm/lightning.py)
        return 6.0 * matmul_params + 6.0 * lightning.attention_macs_per_token(cfg, seq_len)
    return 6.0 * matmul_params + 6.0 * cfg.parscale * cfg.n_heads * score_and_value * speedrun_config.attended_keys(cfg, keys)
