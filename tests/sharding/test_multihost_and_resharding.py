"""Runs that move between meshes and processes: checkpoint resharding and a 2-process replica-local job with every
cross-replica optimizer (the 2-process GSPMD job that stops and resumes is test_multihost_lost_host.py's)."""

import shutil
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
