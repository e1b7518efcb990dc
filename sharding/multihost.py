"""Multi-process start-up through JAX's own runtime (`jax.distributed`).

Every process of a job runs the same command. On TPU VMs, and under SLURM or Open MPI, JAX detects
the coordinator, process count and process id by itself (``auto=True``); elsewhere pass them
explicitly. On CPU, cross-process collectives go through gloo.
"""

from __future__ import annotations

import jax


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Starts `jax.distributed` when asked to; returns whether it was started.

    Args:
      coordinator_address: ``host:port`` of process 0.
      num_processes, process_id: this job's size and this process's rank.
      auto: let JAX detect all three (TPU VM, SLURM, Open MPI).

    Raises:
      ValueError: only some of the explicit values were given.
    """
    explicit = (coordinator_address, num_processes, process_id)
    if not auto and all(v is None for v in explicit):
        return False
    if not auto and any(v is None for v in explicit):
        raise ValueError(
            "multi-process runs need all of --coordinator_address, --num_processes and --process_id "
            "(or --distributed_auto on TPU VMs and SLURM)"
        )
    if num_processes is not None and not 0 <= (process_id or 0) < num_processes:
        raise ValueError(f"--process_id={process_id} must lie in [0, --num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # affects only the CPU backend
    if auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)
    return True
