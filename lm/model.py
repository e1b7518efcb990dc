"""Functional view of a model: parameters as a plain nested dict, built abstractly, initialised sharded.

`nnx` modules are the readable definition; training works on the pure-dict parameter pytree that
`nnx.split` yields, so optimizers (`optim/`) and checkpoints see ordinary arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
from flax import nnx

from lm import fp8, speedrun_config, transformer
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


class ParamCounts(NamedTuple):
    """Parameter counts read off the parameter tree."""

    total: int
    active: int  # used per token: a routed expert stack counts experts_per_token / n_experts of its size
    active_matmul: int  # active weights of matrix multiplies: no norms, biases, or embedding lookup; the LM head counts
    stream_matmul: int = 0  # the part of active_matmul in the blocks, which run once per ParScale stream (lm/parscale.py)


@functools.lru_cache(maxsize=64)
def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Counts the parameters of ``cfg``'s model from its abstract parameter tree and logical axes.

    A leaf is a matrix multiply's weight when it has two or more logical axes besides ``layers``;
    the ``(vocab, embed)`` table counts as one only when it is tied (it is then the LM head), and
    ParScale's prefix keys and values (``streams`` and ``head_dim`` axes) never do: attention reads
    them as it reads the sequence's keys. A leaf with both ``experts`` and ``mlp`` axes is a routed
    expert stack.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):  # callable under a run's mesh
        return count_params(define(cfg))


def count_params(model_def: ModelDef) -> ParamCounts:
    """`param_counts` of a model already defined (tracing a deep unrolled model takes seconds)."""
    cfg = model_def.config
    total = active = matmul = stream = 0
    specs = jax.tree.leaves(fp8.split(model_def.logical_specs)[0], is_leaf=lambda x: isinstance(x, jax.P))  # FP8 scaling state is no parameter
    params = jax.tree_util.tree_leaves_with_path(fp8.split(model_def.abstract_params)[0])
    for spec, (path, leaf) in zip(specs, params, strict=True):
        names = tuple(n for n in spec if n != "layers")
        size = math.prod(leaf.shape)
        used = size * cfg.experts_per_token // cfg.n_experts if {"experts", "mlp"} <= set(names) else size
        total += size
        active += used
        lookup_only = (names == ("vocab", "embed") and not cfg.tie_embeddings) or {"streams", "head_dim"} <= set(names)
        weight = used if len(names) >= 2 and not lookup_only else 0
        matmul += weight
        stream += weight if path[0].key == "blocks" else 0
    return ParamCounts(total, active, matmul, stream)


def unstack_layers(blocks: Params, n_layers: int) -> Params:
    """Stacked block parameters (leading ``layers`` axis) as the unrolled model's ``{layer: block}``."""
    return {i: jax.tree.map(lambda x: x[i], blocks) for i in range(n_layers)}


def init_params(model_def: ModelDef, seed: int, shardings: Params | None = None) -> Params:
    """Initialises parameters under `jit`, directly into ``shardings`` when given (never whole on one device).

    Blocks are always initialised stacked, by one initialiser vmapped over depth, and unstacked for
    an unrolled model: the program stays small at any depth (an unrolled one compiles an initialiser
    per layer), and a seed gives the same values with and without ``scan_layers``. Blocks that
    differ (dense and MoE, ``moe_every > 1`` or ``first_dense_layers``; lightning layers, whose decays depend on depth) cannot be stacked and are initialised one by one.
    """
    cfg = model_def.config
    uniform = (
        cfg.attention_type != "lightning"
        and (cfg.n_experts == 0 or (cfg.moe_every == 1 and cfg.first_dense_layers == 0))
        and not speedrun_config.layer_dependent(cfg)
    )
    # window_warmup (a schedule, no parameter) runs unrolled only: the stacked twin initialises without it.
    stacked = dataclasses.replace(cfg, scan_layers=True, window_warmup=0) if uniform else cfg

    def init() -> Params:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.split(Transformer(stacked, rngs=nnx.Rngs(seed)))[1])
        if not cfg.scan_layers and uniform:
            params["blocks"] = unstack_layers(params["blocks"], cfg.n_layers)
        return params

    return jax.jit(init, out_shardings=shardings)()


def apply(
    model_def: ModelDef, params: Params, tokens: jax.Array, *, return_aux: bool = False, model_layout: bool = False,
    window_blocks: jax.Array | None = None,
):  # fmt: skip
    """Runs the model with ``params`` on ``tokens`` ``(batch, seq)``; see `Transformer.__call__`."""
    model = nnx.merge(model_def.graphdef, params)
    return model(tokens, return_aux=return_aux, model_layout=model_layout, window_blocks=window_blocks)


def features(
    model_def: ModelDef, params: Params, tokens: jax.Array, window_blocks: jax.Array | None = None
) -> tuple[jax.Array, tuple[jax.Array, bool], dict]:
    """``(features, (head, vocab_first), aux)``: the LM head's input ``(batch, seq, d_model)`` in the model's
    layout (`in_model_layout`), its float32 weight and axis order (`Transformer.head_matrix`), and the aux dict."""
    model = nnx.merge(model_def.graphdef, params)
    h, aux = model.features(tokens, window_blocks)
    return h, model.head_matrix(), aux


def in_model_layout(model_def: ModelDef, x: jax.Array) -> jax.Array:
    """``x`` ``(batch, seq, ...)`` in the sequence layout the model runs in: targets for ``apply(..., model_layout=True)``."""
    return transformer.in_model_layout(model_def.config, x)


def decode(model_def: ModelDef, params: Params, tokens: jax.Array, cache: Any, start: jax.Array):
    """``(logits, cache)`` for ``tokens`` at positions ``start ..`` given ``cache``; see `Transformer.decode`."""
    model = nnx.merge(model_def.graphdef, params)
    return model.decode(tokens, cache, start)
