"""Sliding-window causal attention: a banded XLA computation, and cuDNN's token window.

Query ``i`` sees key ``j`` when, with window ``W`` and block size ``B`` (``W`` a multiple of ``B``)::

    j <= i   and   i // B - j // B < W / B   (and seg_i == seg_j with segment ids)

``B = 1`` is the token window of Mistral / Gemma 2 (the ``W`` latest keys); ``B = 128`` is
modded-nanogpt's block sliding window (FlexAttention block masks of 128 x 128 tiles: a query block
sees its own block and the ``W / B - 1`` blocks before it). Otherwise as `reference.attention`.

A window that changes during training (modded-nanogpt grows it from one block to ``W / B`` over the
run) is a traced ``limit`` of key blocks, ``1 <= limit <= W / B``, inside the static band of ``W``: the
mask becomes ``i // B - j // B < limit`` and nothing recompiles when it changes, at the band's cost.

`attention` splits the queries into chunks of ``C`` rows and multiplies each only with the keys
``[start - round_up(W, C), end)`` that can fall in its window, so the work and memory are
``O(T (W + C))`` rather than ``O(T^2)``; it is recomputed in the backward pass (`jax.checkpoint`), so
no ``(T, W)`` probabilities are kept. `cudnn` hands a token window to
`jax.nn.dot_product_attention`'s ``local_window_size``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import check_shapes


def allowed(q_pos: jax.Array, k_pos: jax.Array, window: int, block: int) -> jax.Array:
    """Whether queries at ``q_pos`` see keys at ``k_pos`` (broadcast together): causal and inside the window."""
    return (k_pos >= 0) & (k_pos <= q_pos) & (q_pos // block - k_pos // block < window // block)


def chunk_size(seq_len: int, block: int) -> int:
    """Query rows per chunk: the largest of 512, 256, ... that divides ``seq_len`` and nests with ``block``."""
    return next(c for c in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1) if seq_len % c == 0 and (c % block == 0 or block % c == 0))


def check_window(window: int, block: int) -> None:
    if window < 1 or block < 1 or window % block:
        raise ValueError(f"window {window} must be a positive multiple of its block size {block}")


@functools.partial(jax.checkpoint, static_argnums=(4, 5))
def _banded(q, k, v, segment_ids, window: int, block: int, limit):
    b, t, h, d = q.shape
    kv, dv = k.shape[2], v.shape[-1]
    c = chunk_size(t, block)
    n, lookback = t // c, -(-window // c) * c
    iota = lambda shape, axis: jax.lax.broadcasted_iota(jnp.int32, shape, axis)  # computed, not constants of the program
    starts = iota((n, 1), 0) * c
    index = starts + iota((1, lookback + c), 1)  # rows of the left-padded keys, (n, lookback + c)
    q_pos, k_pos = starts + iota((1, c), 1), index - lookback
    pad = ((0, 0), (lookback, 0), (0, 0), (0, 0))
    k_win, v_win = jnp.pad(k, pad)[:, index], jnp.pad(v, pad)[:, index]  # (b, n, lookback + c, kv, d)
    mask = allowed(q_pos[:, :, None], k_pos[:, None, :], window if limit is None else limit * block, block)[None, :, None, None]
    if segment_ids is not None:
        seg_k = jnp.pad(segment_ids, ((0, 0), (lookback, 0)), constant_values=-1)[:, index]
        seg_q = segment_ids.reshape(b, n, c)
        mask = mask & (seg_q[:, :, :, None] == seg_k[:, :, None, :])[:, :, None, None]
    grouped = q.reshape(b, n, c, kv, h // kv, d)
    logits = jnp.einsum("bncxgd,bnkxd->bnxgck", grouped, k_win, preferred_element_type=jnp.float32) * d**-0.5
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bnxgck,bnkxd->bncxgd", probs.astype(v.dtype), v_win)
    return out.reshape(b, t, h, dv).astype(q.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, block: int = 1, segment_ids: jax.Array | None = None, limit: jax.Array | None = None
) -> jax.Array:
    """Windowed causal attention in XLA, banded over query chunks (module docstring); shapes as `reference.attention`.

    ``limit``: a traced number of key blocks in ``[1, window / block]`` that each query block sees; None: all of them."""
    check_shapes(q, k, v, segment_ids)
    check_window(window, block)
    if limit is not None:
        limit = jnp.clip(jnp.asarray(limit, jnp.int32), 1, window // block)
    return _banded(q, k, v, segment_ids, window, block, limit)


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, segment_ids: jax.Array | None = None) -> jax.Array:
    """A token window (``block = 1``) by cuDNN's fused attention: key ``j`` in ``[i - W + 1, i]``."""
    check_shapes(q, k, v, segment_ids)
    check_window(window, 1)
    same = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=same, is_causal=True, local_window_size=(window - 1, 0), implementation="cudnn"
    )
