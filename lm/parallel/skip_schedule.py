"""SkipPipe's partial and reordered paths and their tick tables (NumPy; executed by `lm.parallel.pipeline`).

"SkipPipe: Partial and Reordered Pipelining Framework for Training LLMs in Heterogeneous Networks"
(Gensyn; reference code gensyn-ai/skippipe). Each microbatch runs a *path*: an
ordered subset of the ``S`` stages that starts at stage 0 (it holds the input) and ends at stage
``S - 1``; the layer groups of the stages left out are skipped for that microbatch (layer dropping at
the granularity of a stage), and the groups in between may run in another order. The paper's scheduler
draws paths under its convergence guidelines, which `paths` follows: with skip rate ``k`` every
microbatch skips ``round(k S)`` stages, never the first or the last, and never two consecutive ones
(a skipped run of stages would remove a contiguous slab of the network); the skipped set is drawn
uniformly among those allowed, once per run (seed 0: a microbatch slot keeps its path every step, the
batch rows in it change). Reordering (a microbatch visiting stage ``b`` before ``a < b``) is a path
like any other to the tables and the executor; `paths` draws skips only (in order), as the issue's
``model.pipeline_skip_rate`` asks; the heterogeneous-network placement of the paper is not modelled.

`tick_table` places every hop of every path on a unit-time tick, list-scheduled as a stage with blocking
receives would run them: a stage runs, of the microbatches whose input is there (sent on an earlier
tick), the lowest-numbered one, one per tick. With skip rate 0 every path is ``0, 1, ..., S - 1`` and
the table is GPipe's (`lm.parallel.pipeline.forward_table`). Shorter paths leave fewer hops to run:

    bubble = idle (tick, stage) slots / (ticks S),    throughput = M / ticks   (microbatches per tick)
"""

from __future__ import annotations

import itertools

import numpy as np

Path = tuple[int, ...]


def max_skips(stages: int) -> int:
    """The most stages one path may skip: none of the first and last, no two consecutive."""
    return (stages - 1) // 2


def skips(stages: int, skip_rate: float) -> int:
    """Stages each microbatch skips at ``skip_rate``; a ValueError naming the rates that work when too many."""
    if not 0.0 <= skip_rate < 1.0:
        raise ValueError(f"model.pipeline_skip_rate={skip_rate} must be in [0, 1)")
    n = round(skip_rate * stages)
    if n > max_skips(stages):
        top = max_skips(stages) / stages
        raise ValueError(
            f"model.pipeline_skip_rate={skip_rate} skips {n} of stage:{stages} per microbatch, but at most {max_skips(stages)} "
            f"can be skipped (never the first or last stage, never two consecutive ones); use a skip rate <= {top:g}"
        )
    return n


def paths(stages: int, microbatches: int, skip_rate: float, seed: int = 0) -> list[Path]:
    """One path per microbatch: stages ``0 .. S-1`` in order less ``skips(stages, skip_rate)`` of them, drawn uniformly
    among the sets with no first or last stage and no two consecutive stages."""
    n = skips(stages, skip_rate)
    allowed = [c for c in itertools.combinations(range(1, stages - 1), n) if all(b - a > 1 for a, b in itertools.pairwise(c))]
    rng = np.random.default_rng(seed)
    return [tuple(s for s in range(stages) if s not in allowed[k]) for k in rng.integers(0, len(allowed), microbatches)]


def check_paths(route: list[Path], stages: int) -> None:
    """Raises a ValueError unless every path starts at stage 0, ends at ``stages - 1`` and visits no stage twice."""
    for m, path in enumerate(route):
        if path[0] != 0 or path[-1] != stages - 1 or len(set(path)) != len(path) or not set(path) <= set(range(stages)):
            raise ValueError(f"microbatch {m}'s path {path} must run stage 0 first, stage {stages - 1} last, each stage at most once")


def tick_table(route: list[Path], stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``(items, sources)``: ``(ticks, stages)`` tables of the microbatch each stage runs per tick (-1 idle) and the stage
    its input comes from (-1: the batch, or idle)."""
    check_paths(route, stages)
    hop, ready = [0] * len(route), [0] * len(route)  # next hop of each path, the first tick it may run on
    items, sources = [], []
    while any(h < len(p) for h, p in zip(hop, route, strict=True)):
        t = len(items)
        row_items, row_sources = [-1] * stages, [-1] * stages
        for m, path in enumerate(route):
            if hop[m] < len(path) and ready[m] <= t and row_items[path[hop[m]]] < 0:
                s = path[hop[m]]
                row_items[s], row_sources[s] = m, path[hop[m] - 1] if hop[m] else -1
        for s, m in enumerate(row_items):
            if m >= 0:
                hop[m], ready[m] = hop[m] + 1, t + 1
        items.append(row_items)
        sources.append(row_sources)
    return np.array(items, np.int32), np.array(sources, np.int32)


def offsets(sources: np.ndarray) -> tuple[int, ...]:
    """The stage distances ``s - source`` that a table's hops travel (one collective-permute each per tick)."""
    stage = np.broadcast_to(np.arange(sources.shape[1]), sources.shape)
    return tuple(sorted({int(d) for d in (stage - sources)[sources >= 0]}))


def arrivals(items: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """``(ticks, stages, len(offsets))``: the microbatch arriving at stage ``s`` on tick ``t`` from stage ``s - offset``
    (run there on an earlier tick; kept until it is used), -1 where none. A stage's output travels on the tick after it ran."""
    hops, ticks = offsets(sources), items.shape[0]
    out = np.full((ticks, items.shape[1], len(hops)), -1, np.int32)
    ran = {(int(items[t, s]), s): t for t in range(ticks) for s in range(items.shape[1]) if items[t, s] >= 0}
    for t, s in zip(*np.nonzero(sources >= 0), strict=True):
        m, src = int(items[t, s]), int(sources[t, s])
        out[ran[(m, src)] + 1, s, hops.index(s - src)] = m
    return out


def bubble_fraction(items: np.ndarray) -> float:
    """The share of a table's (tick, stage) slots that are idle."""
    return float(np.mean(items < 0))


def throughput(items: np.ndarray) -> float:
    """Microbatches finished per tick."""
    return float(len(np.unique(items[items >= 0])) / items.shape[0])
