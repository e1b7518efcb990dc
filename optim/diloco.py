r"""DiLoCo and Streaming DiLoCo: replicas train alone for H steps, then average where they went.

**DiLoCo** (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105, Algorithm 1). Every replica ``w`` runs an inner optimizer (AdamW in the paper; any
optax transform here) on its own data and parameters ``theta_w``, its inner state kept across rounds.
Every ``H`` inner steps the replicas exchange the *outer gradient* and take one outer step from the
last synchronised parameters ``theta``:

    Delta = mean_w (theta - theta_w)                 # one all-reduce of the parameters every H steps
    m     = mu m + Delta                             # outer Nesterov SGD (PyTorch's nesterov=True,
    theta = theta - eta (Delta + mu m)               #   as in the paper): eta = 0.7, mu = 0.9
    theta_w = theta                                  # every replica restarts from the new theta

With one replica, ``H = 1``, ``eta = 1`` and ``mu = 0`` the outer step undoes nothing and DiLoCo is
its inner optimizer; with ``eta = 1``, ``mu = 0`` it is parameter averaging every ``H`` steps.

*Warm start* (``warm_start_steps = W``, both variants): the paper starts DiLoCo from a model
pretrained with data parallelism. The first ``W`` steps are that data-parallel phase: the inner
optimizer takes the replica mean of the gradients (one all-reduce per step; the replicas stay
identical), ``theta`` follows the parameters, and the rounds start at step ``W`` (synchronisations
at ``W + k H``; Streaming's fragment offsets count from ``W`` too).

**Streaming DiLoCo** (Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv:2501.18512, Algorithm 2). The parameters are cut into ``P`` fragments, strided over layers
(layer ``l`` of the stack under ``layer_key`` is in fragment ``l mod P``; leaves outside the stack go
with fragment 0). Fragment ``p`` is synchronised every ``H`` steps, offset by ``t_p = floor(p H / P)``,
so only ``1/P`` of the model crosses the network at a time. Its outer gradient is *sent* at step
``t`` (``t = t_p mod H``) and *received* ``tau`` steps later, while the replicas keep training:

    send    (t):        Delta_p = mean_w (theta_p - theta_{w,p}(t))       # exchanged in `exchange` precision
    receive (t + tau):  m_p = mu m_p + Delta_p;  theta_p = theta_p - eta (Delta_p + mu m_p)
                        theta_{w,p} = alpha theta_{w,p}(t + tau) + (1 - alpha) theta_p

The overlap is simulated in SPMD: the all-reduce runs (blocking) at the send step and its result
waits in the state for ``tau`` steps, which is the algorithm an overlapped implementation computes.
``P = 1``, ``tau = 0``, ``alpha = 0`` is DiLoCo. Outer gradients may travel as bfloat16, int8 or int4
codes with fp32 accumulation (`optim.cross_replica.quantized_mean`); the paper's 4-bit format is FP4
(E3M0), ours the 4-bit dynamic code of `optim.quantization`.

Both are wrappers: ``inner`` sees the replica's *local* gradients, and the update returned moves the
parameters to ``theta_w`` (after ``theta + (theta_w - theta)``, one rounding from it). Build them with
``axis_name`` = the replica axis of the enclosing `jax.shard_map` (None: one replica). Extra keyword
arguments of ``update`` go to ``inner``. Under `optax.inject_hyperparams` the integer arguments that
set the round schedule are static (``static_args`` of the specs); the outer learning rate, momentum
and Streaming's mixing may be injected.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import common, cross_replica, labels, shapes, spec


class DiLoCoState(NamedTuple):
    """State of `diloco` (per replica; all but ``inner`` agree across replicas)."""

    count: jax.Array  # inner steps taken
    outer_params: optax.Params  # theta: the parameters of the last synchronisation
    outer_momentum: optax.Params  # m of the outer Nesterov SGD
    inner: optax.OptState  # the inner optimizer's state, kept across rounds


class StreamingDiLoCoState(NamedTuple):
    """State of `streaming_diloco`: `DiLoCoState` plus outer gradients waiting for their receive step."""

    count: jax.Array
    outer_params: optax.Params
    outer_momentum: optax.Params
    pending: optax.Params  # Delta_p of fragments sent but not yet received
    inner: optax.OptState


def outer_nesterov(theta: Any, m: Any, delta: Any, lr: float, momentum: float) -> tuple[Any, Any]:
    """One outer Nesterov SGD step on outer gradient ``delta`` (arrays or pytrees): returns ``(theta, m)``."""
    m = jax.tree.map(lambda m, d: momentum * m + d, m, delta)
    return jax.tree.map(lambda t, m, d: t - lr * (d + momentum * m), theta, m, delta), m


def static_ints(static_args: Sequence[str], **values: Any) -> list[int]:
    """``values`` as Python ints: they set the schedule's Python control flow (or shapes), so under
    `optax.inject_hyperparams` they must be static (`common.static_int` names them)."""
    return [common.static_int(name, v, static_args) for name, v in values.items()]


def is_concrete(x: Any) -> bool:
    """Whether ``x`` can be range-checked in Python (not an injected hyperparameter)."""
    return isinstance(x, numbers.Real)


def check_outer(sync_every: int, outer_learning_rate: Any, outer_momentum: Any, warm_start_steps: int = 0) -> None:
    """Raises a ValueError naming the bad value among the outer loop's settings (shared by DiLoCo's variants)."""
    if warm_start_steps < 0:
        raise ValueError(f"warm_start_steps={warm_start_steps} must be >= 0 (data-parallel steps before the first round)")
    if sync_every < 1:
        raise ValueError(f"sync_every={sync_every} must be >= 1 (inner steps between synchronisations)")
    if is_concrete(outer_learning_rate) and is_concrete(outer_momentum):
        if outer_learning_rate <= 0 or not 0 <= outer_momentum < 1:
            raise ValueError(
                f"outer_learning_rate={outer_learning_rate} must be > 0 and outer_momentum={outer_momentum} in [0, 1)"
            )


def _inner_step(inner, grads, inner_state, params, extra_args):
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
    return optax.apply_updates(params, updates), inner_state


def _warm_start(warm_start_steps: int, axis_name: str | None):
    """``(grads, count) -> grads`` of the data-parallel phase and ``(theta, local, count) -> theta``."""
    if not warm_start_steps:
        return (lambda grads, count: grads), (lambda theta, local, count: theta)

    def gradients(grads, count):
        if axis_name is None:
            return grads
        # The mean is the same on every replica; cast back to per-replica values so both branches agree.
        mean = lambda g: jax.lax.pcast(jax.lax.pmean(g, axis_name), axis_name, to="varying")  # noqa: E731
        return jax.lax.cond(count < warm_start_steps, mean, lambda g: g, grads)

    def outer(theta, local, count):  # ``count``: steps taken including this one
        return jax.tree.map(lambda t, x: jnp.where(count <= warm_start_steps, x.astype(jnp.float32), t), theta, local)

    return gradients, outer


def _outer_init(params: optax.Params) -> tuple[optax.Params, optax.Params]:
    # A copy even of a float32 parameter: the state must never alias the parameter's buffer.
    as_f32 = lambda p: jnp.array(p, jnp.float32, copy=True)  # noqa: E731
    return jax.tree.map(as_f32, params), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiLoCo(spec.WrapperSpec):
    """DiLoCo around ``inner``: ``sync_every`` (H) local steps, then the averaged outer Nesterov step.

    `optim.build` builds ``inner`` from ``optimizer.diloco.inner`` (default ``adamw``) with that
    optimizer's own keys and the run's learning-rate schedule.

    Attributes:
      inner: the replicas' optimizer (an optax transform).
      sync_every: ``H``, inner steps between two synchronisations.
      outer_learning_rate: ``eta`` of the outer Nesterov SGD.
      outer_momentum: ``mu`` of the outer Nesterov SGD.
      warm_start_steps: ``W``, data-parallel steps before the first round (module docstring).
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica).
    """

    sync_every: int = spec.param(500, valid="[1, inf)")
    outer_learning_rate: float = spec.param(0.7, valid="(0, inf)")
    outer_momentum: float = spec.param(0.9, valid="[0, 1)")
    warm_start_steps: int = spec.param(0, valid="[0, inf)")
    axis_name: str | None = spec.code_only()

    replica_local: ClassVar[bool] = True
    static_args: ClassVar[tuple[str, ...]] = ("sync_every", "warm_start_steps")

    def transform(self) -> optax.GradientTransformationExtraArgs:
        return _diloco(
            self.inner, self.sync_every, self.outer_learning_rate, self.outer_momentum, self.axis_name,
            self.warm_start_steps,
        )  # fmt: skip


def _diloco(
    inner: optax.GradientTransformation,
    sync_every: int,
    outer_learning_rate: float,
    outer_momentum: float,
    axis_name: str | None,
    warm_start_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
    sync_every, warm_start_steps = static_ints(DiLoCo.static_args, sync_every=sync_every, warm_start_steps=warm_start_steps)
    check_outer(sync_every, outer_learning_rate, outer_momentum, warm_start_steps)
    mean = (lambda t: t) if axis_name is None else (lambda t: jax.lax.pmean(t, axis_name))  # noqa: E731

    def synchronise(rounds, local, theta, momentum):
        def outer_step(local, theta, momentum):
            delta = mean(jax.tree.map(lambda t, x: t - x.astype(jnp.float32), theta, local))
            theta, momentum = outer_nesterov(theta, momentum, delta, outer_learning_rate, outer_momentum)
            return jax.tree.map(lambda t, x: t.astype(x.dtype), theta, local), theta, momentum

        keep = lambda local, theta, momentum: (local, theta, momentum)  # noqa: E731
        return jax.lax.cond((rounds > 0) & (rounds % sync_every == 0), outer_step, keep, local, theta, momentum)

    return local_rounds(inner, synchronise, axis_name=axis_name, warm_start_steps=warm_start_steps, name="diloco")


def local_rounds(
    inner: optax.GradientTransformation,
    synchronise: Callable[[jax.Array, Any, Any, Any], tuple[Any, Any, Any]],
    *,
    axis_name: str | None,
    warm_start_steps: int,
    name: str,
) -> optax.GradientTransformationExtraArgs:
    """The DiLoCo family's step: ``inner`` on the replica's gradients, then ``synchronise``.

    ``synchronise(rounds, local, theta, m) -> (local, theta, m)`` gets the steps taken since the warm
    start (this one included), the replica's parameters after its inner step, the outer parameters
    ``theta`` and the outer momentum ``m`` (fp32), and decides itself (`jax.lax.cond` /
    `jax.lax.switch` on ``rounds``) whether this step synchronises. The state is a `DiLoCoState`.
    """
    inner = optax.with_extra_args_support(inner)
    warm_gradients, warm_outer = _warm_start(warm_start_steps, axis_name)

    def init_fn(params):
        theta, momentum = _outer_init(params)
        return DiLoCoState(jnp.zeros((), jnp.int32), theta, momentum, inner.init(params))

    def update_fn(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError(f"{name} needs params: call update(grads, state, params)")
        shapes.check_like(grads, state.outer_momentum, name)
        local, inner_state = _inner_step(inner, warm_gradients(grads, state.count), state.inner, params, extra_args)
        count = state.count + 1
        theta = warm_outer(state.outer_params, local, count)
        new, theta, momentum = synchronise(count - warm_start_steps, local, theta, state.outer_momentum)
        updates = jax.tree.map(lambda n, p: n - p, new, params)
        return updates, DiLoCoState(count, theta, momentum, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fragment_slices(params: Any, fragments: int, layer_key: str = "blocks") -> list[list[Any]]:
    """Per leaf of ``params`` (flattened order), per fragment: the index of its part, or None.

    A fragment may hold nothing (more fragments than layers): its synchronisations are no-ops.

    A leaf under ``layer_key`` with an integer index after it (unscanned layers) belongs whole to
    fragment ``index mod P``; one without (scan-stacked, layers on axis 0) is split: slice ``l`` to
    fragment ``l mod P``; other leaves belong to fragment 0.
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = labels.path_names(path)
        where = names.index(layer_key) if layer_key in names else None
        parts: list[Any] = [None] * fragments
        if where is None:
            parts[0] = ...
        elif where + 1 < len(names) and names[where + 1].isdigit():
            parts[int(names[where + 1]) % fragments] = ...
        else:
            for p in range(min(fragments, leaf.shape[0])):
                parts[p] = slice(p, None, fragments)
        out.append(parts)
    return out


def _offsets(sync_every: int, fragments: int) -> Sequence[int]:
    return [p * sync_every // fragments for p in range(fragments)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo around ``inner`` (see the module docstring for the rule).

    Attributes:
      inner: the replicas' optimizer (`optim.build` builds it from ``optimizer.streaming_diloco.inner``).
      sync_every: ``H``, inner steps between two synchronisations of one fragment.
      fragments: ``P``; fragment ``p`` is sent at steps ``floor(p H / P) mod H``.
      overlap: ``tau`` in ``[0, H)``, steps between sending an outer gradient and applying it.
      mixing: ``alpha``, the weight of the replica's own parameters when a fragment is received.
      exchange: outer-gradient precision on the wire: float32, bfloat16, int8 or int4.
      outer_learning_rate, outer_momentum: the outer Nesterov SGD.
      layer_key: the path name of the layer stack that fragments stride over.
      axis_name: the replica axis (None: one replica).
    """

    sync_every: int = spec.param(100, valid="[1, inf)")
    fragments: int = spec.param(2, valid="[1, inf)")
    overlap: int = spec.param(1, valid="[0, inf)")
    mixing: float = spec.param(0.5, valid="[0, 1]")
    exchange: str = "int4"
    layer_key: str = "blocks"

    static_args: ClassVar[tuple[str, ...]] = ("sync_every", "warm_start_steps", "fragments", "overlap")

    def transform(self) -> optax.GradientTransformationExtraArgs:
        fields = spec.values(self, StreamingDiLoCo)
        del fields["inner"]
        return _streaming_diloco(self.inner, **fields)


def _streaming_diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    fragments: int,
    overlap: int,
    mixing: float,
    exchange: str,
    outer_learning_rate: float,
    outer_momentum: float,
    layer_key: str,
    axis_name: str | None,
    warm_start_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
    sync_every, warm_start_steps, fragments, overlap = static_ints(
        StreamingDiLoCo.static_args,
        sync_every=sync_every, warm_start_steps=warm_start_steps, fragments=fragments, overlap=overlap,
    )  # fmt: skip
    check_outer(sync_every, outer_learning_rate, outer_momentum, warm_start_steps)
    inner = optax.with_extra_args_support(inner)
    warm_gradients, warm_outer = _warm_start(warm_start_steps, axis_name)
    if fragments < 1 or not 0 <= overlap < sync_every or (is_concrete(mixing) and not 0 <= mixing <= 1):
        raise ValueError(
            f"streaming_diloco needs fragments >= 1 (got {fragments}), 0 <= overlap < sync_every "
            f"(got {overlap}, {sync_every}) and 0 <= mixing <= 1 (got {mixing})"
        )
    cross_replica.check_exchange(exchange)
    offsets = _offsets(sync_every, fragments)

    def init_fn(params):
        theta, momentum = _outer_init(params)
        pending = jax.tree.map(jnp.zeros_like, momentum)
        return StreamingDiLoCoState(jnp.zeros((), jnp.int32), theta, momentum, pending, inner.init(params))

    def due(count, offset, delay):
        """Whether ``count`` is ``offset + delay`` plus a multiple of H (and the first such step has come)."""
        since = count - offset - delay
        return (since >= 0) & (since % sync_every == 0) & (count - delay > 0)

    def update_fn(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("streaming_diloco needs params: call update(grads, state, params)")
        shapes.check_like(grads, state.outer_momentum, "streaming_diloco")
        local, inner_state = _inner_step(inner, warm_gradients(grads, state.count), state.inner, params, extra_args)
        count = state.count + 1
        rounds = count - warm_start_steps  # fragment schedules start after the warm start
        leaves, treedef = jax.tree.flatten(local)
        outer = warm_outer(state.outer_params, local, count)
        theta, momentum, pending = (treedef.flatten_up_to(t) for t in (outer, state.outer_momentum, state.pending))
        slices = fragment_slices(local, fragments, layer_key)

        for p in range(fragments):
            where = [(i, s[p]) for i, s in enumerate(slices) if s[p] is not None]
            if not where:
                continue

            def send(args, where=where):
                leaves, theta, pending = args
                delta = jnp.concatenate([(theta[i][s] - leaves[i][s].astype(jnp.float32)).ravel() for i, s in where])
                delta = cross_replica.quantized_mean(delta, axis_name, exchange)
                pending, start = list(pending), 0
                for i, s in where:
                    size = int(np.prod(pending[i][s].shape))
                    pending[i] = pending[i].at[s].set(delta[start : start + size].reshape(pending[i][s].shape))
                    start += size
                return pending

            def receive(args, where=where):
                leaves, theta, momentum, pending = (list(a) for a in args)
                for i, s in where:
                    t, m = outer_nesterov(theta[i][s], momentum[i][s], pending[i][s], outer_learning_rate, outer_momentum)
                    theta[i], momentum[i] = theta[i].at[s].set(t), momentum[i].at[s].set(m)
                    mixed = mixing * leaves[i][s].astype(jnp.float32) + (1 - mixing) * t
                    leaves[i] = leaves[i].at[s].set(mixed.astype(leaves[i].dtype))
                return leaves, theta, momentum, pending

            pending = jax.lax.cond(due(rounds, offsets[p], 0), send, lambda a: list(a[2]), (leaves, theta, pending))
            leaves, theta, momentum, pending = jax.lax.cond(
                due(rounds, offsets[p], overlap), receive, lambda a: tuple(list(x) for x in a), (leaves, theta, momentum, pending)
            )

        new = treedef.unflatten(leaves)
        updates = jax.tree.map(lambda n, p: n - p, new, params)
        state = StreamingDiLoCoState(count, *(treedef.unflatten(t) for t in (theta, momentum, pending)), inner_state)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


diloco = spec.function(DiLoCo, name="diloco")
streaming_diloco = spec.function(StreamingDiLoCo, name="streaming_diloco")
