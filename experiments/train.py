r"""Trains a language model.

    python -m experiments.train --workdir=runs/tiny --config=experiments/configs/default.py \
        --config.steps=300 --config.model.preset=tiny --config.optimizer.name=adamw \
        --config.optimizer.learning_rate=3e-3 --config.seed=0

With no flags it runs the default job (`tiny` + AdamW on the standard-library corpus) into a fresh
workdir under ``./runs/``. A workdir that holds checkpoints is resumed from the latest one (from an
earlier one with ``--restore_step=N``, e.g. when the latest is damaged).
Writes ``config.json``, ``metrics.jsonl``, TensorBoard events, ``loss.png``, checkpoints and
``summary.json`` into the workdir.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from experiments import checkpointing, hardware, host_memory, metrics_io, train_lib
from lm import config as model_config_lib
from lm import data, input_pipeline, moe
from lm import model as model_lib
from lm.loss import flops_per_token
from optim import registry
from sharding import mesh as mesh_lib
from sharding import multihost
from sharding import partition
from sharding import rules as rules_lib

DEFAULT_CONFIG = str(Path(__file__).parent / "configs" / "default.py")


class UsageError(ValueError):
    """Bad input from the user: reported as one line, exit code 2."""


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps."""


@dataclasses.dataclass
class _Stop:
    """Set by SIGINT/SIGTERM (or a simulated preemption) to end the run after the current step."""

    signum: int | None = None

    def request(self, signum: int, frame: Any = None) -> None:
        del frame
        self.signum = signum


def model_config(config: ml_collections.ConfigDict) -> model_config_lib.ModelConfig:
    """The `ModelConfig` for ``config.model``: the preset plus every key that is set (the vocabulary, when
    unset, from the manifest of ``data.train_files`` if they have one; the document separator with
    ``data.document_mask``)."""
    overrides = {k: v for k, v in config.model.items() if k != "preset" and v is not None}
    if "vocab_size" not in overrides and (vocab_size := input_pipeline.manifest_vocab_size(config.data)) is not None:
        overrides["vocab_size"] = vocab_size
    overrides["document_separator"] = input_pipeline.document_separator(config.data)
    return model_config_lib.from_preset(config.model.preset, **overrides)


def balancing(config: ml_collections.ConfigDict) -> moe.Balancing:
    """The MoE balancing of ``config.moe`` (defaults where a config has no ``moe`` block)."""
    block = config.get("moe") or {}
    names = {"balance_loss": "balance_loss", "router_z_loss": "router_z_loss", "balance_scope": "scope", "bias_rate": "bias_rate"}
    return moe.Balancing(**{field: block[key] for key, field in names.items() if key in block})


# Common optimizer keys that change the optimizer state's structure.
STATE_SHAPING_KEYS = ("state_bits", "cautious")

# Per-step metrics of an MoE model (lm/moe.py) written with the loss.
MOE_METRICS = ("moe_balance_loss", "router_z_loss", "expert_load_max", "dropped_fraction")

# Model fields a resumed run may change: they alter how the step computes, not what the state is.
_RESUMABLE_MODEL_CHANGES = ("attention", "dtype", "remat", "scan_unroll", "track_attn_logits")


def run_meta(config: ml_collections.ConfigDict, cfg: model_config_lib.ModelConfig, replicas: int = 1) -> dict:
    """What a checkpoint must agree with to be resumed by this run.

    A wrapper's inner optimizer shapes the state too, so its block is included. A replica-local
    run's state holds one slice per replica, so it resumes only with the same replica axis and count
    (a different count is refused with the difference named).
    """
    name = config.optimizer.name
    family = config.optimizer.get(name)
    family = family.to_dict() if family is not None else {}
    inner = registry.inner_name(config.optimizer)
    if inner is not None and config.optimizer.get(inner) is not None:
        family[inner] = config.optimizer[inner].to_dict()
    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _RESUMABLE_MODEL_CHANGES}
    meta = {"replicas": {"axis": config.replicas, "count": replicas}} if config.get("replicas") else {}
    return meta | {
        "model": model,
        "optimizer": {
            "name": name,
            **family,
            **{k: config.optimizer[k] for k in STATE_SHAPING_KEYS if k in config.optimizer},
        },
    }


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The model, optimizer and placement a config describes (no data, no allocation)."""

    cfg: model_config_lib.ModelConfig
    model_def: model_lib.ModelDef
    tx: Any
    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    shardings: train_lib.Shardings


def _check_replica_kernels(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """Pallas kernels run interpreted on a CPU, which the replica-local step cannot host (`kernels_pallas.varying`)."""
    if mesh.devices.flat[0].platform != "cpu":
        return
    chosen = {
        "model.attention": (config.model.attention, "pallas", "xla"),
        "model.moe_matmul": (config.model.moe_matmul, "gmm", "ragged_dot"),
        "optimizer.state_kernel": (config.optimizer.state_kernel, "pallas", "xla"),
    }
    for key, (value, kernel, fix) in chosen.items():
        if value == kernel:
            raise ValueError(
                f"{key}={kernel} runs in Pallas interpret mode on a CPU, which cannot run inside the replica-local "
                f"train step (config.replicas); use {key}={fix} or auto here (compiled GPU/TPU kernels are unaffected)"
            )


def build_run(config: ml_collections.ConfigDict) -> RunSpec:
    """Checks ``config`` and builds its `RunSpec`; every bad-input error becomes a `UsageError`."""
    try:
        if config.steps < 1:
            raise ValueError(f"config.steps={config.steps} must be >= 1")
        if config.grad_accum_steps < 1 or config.batch_size % config.grad_accum_steps:
            raise ValueError(f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps}")
        cfg = model_config(config)
        if config.optimizer.name in registry.NEEDS_ATTN_LOGITS:
            cfg = dataclasses.replace(cfg, track_attn_logits=True)
        if config.data.seq_len > cfg.max_seq_len:
            raise ValueError(f"data.seq_len={config.data.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        if config.devices and jax.process_count() > 1:
            raise ValueError("config.devices selects local devices and works only in single-process runs; leave it 0")
        if config.devices > len(jax.devices()):
            raise ValueError(f"config.devices={config.devices} but only {len(jax.devices())} devices are present")
        mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[: config.devices] if config.devices else None)
        rules = rules_lib.make_rules(config.rules, rules_lib.parse_overrides(config.get("rule_overrides", "")))
        n_batch_shards = int(np.prod([mesh.shape[a] for a in dict(rules.activations).get("batch", ()) if a in mesh.shape]))
        if (config.batch_size // config.grad_accum_steps) % n_batch_shards:
            raise ValueError(
                f"the micro-batch of {config.batch_size // config.grad_accum_steps} sequences cannot be split over "
                f"{n_batch_shards} batch shards of mesh {dict(mesh.shape)}; use a batch_size divisible by {n_batch_shards * config.grad_accum_steps}"
            )
        replica_axis = config.get("replicas") or None
        if replica_axis:
            _check_replica_kernels(config, mesh)
        balancing(config)  # checked here so a bad value is a usage error
        model_def = model_lib.define(cfg)
        # The fused quantized-state kernel runs per shard of these specs (optim.quantize_state).
        param_shardings = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
        param_specs = jax.tree.map(lambda s: s.spec, param_shardings)
        tx = registry.build(config.optimizer, config.steps, replica_axis=replica_axis, param_specs=param_specs)
        shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
        registry.check_layout(config.optimizer, model_def.abstract_params, shardings.params, replica_axis)
    except (ValueError, KeyError) as e:
        raise UsageError(str(e).strip("'\"")) from e
    return RunSpec(cfg, model_def, tx, mesh, rules, shardings)


def _load_data(config: ml_collections.ConfigDict) -> tuple[data.PackedBatches, input_pipeline.ValidationSet]:
    """This process's training iterator and validation batches (`lm.input_pipeline`)."""
    try:
        return input_pipeline.build(
            config, model_config(config).vocab_size, process_index=jax.process_index(), process_count=jax.process_count()
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e


def _evaluate(eval_step, params, batches, shardings) -> float:
    losses = [eval_step(params, train_lib.global_batch(b, shardings)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def run(
    config: ml_collections.ConfigDict, workdir: str | Path, *, interrupt_at: int | None = None, restore_step: int | None = None
) -> dict:
    """Trains (or resumes) the run described by ``config`` in ``workdir``; returns the summary.

    Args:
      config: see ``experiments/configs/default.py``.
      workdir: output folder; its checkpoints, if any, are resumed.
      interrupt_at: simulate a preemption after this many steps (the SIGTERM path: save, stop).
      restore_step: resume from this saved step instead of the newest (newer ones are deleted).

    Returns:
      The summary dict also written to ``summary.json``; ``{"interrupted": True, ...}`` when stopped.
    """
    workdir = Path(workdir)
    spec = build_run(config)
    train_iter, val_batches = _load_data(config)
    lead = jax.process_index() == 0
    workdir.mkdir(parents=True, exist_ok=True)
    if lead:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))

    shardings = spec.shardings
    lr_fn = registry.learning_rate_fn(config.optimizer, config.steps)
    step_fn = train_lib.make_train_step(
        spec.model_def,
        spec.tx,
        grad_accum_steps=config.grad_accum_steps,
        z_loss=config.loss.z_loss,
        learning_rate=lr_fn,
        balancing=balancing(config),
        replica_axis=shardings.replica_axis,
    )
    meta = run_meta(config, spec.cfg, shardings.replicas)
    mgr = checkpointing.manager(workdir, keep=config.keep_checkpoints, every=config.checkpoint_every)
    stop = _Stop()
    handlers = {}
    if hasattr(signal, "SIGTERM"):
        try:
            handlers = {s: signal.signal(s, stop.request) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: no signal handling
            handlers = {}
    try:
        with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
            target = train_lib.abstract_state(spec.model_def, spec.tx, shardings)
            try:
                restored = checkpointing.restore(mgr, target, meta, restore_step)
            except checkpointing.CheckpointError as e:
                raise UsageError(str(e)) from e
            if restored is None:
                state, start = train_lib.init_state(spec.model_def, spec.tx, config.seed, shardings), 0
            else:
                start, state, data_state = restored
                try:
                    train_iter.set_state(data_state)
                except ValueError as e:
                    raise UsageError(str(e)) from e
            summary = _loop(config, workdir, spec, train_iter, val_batches, step_fn, state, start, mgr, meta, stop, interrupt_at)
    finally:
        mgr.wait_until_finished()
        mgr.close()
        for s, h in handlers.items():
            signal.signal(s, h)
    return summary


def _loop(config, workdir, spec, train_iter, val_batches, step_fn, state, start, mgr, meta, stop, interrupt_at) -> dict:
    shardings, lead = spec.shardings, jax.process_index() == 0
    train_step = train_lib.jit_train_step(step_fn, shardings)
    eval_step = train_lib.jit_eval_step(train_lib.make_eval_step(spec.model_def), shardings)
    writer = metrics_io.MetricsWriter(workdir, resume_step=start, enabled=lead)
    tokens_per_step = config.batch_size * config.data.seq_len
    progress = Progress(config.steps, start, lead)
    step_times: list[float] = []
    last = {}
    val_loss = None
    # Steps dispatched whose metrics have not been read: (step, metrics, dispatch time). Reading a
    # step's metrics waits for it, so they are read one step late: the host loads and dispatches
    # step n + 1 while the device runs step n. A step that evaluates or checkpoints reads them all
    # first, so no checkpoint is saved past a step that ends the run.
    in_flight: collections.deque = collections.deque()
    previous_ready = time.perf_counter()
    try:
        for step in range(start, config.steps):
            done = step + 1
            dispatched = time.perf_counter()
            state, metrics = train_step(state, train_lib.global_batch(next(train_iter), shardings))
            in_flight.append((done, metrics, dispatched))
            if interrupt_at is not None and done == interrupt_at:
                stop.request(signal.SIGTERM)
            stopping = stop.signum is not None and done < config.steps
            evaluating = done % config.eval_every == 0 or done == config.steps
            saving = stopping or done == config.steps or mgr.should_save(done)
            while len(in_flight) > (0 if evaluating or saving else 1):
                record_step, metrics, dispatched = in_flight.popleft()
                metrics = jax.device_get(metrics)
                ready = time.perf_counter()
                step_times.append(ready - max(dispatched, previous_ready))  # this step's time on the device
                previous_ready = ready
                record = {
                    "step": record_step,
                    "loss": float(metrics["loss"]),
                    "lr": float(metrics["lr"]),
                    "grad_norm": float(metrics["grad_norm"]),
                    "tokens_per_second": tokens_per_step / step_times[-1],
                    "skipped_steps": int(metrics["skipped"]),
                    **{k: float(metrics[k]) for k in MOE_METRICS if k in metrics},
                }
                if record_step == done and evaluating:
                    val_loss = _evaluate(eval_step, state["params"], val_batches, shardings)
                    record["val_loss"] = val_loss
                    if (bits_per_byte := val_batches.bits_per_byte(val_loss)) is not None:
                        record["val_bits_per_byte"] = bits_per_byte
                last = record
                if record_step % config.log_every == 0 or "val_loss" in record or record_step == config.steps:
                    writer.write(record)
                    progress.update(record)
                if int(metrics["bad_streak"]) >= config.max_bad_steps:
                    raise NonFiniteError(
                        f"{int(metrics['bad_streak'])} consecutive steps had a non-finite loss or gradient (last at step "
                        f"{record_step}); parameters were left unchanged and no such state was checkpointed. Lower "
                        "optimizer.learning_rate, enable optimizer.grad_clip_norm, or check the data"
                    )
            if saving:
                checkpointing.save(mgr, done, state, train_iter.get_state(), meta, force=True)
            if stopping:
                progress.close()
                print(f"stopped by signal {stop.signum} after step {done}; checkpoint saved, rerun with the same --workdir to resume", file=sys.stderr)
                return {"interrupted": True, "steps": done, "signal": stop.signum}
    finally:
        progress.close()
        writer.close()
    return _summarize(config, workdir, spec, step_times, last, val_loss, start, lead)


def _summarize(config, workdir, spec, step_times, last, val_loss, start, lead) -> dict:
    tokens_per_step = config.batch_size * config.data.seq_len
    timed = step_times[1:] or step_times  # the first step of a process includes compilation
    tokens_per_second = tokens_per_step / float(np.median(timed)) if timed else 0.0
    fpt = flops_per_token(spec.cfg, config.data.seq_len)
    peak = hardware.peak_flops_per_device(spec.cfg.dtype, spec.mesh.devices.flat[0])
    measured_flops = hardware.matmul_flops_per_device() * spec.mesh.size
    peak_bytes, peak_source = hardware.peak_memory_bytes()
    summary = {
        "steps": config.steps,
        "resumed_from_step": start,
        "final_train_loss": last.get("loss"),
        "final_val_loss": val_loss,
        "final_val_bits_per_byte": last.get("val_bits_per_byte"),
        "data_token_share": input_pipeline.token_shares(config),
        "tokens_per_second": tokens_per_second,
        "mfu": tokens_per_second * fpt / (peak.flops_per_second * spec.mesh.size),
        "mfu_peak_source": peak.source,
        "peak_flops_per_second": peak.flops_per_second * spec.mesh.size,
        "mfu_measured_matmul": tokens_per_second * fpt / measured_flops,
        "matmul_flops_per_second": measured_flops,
        "flops_per_token": fpt,
        "peak_memory_bytes": peak_bytes,
        "peak_memory_source": peak_source,
        "skipped_steps": last.get("skipped_steps", 0),
        "num_params": spec.cfg.num_params(),
        "num_active_params": spec.cfg.num_active_params(),
        "devices": spec.mesh.size,
        "mesh": dict(spec.mesh.shape),
    }
    if lead:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        metrics_io.plot_losses(workdir / "metrics.jsonl", workdir / "loss.png")
    return summary


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.total = total
        self.last_step = start

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        text = f"loss {record['loss']:.4f} tok/s {record['tokens_per_second']:,.0f}"
        if "val_loss" in record:
            text += f" val {record['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.update(record["step"] - self.last_step)
            self.bar.set_postfix_str(text)
        else:
            print(f"step {record['step']}/{self.total} {text} lr {record['lr']:.2e}", flush=True)
        self.last_step = record["step"]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors and exit code 2 for bad flags."""
    try:
        rest = flags.FLAGS(argv)
    except (flags.Error, KeyError, TypeError, ValueError) as e:
        usage_exit(str(e))
    if len(rest) > 1:
        usage_exit(f"unexpected arguments {rest[1:]}; options are --workdir, --config and --config.<key>=<value>")
    return rest


def usage_exit(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(config_flag: flags.FlagHolder, argv: list[str]) -> None:
    del argv  # checked by parse_flags
    host_memory.keep_freed_memory()  # before JAX starts its backend
    if not flags.FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    try:
        multihost.initialize(
            flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id, auto=flags.FLAGS.distributed_auto
        )
    except ValueError as e:
        usage_exit(str(e))
    config = config_flag.value
    workdir = flags.FLAGS.workdir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.model.preset}-{config.optimizer.name}"
    try:
        summary = run(config, workdir, interrupt_at=flags.FLAGS.stop_after, restore_step=flags.FLAGS.restore_step)
    except UsageError as e:
        if flags.FLAGS.verbose:
            raise
        usage_exit(str(e))
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if summary.get("interrupted"):
        sys.exit(128 + summary["signal"])
    keys = (
        "steps", "final_train_loss", "final_val_loss", "final_val_bits_per_byte", "tokens_per_second",
        "mfu", "mfu_peak_source", "mfu_measured_matmul",
    )  # fmt: skip
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"workdir: {workdir}")


def define_flags() -> flags.FlagHolder:
    """The command-line flags; config overrides of unknown keys exit with code 2."""
    flags.DEFINE_string("workdir", None, "Output folder; default: a fresh folder under ./runs/.")
    flags.DEFINE_bool("verbose", False, "Show tracebacks for bad input, and library logs.")
    flags.DEFINE_string("coordinator_address", None, "Multi-process: host:port of process 0.")
    flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
    flags.DEFINE_integer("process_id", None, "Multi-process: rank of this process.")
    flags.DEFINE_integer("stop_after", None, "Stop as if preempted after this step (checkpoint, exit 143).")
    flags.DEFINE_integer("restore_step", None, "Resume from this checkpoint step, not the newest; newer ones are deleted.")
    flags.DEFINE_bool("distributed_auto", False, "Multi-process with values detected by JAX (TPU VM, SLURM).")
    return define_config_flag(DEFAULT_CONFIG)


def define_config_flag(default: str) -> flags.FlagHolder:
    """``--config`` with ``--config.<key>`` overrides; an unknown key exits with code 2."""
    try:
        return config_flags.DEFINE_config_file("config", default, "Config file (ml_collections).", lock_config=True)
    except (AttributeError, KeyError) as e:  # config_flags applies --config.* overrides right here
        detail = str(e.args[0] if e.args else e).replace("\\'", "'").replace("\\n", "\n").strip("'\"")
        key, _, hint = detail.partition("\n")
        hint = f" ({hint.strip()})" if hint.strip() else ""
        usage_exit(f"unknown config key {key.strip(chr(39))!r}{hint}; the keys are listed in {default}")


if __name__ == "__main__":
    config_holder = define_flags()
    app.run(functools.partial(main, config_holder), flags_parser=parse_flags)
