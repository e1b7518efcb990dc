"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al., arXiv:2409.11321).

Pinned variant: the reference code github.com/nikhilvyas/SOAP at commit a1e5535 (2024-12-02), which
includes "momentum change" (f42d296): the first moment lives in the *rotated* space and is rotated
along when the eigenbasis changes. (The paper's Algorithm and the code before f42d296 kept it in the
original space and projected it every step.) For a 2-D parameter with gradient ``G_t`` (k-D: one
factor per dim; batch axes of stacked layers are independent matrices)::

    L_t = beta_s L_{t-1} + (1 - beta_s) G_t G_t^T,  R_t = beta_s R_{t-1} + (1 - beta_s) G_t^T G_t
          (L_0 = R_0 = 0, beta_s = shampoo_beta, or b2 when shampoo_beta < 0)
    step 1 only initialises: L_1, R_1, then Q_L, Q_R = eigenvectors of L_1, R_1 (eigh, columns
          by decreasing eigenvalue); the update is zero
    step t >= 2, with s = t - 1 Adam steps:
      G'  = Q_L^T G_t Q_R                                (rotate with the current bases)
      m_s = b1 m_{s-1} + (1 - b1) G';  v_s = b2 v_{s-1} + (1 - b2) G'^2
      update = sqrt(1 - b2^s) / (1 - b1^s) * Q_L (m_s / (sqrt(v_s) + eps)) Q_R^T
      update L_t, R_t with G_t; if s % precondition_frequency == 0, refresh each basis by one power
      iteration and QR: sort Q's columns by the estimated eigenvalues diag(Q^T L Q) (descending),
      permute v's rows/cols the same way, Q <- QR(L Q); and rotate m into the new basis:
      m <- Q_L'^T (Q_L m Q_R^T) Q_R'.

Dims longer than ``max_precond_dim`` are not rotated (identity basis); 1-D parameters only with
``precondition_1d``; a parameter with no rotated dim gets plain Adam. Defaults are the reference's:
b1 = b2 = 0.95, eps 1e-8, precondition_frequency 10, max_precond_dim 10000, merge_dims False,
weight decay 0.01 (`soap`). Differences: weight decay is decoupled through
`optax.add_decayed_weights` (applied to the pre-update weights, and also at step 1, where the
reference skips the whole step); the reference's every-step round trip ``project(project_back(m))``
with an unchanged basis is skipped (it is the identity).

Statistics and bases of all parameters are stacked per side ``b`` into ``(n, b, b)`` arrays with
mesh-independent shapes, spread over the ambient mesh (`optim.blocking`), so eigh / QR run batched
and distributed.
Under `optax.inject_hyperparams` pass ``static_args=STATIC_ARGS``. `optax.tree.map_params` cannot
map this state (the stacks' group keys come from parameter shapes, which its placeholder lacks): use
`optim.blocking.map_params`, its equivalent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import blocking, common, matrix_roots, shapes, spec

STATIC_ARGS = ("max_precond_dim",)


class SoapState(NamedTuple):
    """State of `scale_by_soap`."""

    count: jax.Array  # calls so far, int32 (the first only initialises the bases)
    mu: optax.Updates  # first moment m, in the rotated space, float32, like the parameters
    nu: optax.Updates  # second moment v, in the rotated space, float32, like the parameters
    stats: blocking.BlockStacks  # L, R factors: (n, b, b) per side b, spread over devices
    bases: blocking.BlockStacks  # eigenbases Q_L, Q_R, same layout


def _rotate(
    layout: blocking.TensorLayout, x: jax.Array, mats: list, *, into: bool, precision: jax.lax.Precision
) -> jax.Array:
    """``Q_L^T X Q_R`` (``into``, projection) or ``Q_L X Q_R^T`` (back) on every block of ``x``."""
    return layout.from_blocks(blocking.apply_factors(layout.to_blocks(x), mats, transpose=into, precision=precision))


def _permute(layout: blocking.TensorLayout, x: jax.Array, orders: list) -> jax.Array:
    """Reorders every rotated dim of each block of ``x`` by its (M, b) index array."""
    out = []
    for rb, region_orders in zip(layout.to_blocks(x), orders, strict=True):
        for i, order in enumerate(region_orders):
            if order is not None:
                shape = [rb.shape[0]] + [1] * (rb.ndim - 1)
                shape[1 + i] = rb.shape[1 + i]
                rb = jnp.take_along_axis(rb, jnp.broadcast_to(order.reshape(shape), rb.shape), axis=1 + i)
        out.append(rb)
    return layout.from_blocks(out)


def eigenbasis(stats: jax.Array) -> jax.Array:
    """Eigenvectors of each symmetric matrix, columns by decreasing eigenvalue."""
    _, vecs = matrix_roots.lapack_map(jnp.linalg.eigh, stats)
    return vecs[..., ::-1]


def power_qr(stats: jax.Array, bases: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One power iteration + QR from the current bases; returns (new bases, column order used)."""
    estimate = jnp.einsum("nij,nik,nkj->nj", bases, stats, bases, precision=blocking.HIGHEST)
    order = jnp.argsort(-estimate, axis=-1)
    bases = jnp.take_along_axis(bases, order[:, None, :], axis=2)
    q, _ = matrix_roots.lapack_map(jnp.linalg.qr, jnp.matmul(stats, bases, precision=blocking.HIGHEST))
    return q, order


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoapDirection:
    """SOAP's bias-corrected direction (module docstring); no learning rate.

    Attributes:
      b1: first-moment EMA coefficient.
      b2: second-moment EMA coefficient.
      eps: added to ``sqrt(v)``.
      shampoo_beta: EMA coefficient of the L / R statistics; < 0 means ``b2``.
      precondition_frequency: Adam steps between eigenbasis refreshes (power iteration + QR).
      max_precond_dim: dims longer than this are not rotated.
      merge_dims: merge adjacent dims while the product stays <= ``max_precond_dim``.
      precondition_1d: rotate 1-D parameters too (a full ``(n, n)`` statistic).
      batch_leading_axes: axes before the last two are batch axes (scan-stacked layers). False:
        every axis is a tensor dim, as in the reference.
      matmul_precision: statistics and rotation matmuls, ``"auto"`` | ``"highest"`` | ``"high"``
        (`blocking.matmul_precision`; eigh, QR and the power step always in full fp32).
    """

    b1: float = spec.param(0.95, valid="[0, 1)")
    b2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    shampoo_beta: float = spec.param(-1.0, valid="(-inf, 1)")
    precondition_frequency: int = spec.param(10, valid="[1, inf)")
    max_precond_dim: int = spec.param(10000, valid="[1, inf)")
    merge_dims: bool = False
    precondition_1d: bool = False
    batch_leading_axes: bool = spec.code_only(True)
    matmul_precision: str = "auto"

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS

    def direction(self) -> optax.GradientTransformation:
        return _scale_by_soap(self)


def _scale_by_soap(h: SoapDirection) -> optax.GradientTransformation:
    max_precond_dim = common.static_int("max_precond_dim", h.max_precond_dim, STATIC_ARGS)
    if max_precond_dim < 1:
        raise ValueError(f"max_precond_dim={max_precond_dim} must be >= 1")
    precision = blocking.matmul_precision(h.matmul_precision)

    def make_layout(leaf: jax.Array) -> blocking.TensorLayout | None:
        if leaf.ndim < 1 or (leaf.ndim == 1 and not h.precondition_1d):
            return None
        layout = blocking.tensor_layout(
            leaf.shape,
            block_size=max_precond_dim,
            max_precond_dim=max_precond_dim,
            merge_dims=h.merge_dims,
            batch_leading_axes=h.batch_leading_axes,
        )
        return layout if layout.rank else None

    def layouts(tree: Any):
        leaves, treedef, tensors = blocking.layout_tree(tree, make_layout)
        return leaves, treedef, tensors, blocking.stack_layout(tensors, lambda b, _: f"b{b}")

    def init_fn(params):
        leaves, treedef, _, stack = layouts(params)
        def zeros():  # a fresh buffer per field: a donating jit step must never see one twice
            return treedef.unflatten([jnp.zeros(p.shape, jnp.float32) for p in leaves])

        def stacks(fill):
            return blocking.BlockStacks({k: blocking.constrain_blocks(fill(n, b)) for k, b, n in stack.groups})

        return SoapState(
            count=jnp.zeros([], jnp.int32),
            mu=zeros(),
            nu=zeros(),
            stats=common.by_shapes(params, lambda: stacks(blocking.zeros_fill)),
            bases=common.by_shapes(params, lambda: stacks(blocking.identity_fill)),
        )

    def update_fn(updates, state, params=None):
        del params
        shapes.check_like(updates, state.mu, "soap")
        grads, treedef, tensors, stack = layouts(updates)
        g32 = [g.astype(jnp.float32) for g in grads]
        first = state.count == 0
        s = jnp.maximum(state.count, 1)
        old_mats = blocking.unstack(stack, state.bases)

        def rotate(x, lay, mats, into):
            return x if lay is None else _rotate(lay, x, mats, into=into, precision=precision)

        mu, nu, direction = [], [], []
        leaves = zip(g32, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu), tensors, old_mats, strict=True)
        for g, m, v, lay, mats in leaves:
            g_rot = rotate(g, lay, mats, True)
            m = h.b1 * m + (1 - h.b1) * g_rot
            v = h.b2 * v + (1 - h.b2) * g_rot * g_rot
            d = rotate(m / (jnp.sqrt(v) + h.eps), lay, mats, False)
            mu.append(m)
            nu.append(v)
            direction.append(jnp.where(first, 0.0, d * (jnp.sqrt(1 - h.b2**s) / (1 - h.b1**s))))

        blocks = [None if lay is None else lay.to_blocks(g) for g, lay in zip(g32, tensors, strict=True)]
        outer = blocking.factor_statistics(stack, blocks, precision)
        beta_s = jnp.where(h.shampoo_beta < 0, h.b2, h.shampoo_beta)
        stats = blocking.BlockStacks(
            {k: blocking.constrain_blocks(beta_s * state.stats[k] + (1 - beta_s) * outer[k]) for k in state.stats}
        )

        def keep(bases, mu, nu):
            return bases, mu, nu

        def initialise(bases, mu, nu):
            new = {k: blocking.constrain_blocks(blocking.spread_blocks(eigenbasis, stats[k])) for k in stats}
            new = blocking.BlockStacks(new)
            return new, [jnp.zeros_like(m) for m in mu], [jnp.zeros_like(v) for v in nu]

        def refresh(bases, mu, nu):
            pairs = {k: blocking.spread_blocks(power_qr, stats[k], bases[k]) for k in stats}
            new = blocking.BlockStacks({k: blocking.constrain_blocks(q) for k, (q, _) in pairs.items()})
            orders = blocking.unstack(stack, blocking.BlockStacks({k: o for k, (_, o) in pairs.items()}))
            new_mats = blocking.unstack(stack, new)
            mu = [
                rotate(rotate(m, lay, old, False), lay, fresh, True)
                for m, lay, old, fresh in zip(mu, tensors, old_mats, new_mats, strict=True)
            ]
            nu = [v if lay is None else _permute(lay, v, o) for v, lay, o in zip(nu, tensors, orders, strict=True)]
            return new, mu, nu

        branch = jnp.where(first, 1, jnp.where(s % h.precondition_frequency == 0, 2, 0))
        bases, mu, nu = jax.lax.switch(branch, (keep, initialise, refresh), state.bases, mu, nu)
        new_state = SoapState(
            count=state.count + 1,
            mu=treedef.unflatten(mu),
            nu=treedef.unflatten(nu),
            stats=stats,
            bases=bases,
        )
        out = [d.astype(g.dtype) for d, g in zip(direction, grads, strict=True)]
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Soap(SoapDirection, common.MatrixOptimizer):
    """SOAP on hidden matrices, AdamW on embeddings, LM head, norms, biases and scalars.

    Matrix leaves: ``chain(scale_by_soap(...), add_decayed_weights(weight_decay),
    scale_by_learning_rate(learning_rate))``; the rest: AdamW with ``adam_lr_ratio * learning_rate``
    (or ``adam_learning_rate``), see `optim.common.with_adam`. The reference's learning rate is 3e-3.
    Hyperparameters: `SoapDirection`, `optim.common.AdamGroup`.

    Example:
      >>> tx = soap(optax.cosine_decay_schedule(3e-3, 1000))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
    """

    learning_rate: optax.ScalarOrSchedule = 6e-3  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.01
    # Only hidden matrices reach the SOAP direction here, so no 1-D leaf could be rotated: not a config key.
    precondition_1d: bool = spec.code_only(False, doc="must stay False: 1-D parameters take AdamW here.")

    def __post_init__(self) -> None:
        if self.precondition_1d:
            raise ValueError(
                "soap sends 1-D parameters (norm scales, biases) to AdamW, so precondition_1d=True would do nothing; "
                "to rotate them, use optim.soap.scale_by_soap(precondition_1d=True) in an optax.partition of your own"
            )


scale_by_soap = spec.function(SoapDirection, "direction", name="scale_by_soap", positional=("b1", "b2", "eps"))
soap = spec.function(Soap, name="soap")
