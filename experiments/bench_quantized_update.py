r"""The quantized optimizer-state update: fp32 AdamW, then 8- and 4-bit states with XLA and with the fused kernel.

Run through `experiments.bench_kernels` (``--sections=quantized_update``). Each row times one
optimizer step on a set of parameter matrices, ``update`` then ``apply_updates``, jitted, with the
state and parameters donated so that XLA may update them in place. ``bytes/param`` is the least
traffic such a step needs per parameter (fp32 gradient and parameter read, parameter written; each
moment read and written at its stored width, scales included): 28 for fp32 AdamW, 16.06 for 8-bit,
~14.07 for 4-bit. ``GB/s`` is that count over the measured time: compare it with the device's copy
bandwidth. The kernel returns the update (optax's contract), so the step moves one more fp32 write and
read than this minimum. Rows that cannot run here (the kernel off a GPU) say why.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

import kernels_pallas.quantized_update as qu
from experiments import timing
from optim.quantize_state import Fused, quantize_state

VARIANTS = ("fp32", "8bit_xla", "8bit_pallas", "4bit_xla", "4bit_pallas")
GPT2_124M_MATRICES = ["12x768x2304", "12x768x768", "12x768x3072", "12x3072x768"]  # its blocks' weights, stacked


def bytes_per_param(variant: str, shape: tuple[int, ...]) -> float:
    """The least bytes one AdamW step moves per parameter for ``variant`` (module docstring)."""
    if variant == "fp32":
        return 4 + 4 + 4 + 2 * 2 * 4
    bits = int(variant[0])
    block = 256 if bits == 8 else 128
    if bits == 8:  # codes and block scales of both moments, read and written
        return 12 + 2 * 2 * (1 + 4 / block)
    # mu: codes and block scales; nu: codes and rank-1 maxima (R + C floats per matrix); read and written
    return 12 + 2 * (0.5 + 4 / block) + 2 * (0.5 + 4 * (1 / shape[-1] + 1 / shape[-2]))


def _step(variant: str, interpret: bool):
    adamw = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    if variant == "fp32":
        return adamw
    bits, kernel = int(variant[0]), variant.split("_")[1]
    if kernel == "pallas" and not (qu.available() or interpret):
        raise NotImplementedError(f"no quantized-update kernel on {jax.default_backend()}")
    fused = Fused(qu.AdamW(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1), 1e-3)
    return quantize_state(adamw, bits, kernel=kernel, fused=fused, interpret=interpret, mask=lambda p: jax.tree.map(lambda _: True, p))


def bench(shapes: list[tuple[int, ...]], variants: list[str], *, warmup: int = 2, iters: int = 10, interpret: bool = False) -> list[dict]:
    """One row per variant: median / min ms of a step over all ``shapes``, bytes per parameter, GB/s."""
    keys = jax.random.split(jax.random.key(0), 2 * len(shapes))
    params = {f"w{i}": jax.random.normal(keys[2 * i], s, jnp.float32) for i, s in enumerate(shapes)}
    grads = {f"w{i}": jax.random.normal(keys[2 * i + 1], s, jnp.float32) * 1e-2 for i, s in enumerate(shapes)}
    n = sum(p.size for p in params.values())
    rows = []
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; use {', '.join(VARIANTS)}")
        row: dict[str, Any] = {"variant": variant, "params": n}
        try:
            tx = _step(variant, interpret)
        except NotImplementedError as e:
            rows.append({**row, "unavailable": str(e)})
            continue

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        carried = [jax.tree.map(jnp.copy, params), tx.init(params)]
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*carried, grads).compile()

        def one_step(compiled=compiled, carried=carried):  # parameters and state donated and carried, as in training
            carried[:] = compiled(*carried, grads)
            return carried

        rows.append(row)
        if timing.timed_row(row, one_step, warmup, iters) is None:
            continue
        per_param = sum(bytes_per_param(variant, x.shape) * x.size for x in params.values()) / n
        memory = compiled.memory_analysis()
        row.update(
            bytes_per_param=per_param,
            gb_per_s=per_param * n / (row["ms"] * 1e-3) / 1e9,
            temp_bytes=None if memory is None else int(memory.temp_size_in_bytes),
        )
    fp32 = next((r for r in rows if r["variant"] == "fp32" and "ms" in r), None)
    for r in rows:
        if "ms" in r:
            r["vs_fp32"] = None if fp32 is None else r["ms"] / fp32["ms"]
    return rows


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(
        rows,
        ["variant", "params"],
        {
            **timing.TIME_COLUMNS,
            "time vs fp32": lambda r: timing.optional(r["vs_fp32"], ".2f"),
            "bytes/param": lambda r: f"{r['bytes_per_param']:.2f}",
            "GB/s": lambda r: f"{r['gb_per_s']:.1f}",
            "step temp MiB": lambda r: timing.optional(None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20, ".1f"),
        },
    )
