"""Optimizers at their default learning rates, with seeds: the CPU table of docs/benchmarks.md.

    python -m experiments.compare_optimizers --config=experiments/configs/compare_defaults.py \
        --seeds=0,1,2 --workdir=runs/compare_defaults

The default job's model, data and batch (`default.py`: `tiny`, 16 x 128 tokens per step) for
``STEPS`` steps (100: half the default job's 200, what the loaded 2-core machine could run three
seeds of), validation every 10 steps on 4 batches. Each optimizer's grid is one point, its spec's
default learning rate (`optim/*.py`), so the comparison is "at the defaults", not tuned.
``--config.compare.optimizers=`` picks the rows; every registered optimizer that runs without
replicas is in the block.
"""

import ml_collections

from experiments.configs import compare, default
from optim import registry, spec

STEPS = 100
REDUCED = "adamw,muon,lion,soap,normuon,adamuon,scion"


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.steps = STEPS
    config.eval_every = 10
    config.eval_batches = 4
    config.log_every = 10
    config.checkpoint_every = 50
    config.optimizer.warmup_steps = 10
    config.compare = compare.compare_block(REDUCED, seeds=3, factors=(1.0,))
    for name, cls in registry.OPTIMIZERS.items():
        config.compare.grid[name].learning_rate = f"{spec.defaults(cls)['learning_rate']:g}" if not cls.replica_local else ""
    config.compare.update_timing_repeats = 5
    return config
