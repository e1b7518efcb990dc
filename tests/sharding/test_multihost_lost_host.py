"""A lost host: a 2-process job started by the Slurm recipe (experiments/launch/slurm.sbatch, run with the
environment ``srun`` sets and the CPU stand-in for GPUs) is SIGKILLed in the middle of an asynchronous
checkpoint save, and resumed by one process: its losses equal an uninterrupted run's, step for step."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "experiments" / "launch" / "slurm.sbatch"
# The recipe's llama-1b cut to a model that compiles in seconds; saves at steps 2, 4, 6, 8.
TINY = {
    "model.preset": "tiny", "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1,
    "model.head_dim": 16, "model.mlp_dim": 64, "model.dtype": "float32", "model.remat": "none",
    "steps": 8, "batch_size": 4, "data.seq_len": 16, "eval_every": 100, "eval_batches": 1, "log_every": 1,
    "checkpoint_every": 2, "optimizer.warmup_steps": 1,
}  # fmt: skip
MESH = "data:2,fsdp:-1"  # the recipe's data:$SLURM_NNODES,fsdp:-1 on 2 nodes of one device each


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _srun(workdir: Path, rank: int, port: int) -> subprocess.Popen:
    """Task ``rank`` of 2, one per node, as ``srun`` starts it: the sbatch script with ``srun`` running its command."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_VISIBLE"))},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "true", "WORKDIR": str(workdir), "JAX_COORDINATOR_PORT": str(port),
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0",
    }  # fmt: skip
    overrides = [f"--config.{k}={v}" for k, v in TINY.items()]
    script = 'srun() { exec "$@"; }; . "$0" "$@"'  # exec: the task's pid is the trainer's
    return subprocess.Popen(["bash", "-c", script, str(SBATCH), *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def _config():
    config = default.get_config()
    for key, value in TINY.items():
        *path, last = key.split(".")
        (config[path[0]] if path else config)[last] = value
    config.mesh, config.devices = MESH, 2
    return config


@pytest.mark.devices(2)
def test_job_killed_mid_save_resumes_on_another_process_count_with_the_uninterrupted_losses(tmp_path):
    port = _free_port()
    procs = [_srun(tmp_path / "run", rank, port) for rank in range(2)]
    trainer.run(_config(), tmp_path / "straight")  # meanwhile, the uninterrupted reference on 2 devices of this process
    seen = _kill_during_a_save(procs, tmp_path / "run" / "checkpoints", after=4)
    logs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    for rank, log in enumerate(logs):
        assert f"jax.distributed via slurm: process {rank} of 2" in log, log[-2000:]
    committed = sorted(int(e) for e in os.listdir(tmp_path / "run" / "checkpoints") if e.isdigit())
    partial = sorted({int(e.split(".")[0]) for e in seen if not e.isdigit()} - set(committed))
    assert committed and all(step > committed[-1] for step in partial), (seen, committed)

    summary = trainer.run(_config(), tmp_path / "run")  # one process, two devices: the same mesh
    assert summary["resumed_from_step"] == committed[-1] and summary["mesh"] == {"data": 2, "fsdp": 1}
    resumed, straight = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("run", "straight"))
    assert [r["step"] for r in resumed] == list(range(1, 9))  # process 0 alone wrote the steps before the kill
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-5)
    print(f"killed with {seen} in checkpoints/ (a save in flight: {bool(partial)}); resumed from step {committed[-1]}")
