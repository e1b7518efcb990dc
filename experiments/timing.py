"""Timing and tabulating benchmark rows, shared by the `bench_*` scripts.

A row is a dict: the fields that name it (shape, implementation, mode, ...), then either the timing
(``ms``: median, ``ms_min``: fastest sample, in milliseconds per call) or ``unavailable``: why it did
not run here.

A sample is several calls issued back to back (dispatched without waiting, as a training loop runs
them) and waited for once at the end, divided by their number: one call between two host timers
would add the dispatch and synchronisation latency to every kernel, which for a sub-millisecond
kernel on a GPU is most of the figure.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def time_calls(fn: Callable[[], Any], warmup: int, iters: int, *, min_sample_s: float = 0.02, max_calls: int = 100) -> list[float]:
    """Seconds per call of ``fn`` in each of ``iters`` samples, after ``warmup`` untimed calls.

    A sample runs ``calls`` calls back to back and waits for the last (module docstring); ``calls``
    is what the last warm-up call's time says makes a sample last ``min_sample_s`` (at most
    ``max_calls``; 1 without warm-up, whose first call would include compilation).
    """
    once = math.inf
    for _ in range(warmup):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        once = time.perf_counter() - start
    calls = min(max_calls, max(1, math.ceil(min_sample_s / max(once, 1e-9)))) if warmup else 1
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        seconds.append((time.perf_counter() - start) / calls)
    return seconds


def timed_row(row: dict, fn: Callable[[], Any], warmup: int, iters: int) -> Any:
    """Times ``fn`` into ``row`` (``ms``, ``ms_min``) and returns its output; on failure notes why in ``row`` and returns None.

    One failing row (out of memory, an unsupported shape) must not end a benchmark, so any exception is
    caught and recorded as ``unavailable``.
    """
    try:
        seconds = time_calls(fn, warmup, iters)
    except Exception as e:  # noqa: BLE001 -- see the docstring
        row["unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None
    row.update(ms=statistics.median(seconds) * 1e3, ms_min=min(seconds) * 1e3)
    return fn()


def max_abs_diff(got: Any, reference: Any) -> float | None:
    """Largest absolute difference, in float32, over the leaves of two trees; None without a reference."""
    if reference is None:
        return None
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
    )


def optional(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


# The timing columns of every table: median and fastest call.
TIME_COLUMNS: dict[str, Callable[[dict], str]] = {
    "ms (median)": lambda r: f"{r['ms']:.3f}",
    "ms (min)": lambda r: f"{r['ms_min']:.3f}",
}


def markdown_table(rows: Sequence[dict], keys: Sequence[str], columns: dict[str, Callable[[dict], str]], header: Sequence[str] | None = None) -> str:
    """One Markdown line per row: its ``keys`` fields (integers with thousands separators), then ``columns``
    (header -> cell of a timed row).

    A row that did not run fills the first column with ``not run: <why>`` and leaves the others empty.
    ``header`` names the ``keys`` columns (default: the keys themselves).
    """
    names = [*(header or keys), *columns]
    lines = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    for r in rows:
        cells = [f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for k in keys]
        if "unavailable" in r:
            cells += [f"not run: {r['unavailable']}", *[""] * (len(columns) - 1)]
        else:
            cells += [cell(r) for cell in columns.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
