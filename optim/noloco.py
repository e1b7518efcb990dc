r"""NoLoCo: DiLoCo without the all-reduce; each outer step averages with one partner replica.

Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large Models",
arXiv:2506.10911; the reference matched is the authors' code (github.com/jkolehm/noloco,
``SparseOptimizerC`` with ``local_group_size=2``, which their ``noloco`` configs run).

Every replica ``i`` runs an inner optimizer on its own data from its fast weights ``theta_i`` and
keeps its own slow weights ``phi_i`` and outer momentum ``delta_i``. Every ``H`` inner steps it pairs
with one partner ``j`` (no collective over all replicas: one exchange between the two) and takes the
paper's modified Nesterov step, with ``Delta = phi - theta`` the outer gradient:

    delta_i = alpha delta_i - beta mean_{i,j}(Delta) - gamma (phi_i - mean_{i,j}(phi))
    phi_i   = phi_i + delta_i;   theta_i = phi_i

``alpha`` is ``outer_momentum``, ``beta`` ``outer_learning_rate`` and ``gamma`` ``partner_pull``,
which pulls the replicas' slow weights together (they differ, since no step averages all of them).
Defaults are the authors' ``noloco`` configs: ``H = 50``, ``alpha = 0.5``, ``beta = 0.7`` and
``gamma = beta`` (their code ties the two). With ``gamma = beta`` the step only needs the partner's
``theta`` (``beta mean(Delta) + beta (phi_i - mean(phi)) = beta (phi_i - mean(theta))``), so only
``theta`` crosses the network; otherwise ``theta`` and ``phi`` do.

Partners: the reference draws a random pairing every round. Here round ``k`` (``k = 0, 1, ...``)
takes pairing ``k mod (W - 1)`` of the round-robin (circle) schedule of ``W`` replicas, in which every
pair meets once every ``W - 1`` rounds: deterministic from the step, and each pairing one static
`jax.lax.ppermute` (a `jax.lax.switch` picks the round's). ``W`` must be even. One replica
(``axis_name=None``) is its own partner: ``delta = alpha delta - beta Delta``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from optim import cross_replica, diloco, spec


def round_robin_partners(replicas: int) -> list[list[int]]:
    """The circle method: ``replicas - 1`` perfect matchings of ``0..replicas-1`` (even), every pair in one.

    ``out[r][i]`` is replica ``i``'s partner in round ``r``.
    """
    if replicas % 2:
        raise ValueError(f"noloco pairs replicas, so their number must be even; got {replicas}: use an even replica axis")
    last = replicas - 1
    out = []
    for r in range(last):
        partner = [0] * replicas
        pairs = [(r, last)] + [((r + k) % last, (r - k) % last) for k in range(1, replicas // 2)]
        for a, b in pairs:
            partner[a], partner[b] = b, a
        out.append(partner)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoLoCo(diloco.DiLoCo):
    """NoLoCo around ``inner`` (see the module docstring for the rule and the partner schedule).

    Attributes:
      inner: the replicas' optimizer (`optim.build` builds it from ``optimizer.noloco.inner``).
      sync_every: ``H``, inner steps between two exchanges with a partner.
      outer_learning_rate: ``beta``, the step along the pair's mean outer gradient.
      outer_momentum: ``alpha``, the outer momentum.
      partner_pull: ``gamma``, the pull of a replica's slow weights toward the pair's mean.
      warm_start_steps: data-parallel steps before the first round (as DiLoCo's).
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica).
    """

    sync_every: int = spec.param(50, valid="[1, inf)")
    outer_momentum: float = spec.param(0.5, valid="[0, 1)")
    partner_pull: float = spec.param(0.7, valid="[0, inf)")

    def transform(self) -> optax.GradientTransformationExtraArgs:
        sync_every, warm_start_steps = diloco.static_ints(
            self.static_args, sync_every=self.sync_every, warm_start_steps=self.warm_start_steps
        )
        diloco.check_outer(sync_every, self.outer_learning_rate, self.outer_momentum, warm_start_steps)
        synchronise = functools.partial(
            _synchronise, sync_every, self.outer_learning_rate, self.outer_momentum, self.partner_pull, self.axis_name
        )
        return diloco.local_rounds(self.inner, synchronise, axis_name=self.axis_name, warm_start_steps=warm_start_steps, name="noloco")


def _synchronise(sync_every, beta, alpha, gamma, axis_name, rounds, local, phi, delta):
    replicas = cross_replica.replica_count(axis_name)
    schedule = round_robin_partners(replicas) if replicas > 1 else [[0]]
    theta_only = diloco.is_concrete(beta) and diloco.is_concrete(gamma) and beta == gamma

    def outer_step(partner, local, phi, delta):
        theta = jax.tree.map(lambda x: x.astype(jnp.float32), local)
        sent = theta if theta_only else (theta, phi)
        if replicas > 1:
            perm = [(i, j) for i, j in enumerate(partner)]
            sent = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), sent)
        if theta_only:
            pull = jax.tree.map(lambda p, t, u: beta * (p - (t + u) / 2), phi, theta, sent)
        else:
            partner_theta, partner_phi = sent
            pull = jax.tree.map(
                lambda p, t, pp, pt: beta * ((p + pp) / 2 - (t + pt) / 2) + gamma * (p - pp) / 2, phi, theta, partner_phi, partner_theta
            )
        delta = jax.tree.map(lambda d, g: alpha * d - g, delta, pull)
        phi = jax.tree.map(jnp.add, phi, delta)
        return jax.tree.map(lambda p, x: p.astype(x.dtype), phi, local), phi, delta

    keep = lambda local, phi, delta: (local, phi, delta)  # noqa: E731
    branches = [keep] + [functools.partial(outer_step, partner) for partner in schedule]
    due = (rounds > 0) & (rounds % sync_every == 0)
    index = jnp.where(due, 1 + (rounds // sync_every - 1) % len(schedule), 0)
    return jax.lax.switch(index, branches, local, phi, delta)


noloco = spec.function(NoLoCo, name="noloco")
