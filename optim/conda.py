"""Conda: column-normalised Adam, Adam in the singular basis of the momentum (Wang et al., "Conda:
Column-Normalized Adam for Training Large Language Models Faster", arXiv:2509.24218).

For each hidden matrix (layout ``(*batch, fan_in, fan_out)``, per matrix) with gradient ``G_t``,
``t`` from 1, and ``Q`` an orthogonal basis of the matrix's *shorter* side:

    M_t = b1 M_{t-1} + (1 - b1) G_t
    Q  <- the singular vectors of M_t on the shorter side      when t = 1 or t % update_proj_gap = 0
          (fan_in <= fan_out: M_t = Q S V^T, rotate rows; else M_t = U S Q^T, rotate columns)
    G' = Q^T G_t,  M' = Q^T M_t                                (or G_t Q, M_t Q)
    V_t = b2 V_{t-1} + (1 - b2) G' * G'                        element-wise, in the rotated basis
    D_t = sqrt(1 - b2^t) / (1 - b1^t) Q (M' / (sqrt(V_t) + eps))   (or (...) Q^T)
    W_{t+1} = W_t - lr_t (D_t + lambda W_t)

In the rotated basis each coordinate is one singular direction of the momentum, so Adam's
element-wise normalisation there normalises the update per singular direction ("column"), a cheap
step towards Muon's orthogonalised update that keeps Adam's adaptivity. ``V`` is not rotated when
``Q`` is refreshed (as in the reference). Only the basis's side is stored: ``min(fan_in,
fan_out)^2`` floats per matrix besides Adam's two moments.

Reference matched step by step (tests/optim/test_conda.py: the installed implementation itself, float64
PyTorch, where an interpreter with it exists, to 1e-4 of the weights' movement over 6 steps; and a
float64 NumPy transcription that always runs):
pytorch-optimizer's ``Conda`` (kozistr/pytorch_optimizer ``optimizer/conda.py`` with its
``GaLoreProjector(rank=None, projection_type="std")``). Its PyTorch ``(out, in)`` weights are the
transpose of the repo's, so its "right" projection on tall weights is the row rotation here; both
rotate the shorter side. Differences: its decoupled decay multiplies the already-updated weight,
here the pre-update weight (optax's and AdamW's convention), a change of order ``lr^2 lambda``; its
Conda treats every 2-D parameter (embeddings too), here embeddings, LM head, norms and biases go to
AdamW (`optim.common.with_adam`), which is its non-2-D branch with bias correction moved into ``eps``.
Defaults are the reference's (b1 0.9, b2 0.999, eps 1e-8, ``update_proj_gap`` 2000: a run shorter
than that keeps the basis of its first momentum; pass a smaller gap for short runs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, matrix_roots, spec
from optim import newton_schulz as ns
from optim.muon import check_matrices


class CondaState(NamedTuple):
    """State of `scale_by_conda`."""

    count: jax.Array  # steps taken, int32
    mu: optax.Updates  # first moment M_t, float32, like the parameters
    nu: optax.Updates  # second moment V_t in the rotated basis, float32, like the parameters
    basis: optax.Updates  # Q: (*batch, k, k), k = min(fan_in, fan_out), float32


def rotates_rows(shape: tuple[int, ...]) -> bool:
    """Whether ``Q`` acts on the fan-in axis (the shorter side; fan-in on a tie, as the reference)."""
    return shape[-2] <= shape[-1]


def singular_basis(m: jax.Array) -> jax.Array:
    """The singular vectors of ``m`` on its shorter side, as columns, by decreasing singular value."""
    u, _, vh = matrix_roots.lapack_each(functools.partial(jnp.linalg.svd, full_matrices=False), m)
    return u if rotates_rows(m.shape) else jnp.swapaxes(vh, -1, -2)


def project(x: jax.Array, q: jax.Array) -> jax.Array:
    return jnp.swapaxes(q, -1, -2) @ x if rotates_rows(x.shape) else x @ q


def project_back(x: jax.Array, q: jax.Array) -> jax.Array:
    return q @ x if rotates_rows(x.shape) else x @ jnp.swapaxes(q, -1, -2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CondaDirection:
    """Conda's direction ``D_t`` for a pytree of matrices (module docstring), no learning rate.

    Attributes:
      b1: decay of the first moment.
      b2: decay of the second moment (in the rotated basis).
      eps: added to ``sqrt(V_t)`` (before the bias correction, as the reference).
      update_proj_gap: steps between refreshes of the basis (and at step 1).
    """

    b1: float = spec.param(0.9, valid="[0, 1)")
    b2: float = spec.param(0.999, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="[0, inf)")
    update_proj_gap: int = spec.param(2000, valid="[1, inf)")

    family: ClassVar[str] = "conda"

    def direction(self) -> optax.GradientTransformation:
        def init_fn(params):
            check_matrices(params, None, self.family)
            for p in jax.tree.leaves(params):
                ns.split_axes(p.shape, ns.MatrixAxes())

            def basis(p):
                k = min(p.shape[-2:])
                return jnp.zeros((*p.shape[:-2], k, k), jnp.float32)

            return CondaState(
                count=jnp.zeros([], jnp.int32),
                mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                nu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
                basis=jax.tree.map(basis, params),
            )

        def update_fn(updates, state, params=None, **extra):
            del params, extra
            # float32 hyperparameters, as `optax.inject_hyperparams` gives them: the basis is the SVD of
            # M_t, whose vectors move by (rounding of M_t) / (singular value gap), so M_t must not depend
            # on whether b1 arrived as a Python float or an array.
            b1, b2, eps = (jnp.asarray(x, jnp.float32) for x in (self.b1, self.b2, self.eps))
            count = optax.safe_increment(state.count)
            refresh = (count == 1) | (count % self.update_proj_gap == 0)
            scale = jnp.sqrt(1 - b2**count) / (1 - b1**count)

            def leaf(g, m, v, q):
                g32 = g.astype(jnp.float32)
                m = b1 * m + (1 - b1) * g32
                q = jax.lax.cond(refresh, singular_basis, lambda _: q, m)
                g_rot = project(g32, q)
                v = b2 * v + (1 - b2) * jnp.square(g_rot)
                d = scale * project_back(project(m, q) / (jnp.sqrt(v) + eps), q)
                return d.astype(g.dtype), m, v, q

            out = jax.tree.map(leaf, updates, state.mu, state.nu, state.basis)
            d, mu, nu, basis = common.unzip(updates, out, 4)
            return d, CondaState(count=count, mu=mu, nu=nu, basis=basis)

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conda(CondaDirection, common.MatrixOptimizer):
    """Conda on hidden matrices, AdamW elsewhere (module docstring); AdamW group: `optim.common.AdamGroup`."""

    learning_rate: optax.ScalarOrSchedule = 3e-3  # best of 1.5e-3, 3e-3, 6e-3: docs/benchmarks.md section 1b
    weight_decay: float = 0.1


scale_by_conda = spec.function(CondaDirection, "direction", name="scale_by_conda", positional=("b1", "b2"))
conda = spec.function(Conda, name="conda")
