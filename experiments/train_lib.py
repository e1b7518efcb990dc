"""The pure training step and the sharded train state it works on.

    state' , metrics = train_step(state, batch)

``state`` is a dict ``{params, opt_state, step, bad_streak, skipped}``. The step computes the
next-token loss (accumulated over micro-batches), the optimizer update, and keeps the old params and
optimizer state when the loss, the gradients, the update or the new optimizer state is not finite (a
*skipped* step; finite gradients can overflow a second moment while the update stays finite).
``bad_streak`` counts consecutive skipped steps; the loop stops the run when it grows too long.
The same function runs on one device or a pod slice: shardings come from logical names.

**Replica-local step** (``replica_axis``, e.g. ``"data"``): the mesh axis is split into replicas.
Each replica computes the gradient of its own share of the batch inside a `jax.shard_map` that
makes only that axis manual (other axes, ``fsdp`` / ``tensor`` inside a replica, stay
GSPMD-partitioned), and the optimizer receives these *local* gradients: an optimizer built for
replicas (DeMo, DiLoCo, PowerSGD; ``axis_name=replica_axis``) does its own collectives, any other
is given the replica mean first (`optim.cross_replica.mean_over_replicas`, i.e. data parallelism).
Every leaf of ``params`` and ``opt_state`` then carries a leading axis of one slice per replica,
sharded over ``replica_axis``: per-device memory is that of replicated parameters, and state that
differs between replicas (local momenta, DiLoCo's drifting parameters) is ordinary state that
checkpoints and restores like any other (onto the same replica count; `experiments.run_spec.run_meta`
makes a resume refuse another). Skipping a non-finite step is decided jointly (one bad replica skips the step
everywhere), metrics are replica means, and evaluation uses the replica mean of the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from kernels_pallas import varying
from lm import fp8
from lm import model as model_lib
from lm import moe as moe_lib
from lm.loss import cross_entropy, next_token_loss, weighted_nll
from lm.parallel import pipeline_1f1b
from optim import placement
from sharding import partition
from sharding import rules as rules_lib

TrainState = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where every piece of a run lives on the mesh."""

    mesh: jax.sharding.Mesh
    rules: rules_lib.Rules
    params: Any  # one model's parameters (per replica in a replica-local run)
    state: Any
    batch: jax.NamedSharding
    replica_axis: str | None = None

    @property
    def replicas(self) -> int:
        return self.mesh.shape[self.replica_axis] if self.replica_axis else 1


def check_replica_axis(axis: str, mesh: jax.sharding.Mesh, rules: rules_lib.Rules, param_shardings: Any) -> None:
    """Raises a ValueError naming the fix unless mesh axis ``axis`` can hold replicas of the model."""
    if axis not in mesh.shape:
        raise ValueError(
            f"replicas={axis!r} is not an axis of mesh {dict(mesh.shape)}; name a mesh axis, e.g. "
            f"--config.mesh={axis}:{mesh.size} or {axis}:{max(mesh.size // 2, 1)},fsdp:2"
        )
    inner = {a: n for a, n in mesh.shape.items() if a != axis and n > 1}
    if len(inner) > 1:
        raise ValueError(
            f"replicas={axis!r} leaves {len(inner)} mesh axes of size > 1 inside a replica ({inner}); XLA's SPMD "
            f"partitioner aborts on that (jax 0.10), so keep one, e.g. --config.mesh={axis}:{mesh.shape[axis]},fsdp:{mesh.size // mesh.shape[axis]}"
        )
    if axis not in partition.mesh_axes_of(rules_lib.logical_to_mesh_spec(("batch",), rules.activations, mesh.axis_names)[0]):
        raise ValueError(f"replicas={axis!r}: the batch is not split over mesh axis {axis!r} by the rules; add it to the batch rule")
    for sharding in jax.tree.leaves(param_shardings):
        if any(axis in partition.mesh_axes_of(axes) for axes in sharding.spec):
            raise ValueError(
                f"replicas={axis!r}: the rules shard parameters over {axis!r} (spec {sharding.spec}); replicas hold whole "
                "models, so shard parameters over another axis (fsdp, tensor) or override the rule"
            )


def make_shardings(
    model_def: model_lib.ModelDef,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    rules: rules_lib.Rules,
    replica_axis: str | None = None,
) -> Shardings:
    params = partition.named_shardings(model_def.logical_specs, mesh, rules, model_def.abstract_params)
    partition.check_divisible(model_def.abstract_params, params)
    if replica_axis:
        check_replica_axis(replica_axis, mesh, rules, params)
    opt = placement.state_shardings(tx, model_def.abstract_params, params, mesh, replica_axis)
    state_params = params
    if replica_axis:
        state_params, opt = (jax.tree.map(lambda s: partition.stacked(s, replica_axis), t) for t in (params, opt))
    replicated = jax.NamedSharding(mesh, jax.P())
    state = {"params": state_params, "opt_state": opt, "step": replicated, "bad_streak": replicated, "skipped": replicated}
    batch_spec = rules_lib.logical_to_mesh_spec(("batch", None), rules.activations, mesh.axis_names)
    return Shardings(mesh, rules, params, state, jax.NamedSharding(mesh, batch_spec), replica_axis)


def abstract_state(
    model_def: model_lib.ModelDef, tx: optax.GradientTransformation, shardings: Shardings, replicas: int | None = None
) -> TrainState:
    """`ShapeDtypeStruct`s with shardings for the whole train state: a restore target, no allocation. ``replicas``:
    the leading axis of a replica-local run's state (default: the mesh's replica count; a reader of a checkpoint
    saved on another replica count gives the saved count; a count the mesh's replica axis does not divide is read
    whole on every replica device)."""
    shapes = {
        "params": model_def.abstract_params,
        "opt_state": jax.eval_shape(tx.init, model_def.abstract_params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "bad_streak": jax.ShapeDtypeStruct((), jnp.int32),
        "skipped": jax.ShapeDtypeStruct((), jnp.int32),
    }
    state = shardings.state
    if shardings.replica_axis:
        count = shardings.replicas if replicas is None else replicas
        per_replica = lambda s: jax.ShapeDtypeStruct((count, *s.shape), s.dtype)  # noqa: E731
        shapes |= {k: jax.tree.map(per_replica, shapes[k]) for k in _PER_REPLICA}
        if count % shardings.replicas:  # e.g. 2 saved replicas read on data:8: every replica device reads both
            whole = lambda sh: jax.NamedSharding(sh.mesh, jax.P(None, *sh.spec[1:]))  # noqa: E731
            state = state | {k: jax.tree.map(whole, state[k]) for k in _PER_REPLICA}
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state)


def init_state(
    model_def: model_lib.ModelDef, tx: optax.GradientTransformation, seed: int, shardings: Shardings, params: Any = None
) -> TrainState:
    """Fresh train state, created directly in its shardings (every replica starts from the same state).

    ``params``: start from these (placed in ``shardings.params``, e.g. `lm.hf.load_params`) instead of initialising.
    """
    params = model_lib.init_params(model_def, seed, shardings.params) if params is None else params
    if shardings.replica_axis:
        copies = lambda p: jax.tree.map(lambda x: jnp.broadcast_to(x, (shardings.replicas, *x.shape)), (p, tx.init(p)))  # noqa: E731
        out = (shardings.state["params"], shardings.state["opt_state"])
        params, opt_state = jax.jit(copies, out_shardings=out)(params)
    else:
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
    replica_axis: str | None = None,
    window_blocks: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """Returns the (unjitted) train step for batches of shape ``(batch, seq_len + 1)``.

    Auxiliary model outputs are routed explicitly: those named in `OPTIMIZER_AUX` (e.g.
    ``attn_max_logits``) reach the optimizer as extra arguments of ``tx.update`` (transforms that do
    not take them ignore them); an MoE model's statistics go through the balancing hook
    (`lm.moe.balancing_losses`, weights and scope from ``balancing``, default `lm.moe.Balancing()`)
    into the loss, and their expert counts, summed over the step (and over replicas in a replica-local
    step, so the global balancing scope and the router-bias step see the whole batch as under GSPMD),
    drive the router-bias update.

    With ``replica_axis`` the step is replica-local (see the module docstring) and must be called
    under ``jax.set_mesh``; ``tx`` then sees each replica's own gradients, so it is either built for
    replicas or preceded by `optim.cross_replica.mean_over_replicas` (`optim.build.build` does both).

    ``window_blocks(step)``: the attention window at each step, traced (`lm.speedrun_config.window_blocks`).
    """
    tx = optax.with_extra_args_support(tx)
    balancing = balancing or moe_lib.Balancing()
    total = (lambda x: jax.lax.psum(x, replica_axis)) if replica_axis else (lambda x: x)  # noqa: E731

    def loss_fn(params, tokens, prior_counts=None, window=None):
        loss, metrics, aux = next_token_loss(model_def, params, tokens, z_loss=z_loss, window_blocks=window)
        routed = {k: v for k, v in aux.items() if k in OPTIMIZER_AUX}
        if "moe" in aux:
            stats = aux["moe"]
            if prior_counts is None:
                prior_counts = jnp.zeros_like(stats["expert_counts"][:, 0])
            extra, moe_metrics = moe_lib.balancing_losses(stats, prior_counts, balancing, replica_axis)
            loss, metrics = loss + extra, {**metrics, **moe_metrics}
            # Whole-batch counts (every replica's rows): the router-bias step is then the same everywhere.
            routed |= {"moe_counts": moe_lib.batch_counts(stats, replica_axis), "moe_dropped": total(jnp.sum(stats["dropped_slots"]))}
        return loss, (metrics, routed)

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(params, tokens, prior_counts=None, window=None):
        if pipeline_1f1b.active(model_def.config):  # the schedule computes loss and gradients itself (lm/parallel/pipeline_1f1b.py)
            loss_of = lambda logits, targets: cross_entropy(logits, targets, z_loss=z_loss)  # noqa: E731
            (loss, metrics), grads = pipeline_1f1b.value_and_grad(model_def, params, tokens, loss_of, z_loss=z_loss)
            return (loss, (metrics, {})), grads
        return value_and_grad(params, tokens, prior_counts, window)

    def accumulate(params, batch, window):
        if grad_accum_steps == 1:
            return grad_fn(params, batch, None, window)
        b = batch.shape[0]
        # Row r of micro-batch m is row r * accum + m: each micro-batch keeps the batch sharding.
        micro = batch.reshape(b // grad_accum_steps, grad_accum_steps, -1).swapaxes(0, 1)

        def body(carry, tokens):
            totals, counts = carry
            (loss, (metrics, aux)), grads = grad_fn(params, partition.constrain(tokens, ("batch", None)), counts, window)
            if counts is not None:  # the global balancing scope sees the step's earlier micro-batches
                counts = counts + aux["moe_counts"]
            loss_sum, metrics_sum, grads_sum = totals  # FP8 scaling state: the micro-batches' maximum (lm/fp8.py)
            return ((loss_sum + loss, jax.tree.map(jnp.add, metrics_sum, metrics), fp8.accumulate(grads_sum, grads)), counts), aux

        (_, (metric_shapes, aux_shapes)), _ = jax.eval_shape(grad_fn, params, micro[0], None, window)
        from_shape = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731  (zeros_like of a shape typed varying fails)
        zeros = (jnp.float32(0), jax.tree.map(from_shape, metric_shapes), jax.tree.map(jnp.zeros_like, params))
        counts = from_shape(aux_shapes["moe_counts"]) if "moe_counts" in aux_shapes else None
        # In the replica-local step's shard_map the sums vary over the replica axis, as the scan's carry must too.
        zeros, counts = varying.vary_like((zeros, counts), params)
        ((loss, metrics, grads), _), aux = jax.lax.scan(body, (zeros, counts), micro)
        scale = 1.0 / grad_accum_steps
        aux = {k: (OPTIMIZER_AUX | _MOE_AUX)[k](v, axis=0) for k, v in aux.items()}
        return (loss * scale, (jax.tree.map(lambda m: m * scale, metrics), aux)), fp8.mean(grads, scale)

    # Reductions over replicas; identities when GSPMD already sees the whole batch.
    if replica_axis:
        mean = lambda x: jax.lax.pmean(x, replica_axis)  # noqa: E731
        maximum = lambda x: jax.lax.pmax(x, replica_axis)  # noqa: E731
        every = lambda ok: jax.lax.pmin(ok.astype(jnp.int32), replica_axis).astype(bool)  # noqa: E731
    else:
        mean = maximum = every = lambda x: x  # noqa: E731

    def local_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        params, opt_state = state["params"], state["opt_state"]
        window = None if window_blocks is None else window_blocks(state["step"])
        (loss, (metrics, aux)), grads = accumulate(params, batch, window)
        # Per-head max logits of the whole batch (identity without replicas).
        aux = {k: maximum(v) if k in OPTIMIZER_AUX else v for k, v in aux.items()}
        updates, new_opt_state = tx.update(grads, opt_state, params, **{k: aux[k] for k in OPTIMIZER_AUX if k in aux})
        new_params = optax.apply_updates(params, updates)
        new_params = fp8.overwrite(new_params, grads, maximum)  # delayed FP8 scaling's new state is its gradient (lm/fp8.py)
        if "moe_counts" in aux:
            new_params = moe_lib.update_router_bias(new_params, params, aux["moe_counts"], balancing.bias_rate)
            metrics = {**metrics, **moe_lib.load_metrics(aux["moe_counts"], aux["moe_dropped"])}
        ok = every(jnp.isfinite(loss) & _all_finite(grads, updates, new_opt_state))
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
            "grad_norm": optax.tree.norm(fp8.split(grads)[0]),
            "update_norm": optax.tree.norm(updates),
        }
        metrics = {k: mean(v) for k, v in metrics.items()}
        metrics |= {"finite": ok, "bad_streak": new_state["bad_streak"], "skipped": new_state["skipped"]}
        if learning_rate is not None:
            metrics["lr"] = learning_rate(state["step"])
        return new_state, metrics

    if not replica_axis:
        return local_step
    return _replica_local(local_step, replica_axis)


_PER_REPLICA = ("params", "opt_state")


def _replica_local(local_step: Callable, axis: str) -> Callable:
    """``local_step`` run once per replica of mesh ``axis``, on that replica's slice of the state and batch."""
    spec = {k: jax.P(axis) if k in _PER_REPLICA else jax.P() for k in ("params", "opt_state", "step", "bad_streak", "skipped")}

    def body(state, batch):
        state = {k: jax.tree.map(lambda x: x[0], v) if k in _PER_REPLICA else v for k, v in state.items()}
        new_state, metrics = local_step(state, batch)
        return {k: jax.tree.map(lambda x: x[None], v) if k in _PER_REPLICA else v for k, v in new_state.items()}, metrics

    def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict]:
        step = jax.shard_map(body, in_specs=(spec, jax.P(axis)), out_specs=(spec, jax.P()), axis_names={axis})
        return step(state, batch)

    return train_step


def make_eval_step(model_def: model_lib.ModelDef) -> Callable[[Any, jax.Array], jax.Array]:
    """Mean next-token loss (nats per token) of ``params`` on a batch."""

    def eval_step(params, batch):
        return next_token_loss(model_def, params, batch)[0]

    return eval_step


def jit_train_step(step_fn, shardings: Shardings):
    return jax.jit(
        step_fn, in_shardings=(shardings.state, shardings.batch), out_shardings=(shardings.state, None), donate_argnums=0
    )


def make_weighted_eval_step(model_def: model_lib.ModelDef) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """``(sum of weighted next-token losses, sum of weights)`` of ``params`` on a batch with per-target weights
    (`lm.loss.weighted_nll`): a validation set that is not whole batches."""

    def eval_step(params, batch, weights):
        return weighted_nll(model_def, params, batch, weights)

    return eval_step


def jit_eval_step(eval_fn, shardings: Shardings, *, weighted: bool = False):
    """``eval_fn`` on the train state's parameters; in a replica-local run, on their replica mean. ``weighted``:
    ``eval_fn(params, batch, weights)`` with weights sharded as the batch (`make_weighted_eval_step`)."""
    batch = (shardings.batch,) * (2 if weighted else 1)
    if not shardings.replica_axis:
        return jax.jit(eval_fn, in_shardings=(shardings.params, *batch))

    def on_mean(params, *data):
        mean = jax.tree.map(lambda p, s: jax.lax.with_sharding_constraint(jnp.mean(p, axis=0), s), params, shardings.params)
        return eval_fn(mean, *data)

    return jax.jit(on_mean, in_shardings=(shardings.state["params"], *batch))


def global_batch(local_rows, shardings: Shardings) -> jax.Array:
    """A global array from this process's rows of the batch."""
    return jax.make_array_from_process_local_data(shardings.batch, local_rows)
