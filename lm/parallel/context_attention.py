"""Context parallelism: causal attention with the sequence split over the ``context`` mesh axis.

The activation rules map logical ``seq`` onto ``context``, so each of the ``C`` context shards holds
``S / C`` positions of every activation. Attention needs keys and values of the whole sequence; each
mode below is a `jax.shard_map` (`sharding.partition.logical_shard_map`) over the mesh that moves them:

- ``ring``: keys and values travel ``C - 1`` hops around the ring (`jax.lax.ppermute`). Each hop gives
  a partial result ``(o_b, lse_b)`` over one key block, merged in float32 by the log-sum-exp rule::

      lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

  The shards are in zig-zag layout (device ``i`` holds chunks ``i`` and ``2C-1-i`` of ``2C``), so
  every hop from another device costs each device half a block (`ring_schedule`): the causal work is
  equal on every device. The model permutes its sequence into that layout once at input
  (`model_order`); called on a sequence in order, the call re-lays out its shards by two ppermutes
  of half a shard each way (`zigzag_pairs`) and back. The hops and their hand-written backward (dK/dV travel back around the ring) are
  `lm.parallel.ring_attention`; each block is `kernels_pallas.attention.partial` (XLA, or the Pallas kernel
  returning its log-sum-exp).
- ``all_gather``: each device keeps its queries and all-gathers the keys and values (and segment
  ids) once, then runs the ring's hops on blocks sliced out of the gathered arrays: the same zig-zag
  layout, schedule, kernels and backward (dK/dV go home by one reduce-scatter). Each block is square
  with the causal mask by index, so no kernel needs a query offset into the gathered keys.
- ``ulysses`` (DeepSpeed-Ulysses, arXiv:2309.14509): an all-to-all turns sequence-split q, k, v into
  head-split ones over the whole sequence, the attention op (`kernels_pallas.attention.api`, any
  implementation) runs per device, and a second all-to-all turns the output back. Needs the
  per-device head counts to divide by ``C``.

Keys and values travel with their ``n_kv_heads`` (grouped-query attention is never repeated before the
wire), or compressed (`Compressed`: MLA's latent and RoPE key, expanded per shard). Segment ids
(packed documents) travel with the keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backends
from kernels_pallas.attention import api as attention_api
from kernels_pallas.attention import reference
from lm.config import ModelConfig
from lm.parallel import ring_attention
from sharding import axes as mesh_axes
from sharding import partition

MODES = ("all_gather", "ring", "ulysses")

_Q = ("batch", "seq", "heads", "head_dim")
_KV = ("batch", "seq", "kv_heads", "head_dim")


def check(cfg: ModelConfig, seq_len: int, shards: int, head_shards: int) -> None:
    """Raises a one-line ValueError naming the sizes when ``cfg`` cannot run over ``shards`` context shards.

    ``head_shards``: how many ways the rules split the ``heads`` (and ``kv_heads``) axis (tensor parallelism).
    """
    if shards <= 1:
        return
    chunks = shards if cfg.context_parallel == "ulysses" else 2 * shards
    if seq_len % chunks:
        raise ValueError(
            f"context_parallel={cfg.context_parallel} splits data.seq_len={seq_len} into {chunks} chunks over {shards} "
            f"context shards; use a seq_len divisible by {chunks}"
        )
    kv_heads = cfg.n_heads if cfg.attention_type == "mla" else cfg.n_kv_heads
    if cfg.context_parallel == "ulysses" and (cfg.n_heads % (shards * head_shards) or kv_heads % (shards * head_shards)):
        raise ValueError(
            f"context_parallel=ulysses splits {cfg.n_heads} query and {kv_heads} key/value heads over {head_shards} head "
            f"shard(s) x {shards} context shards; use head counts divisible by {shards * head_shards} or context_parallel=ring"
        )


def layer_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> tuple[int, int]:
    """``(KV, A)``: bytes of one layer's whole-sequence keys and values, and of q, k, v and the output.

    MLA counts its per-head keys (``head_dim + rope_head_dim`` wide) and values (``v_head_dim``).
    """
    item = np.dtype(cfg.compute_dtype).itemsize
    kv_heads = cfg.n_heads if cfg.attention_type == "mla" else cfg.n_kv_heads
    k_dim = cfg.head_dim + (cfg.rope_head_dim if cfg.attention_type == "mla" else 0)
    kv = batch * seq_len * kv_heads * (k_dim + cfg.value_head_dim) * item
    return kv, kv + batch * seq_len * cfg.n_heads * (k_dim + cfg.value_head_dim) * item


def in_flight_bytes(mode: str, cfg: ModelConfig, batch: int, seq_len: int, shards: int) -> float:
    """Bytes of one layer a device holds beyond its own shard while attending (``batch`` on this device).

    all-gather: the whole sequence's K and V; ring: two K/V blocks (the one in use, the one arriving);
    Ulysses: q, k, v and the output of the whole sequence for ``heads / C`` heads.
    """
    kv, activations = layer_bytes(cfg, batch, seq_len)
    return {"all_gather": kv, "ring": 2 * kv / shards, "ulysses": activations / shards}[mode]


def zigzag_order(seq_len: int, shards: int) -> np.ndarray:
    """Global positions in zig-zag layout: with ``2C`` equal chunks, shard ``i`` holds chunks ``i`` and ``2C-1-i``."""
    if seq_len % (2 * shards):
        raise ValueError(
            f"the zig-zag layout (context_parallel=ring, all_gather) has 2 x {shards} chunks; seq_len={seq_len} must be a multiple of {2 * shards}"
        )
    chunks = np.arange(seq_len).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def ring_schedule(shards: int) -> np.ndarray:
    """Which (query half, key half) pairs each device computes on each ring hop, ``(C, C, 2, 2)`` bool.

    On hop ``t`` device ``i`` holds the keys of device ``j = (i - t) mod C``. Hop 0 is the local causal
    block (all four half pairs). For ``j < i`` all local queries see only the first key half (chunk
    ``j``); for ``j > i`` only the second query half (chunk ``2C-1-i``) sees keys, and sees both halves.
    Every other pair is entirely masked and skipped.
    """
    work = np.zeros((shards, shards, 2, 2), bool)
    for i in range(shards):
        work[i, 0] = True
        for t in range(1, shards):
            if (i - t) % shards < i:
                work[i, t, :, 0] = True
            else:
                work[i, t, 1, :] = True
    return work


def zigzag_pairs(shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The two ppermutes (source, destination) that turn contiguous shards into the zig-zag layout.

    Shard ``d`` holds half-chunks ``2d`` (slot 0) and ``2d+1`` (slot 1); zig-zag shard ``i`` needs
    half-chunks ``i`` and ``2C-1-i``. The first list moves every slot 0 (to an even ``i`` as its first
    half, to an odd ``i`` as its second), the second list every slot 1 (the other way round).
    """
    mirror = lambda i: (2 * shards - 1 - i) // 2  # noqa: E731
    slot_0 = [(i // 2 if i % 2 == 0 else mirror(i), i) for i in range(shards)]
    slot_1 = [(mirror(i) if i % 2 == 0 else i // 2, i) for i in range(shards)]
    return slot_0, slot_1


def _to_zigzag(x, axes, axis: int):
    slot_0, slot_1 = zigzag_pairs(jax.lax.axis_size(axes))
    first, second = _halves(x, axis)
    a, b = jax.lax.ppermute(first, axes, slot_0), jax.lax.ppermute(second, axes, slot_1)
    even = jax.lax.axis_index(axes) % 2 == 0
    return jnp.where(even, jnp.concatenate([a, b], axis), jnp.concatenate([b, a], axis))


def _from_zigzag(x, axes, axis: int):
    slot_0, slot_1 = zigzag_pairs(jax.lax.axis_size(axes))
    first, second = _halves(x, axis)
    even = jax.lax.axis_index(axes) % 2 == 0
    back = lambda y, pairs: jax.lax.ppermute(y, axes, [(d, s) for s, d in pairs])  # noqa: E731
    return jnp.concatenate([back(jnp.where(even, first, second), slot_0), back(jnp.where(even, second, first), slot_1)], axis)


def _halves(x, axis: int):
    half = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, half, axis=axis), jax.lax.slice_in_dim(x, half, None, axis=axis)


def _ulysses(axes, q, k, v, seg, *, implementation: str, track_max_logits: bool):
    shards = jax.lax.axis_size(axes)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % shards or kv_heads % shards:
        raise ValueError(
            f"context_parallel=ulysses splits each device's {heads} query and {kv_heads} key/value heads over {shards} "
            f"context shards; use head counts divisible by {shards} or --config.model.context_parallel=ring"
        )
    to_heads = lambda x: jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)  # noqa: E731
    seg = None if seg is None else jax.lax.all_gather(seg, axes, axis=1, tiled=True)
    out, max_logits = attention_api.attention(
        to_heads(q), to_heads(k), to_heads(v), implementation=implementation, track_max_logits=track_max_logits, segment_ids=seg
    )
    out = jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)
    if max_logits is not None:
        max_logits = jax.lax.all_gather(max_logits, axes, tiled=True)
    return out, max_logits


@dataclasses.dataclass(frozen=True)
class Compressed:
    """Keys and values that cross the wire compressed and are expanded on each shard.

    ``expand(*params, *sources) -> (k, v)`` maps per-token ``sources`` (each ``(batch, seq, ...)``)
    to ``(batch, seq, kv_heads, dim)`` keys and values, per token and linear in nothing but itself, so
    expanding a shard of the sources gives that shard of K and V. ``params`` are what it reads beside
    (replicated over ``context``); the logical names place both inside the `jax.shard_map`.
    """

    sources: tuple[jax.Array, ...]
    source_logical: tuple[tuple[str | None, ...], ...]
    params: tuple[jax.Array, ...]
    param_logical: tuple[tuple[str | None, ...], ...]
    expand: Callable[..., tuple[jax.Array, jax.Array]]


def sequence_split() -> bool:
    """Whether the mesh in context splits the sequence over a ``context`` axis of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape.get(mesh_axes.CONTEXT, 1) > 1 and mesh_axes.CONTEXT in partition.logical_mesh_axes("seq")


def model_order(mode: str, seq_len: int) -> np.ndarray | None:
    """The order the model lays its sequence out in under the mesh in context, or None for sequence order.

    With the sequence split over ``context`` and ``mode`` ``ring`` or ``all_gather``: the zig-zag
    layout (`zigzag_order`), permuted once where the batch enters the model (tokens, segment ids and
    the positions RoPE reads), so no attention call re-lays out its shards. A token-mean loss permutes
    its targets the same way and needs no inverse; per-token outputs are inverted (`lm.transformer`).
    """
    if mode == "ulysses" or not sequence_split():
        return None
    seq_axes = partition.logical_mesh_axes("seq")
    return zigzag_order(seq_len, int(np.prod([jax.sharding.get_abstract_mesh().shape[a] for a in seq_axes])))


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mode: str,
    implementation: str = "xla",
    track_max_logits: bool = False,
    segment_ids: jax.Array | None = None,
    zigzag: bool = False,
):
    """Causal attention (`reference.attention`'s contract) with the sequence split over the ``context`` axis.

    Args:
      q: ``(batch, seq, heads, head_dim)``; k, v: ``(batch, seq, kv_heads, head_dim)``, at global
        positions ``0 .. seq-1`` (rotary embeddings already applied).
      mode: ``all_gather``, ``ring`` or ``ulysses``.
      implementation: ``model.attention`` per shard: Ulysses runs the attention op on whole sequences
        (any implementation); the ring and all-gather run `kernels_pallas.attention.partial` blocks
        (``pallas`` or ``xla``, `attention_api.block_implementation`).
      track_max_logits: also return the per-head maximum unmasked logit, ``(heads,)``.
      segment_ids: ``(batch, seq)`` int or None (packed documents).
      zigzag: q, k, v, segment ids (and the output) are in the zig-zag layout already (`model_order`,
        ring and all-gather only); else in sequence order, and those two modes re-lay them out here.

    Returns:
      ``(out, max_logits or None)``, out ``(batch, seq, heads, v_head_dim)`` in q's dtype.
    """
    reference.check_shapes(q, k, v, segment_ids)
    kv = Compressed((k, v), (_KV, _KV), (), (), lambda k, v: (k, v))
    return attend_compressed(
        q, kv, mode=mode, implementation=implementation, track_max_logits=track_max_logits, segment_ids=segment_ids,
        zigzag=zigzag,
    )


def attend_compressed(
    q: jax.Array,
    kv: Compressed,
    *,
    mode: str,
    implementation: str = "xla",
    track_max_logits: bool = False,
    segment_ids: jax.Array | None = None,
    zigzag: bool = False,
):
    """`attend` with keys and values sent as ``kv.sources`` and expanded per shard (all-gather, ring).

    Ulysses exchanges heads, which a compressed source does not have: it expands first and sends K and V.
    """
    if mode not in MODES:
        raise ValueError(f"model.context_parallel={mode!r} must be one of {', '.join(MODES)}")
    if zigzag and mode == "ulysses":
        raise ValueError("context_parallel=ulysses attends over the sequence in order; zigzag=True is for ring and all_gather")
    seq_axes = partition.logical_mesh_axes("seq")
    shards = int(np.prod([jax.sharding.get_abstract_mesh().shape[a] for a in seq_axes]))
    if q.shape[1] % shards:
        raise ValueError(f"seq_len={q.shape[1]} does not split over {shards} context shards; use a multiple of {shards}")
    if mode != "ulysses" and q.shape[1] % (2 * shards):
        raise ValueError(f"context_parallel={mode} lays seq_len={q.shape[1]} out in 2 x {shards} chunks; use a multiple of {2 * shards}")
    reduce_axes = (*partition.logical_mesh_axes("batch"), *seq_axes)
    n_sources, n_params = len(kv.sources), len(kv.params)
    target = backends.platform()
    block = attention_api.block_implementation(implementation, target, q.dtype)

    def per_shard(q, *rest):
        sources, params, seg = rest[:n_sources], rest[n_sources : n_sources + n_params], rest[n_sources + n_params :]
        seg = seg[0] if seg else None
        expand = functools.partial(kv.expand, *params)
        if mode == "ulysses":
            out, max_logits = _ulysses(
                seq_axes, q, *expand(*sources), seg, implementation=implementation, track_max_logits=track_max_logits
            )
            batch_axes = partition.logical_mesh_axes("batch")
            if max_logits is not None and batch_axes:
                max_logits = jax.lax.pmax(max_logits, batch_axes)
            return (out, max_logits) if track_max_logits else out
        relayout = (lambda x: x) if zigzag else (lambda x: None if x is None else _to_zigzag(x, seq_axes, 1))  # noqa: E731
        q, seg, *sources = (relayout(x) for x in (q, seg, *sources))
        out, row_max = ring_attention.ring(
            q, tuple(sources), params, seg, axes=seq_axes, past=ring_schedule(shards)[:, :, 0, 0], expand=kv.expand,
            transport=mode, implementation=block, interpret=target == "cpu",
        )
        out = out.astype(q.dtype) if zigzag else _from_zigzag(out.astype(q.dtype), seq_axes, 1)
        row_max = jnp.max(row_max, axis=(0, 2))
        max_logits = jax.lax.pmax(jax.lax.stop_gradient(row_max), reduce_axes) if track_max_logits else None
        return (out, max_logits) if track_max_logits else out

    args = [q, *kv.sources, *kv.params]
    specs = [_Q, *kv.source_logical, *kv.param_logical]
    if segment_ids is not None:
        args, specs = [*args, segment_ids], [*specs, ("batch", "seq")]
    out_logical = (_Q, ("heads",)) if track_max_logits else _Q
    result = partition.logical_shard_map(per_shard, specs, out_logical)(*args)
    return result if track_max_logits else (result, None)
