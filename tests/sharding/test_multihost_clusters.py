"""Real processes started with the environment each cluster sets: a 4-process job whose ranks start from a JobSet's
(rank 0, the coordinator), Open MPI's, Slurm's and SkyPilot's variables, one each, and a 2-process job of a Slurm task
(the coordinator) and a JobSet pod. So each path runs in a 4-process and a 2-process job (4 Slurm tasks run the lost
job in test_multihost_lost_host.py, which also resumes it on 2 SkyPilot nodes; 2 Open MPI ranks train the
cross-replica optimizers in test_multihost_and_resharding.py). Every
process of a job must find the same coordinator, its own rank, the same global mesh, and the losses of the same
steps run by one process on 4 devices (`cluster_worker.py`). The jobs run at once; a worker imports the train
step only, not the trainer."""

import json
import subprocess
import sys
from pathlib import Path

import cluster_env
import cluster_worker
import jax
import pytest

WORKER = Path(__file__).with_name("cluster_worker.py")
# The cluster each process of a job starts from, by rank.
JOBS = {
    "mixed": ["jobset", "ompi", "slurm", "skypilot"],
    "mixed-2": ["slurm", "jobset"],
}  # fmt: skip


def _launch(job: str) -> tuple[int, list[subprocess.Popen]]:
    clusters, port = JOBS[job], cluster_env.free_port()
    tasks = len(clusters)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *([str(tasks)] if cluster == "jobset" else [])],  # a JobSet's size is --num_processes
            env=cluster_env.environ(cluster, rank, tasks, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank, cluster in enumerate(clusters)
    ]  # fmt: skip
    return port, procs


@pytest.mark.devices(4)
def test_each_cluster_environment_starts_a_job_whose_processes_agree_with_one_process():
    launched = {job: _launch(job) for job in JOBS}
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)  # as the workers compile
    try:
        reference, _ = cluster_worker.losses(cluster_worker.config(devices=4))
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        outputs = {job: [p.communicate(timeout=600) for p in procs] for job, (_, procs) in launched.items()}
    for job, (port, procs) in launched.items():
        clusters = JOBS[job]
        tasks = len(clusters)
        assert [p.returncode for p in procs] == [0] * tasks, (job, [err[-2000:] for _, err in outputs[job]])
        reports = [json.loads(out.splitlines()[-1]) for out, _ in outputs[job]]
        assert [r["process_index"] for r in reports] == list(range(tasks)), job
        assert [(r["source"], r["process_count"], r["coordinator"]) for r in reports] == [
            (cluster, tasks, cluster_env.COORDINATOR[cluster].format(port=port)) for cluster in clusters
        ], job
        assert all(r["mesh"] == {"data": tasks} and r["devices"] == reports[0]["devices"] for r in reports), job
        assert sorted(process for _, process in reports[0]["devices"]) == list(range(tasks)), job
        for r in reports:  # the same global batch on 2 or 4 devices: equal up to the order of the batch mean
            assert r["losses"] == pytest.approx(reference, rel=1e-5), job
