"""Every parallel mode of a model checked against a mesh and its rules, before anything is traced.

One place for all of them, so a new mode adds its check here and every entry point (training, the
planner, benchmarks; all build their run through `experiments.run_spec`) refuses a bad layout with one
line naming the fix:

- ``context`` (`lm.parallel.context_attention`): the sequence and head counts split over the shards;
- ``stage`` (`lm.parallel.pipeline`): layers, microbatches and repeats split over the stages, and the
  vocabulary under ``model.pipeline_vocab_parallel`` (`lm.parallel.vocab_parallel`); FP8 scaled currently,
  not by delayed scaling's history;
- a replica-local train step (``replicas``, a mesh axis whose slices keep their own optimizer state)
  does not run beside a ``stage`` axis, nor a ``context`` or ``expert`` split (the attention's custom
  backward passes and the all-to-all dispatch's grouped matmuls are not typed for its `jax.shard_map`'s
  varying axes);
- ``expert`` needs nothing beyond the rules' own checks (`sharding.rules.logical_to_mesh_spec`);
- a sliding window (``model.attention_window``) needs whole sequences: no ``context`` or ``seq`` split;
- ParScale's streams (``model.parscale``) run on neither a ``stage`` nor a ``context`` split, lightning
  attention not on a ``context`` split.
"""

from __future__ import annotations

import math

import jax

from lm.config import ModelConfig
from lm import lightning, parscale
from lm.parallel import context_attention, pipeline, vocab_parallel
from sharding import axes
from sharding.rules import Rules


def shards(mesh: jax.sharding.Mesh, rules: Rules, logical: str) -> int:
    """How many ways the activation rules of ``rules`` split logical axis ``logical`` on ``mesh``."""
    return math.prod(mesh.shape[a] for a in dict(rules.activations).get(logical, ()) if a in mesh.shape)


def check(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: Rules, *, batch: int, seq_len: int, replicas: str = "") -> None:
    """Raises a one-line ValueError naming the fix when model ``cfg`` cannot run its parallel modes on ``mesh``.

    ``batch``: sequences per gradient-accumulation micro-batch; ``seq_len``: tokens per sequence;
    ``replicas``: the replica axis of a replica-local step (empty: none).
    """
    seq_rule = dict(rules.activations).get("seq", ())
    seq_axes = [a for a in seq_rule if mesh.shape.get(a, 1) > 1]
    if cfg.attention_window and seq_axes:
        raise ValueError(
            f"model.attention_window={cfg.attention_window} attends within whole sequences, and the rules split the sequence "
            f"over {', '.join(seq_axes)} of mesh {dict(mesh.shape)}; keep the sequence whole (no context axis; tp rules, not sp) "
            "or set model.attention_window=0"
        )
    context_split = axes.CONTEXT in seq_rule and mesh.shape.get(axes.CONTEXT, 1) > 1
    if axes.CONTEXT in seq_rule:
        context_attention.check(cfg, seq_len, mesh.shape.get(axes.CONTEXT, 1), shards(mesh, rules, "heads"))
    stages = mesh.shape.get(axes.STAGE, 1)
    if cfg.parscale > 1 and (stages > 1 or context_split):
        raise ValueError(parscale.MESH_PROBLEM)
    if cfg.attention_type == "lightning" and context_split:
        raise ValueError(lightning.CONTEXT_PROBLEM)
    pipeline.check(cfg, stages=stages, batch=batch, batch_shards=shards(mesh, rules, "batch"))
    vocab_parallel.check(cfg, stages)
    expert_split = cfg.n_experts and mesh.shape.get(axes.EXPERT, 1) > 1
    if replicas and (stages > 1 or context_split or expert_split):
        axis = "stage" if stages > 1 else "context" if context_split else "expert"
        raise ValueError(
            f"config.replicas={replicas} (a replica-local step) does not run beside {'an' if axis == 'expert' else 'a'} {axis} axis yet (mesh "
            f"{dict(mesh.shape)}); drop the {axis} axis or use an optimizer that is not replica-local"
        )
