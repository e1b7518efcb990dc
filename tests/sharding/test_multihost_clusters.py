"""Real processes started with the environment each cluster sets: 4 Slurm tasks and 2 JobSet pods (2 Open MPI
ranks train the cross-replica optimizers in test_multihost_and_resharding.py, 2 SkyPilot nodes resume the
lost job in test_multihost_lost_host.py). Every process of a job must find the same coordinator, its own
rank, the same global mesh, and the losses of the same steps run by one process on 4 devices
(`cluster_worker.py`). Both jobs run at once; a worker imports the train step only, not the trainer."""

import json
import subprocess
import sys
from pathlib import Path

import cluster_env
import cluster_worker
import jax
import pytest

WORKER = Path(__file__).with_name("cluster_worker.py")
JOBS = {"slurm": 4, "jobset": 2}  # processes


def _launch(cluster: str) -> tuple[int, list[subprocess.Popen]]:
    tasks, port = JOBS[cluster], cluster_env.free_port()
    args = [str(tasks)] if cluster == "jobset" else []  # a JobSet's size is --num_processes
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args], env=cluster_env.environ(cluster, rank, tasks, port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(tasks)
    ]  # fmt: skip
    return port, procs


@pytest.mark.devices(4)
def test_each_cluster_environment_starts_a_job_whose_processes_agree_with_one_process():
    launched = {cluster: _launch(cluster) for cluster in JOBS}
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # as the workers compile
    try:
        reference, _ = cluster_worker.losses(cluster_worker.config(devices=4))
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        outputs = {cluster: [p.communicate(timeout=600) for p in procs] for cluster, (_, procs) in launched.items()}
    for cluster, (port, procs) in launched.items():
        tasks, coordinator = JOBS[cluster], cluster_env.COORDINATOR[cluster].format(port=port)
        assert [p.returncode for p in procs] == [0] * tasks, (cluster, [err[-2000:] for _, err in outputs[cluster]])
        reports = [json.loads(out.splitlines()[-1]) for out, _ in outputs[cluster]]
        assert [r["process_index"] for r in reports] == list(range(tasks)), cluster
        assert {(r["source"], r["process_count"], r["coordinator"]) for r in reports} == {(cluster, tasks, coordinator)}
        assert all(r["mesh"] == {"data": tasks} and r["devices"] == reports[0]["devices"] for r in reports), cluster
        assert sorted(process for _, process in reports[0]["devices"]) == list(range(tasks)), cluster
        for r in reports:  # the same global batch on 2 or 4 devices: equal up to the order of the batch mean
            assert r["losses"] == pytest.approx(reference, rel=1e-5), cluster
