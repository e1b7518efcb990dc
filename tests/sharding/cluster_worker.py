"""One process of a multi-process job started with a cluster's environment (test_multihost_clusters.py).

    python tests/sharding/cluster_worker.py [NUM_PROCESSES]

Joins the job as `sharding.multihost.resolve` reads this process's environment (Slurm's, Open MPI's, a
JobSet's, ...; ``NUM_PROCESSES`` stands for ``--num_processes``, which a JobSet needs), then prints one
JSON line: where the values came from, the rank, the coordinator JAX connected to, the global mesh
(device ids and their processes) and the losses of `STEPS` training steps of a tiny model on a
``data`` mesh over every device of the job. The step is the trainer's (`experiments.train_lib`) and the
batches are fixed arrays, so the worker imports neither the trainer nor its data pipeline; `losses`
also gives the one-process reference.
"""

import json
import sys

import jax
import numpy as np

from sharding import multihost

STEPS = 3
# A model that compiles in seconds; the batch splits over 2 or 4 processes.
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "mlp_dim": 64, "dtype": "float32", "remat": "none"}  # fmt: skip


def config(devices: int = 0):
    """The default job cut to `TINY` on mesh ``data:-1``; ``devices`` > 0: that many devices of one process."""
    from experiments.configs import default

    c = default.get_config()
    c.model.update(TINY)
    c.steps, c.batch_size, c.data.seq_len = STEPS, 8, 16
    c.optimizer.warmup_steps = 1
    c.mesh, c.devices = "data:-1", devices
    return c


def losses(c) -> tuple[list[float], jax.sharding.Mesh]:
    """The losses of ``c.steps`` train steps on fixed random batches, and the mesh they ran on."""
    from experiments import run_spec, train_lib
    from optim import build

    spec = run_spec.build_run(c)
    step = train_lib.jit_train_step(
        train_lib.make_train_step(spec.model_def, spec.tx, learning_rate=build.learning_rate_fn(c.optimizer, c.steps)),
        spec.shardings,
    )
    state = train_lib.init_state(spec.model_def, spec.tx, c.seed, spec.shardings)
    shape = (c.batch_size, c.data.seq_len + 1)
    out = []
    for i in range(c.steps):
        tokens = np.random.default_rng(i).integers(0, spec.cfg.vocab_size, shape, dtype=np.int32)
        batch = jax.make_array_from_callback(shape, spec.shardings.batch, lambda index: tokens[index])  # noqa: B023
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out, spec.mesh


def main(argv: list[str]) -> None:
    start = multihost.resolve(num_processes=int(argv[0]) if argv else None)
    multihost.initialize(start)
    jax.config.update("jax_disable_most_optimizations", True)  # as the reference in the test
    # The address JAX itself connected to (where its own detector chose it, too).
    from jax._src import distributed

    values, mesh = losses(config())
    report = {
        "source": start.source,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "coordinator": distributed.global_state.coordinator_address,
        "mesh": dict(mesh.shape),
        "devices": [[d.id, d.process_index] for d in mesh.devices.flat],
        "losses": values,
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
