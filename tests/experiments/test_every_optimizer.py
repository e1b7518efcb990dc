"""Every registered optimizer trains the LM end to end through the registry, on an FSDP mesh."""

import math

import pytest

from experiments import train
from experiments.configs import default
from optim import registry


@pytest.mark.parametrize("name", sorted(registry.OPTIMIZERS))
def test_registered_optimizer_trains_tiny_lm_on_fsdp(name, tmp_path):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 6, 8, 16
    config.eval_every, config.eval_batches, config.log_every = 6, 1, 1
    config.model.n_layers = 1
    config.mesh = "fsdp:8"
    config.optimizer.name = name
    config.optimizer.warmup_steps = 0
    config.optimizer.learning_rate = 0.1 if name == "sgd" else 3e-3
    summary = train.run(config, tmp_path)
    assert summary["skipped_steps"] == 0
    assert math.isfinite(summary["final_val_loss"])
    assert summary["final_train_loss"] < math.log(320)  # below the uniform guess: it learned something
