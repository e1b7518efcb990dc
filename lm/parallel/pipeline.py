"""Pipeline parallelism over the ``stage`` mesh axis, inside one SPMD program.

The scanned block stack's parameters are ``[L, ...]`` arrays whose ``layers`` axis the rules map onto
the ``stage`` mesh axis (`sharding.rules`), so the stored layout is the same on every mesh. With
``S`` stages and ``R`` repeats the stack is cut into ``S R`` contiguous groups of ``K = L / (S R)``
layers; stage ``s`` runs groups ``s, s + S, ..., s + (R-1) S`` (``R = 1``: one contiguous group per
stage). The batch is split into ``M`` microbatches (row ``j`` of microbatch ``m`` is batch row
``j M + m``, so every microbatch keeps the batch's data sharding).

The loop is a `jax.lax.scan` over ticks inside a `jax.shard_map` that makes only ``stage`` manual (the
other axes stay GSPMD-partitioned, as in `lm.parallel.context_attention`). On tick ``t`` stage ``s`` works on
item ``i = t - s`` (microbatch ``i mod M``, repeat ``i // M``) when ``0 <= i < R M``; otherwise it
runs on stale data whose result is never used (the bubble). After each tick every stage sends its
output to stage ``s + 1`` with one collective-permute (`jax.lax.ppermute`); under ``circular`` the
last stage's output goes round to stage 0, which keeps it until the item's next repeat. ``jax.grad``
of the loop is the backward pipeline: the transposed permutes carry activation gradients from stage
``s + 1`` back to ``s``. The schedule takes ``R M + S - 1`` ticks of ``R M`` useful ones per stage:

    bubble = (S - 1) / (R M + S - 1)      (GPipe: R = 1; circular's R > 1 shrinks it)

Embedding, final norm and head stay outside the pipeline, computed by GSPMD over the other axes and
replicated over ``stage``; the last stage's outputs reach every stage by one all-reduce over ``stage``
(its gradient is the same all-reduce's transpose). ``circular`` reorders the stored ``[L]`` axis into
stage-major groups each step (an all-to-all of the block weights over ``stage``), so the checkpoint
layout stays that of every other mesh.

The schedule is model configuration: ``model.pipeline_schedule`` (``S`` is the mesh's ``stage`` size),
``model.pipeline_microbatches`` (``M``) and ``model.pipeline_repeats`` (``R``) of `lm.config.ModelConfig`.

This module is the forward loop (``gpipe``, ``circular``) that ``jax.grad`` differentiates; the
``1f1b`` and ``zb_h1`` schedules, which compute the gradients themselves from a tick table
(`lm.parallel.pipeline_schedule`), are `lm.parallel.pipeline_1f1b`. Under ``gpipe`` with
``model.pipeline_skip_rate > 0`` the loop is `run_paths`: SkipPipe's per-microbatch paths through the
stages (`lm.parallel.skip_schedule`). ``model.pipeline_vocab_parallel`` splits the embedding and head
over ``stage`` instead of replicating them (`lm.parallel.vocab_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm import fp8
from lm.config import ModelConfig
from lm.parallel import skip_schedule
from sharding import axes, partition

SCHEDULES = ("gpipe", "circular", "1f1b", "zb_h1")
_MICRO = (None, "batch", "seq", "embed")


def stage_count() -> int:
    """Size of the ``stage`` axis of the mesh in context (1 without one, or where it is already manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axes.STAGE not in partition.auto_axes(mesh):
        return 1
    return mesh.shape[axes.STAGE]


def check(cfg: ModelConfig, *, stages: int, batch: int, batch_shards: int = 1) -> None:
    """Raises a one-line ValueError naming the sizes that work when ``cfg``'s pipeline cannot run on ``stages``.

    ``batch``: rows per gradient-accumulation micro-batch, split over ``batch_shards`` devices.
    """
    if stages <= 1:
        return
    schedule, m, r = cfg.pipeline_schedule, cfg.pipeline_microbatches, cfg.pipeline_repeats
    if schedule not in SCHEDULES:
        raise ValueError(f"model.pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if not cfg.scan_layers:
        raise ValueError(f"a mesh with stage:{stages} pipelines the scanned block stack; set model.scan_layers=True")
    if (aux := uncarried_aux(cfg)) is not None:
        raise ValueError(f"{aux} is not carried through the pipeline yet; turn it off or use a mesh without a stage axis")
    if cfg.fp8 != "none" and cfg.fp8_scaling == "delayed":
        raise ValueError(fp8.DELAYED_UNDER_PIPELINE)
    if r < 1 or (schedule != "circular" and r != 1):
        raise ValueError(f"model.pipeline_repeats={r}: {schedule} takes repeats=1, circular any repeats >= 1")
    groups, n_layers = stages * r, cfg.n_layers
    if n_layers % groups:
        near = sorted({n for n in (groups * (n_layers // groups), groups * (n_layers // groups + 1)) if n > 0})
        raise ValueError(
            f"model.n_layers={n_layers} does not split into stage:{stages} x model.pipeline_repeats={r} = {groups} "
            f"layer groups; use n_layers divisible by {groups} (e.g. {' or '.join(map(str, near))})"
        )
    if m < 1 or batch % (m * batch_shards):
        working = [d for d in range(1, batch + 1) if batch % (d * batch_shards) == 0]
        raise ValueError(
            f"model.pipeline_microbatches={m} does not split the micro-batch of {batch} sequences into microbatches "
            f"that split over {batch_shards} batch shard(s); use microbatches in {working}"
        )
    if cfg.pipeline_skip_rate and (schedule != "gpipe"):
        raise ValueError(f"model.pipeline_skip_rate={cfg.pipeline_skip_rate} (SkipPipe) runs under pipeline_schedule=gpipe, not {schedule}")
    skip_schedule.skips(stages, cfg.pipeline_skip_rate)
    if r > 1 and m < stages:
        raise ValueError(
            f"model.pipeline_schedule=circular with repeats={r} needs microbatches >= stages ({m} < "
            f"{stages}): a microbatch must be back at stage 0 before its next repeat"
        )


def uncarried_aux(cfg: ModelConfig) -> str | None:
    """The per-layer model output of ``cfg`` that the pipeline does not carry, if any."""
    if cfg.track_attn_logits:
        return "model.track_attn_logits (attention max logits, e.g. for muon_clip)"
    if cfg.n_experts:
        return "an MoE model's routing statistics"
    return None


def forward_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
    """``(ticks, stages)`` int table: the item (``repeat * M + microbatch``) each stage runs per tick, -1 in a bubble."""
    items = repeats * microbatches
    ticks = items + stages - 1
    i = np.arange(ticks)[:, None] - np.arange(stages)[None, :]
    return np.where((i >= 0) & (i < items), i, -1)


def bubble_fraction(table: np.ndarray) -> float:
    """The share of (tick, stage) slots of a tick table that do no work."""
    return float(np.mean(table < 0))


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """``(B, ...) -> (M, B / M, ...)``, microbatch ``m`` holding rows ``m, M + m, 2M + m, ...``."""
    micro = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return partition.constrain(micro, _MICRO[: micro.ndim])


def from_microbatches(micro: jax.Array) -> jax.Array:
    """The inverse of `to_microbatches`."""
    return micro.swapaxes(0, 1).reshape(-1, *micro.shape[2:])


def run_stack(
    blocks: nnx.Module,
    x: jax.Array,
    segment_ids: jax.Array | None,
    run_layers: Callable[[nnx.Module, jax.Array, jax.Array | None], jax.Array],
    cfg: ModelConfig,
) -> jax.Array:
    """The block stack ``blocks`` (stacked ``[L, ...]`` parameters of model ``cfg``) on ``x`` ``(batch, seq, embed)``,
    pipelined by ``cfg``'s schedule (``1f1b`` and ``zb_h1`` run their forward-only calls as ``gpipe``).

    ``run_layers(group, h, segment_ids)`` runs a stacked group of blocks (``[K, ...]`` parameters) on
    one microbatch; the result equals ``run_layers(blocks, x, segment_ids)``.
    """
    stages, m, r = stage_count(), cfg.pipeline_microbatches, cfg.pipeline_repeats
    check(cfg, stages=stages, batch=x.shape[0])
    if cfg.pipeline_skip_rate:
        return run_paths(blocks, x, segment_ids, run_layers, skip_schedule.paths(stages, m, cfg.pipeline_skip_rate))
    graphdef, state = nnx.split(blocks)
    n_layers = jax.tree.leaves(state)[0].shape[0]
    k = n_layers // (stages * r)
    # Layer l = (repeat * S + stage) * K + j, regrouped stage-major: [S, R, K, ...].
    grouped = jax.tree.map(lambda w: w.reshape(r, stages, k, *w.shape[1:]).swapaxes(0, 1), state)
    micro = to_microbatches(x, m)
    segments = None if segment_ids is None else to_microbatches(segment_ids, m)
    forward = [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if r > 1 else [])

    def per_stage(local, micro, segments):
        local = jax.tree.map(lambda w: w[0], local)  # this stage's [R, K, ...]
        stage = jax.lax.axis_index(axes.STAGE)

        def tick(carry, t):
            recv, kept = carry
            item = t - stage
            mb = jnp.mod(item, m)
            if r > 1:  # stage 0 keeps what the last stage sent (item t - S) for its next repeat
                back = t - stages
                keep = (stage == 0) & (back >= 0)
                slot = jnp.mod(back, m)
                kept = jax.lax.dynamic_update_index_in_dim(kept, jnp.where(keep, recv, kept[slot]), slot, 0)
                first = jnp.where(item // m > 0, kept[mb], micro[mb])
            else:
                first = micro[mb]
            h = jnp.where(stage == 0, first, recv)
            group = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, jnp.clip(item // m, 0, r - 1), 0, False), local)
            y = run_layers(nnx.merge(graphdef, group), h, None if segments is None else segments[mb])
            return (jax.lax.ppermute(y, axes.STAGE, forward), kept), y

        kept = jnp.zeros_like(micro) if r > 1 else None
        _, ys = jax.lax.scan(tick, (jnp.zeros_like(micro[0]), kept), jnp.arange(r * m + stages - 1))
        last = ys[(r - 1) * m + stages - 1 :]  # the last stage's final-repeat outputs, microbatches 0 .. M-1
        return jax.lax.psum(jnp.where(stage == stages - 1, last, jnp.zeros_like(last)), axes.STAGE)

    stage_spec = jax.P(axes.STAGE)
    out = jax.shard_map(
        per_stage,
        in_specs=(jax.tree.map(lambda _: stage_spec, grouped), jax.P(), jax.P()),
        out_specs=jax.P(),
        axis_names={axes.STAGE},
        check_vma=False,
    )(grouped, micro, segments)
    return from_microbatches(out)



def run_paths(
    blocks: nnx.Module,
    x: jax.Array,
    segment_ids: jax.Array | None,
    run_layers: Callable[[nnx.Module, jax.Array, jax.Array | None], jax.Array],
    route: list[skip_schedule.Path],
) -> jax.Array:
    """`run_stack` with microbatch ``i`` running only the layer groups of the stages on its path ``route[i]``, in that
    order (SkipPipe, `lm.parallel.skip_schedule`), ``len(route)`` microbatches, ``S = stage_count()`` groups.

    The loop runs `skip_schedule.tick_table`'s ticks. A hop of distance ``d`` travels by a collective-permute
    from every stage ``s`` to ``s + d`` (one per distance the table uses; skip rate 0: ``d = 1`` only, GPipe's
    permute); a stage keeps what arrives in a slot per microbatch until its tick comes. With every path
    ``0, ..., S - 1`` the ticks, inputs and outputs are GPipe's.
    """
    stages, m = stage_count(), len(route)
    graphdef, state = nnx.split(blocks)
    k = jax.tree.leaves(state)[0].shape[0] // stages
    items, sources = skip_schedule.tick_table(route, stages)
    hops, arrived = skip_schedule.offsets(sources), skip_schedule.arrivals(items, sources)
    grouped = jax.tree.map(lambda w: w.reshape(stages, k, *w.shape[1:]), state)
    micro = to_microbatches(x, m)
    segments = None if segment_ids is None else to_microbatches(segment_ids, m)

    def per_stage(local, micro, segments, table):
        stage = jax.lax.axis_index(axes.STAGE)

        def tick(carry, row):
            recv, kept, outs = carry
            item, got = row[0][stage], row[1][stage]
            for j in range(len(hops)):  # keep what came from stage s - hops[j], in its microbatch's slot
                kept = store(kept, jnp.maximum(got[j], 0), recv[j], got[j] >= 0)
            i = jnp.maximum(item, 0)
            h = jnp.where(stage == 0, micro[i], kept[i])
            group = jax.tree.map(lambda w: w[0], local)  # this stage's [K, ...], taken inside the loop (nnx's trace levels)
            y = run_layers(nnx.merge(graphdef, group), h, None if segments is None else segments[i])
            outs = store(outs, i, y, (stage == stages - 1) & (item >= 0))
            recv = tuple(jax.lax.ppermute(y, axes.STAGE, [(s, s + d) for s in range(stages) if 0 <= s + d < stages]) for d in hops)
            return (recv, kept, outs), None

        init = (tuple(jnp.zeros_like(micro[0]) for _ in hops), jnp.zeros_like(micro), jnp.zeros_like(micro))
        (_, _, outs), _ = jax.lax.scan(tick, init, table)
        return jax.lax.psum(jnp.where(stage == stages - 1, outs, jnp.zeros_like(outs)), axes.STAGE)

    table = (jnp.asarray(items), jnp.asarray(arrived))
    out = jax.shard_map(
        per_stage,
        in_specs=(jax.tree.map(lambda _: jax.P(axes.STAGE), grouped), jax.P(), jax.P(), (jax.P(), jax.P())),
        out_specs=jax.P(),
        axis_names={axes.STAGE},
        check_vma=False,
    )(grouped, micro, segments, table)
    return from_microbatches(out)


def store(buffer: jax.Array, slot: jax.Array, value: jax.Array, write: jax.Array) -> jax.Array:
    """``buffer`` with ``value`` in row ``slot`` where the scalar ``write`` is true."""
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(write, value, buffer[slot]), slot, 0)
