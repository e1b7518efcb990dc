"""Timing and tabulating benchmark rows, shared by the `bench_*` scripts.

A row is a dict: the fields that name it (shape, implementation, mode, ...), then either the timing
(``ms``: median, ``ms_min``: fastest call, in milliseconds) or ``unavailable``: why it did not run here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def time_calls(fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn``, each waited to completion, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - start)
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
