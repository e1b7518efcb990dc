"""The 1F1B and ZB-H1 pipeline schedules: loss and gradients of one batch in a tick loop over ``stage``.

GPipe (`lm.parallel.pipeline`) runs every microbatch forward and lets ``jax.grad`` run them all backward, so
each stage keeps the activations of all ``M`` microbatches. 1F1B (PipeDream-Flush, Narayanan et al.
2021) starts a microbatch's backward pass as soon as the last stage has its loss, so a stage holds
only the microbatches in flight; ZB-H1 (Qi et al. 2023, arXiv 2401.10241) splits that backward into
the input gradient B, on the critical path, and the weight gradient W, which fills the cool-down.

Both run one executor over the schedule's unit-time tick table (`lm.parallel.pipeline_schedule`): on every
tick each stage runs exactly one op of its own row (a `jax.lax.switch` on the table entry at
``(tick, stage index)``), then two collective-permutes move every stage's output to ``s + 1`` and
its input gradient to ``s - 1`` (zeros where the op made none; the receiver's row of the arrival
tables says whether it keeps what came):

- forward: the layer group on the microbatch's input, which the stage keeps (stage 0 reads it from the
  batch); the last stage also runs the final norm, head and loss and their `jax.vjp`, whose output
  gradient it keeps;
- backward (1F1B): `jax.vjp` of the layer group at the kept input and output gradient: the weight
  gradient accumulates, the input gradient goes to ``s - 1``;
- B and W (ZB-H1): the same `jax.vjp` taken w.r.t. the input only, and w.r.t. the weights only (the
  output gradient kept until W).

Each backward op recomputes the stage's forward from the kept input (as under full remat), so a stage
keeps one input (and under ZB-H1 one output gradient) per microbatch in flight: ring buffers of the
table's own maximum (`pipeline_schedule.buffer_slots`: ``S`` inputs for both schedules, 1 / ``S``
output gradients), whatever ``M`` is, so activation memory is flat in ``M``. The ticks run in lock
step, so a tick lasts as long as the slowest op any stage runs on it; the tables' idle shares,
``(S - 1) / (M + S - 1)`` (1F1B) and ``(S - 1) / (3M + S - 1)`` (ZB-H1), count unit-time ops.

Embedding stays outside (GSPMD over the other axes; its gradient from stage 0's input gradients by
the embedding's own `jax.vjp`); norm, head and loss run on the last stage (their parameters are
replicated over ``stage``, their gradients summed over it). The stored ``[L, ...]`` layout of the
block parameters is the one every mesh uses (`lm.parallel.pipeline`). Under
``model.pipeline_vocab_parallel`` the head's weight enters split over ``stage`` and, on each tick on
which the last stage finishes a forward, every stage runs the head's S and T passes on its slice
(`lm.parallel.vocab_parallel`): the last stage's output is broadcast, the final norm and its gradient
run on every stage (counted on the last), and the last stage keeps the output gradient as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lm.config import ModelConfig
from lm.model import ModelDef
from lm.parallel import pipeline as pipeline_lib
from lm.parallel import pipeline_schedule, vocab_parallel
from lm.transformer import ACTIVATION, document_segments, scan_blocks
from sharding import axes, partition

SCHEDULES = pipeline_schedule.SCHEDULES
LossFn = Callable[[jax.Array, jax.Array], tuple[jax.Array, dict]]
_FORWARD_LOSS = 5  # the executor's own op: the last stage's forward, which also runs the head and the loss


def active(cfg: ModelConfig) -> bool:
    """Whether model ``cfg``'s step under the mesh in context runs a tick-table schedule (a ``stage`` axis and
    ``model.pipeline_schedule`` ``1f1b`` or ``zb_h1``)."""
    return pipeline_lib.stage_count() > 1 and cfg.pipeline_schedule in SCHEDULES


class _Result(NamedTuple):
    """What one op of a tick produces (zeros where the op makes no such thing)."""

    y: jax.Array  # the stage's output, sent to stage s + 1
    dh: jax.Array  # the gradient at the stage's input, sent to stage s - 1
    dy: jax.Array  # the last stage's output gradient from the loss
    d_local: Any  # the gradient of the stage's layer group
    d_rest: Any  # the gradient of the parameters outside the stack (the head's, on the last stage)
    totals: Any  # (loss, metrics) of the microbatch, on the last stage


def value_and_grad(
    model_def: ModelDef, params: dict, tokens: jax.Array, loss_fn: LossFn, *, z_loss: float = 0.0
) -> tuple[tuple[jax.Array, dict], dict]:
    """``((loss, metrics), grads)`` of ``loss_fn(logits, targets)`` on ``tokens`` ``(batch, seq + 1)``, by the schedule's table.

    ``loss`` and ``metrics`` are means over the microbatches (equal-sized, so the batch means). Under
    ``model.pipeline_vocab_parallel`` the loss is `lm.loss.cross_entropy`'s with ``z_loss``, computed over
    the stages' vocabulary slices (`lm.parallel.vocab_parallel`), and ``loss_fn`` is not called.
    """
    cfg, stages = model_def.config, pipeline_lib.stage_count()
    m = cfg.pipeline_microbatches
    pipeline_lib.check(cfg, stages=stages, batch=tokens.shape[0])
    ops, micro = pipeline_schedule.tick_table(cfg.pipeline_schedule, stages, m)
    arrived_f, arrived_b = pipeline_schedule.arrivals(ops, micro)
    input_slots, grad_slots = pipeline_schedule.buffer_slots(ops, micro)
    vocab = vocab_parallel.active(cfg)
    # Vocabulary parallelism: on the tick the last stage finishes microbatch i's forward, every stage runs the head's passes on i.
    finish = np.repeat(np.where(ops[:, -1] == pipeline_schedule.FORWARD, micro[:, -1], -1)[:, None], stages, axis=1)
    ops = ops.copy()
    if not vocab:
        ops[:, -1] = np.where(ops[:, -1] == pipeline_schedule.FORWARD, _FORWARD_LOSS, ops[:, -1])
    used = np.unique(ops)  # one `lax.switch` branch per op the table runs
    branch = np.searchsorted(used, ops).astype(np.int32)

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    blocks, rest = params["blocks"], {k: v for k, v in params.items() if k != "blocks"}
    model = lambda rest: nnx.merge(model_def.graphdef, {**rest, "blocks": blocks})  # noqa: E731
    block_graph = nnx.graphdef(model(rest).blocks)
    norm_graph = nnx.graphdef(model(rest).final_norm)
    head_key = ("embed", "embedding") if cfg.tie_embeddings else ("lm_head", "kernel")
    # Under vocabulary parallelism the head's weight enters split over `stage`, the other outer parameters replicated.
    inner = {k: {n: w for n, w in v.items() if (k, n) != head_key} for k, v in rest.items()} if vocab else rest
    head_w = rest[head_key[0]][head_key[1]] if vocab else None

    x, embed_vjp = jax.vjp(lambda rest: partition.constrain(model(rest).embed(inputs), ACTIVATION), rest)
    segments = document_segments(cfg, inputs)
    micro_x = pipeline_lib.to_microbatches(x, m)
    micro_t = pipeline_lib.to_microbatches(targets, m)
    micro_seg = None if segments is None else pipeline_lib.to_microbatches(segments, m)
    k = cfg.n_layers // stages
    grouped = jax.tree.map(lambda w: w.reshape(stages, k, *w.shape[1:]), blocks)

    forward_pairs = [(s, s + 1) for s in range(stages - 1)]
    backward_pairs = [(s + 1, s) for s in range(stages - 1)]

    def per_stage(local, rest, head_w, micro_x, micro_t, micro_seg, table):
        local = jax.tree.map(lambda w: w[0], local)
        stage = jax.lax.axis_index(axes.STAGE)
        run = lambda w, h, i: scan_blocks(cfg, nnx.merge(block_graph, w), h, None if micro_seg is None else micro_seg[i])[0]  # noqa: E731

        def head(rest, y, i):
            # Whole rows of logits: XLA's SPMD partitioner fails on the loss's gather over a vocab-split
            # axis inside a partly manual program (batch and tensor axes beside `stage`).
            logits = partition.constrain(model(rest)._logits(y), ("batch", "seq", None))
            return loss_fn(logits, micro_t[i])

        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        scalar = jnp.zeros((), jnp.float32)
        totals = (scalar, {"nll": scalar, "z_loss": scalar}) if vocab else zeros(jax.eval_shape(lambda: head(rest, micro_x[0], 0)))
        nothing = _Result(*(zeros(micro_x[0]),) * 3, zeros(local), zeros(rest), totals)

        def vocab_passes(out, j):
            """The head's S and T passes on this stage's vocabulary slice for microbatch ``j``, whose forward the last
            stage ran on this tick: ``(dy, d_rest, dW_s, totals)``, ``dy``, ``d_rest`` and ``totals`` real on the last stage."""
            last = stage == stages - 1
            y = jax.lax.psum(jnp.where(last, out.y, jnp.zeros_like(out.y)), axes.STAGE)  # the paper's broadcast
            f, norm_vjp = jax.vjp(lambda r, y: nnx.merge(norm_graph, r["final_norm"])(y), rest, y)
            totals, df, dw = vocab_parallel.loss_and_grads(f, head_w, micro_t[j], z_loss=z_loss, vocab_first=cfg.tie_embeddings, scale=1.0 / m)
            d_rest, dy = norm_vjp(df)
            only_last = lambda tree: jax.tree.map(lambda a: jnp.where(last, a, jnp.zeros_like(a)), tree)  # noqa: E731
            return dy.astype(y.dtype), only_last(d_rest), dw, only_last(totals)

        def tick(carry, row):
            recv_f, recv_b, kept_x, kept_dy, grads, head_grads, head_w_grad, dx, totals = carry
            op, i, got_f, got_b, fin = (r[stage] for r in row)
            kept_x = pipeline_lib.store(kept_x, got_f % input_slots, recv_f, got_f >= 0)
            kept_dy = pipeline_lib.store(kept_dy, got_b % grad_slots, recv_b, got_b >= 0)
            i = jnp.maximum(i, 0)
            h, dy = jnp.where(stage == 0, micro_x[i], kept_x[i % input_slots]), kept_dy[i % grad_slots]

            def forward():
                return nothing._replace(y=run(local, h, i))

            def forward_loss():  # the last stage: its forward, the loss and the loss's gradient at the output
                y = run(local, h, i)
                loss, head_vjp, metrics = jax.vjp(lambda r, y: head(r, y, i), rest, y, has_aux=True)
                d_rest, dy = head_vjp(jnp.float32(1.0 / m))
                return nothing._replace(dy=dy.astype(y.dtype), d_rest=d_rest, totals=(loss, metrics))

            def backward():
                d_local, dh = jax.vjp(lambda w, h: run(w, h, i), local, h)[1](dy)
                return nothing._replace(dh=dh, d_local=d_local)

            def backward_input():
                return nothing._replace(dh=jax.vjp(lambda h: run(local, h, i), h)[1](dy)[0])

            def backward_weight():
                return nothing._replace(d_local=jax.vjp(lambda w: run(w, h, i), local)[1](dy)[0])

            fns = {
                pipeline_schedule.IDLE: lambda: nothing, pipeline_schedule.FORWARD: forward, _FORWARD_LOSS: forward_loss,
                pipeline_schedule.BACKWARD: backward, pipeline_schedule.BACKWARD_INPUT: backward_input,
                pipeline_schedule.BACKWARD_WEIGHT: backward_weight,
            }  # fmt: skip
            out = jax.lax.switch(op, [fns[int(c)] for c in used])
            code = jnp.asarray(used)[op]
            kept_dy = pipeline_lib.store(kept_dy, i % grad_slots, out.dy, code == _FORWARD_LOSS)
            if vocab:
                j = jnp.maximum(fin, 0)
                none = (zeros(micro_x[0]), nothing.d_rest, zeros(head_w), nothing.totals)
                dy, d_rest, dw, tot = jax.lax.cond(fin >= 0, lambda: vocab_passes(out, j), lambda: none)
                kept_dy = pipeline_lib.store(kept_dy, j % grad_slots, dy, (fin >= 0) & (stage == stages - 1))
                out = out._replace(d_rest=d_rest, totals=tot)
                head_w_grad = head_w_grad + dw
            sends_dx = (stage == 0) & jnp.isin(code, jnp.asarray(pipeline_schedule.SENDS_GRADIENT))
            dx = pipeline_lib.store(dx, i, out.dh, sends_dx)
            grads, head_grads, totals = jax.tree.map(jnp.add, (grads, head_grads, totals), (out.d_local, out.d_rest, out.totals))
            sent = (
                jax.lax.ppermute(out.y, axes.STAGE, forward_pairs),
                jax.lax.ppermute(out.dh, axes.STAGE, backward_pairs),
            )
            return (*sent, kept_x, kept_dy, grads, head_grads, head_w_grad, dx, totals), None

        buffer = lambda slots: jnp.zeros((slots, *micro_x.shape[1:]), micro_x.dtype)  # noqa: E731
        init = (*nothing[:2], buffer(input_slots), buffer(grad_slots), *nothing[3:5], zeros(head_w), jnp.zeros_like(micro_x), nothing.totals)
        carry, _ = jax.lax.scan(tick, init, table)
        _, _, _, _, grads, head_grads, head_w_grad, dx, totals = carry
        total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, axes.STAGE), tree)  # noqa: E731
        loss, metrics = jax.tree.map(lambda a: a / m, total(totals))
        return loss, metrics, jax.tree.map(lambda g: g[None], grads), total(head_grads), head_w_grad, total(dx)

    stage_spec = jax.P(axes.STAGE)
    head_spec = jax.P() if head_w is None else jax.P(axes.STAGE) if cfg.tie_embeddings else jax.P(None, axes.STAGE)
    replicated = lambda tree: jax.tree.map(lambda _: jax.P(), tree)  # noqa: E731
    table = tuple(jnp.asarray(t) for t in (branch, micro, arrived_f, arrived_b, finish))
    loss, metrics, block_grads, head_grads, head_w_grad, dx = jax.shard_map(
        per_stage,
        in_specs=(jax.tree.map(lambda _: stage_spec, grouped), replicated(inner), head_spec, jax.P(), jax.P(), jax.P(), replicated(table)),
        out_specs=(jax.P(), jax.P(), jax.tree.map(lambda _: stage_spec, grouped), replicated(inner), head_spec, jax.P()),
        axis_names={axes.STAGE},
        check_vma=False,
    )(grouped, inner, head_w, micro_x, micro_t, micro_seg, table)
    if vocab:  # the head's weight gradient, split over `stage` like the weight, back into the outer parameters' tree
        head_grads = {k: {**v, head_key[1]: head_w_grad} if k == head_key[0] else v for k, v in head_grads.items()}
    (embed_grads,) = embed_vjp(pipeline_lib.from_microbatches(dx))
    grads = jax.tree.map(jnp.add, head_grads, embed_grads)
    grads["blocks"] = jax.tree.map(lambda g: g.reshape(-1, *g.shape[2:]), block_grads)
    return (loss, metrics), grads

