"""KL-Shampoo: Shampoo whose factor statistics come from KL-divergence minimisation.

Lin, Lowe, Dangel, Eschenhagen, Xu & Grosse, "Understanding and Improving Shampoo and SOAP via
Kullback-Leibler Minimization" (arXiv:2509.03378). Reference matched: the simplified KL-Shampoo of
facebookresearch/optimizers (``RootInvKLShampooPreconditionerConfig``, "without per-factor matrix
eigenvalue correction", 2025-12): everything is `optim.shampoo`'s (blocking, grafting, momentum, roots,
refresh schedule) except the outer product that feeds each factor. For a block ``G`` with
preconditioned dims ``1..k`` and the current inverse roots ``P_j = (S_j + r I)^(-1/p)`` (the ones the
step before last refresh computed; identity before the first)::

    X^(i) = G x_{j != i} P_j                  (G preconditioned along every other dim)
    S_i <- beta2 S_i + (1 - beta2) X^(i)_(i) X^(i)_(i)^T        (Shampoo: G_(i) G_(i)^T)

For a matrix with ``p = 2`` (``exponent_override=2``) this is the paper's two-sided estimate
``L <- beta2 L + (1 - beta2) G R^{-1} G^T``, ``R <- beta2 R + (1 - beta2) G^T L^{-1} G`` with the
preconditioned step ``L^{-1/2} G R^{-1/2}``; by default ``p = 2k`` as in the reference (its
``1 / (2 max(order, 1))``). The paper's per-factor eigenvalue correction (its full KL-Shampoo / KL-SOAP)
is not in the reference's simplified form and not here, nor is its ``1 / d`` scaling of the outer
products (the reference has none). Root ridge, statistics initialisation and the refresh schedule are
`optim.shampoo`'s (distributed Shampoo's), not the PyTorch reference's absolute epsilon.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from optim import blocking, common, spec
from optim.shampoo import ShampooDirection


def kl_outer_products(
    stack: blocking.StackLayout,
    blocks: list[list[jax.Array] | None],
    preconds: blocking.BlockStacks,
    precision: jax.lax.Precision,
) -> blocking.BlockStacks:
    """``X^(i)_(i) X^(i)_(i)^T`` of every block and preconditioned dim ``i``, ``X^(i) = G x_{j != i} P_j``."""
    mats = blocking.unstack(stack, preconds)
    outer = []
    for leaf_blocks, leaf_mats in zip(blocks, mats, strict=True):
        leaf_outer = []
        for rb, region_mats in zip(leaf_blocks or (), leaf_mats, strict=True):
            region_outer = []
            for i, m in enumerate(region_mats):
                if m is None:
                    region_outer.append(None)
                    continue
                others = [None if j == i else mj for j, mj in enumerate(region_mats)]
                (x,) = blocking.apply_factors([rb], [others], precision=precision)
                region_outer.append(blocking.factor_statistic(x, i, precision))
            leaf_outer.append(region_outer)
        outer.append(leaf_outer)
    return blocking.stack(stack, outer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLShampooDirection(ShampooDirection):
    """KL-Shampoo's direction: `optim.shampoo.ShampooDirection` with the KL factor statistics (module docstring)."""

    def outer_products(
        self,
        stack: blocking.StackLayout,
        blocks: list[list[jax.Array] | None],
        preconds: blocking.BlockStacks,
        precision: jax.lax.Precision,
    ) -> blocking.BlockStacks:
        return kl_outer_products(stack, blocks, preconds, precision)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLShampoo(KLShampooDirection, common.MatrixOptimizer):
    """KL-Shampoo on hidden matrices, AdamW elsewhere; hyperparameters and defaults as `optim.shampoo.shampoo`
    (the reference's KL-Shampoo is a preconditioner choice inside distributed Shampoo, whose defaults
    it keeps; ``exponent_override=2, graft_type="none"`` is the paper's two-sided form without Adam
    grafting). Learning rate Shampoo's, the best of 1.5e-3, 3e-3 and 6e-3 on the default job
    (docs/benchmarks.md, "Default learning rates")."""

    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = 0.0


scale_by_kl_shampoo = spec.function(
    KLShampooDirection, "direction", name="scale_by_kl_shampoo", positional=("block_size", "beta1", "beta2")
)
kl_shampoo = spec.function(KLShampoo, name="kl_shampoo")
