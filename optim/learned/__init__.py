"""Learned optimizers: a per-parameter MLP (`optim.learned.mlp_lopt`) on the features of `optim.learned.features`."""
