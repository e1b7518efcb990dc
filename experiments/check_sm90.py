r"""Compile every Triton kernel configuration the defaults can choose for sm_90a (H100), on a host without a GPU.

    pip install 'spmdlab[gpu-check]'   # triton, with its own ptxas
    python -m experiments.check_sm90 --json_out=/tmp/sm90.json

Each case lowers one op (forward and backward) for ``cuda`` under an abstract H100 mesh
(`kernels_pallas.backends.gpu_target`), takes the Triton IR of every Pallas call from the lowered
module (with the warps and stages the kernel asked for), compiles it with the pip ``triton`` package
to PTX and to a cubin for sm_90a (``ptxas``, the assembler that ships with triton), and reports per
kernel the shared memory Triton allocates, the registers per thread and the spill bytes (stores +
loads) that ``ptxas -v`` prints. A kernel fails on more than 227 KiB of shared memory (the H100's
limit per block), on any spill, or when it does not compile; the script exits 1 if any does.

XLA compiles these kernels with its own Triton at run time; the pip ``triton`` and its pass pipeline
are close to it, not the same, so a pass here is necessary for a clean GPU run, not sufficient.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments import cli, timing
from kernels_pallas import backends
from kernels_pallas.attention import flash_attention
from kernels_pallas.gmm import api as gmm_api

SHARED_LIMIT = 227 * 1024  # bytes of shared memory one H100 block may use
ATTENTION_HEAD_DIMS = {"d64": (64, 64), "d128": (128, 128), "mla192/128": (192, 128), "d256": (256, 256)}
DTYPES = ("bfloat16", "float32")
GMM_SHAPE = (8, 1024, 768, 2048)  # groups, rows, k, n
QUANTIZED = ("adamw8", "adamw4", "lion8")
TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One Pallas Triton call as the lowering emitted it."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int


def triton_kernels(fn: Callable, *args) -> list[TritonKernel]:
    """The Triton kernels of ``jax.jit(fn)(*args)`` lowered for an H100, in program order."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    with backends.gpu_target():
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    configs = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL:
            configs.append(ir.DictAttr(op.attributes["mhlo.backend_config"]))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    kernels = []
    for config in configs:
        context = jax_mlir.make_ir_context()
        tt_dialect.register_dialect(context)
        with context:
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm()
        kernels.append(
            TritonKernel(
                ir.StringAttr(config["name"]).value, ttir, ir.IntegerAttr(config["num_warps"]).value, ir.IntegerAttr(config["num_stages"]).value
            )
        )
    return kernels


def compile_sm90(kernel: TritonKernel, workdir: str) -> dict:
    """``{shared_bytes, registers, spill_bytes}`` of ``kernel`` compiled for sm_90a; raises if it does not compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    source = os.path.join(workdir, f"{kernel.name}.ttir")
    with open(source, "w") as f:
        f.write(kernel.ttir)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    ptx = os.path.join(workdir, f"{kernel.name}.ptx")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    log = subprocess.run(
        [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull], capture_output=True, text=True, check=True
    ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register / spill figures for {kernel.name}:\n{log}")
    return {
        "shared_bytes": int(compiled.metadata.shared),
        "registers": int(registers.group(1)),
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
    }


def _forward_and_backward(fn: Callable) -> Callable:
    """``fn``'s output and its pullback of that output: every forward and backward kernel stays live."""

    def both(*args):
        out, pullback = jax.vjp(fn, *args)
        return out, pullback(out)

    return both


def _attention_case(dims: tuple[int, int], dtype) -> tuple[Callable, tuple]:
    d, dv = dims
    q = jax.ShapeDtypeStruct((1, 2048, 2, d), dtype)
    k = jax.ShapeDtypeStruct((1, 2048, 1, d), dtype)
    v = jax.ShapeDtypeStruct((1, 2048, 1, dv), dtype)

    return _forward_and_backward(lambda q, k, v: flash_attention(q, k, v, causal=True)), (q, k, v)


def _masked_case(dtype, window: bool) -> tuple[Callable, tuple]:
    """Head_dim 128 with documents masked by segment ids (`data.document_mask`) and, with ``window``,
    `speedrun-124m`'s attention: a 1792-token window over 128-token blocks whose count is traced."""
    q = k = v = jax.ShapeDtypeStruct((1, 4096, 2, 128), dtype)
    segment_ids, limit = jax.ShapeDtypeStruct((1, 4096), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    options = {"window": 1792, "window_block": 128} if window else {}

    def step(q, k, v, segment_ids, limit):
        attend = lambda q, k, v: flash_attention(  # noqa: E731
            q, k, v, causal=True, segment_ids=segment_ids, window_limit=limit if window else None, **options
        )
        return _forward_and_backward(attend)(q, k, v)

    return step, (q, k, v, segment_ids, limit)


def _gmm_case(dtype) -> tuple[Callable, tuple]:
    groups, m, k, n = GMM_SHAPE
    lhs, rhs = jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)

    def step(lhs, rhs, sizes):
        return _forward_and_backward(lambda a, b: gmm_api.gmm(a, b, sizes, backend="triton", interpret=False))(lhs, rhs)

    return step, (lhs, rhs, sizes)


def _quantized_case(variant: str) -> tuple[Callable, tuple]:
    """One step of `optim.quantize_state` with the fused kernel (``state_kernel=auto`` on a GPU), 768 x 3072."""
    import optax

    import kernels_pallas.quantized_update as qu
    from optim.quantize_state import Fused, quantize_state

    bits = int(variant[-1])
    if variant.startswith("adamw"):
        base, rule = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1), qu.AdamW(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    else:
        base, rule = optax.lion(1e-4, b1=0.9, b2=0.99, weight_decay=0.5), qu.Lion(b1=0.9, b2=0.99, weight_decay=0.5)
    tx = quantize_state(base, bits, kernel="pallas", fused=Fused(rule, 1e-3), mask=lambda p: jax.tree.map(lambda _: True, p))
    params = {"w": jnp.zeros((768, 3072), jnp.float32)}
    with backends.gpu_target():
        state = jax.eval_shape(tx.init, params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return lambda g, s, p: tx.update(g, s, p), (abstract, state, abstract)


def cases(sections: list[str]) -> dict[str, tuple[Callable, tuple]]:
    """Case name -> ``(fn, abstract args)`` for every default configuration of the named sections."""
    out = {}
    if "attention" in sections:
        for dtype in DTYPES:
            for name, dims in ATTENTION_HEAD_DIMS.items():
                out[f"attention {dtype} {name}"] = _attention_case(dims, jnp.dtype(dtype))
            out[f"attention {dtype} d128 segments"] = _masked_case(jnp.dtype(dtype), window=False)
            out[f"attention {dtype} d128 segments+window"] = _masked_case(jnp.dtype(dtype), window=True)
    if "gmm" in sections:
        for dtype in DTYPES:
            out[f"gmm {dtype} {'x'.join(map(str, GMM_SHAPE))}"] = _gmm_case(jnp.dtype(dtype))
    if "quantized_update" in sections:
        for variant in QUANTIZED:
            out[f"quantized_update {variant}"] = _quantized_case(variant)
    return out


def problems(row: dict) -> list[str]:
    """What keeps a compiled kernel from a clean H100 run (empty: none)."""
    if "error" in row:
        return [f"does not compile: {row['error']}"]
    found = []
    if row["shared_bytes"] > SHARED_LIMIT:
        found.append(f"{row['shared_bytes'] / 1024:.0f} KiB of shared memory > 227 KiB")
    if row["spill_bytes"]:
        found.append(f"spills {row['spill_bytes']} B")
    return found


def check(sections: list[str]) -> list[dict]:
    """One row per Triton kernel of every case: its launch config and compiled resources, or its error."""
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case, (fn, args) in cases(sections).items():
            for kernel in triton_kernels(fn, *args):
                row = {"case": case, "kernel": kernel.name, "num_warps": kernel.num_warps, "num_stages": kernel.num_stages}
                try:
                    row.update(compile_sm90(kernel, workdir))
                except Exception as e:  # noqa: BLE001 -- a kernel that does not compile is a row of the report
                    row["error"] = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
                row["problems"] = problems(row)
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def figure(key, scale=1):
        return lambda r: timing.optional(r[key] / scale if key in r else None, ".0f")

    return timing.markdown_table(
        rows,
        ["case", "kernel", "num_warps", "num_stages"],
        {
            "shared KiB": figure("shared_bytes", 1024),
            "registers": figure("registers"),
            "spill B": figure("spill_bytes"),
            "problems": lambda r: "; ".join(r["problems"]) or "ok",
        },
    )


def main(argv: list[str]) -> None:
    del argv  # cli.parse_flags refuses positional arguments
    f = flags.FLAGS
    unknown = sorted(set(f.sections) - {"attention", "gmm", "quantized_update"})
    if unknown:
        cli.usage_exit(f"unknown section(s) {unknown}; use attention, gmm, quantized_update")
    try:
        import triton  # noqa: F401
    except ImportError:
        cli.usage_exit("the sm_90a check needs the pip triton package: pip install 'spmdlab[gpu-check]'")
    rows = check(f.sections)
    print(f"sm_90a (H100), jax {jax.__version__}: Triton kernels of the default configurations")
    print(format_table(rows))
    if f.json_out:
        with open(f.json_out, "w") as file:
            json.dump({"jax": jax.__version__, "shared_limit_bytes": SHARED_LIMIT, "rows": rows}, file, indent=1)
    failed = [r for r in rows if r["problems"]]
    if failed:
        print(f"{len(failed)} of {len(rows)} kernels would not run cleanly on an H100", file=sys.stderr)
        sys.exit(1)


def define_flags() -> None:
    flags.DEFINE_list("sections", ["attention", "gmm", "quantized_update"], "From attention, gmm, quantized_update.")
    cli.define_output_file_flag("json_out", "Write the rows as JSON here.")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
