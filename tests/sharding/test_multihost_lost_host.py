"""A lost host: a 4-process job started by the Slurm recipe (experiments/launch/slurm.sbatch, run with the
environment ``srun`` sets and the CPU stand-in for GPUs) is SIGKILLed in the middle of an asynchronous
checkpoint save; a second job of 2 processes, started by the SkyPilot recipe (experiments/launch/skypilot.yaml,
SkyPilot's variables), resumes it from the last committed step on half the hosts and stops as if preempted
after step 6; one process finishes it. Its losses (training and validation, read from llm.c shards by the Grain loader,
each process its rows) equal an uninterrupted run's, step for step."""

import concurrent.futures
import os
import signal
import subprocess
import time
from pathlib import Path

import cluster_env
import pytest
import yaml

from experiments import trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm.data import documents, tokenize

LAUNCH = cluster_env.REPO / "experiments" / "launch"
# The recipes' llama-1b cut to a model that compiles in seconds; saves at steps 2, 4, 6, 8, validation at 4 and 8.
TINY = {
    "model.preset": "tiny", "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1,
    "model.head_dim": 16, "model.mlp_dim": 64, "model.dtype": "float32", "model.remat": "none",
    "steps": 8, "batch_size": 4, "data.seq_len": 16, "eval_every": 4, "eval_batches": 1, "log_every": 1,
    "checkpoint_every": 2, "optimizer.warmup_steps": 1,
}  # fmt: skip
MESH = "data:2,fsdp:-1"  # the recipes' data:<nodes>,fsdp:-1 on 2 nodes of one device each (the reference's)
STOP = 6  # the second job stops here (the SIGTERM path: checkpoint, exit 143)


def _shards(root: Path) -> dict:
    """llm.c shards of a small text folder (`experiments.tokenize`), read with document-aligned windows."""
    (root / "text").mkdir(parents=True)
    for i in range(40):
        (root / "text" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * (5 + i % 9))
    tokenize.tokenize("bytes", documents.expand(str(root / "text")), root / "shards", val_fraction=0.2, shard_tokens=3000, workers=1)
    return {"data.train_files": str(root / "shards" / "train_*.bin"), "data.val_files": str(root / "shards" / "val_*.bin"), "data.bos_aligned": True}


def _job(
    cluster: str, script: str, recipe: Path, workdir: Path, overrides: dict, *extra: str, tasks: int
) -> tuple[int, list[subprocess.Popen]]:
    """The ``tasks`` processes of a job that ``cluster`` starts: ``script`` (bash, ``$0`` the recipe, the trainer's
    extra flags in ``$@``) with the cluster's variables."""
    port = cluster_env.free_port()
    flags = [*(f"--config.{k}={v}" for k, v in overrides.items()), *extra]
    procs = [
        subprocess.Popen(
            ["bash", "-c", script, str(recipe), *flags], cwd=cluster_env.REPO, env=cluster_env.environ(cluster, rank, tasks, port)
            | {"WORKDIR": str(workdir), "JAX_DISABLE_MOST_OPTIMIZATIONS": "true"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(tasks)
    ]  # fmt: skip
    return port, procs


def _slurm_job(workdir: Path, overrides: dict, tasks: int) -> tuple[int, list[subprocess.Popen]]:
    """The sbatch script with ``srun`` running its command (exec: the task's pid is the trainer's)."""
    return _job("slurm", 'srun() { exec "$@"; }; . "$0" "$@"', LAUNCH / "slurm.sbatch", workdir, overrides, tasks=tasks)


def _skypilot_job(workdir: Path, overrides: dict, *extra: str, tasks: int) -> tuple[int, list[subprocess.Popen]]:
    """The task's ``run`` script, the flags appended to its command; a later ``--workdir`` replaces the bucket."""
    run = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())["run"].rstrip()
    return _job("skypilot", f'{run} "$@"', LAUNCH / "skypilot.yaml", workdir, overrides, f"--workdir={workdir}", *extra, tasks=tasks)


def _kill_during_a_save(procs: list[subprocess.Popen], checkpoints: Path, after: int) -> list[str]:
    """SIGKILLs process 1, then process 0, as soon as a save of a step >= ``after`` shows in ``checkpoints``;
    returns what that folder held at that moment."""
    while all(p.poll() is None for p in procs):
        entries = os.listdir(checkpoints) if checkpoints.is_dir() else []
        if any(int(e.split(".")[0]) >= after for e in entries if e.split(".")[0].isdigit()):
            for p in reversed(procs):
                p.send_signal(signal.SIGKILL)
            return entries
        time.sleep(0.002)
    outputs = [p.communicate()[1][-2000:] for p in procs]
    pytest.fail(f"the job ended (codes {[p.returncode for p in procs]}) before a save of step {after}: {outputs}")


def _config(overrides: dict):
    config = default.get_config()
    config.update_from_flattened_dict(overrides)
    config.mesh, config.devices = MESH, 2
    return config


def _logs(procs: list[subprocess.Popen], cluster: str, port: int) -> None:
    """Waits for the job; each process logged its start through ``cluster``."""
    for rank, p in enumerate(procs):
        log = p.communicate(timeout=600)[1]
        assert cluster_env.start_line(cluster, rank, len(procs), port) in log, log[-2000:]


@pytest.mark.devices(2)
def test_job_killed_mid_save_resumes_as_a_new_job_and_on_another_process_count_with_the_uninterrupted_losses(tmp_path):
    overrides = TINY | _shards(tmp_path)
    port, procs = _slurm_job(tmp_path / "run", overrides, tasks=4)  # data:4: one row of the batch per process
    # The job is watched from its start (a watch begun after the reference run found, on a loaded machine,
    # the job already past its last save before STOP); meanwhile, the uninterrupted reference on 2 devices here.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watch = pool.submit(_kill_during_a_save, procs, tmp_path / "run" / "checkpoints", after=4)
        trainer.run(_config(overrides), tmp_path / "straight")
        seen = watch.result()
    _logs(procs, "slurm", port)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 4
    committed = sorted(int(e) for e in os.listdir(tmp_path / "run" / "checkpoints") if e.isdigit())
    partial = sorted({int(e.split(".")[0]) for e in seen if not e.isdigit()} - set(committed))
    assert committed and committed[-1] < STOP and all(step > committed[-1] for step in partial), (seen, committed)

    port, procs = _skypilot_job(tmp_path / "run", overrides, f"--stop_after={STOP}", tasks=2)  # data:2 from data:4's checkpoint
    _logs(procs, "skypilot", port)
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2
    assert (tmp_path / "run" / "checkpoints" / str(STOP)).is_dir()

    summary = trainer.run(_config(overrides), tmp_path / "run")  # one process, two devices: the same mesh
    assert summary["resumed_from_step"] == STOP and summary["mesh"] == {"data": 2, "fsdp": 1}
    resumed, straight = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("run", "straight"))
    assert [r["step"] for r in resumed] == list(range(1, 9))  # process 0 alone wrote each job's steps
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-5)
    evaluated, expected = ([(r["step"], r["val_loss"]) for r in rows if "val_loss" in r] for rows in (resumed, straight))
    assert [s for s, _ in evaluated] == [s for s, _ in expected] == [4, 8]
    assert [v for _, v in evaluated] == pytest.approx([v for _, v in expected], rel=1e-5)
    print(f"killed with {seen} in checkpoints/ (a save in flight: {bool(partial)}); resumed from step {committed[-1]}")
