"""Functional view of a model: parameters as a plain nested dict, built abstractly, initialised sharded.

`nnx` modules are the readable definition; training works on the pure-dict parameter pytree that
`nnx.split` yields, so optimizers (`optim/`) and checkpoints see ordinary arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
from flax import nnx

from lm.config import ModelConfig
from lm.transformer import Transformer

Params = dict[str, Any]


class ModelDef(NamedTuple):
    """What is needed to run a model on a parameter dict: its config and nnx graph definition."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    abstract_params: Params  # ShapeDtypeStruct leaves
    logical_specs: Params  # PartitionSpec of logical axis names per leaf


def define(cfg: ModelConfig) -> ModelDef:
    """Traces the model abstractly (no allocation): graph definition, parameter shapes, logical axes."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    return ModelDef(cfg, graphdef, nnx.to_pure_dict(state), specs)


def unstack_layers(blocks: Params, n_layers: int) -> Params:
    """Stacked block parameters (leading ``layers`` axis) as the unrolled model's ``{layer: block}``."""
    return {i: jax.tree.map(lambda x: x[i], blocks) for i in range(n_layers)}


def init_params(model_def: ModelDef, seed: int, shardings: Params | None = None) -> Params:
    """Initialises parameters under `jit`, directly into ``shardings`` when given (never whole on one device).

    Blocks are always initialised stacked, by one initialiser vmapped over depth, and unstacked for
    an unrolled model: the program stays small at any depth (an unrolled one compiles an initialiser
    per layer), and a seed gives the same values with and without ``scan_layers``.
    """
    cfg = model_def.config
    stacked = dataclasses.replace(cfg, scan_layers=True)

    def init() -> Params:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.split(Transformer(stacked, rngs=nnx.Rngs(seed)))[1])
        if not cfg.scan_layers:
            params["blocks"] = unstack_layers(params["blocks"], cfg.n_layers)
        return params

    return jax.jit(init, out_shardings=shardings)()


def apply(model_def: ModelDef, params: Params, tokens: jax.Array, *, return_aux: bool = False):
    """Runs the model with ``params`` on ``tokens`` ``(batch, seq)``; see `Transformer.__call__`."""
    model = nnx.merge(model_def.graphdef, params)
    return model(tokens, return_aux=return_aux)


def decode(model_def: ModelDef, params: Params, tokens: jax.Array, cache: Any, start: jax.Array):
    """``(logits, cache)`` for ``tokens`` at positions ``start ..`` given ``cache``; see `Transformer.decode`."""
    model = nnx.merge(model_def.graphdef, params)
    return model.decode(tokens, cache, start)
