"""Unit-time tick tables of the 1F1B and ZB-H1 pipeline schedules (NumPy; executed by `lm.parallel.pipeline_1f1b`).

A table is a pair of ``(ticks, stages)`` int arrays: the op each stage runs on each tick and its
microbatch (-1 where idle). Every op takes one tick, and a result computed on tick ``t`` reaches the
neighbouring stage on tick ``t + 1`` (one collective-permute per tick and direction). The ops:

- ``FORWARD``: the stage's layer group on one microbatch (the last stage also runs head and loss);
- ``BACKWARD``: input and weight gradients of the group in one pass (1F1B);
- ``BACKWARD_INPUT`` (B) and ``BACKWARD_WEIGHT`` (W): the two halves of ``BACKWARD`` (ZB-H1). B is
  on the critical path (its result goes to stage ``s - 1``); W only feeds the stage's own gradient
  sum, so it can wait for a tick where the stage would otherwise idle.

Each stage runs a fixed order of ops (`stage_order`); the table places every op on the first tick
after its inputs exist (`tick_table`), as a stage with blocking receives would. With ``S`` stages and
``M`` microbatches, stage ``s`` runs, in order:

- ``1f1b`` (PipeDream-Flush): ``S - 1 - s`` forwards, then alternately one forward and one backward,
  then the remaining backwards: ``2(M + S - 1)`` ticks, idle share ``(S - 1) / (M + S - 1)``, at most
  ``S - s`` microbatches between forward and backward;
- ``zb_h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, schedule ZB-H1):
  ``S - 1 - s`` forwards, ``s`` times a forward and a B, then F, B, W triples, then B, W pairs, then
  the remaining Ws: ``3M + S - 1`` ticks, idle share ``(S - 1) / (3M + S - 1)`` (a third of 1F1B's
  when F, B and W cost the same), at most ``S`` microbatches between forward and W on every stage.
"""

from __future__ import annotations

import numpy as np

IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = range(5)  # op codes of a table
SCHEDULES = ("1f1b", "zb_h1")
RELEASES = (BACKWARD, BACKWARD_WEIGHT)  # the ops after which a stage no longer needs a microbatch
SENDS_GRADIENT = (BACKWARD, BACKWARD_INPUT)  # the ops whose input gradient goes to stage s - 1


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[tuple[int, int]]:
    """The ``(op, microbatch)`` sequence that ``stage`` runs under ``schedule`` (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} has no tick table; use one of {', '.join(SCHEDULES)}")
    m, order, count = microbatches, [], dict.fromkeys((FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT), 0)

    def run(*ops: int) -> None:
        for op in ops:
            order.append((op, count[op]))
            count[op] += 1

    warmup = min(stages - 1 - stage, m)
    for _ in range(warmup):
        run(FORWARD)
    if schedule == "1f1b":
        for _ in range(m - warmup):
            run(FORWARD, BACKWARD)
        for _ in range(warmup):
            run(BACKWARD)
        return order
    deferred = min(stage, m - warmup)  # stage s holds back s Ws to fill its cool-down
    for _ in range(deferred):
        run(FORWARD, BACKWARD_INPUT)
    for _ in range(m - warmup - deferred):
        run(FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    for _ in range(warmup):
        run(BACKWARD_INPUT, BACKWARD_WEIGHT)
    for _ in range(deferred):
        run(BACKWARD_WEIGHT)
    return order


def tick_table(schedule: str, stages: int, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ops, micro)``: ``(ticks, stages)`` tables of each stage's op per tick and its microbatch (-1 idle).

    Every op runs on the first tick after its inputs are there: a forward after the previous stage's
    forward of the microbatch, a backward (or B) after the next stage's backward (or B) and the
    stage's own forward, a W after the stage's B.
    """
    orders = [stage_order(schedule, stages, microbatches, s) for s in range(stages)]
    done: set[tuple[int, int, int]] = set()  # (op, microbatch, stage) run on an earlier tick
    position, ops, micro = [0] * stages, [], []

    def ready(op: int, i: int, s: int) -> bool:
        if op == FORWARD:
            return s == 0 or (FORWARD, i, s - 1) in done
        if op == BACKWARD_WEIGHT:
            return (BACKWARD_INPUT, i, s) in done
        upstream = s == stages - 1 or any((b, i, s + 1) in done for b in SENDS_GRADIENT)
        return upstream and (FORWARD, i, s) in done

    while any(p < len(o) for p, o in zip(position, orders, strict=True)):
        row_ops, row_micro, finished = [IDLE] * stages, [-1] * stages, set()
        for s, order in enumerate(orders):
            if position[s] < len(order) and ready(*order[position[s]], s):
                op, i = order[position[s]]
                row_ops[s], row_micro[s] = op, i
                finished.add((op, i, s))
                position[s] += 1
        if not finished:
            raise AssertionError(f"{schedule} with stages={stages}, microbatches={microbatches} deadlocks")
        done.update(finished)
        ops.append(row_ops)
        micro.append(row_micro)
    return np.array(ops, np.int32), np.array(micro, np.int32)


def bubble_fraction(ops: np.ndarray) -> float:
    """The share of a tick table's (tick, stage) entries that are idle."""
    return float(np.mean(ops == IDLE))


def _held(starts: np.ndarray, ops: np.ndarray, micro: np.ndarray) -> np.ndarray:
    """``(ticks, stages)`` count of microbatches held: from the tick where ``starts`` names one to its release, inclusive."""
    held = np.zeros(ops.shape, np.int32)
    for s in range(ops.shape[1]):
        release = {int(i): t for t, (op, i) in enumerate(zip(ops[:, s], micro[:, s], strict=True)) if op in RELEASES}
        for t in np.flatnonzero(starts[:, s] >= 0):
            held[t : release[int(starts[t, s])] + 1, s] += 1
    return held


def _next_tick(table: np.ndarray) -> np.ndarray:
    """``table`` one tick later (-1 on the first tick)."""
    return np.concatenate([np.full((1, table.shape[1]), -1, table.dtype), table[:-1]])


def in_flight(ops: np.ndarray, micro: np.ndarray) -> np.ndarray:
    """Per stage, the most microbatches whose forward has run and whose (weight-)gradient pass has not, at once."""
    return _held(np.where(ops == FORWARD, micro, -1), ops, micro).max(axis=0)


def arrivals(ops: np.ndarray, micro: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(activations, gradients)``: per (tick, stage), the microbatch whose input arrives from stage ``s - 1`` (its
    forward ran there on the tick before) and whose output gradient arrives from stage ``s + 1``; -1 where none."""
    activations, gradients = np.full(ops.shape, -1, np.int32), np.full(ops.shape, -1, np.int32)
    activations[:, 1:] = _next_tick(np.where(ops == FORWARD, micro, -1))[:, :-1]
    gradients[:, :-1] = _next_tick(np.where(np.isin(ops, SENDS_GRADIENT), micro, -1))[:, 1:]
    return activations, gradients


def buffer_slots(ops: np.ndarray, micro: np.ndarray) -> tuple[int, int]:
    """``(inputs, gradients)``: ring-buffer slots a stage needs, the most microbatches held at once on any stage.

    A stage keeps a microbatch's input from its arrival to its release (stage 0 reads its inputs from
    the batch) and its output gradient from its arrival (on the last stage: the tick after its
    forward, which runs the loss) to its release. Both hold consecutive microbatches: slot ``i mod slots``.
    """
    activations, gradients = arrivals(ops, micro)
    gradients[:, -1] = _next_tick(np.where(ops == FORWARD, micro, -1))[:, -1]
    return int(_held(activations, ops, micro).max()), int(_held(gradients, ops, micro).max())
