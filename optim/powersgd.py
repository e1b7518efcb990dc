r"""PowerSGD: rank-r gradient compression across data-parallel replicas (Vogels et al., "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization", arXiv:1905.13727, Algorithm 1
with error feedback; the warm start and the uncompressed-when-it-does-not-pay rule follow PyTorch's
``powerSGD_hook``).

Each replica ``w`` holds its local gradient ``g_w`` of a matrix ``(n, m)`` and an error memory
``e_w``; all replicas share ``Q`` ``(m, r)`` (warm-started from the previous step, Gaussian at the
first). One step, with ``mean_w`` an all-reduce over the replica axis:

    M_w = g_w + e_w
    P   = mean_w(M_w Q)                      # all-reduce of n r numbers
    P^  = orthonormalise(P)                  # Gram-Schmidt over the r columns
    Q   = mean_w(M_w^T P^)                   # all-reduce of m r numbers; kept for the next step
    G^  = P^ Q^T                             # = mean_w(P^ P^T M_w): the same on every replica
    e_w = M_w - G^

``G^`` replaces the gradient. ``r`` is ``min(rank, n, m)`` per matrix (a higher rank cannot add
anything and would leave ``P`` with dependent columns). With ``r = min(n, m)`` (and ``M Q`` of full rank) ``P^ P^T`` is a
projection onto the whole column space, ``G^ = mean_w M_w`` and, since the errors then sum to zero
over replicas, every step equals a plain all-reduce of the gradients. Leading axes are batch axes
(scan-stacked layers: one ``Q`` per layer). Leaves that are vectors (norm scales, biases, stacked or
not) and matrices where ``n m <= min_compression_rate * r (n + m)`` (too little saving; PyTorch's
default rate is 2, ours 1: compress whenever it saves bytes) are all-reduced uncompressed.

As PyTorch's ``start_powerSGD_iter``, the first ``start_iter`` steps (default 0) all-reduce the
gradients uncompressed (error memories stay zero, ``Q`` keeps its Gaussian start): compression then
starts from trained, lower-rank gradients. Under `optax.inject_hyperparams` ``rank``,
``min_compression_rate`` and ``start_iter`` set the state's shapes or Python control flow and must be
static (``static_args`` of the spec).

`scale_by_powersgd` is the compressor; `powersgd` feeds its output to any optimizer (AdamW by
default in the registry; the paper's own choice is SGD with momentum).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, labels, shapes, spec


class ScaleByPowerSGDState(NamedTuple):
    """State of `scale_by_powersgd`; uncompressed leaves hold `optax.MaskedNode`."""

    count: jax.Array  # steps taken (int32), for ``start_iter``
    q: optax.Updates  # (*batch, m, r), identical on every replica
    error: optax.Updates  # e_w, shaped like the parameter, local to each replica


def leaf_rank(shape: tuple[int, ...], rank: int) -> int:
    """``min(rank, n, m)`` for a matrix ``(*batch, n, m)``: the rank PowerSGD uses on it."""
    return min(rank, *shape[-2:])


def compresses(path, shape: tuple[int, ...], rank: int, min_compression_rate: float = 1.0) -> bool:
    """Whether a leaf is compressed: a matrix (not a vector by role) that its rank shrinks enough."""
    if labels.is_vector(path, shape):
        return False
    n, m = shape[-2:]
    return n * m > min_compression_rate * leaf_rank(shape, rank) * (n + m)


def orthonormalize(p: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Gram-Schmidt over the last axis of ``p`` ``(..., n, r)``: orthonormal columns (zero stays zero)."""
    cols = []
    for i in range(p.shape[-1]):
        v = p[..., i]
        for u in cols:
            v = v - jnp.sum(u * v, axis=-1, keepdims=True) * u
        cols.append(v / (jnp.linalg.norm(v, axis=-1, keepdims=True) + eps))
    return jnp.stack(cols, axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGDCompressor:
    """Replaces each replica's gradient by the rank-``rank`` PowerSGD estimate of the replica mean.

    Attributes:
      rank: ``r``, columns of ``P`` and ``Q`` (at most ``min(n, m)`` per matrix).
      min_compression_rate: compress a matrix only when ``n m / (r (n + m))`` exceeds this (0: always).
      seed: seed of the initial Gaussian ``Q`` (the same on every replica).
      start_iter: steps all-reduced uncompressed before compression starts (PyTorch's
        ``start_powerSGD_iter``; 0: compress from the first step).
      axis_name: the replica axis of the enclosing `jax.shard_map` (None: one replica, no collectives).
    """

    rank: int = spec.param(4, valid="[1, inf)")
    min_compression_rate: float = spec.param(1.0, valid="[0, inf)")
    seed: int = 0
    start_iter: int = spec.param(0, valid="[0, inf)")
    axis_name: str | None = spec.code_only()

    replica_local: ClassVar[bool] = True
    static_args: ClassVar[tuple[str, ...]] = ("rank", "min_compression_rate", "start_iter")

    def compressor(self) -> optax.GradientTransformation:
        rank = common.static_int("rank", self.rank, self.static_args)
        start_iter = common.static_int("start_iter", self.start_iter, self.static_args)
        try:
            min_compression_rate = float(self.min_compression_rate)
        except jax.errors.ConcretizationTypeError:
            raise ValueError(
                "min_compression_rate decides which leaves have state and must be a Python float; with "
                f"optax.inject_hyperparams pass static_args={self.static_args}"
            ) from None
        axis_name, seed = self.axis_name, self.seed
        if rank < 1:
            raise ValueError(f"powersgd rank={rank} must be >= 1")
        mean = (lambda x: x) if axis_name is None else (lambda x: jax.lax.pmean(x, axis_name))  # noqa: E731
        hi = jax.lax.Precision.HIGHEST

        def init_fn(params):
            leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
            keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
            qs, errors = [], []
            for key, (path, p) in zip(keys, leaves, strict=False):
                if compresses(path, p.shape, rank, min_compression_rate):
                    r = leaf_rank(p.shape, rank)
                    qs.append(jax.random.normal(key, (*p.shape[:-2], p.shape[-1], r), jnp.float32))
                    errors.append(jnp.zeros(p.shape, jnp.float32))
                else:
                    qs.append(optax.MaskedNode())
                    errors.append(optax.MaskedNode())
            return ScaleByPowerSGDState(
                count=jnp.zeros([], jnp.int32), q=treedef.unflatten(qs), error=treedef.unflatten(errors)
            )

        def compress(g, q, e):
            if isinstance(q, optax.MaskedNode):
                return mean(g), q, e
            m = g.astype(jnp.float32) + e
            p = orthonormalize(mean(jnp.einsum("...nm,...mr->...nr", m, q, precision=hi)))
            q = mean(jnp.einsum("...nm,...nr->...mr", m, p, precision=hi))
            approx = jnp.einsum("...nr,...mr->...nm", p, q, precision=hi)
            return approx.astype(g.dtype), q, m - approx

        def compress_all(leaves, qs, errors):
            outs = [compress(*t) for t in zip(leaves, qs, errors, strict=True)]
            return tuple(list(column) for column in zip(*outs, strict=True))

        def all_reduce(leaves, qs, errors):
            # Q is the same on every replica; its mean types it as such, as the compressing branch does.
            return [mean(g) for g in leaves], [q if isinstance(q, optax.MaskedNode) else mean(q) for q in qs], errors

        def update_fn(updates, state, params=None):
            del params
            leaves, treedef = jax.tree.flatten(updates)
            if not leaves:
                return updates, state
            qs, errors = treedef.flatten_up_to(state.q), treedef.flatten_up_to(state.error)
            if start_iter:
                grads, qs, errors = jax.lax.cond(state.count < start_iter, all_reduce, compress_all, leaves, qs, errors)
            else:
                grads, qs, errors = compress_all(leaves, qs, errors)
            count = optax.safe_increment(state.count)
            return treedef.unflatten(grads), ScaleByPowerSGDState(count, treedef.unflatten(qs), treedef.unflatten(errors))

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGD(PowerSGDCompressor, spec.WrapperSpec):
    """``inner`` (any optimizer) on the PowerSGD-compressed replica-mean gradient.

    `optim.build` builds ``inner`` from ``optimizer.powersgd.inner`` (default ``adamw``).
    """

    def transform(self) -> optax.GradientTransformation:
        return shapes.checked(optax.chain(self.compressor(), self.inner), "powersgd")


scale_by_powersgd = spec.function(PowerSGDCompressor, "compressor", name="scale_by_powersgd", positional=("rank",))
powersgd = spec.function(PowerSGD, name="powersgd")
