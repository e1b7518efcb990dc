"""The pure training step and the sharded train state it works on.

    state' , metrics = train_step(state, batch)

``state`` is a dict ``{params, opt_state, step, bad_streak, skipped}``. The step computes the
next-token loss (accumulated over micro-batches), the optimizer update, and keeps the old params and
optimizer state when the loss, the gradients, the update or the new optimizer state is not finite (a
*skipped* step; finite gradients can overflow a second moment while the update stays finite).
``bad_streak`` counts consecutive skipped steps; the loop stops the run when it grows too long.
The same function runs on one device or a pod slice: shardings come from logical names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from lm import model as model_lib
from lm import moe as moe_lib
from lm.loss import cross_entropy
from optim import blocking
from sharding import partition
from sharding import rules as rules_lib

TrainState = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where every piece of a run lives on the mesh."""

    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    params: Any
    state: Any
    batch: jax.NamedSharding


def make_shardings(
    model_def: model_lib.ModelDef, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, rules: rules_lib.Rules
) -> Shardings:
    params = partition.named_shardings(model_def.logical_specs, mesh, rules)
    partition.check_divisible(model_def.abstract_params, params)
    # Optimizers that stack blocks (Shampoo, SOAP) spread the stacks over all devices.
    abstract_opt = blocking.annotate_block_shardings(jax.eval_shape(tx.init, model_def.abstract_params), mesh)
    opt = partition.state_shardings(abstract_opt, model_def.abstract_params, params, mesh)
    replicated = jax.NamedSharding(mesh, jax.P())
    state = {"params": params, "opt_state": opt, "step": replicated, "bad_streak": replicated, "skipped": replicated}
    batch_spec = rules_lib.logical_to_mesh_spec(("batch", None), rules.activations, mesh.axis_names)
    return Shardings(mesh, rules, params, state, jax.NamedSharding(mesh, batch_spec))


def abstract_state(model_def: model_lib.ModelDef, tx: optax.GradientTransformation, shardings: Shardings) -> TrainState:
    """`ShapeDtypeStruct`s with shardings for the whole train state: a restore target, no allocation."""
    shapes = {
        "params": model_def.abstract_params,
        "opt_state": jax.eval_shape(tx.init, model_def.abstract_params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "bad_streak": jax.ShapeDtypeStruct((), jnp.int32),
        "skipped": jax.ShapeDtypeStruct((), jnp.int32),
    }
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings.state)


def init_state(model_def: model_lib.ModelDef, tx: optax.GradientTransformation, seed: int, shardings: Shardings) -> TrainState:
    """Fresh train state, created directly in its shardings."""
    params = model_lib.init_params(model_def, seed, shardings.params)
    opt_state = jax.jit(tx.init, out_shardings=shardings.state["opt_state"])(params)
    counters = {k: jax.device_put(jnp.zeros((), jnp.int32), shardings.state[k]) for k in ("step", "bad_streak", "skipped")}
    return {"params": params, "opt_state": opt_state, **counters}


def _all_finite(*trees: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for t in trees for x in jax.tree.leaves(t) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


# Auxiliary model outputs that reach `tx.update` as extra arguments, and how each combines over
# gradient-accumulation micro-batches. Every other aux output is routed by the step itself.
OPTIMIZER_AUX = {"attn_max_logits": jnp.max}
_MOE_AUX = {"moe_counts": jnp.sum, "moe_dropped": jnp.sum}


def make_train_step(
    model_def: model_lib.ModelDef,
    tx: optax.GradientTransformation,
    *,
    grad_accum_steps: int = 1,
    z_loss: float = 0.0,
    learning_rate: Callable[[Any], Any] | None = None,
    balancing: moe_lib.Balancing | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """Returns the (unjitted) train step for batches of shape ``(batch, seq_len + 1)``.

    Auxiliary model outputs are routed explicitly: those named in `OPTIMIZER_AUX` (e.g.
    ``attn_max_logits``) reach the optimizer as extra arguments of ``tx.update`` (transforms that do
    not take them ignore them); an MoE model's statistics go through the balancing hook
    (`lm.moe.balancing_losses`, weights and scope from ``balancing``, default `lm.moe.Balancing()`)
    into the loss, and their expert counts, summed over the step, drive the router-bias update.
    """
    tx = optax.with_extra_args_support(tx)
    balancing = balancing or moe_lib.Balancing()

    def loss_fn(params, tokens, prior_counts=None):
        logits, aux = model_lib.apply(model_def, params, tokens[:, :-1], return_aux=True)
        loss, metrics = cross_entropy(logits, tokens[:, 1:], z_loss=z_loss)
        routed = {k: v for k, v in aux.items() if k in OPTIMIZER_AUX}
        if "moe" in aux:
            stats = aux["moe"]
            if prior_counts is None:
                prior_counts = jnp.zeros_like(stats["expert_counts"][:, 0])
            extra, moe_metrics = moe_lib.balancing_losses(stats, prior_counts, balancing)
            loss, metrics = loss + extra, {**metrics, **moe_metrics}
            routed |= {"moe_counts": jnp.sum(stats["expert_counts"], axis=1), "moe_dropped": jnp.sum(stats["dropped_slots"])}
        return loss, (metrics, routed)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(params, batch):
        if grad_accum_steps == 1:
            return grad_fn(params, batch)
        b = batch.shape[0]
        # Row r of micro-batch m is row r * accum + m: each micro-batch keeps the batch sharding.
        micro = batch.reshape(b // grad_accum_steps, grad_accum_steps, -1).swapaxes(0, 1)

        def body(carry, tokens):
            totals, counts = carry
            (loss, (metrics, aux)), grads = grad_fn(params, partition.constrain(tokens, ("batch", None)), counts)
            if counts is not None:  # the global balancing scope sees the step's earlier micro-batches
                counts = counts + aux["moe_counts"]
            return (jax.tree.map(jnp.add, totals, (loss, metrics, grads)), counts), aux

        (_, (metric_shapes, aux_shapes)), _ = jax.eval_shape(grad_fn, params, micro[0])
        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), metric_shapes, params))
        counts = jnp.zeros_like(aux_shapes["moe_counts"]) if "moe_counts" in aux_shapes else None
        ((loss, metrics, grads), _), aux = jax.lax.scan(body, (zeros, counts), micro)
        scale = 1.0 / grad_accum_steps
        aux = {k: (OPTIMIZER_AUX | _MOE_AUX)[k](v, axis=0) for k, v in aux.items()}
        return (loss * scale, (jax.tree.map(lambda m: m * scale, metrics), aux)), jax.tree.map(lambda g: g * scale, grads)

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        params, opt_state = state["params"], state["opt_state"]
        (loss, (metrics, aux)), grads = accumulate(params, batch)
        updates, new_opt_state = tx.update(grads, opt_state, params, **{k: aux[k] for k in OPTIMIZER_AUX if k in aux})
        new_params = optax.apply_updates(params, updates)
        if "moe_counts" in aux:
            new_params = moe_lib.update_router_bias(new_params, params, aux["moe_counts"], balancing.bias_rate)
            metrics = {**metrics, **moe_lib.load_metrics(aux["moe_counts"], aux["moe_dropped"])}
        ok = jnp.isfinite(loss) & _all_finite(grads, updates, new_opt_state)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
        bad = (~ok).astype(jnp.int32)
        new_state = {
            "params": keep(new_params, params),
            "opt_state": keep(new_opt_state, opt_state),
            "step": state["step"] + 1,
            "bad_streak": (state["bad_streak"] + 1) * bad,
            "skipped": state["skipped"] + bad,
        }
        metrics = {
            "loss": loss,
            **metrics,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "finite": ok,
            "bad_streak": new_state["bad_streak"],
            "skipped": new_state["skipped"],
        }
        if learning_rate is not None:
            metrics["lr"] = learning_rate(state["step"])
        return new_state, metrics

    return train_step


def make_eval_step(model_def: model_lib.ModelDef) -> Callable[[Any, jax.Array], jax.Array]:
    """Mean next-token loss (nats per token) of ``params`` on a batch."""

    def eval_step(params, batch):
        logits = model_lib.apply(model_def, params, batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])[0]

    return eval_step


def jit_train_step(step_fn, shardings: Shardings):
    return jax.jit(
        step_fn, in_shardings=(shardings.state, shardings.batch), out_shardings=(shardings.state, None), donate_argnums=0
    )


def jit_eval_step(eval_fn, shardings: Shardings):
    return jax.jit(eval_fn, in_shardings=(shardings.params, shardings.batch))


def global_batch(local_rows, shardings: Shardings) -> jax.Array:
    """A global array from this process's rows of the batch."""
    return jax.make_array_from_process_local_data(shardings.batch, local_rows)
