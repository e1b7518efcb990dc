r"""MT-DAO: local quasi-hyperbolic Adam with a slow first momentum, states averaged on their own periods.

Iacob et al., "MT-DAO: Multi-Timescale Distributed Adaptive Optimizers with Local Updates"
(arXiv:2510.05361, ICLR 2026). Every replica ``m`` runs, on its own gradients ``g``, an Adam whose
direction mixes the gradient and a slow first momentum (quasi-hyperbolic, Ma and Yarats'
QHAdam, the paper's ``N = 1`` form, which it finds sufficient)::

    u = b1 u + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    x = x - lr_t ( ((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps) + lambda x )

(``u_hat``, ``v_hat`` Adam's bias corrections), and the parameters, ``u`` and ``v`` are replaced by
their replica mean every ``K_x``, ``K_u`` and ``K_v`` steps, each just before the step that uses it
(the averaging of `optim.des_loc`, which MT-DAO generalises: ``omega = 1`` with a fast ``b1`` is
DES-LOC). A slow ``b1`` (half-life ``ln 0.5 / ln b1``: 693 steps at 0.999) keeps the global direction
across ``K_x`` local steps, where Adam's 0.9 (6.6 steps) forgets it; the gradient term keeps the step
responsive. Defaults: ``K_x = K_u = K_v = 32`` (the paper's runs); ``b1 = 0.999`` and ``omega = 0.7``
are QHAdam's recommended pair (Ma and Yarats, arXiv:1810.06801; the paper tunes them, its values
not read here; on a 200-step replica job a faster ``b1`` wins, docs/benchmarks.md 1b, but such a job
is shorter than the slow momentum's half-life); ``b2 = 0.95`` as the registry's AdamW (the paper's
base optimizer is ADOPT with ``b2 = 0.9999``; Adam here). Weight decay on `optim.labels.decay_mask`'s leaves.

The moments are an `optax.ScaleByAdamState`, so the averaging is `optim.des_loc`'s, its all-reduces
under `optim.cross_replica.sync_period` scopes (`experiments.bench_comm` amortises each over its
period).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from optim import des_loc, diloco, labels, shapes, spec


def scale_by_qh_adam(
    b1: float = 0.999, b2: float = 0.95, omega: float = 0.7, eps: float = 1e-8
) -> optax.GradientTransformation:
    """``((1 - omega) g + omega u_hat) / (sqrt(v_hat) + eps)``: quasi-hyperbolic Adam's direction, its
    moments in an `optax.ScaleByAdamState` (``mu`` = ``u``, ``nu`` = ``v``)."""

    def init_fn(params):
        zeros = lambda: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update_fn(updates, state, params=None):
        del params
        # float32 from the start, so `1 - b1` rounds as it does when optax.inject_hyperparams passes arrays
        b1_, b2_, omega_, eps_ = (jnp.asarray(h, jnp.float32) for h in (b1, b2, omega, eps))
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        mu = jax.tree.map(lambda u, g: b1_ * u + (1 - b1_) * g, state.mu, g32)
        nu = jax.tree.map(lambda v, g: b2_ * v + (1 - b2_) * g * g, state.nu, g32)

        # 1 - b^t as -expm1(t log b): at b1 = 0.999 the subtraction would cancel all but ~3 of float32's digits
        debias_u, debias_v = -jnp.expm1(t * jnp.log(b1_)), -jnp.expm1(t * jnp.log(b2_))

        def direction(g, u, v, like):
            mixed = (1 - omega_) * g + omega_ * u / debias_u
            return (mixed / (jnp.sqrt(v / debias_v) + eps_)).astype(like.dtype)

        out = jax.tree.map(direction, g32, mu, nu, updates)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTDAO(spec.OptimizerSpec):
    """MT-DAO (module docstring), replica-local: its update averages over ``axis_name`` itself.

    Attributes:
      b1: decay of the slow first momentum ``u``.
      b2: decay of the second moment ``v``.
      omega: the momentum's share of the direction; ``1 - omega`` is the gradient's.
      eps: added to ``sqrt(v_hat)``.
      weight_decay: decoupled weight decay ``lambda`` (times the learning rate) on `optim.labels.decay_mask`'s leaves.
      sync_every: ``K_x``, steps between two averages of the parameters.
      mu_sync_every: ``K_u``, steps between two averages of ``u``.
      nu_sync_every: ``K_v``, steps between two averages of ``v``.
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica).
    """

    # The registry's AdamW rate; bracketed by 1.5e-3 and 6e-3 on bench_comm's replica job (docs/benchmarks.md 1b).
    learning_rate: optax.ScalarOrSchedule = 3e-3
    b1: float = spec.param(0.999, valid="[0, 1)")
    b2: float = spec.param(0.95, valid="[0, 1)")
    omega: float = spec.param(0.7, valid="[0, 1]")
    eps: float = spec.param(1e-8, valid="[0, inf)")
    weight_decay: float = spec.param(0.1, valid="[0, inf)")
    sync_every: int = spec.param(32, valid="[1, inf)")
    mu_sync_every: int = spec.param(32, valid="[1, inf)")
    nu_sync_every: int = spec.param(32, valid="[1, inf)")
    axis_name: str | None = spec.code_only()

    replica_local: ClassVar[bool] = True
    applies_weight_decay: ClassVar[bool] = True
    static_args: ClassVar[tuple[str, ...]] = ("sync_every", "mu_sync_every", "nu_sync_every")

    def transform(self) -> optax.GradientTransformationExtraArgs:
        k_x, k_u, k_v = diloco.static_ints(
            self.static_args, sync_every=self.sync_every, mu_sync_every=self.mu_sync_every, nu_sync_every=self.nu_sync_every
        )
        local = optax.chain(
            scale_by_qh_adam(self.b1, self.b2, self.omega, self.eps),
            optax.add_decayed_weights(self.weight_decay, labels.decay_mask),
            optax.scale_by_learning_rate(self.learning_rate),
        )
        return shapes.checked(des_loc.averaged_moments(local, k_x, k_u, k_v, self.axis_name), "mt_dao")


mt_dao = spec.function(MTDAO, name="mt_dao")
