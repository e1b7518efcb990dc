"""The reduced comparison of ``--quick``: `tiny`, 80 steps, two learning rates per optimizer, two seeds.

    python -m experiments.compare_optimizers --quick --workdir=runs/compare_quick

Twelve runs (4 optimizers x 2 learning rates with seed 0, then each best with seed 1): about 7 minutes
on 2 CPU cores (measured in issue 42). With two learning rates a best value sits on the grid's edge,
which the table marks. See `compare.py` for the keys.
"""

import ml_collections

from experiments.configs import compare


def get_config() -> ml_collections.ConfigDict:
    config = compare.get_config()
    config.model.preset = "tiny"
    config.steps = 80
    config.batch_size = 16
    config.data.seq_len = 64
    config.eval_every = 10
    config.eval_batches = 4
    config.log_every = 20
    config.checkpoint_every = 40
    config.optimizer.warmup_steps = 10
    config.compare = compare.compare_block("adamw,sgd,lion,muon", seeds=2, factors=(1.0, 2.0))
    config.compare.update_timing_repeats = 10
    return config
