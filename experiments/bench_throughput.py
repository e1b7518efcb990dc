r"""Training-step throughput (tokens/s) and model FLOPs utilisation for presets x batch shapes x dtypes x meshes.

    python -m experiments.bench_throughput --presets=tiny,small --batch_shapes=8x128,32x128 \
        --dtypes=float32,bfloat16 --mesh=data:-1 --mesh=fsdp:-1 --json_out=/tmp/throughput.json
    # compare meshes on one host by splitting its CPU into 8 devices:
    python -m experiments.bench_throughput --cpu_devices=8 --mesh=data:8 --mesh=fsdp:8 --mesh=data:2,fsdp:4
    # any other training key applies to every case, e.g. the layer loop and the remat policy:
    python -m experiments.bench_throughput --presets=gpt2-124m --batch_shapes=16x1024 --dtypes=bfloat16 \
        --config.model.scan_layers=false --config.model.remat=dots_and_attention
    # FP8 matrix products (lm/fp8.py) against the same step in bf16, as experiments/gpu_check.sh runs them:
    python -m experiments.bench_throughput --presets=gpt2-124m,llama-1b --batch_shapes=8x1024 --dtypes=bfloat16 \
        --config.model.fp8=hybrid

Each case is the real training step of `experiments.train` (forward, backward, optimizer update,
non-finite check), jitted with the run's shardings, on random tokens (no input pipeline; ``--tokens=zipf``
repeats ids as text does, which is what the embedding's gradient scatter feels). The first
``--warmup`` steps (compilation included) are not timed; then ``--repeats`` times, ``--steps``
consecutive steps are timed to the last result. Reported: the median tokens/s over the repeats with
the slowest and fastest, and two MFUs, median tokens/s x `lm.loss.flops_per_token` over

- the datasheet dense peak of the device for the case's compute dtype
  (`experiments.hardware.peak_flops_per_device`) x devices in the mesh; a device the table does not
  list (a CPU) falls back to the measured rate below, and the output says so;
- the measured matmul FLOP/s of one device (`experiments.hardware.matmul_flops_per_device`, fp32 on
  CPU and bf16 elsewhere, for every dtype) x devices in the mesh.

Fake CPU devices (``--cpu_devices``) share the host's cores, so their MFU is understated by up to the
device count; compare meshes there by tokens/s.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
from typing import Any

import jax
import ml_collections
from absl import app, flags

from experiments import cli, hardware, host_memory, run_spec, train_steps
from lm import config as model_config_lib
from lm import model as model_lib
from lm.loss import flops_per_token


def benchmark(
    config: ml_collections.ConfigDict, *, warmup: int, repeats: int, steps: int, seed: int = 0, tokens: str = "uniform"
) -> dict[str, Any]:
    """Times the training step of ``config`` on ``tokens``-distributed random tokens; see the module docstring."""
    spec, run = train_steps.compile_train_steps(config, seed, tokens)
    tokens_per_step = config.batch_size * config.data.seq_len
    warmup_seconds = run(warmup)
    rates = [steps * tokens_per_step / run(steps) for _ in range(repeats)]
    median = statistics.median(rates)
    peak = hardware.peak_flops_per_device(spec.cfg.dtype, spec.mesh.devices.flat[0])
    measured = hardware.matmul_flops_per_device() * spec.mesh.size
    fpt = flops_per_token(spec.cfg, config.data.seq_len)
    return {
        "preset": config.model.preset,
        "model_options": model_options(spec.cfg, config.model.preset),
        "batch_size": config.batch_size,
        "seq_len": config.data.seq_len,
        "dtype": config.model.dtype,
        "mesh": dict(spec.mesh.shape),
        "rules": config.rules,
        "optimizer": config.optimizer.name,
        "tokens": tokens,
        "devices": spec.mesh.size,
        "num_params": model_lib.count_params(spec.model_def).total,
        "tokens_per_second": median,
        "tokens_per_second_min": min(rates),
        "tokens_per_second_max": max(rates),
        "tokens_per_second_repeats": rates,
        "step_seconds": tokens_per_step / median,
        "mfu": median * fpt / (peak.flops_per_second * spec.mesh.size),
        "peak_flops": peak.flops_per_second * spec.mesh.size,
        "peak_source": peak.source,
        "mfu_measured_matmul": median * fpt / measured,
        "matmul_flops": measured,
        "flops_per_token": fpt,
        "warmup_seconds": warmup_seconds,
    }


def model_options(cfg: model_config_lib.ModelConfig, preset: str) -> str:
    """The model fields that differ from the preset's defaults (dtype aside: it has its own column)."""
    preset_cfg = model_config_lib.from_preset(preset)
    changed = [
        f"{f.name}={getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
        if f.name != "dtype" and getattr(cfg, f.name) != getattr(preset_cfg, f.name)
    ]
    return ", ".join(changed) or "preset"


def format_table(cases: list[dict[str, Any]]) -> str:
    """A markdown table, one row per case; MFU against the datasheet peak and the measured matmul rate."""
    lines = [
        "| preset | model | batch x seq | dtype | mesh | tokens/s median (min-max) | step ms | MFU (peak) | MFU (measured matmul) | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        mesh = ",".join(f"{k}:{v}" for k, v in c["mesh"].items())
        lines.append(
            f"| {c['preset']} | {c['model_options']} | {c['batch_size']}x{c['seq_len']} | {c['dtype']} | {mesh} "
            f"| {c['tokens_per_second']:,.0f} ({c['tokens_per_second_min']:,.0f}-{c['tokens_per_second_max']:,.0f}) "
            f"| {1e3 * c['step_seconds']:.1f} | {c['mfu']:.1%} | {c['mfu_measured_matmul']:.1%} | {c['warmup_seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv  # checked by cli.parse_flags
    f = flags.FLAGS
    host_memory.keep_freed_memory()  # before JAX starts its backend
    cli.split_cpu_devices()
    cli.quiet_logging(f.verbose)
    try:
        cli.check_counts("warmup", "repeats", "steps")
        shapes = [train_steps.parse_batch_shape(s) for s in f.batch_shapes]
        configs = [
            train_steps.case_config(preset, b, t, dtype, mesh, f.optimizer, f.rules, base=config_flag.value)
            for preset in f.presets
            for b, t in shapes
            for dtype in f.dtypes
            for mesh in f.mesh
        ]
        for config in configs:  # every bad case is reported before anything runs
            run_spec.build_run(config)
    except (cli.UsageError, ValueError) as e:  # ValueError: a malformed --mesh
        if f.verbose:
            raise
        cli.usage_exit(str(e))
    cases = []
    for i, config in enumerate(configs, 1):
        print(
            f"[{i}/{len(configs)}] {config.model.preset} {config.batch_size}x{config.data.seq_len} {config.model.dtype} "
            f"mesh {config.mesh or 'data:-1'}",
            file=sys.stderr,
            flush=True,
        )
        cases.append(benchmark(config, warmup=f.warmup, repeats=f.repeats, steps=f.steps, tokens=f.tokens))
    device = jax.devices()[0]
    print(f"{device.platform}: {device.device_kind}, {len(jax.devices())} devices; median of {f.repeats} x {f.steps} steps")
    for source in dict.fromkeys(c["peak_source"] for c in cases):
        print(f"MFU (peak) against the {source}")
    print(format_table(cases))
    if f.json_out:
        result = {"backend": device.platform, "device": device.device_kind, "num_devices": len(jax.devices()), "cases": cases}
        with open(f.json_out, "w") as out:
            json.dump(result, out, indent=1)


def define_flags() -> flags.FlagHolder:
    """The benchmark's flags, and ``--config`` whose ``--config.<key>`` overrides apply to every case."""
    flags.DEFINE_list("presets", ["tiny"], "Model presets (lm/config.py).")
    flags.DEFINE_list("batch_shapes", ["8x128", "32x128"], "BATCHxSEQ_LEN shapes (global batch).")
    flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes.")
    flags.DEFINE_multi_string("mesh", [""], "Mesh spec, repeatable (e.g. --mesh=data:8 --mesh=fsdp:8); empty: all devices on data.")
    flags.DEFINE_string("rules", "fsdp", "Logical-to-mesh rule preset: dp | fsdp | tp | sp.")
    flags.DEFINE_string("optimizer", "adamw", "Registered optimizer used in the step.")
    flags.DEFINE_integer("warmup", 2, "Untimed steps first (compilation included).")
    flags.DEFINE_integer("repeats", 5, "Timed repeats (median, min and max reported).")
    flags.DEFINE_integer("steps", 3, "Steps per timed repeat.")
    flags.DEFINE_enum(
        "tokens", "uniform", list(train_steps.TOKEN_DISTRIBUTIONS),
        "Random tokens' distribution: uniform, or zipf (text-like repeats: the embedding gradient's scatter adds many rows into one).",
    )  # fmt: skip
    cli.define_cpu_devices_flag()
    flags.declare_key_flag("cpu_devices")
    cli.define_output_file_flag("json_out", "Also write every case as JSON here.")
    cli.define_verbose_flag()
    return cli.define_config_flag(cli.DEFAULT_CONFIG)


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
