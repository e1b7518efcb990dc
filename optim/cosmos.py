"""COSMOS: SOAP-like adaptivity on a tracked leading subspace, Muon on the rest.

Liu et al., "COSMOS: A Hybrid Adaptive Optimizer for Memory-Efficient Training of LLMs"
(arXiv:2502.17410). Reference matched step by step (tests/optim/test_cosmos.py, a float64 NumPy
transcription): the authors' code, github.com/lliu606/COSMOS ``COSMOS_optim.py`` (commit 61de180).

For a hidden matrix written as PyTorch does, ``G`` of shape ``m x n`` (``n`` the input side: the
``(fan_in, fan_out)`` kernel transposed; per matrix of a stacked leaf), rank ``r = min(rank, n)``,
``t`` the step from 1::

    M_t = b1 M_{t-1} + G_t                                       (sum-form momentum)
    t = 1:  P_1 = top-r eigenvectors of G^T G (n x r);  S_1 = (1 - b2) (G P_1)^T (G P_1)
    t > 1:  P_t = QR(b2 P_{t-1} S_{t-1} + (1 - b2) G^T G P_{t-1});  T = P_{t-1}^T P_t
            S_t = b2 T^T S_{t-1} T + (1 - b2) (G P_t)^T (G P_t)           (one subspace iteration)
    V_t = b2 V_{t-1} + (1 - b2) (G P_t)^2                        (m x r, element-wise)
    D_t = (G_t + b1 M_t) / (1 + b1 c_t)  (Nesterov, the authors'),  or M_t / c_t (ours);   c_t = (1 - b1^t) / (1 - b1)
    A_t = (D_t P_t / (sqrt(V_t / (1 - b2^t)) + eps)) P_t^T        (Adam on the subspace)
    O_t = sqrt(m n) NS(D_t - D_t P_t P_t^T) / (||NS(.)||_F + eps)  (Muon on the rest, Newton-Schulz)
    U_t = sqrt(m n) (A_t + gamma O_t) / (||A_t + gamma O_t||_F + eps)
    W_{t+1} = W_t - lr_t (U_t + lambda W_t)

``U_t`` has RMS 1, so ``lr`` is the step's RMS. The authors' code has only the Nesterov form (the
default, matched); ``nesterov=False`` is ours, not theirs: the debiased momentum ``M_t / c_t`` (the
average of past gradients that the Nesterov form mixes with ``G_t``). Deleting the Nesterov lines
from their code would instead leave the raw gradient ``G_t``, i.e. no momentum at all, which is
``b1=0`` here. Embeddings, head, norms and biases get AdamW
(`optim.common.with_adam`); the authors send every 2-D parameter with at most 10000 rows to COSMOS
and the rest to an Adam whose first moment is ``b1 m + 0.1 g`` debiased by ``1 - 0.9^t`` (so
Adam's only when ``b1 = 0.9``): here the AdamW group is optax's. Their learning rate is the AdamW
group's, the hidden one ``lr_ratio`` times it, and weight decay multiplies the AdamW group's rate;
here ``learning_rate`` is the hidden one, ``adam_lr_ratio = 1 / lr_ratio``, and decay multiplies each
group's own rate. Newton-Schulz is `optim.newton_schulz` (the authors: Jordan's 5 steps in bf16; here
``ns_dtype="auto"``: fp32 on CPU, bf16 inputs with fp32 accumulation on accelerators). The rank is
capped at ``n`` (the authors' state would not fit); at ``r = n`` the complement is empty and ``O_t = 0``
(its value in exact arithmetic; the authors' code orthogonalises the rounding error of ``D - D P P^T``
there, normalised to the size of a real direction). State: ``mu`` like the parameter, ``basis``
``(*batch, fan_in, r)``, ``gram`` ``(*batch, r, r)``, ``nu`` ``(*batch, fan_out, r)``.

Conditioning: where ``r`` exceeds the gradients' rank (a rank-1 gradient, as optax's contrib harness
uses), ``D P`` and ``V`` vanish in exact arithmetic on the extra directions and ``A_t`` divides their
rounding error by ``eps`` (the authors' code does the same); updates there differ between any two
roundings (e.g. with and without `optax.inject_hyperparams`), not between the two readings of the rule.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, matrix_roots, spec
from optim import newton_schulz as ns
from optim.muon import NewtonSchulz, check_matrices

HIGHEST = jax.lax.Precision.HIGHEST
STATIC_ARGS = ("rank",)


class CosmosState(NamedTuple):
    """State of `scale_by_cosmos`."""

    count: jax.Array  # steps taken, int32
    mu: optax.Updates  # sum-form momentum M_t, float32, like the parameters
    basis: optax.Updates  # P_t, (*batch, fan_in, r) per parameter
    gram: optax.Updates  # S_t, (*batch, r, r)
    nu: optax.Updates  # V_t, (*batch, fan_out, r)


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=HIGHEST)


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _frobenius(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def initial_subspace(g: jax.Array, rank: int, b2) -> tuple[jax.Array, jax.Array]:
    """``(P_1, S_1)``: the top-``rank`` eigenvectors of ``G^T G`` and ``(1 - b2) (G P_1)^T (G P_1)``; ``g`` (B, m, n)."""
    _, vecs = matrix_roots.lapack_map(jnp.linalg.eigh, _mm(_t(g), g))
    p = vecs[..., ::-1][..., :rank]
    gp = _mm(g, p)
    return p, (1 - b2) * _mm(_t(gp), gp)


def track_subspace(g: jax.Array, p: jax.Array, s: jax.Array, b2) -> tuple[jax.Array, jax.Array]:
    """One subspace iteration of ``(P, S)`` towards the leading eigenvectors of the EMA of ``G^T G``."""
    new, _ = matrix_roots.lapack_map(jnp.linalg.qr, b2 * _mm(p, s) + (1 - b2) * _mm(_t(g), _mm(g, p)))
    turn = _mm(_t(p), new)
    gp = _mm(g, new)
    return new, b2 * _mm(_t(turn), _mm(s, turn)) + (1 - b2) * _mm(_t(gp), gp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CosmosDirection(NewtonSchulz):
    """COSMOS's direction ``U_t`` (module docstring) for a pytree of ``(*batch, fan_in, fan_out)`` matrices.

    Attributes:
      b1: momentum coefficient (sum form).
      b2: decay of the subspace statistics ``S`` and of the second moment ``V``.
      eps: added to ``sqrt(V)`` and to the Frobenius norms.
      rank: dimension ``r`` of the adaptive subspace (capped at fan_in).
      gamma: weight of the Newton-Schulz part on the complement.
      nesterov: Nesterov look-ahead on the momentum (the authors' only form); False: ``M_t / c_t`` (ours).
      (ns_*: `optim.muon.NewtonSchulz`.)
    """

    b1: float = spec.param(0.95, valid="[0, 1)")
    b2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    rank: int = spec.param(64, valid="[1, inf)")
    gamma: float = spec.param(0.2, valid="[0, inf)")
    nesterov: bool = True

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS

    def direction(self) -> optax.GradientTransformation:
        rank = common.static_int("rank", self.rank, STATIC_ARGS)
        # float32 from the start, so ``1 - b1`` rounds alike whether or not optax.inject_hyperparams made them arrays
        b1, b2, eps, gamma = (jnp.asarray(x, jnp.float32) for x in (self.b1, self.b2, self.eps, self.gamma))

        def ranks(p):
            return min(rank, p.shape[-2])

        def init_fn(params):
            check_matrices(params, None, "cosmos")

            def zeros(*shape):
                return jnp.zeros(shape, jnp.float32)

            return CosmosState(
                count=jnp.zeros([], jnp.int32),
                mu=jax.tree.map(lambda p: zeros(*p.shape), params),
                basis=jax.tree.map(lambda p: zeros(*p.shape[:-1], ranks(p)), params),
                gram=jax.tree.map(lambda p: zeros(*p.shape[:-2], ranks(p), ranks(p)), params),
                nu=jax.tree.map(lambda p: zeros(*p.shape[:-2], p.shape[-1], ranks(p)), params),
            )

        def leaf_step(g, mu, p, s, v, t, first):
            shape = g.shape
            g = _t(g.astype(jnp.float32).reshape(-1, *shape[-2:]))  # (B, m, n), PyTorch's orientation
            mu = _t(mu.reshape(g.shape[0], *shape[-2:]))
            p, s, v = (x.reshape(g.shape[0], *x.shape[-2:]) for x in (p, s, v))
            mu = b1 * mu + g
            p, s = jax.lax.cond(
                first,
                lambda p, s: initial_subspace(g, p.shape[-1], b2),
                lambda p, s: track_subspace(g, p, s, b2),
                p,
                s,
            )
            gp = _mm(g, p)
            v = b2 * v + (1 - b2) * gp * gp
            c1 = (1 - b1**t) / (1 - b1)
            d = (g + b1 * mu) / (1 + b1 * c1) if self.nesterov else mu / c1
            dp = _mm(d, p)
            adaptive = _mm(dp / (jnp.sqrt(v / (1 - b2**t)) + eps), _t(p))
            scale = (shape[-1] * shape[-2]) ** 0.5
            u = adaptive
            if p.shape[-1] < g.shape[-1]:  # else the complement is empty: D - D P P^T is rounding only
                rest = ns.newton_schulz(
                    d - _mm(dp, _t(p)), self.ns_coeffs, self.ns_steps, eps=self.ns_eps, dtype=self.ns_dtype
                )
                u = u + gamma * scale * rest / (_frobenius(rest) + eps)
            u = scale * u / (_frobenius(u) + eps)

            def back(x, like):
                return x.reshape(like)

            return (
                back(_t(u), shape),
                back(_t(mu), shape),
                back(p, shape[:-1] + p.shape[-1:]),
                back(s, shape[:-2] + s.shape[-2:]),
                back(v, shape[:-2] + v.shape[-2:]),
            )

        def update_fn(updates, state, params=None):
            del params
            grads, treedef = jax.tree.flatten(updates)
            t = optax.safe_increment(state.count)
            tf = t.astype(jnp.float32)
            fields = [treedef.flatten_up_to(x) for x in (state.mu, state.basis, state.gram, state.nu)]
            steps = [leaf_step(g, *rest, tf, state.count == 0) for g, *rest in zip(grads, *fields, strict=True)]
            out = [u.astype(g.dtype) for (u, *_), g in zip(steps, grads, strict=True)]
            mu, basis, gram, nu = (treedef.unflatten([s[i] for s in steps]) for i in range(1, 5))
            return treedef.unflatten(out), CosmosState(count=t, mu=mu, basis=basis, gram=gram, nu=nu)

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cosmos(CosmosDirection, common.MatrixOptimizer):
    """COSMOS on hidden matrices, AdamW elsewhere. Defaults: the authors' README (AdamW-group rate
    2e-3, ``lr_ratio`` 0.2, betas 0.95, weight decay 0.1), so ``adam_lr_ratio = 5``; the learning rate
    is the best of 2e-4, 4e-4 (the README's ``0.2 * 2e-3``), 8e-4, 1.6e-3 and 3.2e-3 on the default
    job, the ratio kept (docs/benchmarks.md, "Default learning rates"). Hyperparameters: `CosmosDirection`,
    `optim.common.AdamGroup`."""

    learning_rate: optax.ScalarOrSchedule = 1.6e-3  # swept: docs/benchmarks.md section 1b
    weight_decay: float = 0.1
    adam_lr_ratio: float = spec.param(5.0, valid="[0, inf)")


scale_by_cosmos = spec.function(CosmosDirection, "direction", name="scale_by_cosmos", positional=("b1", "b2"))
cosmos = spec.function(Cosmos, name="cosmos")
