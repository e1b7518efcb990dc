"""Optimizers as optax transforms, one family per module: `optim.muon.muon`, `optim.lion.lion`, ...

Build any registered optimizer from a config with `optim.build.build`.
"""

from optim.memory import state_bytes

__all__ = ["state_bytes"]
