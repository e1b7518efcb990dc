"""Where a process's place in a multi-process job comes from (`sharding.multihost.resolve`), for each cluster's
environment, and the launch recipes in experiments/launch/ (their flags, config keys and ranks). The 2-process
run through the Slurm recipe is in test_multihost_lost_host.py."""

import inspect
import re
import shlex
from pathlib import Path

import jax
import pytest
import yaml

from experiments.configs import default
from sharding import multihost

LAUNCH = Path(__file__).resolve().parents[2] / "experiments" / "launch"


def _slurm(rank, tasks=4, per_node=1, **extra):
    """What ``srun`` sets for task ``rank`` of ``tasks``, ``per_node`` tasks on each node."""
    return {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-006]", "SLURM_NTASKS": str(tasks), "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{tasks // per_node})", **extra,
    }  # fmt: skip


def _ompi(rank, tasks=4, per_node=2):
    return {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1,10.148.0.1:34911", "OMPI_COMM_WORLD_SIZE": str(tasks),
        "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_node),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
    }  # fmt: skip


def _jobset(rank):
    """A JobSet pod's variables, in a pod (KUBERNETES_SERVICE_HOST) without the ``kubernetes`` package."""
    return {
        "JOBSET_NAME": "spmdlab",
        "REPLICATED_JOB_NAME": "workers",
        "JOB_INDEX": "0",
        "JOB_COMPLETION_INDEX": str(rank),
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    }


def _skypilot(rank, nodes=4):
    ips = "\n".join(f"10.1.0.{i + 7}" for i in range(nodes))
    return {
        "SKYPILOT_NODE_IPS": ips,
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    }


def test_each_cluster_environment_picks_its_source_and_gives_every_process_its_rank():
    eight = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    # JAX's own detectors read the values inside jax.distributed.initialize: only the source and the GPUs are ours.
    for rank in range(4):
        start = multihost.resolve(environ=_slurm(rank) | eight)
        assert (
            start.source,
            start.method,
            start.coordinator_address,
            start.process_id,
        ) == ("slurm", "slurm", None, None)
        assert start.local_device_ids == tuple(
            range(8)
        )  # one task per node drives the node's 8 GPUs
        start = multihost.resolve(environ=_ompi(rank) | eight)
        assert (start.source, start.method) == ("ompi", "ompi")
        assert start.local_device_ids == tuple(
            range(4 * (rank % 2), 4 * (rank % 2) + 4)
        )  # 2 processes per node
    ours = {
        "jobset": (
            lambda r: _jobset(r),
            {"num_processes": 4},
            "spmdlab-workers-0-0.spmdlab:55527",
        ),
        "skypilot": (lambda r: _skypilot(r), {}, "10.1.0.7:55527"),
    }
    for source, (env, flags, coordinator) in ours.items():
        starts = [multihost.resolve(**flags, environ=env(r)) for r in range(4)]
        assert {
            (s.source, s.method, s.coordinator_address, s.num_processes) for s in starts
        } == {(source, "deactivate", coordinator, 4)}
        assert [s.process_id for s in starts] == [0, 1, 2, 3]
    assert (
        multihost.resolve(cluster="k8s", environ={}).method is None
    )  # JAX's Kubernetes detector has no name
    assert multihost.resolve(environ={"TPU_WORKER_HOSTNAMES": "a,b"}).source == "gketpu"
    assert multihost.resolve(cluster="auto", environ={}).method is None


def test_explicit_values_win_and_jobs_of_one_process_start_nothing():
    flags = {"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 1}
    start = multihost.resolve(**flags, environ=_slurm(3))
    assert (start.source, start.method, start.process_id) == ("flags", "deactivate", 1)
    assert (
        multihost.resolve(
            environ={"JAX_COORDINATOR_ADDRESS": "h:1", **_jobset(2)}, num_processes=4
        ).coordinator_address
        == "h:1"
    )
    assert (
        multihost.resolve(
            environ=_slurm(0) | {"JAX_COORDINATOR_PORT": "999"}, process_id=0
        ).process_id
        == 0
    )
    assert not multihost.resolve(environ={}).started
    assert not multihost.resolve(environ=_slurm(0, tasks=1)).started
    assert not multihost.resolve(cluster="none", environ=_slurm(1)).started
    assert (
        multihost.resolve(
            environ=_skypilot(1) | {"JAX_COORDINATOR_PORT": "8476"}
        ).coordinator_address
        == "10.1.0.7:8476"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"coordinator_address": "h:1"}, "no cluster was detected"),
        (
            {"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"},
            "must lie in",
        ),
        ({"cluster": "slurmm"}, "is not one of"),
        ({"environ": _jobset(1)}, "--num_processes=N"),
        (
            {
                "environ": _slurm(0, per_node=1)
                | {
                    "CUDA_VISIBLE_DEVICES": "0,1,2",
                    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
                }
            },
            "3 GPUs for 2 processes",
        ),
    ],
)
def test_bad_start_up_names_the_fix(kwargs, message):
    kwargs.setdefault("environ", {})
    with pytest.raises(ValueError, match=re.escape(message)):
        multihost.resolve(**kwargs)


def test_slurm_gpu_binding_and_explicit_device_ids():
    bound = _slurm(
        5, tasks=16, per_node=8, SLURM_GPUS_PER_TASK="1", CUDA_VISIBLE_DEVICES="5"
    )
    assert multihost.resolve(environ=bound).local_device_ids == (
        0,
    )  # srun bound one GPU per task already
    shared = _slurm(5, tasks=16, per_node=8, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert multihost.resolve(environ=shared).local_device_ids == (5,)
    assert multihost.resolve(device_ids=[2, 3], environ=shared).local_device_ids == (
        2,
        3,
    )
    assert (
        multihost.resolve(environ=_slurm(1)).local_device_ids is None
    )  # no GPUs listed: JAX decides


def test_timeouts_pass_only_where_this_jax_takes_them():
    accepted = inspect.signature(jax.distributed.initialize).parameters
    assert multihost._timeouts(60, None) == {"initialization_timeout": 60}
    if "heartbeat_timeout_seconds" in accepted:
        assert multihost._timeouts(None, 30) == {"heartbeat_timeout_seconds": 30}
    assert not multihost.initialize(multihost.Start("none"), initialization_timeout=5)


# --- the launch recipes in experiments/launch/ -------------------------------------------------------------


def _command(text: str) -> list[str]:
    """The ``python -m experiments.train ...`` arguments of a shell text (continuations joined)."""
    line = next(
        line
        for line in text.replace("\\\n", " ").splitlines()
        if "-m experiments.train" in line
    )
    command = line[line.index("python") :].replace('"$@"', "").strip()
    words = shlex.split(
        command.rstrip('"') if command.count('"') % 2 else command
    )  # the end of gcloud's --command="..."
    return words[words.index("experiments.train") + 1 :]


def _recipes() -> dict[str, tuple[list[str], dict]]:
    """Each recipe's trainer arguments and the job shape it asks for."""
    sbatch = (LAUNCH / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", sbatch))
    jobset = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
    job = jobset["spec"]["replicatedJobs"][0]
    container = job["template"]["spec"]["template"]["spec"]["containers"][0]
    sky = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    return {
        "slurm": (_command(sbatch), {"nodes": int(directives["nodes"]), "gpus": int(directives["gpus-per-node"])}),
        "jobset": (container["command"][3:], {"nodes": job["template"]["spec"]["parallelism"] * job["replicas"], "gpus": container["resources"]["limits"]["nvidia.com/gpu"]}),
        "skypilot": (_command(sky["run"]), {"nodes": sky["num_nodes"], "gpus": int(sky["resources"]["accelerators"].split(":")[1])}),
        "tpu_vm": (_command((LAUNCH / "tpu_vm.sh").read_text()), {"nodes": None, "gpus": None}),
    }  # fmt: skip


def _environ(name: str, rank: int, shape: dict) -> dict:
    nodes, gpus = shape["nodes"], shape["gpus"]
    cuda = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))} if gpus else {}
    return {
        "slurm": lambda: (
            _slurm(rank, tasks=nodes) | {"SLURM_NNODES": str(nodes)} | cuda
        ),
        "jobset": lambda: _jobset(rank) | cuda,
        "skypilot": lambda: _skypilot(rank, nodes=nodes) | cuda,
        "tpu_vm": dict,
    }[name]()


def test_launch_recipes_set_known_flags_and_config_keys_and_give_each_process_its_rank():
    config = default.get_config()
    cluster_flags = {
        "num_processes",
        "cluster",
        "initialization_timeout",
        "heartbeat_timeout",
        "workdir",
    }
    for name, (args, shape) in _recipes().items():
        flags = dict(
            arg[2:].partition("=")[::2] for arg in args if arg.startswith("--")
        )
        for key in [k for k in flags if k.startswith("config.")]:
            node = config
            for part in key.split(".")[1:]:
                assert part in node, f"{name}: --{key} is no config key"
                node = node[part]
        assert (
            set(flags) - {k for k in flags if k.startswith("config.")} <= cluster_flags
        ), name
        environs = [_environ(name, r, shape) for r in range(shape["nodes"] or 1)]
        starts = [
            multihost.resolve(num_processes=int(flags["num_processes"]) if "num_processes" in flags else None, cluster=flags.get("cluster", ""), environ=env)
            for env in environs
        ]  # fmt: skip
        if name == "tpu_vm":
            assert (
                starts[0].source == "auto" and starts[0].method is None
            )  # JAX asks the TPU metadata server
            continue
        assert {s.source for s in starts} == {name}
        assert {s.local_device_ids for s in starts} == {
            tuple(range(shape["gpus"]))
        }  # each process drives its node's GPUs
        if name != "slurm":  # Slurm's ranks are JAX's to read
            assert [s.process_id for s in starts] == list(range(shape["nodes"]))
            assert len({s.coordinator_address for s in starts}) == 1
