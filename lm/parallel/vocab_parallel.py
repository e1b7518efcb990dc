"""Vocabulary parallelism: the embedding and the LM head with its softmax split over the ``stage`` axis.

Yeung, Qi, Lin, Wan, "Balancing Pipeline Parallelism with Vocabulary Parallelism" (arXiv 2411.05288;
reference code sail-sg/VocabularyParallelism). A pipeline puts the vocabulary layers on one stage (or,
here, keeps a whole copy on every stage): with ``V`` tokens and width ``d`` that stage holds ``V d``
(tied) parameters more and runs the ``2 N V d`` FLOPs of the head alone. Under
``model.pipeline_vocab_parallel`` stage ``s`` holds rows ``[s V / S, (s + 1) V / S)`` of the table (the
parameter rules map ``vocab`` onto ``stage``, `rules`) and computes its slice of every token's logits.

The output layer with the cross-entropy, per token with features ``h`` and target ``y``, on stage ``s``
with weight slice ``W_s`` (the paper's Algorithm 1; the max and the sum share one barrier by the online
softmax's rescaling, so there are two communication barriers, one per pass):

- S pass (forward): ``z_s = W_s h``, ``m_s = max z_s``, ``l_s = sum exp(z_s - m_s)``, ``t_s = z_s[y]``
  (0 where ``y`` is not in the slice); barrier C1 gathers ``(m_s, l_s, t_s)`` over the stages:
  ``M = max_s m_s``, ``lse = M + log sum_s l_s exp(m_s - M)``, ``t = sum_s t_s``, loss
  ``lse - t + z_loss lse^2``;
- T pass (backward): with ``g = 1 + 2 z_loss lse``, ``dz_s = (g exp(z_s - lse) - onehot_s(y)) / N``;
  ``dW_s = dz_s^T h`` stays on the stage; barrier C2 all-reduces ``dh = sum_s W_s^T dz_s``.

The embedding lookup is split the same way: each stage looks up the tokens of its slice (zeros elsewhere)
and one all-reduce over ``stage`` sums them; its gradient scatters into the stage's own rows. GSPMD
partitions the lookup of a table whose ``vocab`` dimension is split exactly so (a masked local gather and
an all-reduce), so the embedding needs no code here, only the rule.

Where the passes run: under ``gpipe`` and ``circular`` the head follows the forward loop, whose output
already reaches every stage (`lm.parallel.pipeline.run_stack`'s all-reduce: the paper's broadcast), and
`cross_entropy` runs both passes over ``stage`` (`jax.custom_vjp`). Under ``1f1b`` and ``zb_h1``
(`lm.parallel.pipeline_1f1b`) they run inside the tick on which the last stage finishes a microbatch's
forward: that stage's output is broadcast, every stage runs the S pass, C1, the T pass and C2 on its
slice, and the last stage keeps the output gradient for its backward on the next tick, as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lm.config import ModelConfig
from lm.parallel import pipeline
from sharding import axes
from sharding.rules import Rules


def active(cfg: ModelConfig) -> bool:
    """Whether model ``cfg`` splits its vocabulary over the ``stage`` axis of the mesh in context."""
    return cfg.pipeline_vocab_parallel and pipeline.stage_count() > 1


def with_vocab_over_stage(rules: Rules, cfg: ModelConfig) -> Rules:
    """``rules`` whose parameter table also splits ``vocab`` over ``stage`` when ``cfg.pipeline_vocab_parallel``."""
    if not cfg.pipeline_vocab_parallel:
        return rules
    params = tuple((name, (*mesh, axes.STAGE) if name == "vocab" else mesh) for name, mesh in rules.params)
    if "vocab" not in dict(rules.params):
        params += (("vocab", (axes.STAGE,)),)
    return Rules(params=params, activations=rules.activations)


def check(cfg: ModelConfig, stages: int) -> None:
    """Raises a one-line ValueError naming the fix when ``cfg``'s vocabulary does not split over ``stages``."""
    if cfg.pipeline_vocab_parallel and stages > 1 and cfg.vocab_size % stages:
        raise ValueError(
            f"model.pipeline_vocab_parallel splits model.vocab_size={cfg.vocab_size} over stage:{stages}; use a vocab_size "
            f"divisible by {stages} (e.g. {stages * -(-cfg.vocab_size // stages)})"
        )


def _logits(h: jax.Array, w: jax.Array, vocab_first: bool) -> jax.Array:
    """``(n, V / S)`` float32 logits of the stage's slice ``w`` (``(V / S, d)`` if ``vocab_first`` else ``(d, V / S)``)."""
    return jnp.einsum("nd,vd->nv" if vocab_first else "nd,dv->nv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def _target_mask(z: jax.Array, targets: jax.Array) -> jax.Array:
    """One-hot ``(n, V / S)`` of each target within this stage's slice (all false where it is another stage's)."""
    first = jax.lax.axis_index(axes.STAGE) * z.shape[-1]
    return jnp.arange(z.shape[-1])[None, :] + first == targets[:, None]


def s_pass(h: jax.Array, w: jax.Array, targets: jax.Array, vocab_first: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(lse, target_logit, z)`` per token, inside a ``stage``-manual program: local statistics, then barrier C1."""
    z = _logits(h, w, vocab_first)
    m = jnp.max(z, axis=-1)
    local = jnp.stack([m, jnp.sum(jnp.exp(z - m[:, None]), axis=-1), jnp.sum(jnp.where(_target_mask(z, targets), z, 0.0), axis=-1)])
    m_all, l_all, t_all = jax.lax.all_gather(local, axes.STAGE, axis=1)  # C1: (S, n) each
    top = jnp.max(m_all, axis=0)
    return top + jnp.log(jnp.sum(l_all * jnp.exp(m_all - top), axis=0)), jnp.sum(t_all, axis=0), z


def t_pass(
    h: jax.Array, w: jax.Array, targets: jax.Array, z: jax.Array, lse: jax.Array, g_nll: jax.Array, g_z: jax.Array, z_loss: float, vocab_first: bool
) -> tuple[jax.Array, jax.Array]:
    """``(dh, dW_s)`` of ``g_nll sum(lse - t) + g_z z_loss sum(lse^2)`` over the tokens: the slice's gradients from
    ``dz_s = (g_nll + 2 z_loss g_z lse) softmax(z)_s - g_nll onehot_s(y)``, then barrier C2 on ``dh``."""
    dz = (g_nll + 2.0 * z_loss * g_z * lse)[:, None] * jnp.exp(z - lse[:, None]) - g_nll * _target_mask(z, targets)
    dw = jnp.einsum("nv,nd->vd" if vocab_first else "nv,nd->dv", dz, h.astype(jnp.float32))
    dh = jnp.einsum("nv,vd->nd" if vocab_first else "nv,dv->nd", dz, w.astype(jnp.float32))
    return jax.lax.psum(dh, axes.STAGE).astype(h.dtype), dw.astype(w.dtype)  # C2


def loss_and_grads(
    h: jax.Array, w: jax.Array, targets: jax.Array, *, z_loss: float, vocab_first: bool, scale: float = 1.0
) -> tuple[tuple[jax.Array, dict], jax.Array, jax.Array]:
    """``((loss, metrics), dh, dW_s)`` of the mean cross-entropy of ``h`` ``(..., d)`` against ``targets`` ``(...)``
    times ``scale``, inside a ``stage``-manual program; ``loss`` and ``metrics`` unscaled, as `lm.loss.cross_entropy`'s."""
    shape, h, targets = h.shape, h.reshape(-1, h.shape[-1]), targets.reshape(-1).astype(jnp.int32)
    lse, t, z = s_pass(h, w, targets, vocab_first)
    g = jnp.float32(scale / h.shape[0])
    dh, dw = t_pass(h, w, targets, z, lse, g, g, z_loss, vocab_first)
    nll, z_term = jnp.mean(lse - t), z_loss * jnp.mean(jnp.square(lse))
    return (nll + z_term, {"nll": nll, "z_loss": z_term}), dh.reshape(shape), dw


def cross_entropy(h: jax.Array, head: jax.Array, targets: jax.Array, *, z_loss: float = 0.0, vocab_first: bool) -> tuple[jax.Array, dict]:
    """`lm.loss.cross_entropy` of the logits of features ``h`` ``(batch, seq, d)`` and ``head`` (split over ``stage``
    by its ``vocab`` axis), by the S and T passes over ``stage``; ``h`` and the loss replicated over ``stage``."""
    nll, z_term = _vocab_loss(h, head, targets.astype(jnp.int32), float(z_loss), vocab_first)
    return nll + z_term, {"nll": nll, "z_loss": z_term}


def _over_stage(fn, vocab_first: bool, out_specs):
    """``fn(h, head, targets, *rest)`` in a `jax.shard_map` manual over ``stage`` only, the head split by its vocab axis."""
    head = jax.P(axes.STAGE) if vocab_first else jax.P(None, axes.STAGE)
    out_specs = tuple(head if spec == "head" else jax.P() for spec in out_specs)
    return lambda h, w, *rest: jax.shard_map(
        fn, in_specs=(jax.P(), head, *(jax.P(),) * len(rest)), out_specs=out_specs, axis_names={axes.STAGE}, check_vma=False
    )(h, w, *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _vocab_loss(h, head, targets, z_loss, vocab_first):
    return _vocab_loss_fwd(h, head, targets, z_loss, vocab_first)[0]


def _vocab_loss_fwd(h, head, targets, z_loss, vocab_first):
    def fn(h, w, targets):
        lse, t, _ = s_pass(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), vocab_first)
        return jnp.mean(lse - t), z_loss * jnp.mean(jnp.square(lse))

    return _over_stage(fn, vocab_first, (None, None))(h, head, targets), (h, head, targets)


def _vocab_loss_bwd(z_loss, vocab_first, saved, g):
    h, head, targets = saved

    def fn(h, w, targets, g_nll, g_z):
        h2, t2 = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        lse, _, z = s_pass(h2, w, t2, vocab_first)  # the S pass again: the logits are not kept (as under remat)
        dh, dw = t_pass(h2, w, t2, z, lse, g_nll / h2.shape[0], g_z / h2.shape[0], z_loss, vocab_first)
        return dh.reshape(h.shape), dw

    dh, dw = _over_stage(fn, vocab_first, (None, "head"))(h, head, targets, *g)
    return dh, dw, None


_vocab_loss.defvjp(_vocab_loss_fwd, _vocab_loss_bwd)
