"""The replica-local step across two processes (one replica each) matches one process with two devices."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.metrics_io import read_metrics

REPO = Path(__file__).resolve().parents[2]
ARGS = (
    "--config.steps=4", "--config.batch_size=4", "--config.data.seq_len=16", "--config.eval_every=4",
    "--config.eval_batches=1", "--config.log_every=1", "--config.optimizer.warmup_steps=0", "--config.model.n_layers=1",
    "--config.mesh=data:2", "--config.replicas=data", "--config.optimizer.name=diloco",
    "--config.optimizer.diloco.sync_every=2",
)  # fmt: skip


def _launch(workdir, *extra, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    args = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *ARGS, *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_diloco_on_two_processes_matches_one_process_with_two_devices(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        _launch(tmp_path / "multi", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}")
        for i in range(2)
    ]
    procs.append(_launch(tmp_path / "single", env_extra={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in results]
    multi, single = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("multi", "single"))
    assert [r["step"] for r in multi] == [1, 2, 3, 4]
    assert [r["loss"] for r in multi] == pytest.approx([r["loss"] for r in single], rel=1e-5)
    assert multi[-1]["val_loss"] == pytest.approx(single[-1]["val_loss"], rel=1e-5)
