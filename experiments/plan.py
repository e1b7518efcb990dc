r"""Memory planner: will this model, optimizer, batch and mesh fit in each device's memory?

    python -m experiments.plan --config.model.preset=llama-1b --config.mesh=fsdp:8 --hbm_gb=16

Nothing is allocated. Parameter, gradient and optimizer-state bytes per device are exact, from the
abstract state and its shardings. Activations and temporaries come from compiling the real train
step for the mesh and reading XLA's memory analysis; ``--state_only`` skips that compilation (minutes
for a 50B-parameter model on hundreds of fake devices) and checks the state alone, a lower bound. Without ``--native``, the step is compiled for
as many fake CPU devices as the mesh needs, so a laptop can plan a pod slice; XLA:CPU's buffer
assignment then stands in for the accelerator's, which fuses and lays out differently (treat the
activation figure as an estimate). Exit code 0 when it fits, 1 when it does not, 2 for bad input.

For a cluster, ``--hosts=16 --devices_per_host=8`` plans the mesh over 128 devices and adds each
host's share (its devices' memory) and the collective bytes of one step, counted from the compiled
HLO (`experiments.hlo_bytes`): the payload each device moves and the bytes it sends under ring
algorithms; a host sends at most its devices' sum (collectives within a host stay on NVLink / ICI).

    python -m experiments.plan --config.model.preset=llama-1b --config.mesh=data:16,fsdp:8 --hosts=16 \
        --devices_per_host=8 --hbm_gb=80 --config.model.dtype=bfloat16 --config.model.remat=full

With a ``context`` mesh axis (long sequences, `lm.parallel.context_attention`) the report adds the context
shards, the mode, each device's share of a sequence and the K/V one layer holds in flight.
"""

from __future__ import annotations

import functools
import json
import math
import sys

import jax
import ml_collections
from absl import app, flags

from experiments import cli, hlo_bytes, run_spec, train_lib
from lm import loss as loss_lib
from lm import model as model_lib
from lm.parallel import context_attention
from sharding import axes, partition
from sharding import mesh as mesh_lib

GiB = 2**30


def _state_bytes(abstract_tree) -> int:
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_tree)
    )


def _context(config: ml_collections.ConfigDict, spec: run_spec.RunSpec) -> dict | None:
    """The context-parallel part of the report, or None without a ``context`` axis splitting ``seq``."""
    shards = spec.mesh.shape.get(axes.CONTEXT, 1)
    if shards == 1 or axes.CONTEXT not in dict(spec.rules.activations).get("seq", ()):
        return None
    batch_axes = dict(spec.rules.activations).get("batch", ())
    rows = config.batch_size // config.grad_accum_steps // math.prod(spec.mesh.shape.get(a, 1) for a in batch_axes)
    mode, seq_len = spec.cfg.context_parallel, config.data.seq_len
    return {
        "mode": mode,
        "shards": shards,
        "tokens_per_device": rows * seq_len // shards,
        "kv_in_flight_bytes_per_layer": int(context_attention.in_flight_bytes(mode, spec.cfg, rows, seq_len, shards)),
    }


def plan(config: ml_collections.ConfigDict, hbm_bytes: float, *, compile_step: bool = True, devices_per_host: int | None = None) -> dict:
    """Per-device memory of one training step of ``config``; see the module docstring.

    With ``compile_step=False`` only the state is counted: ``peak_bytes`` is then parameters +
    gradients + optimizer state, a lower bound, and the compiled, activation and collective fields are
    absent. With ``devices_per_host``, ``per_host`` holds a host's share (its devices' sum).
    """
    spec = run_spec.build_run(config)
    shardings = spec.shardings
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        state = train_lib.abstract_state(spec.model_def, spec.tx, shardings)
        if compile_step:
            batch = jax.ShapeDtypeStruct((config.batch_size, config.data.seq_len + 1), jax.numpy.int32, sharding=shardings.batch)
            step_fn = train_lib.make_train_step(spec.model_def, spec.tx, grad_accum_steps=config.grad_accum_steps)
            with loss_lib.assume_device_memory(hbm_bytes):  # loss chunks as the planned device would size them
                compiled = train_lib.jit_train_step(step_fn, shardings).lower(state, batch).compile()
    params = _state_bytes(state["params"])
    counts = model_lib.count_params(spec.model_def)
    report = {
        "model": config.model.preset,
        "mesh": dict(spec.mesh.shape),
        "devices": spec.mesh.size,
        "num_params": counts.total,
        "num_active_params": counts.active,
        "params_bytes": params,
        "gradients_bytes": params,  # fp32, sharded like the parameters
        "optimizer_state_bytes": _state_bytes(state["opt_state"]),
        "hbm_bytes": int(hbm_bytes),
        "state_only": not compile_step,
        "context": _context(config, spec),
    }
    if spec.mesh.shape.get(axes.STAGE, 1) > 1:  # block parameters and their state split over stages
        report["pipeline"] = {k: getattr(spec.cfg, f"pipeline_{k}") for k in ("schedule", "microbatches", "repeats")}
    if not compile_step:
        report["peak_bytes"] = report["params_bytes"] + report["gradients_bytes"] + report["optimizer_state_bytes"]
        report["fits"] = report["peak_bytes"] <= hbm_bytes
        return _per_host(report, devices_per_host)
    memory = compiled.memory_analysis()
    report |= {
        "compiled_arguments_bytes": int(memory.argument_size_in_bytes),
        "compiled_temporaries_bytes": int(memory.temp_size_in_bytes),
        "compiled_outputs_bytes": int(memory.output_size_in_bytes),
        "compiled_aliased_bytes": int(memory.alias_size_in_bytes),
    }
    # Donated state aliases the outputs: peak = inputs + temporaries + outputs not written in place.
    report["activations_estimate_bytes"] = max(report["compiled_temporaries_bytes"] - report["gradients_bytes"], 0)
    report["peak_bytes"] = (
        report["compiled_arguments_bytes"]
        + report["compiled_temporaries_bytes"]
        + report["compiled_outputs_bytes"]
        - report["compiled_aliased_bytes"]
    )
    report["fits"] = report["peak_bytes"] <= hbm_bytes
    found = hlo_bytes.collectives(compiled.as_text(), spec.mesh.size)
    summary = hlo_bytes.summarize(found, 1, config.batch_size * config.data.seq_len)
    report["collectives"] = {"payload_bytes_per_step": summary["payload"]["per_step"], "ring_bytes_per_step": summary["ring"]["per_step"], "ops": summary["ops"]}
    return _per_host(report, devices_per_host)


def _per_host(report: dict, devices_per_host: int | None) -> dict:
    """``report`` with a host's share of memory and of bytes sent (its ``devices_per_host`` devices' sum)."""
    if devices_per_host is None:
        return report
    if report["devices"] % devices_per_host:
        raise cli.UsageError(f"the mesh's {report['devices']} devices do not fill hosts of --devices_per_host={devices_per_host}")
    report["hosts"], report["devices_per_host"] = report["devices"] // devices_per_host, devices_per_host
    per_host = {"peak_bytes": report["peak_bytes"] * devices_per_host, "hbm_bytes": report["hbm_bytes"] * devices_per_host}
    if "collectives" in report:
        per_host["ring_bytes_per_step"] = report["collectives"]["ring_bytes_per_step"] * devices_per_host
    report["per_host"] = per_host
    return report


def format_report(report: dict) -> str:
    state = [
        ("parameters", report["params_bytes"]),
        ("gradients", report["gradients_bytes"]),
        ("optimizer state", report["optimizer_state_bytes"]),
    ]
    if report["state_only"]:
        rows = [*state, ("state (--state_only: activations not compiled)", report["peak_bytes"])]
    else:
        rows = [
            *state,
            ("activations + temporaries (compiled, less gradients)", report["activations_estimate_bytes"]),
            ("peak of one train step (compiled)", report["peak_bytes"]),
        ]
    context = report.get("context")
    if context:
        rows.append((f"K/V in flight per layer ({context['mode']} over {context['shards']} context shards)", context["kv_in_flight_bytes_per_layer"]))
    rows.append(("device memory (--hbm_gb)", report["hbm_bytes"]))
    width = max(len(name) for name, _ in rows)
    lines = [
        (
            f"{report['model']} ({report['num_params'] / 1e6:,.1f}M parameters, {report['num_active_params'] / 1e6:,.1f}M active) "
            f"on mesh {report['mesh']}: bytes per device"
            + (f" (pipeline {report['pipeline']})" if "pipeline" in report else "")
        ),
        *(f"  {name:<{width}}  {value / GiB:10.3f} GiB" for name, value in rows),
    ]
    if context:
        lines.insert(1, f"  context parallelism: {context['tokens_per_device']:,} tokens per device per micro-batch")
    collectives = report.get("collectives")
    if collectives:
        lines.append(
            f"  collectives per step per device: {collectives['payload_bytes_per_step'] / GiB:.3f} GiB moved, "
            f"{collectives['ring_bytes_per_step'] / GiB:.3f} GiB sent (ring algorithms); ops {collectives['ops']}"
        )
    if "per_host" in report:
        host = report["per_host"]
        sent = f", at most {host['ring_bytes_per_step'] / GiB:.3f} GiB sent per step" if "ring_bytes_per_step" in host else ""
        lines.append(
            f"  per host ({report['hosts']} hosts x {report['devices_per_host']} devices): {host['peak_bytes'] / GiB:.3f} GiB "
            f"of {host['hbm_bytes'] / GiB:.3f} GiB device memory{sent}"
        )
    if report["fits"]:
        lines.append(f"FITS: the step needs {report['peak_bytes'] / report['hbm_bytes']:.0%} of device memory.")
    else:
        lines.append(
            f"DOES NOT FIT: the step needs {report['peak_bytes'] / GiB:.2f} GiB per device, {report['hbm_bytes'] / GiB:.2f} GiB "
            "available. Shard more (a larger fsdp axis; a context axis for long sequences), set --config.model.remat=full (or a lighter policy, lm/remat.py), use gradient accumulation "
            "(--config.grad_accum_steps) or a smaller batch."
        )
    return "\n".join(lines)


def _fake_devices_for(spec: str) -> int | None:
    """Devices the mesh spec needs, when it fixes the number (no -1)."""
    sizes = [n for _, n in mesh_lib.parse_mesh_spec(spec)]
    return None if -1 in sizes else math.prod(sizes)


def check_machine_flags(hbm_gb: float, num_devices: int, hosts: int | None, per_host: int | None) -> None:
    """Raises `cli.UsageError` for a machine no plan can describe, naming the flag."""
    if (hosts is None) != (per_host is None):
        raise cli.UsageError("--hosts and --devices_per_host go together (e.g. --hosts=16 --devices_per_host=8)")
    if not hbm_gb > 0:
        raise cli.UsageError(f"--hbm_gb={hbm_gb:g} must be > 0 (memory per device, GiB)")
    for name, value in (("num_devices", num_devices), ("hosts", hosts), ("devices_per_host", per_host)):
        if value is not None and value < 1:
            raise cli.UsageError(f"--{name}={value} must be >= 1")


def main(config_flag, argv) -> None:
    del argv
    cli.quiet_logging(flags.FLAGS.verbose)
    config = config_flag.value
    hosts, per_host = flags.FLAGS.hosts, flags.FLAGS.devices_per_host
    try:
        check_machine_flags(flags.FLAGS.hbm_gb, flags.FLAGS.num_devices, hosts, per_host)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    if not flags.FLAGS.native:
        try:
            needed = _fake_devices_for(config.mesh)
        except ValueError as e:
            cli.usage_exit(str(e))
        cluster = hosts * per_host if hosts else None
        if needed and cluster and needed != cluster:
            cli.usage_exit(f"--config.mesh={config.mesh} has {needed} devices, the cluster {hosts} x {per_host} = {cluster}")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", needed or cluster or flags.FLAGS.num_devices)
    try:
        report = plan(config, flags.FLAGS.hbm_gb * GiB, compile_step=not flags.FLAGS.state_only, devices_per_host=per_host)
    except cli.UsageError as e:
        cli.usage_exit(str(e))
    print(format_report(report))
    if flags.FLAGS.json_out:
        with open(flags.FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(0 if report["fits"] else 1)


def define_flags() -> flags.FlagHolder:
    """The command-line flags (defined under ``__main__`` only: scripts share absl's flag registry)."""
    cli.define_verbose_flag()
    flags.DEFINE_float("hbm_gb", 16.0, "Memory per device, GiB.")
    flags.DEFINE_bool("state_only", False, "Count parameters, gradients and optimizer state only; do not compile the step.")
    flags.DEFINE_bool("native", False, "Compile for this machine's devices instead of fake CPU devices.")
    flags.DEFINE_integer("num_devices", 8, "Fake devices when the mesh spec has a -1 (and no --hosts).")
    flags.DEFINE_integer("hosts", None, "Plan for a cluster of this many hosts (with --devices_per_host).")
    flags.DEFINE_integer("devices_per_host", None, "Devices (GPUs, TPU chips) per host of the cluster.")
    cli.define_output_file_flag("json_out", "Also write the report as JSON here.")
    return cli.define_config_flag(cli.DEFAULT_CONFIG)


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=cli.parse_flags)
