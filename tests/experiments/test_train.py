import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from experiments import cli, restore, run_spec, train_lib, trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm import config as config_lib
from lm import model as model_lib
from optim import build
from optim.cautious_weight_decay import CautiousWeightDecayState
from optim.lookahead import LookaheadState
from optim.tail_average import TailAverageState
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib

REPO = Path(__file__).resolve().parents[2]


def small_config(**overrides):
    config = default.get_config()
    config.steps = 12
    config.batch_size = 8
    config.data.seq_len = 32
    config.eval_every = 6
    config.eval_batches = 2
    config.log_every = 1
    config.checkpoint_every = 5
    config.optimizer.warmup_steps = 2
    config.devices = 1  # sharded runs are tested in tests/sharding; 8 fake devices only add time here
    config.update_from_flattened_dict(overrides)
    return config


def test_the_runs_optimizer_is_the_one_its_config_block_builds():
    """The run builds its optimizer as `optim.build.build` does, every setting of the block included: the track
    wrappers (``optimizer.cautious_weight_decay``, ``.lookahead``, ``.tail_average``) once stopped at ``build``,
    which the run does not call, so a run with them trained without them."""
    settings = {
        "optimizer.cautious_weight_decay": 0.1, "optimizer.lookahead.stepsize": 0.3, "optimizer.tail_average.start": 4,
        "optimizer.state_bits": 8, "optimizer.cautious": True,
    }  # fmt: skip
    config = small_config(**settings)
    spec = run_spec.build_run(config)
    state = jax.eval_shape(spec.tx.init, spec.model_def.abstract_params)
    built = jax.eval_shape(build.build(config.optimizer, config.steps).init, spec.model_def.abstract_params)
    assert jax.tree.structure(state) == jax.tree.structure(built)
    for kind in (CautiousWeightDecayState, LookaheadState, TailAverageState):
        assert any(isinstance(s, kind) for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, kind))), kind


def test_run_writes_every_output_and_learns(tmp_path):
    # The config of `straight_run` (its compiled steps are cached), every checkpoint kept.
    summary = trainer.run(small_config(keep_checkpoints=10), tmp_path)
    # Saves every checkpoint_every steps from step 0, and the last step (orbax's policy alone also saved step 1).
    assert ocp.CheckpointManager(tmp_path / "checkpoints").all_steps() == [5, 10, 12]
    for name in ("config.json", "metrics.jsonl", "loss.png", "summary.json"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_second"} <= set(records[0])
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0] - 0.3
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "final_train_loss", "final_val_loss", "tokens_per_second", "mfu", "mfu_measured_matmul", "peak_memory_bytes"):
        assert on_disk[key] == summary[key]
    assert 0 < summary["mfu"] < 1 and summary["peak_memory_bytes"] > 0
    assert summary["mfu_peak_source"].startswith("measured matmul rate")  # a CPU has no datasheet peak
    assert summary["mfu"] == summary["mfu_measured_matmul"]
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 12


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    trainer.run(small_config(), workdir)
    return read_metrics(workdir / "metrics.jsonl")


@pytest.mark.parametrize("interrupt_at", [5, 7])  # on and between checkpoint_every=5 boundaries
def test_interrupted_and_resumed_run_matches_uninterrupted_bit_for_bit(tmp_path, straight_run, interrupt_at):
    config = small_config()
    stopped = trainer.run(config, tmp_path, interrupt_at=interrupt_at)
    assert stopped == {"interrupted": True, "steps": interrupt_at, "signal": 15}
    summary = trainer.run(config, tmp_path)
    assert summary["resumed_from_step"] == interrupt_at
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    for key in ("step", "loss", "grad_norm", "lr", "val_loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in straight_run], key


class _LoggedFloat:
    """A metric whose conversion to float (the loop reading it on the host) is logged."""

    def __init__(self, value, events, step):
        self.value, self.events, self.step = value, events, step

    def __float__(self):
        self.events.append(("read", self.step))
        return float(self.value)


def test_loop_reads_step_metrics_one_step_late_except_where_it_evaluates_or_saves(tmp_path, monkeypatch):
    events = []
    jit_train_step, evaluate, save = train_lib.jit_train_step, trainer._evaluate, trainer.checkpointing.save

    def logged_jit_train_step(step_fn, shardings):
        step = jit_train_step(step_fn, shardings)

        def run(state, batch):
            n = len([e for e in events if e[0] == "dispatch"]) + 1
            events.append(("dispatch", n))
            state, metrics = step(state, batch)
            return state, {**metrics, "loss": _LoggedFloat(metrics["loss"], events, n)}

        return run

    monkeypatch.setattr(train_lib, "jit_train_step", logged_jit_train_step)
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: events.append(("host", "eval")) or evaluate(*a))
    monkeypatch.setattr(trainer.checkpointing, "save", lambda mgr, step, *a, **k: events.append(("host", "save")) or save(mgr, step, *a, **k))
    trainer.run(small_config(eval_every=3, checkpoint_every=4), tmp_path)

    position = {e: i for i, e in enumerate(events)}
    late = 0
    for n in range(1, 13):
        host_work = [e for e in events[position["read", n] + 1 : position.get(("dispatch", n + 1), len(events))] if e[0] == "host"]
        if ("dispatch", n + 1) in position and position["read", n] > position["dispatch", n + 1]:
            late += 1
            assert position["read", n] < position.get(("dispatch", n + 2), len(events)), events  # one step late at most
        else:
            assert host_work, f"step {n} was read before the next dispatch with nothing to do on the host: {events}"
    assert late == 6, events  # steps 1, 2, 5, 7, 10, 11 neither evaluate (3, 6, 9, 12) nor save (4, 8, 12)


@pytest.mark.devices(8)
def test_non_finite_steps_are_skipped_and_counted():
    """A corrupt batch (token ids past the vocabulary gather NaN embeddings) must not touch the state."""
    model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=1))
    tx = optax.adam(1e-3)
    mesh = mesh_lib.make_mesh("data:8")
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules_lib.make_rules())
    good = np.random.default_rng(0).integers(0, 256, (8, 17))
    corrupt = good.copy()
    corrupt[3, 5] = 10_000
    with jax.set_mesh(mesh):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step = jax.jit(train_lib.make_train_step(model_def, tx))
        history = []
        for batch in (good, corrupt, corrupt, good):
            before = jax.tree.map(np.asarray, (state["params"], state["opt_state"]))
            state, metrics = step(state, jnp.asarray(batch, jnp.int32))
            after = jax.tree.leaves((state["params"], state["opt_state"]))
            changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), after))
            history.append((bool(metrics["finite"]), changed, int(state["bad_streak"]), int(state["skipped"])))
    assert history == [(True, True, 0, 0), (False, False, 1, 1), (False, False, 2, 2), (True, True, 0, 2)]
    assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(state["params"]))


def test_run_stops_after_consecutive_bad_steps_without_poisoned_checkpoint(tmp_path):
    config = small_config(steps=10, max_bad_steps=3)
    config.optimizer.learning_rate = float("inf")
    config.optimizer.schedule = "constant"
    config.optimizer.warmup_steps = 0
    with pytest.raises(trainer.NonFiniteError, match="3 consecutive steps"):
        trainer.run(config, tmp_path)
    mgr = ocp.CheckpointManager(tmp_path / "checkpoints")
    for step in mgr.all_steps():
        restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored["state"]["params"]))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [1, 2, 3]


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    one = trainer.run(small_config(steps=4, eval_every=4, batch_size=16), tmp_path / "one")
    accumulated = trainer.run(small_config(steps=4, eval_every=4, batch_size=16, grad_accum_steps=2), tmp_path / "two")
    assert accumulated["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)
    assert accumulated["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)


# Messages that name this host's 8 fake CPU devices (a one-GPU box has one device).
EIGHT_DEVICES = pytest.mark.devices(8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optimizer.name": "adamz"}, "unknown optimizer 'adamz'; set optimizer.name to one of"),
        ({"model.preset": "huge"}, "unknown model preset 'huge'"),
        ({"model.n_heads": 3}, "multiple of model.n_kv_heads"),
        ({"data.path": "/no/such/corpus"}, "does not exist"),
        pytest.param({"mesh": "data:3", "devices": 0}, "divisors of 8", marks=EIGHT_DEVICES),
        pytest.param({"batch_size": 12, "devices": 0}, "batch_size divisible by 8", marks=EIGHT_DEVICES),
        ({"optimizer.schedule": "step"}, "one of constant, cosine"),
        ({"data.seq_len": 2048}, "max_seq_len=1024; lower data.seq_len or raise model.max_seq_len to at least 2048"),
        pytest.param({"mesh": "tensor:8", "devices": 0, "rules": "tp", "model.mlp_dim": 100},
                     "does not split over mesh axes \\('tensor',\\)", marks=EIGHT_DEVICES),
        pytest.param({"devices": 9}, "only 8 devices", marks=EIGHT_DEVICES),
        pytest.param({"mesh": "data:2", "devices": 2, "replicas": "data", "optimizer.name": "diloco", "model.attention": "pallas"},
                     "model.attention=pallas runs in Pallas interpret mode .* use model.attention=xla", marks=EIGHT_DEVICES),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_fix(tmp_path, overrides, message):
    with pytest.raises(cli.UsageError, match=message):
        trainer.run(small_config(**overrides), tmp_path)


def test_cudnn_attention_off_an_nvidia_gpu_is_a_usage_error(tmp_path):
    """Named on a CPU, jax would raise "cuDNN is not detected" from inside the first step's lowering."""
    if jax.default_backend() in ("gpu", "cuda"):
        pytest.skip("cuDNN attention runs on this device")
    with pytest.raises(cli.UsageError, match=r"model.attention=cudnn runs on NVIDIA GPUs, .* use model.attention=auto \(xla here\)"):
        trainer.run(small_config(**{"model.attention": "cudnn"}), tmp_path)


def test_workdir_with_another_models_checkpoint_is_refused(tmp_path):
    trainer.run(small_config(), tmp_path, interrupt_at=2)
    with pytest.raises(cli.UsageError, match="different run .*d_model: checkpoint 128 vs now 64"):
        trainer.run(small_config(steps=4, **{"model.d_model": 64}), tmp_path)
    # the changed name first, not the other optimizer's keys that follow from it (were the four shown)
    with pytest.raises(cli.UsageError, match=r"different run \(optimizer.name: checkpoint 'adamw' vs now 'muon'; .*; and \d+ more\)"):
        trainer.run(small_config(steps=4, **{"optimizer.name": "muon"}), tmp_path)
    with pytest.raises(cli.UsageError, match="checkpointed data state has seq_len=32 but this run has 16"):
        trainer.run(small_config(steps=4, **{"data.seq_len": 16}), tmp_path)
    # the refused runs wrote nothing (was: their config.json over the run's, which sample, evaluate and export then read)
    saved = restore.run_config(tmp_path)
    assert (saved.model.d_model, saved.optimizer.name, saved.data.seq_len) == (128, "adamw", 32)


def _cli(*args, cwd, env_extra=None, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.optimizer.nme=sgd"], """unknown config key 'optimizer.nme' (Did you mean "name" instead of "nme"?)"""),
        (["--config.model.preset=huge"], "unknown model preset 'huge'"),
        (["--config.steps=ten"], "--config.steps=ten"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, args, message):
    result = _cli(f"--workdir={tmp_path}", *args, cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def _cli_flags(config, base, prefix="--config."):
    """The ``--config.<key>=<value>`` flags that turn ``base`` into ``config``."""
    flags = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            flags += _cli_flags(value, base[key], f"{prefix}{key}.")
        elif value != base[key]:
            flags.append(f"{prefix}{key}={value}")
    return flags


def _truncate_array_data(step_dir):
    data = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


DAMAGE = {
    "truncated array data": _truncate_array_data,
    "truncated tree metadata": lambda step_dir: (step_dir / "state" / "_METADATA").write_text("{"),
    "missing state": lambda step_dir: shutil.rmtree(step_dir / "state"),
}


@pytest.fixture(scope="module")
def saved_at_5_and_7(tmp_path_factory):
    """A run stopped after step 7 (`small_config`: checkpoints at steps 5 and 7)."""
    workdir = tmp_path_factory.mktemp("saved")
    trainer.run(small_config(), workdir, interrupt_at=7)
    assert ocp.CheckpointManager(workdir / "checkpoints").all_steps() == [5, 7]
    return workdir


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_a_usage_error_naming_step_and_fix(tmp_path, saved_at_5_and_7, damage):
    shutil.copytree(saved_at_5_and_7, tmp_path, dirs_exist_ok=True)
    DAMAGE[damage](tmp_path / "checkpoints" / "7")
    with pytest.raises(cli.UsageError, match=r"checkpoint step 7 cannot be read \(.+\); delete .+/7 .*--restore_step=5"):
        trainer.run(small_config(), tmp_path)


def test_cli_damaged_checkpoint_exits_2_and_restore_step_resumes_the_previous_one(tmp_path, saved_at_5_and_7, straight_run):
    shutil.copytree(saved_at_5_and_7, tmp_path, dirs_exist_ok=True)
    _truncate_array_data(tmp_path / "checkpoints" / "7")
    result = _cli(f"--workdir={tmp_path}", *_cli_flags(small_config(), default.get_config()), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint step 7 cannot be read"), result.stderr[-3000:]
    assert "--restore_step=5" in lines[0]
    summary = trainer.run(small_config(), tmp_path, restore_step=5)
    assert summary["resumed_from_step"] == 5
    assert ocp.CheckpointManager(tmp_path / "checkpoints").all_steps() == [10, 12]  # the damaged 7 was replaced
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    for key in ("step", "loss", "grad_norm", "lr", "val_loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in straight_run], key


def test_restore_step_that_was_not_saved_is_a_usage_error(tmp_path, saved_at_5_and_7):
    shutil.copytree(saved_at_5_and_7, tmp_path, dirs_exist_ok=True)
    with pytest.raises(cli.UsageError, match=r"no checkpoint at step 6 .*saved steps: \[5, 7\]"):
        trainer.run(small_config(), tmp_path, restore_step=6)


def test_default_main_job_reaches_target_loss(tmp_path, optimized_subprocess_env):
    """The README's main command, as a fresh user runs it: no flags, a workdir under ./runs/."""
    result = _cli(cwd=tmp_path, env_extra={"JAX_PLATFORMS": "cpu", **optimized_subprocess_env})
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == default.get_config().steps
    assert summary["final_val_loss"] <= 2.5
    print(f"default job: val loss {summary['final_val_loss']:.3f}, {summary['tokens_per_second']:.0f} tokens/s")


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    """(On a CPU split into the two devices of its mesh by ``--cpu_devices``, as a laptop runs a sharded run;
    without the flag the mesh is refused, naming it: tests/sharding/test_mesh_and_rules.py.)"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    args = [
        sys.executable, "-m", "experiments.train", f"--workdir={tmp_path}", "--config.steps=100000", "--cpu_devices=2",
        "--config.mesh=data:2", "--config.batch_size=4", "--config.data.seq_len=16", "--config.log_every=1",
        "--config.eval_batches=1",
    ]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "checkpoint saved" in err and f"--workdir={tmp_path}" in err
    last_logged = read_metrics(metrics)[-1]["step"]
    saved = ocp.CheckpointManager(tmp_path / "checkpoints").latest_step()
    assert saved is not None and saved >= last_logged
