"""Muon as modded-nanogpt's GPT-2 speedrun trains with it: four parameter groups and a momentum warmup.

Record 21 of github.com/KellerJordan/modded-nanogpt (track 1, 2025-01-26; `train_gpt.py` in its log)
steps four groups, every learning rate times the run's one schedule ``s_t``::

    hidden matrices                    Muon  lr 0.05  s_t, momentum beta_t (EMA form, Nesterov; `optim.muon`)
    embeddings (token and value)       Adam  lr 0.6   s_t
    LM head                            Adam  lr 0.008 s_t
    scalars (mixing weights, ...)      Adam  lr 0.04  s_t        every Adam group: betas (0.8, 0.95), eps 1e-10

with Muon's momentum warmed up linearly over its first ``K = 300`` updates (``t = 0, 1, ...``)::

    beta_t = (1 - f_t) beta_0 + f_t beta,   f_t = min(t / K, 1)      (beta_0 = 0.85 -> beta = 0.95)

The Adam rates are ratios of Muon's (``embed_lr_ratio`` 12, ``head_lr_ratio`` 0.16 and, for the scalars
and anything else Adam takes, ``adam_lr_ratio`` 0.8), so one schedule drives the four groups as the
record's ``LambdaLR`` does. The groups come from `optim.labels`: "matrix" as `labels.matrix_labels`; of
the rest, a path through an LM head (`labels.READOUT_NAMES`) is "head", one through a token table
(`labels.TOKEN_EMBEDDING_NAMES`, value embeddings included) "embed", everything else "adam" (the record's
``ndim < 2``). A tree without a head reads out through its token table (tied embeddings), so that table is
"head": its 12x embedding rate diverged on a tied micro LM, and modded-nanogpt's records stepped their table
with the LM head's optimizer while it was tied. Weight decay (0 in the record) is as in `optim.muon`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from optim import common, labels, shapes, spec
from optim.muon import Muon, MuonDirection

EMBED, HEAD = "embed", "head"


def group_labels(params: Any) -> Any:
    """``"matrix"``, ``"embed"``, ``"head"`` or ``"adam"`` per leaf (module docstring)."""
    tied = not any(labels.is_embedding_path(path, labels.READOUT_NAMES) for path, _ in jax.tree_util.tree_leaves_with_path(params))

    def label(path, matrix_label):
        if matrix_label == labels.MATRIX:
            return labels.MATRIX
        if labels.is_embedding_path(path, labels.READOUT_NAMES) or (tied and labels.is_embedding_path(path[:1], labels.TOKEN_EMBEDDING_NAMES)):
            return HEAD
        return EMBED if labels.is_embedding_path(path, labels.TOKEN_EMBEDDING_NAMES) else labels.ADAM

    return jax.tree_util.tree_map_with_path(label, labels.matrix_labels(params))


def momentum_warmup(start: float, end: float, steps: int) -> optax.Schedule:
    """``beta_t = (1 - f_t) start + f_t end`` with ``f_t = min(t / steps, 1)``, in float32 (so Python floats
    and their `optax.inject_hyperparams` arrays give the same momentum)."""

    def schedule(count):
        f = jnp.minimum(jnp.asarray(count, jnp.float32) / steps, 1.0)
        return (1 - f) * jnp.asarray(start, jnp.float32) + f * jnp.asarray(end, jnp.float32)

    return schedule


def _times(learning_rate: optax.ScalarOrSchedule, ratio: float) -> optax.ScalarOrSchedule:
    return (lambda count: ratio * learning_rate(count)) if callable(learning_rate) else ratio * learning_rate


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeedrunMuon(Muon):
    """Muon on hidden matrices and Adam in three groups with their own rates, Muon's momentum warmed up
    (module docstring); the defaults are record 21's. ``adam_learning_rate``, when given, replaces
    ``adam_lr_ratio * learning_rate`` for the "adam" group only; ``param_labels`` uses the four labels."""

    learning_rate: optax.ScalarOrSchedule = 0.05
    weight_decay: float = 0.0
    shape_scale: str = "jordan"
    adam_lr_ratio: float = 0.8
    adam_b1: float = 0.8
    adam_b2: float = 0.95
    adam_eps: float = 1e-10
    embed_lr_ratio: float = spec.param(12.0, valid="[0, inf)", doc="Adam's rate on token and value embeddings, times Muon's.")
    head_lr_ratio: float = spec.param(0.16, valid="[0, inf)", doc="Adam's rate on the LM head, times Muon's.")
    momentum_warmup_steps: int = spec.param(300, valid="[0, inf)", doc="Muon's momentum rises linearly over these updates (0: off).")
    momentum_warmup_start: float = spec.param(0.85, valid="[0, 1)", doc="Muon's momentum at the first update of the warmup.")

    static_args: ClassVar[tuple[str, ...]] = ("momentum_warmup_steps",)  # whether and how long the warmup runs

    def direction(self) -> optax.GradientTransformation:
        warmup_steps = common.static_int("momentum_warmup_steps", self.momentum_warmup_steps, self.static_args)
        if not warmup_steps:
            return super().direction()
        fields = spec.values(self, MuonDirection)

        def with_beta(beta):
            return MuonDirection(**{**fields, "beta": beta}).direction()

        beta = momentum_warmup(self.momentum_warmup_start, self.beta, warmup_steps)
        return optax.inject_hyperparams(with_beta)(beta=beta)

    def transform(self) -> optax.GradientTransformationExtraArgs:
        lr = self.learning_rate

        def adam(rate):
            return optax.adamw(rate, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps, weight_decay=self.weight_decay, mask=labels.decay_mask)

        scalar_lr = _times(lr, self.adam_lr_ratio) if self.adam_learning_rate is None else self.adam_learning_rate
        groups = {
            labels.MATRIX: optax.chain(self.direction(), optax.add_decayed_weights(self.weight_decay), optax.scale_by_learning_rate(lr)),
            EMBED: adam(_times(lr, self.embed_lr_ratio)),
            HEAD: adam(_times(lr, self.head_lr_ratio)),
            labels.ADAM: adam(scalar_lr),
        }
        return shapes.checked(optax.partition(groups, self.param_labels or group_labels), "speedrun_muon")


speedrun_muon = spec.function(SpeedrunMuon, name="speedrun_muon")
