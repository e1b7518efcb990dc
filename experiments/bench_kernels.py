r"""Kernels: attention (forward and forward+backward of every implementation, checked against XLA) and
the quantized optimizer-state update (`experiments.bench_quantized_update`).

    python -m experiments.bench_kernels --json_out=/tmp/kernels.json             # on a GPU
    python -m experiments.bench_kernels --shapes=1x64x2x32 --implementations=pallas,xla \
        --gmm_shapes=2x40x16x16 --gmm_block_m=16 --gmm_block_k=16 --gmm_block_n=16   # CPU smoke run
    python -m experiments.bench_kernels --sections=quantized_update   # the update on gpt2-124m's block matrices

Implementations (causal self-attention, ``(batch, seq, heads, head_dim)``):

- ``pallas``: ours, `kernels_pallas.attention.flash_attention` (Triton on GPU, Mosaic on TPU;
  interpret mode on CPU, which only shows that it runs).
- ``cudnn`` / ``xla``: `jax.nn.dot_product_attention(..., implementation=...)`.
- ``jax_triton``: the Pallas GPU kernel that ships with JAX, `jax.experimental.pallas.ops.gpu.attention.mha`
  (default block sizes; sequence lengths must be multiples of 128).

Each row is one implementation x shape x mode (``fwd``, or ``fwd_bwd``: the forward pass and the pullback
of a fixed random cotangent to q, k, v). After ``--warmup`` calls (compilation included), ``--iters``
calls are timed one by one to completion; the median and minimum are reported. TFLOP/s count the
causal half of the matmuls (FlashAttention-2, arXiv:2307.08691, Sec. 4): forward ``2 * 2 B H T^2 D / 2``,
backward 2.5x the forward. ``peak`` is ``--peak_tflops`` (default: H100 SXM dense bf16, 989).
``vs_cudnn`` is cuDNN's time over the row's (above 1: faster than cuDNN). ``max_err`` is the largest
absolute difference from the ``xla`` row's output (fwd) or gradients (fwd_bwd), in float32.
An implementation that cannot run here (cuDNN off an NVIDIA GPU) is listed with its reason.

Grouped matmul (``--gmm_shapes``, ``GxMxKxN``; empty to skip): `kernels_pallas.gmm.gmm` (``pallas``,
Triton on GPU, Mosaic on TPU, Triton in interpret mode on CPU) against ``jax.lax.ragged_dot`` (``ragged_dot``) for ``lhs (M, K)``,
``rhs (G, K, N)`` and group sizes drawn as a multinomial of ``M`` tokens over ``G`` equally likely experts
(seeded). FLOPs: ``2 M K N`` forward, three times that forward+backward (dlhs and drhs). ``vs_ragged_dot``
is ragged_dot's time over the row's; ``max_err`` is against the ragged_dot row. The default shape is a
dropless MoE layer's up-projection (E=8, 16k token slots, 768 -> 2048); its GPU figures are not yet measured.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import bench_quantized_update
from kernels_pallas import gmm as gmm_lib
from kernels_pallas.attention import BlockSizes, flash_attention
from kernels_pallas.gmm import Tiling
from kernels_pallas.gmm import api as gmm_api

DEFAULT_SHAPES = ["16x1024x12x64", "4x4096x16x128", "1x16384x8x128"]
IMPLEMENTATIONS = ("pallas", "cudnn", "xla", "jax_triton")

_SHAPES = flags.DEFINE_list("shapes", DEFAULT_SHAPES, "BATCHxSEQxHEADSxHEAD_DIM, causal self-attention.")
_IMPLEMENTATIONS = flags.DEFINE_list("implementations", list(IMPLEMENTATIONS), f"From {', '.join(IMPLEMENTATIONS)}.")
_MODES = flags.DEFINE_list("modes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Input dtype.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls first (compilation included).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per row.")
_PEAK = flags.DEFINE_float("peak_tflops", 989.0, "Dense peak TFLOP/s of the device in --dtype (H100 SXM bf16: 989).")
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the rows as JSON here.")
_SECTIONS = flags.DEFINE_list("sections", ["attention"], "attention and/or quantized_update.")
_Q_SHAPES = flags.DEFINE_list(
    "quantized_shapes", bench_quantized_update.GPT2_124M_MATRICES, "Parameter shapes (AxBxC) of the quantized-update section."
)
_Q_VARIANTS = flags.DEFINE_list("quantized_variants", list(bench_quantized_update.VARIANTS), "Rows of the quantized-update section.")
_GMM_SHAPES = flags.DEFINE_list("gmm_shapes", ["8x16384x768x2048"], "GROUPSxMxKxN grouped matmuls; empty to skip.")
_GMM_TILING = {name: flags.DEFINE_integer(f"gmm_{name}", 0, f"Tiling.{name} of the gmm kernel (0: default).") for name in ("block_m", "block_k", "block_n")}
_BLOCKS = {
    name: flags.DEFINE_integer(name, 0, f"BlockSizes.{name} of the pallas rows (0: the backend's default).")
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv", "num_warps", "num_stages")
}


def parse_dims(text: str) -> tuple[int, ...]:
    parts = text.strip().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise app.UsageError(f"shape {text!r} is not positive sizes joined by x, e.g. 12x768x3072")
    return tuple(int(p) for p in parts)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.strip().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise app.UsageError(f"shape {text!r} is not BATCHxSEQxHEADSxHEAD_DIM, e.g. 16x1024x12x64")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def attention_flops(shape: tuple[int, int, int, int], mode: str) -> float:
    """Causal attention matmul FLOPs: forward 4 B H T^2 D / 2, backward 2.5x that."""
    b, t, h, d = shape
    forward = 4 * b * h * t * t * d / 2
    return forward * (3.5 if mode == "fwd_bwd" else 1.0)


def implementation(name: str, *, block_sizes: BlockSizes | None, interpret: bool) -> Callable:
    """``attend(q, k, v) -> out`` for a row, or raises `NotImplementedError` with why it cannot run here."""
    if name == "pallas":
        return lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=block_sizes, interpret=interpret)
    if name in ("cudnn", "xla"):
        if name == "cudnn" and jax.default_backend() != "gpu":
            raise NotImplementedError("cuDNN needs an NVIDIA GPU")
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=name)
    if name == "jax_triton":
        from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention

        if jax.default_backend() != "gpu" and not interpret:
            raise NotImplementedError("jax's Triton kernel needs a GPU (or interpret mode)")
        return lambda q, k, v: jax_gpu_attention.mha(
            q, k, v, segment_ids=None, sm_scale=q.shape[-1] ** -0.5, causal=True, interpret=interpret
        )
    raise app.UsageError(f"unknown implementation {name!r}; use {', '.join(IMPLEMENTATIONS)}")


def _timed(fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds.append(time.perf_counter() - start)
    return seconds


def _inputs(shape, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape, dtype) for key in keys)  # q, k, v, output cotangent


def bench(
    shapes: list[tuple[int, int, int, int]],
    implementations: list[str],
    modes: list[str],
    *,
    dtype: str = "bfloat16",
    warmup: int = 3,
    iters: int = 20,
    peak_tflops: float = 989.0,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> list[dict]:
    """One dict per implementation x shape x mode (see the module docstring for the fields)."""
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    rows = []
    for shape in shapes:
        q, k, v, d_out = _inputs(shape, jnp.dtype(dtype))
        shape_rows, results = [], {}
        for mode in modes:
            for name in implementations:
                row = {"shape": "x".join(map(str, shape)), "implementation": name, "mode": mode, "dtype": dtype}
                shape_rows.append(row)
                try:
                    attend = implementation(name, block_sizes=block_sizes, interpret=interpret)
                except NotImplementedError as e:
                    row["unavailable"] = str(e)
                    continue
                if mode == "fwd":
                    step, args = jax.jit(attend), (q, k, v)
                else:
                    step = jax.jit(lambda q, k, v, d_out, attend=attend: jax.vjp(attend, q, k, v)[1](d_out))
                    args = (q, k, v, d_out)
                try:
                    seconds = _timed(lambda step=step, args=args: step(*args), warmup, iters)
                except Exception as e:  # noqa: BLE001 -- one failing row (out of memory, unsupported) must not end the run
                    row["unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                results[name, mode] = step(*args)
                ms = statistics.median(seconds) * 1e3
                tflops = attention_flops(shape, mode) / (ms * 1e-3) / 1e12
                row.update(ms=ms, ms_min=min(seconds) * 1e3, tflops=tflops, peak_fraction=tflops / peak_tflops)
        for row in shape_rows:
            if "ms" in row:
                cudnn = results.get(("cudnn", row["mode"])) is not None and next(
                    r for r in shape_rows if r["mode"] == row["mode"] and r["implementation"] == "cudnn"
                )
                row["vs_cudnn"] = cudnn["ms"] / row["ms"] if cudnn else None
                row["max_err"] = _max_err(results[row["implementation"], row["mode"]], results.get(("xla", row["mode"])))
        rows += shape_rows
    return rows


def _max_err(got: Any, reference: Any) -> float | None:
    if reference is None:
        return None
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference), strict=True)
    )


def format_table(rows: list[dict]) -> str:
    lines = [
        "| shape BxTxHxD | implementation | mode | ms (median) | ms (min) | TFLOP/s | % of peak | vs cuDNN | max err vs xla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['implementation']} | {r['mode']} | not run: {r['unavailable']} | | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['implementation']} | {r['mode']} | {r['ms']:.3f} | {r['ms_min']:.3f} | {r['tflops']:.1f} | "
            f"{100 * r['peak_fraction']:.1f} | {fmt(r['vs_cudnn'], '.2f')} | {fmt(r['max_err'], '.2e')} |"
        )
    return "\n".join(lines)


GMM_IMPLEMENTATIONS = ("pallas", "ragged_dot")


def bench_gmm(
    shapes: list[tuple[int, int, int, int]],
    modes: list[str],
    *,
    dtype: str = "bfloat16",
    warmup: int = 3,
    iters: int = 20,
    tiling: Tiling | None = None,
    interpret: bool | None = None,
) -> list[dict]:
    """One dict per gmm implementation x shape x mode: ms, ms_min, tflops, vs_ragged_dot, max_err."""
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    backend = gmm_api.PLATFORM_BACKENDS.get(jax.default_backend(), "triton")
    impls = {
        "pallas": lambda a, b, g: gmm_lib.gmm(a, b, g, backend=backend, interpret=interpret, tiling=tiling),
        "ragged_dot": jax.lax.ragged_dot,
    }
    rows = []
    for groups, m, k, n in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        lhs, rhs = jax.random.normal(keys[0], (m, k), dtype), jax.random.normal(keys[1], (groups, k, n), dtype)
        d_out = jax.random.normal(keys[2], (m, n), dtype)
        sizes = jnp.asarray(np.random.default_rng(0).multinomial(m, np.full(groups, 1 / groups)), jnp.int32)
        for mode in modes:
            results, shape_rows = {}, []
            for name, fn in impls.items():
                row = {"shape": f"{groups}x{m}x{k}x{n}", "implementation": name, "mode": mode, "dtype": dtype}
                shape_rows.append(row)
                if mode == "fwd":
                    step = jax.jit(lambda a, b, fn=fn: fn(a, b, sizes))
                else:
                    step = jax.jit(lambda a, b, fn=fn: jax.vjp(lambda a, b: fn(a, b, sizes), a, b)[1](d_out))
                try:
                    seconds = _timed(lambda step=step: step(lhs, rhs), warmup, iters)
                except Exception as e:  # noqa: BLE001 -- one failing row must not end the run
                    row["unavailable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    continue
                results[name] = step(lhs, rhs)
                ms = statistics.median(seconds) * 1e3
                flops = 2.0 * m * k * n * (1 if mode == "fwd" else 3)
                row.update(ms=ms, ms_min=min(seconds) * 1e3, tflops=flops / (ms * 1e-3) / 1e12)
            baseline = next((r for r in shape_rows if r["implementation"] == "ragged_dot" and "ms" in r), None)
            for row in shape_rows:
                if "ms" in row:
                    row["vs_ragged_dot"] = baseline["ms"] / row["ms"] if baseline else None
                    row["max_err"] = _max_err(results[row["implementation"]], results.get("ragged_dot"))
            rows += shape_rows
    return rows


def format_gmm_table(rows: list[dict]) -> str:
    lines = [
        "| shape GxMxKxN | implementation | mode | ms (median) | ms (min) | TFLOP/s | vs ragged_dot | max err vs ragged_dot |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['implementation']} | {r['mode']} | not run: {r['unavailable']} | | | | |")
            continue
        lines.append(
            f"| {r['shape']} | {r['implementation']} | {r['mode']} | {r['ms']:.3f} | {r['ms_min']:.3f} | {r['tflops']:.1f} | "
            f"{fmt(r['vs_ragged_dot'], '.2f')} | {fmt(r['max_err'], '.2e')} |"
        )
    return "\n".join(lines)


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    unknown = sorted(set(_SECTIONS.value) - {"attention", "quantized_update"})
    if unknown:
        raise app.UsageError(f"unknown section(s) {unknown}; use attention and/or quantized_update")
    env = environment()
    out = {**env}
    if "quantized_update" in _SECTIONS.value:
        q_rows = bench_quantized_update.bench(
            [parse_dims(s) for s in _Q_SHAPES.value], _Q_VARIANTS.value, warmup=_WARMUP.value, iters=_ITERS.value
        )
        print(f"{env['device_kind']} ({env['backend']}), jax {env['jax']}, {env['date']}: quantized AdamW update")
        print(bench_quantized_update.format_table(q_rows))
        out["quantized_update_rows"] = q_rows
    if "attention" in _SECTIONS.value:
        out.update(_attention(env))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(out, f, indent=1)


def _attention(env: dict) -> dict:
    for mode in _MODES.value:
        if mode not in ("fwd", "fwd_bwd"):
            raise app.UsageError(f"unknown mode {mode!r}; use fwd and/or fwd_bwd")
    shapes = [parse_shape(s) for s in _SHAPES.value]
    sizes = {name: flag.value or None for name, flag in _BLOCKS.items()}
    rows = bench(
        shapes, _IMPLEMENTATIONS.value, _MODES.value, dtype=_DTYPE.value, warmup=_WARMUP.value, iters=_ITERS.value,
        peak_tflops=_PEAK.value, block_sizes=BlockSizes(**sizes),
    )  # fmt: skip
    print(f"{env['device_kind']} ({env['backend']}), jax {env['jax']}, {env['date']}, {_DTYPE.value}, peak {_PEAK.value} TFLOP/s")
    print(format_table(rows))
    gmm_rows = []
    if _GMM_SHAPES.value:
        chosen = {name: flag.value for name, flag in _GMM_TILING.items() if flag.value}
        tiling = Tiling(**chosen) if chosen else None  # None: the backend's default tiles
        gmm_shapes = [parse_shape(s) for s in _GMM_SHAPES.value]
        gmm_rows = bench_gmm(gmm_shapes, _MODES.value, dtype=_DTYPE.value, warmup=_WARMUP.value, iters=_ITERS.value, tiling=tiling)
        print(format_gmm_table(gmm_rows))
    return {"peak_tflops": _PEAK.value, "block_sizes": sizes, "rows": rows, "gmm_rows": gmm_rows}


if __name__ == "__main__":
    app.run(main)
