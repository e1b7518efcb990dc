"""PSGD-Kron: preconditioned SGD with a Kronecker-factored whitening preconditioner.

Li, "Preconditioned Stochastic Gradient Descent" (arXiv:1512.04202) and "Black Box Lie Group
Preconditioners for SGD" (arXiv:2211.04422, the Kron / triangular-factor fitting); the "Kron" variant
of Evan Walters' psgd_jax and Xi-Lin Li's psgd_torch. Reference matched step by step
(tests/optim/test_psgd_kron.py): pytorch-optimizer 4.1's ``Kron`` (and a float64 NumPy transcription).

For a tensor ``G`` with dims ``n_1 .. n_k`` the preconditioner is ``P = Q^T Q`` with
``Q = Q_1 (x) ... (x) Q_k``: ``Q_i`` upper triangular ``n_i x n_i``, or diagonal when ``n_i = 1``,
``n_i > max_size_triangular``, ``k < min_ndim_triangular`` or ``memory_save_mode`` picks it;
``Q_i(0) = init_scale^(1/k) I``. ``X x_i M`` applies ``M`` along dim ``i``; ``X_(i)`` unfolds dim ``i``
into rows. Each step ``t`` (from 1)::

    m_t = beta m_{t-1} + (1 - beta) G_t;     M_t = m_t / (1 - beta^t)
    every ceil(1 / p(t - 1)) steps (a counter; p the update probability schedule):
      V ~ N(0, I) shaped like G                      (from ``key`` and t: `noise`)
      g <- g + sqrt(eps_32) mean|g| V                 (``damping=True``: kron_torch's damping)
      A = M_t x_1 Q_1 ... x_k Q_k;   B = V x_1 Q_1^{-T} ... x_k Q_k^{-T}   (g = M_t, or G_t)
      for every i (all from the same A, B):
        triangular: Q_i <- Q_i - lr_p triu(A_(i) A_(i)^T - B_(i) B_(i)^T) Q_i / (||A_(i) A_(i)^T + B_(i) B_(i)^T||_2~ + tiny)
        diagonal:   q_i <- q_i - lr_p (a_i - b_i) q_i / (max|a_i + b_i| + tiny),  a_i = rowsums of A_(i)^2, b_i of B_(i)^2
      (||.||_2~: the reference's lower bound on the spectral norm, `norm_lower_bound`)
    D_t = M_t x_1 Q_1^T Q_1 ... x_k Q_k^T Q_k;   D_t <- D_t min(1, 1.1 / (rms(D_t) + 1e-6))
    W_{t+1} = W_t - lr_t (D_t + lambda W_t)         (decay on the leaves `optim.labels.decay_mask` picks)

with ``p(n) = clip(p_max exp(-decay (n - flat_start)), p_min, p_max)``. The Lie-group step keeps
``Q_i`` triangular and fits ``P`` so that ``E[(P g)(P g)^T] = E[v v^T] P`` (whitening: ``P ~ E[g g^T]^(-1/2)``).

Randomness made explicit: the reference draws ``V`` with ``torch.randn_like``; here ``V`` comes from
``key`` (``seed``) folded with the step and the leaf's index (`noise`), so runs are reproducible and a
comparison can feed the reference the same ``V``. The update schedule is the reference's counter (an
update when ``counter >= 1 / p``), not a coin flip; ``update_probability`` (a float or a schedule of
the step) replaces the exponential schedule. The reference rebalances the factors' norms (geometric
mean of their max-norms) on a random 1% of update steps; here every ``balance_every``-th update. A
rebalance leaves ``P`` and every later step unchanged in exact arithmetic (each ``Q_i`` update is a
left multiplication by a scale-invariant factor); it only keeps the factors' ranges apart from
under/overflow.

Damping: Evan Walters' kron_torch (``kron.py`` at 884427c, ``_calc_A_and_conjB``) adds
``sqrt(eps_32) mean|g| V`` (``eps_32`` float32's machine epsilon, ``mean`` over the tensor) to the
fitted ``g`` before ``A``; pytorch-optimizer's ``Kron`` (the matched reference) does not, so
``damping`` is off by default. kron_torch adds it in place, so where the fit takes the debiased
momentum its step also preconditions the damped momentum (a ~3e-4 relative perturbation); here the
damping reaches the fit only.

Differences from the reference: axes before the last two of a leaf of three or more axes are batch
axes (scan-stacked layers; each entry its own ``Q``, momentum clip per entry), as in `optim.shampoo`
(``batch_leading_axes=False``: every axis a tensor dim, as the reference); the momentum is kept in
float32 (the reference keeps the parameters' dtype); weight decay is `optax.add_decayed_weights` on
the decay-by-role mask (the reference decays every leaf of two or more axes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optim import common, shapes, spec

HIGHEST = jax.lax.Precision.HIGHEST
MEMORY_SAVE_MODES = ("none", "one_diag", "smart_one_diag", "all_diag")
STATIC_ARGS = ("max_size_triangular", "min_ndim_triangular", "seed")
TINY = float(jnp.finfo(jnp.float32).tiny)
DAMPING = float(np.sqrt(np.finfo(np.float32).eps))  # kron_torch's sqrt(eps) of float32


class KronState(NamedTuple):
    """State of `scale_by_psgd_kron`."""

    count: jax.Array  # steps taken, int32
    mu: optax.Updates  # momentum m_t, float32, like the parameters
    qs: tuple  # per parameter (in leaf order) its factors Q_i: (*batch, n_i, n_i) triangular or (*batch, n_i) diagonal
    key: jax.Array  # uint32 key data of the noise V (fixed; folded with the step)
    update_counter: jax.Array  # steps since the last preconditioner update, int32
    balance_counter: jax.Array  # preconditioner updates since the last rebalance, int32


def update_probability_schedule(
    max_prob: float = 1.0, min_prob: float = 0.03, decay: float = 0.001, flat_start: float = 500
) -> Callable[[jax.Array], jax.Array]:
    """``p(n) = clip(max_prob exp(-decay (n - flat_start)), min_prob, max_prob)`` of the steps taken ``n``."""

    def schedule(n):
        prob = max_prob * jnp.exp(-decay * (jnp.asarray(n, jnp.float32) - flat_start))
        return jnp.clip(prob, min_prob, max_prob)

    return schedule


def triangular_dims(shape: tuple[int, ...], max_size: int, min_ndim: int, memory_save_mode: str) -> tuple[bool, ...]:
    """Per dim of a tensor of ``shape``: a triangular factor (True) or a diagonal one (the reference's rule)."""
    diagonal = [False] * len(shape)
    largest = int(np.argsort(shape)[::-1][0]) if shape else 0
    ordered = sorted(shape)
    if memory_save_mode == "one_diag" or (
        memory_save_mode == "smart_one_diag" and len(shape) >= 2 and ordered[-1] > ordered[-2]
    ):
        diagonal[largest] = True
    elif memory_save_mode == "all_diag":
        diagonal = [True] * len(shape)
    return tuple(
        not (d or n == 1 or n > max_size or len(shape) < min_ndim) for n, d in zip(shape, diagonal, strict=True)
    )


def noise(key: jax.Array, count: jax.Array, updates: Any) -> Any:
    """The reference's ``randn_like`` draws at step ``count`` (from 1): standard normal float32 per leaf."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(key), count)
    leaves, treedef = jax.tree.flatten(updates)
    draws = [jax.random.normal(jax.random.fold_in(step_key, i), g.shape, jnp.float32) for i, g in enumerate(leaves)]
    return treedef.unflatten(draws)


def _one_at_a_time(fn: Callable) -> Callable:
    """``fn`` over the leading axis by `jax.lax.map`: on CPU, jaxlib's batched LAPACK kernels (the
    triangular solves) split a batch over XLA's intra-op pool and block on it, which deadlocks a
    multi-device step (as `optim.matrix_roots.lapack_map` explains); one matrix per call does not."""

    def mapped(*args):
        return jax.lax.map(lambda xs: fn(*xs), args)

    return mapped


def _along(x: jax.Array, i: int, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``fn`` on the unfolding of ``x`` along dim ``i`` (rows: dim ``i``), folded back."""
    moved = jnp.moveaxis(x, i, 0)
    return jnp.moveaxis(fn(moved.reshape(moved.shape[0], -1)).reshape(moved.shape), 0, i)


def _mode_product(x: jax.Array, factors: tuple[jax.Array, ...], transpose: bool = False) -> jax.Array:
    """``x x_1 F_1 ... x_k F_k`` (``F_i^T`` with ``transpose``); a 1-D factor scales its dim."""
    for i, f in enumerate(factors):
        if f.ndim == 1:
            x = _along(x, i, lambda u, f=f: f[:, None] * u)
        else:
            x = _along(x, i, lambda u, f=f: jnp.matmul(f.T if transpose else f, u, precision=HIGHEST))
    return x


def _inverse_transpose_product(x: jax.Array, factors: tuple[jax.Array, ...]) -> jax.Array:
    """``x x_1 Q_1^{-T} ... x_k Q_k^{-T}`` by triangular solves (division for diagonal factors)."""
    for i, f in enumerate(factors):
        if f.ndim == 1:
            x = _along(x, i, lambda u, f=f: u / f[:, None])
        else:
            x = _along(x, i, lambda u, f=f: jax.scipy.linalg.solve_triangular(f, u, trans="T", lower=False))
    return x


def norm_lower_bound(a: jax.Array) -> jax.Array:
    """A lower bound on the spectral norm of ``a`` (one power step from its largest row or column)."""
    max_abs = jnp.max(jnp.abs(a))
    a = a / jnp.where(max_abs > 0, max_abs, 1.0)
    aa = a * a
    col_sums, row_sums = jnp.sum(aa, axis=0), jnp.sum(aa, axis=1)
    x0 = jnp.matmul(a[:, jnp.argmax(col_sums)], a, precision=HIGHEST)
    bound0 = jnp.linalg.norm(jnp.matmul(x0 / jnp.maximum(jnp.linalg.norm(x0), TINY), a.T, precision=HIGHEST))
    x1 = jnp.matmul(a, a[jnp.argmax(row_sums), :], precision=HIGHEST)
    bound1 = jnp.linalg.norm(jnp.matmul(a.T, x1 / jnp.maximum(jnp.linalg.norm(x1), TINY), precision=HIGHEST))
    return max_abs * jnp.where(jnp.max(col_sums) > jnp.max(row_sums), bound0, bound1)


def update_factors(factors: tuple[jax.Array, ...], g: jax.Array, v: jax.Array, lr: Any) -> tuple[jax.Array, ...]:
    """One Lie-group fitting step of every factor from the pair (noise ``v``, gradient ``g``), one tensor."""
    a = _mode_product(g, factors)
    b = _inverse_transpose_product(v, factors)
    new = []
    for i, q in enumerate(factors):
        au, bu = jnp.moveaxis(a, i, 0).reshape(a.shape[i], -1), jnp.moveaxis(b, i, 0).reshape(b.shape[i], -1)
        if q.ndim == 1:
            t1, t2 = jnp.sum(au * au, axis=1), jnp.sum(bu * bu, axis=1)
            new.append(q - lr * (t1 - t2) * q / (jnp.max(jnp.abs(t1 + t2)) + TINY))
        else:
            t1, t2 = jnp.matmul(au, au.T, precision=HIGHEST), jnp.matmul(bu, bu.T, precision=HIGHEST)
            step = lr * jnp.triu(t1 - t2) / (norm_lower_bound(t1 + t2) + TINY)
            new.append(q - jnp.matmul(step, q, precision=HIGHEST))
    return tuple(new)


def balance(factors: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Rescales the factors to the geometric mean of their max-norms (their Kronecker product unchanged)."""
    norms = jnp.stack([jnp.max(jnp.abs(q)) for q in factors])
    mean = jnp.prod(norms) ** (1.0 / len(factors))
    return tuple(q * (mean / n) for q, n in zip(factors, norms, strict=True))


def precondition(factors: tuple[jax.Array, ...], g: jax.Array) -> jax.Array:
    """``P g = g x_1 Q_1^T Q_1 ... x_k Q_k^T Q_k``, then clipped to RMS at most 1.1 (the reference's clip)."""
    d = _mode_product(_mode_product(g, factors), factors, transpose=True)
    return d * jnp.minimum(1.1 / (jnp.sqrt(jnp.mean(d * d)) + 1e-6), 1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PsgdKronDirection:
    """PSGD-Kron's preconditioned, momentum-averaged direction (module docstring); no learning rate.

    Attributes:
      beta: momentum EMA coefficient (bias-corrected).
      precond_lr: step size of the preconditioner fit.
      precond_init_scale: ``Q(0) = precond_init_scale^(1/k) I`` (per tensor).
      max_size_triangular: dims longer than this get a diagonal factor.
      min_ndim_triangular: tensors with fewer dims get diagonal factors only.
      memory_save_mode: ``"none"``, ``"one_diag"`` (largest dim diagonal), ``"smart_one_diag"`` (the
        largest when it is strictly the largest) or ``"all_diag"``.
      momentum_into_precond_update: fit the preconditioner on the debiased momentum (else the gradient).
      update_prob_max: the update probability schedule's start (`update_probability_schedule`).
      update_prob_min: its floor.
      update_prob_decay: its exponential decay per step after ``update_prob_flat_start``.
      update_prob_flat_start: steps at ``update_prob_max``.
      update_probability: a float or a schedule of the steps taken replacing the four above.
      balance_every: rebalance the factors every this many preconditioner updates; 0: never.
      seed: seed of the noise ``V`` (`noise`).
      damping: add kron_torch's ``sqrt(eps_32) mean|g| V`` to the fitted ``g`` (module docstring).
      batch_leading_axes: axes before the last two are batch axes (scan-stacked layers). False:
        every axis is a tensor dim, as in the reference.
    """

    beta: float = spec.param(0.9, valid="[0, 1)")
    precond_lr: float = spec.param(0.1, valid="(0, inf)")
    precond_init_scale: float = spec.param(1.0, valid="(0, inf)")
    max_size_triangular: int = spec.param(8192, valid="[1, inf)")
    min_ndim_triangular: int = spec.param(2, valid="[0, inf)")
    memory_save_mode: str = "none"
    momentum_into_precond_update: bool = True
    update_prob_max: float = spec.param(1.0, valid="(0, 1]")
    update_prob_min: float = spec.param(0.03, valid="(0, 1]")
    update_prob_decay: float = spec.param(0.001, valid="[0, inf)")
    update_prob_flat_start: int = spec.param(500, valid="[0, inf)")
    update_probability: float | Callable[[jax.Array], jax.Array] | None = spec.code_only()
    balance_every: int = spec.param(100, valid="[0, inf)")
    seed: int = spec.param(0, valid="[0, inf)")
    damping: bool = False
    batch_leading_axes: bool = spec.code_only(True)

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS

    def direction(self) -> optax.GradientTransformation:
        return _scale_by_psgd_kron(self)


def _scale_by_psgd_kron(h: PsgdKronDirection) -> optax.GradientTransformation:
    max_size = common.static_int("max_size_triangular", h.max_size_triangular, STATIC_ARGS)
    min_ndim = common.static_int("min_ndim_triangular", h.min_ndim_triangular, STATIC_ARGS)
    seed = common.static_int("seed", h.seed, STATIC_ARGS)
    common.check_choice("memory_save_mode", h.memory_save_mode, MEMORY_SAVE_MODES)
    if h.update_probability is None:
        probability = update_probability_schedule(
            h.update_prob_max, h.update_prob_min, h.update_prob_decay, h.update_prob_flat_start
        )
    elif callable(h.update_probability):
        probability = h.update_probability
    else:
        spec.check_value("update_probability", h.update_probability, "[0, 1]")
        probability = lambda n: jnp.asarray(h.update_probability, jnp.float32)

    def split(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(batch axes, tensor axes) of a leaf; a scalar is a tensor of one entry."""
        cut = len(shape) - 2 if h.batch_leading_axes and len(shape) >= 3 else 0
        return shape[:cut], shape[cut:] or (1,)

    def init_factors(shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
        batch, tensor = split(shape)
        scale = h.precond_init_scale ** (1.0 / len(tensor))
        out = []
        for n, tri in zip(tensor, triangular_dims(tensor, max_size, min_ndim, h.memory_save_mode), strict=True):
            one = scale * (jnp.eye(n, dtype=jnp.float32) if tri else jnp.ones(n, jnp.float32))
            out.append(jnp.broadcast_to(one, batch + one.shape))
        return tuple(out)

    def per_tensor(fn: Callable, shape: tuple[int, ...], *args: Any) -> Any:
        """``fn`` on each batch entry: arguments are leaves (``shape``) or factor tuples, batch-leading."""
        batch, tensor = split(shape)
        size = math.prod(batch)

        def flat(x, inner):
            return x.reshape((size, *inner))

        def unflat(x):
            return x.reshape(batch + x.shape[1:]) if batch else x[0]

        flat_args = []
        for arg in args:
            if isinstance(arg, tuple):
                flat_args.append(tuple(flat(q, q.shape[len(batch) :]) for q in arg))
            else:
                flat_args.append(flat(arg, tensor))
        out = jax.lax.platform_dependent(*flat_args, cpu=_one_at_a_time(fn), default=jax.vmap(fn))
        if isinstance(out, tuple):
            return tuple(unflat(q) for q in out)
        return unflat(out).reshape(shape)

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        return KronState(
            count=jnp.zeros([], jnp.int32),
            mu=treedef.unflatten([jnp.zeros(p.shape, jnp.float32) for p in leaves]),
            qs=common.by_shapes(params, lambda: tuple(init_factors(p.shape) for p in leaves)),
            key=jax.random.key_data(jax.random.key(seed)),
            update_counter=jnp.zeros([], jnp.int32),
            balance_counter=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None):
        del params
        shapes.check_like(updates, state.mu, "psgd_kron")
        grads, treedef = jax.tree.flatten(updates)
        count = optax.safe_increment(state.count)
        g32 = [g.astype(jnp.float32) for g in grads]
        mu = [h.beta * m + (1 - h.beta) * g for g, m in zip(g32, treedef.flatten_up_to(state.mu), strict=True)]
        debiased = [m / (1 - h.beta ** count.astype(jnp.float32)) for m in mu]
        fit_on = debiased if h.momentum_into_precond_update else g32
        qs = list(state.qs)

        prob = probability(state.count)
        counter = state.update_counter + 1
        do_update = (prob > 0) & (counter >= 1.0 / jnp.where(prob > 0, prob, 1.0))
        balance_counter = state.balance_counter + do_update.astype(jnp.int32)
        do_balance = do_update & (h.balance_every > 0) & (balance_counter >= h.balance_every)

        def fit(qs):
            vs = treedef.flatten_up_to(noise(state.key, count, updates))
            qs = [
                q if len(q) < 2 else jax.lax.cond(do_balance, lambda q, g=g: per_tensor(balance, g.shape, q), lambda q: q, q)
                for q, g in zip(qs, grads, strict=True)
            ]
            return [
                per_tensor(lambda q, x, v: update_factors(q, damped(x, v), v, h.precond_lr), g.shape, q, x, v)
                for q, x, v, g in zip(qs, fit_on, vs, grads, strict=True)
            ]

        def damped(x, v):
            return x + DAMPING * jnp.mean(jnp.abs(x)) * v if h.damping else x

        qs = jax.lax.cond(do_update, fit, lambda qs: qs, qs)
        out = [
            per_tensor(precondition, g.shape, q, m).astype(g.dtype) for q, m, g in zip(qs, debiased, grads, strict=True)
        ]
        new_state = KronState(
            count=count,
            mu=treedef.unflatten(mu),
            qs=tuple(qs),
            key=state.key,
            update_counter=jnp.where(do_update, 0, counter),
            balance_counter=jnp.where(do_balance, 0, balance_counter),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PsgdKron(PsgdKronDirection, common.DirectionOptimizer):
    """PSGD-Kron on every parameter (as the reference), decoupled weight decay by role, the learning rate.

    ``chain(scale_by_psgd_kron(...), add_decayed_weights(weight_decay, decay_mask),
    scale_by_learning_rate(learning_rate))``. No weight decay by default (pytorch-optimizer ``Kron``'s);
    the learning rate is the best of 1e-3 (the reference's), 3e-3 and 1e-2 on the default job
    (docs/benchmarks.md, "Default learning rates"). Hyperparameters: `PsgdKronDirection`.
    """

    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = 0.0


scale_by_psgd_kron = spec.function(PsgdKronDirection, "direction", name="scale_by_psgd_kron", positional=("beta",))
psgd_kron = spec.function(PsgdKron, name="psgd_kron")
