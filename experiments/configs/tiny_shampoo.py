"""The `tiny` model with Shampoo on its hidden matrices (AdamW on embeddings and norms).

    python -m experiments.train --config=experiments/configs/tiny_shampoo.py --workdir=runs/tiny_shampoo

Shampoo is grafted to Adam, so AdamW's learning rate and schedule carry over. The tiny model's
matrices are at most 384 wide, so each is a single block and its roots are cheap: they are refreshed
every 10 steps, and Shampoo takes over from the Adam graft at step 10.
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.optimizer.name = "shampoo"
    config.optimizer.learning_rate = 3e-3
    config.optimizer.shampoo.precondition_every = 10
    return config
