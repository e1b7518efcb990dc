"""One process of the multi-process cross-replica test: trains every cross-replica optimizer in turn.

    python tests/sharding/cross_replica_worker.py WORKDIR [--preempt]

The process joins its job from its environment (`sharding.multihost.resolve`; the test gives it Open MPI's) and
logs how (`sharding.multihost.Start.describe`).

Each optimizer with its own collectives (DiLoCo, DeMo, PowerSGD) trains a small model replica-locally on a
``data:2`` mesh (one replica per process of a 2-process job; the test runs the same configs on two
devices of its own process as the reference) with `experiments.trainer.run` into ``WORKDIR/<name>``,
XLA with most optimisations off (``jax_disable_most_optimizations``, as the reference). With
``--preempt`` the DiLoCo run first stops as if preempted after step 3 (checkpoint, return) and is
then resumed from that checkpoint: its synchronisations every 2 steps put the stop where the
replicas' parameters differ. (Every one of them resumes bit-exactly in
tests/experiments/test_replica_local.py; here they check their collectives across processes. Streaming
DiLoCo synchronises through DiLoCo's all-reduce, a fragment at a time, and is checked there only.) One
launch trains them all, so the job's start-up and distributed initialisation are paid once.
"""

import sys

import jax

from sharding import multihost

STOP_AT = 3
OPTIMIZERS = {
    "diloco": {"sync_every": 2},
    "demo": {"chunk": 16, "topk": 8},
    "powersgd": {"rank": 2},
}
PREEMPTED = ("diloco",)
SMALL_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "mlp_dim": 64}


def config_for(name: str):
    from experiments.configs import default

    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 8, 8, 32
    config.eval_every, config.eval_batches, config.log_every, config.checkpoint_every = 4, 2, 1, 100
    config.model.update(SMALL_MODEL)
    config.mesh, config.replicas = "data:2", "data"
    config.optimizer.name = name
    config.optimizer.warmup_steps = 2
    config.optimizer[name].update(OPTIMIZERS[name])
    return config


def main(argv: list[str]) -> None:
    preempt = "--preempt" in argv
    (workdir,) = [a for a in argv if a != "--preempt"]
    start = multihost.resolve()
    multihost.initialize(start)
    print(start.describe(), file=sys.stderr, flush=True)
    jax.config.update("jax_disable_most_optimizations", True)
    from experiments import trainer  # after jax.distributed starts

    for name in OPTIMIZERS:
        stops = preempt and name in PREEMPTED
        if stops:
            summary = trainer.run(config_for(name), f"{workdir}/{name}", interrupt_at=STOP_AT)
            assert summary.get("interrupted") and summary["steps"] == STOP_AT, summary
        summary = trainer.run(config_for(name), f"{workdir}/{name}")
        assert summary["resumed_from_step"] == (STOP_AT if stops else 0), summary


if __name__ == "__main__":
    main(sys.argv[1:])
