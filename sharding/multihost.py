"""Multi-process start-up through JAX's own runtime (`jax.distributed`), from what the cluster says.

Every process of a job runs the same command. `resolve` decides where the coordinator address, the
process count and this process's rank come from, first match wins:

1. explicit values: ``--coordinator``, ``--num_processes``, ``--process_id`` (or JAX's own
   ``JAX_COORDINATOR_ADDRESS``); all three given, nothing is detected;
2. the cluster detectors JAX ships (``jax._src.clusters``), which read the values themselves inside
   `jax.distributed.initialize`: Slurm (``srun`` sets ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
   ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``), Open MPI (``mpirun`` sets
   ``OMPI_MCA_orte_hnp_uri``, ``OMPI_COMM_WORLD_*``), Kubernetes Jobs and JobSets through the
   Kubernetes API (``KUBERNETES_SERVICE_HOST`` with ``pip install 'jax[k8s]'``), TPU pods on GKE
   (``TPU_WORKER_HOSTNAMES``). A TPU VM says nothing in its environment: ``--cluster=auto`` lets JAX
   ask its metadata server;
3. a JobSet's own variables where the Kubernetes API is not at hand: ``JOBSET_NAME``,
   ``REPLICATED_JOB_NAME``, ``JOB_INDEX``, ``JOB_COMPLETION_INDEX`` (the coordinator is pod 0 of job 0,
   ``<jobset>-<job>-0-0.<jobset>``, JobSet's DNS name; ``--num_processes`` gives the size);
4. SkyPilot's ``SKYPILOT_NODE_IPS`` (one per line; the first is the coordinator),
   ``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES``;
5. none of these, or a cluster of one process: nothing is started.

Explicit values win field by field; the detector fills the rest (as `jax.distributed.initialize`
does). The coordinator port, where a detector picks it, is ``JAX_COORDINATOR_PORT`` when set.

``local_device_ids`` (the GPUs this process drives) are explicit, or ``CUDA_VISIBLE_DEVICES`` split
evenly over the processes on this node (Slurm: ``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID``, or
``SLURM_NTASKS_PER_NODE``; Open MPI: ``OMPI_COMM_WORLD_LOCAL_SIZE``), all of them where Slurm bound
GPUs per task (``SLURM_GPUS_PER_TASK``). So one process per node drives all 8 GPUs, where JAX alone
would give each Slurm or MPI process the one GPU of its local rank. On CPU, cross-process collectives
go through gloo.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
from collections.abc import Mapping, Sequence

import jax

# JAX's port for coordinators it finds by name (Kubernetes); used for JobSet and SkyPilot too.
DEFAULT_PORT = 55527
# --cluster values besides "" (detect): JAX's detectors by name, our two, JAX's own detection, or one process.
CLUSTERS = (
    "slurm",
    "ompi",
    "k8s",
    "gketpu",
    "gcetpu",
    "mpi4py",
    "jobset",
    "skypilot",
    "auto",
    "none",
)
# JAX's detectors in the order `resolve` tries them: name -> variables that must all be set.
_JAX_DETECTORS = {
    "slurm": (
        "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
    ),
    "ompi": ("OMPI_MCA_orte_hnp_uri",),
    "k8s": ("KUBERNETES_SERVICE_HOST",),
    "gketpu": ("TPU_WORKER_HOSTNAMES",),
}
_JOBSET = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX")
_SKYPILOT = ("SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES")
# Sources whose values `resolve` reads itself (JAX ships no detector for them).
_OURS = ("jobset", "skypilot")
# Process counts a detector reads from the environment, to skip start-up for a job of one process.
_COUNTS = {
    "slurm": "SLURM_NTASKS",
    "ompi": "OMPI_COMM_WORLD_SIZE",
    "skypilot": "SKYPILOT_NUM_NODES",
}


@dataclasses.dataclass(frozen=True)
class Start:
    """How this process joins its job: ``source`` names where the values came from (``flags``, a
    detector's name, or ``none``: one process); None values are left for JAX's detector ``method``."""

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    method: str | None = None  # jax.distributed.initialize's cluster_detection_method

    @property
    def started(self) -> bool:
        return self.source != "none"

    def describe(self) -> str:
        """One line for the log, after `initialize` (reads the rank and sizes back from JAX)."""
        if not self.started:
            return "jax.distributed: not started (one process)"
        return (
            f"jax.distributed via {self.source}: process {jax.process_index()} of {jax.process_count()}, "
            f"coordinator {self.coordinator_address or _connected_coordinator()}, local devices "
            f"{list(self.local_device_ids) if self.local_device_ids is not None else 'by JAX'} "
            f"({jax.local_device_count()} here, {jax.device_count()} in all)"
        )


def _connected_coordinator() -> str:
    """The address JAX's own detector chose (Slurm's first node, Open MPI's launcher), read back after start-up."""
    from jax._src import distributed  # no public accessor

    return getattr(distributed.global_state, "coordinator_address", None) or "found by JAX"


def _present(names: Sequence[str], environ: Mapping[str, str]) -> bool:
    return all(name in environ for name in names)


def _port(environ: Mapping[str, str]) -> str:
    return environ.get("JAX_COORDINATOR_PORT", str(DEFAULT_PORT))


def _jobset(environ: Mapping[str, str], num_processes: int | None) -> dict:
    """Rank and coordinator of a JobSet pod: ``REPLICATED_JOB_REPLICAS`` jobs of ``num_processes / replicas`` pods."""
    if num_processes is None:
        raise ValueError(
            "a JobSet's environment does not say how many pods it has: pass --num_processes=N (parallelism x replicas)"
        )
    replicas = int(environ.get("REPLICATED_JOB_REPLICAS", "1"))
    if num_processes % replicas:
        raise ValueError(
            f"--num_processes={num_processes} is not a multiple of REPLICATED_JOB_REPLICAS={replicas}"
        )
    name, job = environ["JOBSET_NAME"], environ["REPLICATED_JOB_NAME"]
    return {
        "coordinator_address": f"{name}-{job}-0-0.{name}:{_port(environ)}",
        "process_id": int(environ["JOB_INDEX"]) * (num_processes // replicas)
        + int(environ["JOB_COMPLETION_INDEX"]),
    }


def _skypilot(environ: Mapping[str, str]) -> dict:
    return {
        "coordinator_address": f"{environ['SKYPILOT_NODE_IPS'].split()[0]}:{_port(environ)}",
        "num_processes": int(environ["SKYPILOT_NUM_NODES"]),
        "process_id": int(environ["SKYPILOT_NODE_RANK"]),
    }


def _slurm_tasks_here(environ: Mapping[str, str]) -> int:
    """Tasks on this node: ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``8(x2),4``) at ``SLURM_NODEID``."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get(
        "SLURM_TASKS_PER_NODE"
    )
    if spec and "SLURM_NODEID" in environ:
        counts = []
        for count, _, repeat in re.findall(r"(\d+)(\(x(\d+)\))?", spec):
            counts += [int(count)] * int(repeat or 1)
        return counts[int(environ["SLURM_NODEID"])]
    return int(environ.get("SLURM_NTASKS_PER_NODE", "1"))


def local_device_ids(source: str, environ: Mapping[str, str]) -> tuple[int, ...] | None:
    """This process's share of ``CUDA_VISIBLE_DEVICES`` (indices into it), or None to leave it to JAX."""
    visible = [
        d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()
    ]
    if not visible:
        return None
    if source == "slurm" and "SLURM_GPUS_PER_TASK" not in environ:
        here, rank = _slurm_tasks_here(environ), int(environ["SLURM_LOCALID"])
    elif source == "ompi":
        here, rank = (
            int(environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")),
            int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
        )
    else:
        here, rank = 1, 0
    if len(visible) % here:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs for {here} processes on this node; "
            "pass --local_device_ids, or start one process per node or per GPU"
        )
    share = len(visible) // here
    return tuple(range(rank * share, (rank + 1) * share))


def _detect(cluster: str, environ: Mapping[str, str]) -> str:
    """The source to use: ``cluster`` when named, else the first present in the module docstring's order."""
    if cluster:
        return cluster
    for name, variables in _JAX_DETECTORS.items():
        usable = name != "k8s" or importlib.util.find_spec("kubernetes")  # as JAX's own check
        if usable and _present(variables, environ):
            return name
    for name, variables in (("jobset", _JOBSET), ("skypilot", _SKYPILOT)):
        if _present(variables, environ):
            return name
    return "none"


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    device_ids: Sequence[int] | None = None,
    *,
    cluster: str = "",
    environ: Mapping[str, str] | None = None,
) -> Start:
    """Where this process's place in the job comes from; see the module docstring.

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes, process_id: this job's size and this process's rank.
      device_ids: the local devices this process drives (default: see `local_device_ids`).
      cluster: "" detects; one of `CLUSTERS` forces that source ("auto": JAX's own detection, "none": one process).
      environ: the environment (default ``os.environ``).

    Raises:
      ValueError: an unknown ``cluster``, a rank outside the job, or values that do not make a job.
    """
    environ = os.environ if environ is None else environ
    if cluster and cluster not in CLUSTERS:
        raise ValueError(
            f"--cluster={cluster} is not one of {', '.join(CLUSTERS)} (or empty to detect)"
        )
    coordinator_address = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS")
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    ids = tuple(device_ids) if device_ids else None
    if num_processes is not None and not 0 <= (process_id or 0) < num_processes:
        raise ValueError(
            f"--process_id={process_id} must lie in [0, --num_processes={num_processes})"
        )
    if cluster != "none" and all(v is not None for v in explicit.values()):
        return Start(
            "flags",
            coordinator_address,
            num_processes,
            process_id,
            ids,
            method="deactivate",
        )
    source = _detect(cluster, environ)
    if source == "none" or (
        source in _COUNTS
        and int(environ.get(_COUNTS[source], "2")) == 1
        and num_processes is None
    ):
        if any(v is not None for v in explicit.values()) and cluster != "none":
            given = [f"--{k}" for k, v in explicit.items() if v is not None]
            raise ValueError(
                f"{', '.join(given)} given, but not all of --coordinator_address, --num_processes and --process_id, "
                "and no cluster was detected to fill in the rest (or pass --cluster=auto on a TPU VM)"
            )
        return Start("none")
    detected = {
        "jobset": lambda: _jobset(environ, num_processes),
        "skypilot": lambda: _skypilot(environ),
    }.get(source, dict)()
    values = {k: v if v is not None else detected.get(k) for k, v in explicit.items()}
    if ids is None and source not in ("auto", "gketpu", "gcetpu"):  # JAX never restricts TPU devices
        ids = local_device_ids(source, environ)
    if source in _OURS:
        if None in values.values():
            raise ValueError(
                f"the {source} environment leaves {[k for k, v in values.items() if v is None]} unset"
            )
        method = "deactivate"
    else:
        method = None if source in ("auto", "k8s") else source  # JAX's Kubernetes detector has no name
    return Start(
        source,
        values["coordinator_address"],
        values["num_processes"],
        values["process_id"],
        ids,
        method,
    )


def _timeouts(
    initialization_timeout: int | None, heartbeat_timeout: int | None
) -> dict:
    """The timeout arguments this JAX's `jax.distributed.initialize` takes; one it lacks is an error."""
    accepted = inspect.signature(jax.distributed.initialize).parameters
    wanted = {
        "initialization_timeout": initialization_timeout,
        "heartbeat_timeout_seconds": heartbeat_timeout,
    }
    missing = [k for k, v in wanted.items() if v is not None and k not in accepted]
    if missing:
        raise ValueError(
            f"jax {jax.__version__}'s jax.distributed.initialize takes no {missing[0]}; drop that flag"
        )
    return {k: v for k, v in wanted.items() if v is not None}


def initialize(
    start: Start,
    *,
    initialization_timeout: int | None = None,
    heartbeat_timeout: int | None = None,
) -> bool:
    """Starts `jax.distributed` as ``start`` says (nothing for ``none``); returns whether it was started.

    ``initialization_timeout``: seconds to wait for every process to connect (JAX's default 300);
    ``heartbeat_timeout``: seconds of silence after which a process counts as lost (JAX's default 100).
    """
    kwargs = _timeouts(initialization_timeout, heartbeat_timeout)
    if not start.started:
        return False
    jax.config.update(
        "jax_cpu_collectives_implementation", "gloo"
    )  # affects only the CPU backend
    jax.distributed.initialize(
        start.coordinator_address, num_processes=start.num_processes, process_id=start.process_id,
        local_device_ids=list(start.local_device_ids) if start.local_device_ids is not None else None,
        cluster_detection_method=start.method, **kwargs,
    )  # fmt: skip
    return True
