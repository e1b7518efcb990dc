"""The `tiny` model trained with Muon; the other Muon-family optimizers are one flag away.

    python -m experiments.train --config=experiments/configs/tiny_muon.py
    python -m experiments.train --config=experiments/configs/tiny_muon.py --config.optimizer.name=normuon
    python -m experiments.train --config=experiments/configs/tiny_muon.py --config.optimizer.name=mars_muon
    python -m experiments.train --config=experiments/configs/tiny_muon.py --config.optimizer.name=muon_clip \
        --config.model.track_attn_logits=True

Muon's shape scale is Moonlight's (``optimizer.muon.shape_scale="moonlight"``): its updates have
AdamW's RMS, so one learning rate and one schedule serve the hidden matrices (Muon) and the
embedding and norms (AdamW, ``adam_lr_ratio=1``). The learning rate was tuned on this model (see
tests/optim/test_muon.py, test_muon_reaches_adamw_loss_in_fewer_steps).
"""

import ml_collections

from experiments.configs import default

LEARNING_RATE = 2.4e-2


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.optimizer = default.optimizer_config("muon", learning_rate=LEARNING_RATE)
    config.optimizer.muon.ns_coeffs = "jordan"  # or "polar_express", "turbo" (4 steps)
    config.optimizer.muon.ns_steps = 0  # 0: the preset's own count
    config.optimizer.muon.shape_scale = "moonlight"
    config.optimizer.muon_clip.tau = 100.0  # only used with --config.optimizer.name=muon_clip
    return config
