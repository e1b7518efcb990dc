"""SOAP-Muon: Muon's momentum whitened in SOAP's eigenbasis before Newton-Schulz.

Vyas et al., "SOAP-Muon" (nikhilvyas.github.io/SOAP_Muon.pdf), as the modded-nanogpt optimization
track runs it on every hidden matrix (records #44 and #46, github.com/KellerJordan/modded-nanogpt at
f411b3d: ``records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/``,
``soap_precondition_momentum`` / ``soap_update_preconditioner`` in the record's script; the record's
other levers, u/w floors, radius pin and the attention trust gate, are not part of it). Per hidden
matrix ``W`` with gradient ``G_t`` (per matrix of a stacked leaf), ``t`` from 1::

    D_t, M_t = momentum direction of G_t             as Muon (EMA + Nesterov, beta 0.95)
    t = 1:  S_t = D_t                                 (no basis yet)
    t > 1:  D' = Q_L^T D_t Q_R;   V_t = b2 V_{t-1} + (1 - b2) D' * D'
            S_t = Q_L (D' / max(sqrt(V_t), eps)) Q_R^T
    O_t = NewtonSchulz(S_t);   update = s(W) O_t
    then L_t = bs L_{t-1} + (1 - bs) G_t G_t^T,  R_t = bs R_{t-1} + (1 - bs) G_t^T G_t
    (bs = shampoo_beta, or b2 when < 0); t = 1: Q_L, Q_R = eigenvectors of L_1, R_1 (decreasing);
    t > 1 with (t - 1) % precondition_frequency == 0: one power iteration + QR from the sorted bases,
    V's rows / columns permuted by the sort (SOAP's refresh, `optim.soap.power_qr`).

So SOAP's second moment is taken of the momentum direction in the rotated space (no bias
correction, no first moment of its own), and Newton-Schulz then orthogonalises the whitened matrix.
Defaults are the record's: ``b2 = bs = 0.9``, ``precondition_frequency = 1``, ``eps = 1e-8`` (its
denominator ``max(V, eps^2)^(1/2)``), Muon's momentum. The record rescales ``S_t`` to the Schatten-4
norm of ``D_t`` before Newton-Schulz: a positive factor per matrix, which the Frobenius normalisation
of Newton-Schulz removes (up to ``ns_eps``), so it is left out. Its Newton-Schulz is 12 steps of
``(2, -1.5, 0.5)`` after a Schatten-4 normalisation, its shape scale ``"jordan"`` with ``lr = 0.0375``;
here the Newton-Schulz and shape scale are Muon's arguments (``ns_coeffs=((2, -1.5, 0.5),) * 12``
from code gives its iteration under Frobenius normalisation). Statistics and bases use SOAP's
blocked stacks (`optim.blocking`): dims longer than ``max_precond_dim`` are not rotated. Under
`optax.inject_hyperparams` pass ``static_args=STATIC_ARGS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import blocking, common, shapes, spec
from optim import newton_schulz as ns
from optim.muon import MuonDirection, check_matrices, momentum_direction, shape_factor
from optim.soap import _permute, _rotate, eigenbasis, power_qr

STATIC_ARGS = ("max_precond_dim",)


class SoapMuonState(NamedTuple):
    """State of `scale_by_soap_muon`."""

    count: jax.Array  # steps taken, int32
    mu: optax.Updates  # Muon's momentum M_t, like the parameters
    nu: optax.Updates  # V_t, the rotated direction's second moment, float32, like the parameters
    stats: blocking.BlockStacks  # L, R: (n, b, b) per side b, spread over devices
    bases: blocking.BlockStacks  # Q_L, Q_R, same layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoapMuonDirection(MuonDirection):
    """SOAP-Muon's direction ``s(W) NewtonSchulz(S_t)`` (module docstring); Muon's fields and:

    Attributes:
      b2: decay of the second moment ``V`` of the rotated momentum direction.
      eps: floor of ``sqrt(V)``.
      shampoo_beta: decay of the ``L`` / ``R`` statistics; < 0 means ``b2``.
      precondition_frequency: steps between eigenbasis refreshes (power iteration + QR).
      max_precond_dim: dims longer than this are not rotated.
      matmul_precision: statistics and rotation matmuls (`optim.blocking.matmul_precision`).
    """

    b2: float = spec.param(0.9, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    shampoo_beta: float = spec.param(-1.0, valid="(-inf, 1)")
    precondition_frequency: int = spec.param(1, valid="[1, inf)")
    max_precond_dim: int = spec.param(10000, valid="[1, inf)")
    matmul_precision: str = "auto"

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS
    family: ClassVar[str] = "soap_muon"

    def direction(self) -> optax.GradientTransformation:
        return _scale_by_soap_muon(self)


def _scale_by_soap_muon(h: SoapMuonDirection) -> optax.GradientTransformation:
    max_precond_dim = common.static_int("max_precond_dim", h.max_precond_dim, STATIC_ARGS)
    precision = blocking.matmul_precision(h.matmul_precision)

    def make_layout(leaf: jax.Array) -> blocking.TensorLayout | None:
        layout = blocking.tensor_layout(
            leaf.shape, block_size=max_precond_dim, max_precond_dim=max_precond_dim, merge_dims=False, batch_leading_axes=True
        )
        return layout if layout.rank else None

    def layouts(tree: Any):
        leaves, treedef, tensors = blocking.layout_tree(tree, make_layout)
        return leaves, treedef, tensors, blocking.stack_layout(tensors, lambda b, _: f"b{b}")

    def rotate(x, lay, mats, into):
        return x if lay is None else _rotate(lay, x, mats, into=into, precision=precision)

    def init_fn(params):
        check_matrices(params, h.dimension_numbers, h.family)
        leaves, treedef, _, stack = layouts(params)

        def zeros(dtype):  # a fresh buffer per field: a donating jit step must never see one twice
            return treedef.unflatten([jnp.zeros(p.shape, dtype) for p in leaves])

        def stacks(fill):
            return blocking.BlockStacks({k: blocking.constrain_blocks(fill(n, b)) for k, b, n in stack.groups})

        return SoapMuonState(
            count=jnp.zeros([], jnp.int32),
            mu=zeros(h.mu_dtype),
            nu=zeros(jnp.float32),
            stats=common.by_shapes(params, lambda: stacks(blocking.zeros_fill)),
            bases=common.by_shapes(params, lambda: stacks(blocking.identity_fill)),
        )

    def update_fn(updates, state, params=None):
        del params
        shapes.check_like(updates, state.mu, h.family)
        grads, treedef, tensors, stack = layouts(updates)
        axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, h.dimension_numbers))
        g32 = [g.astype(jnp.float32) for g in grads]
        # float32 from the start, so ``1 - b2`` rounds alike whether or not optax.inject_hyperparams made them arrays
        b2, eps, shampoo_beta = (jnp.asarray(x, jnp.float32) for x in (h.b2, h.eps, h.shampoo_beta))
        first = state.count == 0
        mats = blocking.unstack(stack, state.bases)
        pairs = [
            momentum_direction(g, m, h.beta, h.momentum_form, h.nesterov)
            for g, m in zip(g32, treedef.flatten_up_to(state.mu), strict=True)
        ]
        whitened, nu = [], []
        for (d, _), v, lay, q in zip(pairs, treedef.flatten_up_to(state.nu), tensors, mats, strict=True):
            d_rot = rotate(d, lay, q, True)
            v_new = b2 * v + (1 - b2) * d_rot * d_rot
            s = rotate(d_rot / jnp.maximum(jnp.sqrt(v_new), eps), lay, q, False)
            whitened.append(jnp.where(first, d, s))
            nu.append(jnp.where(first, v, v_new))
        xs = treedef.flatten_up_to(h.orthogonalize(treedef.unflatten(whitened), h.dimension_numbers))
        out = [(x * shape_factor(x.shape, ax, h.shape_scale)).astype(g.dtype) for x, ax, g in zip(xs, axes, grads, strict=True)]

        blocks = [None if lay is None else lay.to_blocks(g) for g, lay in zip(g32, tensors, strict=True)]
        outer = blocking.factor_statistics(stack, blocks, precision)
        beta_s = jnp.where(shampoo_beta < 0, b2, shampoo_beta)
        stats = blocking.BlockStacks(
            {k: blocking.constrain_blocks(beta_s * state.stats[k] + (1 - beta_s) * outer[k]) for k in state.stats}
        )

        def keep(bases, nu):
            return bases, nu

        def initialise(bases, nu):
            return blocking.BlockStacks({k: blocking.constrain_blocks(blocking.spread_blocks(eigenbasis, stats[k])) for k in stats}), nu

        def refresh(bases, nu):
            found = {k: blocking.spread_blocks(power_qr, stats[k], bases[k]) for k in stats}
            orders = blocking.unstack(stack, blocking.BlockStacks({k: o for k, (_, o) in found.items()}))
            nu = [v if lay is None else _permute(lay, v, o) for v, lay, o in zip(nu, tensors, orders, strict=True)]
            return blocking.BlockStacks({k: blocking.constrain_blocks(q) for k, (q, _) in found.items()}), nu

        branch = jnp.where(first, 1, jnp.where(state.count % h.precondition_frequency == 0, 2, 0))
        bases, nu = jax.lax.switch(branch, (keep, initialise, refresh), state.bases, nu)
        mu = treedef.unflatten([m.astype(h.mu_dtype) for _, m in pairs])
        new_state = SoapMuonState(count=state.count + 1, mu=mu, nu=treedef.unflatten(nu), stats=stats, bases=bases)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoapMuon(SoapMuonDirection, common.MatrixOptimizer):
    """SOAP-Muon on hidden matrices, AdamW elsewhere; hyperparameters as `optim.muon.muon` plus
    `SoapMuonDirection`'s."""

    # Muon's swept default (docs/benchmarks.md, "Default learning rates"), not swept for SOAP-Muon:
    # Newton-Schulz makes its update Muon-sized whatever the whitening.
    learning_rate: optax.ScalarOrSchedule = 1.2e-2
    weight_decay: float = 0.1


scale_by_soap_muon = spec.function(SoapMuonDirection, "direction", name="scale_by_soap_muon", positional=("beta", "b2"))
soap_muon = spec.function(SoapMuon, name="soap_muon")
