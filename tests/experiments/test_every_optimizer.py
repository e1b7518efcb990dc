"""Every registered optimizer trains the LM end to end through the registry, on an FSDP mesh.

Optimizers built for replicas (`optim.registry.CROSS_REPLICA`: DeMo, DiLoCo, PowerSGD) train on
replicas in tests/experiments/test_replica_local.py instead.
"""

import math

import pytest

from experiments import train
from experiments.configs import default
from optim import registry


@pytest.mark.parametrize("name", sorted(set(registry.OPTIMIZERS) - registry.CROSS_REPLICA))
def test_registered_optimizer_trains_tiny_lm_on_fsdp(name, tmp_path):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 6, 8, 16
    config.eval_every, config.eval_batches, config.log_every = 6, 1, 1
    config.model.n_layers = 1
    config.mesh = "fsdp:8"
    config.optimizer.name = name
    config.optimizer.warmup_steps = 0
    config.optimizer.learning_rate = {"sgd": 0.1, "lopt": 1.0}.get(name, 3e-3)  # lopt's is a multiplier of its learned step
    summary = train.run(config, tmp_path)
    assert summary["skipped_steps"] == 0
    assert math.isfinite(summary["final_val_loss"])
    assert summary["final_train_loss"] < math.log(320)  # below the uniform guess: it learned something


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_block_statistics_are_spread_over_devices_in_training(name):
    import jax

    from experiments import train_lib
    from optim import blocking
    from sharding import partition

    config = default.get_config()
    config.mesh = "fsdp:8"
    config.optimizer.name = name
    spec = train.build_run(config)
    with jax.set_mesh(spec.mesh):
        state = train_lib.init_state(spec.model_def, spec.tx, 0, spec.shardings)
    is_stack = lambda x: isinstance(x, blocking.BlockStacks)  # noqa: E731
    nodes = [n for n in jax.tree.leaves(state["opt_state"], is_leaf=is_stack) if is_stack(n)]
    stacks = [leaf for node in nodes for leaf in jax.tree.leaves(dict(node))]
    assert stacks, "no stacked blocks found"
    for leaf in stacks:
        assert partition.per_device_bytes([leaf]) * 8 == leaf.size * leaf.dtype.itemsize
