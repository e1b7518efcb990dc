"""Optimizer comparison: `small` on the standard-library corpus, a learning-rate grid per optimizer.

    python -m experiments.compare_optimizers --workdir=runs/compare \
        --config.compare.optimizers=adamw,muon,soap --config.compare.grid.soap.learning_rate=1e-3,3e-3,1e-2

Everything outside ``compare`` is a training config (``experiments/configs/default.py``) shared by
every run; each run sets ``optimizer.name``, ``seed`` and the grid's keys. A grid value is a
comma-separated list; an empty string leaves the key at its ``optimizer.*`` value. Grid keys:
``learning_rate``, ``weight_decay``, ``warmup_steps`` (their product is swept).

The grids are centred on the best learning rates of 80-step sweeps of `tiny` with `compare_quick.py`
(AdamW 3e-3, SGD 0.3, Lion 1.2e-3, Muon with Moonlight's shape scale 2.4e-2; docs/benchmarks.md);
the rest of the Muon family takes Muon's and the other families AdamW's, a starting point rather than
a tuned value. A best value on the edge of its grid means the grid should be widened.
This config is sized for an accelerator; `compare_quick.py` is the 2-core CPU version.
"""

import ml_collections

from experiments.configs import default
from optim import registry

# Learning-rate grid centres per family; families not listed use AdamW's.
CENTRES = {"adamw": 3e-3, "sgd": 0.3, "lion": 1.2e-3, "muon": 2.4e-2, "normuon": 2.4e-2, "mars_muon": 2.4e-2, "muon_clip": 2.4e-2}
GRID_KEYS = ("learning_rate", "weight_decay", "warmup_steps")


def lr_grid(centre: float, factors: tuple[float, ...]) -> str:
    return ",".join(f"{centre * f:.3g}" for f in factors)


def compare_block(optimizers: str, seeds: int, factors: tuple[float, ...]) -> ml_collections.ConfigDict:
    """The ``compare`` block: which optimizers, how many seeds, and one grid per registered optimizer."""
    block = ml_collections.ConfigDict()
    block.optimizers = optimizers  # comma-separated registered names
    block.baseline = "adamw"  # speedups are measured against this optimizer's final validation loss
    block.seeds = ",".join(map(str, range(seeds)))  # the best setting's seeds; the first runs the grid (--seeds=0,1,2)
    block.update_timing_repeats = 20  # timed calls of each optimizer's update (median reported)
    block.grid = ml_collections.ConfigDict()
    for name in sorted(registry.OPTIMIZERS):
        block.grid[name] = ml_collections.ConfigDict({key: "" for key in GRID_KEYS})
        block.grid[name].learning_rate = lr_grid(CENTRES.get(name, CENTRES["adamw"]), factors)
    return block


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.model.preset = "small"
    config.steps = 2000
    config.batch_size = 64
    config.data.seq_len = 256
    config.eval_every = 100
    config.eval_batches = 16
    config.checkpoint_every = 500
    config.optimizer.warmup_steps = 100
    config.compare = compare_block(
        "adamw,sgd,lion,muon,normuon,mars_muon,soap,shampoo,came", seeds=3, factors=(0.25, 0.5, 1.0, 2.0, 4.0)
    )
    return config
