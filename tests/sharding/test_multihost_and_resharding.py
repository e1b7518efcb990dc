"""Runs that move between meshes and processes: checkpoint resharding and 2-process jobs (GSPMD, and replica-local
with every cross-replica optimizer)."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import cluster_env
import cross_replica_worker
import jax
import pytest

from experiments import trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm.data import documents, tokenize

REPO = Path(__file__).resolve().parents[2]


def _config(mesh="", rules="fsdp", devices=0):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 10, 8, 32
    config.eval_every, config.eval_batches, config.log_every = 5, 2, 1
    config.checkpoint_every = 100
    config.optimizer.warmup_steps = 2
    config.mesh, config.rules, config.devices = mesh, rules, devices
    return config


def _losses(workdir):
    return [r["loss"] for r in read_metrics(Path(workdir) / "metrics.jsonl")]


@pytest.mark.devices(8)
def test_checkpoint_saved_on_fsdp_restores_on_other_meshes(tmp_path):
    reference = trainer.run(_config("fsdp:8"), tmp_path / "straight")
    assert reference["steps"] == 10
    trainer.run(_config("fsdp:8"), tmp_path / "saved", interrupt_at=4)
    targets = {
        "tp": (_config("data:2,tensor:4", rules="tp"), {"data": 2, "tensor": 4}),
        "one_device": (_config("data:1", devices=1), {"data": 1}),
    }
    for name, (config, mesh) in targets.items():
        shutil.copytree(tmp_path / "saved", tmp_path / name)
        summary = trainer.run(config, tmp_path / name)
        assert summary["resumed_from_step"] == 4 and summary["mesh"] == mesh
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "straight"), rel=1e-5)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The GSPMD job of the 2-process test: the default config with these keys.
JOB = {"steps": 8, "batch_size": 8, "data.seq_len": 32, "eval_every": 4, "eval_batches": 2, "log_every": 1, "optimizer.warmup_steps": 2}


def _train_cli(workdir, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in JOB.items()), *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_processes(workdir, *extra):
    port = _free_port()
    procs = [
        _train_cli(workdir, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}", *extra)
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    return [p.returncode for p in procs], results


def _shards(root):
    """llm.c shards of a small text folder (`experiments.tokenize`), read with document-aligned windows."""
    (root / "text").mkdir(parents=True)
    for i in range(40):
        (root / "text" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * (5 + i % 9))
    tokenize.tokenize("bytes", documents.expand(str(root / "text")), root / "shards", val_fraction=0.2, shard_tokens=3000, workers=1)
    return {"data.train_files": str(root / "shards" / "train_*.bin"), "data.val_files": str(root / "shards" / "val_*.bin"), "data.bos_aligned": True}


@pytest.mark.devices(2)
def test_two_process_run_checkpoints_resumes_and_matches_one_process(tmp_path):
    """Stopped after step 3 and resumed by a second launch: equal to the same job on two devices of this process
    (reading llm.c shards through the Grain loader, each process its rows)."""
    data_keys = _shards(tmp_path)
    reference = default.get_config()
    for key, value in {**JOB, **data_keys}.items():
        *path, last = key.split(".")
        (reference[path[0]] if path else reference)[last] = value
    reference.devices = 2
    trainer.run(reference, tmp_path / "single")

    data_flags = [f"--config.{k}={v}" for k, v in data_keys.items()]
    codes, results = _two_processes(tmp_path / "multi", "--stop_after=3", *data_flags)
    assert codes == [143, 143], [r[1][-2000:] for r in results]
    assert (tmp_path / "multi" / "checkpoints" / "3").is_dir()
    codes, results = _two_processes(tmp_path / "multi", *data_flags)
    assert codes == [0, 0], [r[1][-2000:] for r in results]
    _assert_same_run(tmp_path / "multi", tmp_path / "single")


def _assert_same_run(multi_dir, single_dir):
    multi = read_metrics(Path(multi_dir) / "metrics.jsonl")
    reference = read_metrics(Path(single_dir) / "metrics.jsonl")
    assert [r["step"] for r in multi] == list(range(1, 9))
    assert [r["loss"] for r in multi] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
    # Validation runs at steps 4 and 8 only (pytest >= 9.2's approx rejects None among expected values).
    evaluated = [(r["step"], r["val_loss"]) for r in multi if "val_loss" in r]
    expected = [(r["step"], r["val_loss"]) for r in reference if "val_loss" in r]
    assert [s for s, _ in evaluated] == [s for s, _ in expected] == [4, 8]
    assert [v for _, v in evaluated] == pytest.approx([v for _, v in expected], rel=1e-5)


WORKER = Path(__file__).with_name("cross_replica_worker.py")


@pytest.mark.devices(2)
def test_two_processes_train_every_cross_replica_optimizer_like_one_process(tmp_path):
    """One replica per process of a job started as ``mpirun -np 2`` starts it (Open MPI's variables, JAX's detector
    finding the coordinator), each cross-replica optimizer in turn (one launch for all of them; DiLoCo preempted
    after step 3 where replicas differ, and resumed): equal to two replicas in this process."""
    port = cluster_env.free_port()
    multi = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path / "multi"), "--preempt"], env=cluster_env.environ("ompi", i, 2, port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # as the workers compile
    try:
        for name in cross_replica_worker.OPTIMIZERS:
            config = cross_replica_worker.config_for(name)
            config.devices = 2
            trainer.run(config, tmp_path / "single" / name)
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        results = [p.communicate(timeout=600) for p in multi]
    assert [p.returncode for p in multi] == [0, 0], [err[-2000:] for _, err in results]
    for rank, (_, err) in enumerate(results):
        assert cluster_env.start_line("ompi", rank, 2, port) in err, err[-2000:]
    for name in cross_replica_worker.OPTIMIZERS:
        assert (tmp_path / "multi" / name / "checkpoints" / "3").is_dir() == (name in cross_replica_worker.PREEMPTED)
        _assert_same_run(tmp_path / "multi" / name, tmp_path / "single" / name)
