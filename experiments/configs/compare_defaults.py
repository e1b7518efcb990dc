"""Optimizers at their default learning rates, with seeds: the CPU table of docs/benchmarks.md.

    python -m experiments.compare_optimizers --config=experiments/configs/compare_defaults.py \
        --seeds=0,1,2 --workdir=runs/compare_defaults

The default job (`default.py`: `tiny`, 200 steps of 16 x 128 tokens, cosine schedule, 20 warmup
steps, validation on 8 batches), validated every 10 steps so tokens-to-target is read off a
20-point curve. Each optimizer's grid is one point, its spec's default learning rate (`optim/*.py`), so the comparison is "at the defaults", not tuned.
``--config.compare.optimizers=`` picks the rows; every registered optimizer that runs without
replicas is in the block.
"""

import ml_collections

from experiments.configs import compare, default
from optim import registry, spec

REDUCED = "adamw,muon,lion,soap,normuon,adamuon,scion"


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.eval_every = 10
    config.log_every = 10
    config.checkpoint_every = 50
    config.compare = compare.compare_block(REDUCED, seeds=3, factors=(1.0,))
    for name, cls in registry.OPTIMIZERS.items():
        config.compare.grid[name].learning_rate = f"{spec.defaults(cls)['learning_rate']:g}" if not cls.replica_local else ""
    config.compare.update_timing_repeats = 5
    return config
