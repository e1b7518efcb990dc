"""The environment each cluster gives a process of a job on this host (one CPU device per process), for the
tests that start real processes: what ``srun``, ``mpirun``, a JobSet and SkyPilot set, with the coordinator
on 127.0.0.1 and a free port."""

import os
import random
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# JAX's Slurm and Open MPI detectors derive the coordinator's port from the job id, in this range.
PORT_BASE, PORT_SPAN = 65536 - 2**12, 2**12
_CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "JOBSET_", "JOB_", "REPLICATED_JOB", "SKYPILOT_", "CUDA_VISIBLE", "JAX_COORDINATOR")


def free_port() -> int:
    """A free port in JAX's detector range, so a job id can name it."""
    while True:
        port = PORT_BASE + random.randrange(PORT_SPAN)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def base() -> dict:
    """This process's environment without any cluster's variables, running the repository's code on CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CLUSTER_VARIABLES)}
    return env | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def slurm(rank: int, tasks: int, port: int) -> dict:
    """``srun`` task ``rank`` of ``tasks``, one per node, node 0 this host; JAX's detector takes the port from the job id."""
    nodes = "localhost" + (f",node[002-{tasks:03d}]" if tasks > 2 else ",node002")
    return {
        "SLURM_JOB_ID": str(3 * PORT_SPAN + port - PORT_BASE), "SLURM_STEP_NODELIST": nodes, "SLURM_NTASKS": str(tasks),
        "SLURM_NNODES": str(tasks), "SLURM_STEP_TASKS_PER_NODE": f"1(x{tasks})", "SLURM_PROCID": str(rank),
        "SLURM_NODEID": str(rank), "SLURM_LOCALID": "0",
    }  # fmt: skip


def ompi(rank: int, tasks: int, port: int) -> dict:
    """``mpirun -np TASKS --npernode 1`` rank ``rank``; the launcher's URI names this host, its job id the port."""
    return {
        "OMPI_MCA_orte_hnp_uri": f"{(port - PORT_BASE) * 2**12}.0;tcp://127.0.0.1,10.148.0.1:34911",
        "OMPI_COMM_WORLD_SIZE": str(tasks), "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    }  # fmt: skip


def jobset(rank: int, tasks: int, port: int) -> dict:
    """Pod 0 of replicated job ``rank`` (``tasks`` jobs of 1 pod). JobSet's DNS name of pod 0 does not resolve off
    a cluster, so the address is given as ``JAX_COORDINATOR_ADDRESS``; the rank comes from the job's index."""
    return {
        "JOBSET_NAME": "spmdlab", "REPLICATED_JOB_NAME": "workers", "REPLICATED_JOB_REPLICAS": str(tasks),
        "JOB_INDEX": str(rank), "JOB_COMPLETION_INDEX": "0", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    }  # fmt: skip


def skypilot(rank: int, tasks: int, port: int) -> dict:
    """Node ``rank`` of a ``tasks``-node SkyPilot cluster whose first node is this host."""
    ips = "\n".join(["127.0.0.1", *(f"10.1.0.{i + 8}" for i in range(tasks - 1))])
    return {
        "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(tasks),
        "JAX_COORDINATOR_PORT": str(port),
    }  # fmt: skip


# Where every process must find the coordinator: JAX's detectors name the node or launcher, ours the first IP.
COORDINATOR = {"slurm": "localhost:{port}", "ompi": "127.0.0.1:{port}", "jobset": "127.0.0.1:{port}", "skypilot": "127.0.0.1:{port}"}
ENVIRONMENTS = {"slurm": slurm, "ompi": ompi, "jobset": jobset, "skypilot": skypilot}


def environ(cluster: str, rank: int, tasks: int, port: int) -> dict:
    """The whole environment of process ``rank`` of ``tasks`` started by ``cluster``."""
    return base() | ENVIRONMENTS[cluster](rank, tasks, port)


def start_line(cluster: str, rank: int, tasks: int, port: int) -> str:
    """The start of the line `sharding.multihost.Start.describe` logs in that process."""
    return f"jax.distributed via {cluster}: process {rank} of {tasks}, coordinator {COORDINATOR[cluster].format(port=port)}"
