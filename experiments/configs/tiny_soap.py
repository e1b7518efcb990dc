"""The `tiny` model with SOAP on its hidden matrices (AdamW on embeddings and norms).

    python -m experiments.train --config=experiments/configs/tiny_soap.py --workdir=runs/tiny_soap

SOAP's defaults are the reference's (b1 = b2 = 0.95, eigenbasis refreshed every 10 steps, weight
decay 0.01) with its learning rate 3e-3.
"""

import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.optimizer.name = "soap"
    config.optimizer.learning_rate = 3e-3
    return config
