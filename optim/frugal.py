"""FRUGAL: Adam in a subspace of each hidden matrix, signSGD on the rest (Zmushko et al., "FRUGAL:
Memory-Efficient Optimization by Reducing State Overhead for Scalable Training", arXiv:2411.07837;
reference: the authors' ``frugal/proj_optimizer_templates.py``, ``galore_projector.py``, ``adamw.py``,
its ``GaloreAdamW``).

For each hidden matrix ``W`` (``m x n``, the last two axes; leading axes are batch axes, each matrix
its own subspace) with gradient ``G_t`` and step ``t`` (from 0). The projected side is the shorter
one: ``X = G`` when ``m >= n`` (columns, as the reference's ``proj_side="std"``), else ``X = G^T``;
``q`` is that side's length and ``r = round(density q)`` (at least 1):

    every T steps (t mod T = 0):  B <- a new (r x q) basis with orthonormal rows, from X_t
                                  M, V, s <- 0                          (reset_statistics)
    L = X B^T                                     the state-full part's coordinates
    M = b1 M + (1 - b1) L;  V = b2 V + (1 - b2) L^2;  s = s + 1
    D = (M / (1 - b1^s)) / (sqrt(V / (1 - b2^s)) + eps) B
      + c sign(X - L B)                          the state-free rest (c = inactive_lr_scale)
    W_{t+1} = W_t - lr_t (D (transposed back if X = G^T) + lambda W_t)

Bases (``projection``): ``"svd"``, the top-``r`` right singular vectors of ``X_t`` (GaLore);
``"random"``, a random semi-orthogonal matrix (QR of a Gaussian); ``"randperm"``, ``r`` distinct
coordinates of the side drawn at random (rows of a permutation matrix: the reference's column
selection). Random draws come from ``seed`` and the step, so a resumed run draws the same bases.
``state_free``: ``"sign_sgd"`` (the paper's default), ``"sgd"`` (``c (X - L B)``) or ``"none"``.
Embeddings, LM head, norms and biases take AdamW at the same learning rate, as the reference's
non-projected group (`optim.common.with_adam`).

Reference matched step by step (tests/optim/test_frugal.py, a NumPy transcription; random bases
compared given the drawn basis): defaults ``density = 0.25``, ``T = 200``, ``reset_statistics``,
``sign_sgd`` at ``c = 1``, Adam ``b1, b2, eps = 0.9, 0.999, 1e-8`` with its step count restarting at
every reset, weight decay 0.01. Not here: the reference's ``proj_params_lr_scale`` (1 in all its main
experiments) and its "full" two-sided projection. State per matrix: ``B`` (``r q``), ``M`` and ``V``
(``2 r p``, ``p`` the other side): ``3 density`` of AdamW's two moments for a square matrix.

Blockwise variant, `frugal_block` (the reference's BAdam-like ``BlockAdamW``): the subspace is a set
of whole matrices. The ``N`` hidden matrices (leaves in tree order, each leaf's stacked matrices in
order) are the candidates; every ``T`` steps ``K = round(density N)`` of them become state-full and
the rest state-free, and every moment is reset (the reference clears all state at a switch):

    every T steps (t mod T = 0):  A <- K of the N matrices         (block_order)
                                  M, V <- 0
    s = (t mod T) + 1                                   Adam's step since the switch
    D = Adam(G; M, V, s)  for W in A                    full-matrix Adam, bias-corrected by s
    D = c sign(G)         for W not in A                (``sgd``: c G; ``none``: 0)

``block_order``: ``"random"`` (the reference's default: K distinct matrices drawn from ``seed`` and
the step), ``"ascending"`` (a window of K that moves K forward at every switch, cyclically) or
``"descending"`` (the same, backwards from the last matrix); the reference's ``"mirror"`` is not here.
State shapes cannot change under jit, so ``M`` and ``V`` are kept for every candidate matrix and
masked by the active set: the optimizer state is AdamW's (two moments per hidden matrix, plus one
flag per matrix), not the reference's ``density`` of it. The algorithm is the reference's step by step
(tests/optim/test_frugal.py); its memory saving is not (it would need a buffer of the K largest
matrices' size into which the active moments are packed).

Sharding: state leaves take their parameter's mesh axes where they divide
(`sharding.partition.state_shardings`). Under FSDP the compiled step (8 CPU devices, all three
bases) gathers the bases (``r x q``, small) and, where the projected side is the sharded one,
all-reduces the coordinates ``L``; this communication is not optimised yet.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import common, spec
from optim.muon import check_matrices

PROJECTIONS = ("svd", "random", "randperm")
STATE_FREE = ("sign_sgd", "sgd", "none")
BLOCK_ORDERS = ("random", "ascending", "descending")


class FrugalBlockState(NamedTuple):
    """State of `scale_by_frugal_block`."""

    count: jax.Array  # steps taken, int32
    active: optax.Updates  # 1.0 where a matrix is state-full, per leaf (*batch,)
    mu: optax.Updates  # Adam's M, like the parameters (0 on state-free matrices)
    nu: optax.Updates  # Adam's V, like the parameters


class FrugalState(NamedTuple):
    """State of `scale_by_frugal`."""

    count: jax.Array  # steps taken, int32
    adam_count: jax.Array  # Adam steps since the last reset, int32 (its bias correction)
    basis: optax.Updates  # B per matrix: (*batch, r, n) when m >= n, else B^T (*batch, m, r)
    mu: optax.Updates  # M in W's orientation: (*batch, m, r) when m >= n, else (*batch, r, n)
    nu: optax.Updates  # V, same shapes as mu


def _columns(shape: tuple[int, ...]) -> bool:
    """Whether the projected side of a ``(*batch, m, n)`` matrix is its columns (``m >= n``)."""
    return shape[-2] >= shape[-1]


def _oriented(x: jax.Array, columns: bool) -> jax.Array:
    """``x`` with the projected side last (and back: the map is its own inverse)."""
    return x if columns else jnp.swapaxes(x, -1, -2)


def subspace_rank(shape: tuple[int, ...], density: float) -> int:
    """``r = max(1, round(density q))``, ``q`` the projected side (Python's round, as the reference)."""
    return max(1, round(density * (shape[-1] if _columns(shape) else shape[-2])))


def new_basis(x: jax.Array, r: int, projection: str, key: jax.Array) -> jax.Array:
    """An ``(*batch, r, q)`` basis with orthonormal rows for ``x`` ``(*batch, p, q)`` (module docstring)."""
    q = x.shape[-1]
    if projection == "svd":
        return jnp.linalg.svd(x, full_matrices=False)[2][..., :r, :]
    if projection == "random":
        gaussian = jax.random.normal(key, (*x.shape[:-2], q, r), jnp.float32)
        return jnp.swapaxes(jnp.linalg.qr(gaussian)[0], -1, -2)
    order = jnp.argsort(jax.random.uniform(key, (*x.shape[:-2], q)), axis=-1)
    return jax.nn.one_hot(order[..., :r], q, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrugalRule:
    """What both FRUGAL variants share: the state-full Adam, the state-free rule and the switch period.

    Attributes:
      density: the state-full fraction: of the projected side (`frugal`) or of the matrices (`frugal_block`).
      update_gap: ``T``, steps between new state-full sets.
      state_free: the rule outside the state-full set: "sign_sgd", "sgd" or "none".
      inactive_lr_scale: ``c``, the state-free rule's step relative to the learning rate.
      b1: Adam's first-moment decay in the state-full set.
      b2: Adam's second-moment decay in the state-full set.
      eps: Adam's epsilon in the state-full set.
      seed: seeds the random draws (with the step).
    """

    density: float = spec.param(0.25, valid="(0, 1]")
    update_gap: int = spec.param(200, valid="[1, inf)")
    state_free: str = "sign_sgd"
    inactive_lr_scale: float = spec.param(1.0, valid="[0, inf)")
    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.999, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="[0, inf)")
    seed: int = 0

    static_args: ClassVar[tuple[str, ...]] = ("density",)
    family: ClassVar[str] = "frugal"

    def __post_init__(self) -> None:
        common.check_choice("state_free", self.state_free, STATE_FREE)

    def static_density(self) -> float:
        try:
            return float(self.density)
        except jax.errors.ConcretizationTypeError:
            raise ValueError(
                f"density sets array shapes; with optax.inject_hyperparams pass static_args={self.static_args}"
            ) from None

    def adam(self, m: jax.Array, v: jax.Array, s: jax.Array) -> jax.Array:
        """The bias-corrected Adam direction at Adam step ``s`` (float32)."""
        return (m / (1 - self.b1**s)) / (jnp.sqrt(v / (1 - self.b2**s)) + self.eps)

    def rest(self, x: jax.Array) -> jax.Array:
        """The state-free rule's direction for ``x``."""
        if self.state_free == "none":
            return jnp.zeros_like(x)
        return self.inactive_lr_scale * (jnp.sign(x) if self.state_free == "sign_sgd" else x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrugalDirection(FrugalRule):
    """FRUGAL's direction ``D`` (module docstring) on hidden matrices.

    Attributes:
      projection: how a basis is drawn: "svd", "random" or "randperm".
      reset_statistics: zero Adam's moments and step count at every new basis.
    """

    projection: str = "randperm"
    reset_statistics: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        common.check_choice("projection", self.projection, PROJECTIONS)

    def direction(self) -> optax.GradientTransformation:
        density = self.static_density()
        b1, b2 = self.b1, self.b2

        def init_fn(params):
            check_matrices(params, None, self.family)

            def zeros(p, moment):
                r, (m, n) = subspace_rank(p.shape, density), p.shape[-2:]
                keeps_rows = _columns(p.shape) == moment  # a moment keeps W's long side, a basis its short one
                return jnp.zeros((*p.shape[:-2], *((m, r) if keeps_rows else (r, n))), jnp.float32)

            return FrugalState(
                count=jnp.zeros([], jnp.int32),
                adam_count=jnp.zeros([], jnp.int32),
                basis=jax.tree.map(lambda p: zeros(p, False), params),
                mu=jax.tree.map(lambda p: zeros(p, True), params),
                nu=jax.tree.map(lambda p: zeros(p, True), params),
            )

        def update_fn(updates, state, params=None):
            del params
            grads, treedef = jax.tree.flatten(updates)
            xs = [_oriented(g.astype(jnp.float32), _columns(g.shape)) for g in grads]
            leaves = [treedef.flatten_up_to(t) for t in (state.basis, state.mu, state.nu)]
            bases, mus, nus = ([_oriented(x, _columns(g.shape)) for x, g in zip(t, grads, strict=True)] for t in leaves)
            key = jax.random.fold_in(jax.random.key(self.seed), state.count)

            def refresh(bases, mus, nus, adam_count):
                bases = [
                    new_basis(x, b.shape[-2], self.projection, jax.random.fold_in(key, i))
                    for i, (x, b) in enumerate(zip(xs, bases, strict=True))
                ]
                if self.reset_statistics:
                    mus, nus = [jnp.zeros_like(m) for m in mus], [jnp.zeros_like(v) for v in nus]
                    adam_count = jnp.zeros_like(adam_count)
                return bases, mus, nus, adam_count

            bases, mus, nus, adam_count = jax.lax.cond(
                state.count % self.update_gap == 0,
                refresh,
                lambda *carry: carry,
                bases,
                mus,
                nus,
                state.adam_count,
            )
            adam_count = optax.safe_increment(adam_count)
            s = adam_count.astype(jnp.float32)
            out, new_mus, new_nus = [], [], []
            for g, x, b, m, v in zip(grads, xs, bases, mus, nus, strict=True):
                low = x @ jnp.swapaxes(b, -1, -2)
                m = b1 * m + (1 - b1) * low
                v = b2 * v + (1 - b2) * low * low
                d = self.adam(m, v, s) @ b + self.rest(x - low @ b)
                columns = _columns(g.shape)
                out.append(_oriented(d, columns).astype(g.dtype))
                new_mus.append(_oriented(m, columns))
                new_nus.append(_oriented(v, columns))
            new_bases = [_oriented(b, _columns(g.shape)) for b, g in zip(bases, grads, strict=True)]
            unflat = treedef.unflatten
            return unflat(out), FrugalState(
                optax.safe_increment(state.count), adam_count, unflat(new_bases), unflat(new_mus), unflat(new_nus)
            )

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Frugal(FrugalDirection, common.MatrixOptimizer):
    """FRUGAL on hidden matrices, AdamW (same learning rate) on embeddings, LM head, norms and biases."""

    learning_rate: optax.ScalarOrSchedule = 3e-3  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.01  # the reference's AdamW default


def active_set(switch: jax.Array, n: int, k: int, order: str, key: jax.Array) -> jax.Array:
    """``(n,)`` 1.0 on the ``k`` state-full matrices of the ``switch``-th switch (module docstring)."""
    if order == "random":
        chosen = jax.random.permutation(key, n)[:k]
    elif order == "ascending":
        chosen = switch * k + jnp.arange(k)
    else:
        chosen = n - 1 - switch * k - jnp.arange(k)
    return jnp.zeros(n, jnp.float32).at[chosen % n].set(1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrugalBlockDirection(FrugalRule):
    """FRUGAL's blockwise direction (module docstring): whole matrices state-full or state-free.

    Attributes:
      block_order: which matrices a switch makes state-full: "random", "ascending" or "descending".
    """

    block_order: str = "random"

    family: ClassVar[str] = "frugal_block"

    def __post_init__(self) -> None:
        super().__post_init__()
        common.check_choice("block_order", self.block_order, BLOCK_ORDERS)

    def direction(self) -> optax.GradientTransformation:
        density = self.static_density()
        b1, b2 = self.b1, self.b2

        def init_fn(params):
            check_matrices(params, None, self.family)
            return FrugalBlockState(
                count=jnp.zeros([], jnp.int32),
                active=jax.tree.map(lambda p: jnp.zeros(p.shape[:-2], jnp.float32), params),
                mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                nu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            )

        def update_fn(updates, state, params=None):
            del params
            grads, treedef = jax.tree.flatten(updates)
            if not grads:  # a branch of `optax.partition` that holds no parameter
                return updates, state._replace(count=optax.safe_increment(state.count))
            sizes = [math.prod(g.shape[:-2]) for g in grads]
            n = sum(sizes)
            switch, since = state.count // self.update_gap, state.count % self.update_gap
            key = jax.random.fold_in(jax.random.key(self.seed), state.count)
            fresh = active_set(switch, n, round(density * n), self.block_order, key)
            flags = jnp.where(since == 0, fresh, jnp.concatenate([a.reshape(-1) for a in treedef.flatten_up_to(state.active)]))
            keep = (since > 0).astype(jnp.float32)  # every moment restarts at a switch
            s = (since + 1).astype(jnp.float32)
            out, actives, mus, nus = [], [], [], []
            starts = np.cumsum([0, *sizes[:-1]])
            leaves = zip(grads, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu), starts, sizes, strict=True)
            for g, m, v, start, size in leaves:
                on = flags[start : start + size].reshape(g.shape[:-2])
                x = g.astype(jnp.float32)
                gate = on[..., None, None]
                m = gate * (b1 * keep * m + (1 - b1) * x)
                v = gate * (b2 * keep * v + (1 - b2) * x * x)
                out.append(jnp.where(gate > 0, self.adam(m, v, s), self.rest(x)).astype(g.dtype))
                actives.append(on)
                mus.append(m)
                nus.append(v)
            unflat = treedef.unflatten
            return unflat(out), FrugalBlockState(
                optax.safe_increment(state.count), unflat(actives), unflat(mus), unflat(nus)
            )

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrugalBlock(FrugalBlockDirection, common.MatrixOptimizer):
    """Blockwise FRUGAL on hidden matrices, AdamW (same learning rate) on embeddings, LM head, norms and biases."""

    # 3-point sweep on the default job, seed 0, final val loss (2026-11-25): 1e-3 2.135, 3e-3 1.951,
    # 1e-2 2.294 (the reference's BlockAdamW default is 1e-3)
    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = 0.01  # the reference's AdamW default


scale_by_frugal = spec.function(FrugalDirection, "direction", name="scale_by_frugal", positional=("density",))
frugal = spec.function(Frugal, name="frugal")
scale_by_frugal_block = spec.function(
    FrugalBlockDirection, "direction", name="scale_by_frugal_block", positional=("density",)
)
frugal_block = spec.function(FrugalBlock, name="frugal_block")
