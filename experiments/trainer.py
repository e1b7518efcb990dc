"""The training run: data, the sharded state (fresh or resumed), the loop, checkpoints, the summary.

`run` trains (or resumes) the run a config describes in a workdir; `experiments.train` is its
command line. The loop reads the few settings it needs once (`LoopSettings`), not the config.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from experiments import checkpointing, hardware, metrics_io, profiling, restore, storage, train_lib
from experiments.cli import UsageError
from experiments.run_spec import RunSpec, balancing, build_run, check_hf_tokenizer, data_config, resolve, run_meta, upgrade_meta
from lm import hf, speedrun_config
from lm.data import batches as batches_lib
from lm.data import input_pipeline
from lm.loss import flops_per_token
from lm.model import count_params
from optim import build
from optim.tail_average import evaluation_params
from sharding import partition

# Per-step metrics of an MoE model (lm/moe.py) written with the loss.
MOE_METRICS = ("moe_balance_loss", "router_z_loss", "expert_load_max", "dropped_fraction")
TIMING = "timing.jsonl"  # a run with a target loss: per checkpoint, the training seconds so far, which a resumed run adds


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps."""


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What the training loop needs of the config."""

    steps: int
    batch_size: int
    seq_len: int
    eval_every: int
    log_every: int
    max_bad_steps: int
    token_shares: dict[str, float] | None = None  # a mixture's share of tokens per source over the run
    config: dict | None = None  # the resolved config, for TensorBoard hparams and Weights & Biases
    wandb: dict | None = None  # the config's ``wandb`` block
    profile: tuple[int, int] | None = None  # steps to trace (`experiments.profiling.StepTrace`)
    target_val_loss: float | None = None  # stop at the first evaluation at or below it (`experiments.speedrun`)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> LoopSettings:
        return cls(
            steps=config.steps,
            batch_size=config.batch_size,
            seq_len=config.data.seq_len,
            eval_every=config.eval_every,
            log_every=config.log_every,
            max_bad_steps=config.max_bad_steps,
            token_shares=input_pipeline.token_shares(data_config(config), config.steps * config.batch_size),
            config=config.to_dict(),
            wandb=config.wandb.to_dict() if config.get("wandb") else None,
            profile=profiling.parse_steps(config.get("profile", "")),  # checked by `build_run`
            target_val_loss=config.get("target_val_loss"),
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass
class _Stop:
    """Set by SIGINT/SIGTERM (or a simulated preemption at step ``at``) to end the run after the current step."""

    at: int | None = None
    signum: int | None = None

    def request(self, signum: int, frame: Any = None) -> None:
        del frame
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class _Checkpoints:
    manager: Any
    meta: dict
    every: int  # steps between saves, counted from step 0 (orbax's own policy would also save the first step)


def load_data(config: ml_collections.ConfigDict, vocab_size: int) -> tuple[batches_lib.PackedBatches, input_pipeline.ValidationSet]:
    """This process's training iterator and validation batches (`lm.data.input_pipeline`), for a model of ``vocab_size``."""
    try:
        return input_pipeline.build(
            data_config(config), vocab_size, seed=config.seed, batch_size=config.batch_size, eval_batches=config.eval_batches,
            process_index=jax.process_index(), process_count=jax.process_count(),
        )
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e


def _evaluate(eval_step, params, batches: input_pipeline.ValidationSet, shardings) -> float:
    """The mean validation loss: of the batches' means, or with ``batches.weights`` over exactly the weighted targets."""
    if batches.weights is None:
        losses = [eval_step(params, train_lib.global_batch(b, shardings)) for b in batches]
        return float(np.mean(jax.device_get(losses)))
    sums = [eval_step(params, *(train_lib.global_batch(x, shardings) for x in bw)) for bw in zip(batches, batches.weights, strict=True)]
    total, count = np.sum(jax.device_get(sums), axis=0)
    return float(total / count)


def run(
    config: ml_collections.ConfigDict, workdir: str | Path, *, interrupt_at: int | None = None, restore_step: int | None = None
) -> dict:
    """Trains (or resumes) the run described by ``config`` in ``workdir``; returns the summary.

    Args:
      config: see ``experiments/configs/default.py``.
      workdir: output folder, local or ``gs://`` (`experiments.storage`); its checkpoints, if any, are resumed.
      interrupt_at: simulate a preemption after this many steps (the SIGTERM path: save, stop).
      restore_step: resume from this saved step instead of the newest (newer ones are deleted).

    Returns:
      The summary dict also written to ``summary.json``; ``{"interrupted": True, ...}`` when stopped.
    """
    if interrupt_at is not None and interrupt_at < 1:
        raise UsageError(f"--stop_after={interrupt_at} must be >= 1 (the step to stop after)")
    workdir = storage.workdir(workdir)
    try:
        storage.check_checkpoints(workdir)
    except ValueError as e:
        raise UsageError(str(e)) from e
    spec = build_run(config)
    try:
        config = resolve(config, spec.cfg)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from e
    if config.get("wandb") and config.wandb.project and importlib.util.find_spec("wandb") is None:
        raise UsageError(f"wandb.project={config.wandb.project} needs Weights & Biases: pip install -e '.[wandb]'")
    latest = restore_step if restore_step is not None else checkpointing.latest_step(workdir)
    if latest is not None:  # before anything in the workdir is written (a refused run left its config.json there)
        _check_same_run(workdir, latest, run_meta(config, spec.cfg, spec.shardings.replicas))
    reached = _reached_target(workdir, latest, config) if latest is not None and latest < config.steps else None
    if latest is not None and (latest >= config.steps or reached is not None):
        return _finished(workdir, latest, config.steps, reached)
    if latest is None:
        _check_not_foreign(workdir)
    if latest is None and config.get("init_from_hf"):
        try:
            check_hf_tokenizer(config)
        except ValueError as e:
            raise UsageError(str(e)) from e
    train_iter, val_batches = load_data(config, spec.cfg.vocab_size)
    if latest is not None:  # as the meta: a resume refused for its data settings left its config.json there
        _check_same_data(workdir, latest, train_iter)
    saved_config = _saved_config(workdir) if latest is not None else None
    workdir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        _copy_data_files(data_config(config), workdir)

    shardings = spec.shardings
    step_fn = train_lib.make_train_step(
        spec.model_def,
        spec.tx,
        grad_accum_steps=config.grad_accum_steps,
        z_loss=config.loss.z_loss,
        learning_rate=build.learning_rate_fn(config.optimizer, config.steps),
        balancing=balancing(config),
        replica_axis=shardings.replica_axis,
        window_blocks=functools.partial(speedrun_config.window_blocks, spec.cfg) if spec.cfg.window_warmup else None,
    )
    meta = run_meta(config, spec.cfg, shardings.replicas)
    mgr = checkpointing.manager(workdir, keep=config.keep_checkpoints, every=config.checkpoint_every)
    stop = _Stop(at=interrupt_at)
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
                restored = checkpointing.restore(mgr, target, meta, restore_step, upgrade=upgrade_meta)
            except checkpointing.CheckpointError as e:
                raise UsageError(str(e)) from e
            if restored is None:
                params = None
                if config.get("init_from_hf"):
                    try:
                        params = hf.load_params(config.init_from_hf, spec.cfg, spec.model_def.abstract_params, shardings.params)
                    except (hf.CheckpointError, FileNotFoundError) as e:
                        raise UsageError(f"init_from_hf: {e}") from e
                state, start = train_lib.init_state(spec.model_def, spec.tx, config.seed, shardings, params), 0
            else:
                start, state, data_state = restored
                if jax.process_index() == 0:
                    print(f"resuming from step {start} of {config.steps} in {workdir}", file=sys.stderr)
                    if said := _schedule_change(saved_config, config, start):
                        print(said, file=sys.stderr)
                try:
                    train_iter.set_state(data_state)
                except ValueError as e:
                    raise UsageError(str(e)) from e
            summary = _loop(
                LoopSettings.from_config(config), spec, step_fn, state, start,
                batches=(train_iter, val_batches), workdir=workdir, checkpoints=_Checkpoints(mgr, meta, max(config.checkpoint_every, 1)), stop=stop,
            )  # fmt: skip
    finally:
        mgr.wait_until_finished()
        mgr.close()
        for s, h in handlers.items():
            signal.signal(s, h)
    return summary


def _saved_config(workdir: epath.Path) -> ml_collections.ConfigDict | None:
    """The config a run in ``workdir`` wrote before this one overwrites it (None if it wrote none or it is not JSON)."""
    try:
        return restore.run_config(workdir)
    except UsageError:
        return None


def _schedule_change(saved: ml_collections.ConfigDict | None, config: ml_collections.ConfigDict, step: int) -> str | None:
    """The line a run resumed after ``step`` prints when its learning rate there differs from what the saved run's
    schedule gave: the schedule is computed for this run's ``steps`` and settings, so a cosine run extended after it
    ended climbs back up from its floor."""
    try:
        before = float(build.learning_rate_fn(saved.optimizer, saved.steps)(step))
    except (AttributeError, KeyError, TypeError, ValueError):  # no saved config, or one this version cannot read
        return None
    now = float(build.learning_rate_fn(config.optimizer, config.steps)(step))
    if np.isclose(now, before, rtol=1e-6, atol=0.0):
        return None
    changed = [
        f"{name}={old} -> {new}"
        for name, old, new in [("steps", saved.steps, config.steps)]
        + [(f"optimizer.{k}", saved.optimizer.get(k), config.optimizer.get(k)) for k in build.SCHEDULE_KEYS]
        if old != new
    ]
    return (
        f"the learning rate of step {step + 1} is {now:.3g}, where the saved run's schedule gave {before:.3g} "
        f"({', '.join(changed) or 'its schedule changed'}: the schedule is recomputed for this run)"
    )


def _check_same_run(workdir: epath.Path, step: int, meta: dict) -> None:
    """Checkpoint ``step`` in ``workdir`` is this run's (the same model, optimizer and replicas), else a usage error."""
    mgr = checkpointing.manager(workdir, keep=None, every=1)  # keeps every step: opening it deletes nothing
    try:
        checkpointing.check_meta(mgr, step, meta, upgrade_meta)
    except checkpointing.CheckpointError as e:
        raise UsageError(str(e)) from e
    finally:
        mgr.close()


def _check_not_foreign(workdir: epath.Path) -> None:
    """A fresh run writes its ``config.json`` into ``workdir``: refuse one that holds another program's (a
    transformers export's, which ``--workdir`` = ``init_from_hf`` replaced, leaving weights without a config)."""
    if not (workdir / "config.json").is_file():
        return
    try:
        restore.run_config(workdir)
    except UsageError as e:
        raise UsageError(
            f"--workdir={workdir} holds a config.json that is not a training run's (a transformers export?), which this "
            "run's would replace; give another --workdir"
        ) from e


def _check_same_data(workdir: epath.Path, step: int, train_iter: batches_lib.PackedBatches) -> None:
    """Checkpoint ``step`` in ``workdir`` was saved by the input pipeline ``train_iter`` resumes (the same data,
    sequence length, batch and seed), else a usage error."""
    mgr = checkpointing.manager(workdir, keep=None, every=1)
    try:
        train_iter.check_state(checkpointing.read_data_state(mgr, step))
    except ValueError as e:  # a checkpointing.CheckpointError too
        raise UsageError(str(e)) from e
    finally:
        mgr.close()


def _reached_target(workdir: epath.Path, step: int, config: ml_collections.ConfigDict) -> float | None:
    """The validation loss with which the run saved in ``workdir`` stopped at ``step`` on reaching a target at or
    above ``config.target_val_loss`` (its ``summary.json``); None when it did not, or when there is no target."""
    target, path = config.get("target_val_loss"), workdir / "summary.json"
    if target is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if saved.get("reached_target") and saved.get("steps_to_target") == step and saved["final_val_loss"] <= target:
        return saved["final_val_loss"]
    return None


def _finished(workdir: epath.Path, step: int, steps: int, reached_loss: float | None = None) -> dict:
    """The summary of a run whose checkpoint already reached ``steps`` (or its target loss: ``reached_loss``);
    nothing in ``workdir`` is touched."""
    if reached_loss is None:
        why, further = f"its checkpoint is at step {step} >= steps={steps}", "raise --config.steps to train further"
    else:
        why, further = f"it stopped at step {step} on reaching val loss {reached_loss:.4f}", "lower --config.target_val_loss to train further"
    print(f"{workdir} already finished: {why}; its files are kept as they are ({further})", file=sys.stderr)
    path = workdir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {"steps": step}
    return summary | {"finished": True}


def _copy_data_files(data: input_pipeline.DataConfig, workdir: epath.Path) -> None:
    """The training shards' manifest and its tokenizer file, copied into ``workdir`` (nothing for the text corpus)."""
    manifest = input_pipeline.train_manifest(data)
    if manifest is None:
        return
    source = Path(str(manifest.get("tokenizer") or "")).expanduser()
    source = source / "tokenizer.json" if source.is_dir() else source
    if source.is_file() and manifest.get("tokenizer") != "bytes":
        target = workdir / restore.TOKENIZER_NAMES.get(source.suffix, source.name)
        target.write_bytes(source.read_bytes())
        manifest = manifest | {"tokenizer_copy": target.name}
    (workdir / restore.DATA_MANIFEST).write_text(json.dumps(manifest, indent=1))


def _loop(
    settings: LoopSettings,
    spec: RunSpec,
    step_fn: Any,
    state: train_lib.TrainState,
    start: int,
    *,
    batches: tuple[batches_lib.PackedBatches, input_pipeline.ValidationSet],
    workdir: epath.Path,
    checkpoints: _Checkpoints,
    stop: _Stop,
) -> dict:
    shardings, lead = spec.shardings, jax.process_index() == 0
    train_iter, val_batches = batches
    train_step = train_lib.jit_train_step(step_fn, shardings)
    if val_batches.weights is None:
        eval_step = train_lib.jit_eval_step(train_lib.make_eval_step(spec.model_def), shardings)
    else:
        eval_step = train_lib.jit_eval_step(train_lib.make_weighted_eval_step(spec.model_def), shardings, weighted=True)
    writer = metrics_io.MetricsWriter(workdir, resume_step=start, enabled=lead, config=settings.config, wandb=settings.wandb)
    progress = Progress(settings.steps, start, lead)
    step_times: list[float] = []
    seconds_before = _seconds_before(workdir, start) if settings.target_val_loss is not None else None  # a speedrun's
    last = {}
    val_loss = reached = None
    # Steps dispatched whose metrics have not been read: (step, metrics, dispatch time). Reading a
    # step's metrics waits for it, so they are read one step late: the host loads and dispatches
    # step n + 1 while the device runs step n. A step that evaluates or checkpoints reads them all
    # first, so no checkpoint is saved past a step that ends the run.
    in_flight: collections.deque = collections.deque()
    previous_ready = time.perf_counter()
    trace = profiling.StepTrace(settings.profile, workdir, enabled=lead, resumed_at=start)
    try:
        for step in range(start, settings.steps):
            done = step + 1
            with trace.begin(done, state):
                dispatched = time.perf_counter()
                state, metrics = train_step(state, train_lib.global_batch(next(train_iter), shardings))
            trace.end(done, state)
            in_flight.append((done, metrics, dispatched))
            if stop.at is not None and done == stop.at:
                stop.request(signal.SIGTERM)
            stopping = stop.signum is not None and done < settings.steps
            evaluating = done % settings.eval_every == 0 or done == settings.steps
            saving = stopping or done == settings.steps or done % checkpoints.every == 0
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
                    "tokens_per_second": settings.tokens_per_step / step_times[-1],
                    "skipped_steps": int(metrics["skipped"]),
                    **{k: float(metrics[k]) for k in MOE_METRICS if k in metrics},
                }
                if record_step == done and evaluating:
                    val_loss = _evaluate(eval_step, evaluation_params(state["params"], state["opt_state"]), val_batches, shardings)
                    record["val_loss"] = val_loss
                    if (bits_per_byte := val_batches.bits_per_byte(val_loss)) is not None:
                        record["val_bits_per_byte"] = bits_per_byte
                    if settings.target_val_loss is not None and val_loss <= settings.target_val_loss:
                        reached = record_step
                last = record
                if record_step % settings.log_every == 0 or "val_loss" in record or record_step == settings.steps:
                    writer.write(record)
                    progress.update(record)
                if int(metrics["bad_streak"]) >= settings.max_bad_steps:
                    raise NonFiniteError(
                        f"{int(metrics['bad_streak'])} consecutive steps had a non-finite loss or gradient (last at step "
                        f"{record_step}); parameters were left unchanged and no such state was checkpointed. Lower "
                        "optimizer.learning_rate, enable optimizer.grad_clip_norm, or check the data"
                    )
            if saving or reached is not None:
                checkpointing.save(checkpoints.manager, done, state, train_iter.get_state(), checkpoints.meta, force=True)
                if lead and seconds_before is not None:
                    _record_seconds(workdir, done, seconds_before + _training_seconds(step_times))
            if reached is not None:
                break
            if stopping:
                progress.close()
                print(f"stopped by signal {stop.signum} after step {done}; checkpoint saved, rerun with --workdir={workdir} to resume", file=sys.stderr)
                return {"interrupted": True, "steps": done, "signal": stop.signum}
        progress.close()
        summary = _summarize(settings, spec, workdir, step_times, last, val_loss, start, reached, seconds_before)
        writer.write_summary(summary)
        return summary
    finally:
        trace.close(state)
        progress.close()
        writer.close()


def _summarize(
    settings: LoopSettings, spec: RunSpec, workdir: epath.Path, step_times, last, val_loss, start, reached, seconds_before
) -> dict:
    timed = step_times[1:] or step_times  # the first step of a process includes compilation
    tokens_per_second = settings.tokens_per_step / float(np.median(timed)) if timed else 0.0
    fpt = flops_per_token(spec.cfg, settings.seq_len)
    peak = hardware.peak_flops_per_device(spec.cfg.dtype, spec.mesh.devices.flat[0])
    measured_flops = hardware.matmul_flops_per_device() * spec.mesh.size
    peak_bytes, peak_source = hardware.peak_memory_bytes()
    counts = count_params(spec.model_def)
    summary = {
        "steps": settings.steps,
        "resumed_from_step": start,
        "final_train_loss": last.get("loss"),
        "final_val_loss": val_loss,
        "final_val_bits_per_byte": last.get("val_bits_per_byte"),
        "data_token_share": settings.token_shares,
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
        "num_params": counts.total,
        "num_active_params": counts.active,
        "devices": spec.mesh.size,
        "mesh": dict(spec.mesh.shape),
    }
    if settings.target_val_loss is not None:
        summary |= _to_target(settings, step_times, reached, start, seconds_before)
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        model, optimizer = (settings.config or {}).get("model", {}), (settings.config or {}).get("optimizer", {})
        title = f"{workdir.name}: {model.get('preset', '')} + {optimizer.get('name', '')}, {settings.steps} steps"
        metrics_io.plot_losses(workdir / "metrics.jsonl", workdir / "loss.png", title=title)
    return summary


def _training_seconds(step_times: list[float]) -> float:
    """One process's training seconds as modded-nanogpt times a record: the steps' time on the device without
    evaluations, and without compilation (the first step's time, which includes it, is the others' median)."""
    timed = step_times[1:]
    return sum(timed) + (float(np.median(timed)) if timed else 0.0)


def _seconds_before(workdir: epath.Path, start: int) -> float | None:
    """The training seconds of steps 1..``start`` (0 for a fresh run), from the earlier processes' `TIMING`
    record of checkpoint ``start``; None when there is none (a checkpoint written before the record existed)."""
    if start == 0:
        return 0.0
    path = workdir / TIMING
    lines = path.read_text().splitlines() if path.exists() else []
    return next((r["seconds"] for r in map(json.loads, reversed(lines)) if r["step"] == start), None)


def _record_seconds(workdir: epath.Path, step: int, seconds: float) -> None:
    """Adds checkpoint ``step``'s training seconds so far to `TIMING` (rewritten whole: a bucket has no append)."""
    path = workdir / TIMING
    earlier = path.read_text() if path.exists() else ""
    path.write_text(earlier + json.dumps({"step": step, "seconds": seconds}) + "\n")


def _to_target(settings: LoopSettings, step_times: list[float], reached: int | None, start: int, seconds_before: float | None) -> dict:
    """Steps, tokens and training seconds (`_training_seconds`) to ``settings.target_val_loss``. A run resumed at
    step ``start`` adds the earlier processes' seconds (``seconds_before``; ``timed_from_step`` 0); where they are
    unknown it times only its own steps, ``start + 1`` on (``timed_from_step`` = ``start``)."""
    steps = reached if reached is not None else start + len(step_times)
    return {
        "target_val_loss": settings.target_val_loss,
        "reached_target": reached is not None,
        "steps_to_target": steps,
        "tokens_to_target": steps * settings.tokens_per_step,
        "seconds_to_target": (seconds_before or 0.0) + _training_seconds(step_times),
        "timed_from_step": start if seconds_before is None else 0,
        "compile_step_seconds": step_times[0] if step_times else None,
    }


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
