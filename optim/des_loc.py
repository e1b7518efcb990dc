r"""DES-LOC: replicas run Adam alone and average parameters and each moment on its own period.

Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training Foundation
Models", arXiv:2505.22549 (Algorithm 1). Every replica ``w`` runs Adam on its own gradients; the
parameters, the first moment and the second moment are replaced by their replica mean
``E_w[.]`` every ``K_x``, ``K_u`` and ``K_v`` steps, each just before the step ``t`` that uses it:

    u_w = E_w[u_w] if t mod K_u = 0;   v_w = E_w[v_w] if t mod K_v = 0;   x_w = E_w[x_w] if t mod K_x = 0
    u_w = b1 u_w + (1 - b1) g_w;   v_w = b2 v_w + (1 - b2) g_w^2;   x_w = x_w - lr_t u_hat_w / (sqrt(v_hat_w) + eps)

(the last line is the inner optimizer's step: AdamW by default, with its bias correction and decay
of the averaged ``x``). The moments change more slowly than the parameters (half-life
``ln 0.5 / ln b``), so they are synchronised less often: the paper recommends ``K_u = 3 K_x`` and
``K_v = 6 K_x``, the defaults here with ``K_x = 32`` (ours, not swept). ``K_x = K_u = K_v`` is
Local Adam; one replica is the inner optimizer. The paper clips each replica's gradient first;
here the train step's clipping applies.

A wrapper: ``inner`` must hold its moments in `optax.ScaleByAdamState` (``mu``, ``nu``), as
`optax.adam` / `optax.adamw` and the registered ``adamw`` do; each such state is synchronised (any
other state of ``inner`` stays local). The three averages are all-reduces under
`optim.cross_replica.sync_period` scopes, so `experiments.bench_comm` amortises each over its own
period.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import cross_replica, diloco, spec


class DESLOCState(NamedTuple):
    """State of `des_loc` (per replica)."""

    count: jax.Array  # steps taken
    inner: optax.OptState  # the inner optimizer's state; its Adam moments are synchronised


def _is_adam(x: Any) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _check_has_moments(inner_state: Any) -> None:
    if not any(_is_adam(x) for x in jax.tree.leaves(inner_state, is_leaf=_is_adam)):
        raise ValueError(
            "des_loc synchronises Adam's moments, but its inner optimizer keeps no optax.ScaleByAdamState; "
            "use an Adam-family inner optimizer, e.g. optimizer.des_loc.inner=adamw"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DESLOC(spec.WrapperSpec):
    """DES-LOC around ``inner`` (see the module docstring for the rule).

    Attributes:
      inner: the replicas' Adam-family optimizer (`optim.build` builds it from ``optimizer.des_loc.inner``).
      sync_every: ``K_x``, steps between two averages of the parameters.
      mu_sync_every: ``K_u``, steps between two averages of the first moment.
      nu_sync_every: ``K_v``, steps between two averages of the second moment.
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica).
    """

    sync_every: int = spec.param(32, valid="[1, inf)")
    mu_sync_every: int = spec.param(96, valid="[1, inf)")
    nu_sync_every: int = spec.param(192, valid="[1, inf)")
    axis_name: str | None = spec.code_only()

    replica_local: ClassVar[bool] = True
    static_args: ClassVar[tuple[str, ...]] = ("sync_every", "mu_sync_every", "nu_sync_every")

    def transform(self) -> optax.GradientTransformationExtraArgs:
        k_x, k_u, k_v = diloco.static_ints(
            self.static_args, sync_every=self.sync_every, mu_sync_every=self.mu_sync_every, nu_sync_every=self.nu_sync_every
        )
        return averaged_moments(self.inner, k_x, k_u, k_v, self.axis_name)


def averaged_moments(inner: optax.GradientTransformation, k_x: int, k_u: int, k_v: int, axis_name: str | None):
    """``inner`` on each replica, its parameters and Adam moments averaged every ``k_x``, ``k_u``, ``k_v``
    steps (module docstring); also `optim.mt_dao`'s averaging."""
    inner = optax.with_extra_args_support(inner)

    def mean(tree):
        if axis_name is None:
            return tree
        average = lambda x: jax.lax.pmean(x.astype(jnp.float32), axis_name).astype(x.dtype)  # noqa: E731
        return jax.tree.map(lambda x: jax.lax.pcast(average(x), axis_name, to="varying"), tree)

    def averaged_every(period, t, tree):
        with cross_replica.sync_period(period):
            return jax.lax.cond(t % period == 0, mean, lambda x: x, tree)

    def init_fn(params):
        inner_state = inner.init(params)
        _check_has_moments(inner_state)
        return DESLOCState(jnp.zeros((), jnp.int32), inner_state)

    def update_fn(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("des_loc needs params: call update(grads, state, params)")
        _check_has_moments(state.inner)
        t = state.count + 1

        def moments(s):
            if not _is_adam(s):
                return s
            return s._replace(mu=averaged_every(k_u, t, s.mu), nu=averaged_every(k_v, t, s.nu))

        inner_state = jax.tree.map(moments, state.inner, is_leaf=_is_adam)
        start = averaged_every(k_x, t, params)
        updates, inner_state = inner.update(grads, inner_state, start, **extra_args)
        new = optax.apply_updates(start, updates)
        return jax.tree.map(lambda n, p: n - p, new, params), DESLOCState(t, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


des_loc = spec.function(DESLOC, name="des_loc")
