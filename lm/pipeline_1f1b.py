"""The 1F1B pipeline schedule: loss and gradients of one batch in an explicit tick loop over ``stage``.

GPipe (`lm.pipeline`) runs every microbatch forward and lets ``jax.grad`` run them all backward, so
each stage keeps the activations of all ``M`` microbatches. 1F1B (PipeDream-Flush, Narayanan et al.
2021) starts a microbatch's backward pass as soon as the last stage has its loss, so a stage holds
only the microbatches in flight. Here each tick of one SPMD program gives every stage one forward
slot and one backward slot (masked where the table has no work):

- forward: stage ``s`` runs microbatch ``f = t - s`` on tick ``t`` and keeps its *input* in a ring
  buffer; the last stage also runs the final norm, head and loss of ``f`` and their `jax.vjp`;
- backward: stage ``s`` runs microbatch ``b = t - (2S - 2 - s)``: `jax.vjp` of its layer group at
  the kept input (the forward recomputed, as under full remat) gives the weight gradient, which
  accumulates, and the input gradient, which goes to stage ``s - 1`` by a collective-permute.

Microbatch ``f`` enters stage ``s`` on tick ``f + s`` and leaves it on tick ``f + 2S - 2 - s``, so the
buffer holds at most ``2(S - 1 - s) + 1 <= 2S - 1`` inputs whatever ``M`` is, and the loop's carry is
all the step stores: activation memory is flat in ``M``. The loop takes ``M + 2S - 2`` ticks; no
stage has a forward slot's work after tick ``M + S - 2`` nor a backward slot's before tick ``S - 1``,
so every device skips those slots (a `jax.lax.cond` on the tick alone) and the step costs
``(M + S - 1)`` forward and ``(M + S - 1)`` backward slots per stage, as GPipe's: idle share
``(S - 1) / (M + S - 1)``. The backward slot recomputes the stage's forward (as under full remat).

Embedding stays outside (GSPMD over the other axes; its gradient from stage 0's input gradients by
the embedding's own `jax.vjp`); norm, head and loss run on the last stage (their parameters are
replicated over ``stage``, their gradients summed over it). The stored ``[L, ...]`` layout of the
block parameters is the one every mesh uses (`lm.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm import pipeline as pipeline_lib
from lm.model import ModelDef
from lm.transformer import ACTIVATION, document_segments, scan_blocks
from sharding import partition

SCHEDULES = ("1f1b",)
LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict]]


def active() -> bool:
    """Whether the step in context runs the 1F1B schedule (a ``stage`` axis and such a schedule)."""
    return pipeline_lib.stage_count() > 1 and pipeline_lib.current().schedule in SCHEDULES


def tick_table(stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """``(forward, backward)`` ``(ticks, stages)`` tables of the microbatch each slot runs, -1 where idle."""
    ticks = microbatches + 2 * stages - 2
    t, s = np.arange(ticks)[:, None], np.arange(stages)[None, :]
    valid = lambda i: np.where((i >= 0) & (i < microbatches), i, -1)  # noqa: E731
    return valid(t - s), valid(t - (2 * stages - 2 - s))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of the slots the loop runs: forward slots on ticks ``< M + S - 1``, backward slots on ticks ``>= S - 1``.

    Every device skips the other slots (`value_and_grad`), so this is ``(S - 1) / (M + S - 1)``, GPipe's.
    """
    forward, backward = tick_table(stages, microbatches)
    t = np.arange(forward.shape[0])
    ran = np.concatenate([forward[t < microbatches + stages - 1], backward[t >= stages - 1]])
    return float(np.mean(ran < 0))


def in_flight(stages: int, microbatches: int) -> np.ndarray:
    """Per stage, the most microbatches whose input is kept (forward run, backward not yet) at once."""
    forward, backward = tick_table(stages, microbatches)
    most = np.zeros(stages, int)
    for s in range(stages):
        started = np.cumsum(forward[:, s] >= 0)
        finished = np.concatenate([[0], np.cumsum(backward[:, s] >= 0)[:-1]])
        most[s] = np.max(started - finished)
    return most


def value_and_grad(model_def: ModelDef, params: dict, tokens: jax.Array, loss_fn: LossFn) -> tuple[tuple[jax.Array, dict], dict]:
    """``((loss, metrics), grads)`` of ``loss_fn(logits, targets)`` on ``tokens`` ``(batch, seq + 1)``, under 1F1B.

    ``loss`` and ``metrics`` are means over the microbatches (equal-sized, so the batch means).
    """
    cfg, p, stages = model_def.config, pipeline_lib.current(), pipeline_lib.stage_count()
    m = p.microbatches
    pipeline_lib.check(
        p, stages=stages, n_layers=cfg.n_layers, batch=tokens.shape[0], scan_layers=cfg.scan_layers,
        aux=pipeline_lib.uncarried_aux(cfg),
    )  # fmt: skip
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    blocks, rest = params["blocks"], {k: v for k, v in params.items() if k != "blocks"}
    model = lambda rest: nnx.merge(model_def.graphdef, {**rest, "blocks": blocks})  # noqa: E731
    block_graph = nnx.graphdef(model(rest).blocks)

    x, embed_vjp = jax.vjp(lambda rest: partition.constrain(model(rest).embed(inputs), ACTIVATION), rest)
    segments = document_segments(cfg, inputs)
    micro_x = pipeline_lib.to_microbatches(x, m)
    micro_t = pipeline_lib.to_microbatches(targets, m)
    micro_seg = None if segments is None else pipeline_lib.to_microbatches(segments, m)
    k = cfg.n_layers // stages
    grouped = jax.tree.map(lambda w: w.reshape(stages, k, *w.shape[1:]), blocks)
    slots = 2 * stages - 1

    def per_stage(local, rest, micro_x, micro_t, micro_seg):
        local = jax.tree.map(lambda w: w[0], local)
        stage = jax.lax.axis_index(pipeline_lib.STAGE_AXIS)
        last = stage == stages - 1
        run = lambda w, h, i: scan_blocks(cfg, nnx.merge(block_graph, w), h, None if micro_seg is None else micro_seg[i])[0]  # noqa: E731

        def head(rest, y, i):
            # Whole rows of logits: XLA's SPMD partitioner fails on the loss's gather over a vocab-split
            # axis inside a partly manual program (batch and tensor axes beside `stage`).
            logits = partition.constrain(model(rest)._logits(y), ("batch", "seq", None))
            return loss_fn(logits, micro_t[i])

        def tick(carry, t):
            recv_f, recv_b, kept, grads, head_grads, dx, totals = carry
            f, b = t - stage, t - (2 * stages - 2 - stage)
            f_ok, b_ok = (f >= 0) & (f < m), (b >= 0) & (b < m)
            fi, bi = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)

            def forward_slot():
                h = jnp.where(stage == 0, micro_x[fi], recv_f)
                y = run(local, h, fi)
                loss, head_vjp, metrics = jax.vjp(lambda r, y: head(r, y, fi), rest, y, has_aux=True)
                d_rest, dy = head_vjp(jnp.float32(1.0 / m))
                return h, y, dy, d_rest, (loss, metrics)

            # No stage has forward work after tick M + S - 2, nor backward work before tick S - 1: those
            # slots are skipped on every device alike (the predicate depends on the tick only).
            h, y, dy, d_rest, loss_metrics = _unless(t >= m + stages - 1, forward_slot)
            kept = jax.lax.dynamic_update_index_in_dim(kept, jnp.where(f_ok, h, kept[fi % slots]), fi % slots, 0)
            use_head = last & f_ok  # on the last stage b == f: its backward starts from this tick's loss

            def backward_slot():
                _, block_vjp = jax.vjp(lambda w, h: run(w, h, bi), local, kept[bi % slots])
                return block_vjp(jnp.where(last, dy, recv_b).astype(y.dtype))

            d_local, dh = _unless(t < stages - 1, backward_slot)
            add = lambda acc, g, ok: jax.tree.map(lambda a, g: a + jnp.where(ok, g, jnp.zeros_like(g)), acc, g)  # noqa: E731
            grads, head_grads = add(grads, d_local, b_ok), add(head_grads, d_rest, use_head)
            totals = add(totals, loss_metrics, use_head)
            dx = jax.lax.dynamic_update_index_in_dim(dx, jnp.where((stage == 0) & b_ok, dh, dx[bi]), bi, 0)
            forward = [(s, s + 1) for s in range(stages - 1)]
            backward = [(s + 1, s) for s in range(stages - 1)]
            sent = (jax.lax.ppermute(y, pipeline_lib.STAGE_AXIS, forward), jax.lax.ppermute(dh, pipeline_lib.STAGE_AXIS, backward))
            return (*sent, kept, grads, head_grads, dx, totals), None

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        metric_shapes = jax.eval_shape(lambda: head(rest, micro_x[0], 0))
        init = (
            jnp.zeros_like(micro_x[0]), jnp.zeros_like(micro_x[0]), jnp.zeros((slots, *micro_x.shape[1:]), micro_x.dtype),
            zeros(local), zeros(rest), jnp.zeros_like(micro_x), zeros(metric_shapes),
        )  # fmt: skip
        carry, _ = jax.lax.scan(tick, init, jnp.arange(m + 2 * stages - 2))
        _, _, _, grads, head_grads, dx, totals = carry
        total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, pipeline_lib.STAGE_AXIS), tree)  # noqa: E731
        loss, metrics = jax.tree.map(lambda a: a / m, total(totals))
        return loss, metrics, jax.tree.map(lambda g: g[None], grads), total(head_grads), total(dx)

    stage_spec = jax.P(pipeline_lib.STAGE_AXIS)
    replicated = lambda tree: jax.tree.map(lambda _: jax.P(), tree)  # noqa: E731
    loss, metrics, block_grads, head_grads, dx = jax.shard_map(
        per_stage,
        in_specs=(jax.tree.map(lambda _: stage_spec, grouped), replicated(rest), jax.P(), jax.P(), jax.P()),
        out_specs=(jax.P(), jax.P(), jax.tree.map(lambda _: stage_spec, grouped), replicated(rest), jax.P()),
        axis_names={pipeline_lib.STAGE_AXIS},
        check_vma=False,
    )(grouped, rest, micro_x, micro_t, micro_seg)
    (embed_grads,) = embed_vjp(pipeline_lib.from_microbatches(dx))
    grads = jax.tree.map(jnp.add, head_grads, embed_grads)
    grads["blocks"] = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), block_grads)
    return (loss, metrics), grads



def _unless(skip: jax.Array, fn: Callable[[], Any]) -> Any:
    """``fn()``, or zeros of its result's shapes where the scalar ``skip`` is true (`jax.lax.cond`)."""
    shapes = jax.eval_shape(fn)
    return jax.lax.cond(skip, lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), fn)
