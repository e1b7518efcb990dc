r"""Kernels: attention (forward and forward+backward of every implementation, checked against XLA) and
the quantized optimizer-state update (`experiments.bench_quantized_update`).

    python -m experiments.bench_kernels --json_out=/tmp/kernels.json             # on a GPU: attention and gmm
    python -m experiments.bench_kernels --shapes=1x64x2x32 --implementations=pallas,xla \
        --gmm_shapes=2x40x16x16 --gmm_block_m=16 --gmm_block_k=16 --gmm_block_n=16   # CPU smoke run
    python -m experiments.bench_kernels --sections=quantized_update   # the update on gpt2-124m's block matrices

``--sections`` picks any of ``attention``, ``gmm`` and ``quantized_update`` (default: the first two).

Implementations (causal self-attention, ``(batch, seq, heads, head_dim)``):

- ``pallas``: ours, `kernels_pallas.attention.flash_attention` (Triton on GPU, Mosaic on TPU;
  interpret mode on CPU, which only shows that it runs).
- ``cudnn`` / ``xla``: `jax.nn.dot_product_attention(..., implementation=...)`.
- ``jax_triton``: the Pallas GPU kernel that ships with JAX, `jax.experimental.pallas.ops.gpu.attention.mha`
  (default block sizes; sequence lengths must be multiples of 128).
- ``tokamax``: ``model.attention=tokamax`` (`kernels_pallas.attention.tokamax_op`; a default row where the
  optional package imports): tokamax's own choice among Mosaic GPU (sm90+), its Triton kernel and XLA. The ``kernel``
  column names the tokamax op the compiled program holds (e.g. ``PallasMosaicGpuFlashAttention``; XLA's is
  ``DotProductAttention``).

Each row is one implementation x shape x mode (``fwd``, or ``fwd_bwd``: the forward pass and the pullback
of a fixed random cotangent to q, k, v). After ``--warmup`` calls (compilation included), ``--iters``
samples are timed, each several calls issued back to back and waited for once (`experiments.timing`);
the median and minimum per call are reported. TFLOP/s count the
causal half of the matmuls (FlashAttention-2, arXiv:2307.08691, Sec. 4): forward ``2 * 2 B H T^2 D / 2``,
backward 2.5x the forward. ``peak`` is ``--peak_tflops`` (default: H100 SXM dense bf16, 989).
``vs_cudnn`` is cuDNN's time over the row's (above 1: faster than cuDNN). ``max_err`` is the largest
absolute difference from the ``xla`` row's output (fwd) or gradients (fwd_bwd), in float32.
An implementation that cannot run here (cuDNN off an NVIDIA GPU) is listed with its reason.

Grouped matmul (section ``gmm``, ``--gmm_shapes``, ``GxMxKxN``): `kernels_pallas.gmm.gmm` (``pallas``,
Triton on GPU, Mosaic on TPU, Triton in interpret mode on CPU) against ``jax.lax.ragged_dot`` (``ragged_dot``) for ``lhs (M, K)``,
``rhs (G, K, N)`` and group sizes drawn as a multinomial of ``M`` tokens over ``G`` equally likely experts
(seeded). FLOPs: ``2 M K N`` forward, three times that forward+backward (dlhs and drhs). ``vs_ragged_dot``
is ragged_dot's time over the row's; ``max_err`` is against the ragged_dot row. The default shape is a
dropless MoE layer's up-projection (E=8, 16k token slots, 768 -> 2048); its GPU figures are not yet measured.
``--gmm_implementations`` picks the rows (default: ``pallas``, ``ragged_dot`` and, where the package imports,
``tokamax``: ``model.moe_matmul=tokamax``, `kernels_pallas.gmm.tokamax_op`), a tokamax row's ``kernel`` the tokamax op chosen (``PallasMosaicGpuRaggedDot``, ``PallasTritonRaggedDot``, XLA's ``RaggedDot``).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import bench_quantized_update, cli, timing
from kernels_pallas import extras
from kernels_pallas import gmm as gmm_lib
from kernels_pallas.attention import BlockSizes, flash_attention
from kernels_pallas.attention import api as attention_api
from kernels_pallas.gmm import Tiling
from kernels_pallas.gmm import api as gmm_api
from kernels_pallas.gmm import tokamax_op as gmm_tokamax

DEFAULT_SHAPES = ["16x1024x12x64", "4x4096x16x128", "1x16384x8x128"]
IMPLEMENTATIONS = ("pallas", "cudnn", "xla", "jax_triton", "tokamax")

SECTIONS = ("attention", "gmm", "quantized_update")
BLOCK_FLAGS = ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv", "num_warps", "num_stages")
GMM_TILING_FLAGS = ("block_m", "block_k", "block_n")


def parse_dims(text: str) -> tuple[int, ...]:
    parts = text.strip().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise cli.UsageError(f"shape {text!r} is not positive sizes joined by x, e.g. 12x768x3072")
    return tuple(int(p) for p in parts)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.strip().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise cli.UsageError(f"shape {text!r} is not BATCHxSEQxHEADSxHEAD_DIM, e.g. 16x1024x12x64")
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
    if name == "tokamax":
        if (reason := extras.tokamax_missing()) is not None:
            raise NotImplementedError(reason)
        return lambda q, k, v: attention_api.attention(q, k, v, implementation="tokamax")[0]
    raise cli.UsageError(f"unknown implementation {name!r}; use {', '.join(IMPLEMENTATIONS)}")


def tokamax_kernels(step, *args) -> str:
    """The tokamax ops in ``step``'s program (tokamax names a scope after each op it runs), e.g. ``RaggedDot``."""
    text = step.lower(*args).as_text(debug_info=True)
    return ", ".join(sorted(set(re.findall(r"tokamax\._src\.ops\.\w+\.\w+\.(\w+)", text))))


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
                out = timing.timed_row(row, lambda step=step, args=args: step(*args), warmup, iters)
                if out is None:
                    continue
                results[name, mode] = out
                if name == "tokamax":
                    row["kernel"] = tokamax_kernels(step, *args)
                tflops = attention_flops(shape, mode) / (row["ms"] * 1e-3) / 1e12
                row.update(tflops=tflops, peak_fraction=tflops / peak_tflops)
        for row in shape_rows:
            if "ms" in row:
                cudnn = next((r for r in shape_rows if r["mode"] == row["mode"] and r["implementation"] == "cudnn" and "ms" in r), None)
                row["vs_cudnn"] = cudnn["ms"] / row["ms"] if cudnn else None
                row["max_err"] = timing.max_abs_diff(results[row["implementation"], row["mode"]], results.get(("xla", row["mode"])))
        rows += shape_rows
    return rows


_TIMES_AND_RATE = {**timing.TIME_COLUMNS, "TFLOP/s": lambda r: f"{r['tflops']:.1f}"}


def _kernel_column(rows: list[dict]) -> dict:
    """A ``kernel`` column (the tokamax op that ran) where a row has one."""
    return {"kernel": lambda r: r.get("kernel", "")} if any("kernel" in r for r in rows) else {}


def format_table(rows: list[dict]) -> str:
    return timing.markdown_table(
        rows,
        ["shape", "implementation", "mode"],
        {
            **_kernel_column(rows),
            **_TIMES_AND_RATE,
            "% of peak": lambda r: f"{100 * r['peak_fraction']:.1f}",
            "vs cuDNN": lambda r: timing.optional(r["vs_cudnn"], ".2f"),
            "max err vs xla": lambda r: timing.optional(r["max_err"], ".2e"),
        },
        header=["shape BxTxHxD", "implementation", "mode"],
    )


GMM_IMPLEMENTATIONS = ("pallas", "ragged_dot", "tokamax")


def installed(names: tuple[str, ...]) -> list[str]:
    """``names`` less ``tokamax`` where it does not import: the default rows of each table."""
    return [name for name in names if name != "tokamax" or extras.tokamax_missing() is None]


def bench_gmm(
    shapes: list[tuple[int, int, int, int]],
    modes: list[str],
    *,
    dtype: str = "bfloat16",
    warmup: int = 3,
    iters: int = 20,
    tiling: Tiling | None = None,
    interpret: bool | None = None,
    implementations: list[str] | None = None,
) -> list[dict]:
    """One dict per gmm implementation x shape x mode: ms, ms_min, tflops, vs_ragged_dot, max_err.

    ``implementations``: from `GMM_IMPLEMENTATIONS`; default: those installed."""
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    backend = gmm_api.PLATFORM_BACKENDS.get(jax.default_backend(), "triton")
    impls = {
        "pallas": lambda a, b, g: gmm_lib.gmm(a, b, g, backend=backend, interpret=interpret, tiling=tiling),
        "ragged_dot": jax.lax.ragged_dot,
        "tokamax": gmm_tokamax.ragged_dot,
    }
    unknown = sorted(set(implementations or ()) - set(impls))
    if unknown:
        raise cli.UsageError(f"unknown gmm implementation(s) {unknown}; use {', '.join(GMM_IMPLEMENTATIONS)}")
    impls = {name: impls[name] for name in implementations or installed(GMM_IMPLEMENTATIONS)}
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
                if name == "tokamax" and (reason := extras.tokamax_missing()) is not None:
                    row["unavailable"] = reason
                    continue
                if mode == "fwd":
                    step = jax.jit(lambda a, b, fn=fn: fn(a, b, sizes))
                else:
                    step = jax.jit(lambda a, b, fn=fn: jax.vjp(lambda a, b: fn(a, b, sizes), a, b)[1](d_out))
                out = timing.timed_row(row, lambda step=step: step(lhs, rhs), warmup, iters)
                if out is None:
                    continue
                results[name] = out
                if name == "tokamax":
                    row["kernel"] = tokamax_kernels(step, lhs, rhs)
                row["tflops"] = 2.0 * m * k * n * (1 if mode == "fwd" else 3) / (row["ms"] * 1e-3) / 1e12
            baseline = next((r for r in shape_rows if r["implementation"] == "ragged_dot" and "ms" in r), None)
            for row in shape_rows:
                if "ms" in row:
                    row["vs_ragged_dot"] = baseline["ms"] / row["ms"] if baseline else None
                    row["max_err"] = timing.max_abs_diff(results[row["implementation"]], results.get("ragged_dot"))
            rows += shape_rows
    return rows


def format_gmm_table(rows: list[dict]) -> str:
    return timing.markdown_table(
        rows,
        ["shape", "implementation", "mode"],
        {
            **_kernel_column(rows),
            **_TIMES_AND_RATE,
            "vs ragged_dot": lambda r: timing.optional(r["vs_ragged_dot"], ".2f"),
            "max err vs ragged_dot": lambda r: timing.optional(r["max_err"], ".2e"),
        },
        header=["shape GxMxKxN", "implementation", "mode"],
    )


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
    }


def main(argv: list[str]) -> None:
    del argv  # cli.parse_flags refuses positional arguments
    try:
        run(flags.FLAGS)
    except cli.UsageError as e:
        cli.usage_exit(str(e))


def run(f: flags.FlagValues) -> None:
    """The sections ``f`` asks for: tables printed, rows written to ``--json_out``."""
    cli.require_counts("iters")
    unknown = sorted(set(f.sections) - set(SECTIONS))
    if unknown:
        raise cli.UsageError(f"unknown section(s) {unknown}; use {', '.join(SECTIONS)}")
    for mode in f.modes:
        if mode not in ("fwd", "fwd_bwd"):
            raise cli.UsageError(f"unknown mode {mode!r}; use fwd and/or fwd_bwd")
    env = environment()
    out = {**env}
    heading = f"{env['device_kind']} ({env['backend']}), jax {env['jax']}, {env['date']}"
    if "quantized_update" in f.sections:
        q_rows = bench_quantized_update.bench([parse_dims(s) for s in f.quantized_shapes], f.quantized_variants, warmup=f.warmup, iters=f.iters)
        print(f"{heading}: quantized AdamW update")
        print(bench_quantized_update.format_table(q_rows))
        out["quantized_update_rows"] = q_rows
    if "attention" in f.sections:
        sizes = {name: f[name].value or None for name in BLOCK_FLAGS}
        rows = bench(
            [parse_shape(s) for s in f.shapes], f.implementations, f.modes, dtype=f.dtype, warmup=f.warmup, iters=f.iters,
            peak_tflops=f.peak_tflops, block_sizes=BlockSizes(**sizes),
        )  # fmt: skip
        print(f"{heading}, {f.dtype}, peak {f.peak_tflops} TFLOP/s: attention")
        print(format_table(rows))
        out.update(peak_tflops=f.peak_tflops, block_sizes=sizes, rows=rows)
    if "gmm" in f.sections:
        chosen = {name: f[f"gmm_{name}"].value for name in GMM_TILING_FLAGS if f[f"gmm_{name}"].value}
        tiling = Tiling(**chosen) if chosen else None  # None: the backend's default tiles
        shapes = [parse_shape(s) for s in f.gmm_shapes]
        gmm_rows = bench_gmm(shapes, f.modes, dtype=f.dtype, warmup=f.warmup, iters=f.iters, tiling=tiling, implementations=f.gmm_implementations)
        print(f"{heading}, {f.dtype}: grouped matmul")
        print(format_gmm_table(gmm_rows))
        out["gmm_rows"] = gmm_rows
    if f.json_out:
        with open(f.json_out, "w") as file:
            json.dump(out, file, indent=1)


def define_flags() -> None:
    flags.DEFINE_list("sections", ["attention", "gmm"], f"From {', '.join(SECTIONS)}.")
    flags.DEFINE_list("shapes", DEFAULT_SHAPES, "BATCHxSEQxHEADSxHEAD_DIM, causal self-attention.")
    flags.DEFINE_list("implementations", installed(IMPLEMENTATIONS), f"From {', '.join(IMPLEMENTATIONS)} (default: those installed).")
    flags.DEFINE_list("modes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd.")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Input dtype (attention and gmm).")
    flags.DEFINE_integer("warmup", 3, "Untimed calls first (compilation included).")
    flags.DEFINE_integer("iters", 20, "Timed calls per row.")
    flags.DEFINE_float("peak_tflops", 989.0, "Dense peak TFLOP/s of the device in --dtype (H100 SXM bf16: 989).")
    cli.define_output_file_flag("json_out", "Write the rows as JSON here.")
    flags.DEFINE_list("quantized_shapes", bench_quantized_update.GPT2_124M_MATRICES, "Parameter shapes (AxBxC) of the quantized-update section.")
    flags.DEFINE_list("quantized_variants", list(bench_quantized_update.VARIANTS), "Rows of the quantized-update section.")
    flags.DEFINE_list("gmm_shapes", ["8x16384x768x2048"], "GROUPSxMxKxN grouped matmuls.")
    flags.DEFINE_list("gmm_implementations", installed(GMM_IMPLEMENTATIONS), f"From {', '.join(GMM_IMPLEMENTATIONS)} (default: those installed).")
    for name in GMM_TILING_FLAGS:
        flags.DEFINE_integer(f"gmm_{name}", 0, f"Tiling.{name} of the gmm kernel (0: default).")
    for name in BLOCK_FLAGS:
        flags.DEFINE_integer(name, 0, f"BlockSizes.{name} of the pallas rows (0: the backend's default).")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
