"""Dion: orthonormal updates from one step of low-rank power iteration with error feedback (Ahn, Xu,
Abreu and Langford, "Dion: Distributed Orthonormalized Updates", arXiv:2504.05295).

For each hidden matrix ``W`` (layout ``(*batch, fan_in, fan_out)``, per matrix) with gradient ``G``,
written for PyTorch's ``X = W^T`` (``(fan_out, fan_in)``) as the paper and the reference do, with
``Q`` an ``(fan_in, r)`` matrix carried between steps (random normal at ``init``):

    B_t = M_{t-1} + G_t                                  (momentum buffer plus the gradient)
    P_t = QR(B_t Q_{t-1})                                 (fan_out, r): one power-iteration step
    R_t = B_t^T P_t                                       (fan_in, r);  B_t ~ P_t R_t^T
    M_t = B_t - (1 - mu) P_t R_t^T                        error feedback: what rank r missed stays
    Q_t = R_t / (||R_t||_col + eps)                       column-normalised
    W_{t+1} = W_t - lr_t (sqrt(fan_out / fan_in) (P_t Q_t^T)^T + lambda W_t)

``P_t Q_t^T`` has orthonormal columns on the left and unit columns on the right: a rank-``r``
stand-in for Muon's ``U V^T`` at ``O((m + n) r)`` communication instead of ``O(m n)`` once sharded.
The rank is ``r = max(1, round(rank_fraction * min(fan_in, fan_out)))``. A wide ``X`` (``fan_out <
fan_in``) runs these steps on ``X^T`` (``transpose_wide``, as microsoft/dion's ``Dion`` sets
``is_transposed = m < n`` for an unsharded matrix), so ``Q`` is ``(fan_out, r)`` there and the power
iteration always tracks the longer side; the step's scale stays ``sqrt(fan_out / fan_in)`` of ``X``.
``transpose_wide=False`` keeps ``dion_simple.py``'s one orientation (its ``dion_update`` never
transposes).

Reference matched step by step (tests/optim/test_dion.py, a float64 NumPy transcription):
microsoft/dion ``dion/dion_simple.py`` (``dion_update``: the steps above, plain QR, ``eps = 1e-8``,
decay on the pre-update weight), with the initial ``Q`` taken from this module's ``init``; its
random draw is ``jax.random.normal`` from ``seed`` (the reference draws ``torch.randn``). Defaults:
the reference's ``mu = 0.95`` and ``eps``; ``rank_fraction = 0.25`` where the reference class takes
full rank, since a low rank is Dion's point (the paper runs 1/4 to 1/16). With ``state_bits=8`` a
full-rank ``Q`` of a square matrix has the parameter's shape and is stored in 8 bits like the
moments (a perturbed warm start of the power iteration, not a wrong step).

Sharded, the paper's Algorithm 3: ``B`` and ``M`` stay in the weight's layout and only r-wide
factors move (`low_rank` pins them for GSPMD). Fan-in split: ``B^T Q`` all-reduces ``fan_out x r``
partial sums. Fan-out split: ``B^T Q``'s rows are gathered (``fan_out x r``) for the QR and ``B P``
all-reduces ``fan_in x r``. The column norms all-reduce ``r`` floats. microsoft/dion's
``dion_update_fsdp`` moves the same factors but reduces ``P`` onto one owner per matrix for a
randomized Cholesky QR; here every device orthonormalises the reduced ``P`` itself (`orthonormalize`:
Householder QR on CPU, shifted Cholesky QR 3 from matrix products on accelerators). From the compiled
HLO (experiments/bench_optimizer_comm.py, docs/benchmarks.md 6a): at ``r = d/8`` a `tiny` step moves
1.10x AdamW's collective bytes on ``fsdp:8`` (unpinned, GSPMD gathered whole matrices: 1.57x).

Under `optax.inject_hyperparams` pass ``static_args=STATIC_ARGS`` (the rank sets ``Q``'s shape).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import blocking, common, matrix_roots, spec
from optim.muon import check_matrices

STATIC_ARGS = ("rank_fraction", "seed")


class DionState(NamedTuple):
    """State of `scale_by_dion`."""

    mu: optax.Updates  # momentum buffer M_t, float32, like the parameters
    q: optax.Updates  # Q_t: (*batch, fan_in, r), float32; (*batch, fan_out, r) for a transposed wide matrix


def rank(shape: tuple[int, ...], fraction: float) -> int:
    """``r`` for a leaf of ``shape``: ``max(1, round(fraction * min(fan_in, fan_out)))``."""
    return max(1, round(fraction * min(shape[-2:])))


def low_rank(x: jax.Array, rows: str) -> jax.Array:
    """Pins an r-wide factor ``(*batch, rows, r)`` under the ambient mesh (no-op without one).

    ``r`` is never split, and the rows are replicated (``"replicate"``: ``P`` before and after its QR)
    or left where GSPMD puts them (``"keep"``: ``Q`` and ``R``, which follow the weight's fan-in
    split). With ``B`` in the weight's layout, the products then reduce or gather only r-wide
    factors: ``B^T Q`` all-reduces ``fan_out x r`` partial sums when fan-in is split, or gathers
    its ``fan_out x r`` rows for the QR when fan-out is; ``B P`` all-reduces ``fan_in x r`` when
    fan-out is split; ``||R||_col`` all-reduces ``r`` floats; nothing gathers ``B``.
    """
    if not blocking.mesh_axes()[0]:
        return x
    free = jax.P.UNCONSTRAINED
    spec = jax.P(*([free] * (x.ndim - 2)), None if rows == "replicate" else free, None)
    return jax.lax.with_sharding_constraint(x, spec)


def orthonormalize(p: jax.Array) -> jax.Array:
    """``Q`` of ``P = QR`` for ``(*batch, m, r)`` factors, ``m >= r``: Householder QR on CPU
    (`matrix_roots.lapack_each`, one matrix at a time), `cholesky_qr` elsewhere.

    Batched Householder QR on a GPU is a chain of small solver kernels; Cholesky QR is two products
    per pass (microsoft/dion orthonormalises with a randomized Cholesky QR for the same reason).
    """
    householder = lambda p: matrix_roots.lapack_each(jnp.linalg.qr, p)[0]  # noqa: E731
    if p.shape[-2] < p.shape[-1]:
        return householder(p)
    return jax.lax.platform_dependent(p, cpu=householder, default=cholesky_qr)


def cholesky_qr(p: jax.Array, tolerance: float = 1e-4) -> jax.Array:
    """``Q`` of ``P = QR`` (``R``'s diagonal positive) by shifted Cholesky QR 3: matrix products and ``r x r``
    Cholesky factors only; Householder QR where that does not give orthonormal columns.

    A pass is ``G = P^T P + s I``, ``L = chol(G)``, ``P <- P L^{-T}`` (``L^{-T}`` from an ``r x r``
    triangular solve, applied as one product). The first pass shifts by ``s = 11 (m r + r (r + 1)) u
    ||P||_F^2``, which keeps ``G`` positive definite for ``cond(P)`` up to ``~u^{-1}`` and leaves ``P``
    well conditioned; two unshifted passes (CholeskyQR2) then make it orthonormal to ``O(u)``
    (Fukaya, Kannan, Nakatsukasa, Yamamoto and Yanagisawa, "Shifted Cholesky QR for computing the QR
    factorization of ill-conditioned matrices", SIAM J. Sci. Comput. 2020). A (nearly) rank-deficient
    ``P`` (a gradient of rank below ``r``) keeps columns that are not unit vectors: where ``Q^T Q`` is
    more than ``tolerance`` from ``I`` (or not finite), the stack takes Householder QR,
    which completes the basis, as the reference's QR does. Products at full float32 precision (no TF32).
    """
    highest = jax.lax.Precision.HIGHEST
    m, r = p.shape[-2:]
    eye = jnp.eye(r, dtype=jnp.float32)
    q = p.astype(jnp.float32)
    for shifted in (True, False, False):
        gram = jnp.einsum("...mi,...mj->...ij", q, q, precision=highest)
        if shifted:
            shift = 11.0 * (m * r + r * (r + 1)) * jnp.finfo(jnp.float32).eps * jnp.trace(gram, axis1=-2, axis2=-1)
            gram = gram + shift[..., None, None] * eye
        lower = jnp.linalg.cholesky(gram)
        inverse = jax.lax.linalg.triangular_solve(lower, jnp.broadcast_to(eye, lower.shape), left_side=True, lower=True)
        q = jnp.einsum("...mi,...ji->...mj", q, inverse, precision=highest)  # P L^{-T}
    error = jnp.max(jnp.abs(jnp.einsum("...mi,...mj->...ij", q, q, precision=highest) - eye))
    return jax.lax.cond(jnp.isfinite(error) & (error <= tolerance), lambda: q, lambda: jnp.linalg.qr(p.astype(jnp.float32))[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionDirection:
    """Dion's direction ``sqrt(fan_out / fan_in) Q_t P_t^T`` per matrix (module docstring).

    Attributes:
      mu: error-feedback momentum: the share of the rank-r approximation kept in ``M``.
      rank_fraction: ``r`` as a fraction of ``min(fan_in, fan_out)``.
      eps: added to ``R``'s column norms.
      seed: seed of the random initial ``Q``.
      transpose_wide: run a wide ``X`` (``fan_out < fan_in``) transposed, as microsoft/dion's ``Dion``.
    """

    mu: float = spec.param(0.95, valid="[0, 1]")
    rank_fraction: float = spec.param(0.25, valid="(0, 1]")
    eps: float = spec.param(1e-8, valid="[0, inf)")
    seed: int = 0
    transpose_wide: bool = True

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS
    family: ClassVar[str] = "dion"

    def direction(self) -> optax.GradientTransformation:
        def init_fn(params):
            check_matrices(params, None, self.family)
            try:
                fraction = float(self.rank_fraction)
            except jax.errors.ConcretizationTypeError:
                raise ValueError(
                    f"rank_fraction sets Q's shape; with optax.inject_hyperparams pass static_args={STATIC_ARGS}"
                ) from None
            leaves, treedef = jax.tree.flatten(params)
            key = jax.random.key(common.static_int("seed", self.seed, STATIC_ARGS))
            keys = jax.random.split(key, max(1, len(leaves)))
            qs = [
                jax.random.normal(k, (*p.shape[:-2], self._rows(p.shape), rank(p.shape, fraction)), jnp.float32)
                for k, p in zip(keys, leaves, strict=False)
            ]
            return DionState(
                mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), q=treedef.unflatten(qs)
            )

        def update_fn(updates, state, params=None, **extra):
            del params, extra
            mu_, eps = jnp.asarray(self.mu, jnp.float32), jnp.asarray(self.eps, jnp.float32)

            def leaf(g, m, q):
                fan_in, fan_out = g.shape[-2:]
                flip = self._rows(g.shape) != fan_in
                b = m + g.astype(jnp.float32)  # W layout: B_t^T
                b = jnp.swapaxes(b, -1, -2) if flip else b  # (rows, cols) of the matrix the steps run on
                p = low_rank(jnp.swapaxes(b, -1, -2) @ low_rank(q, "keep"), "replicate")  # (fan_out, r)
                p = low_rank(orthonormalize(p), "replicate")
                r = low_rank(b @ p, "keep")  # (fan_in, r)
                m = b - (1 - mu_) * r @ jnp.swapaxes(p, -1, -2)
                q = r / (jnp.linalg.norm(r, axis=-2, keepdims=True) + eps)
                d = (fan_out / fan_in) ** 0.5 * q @ jnp.swapaxes(p, -1, -2)
                if flip:
                    d, m = jnp.swapaxes(d, -1, -2), jnp.swapaxes(m, -1, -2)
                return d.astype(g.dtype), m, q

            out = jax.tree.map(leaf, updates, state.mu, state.q)
            d, mu, q = common.unzip(updates, out, 3)
            return d, DionState(mu=mu, q=q)

        return optax.GradientTransformation(init_fn, update_fn)

    def _rows(self, shape: tuple[int, ...]) -> int:
        """``Q``'s rows: fan-in, or fan-out where a wide ``X`` runs transposed."""
        fan_in, fan_out = shape[-2:]
        return fan_out if self.transpose_wide and fan_out < fan_in else fan_in


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dion(DionDirection, common.MatrixOptimizer):
    """Dion on hidden matrices, AdamW elsewhere (module docstring); AdamW group: `optim.common.AdamGroup`."""

    # Swept on the default job (docs/benchmarks.md 1b): 1e-2 2.127, 2e-2 2.003, 4e-2 1.998, 8e-2 2.076; the reference's decay
    learning_rate: optax.ScalarOrSchedule = 0.02
    weight_decay: float = 0.01
    adam_lr_ratio: float = spec.param(0.15, valid="[0, inf)")  # AdamW group at 3e-3, the AdamW default


scale_by_dion = spec.function(DionDirection, "direction", name="scale_by_dion", positional=("mu",))
dion = spec.function(Dion, name="dion")
