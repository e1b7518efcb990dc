"""The sweep that sets every registered optimizer's default learning rate: the default job's model,
data, batch and length (`default.py`: `tiny`, 16 x 128 tokens, 200 steps), seed 0, three learning
rates per optimizer around the centres of `compare.py`.

    python -m experiments.compare_optimizers --config=experiments/configs/sweep_defaults.py \
        --workdir=runs/sweep_defaults

Results and the defaults taken from them: docs/benchmarks.md ("Default learning rates").
"""

import ml_collections

from experiments.configs import compare, default
from optim import registry


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.eval_every = 100
    config.log_every = 100
    config.checkpoint_every = 1000
    # The Muon family and the AdamW baseline first: their defaults are what most runs use.
    first = ["adamw", "muon", "normuon", "muon_clip", "mars_muon"]
    names = first + sorted(n for n, c in registry.OPTIMIZERS.items() if n not in first and not c.replica_local)  # these need replicas
    config.compare = compare.compare_block(",".join(names), seeds=1, factors=(0.5, 1.0, 2.0))
    config.compare.update_timing_repeats = 3
    return config
