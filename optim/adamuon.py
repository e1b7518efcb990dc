"""AdaMuon: Muon with an element-wise second moment on the orthogonalised momentum (Si, Zhang and
Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005).

For each hidden matrix ``W`` (layout ``(*batch, fan_in, fan_out)``, per matrix of the batch) with
gradient ``G``, ``m x n`` the matrix and ``t`` the step (from 1):

    D_t, M_t = momentum direction of G_t          as Muon (EMA + Nesterov, beta 0.95, by default)
    O_t = NewtonSchulz(sign(D_t))                 sign_stabilize=True (the paper and the authors' code)
    O_t = NewtonSchulz(D_t)                       sign_stabilize=False
    V_t = beta2 V_{t-1} + (1 - beta2) O_t * O_t   element-wise, shaped like W
    P_t = O_t / (sqrt(V_t) + eps)                 debias=False (the authors' code)
    P_t = O_t / (sqrt(V_t / (1 - beta2^t)) + eps) debias=True
    P_t <- sqrt(min(m, n)) P_t / (||P_t||_F + eps)                        per matrix
    W_{t+1} = W_t - lr_t (s(W) P_t + lambda W_t)

With the default shape scale ``s(W) = 0.2 sqrt(max(m, n))`` (``"moonlight"``) the update is
``0.2 sqrt(m n) P_t / ||P_t||_F``: RMS 0.2, the paper's "RMS-aligned rescaling", so AdamW's
learning rate and schedule serve (the AdamW group shares them, as in `optim.muon`).

Reference matched step by step (tests/optim/test_adamuon.py, a float64 NumPy transcription): the
authors' code, github.com/Chongjie-Si/AdaMuon at 369f0b3, both versions of it (``gpt2/models/
optimizers/adamuon.py`` and the Megatron ``megatron/core/optimizer/muon.py``): Nesterov EMA
momentum, Newton-Schulz of ``sign(D_t)`` (the paper's Algorithm 1 and its "sign-stabilized
orthogonal update"), ``V`` decayed by the momentum coefficient (``beta2 = 0.95``) with no bias
correction, ``eps = 1e-8``, then ``0.2 sqrt(m n) / (||P|| + eps)`` (here ``sqrt(min) / (||P|| + eps)``
times the shape scale ``0.2 sqrt(max)``: the same product). These are the defaults. The repository's
first upload (``adamuon.py`` at 3b84e03) orthogonalised ``D_t`` itself with ``beta2 = 0.999`` and a
bias-corrected ``V``: ``sign_stabilize=False, beta2=0.999, debias=True``. pytorch-optimizer's
``AdaMuon`` is that form with ``nesterov=False``. The bias correction divides ``V`` by one number per
matrix, which the per-matrix rescaling removes up to ``eps``: ``debias`` changes steps by ~1e-7.

Newton-Schulz presets, batching, sharding and the AdamW routing of embeddings, head, norms and
biases are Muon's (optim/muon.py). State: Muon's momentum ``mu``, ``nu`` (``V``, shaped like the
parameter) and the step ``count``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, spec
from optim import newton_schulz as ns
from optim.muon import MuonDirection, check_matrices, momentum_direction, shape_factor


class AdaMuonState(NamedTuple):
    """State of `scale_by_adamuon`."""

    count: jax.Array  # steps taken, int32
    mu: optax.Updates  # momentum M_t, shaped like the parameters
    nu: optax.Updates  # element-wise second moment V_t of the orthogonalised direction, float32


def rms_align(p: jax.Array, ax: ns.MatrixAxes, eps: jax.typing.ArrayLike) -> jax.Array:
    """``sqrt(min(m, n)) P / (||P||_F + eps)`` per matrix: the Frobenius norm of an orthogonal ``m x n``."""
    _, fan_in, fan_out = ns.split_axes(p.shape, ax)
    norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=fan_in + fan_out, keepdims=True))
    return p * (min(ns.fans(p.shape, ax)) ** 0.5 / (norm + eps))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaMuonDirection(MuonDirection):
    """AdaMuon's direction ``s(W) P_t`` (module docstring); other fields as `optim.muon.MuonDirection`.

    Attributes:
      beta2: decay of the element-wise second moment ``V``.
      eps: added to ``sqrt(V_t)`` and to ``||P_t||_F``.
      sign_stabilize: orthogonalise ``sign(D_t)`` (the paper and the authors' code) rather than ``D_t``.
      debias: divide ``V_t`` by ``1 - beta2^t`` (the authors' first upload; their code since does not).
    """

    beta2: float = spec.param(0.95, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    sign_stabilize: bool = True
    debias: bool = False

    family: ClassVar[str] = "adamuon"

    def direction(self) -> optax.GradientTransformation:
        def init_fn(params):
            check_matrices(params, self.dimension_numbers, self.family)
            return AdaMuonState(
                count=jnp.zeros([], jnp.int32),
                mu=jax.tree.map(lambda p: jnp.zeros(p.shape, self.mu_dtype), params),
                nu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            )

        def update_fn(updates, state, params=None, **extra):
            del params, extra
            grads, treedef = jax.tree.flatten(updates)
            axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, self.dimension_numbers))
            pairs = [
                momentum_direction(g, m, self.beta, self.momentum_form, self.nesterov)
                for g, m in zip(grads, treedef.flatten_up_to(state.mu), strict=True)
            ]
            directions = [jnp.sign(d) if self.sign_stabilize else d for d, _ in pairs]
            orthogonal = treedef.flatten_up_to(self.orthogonalize(treedef.unflatten(directions), self.dimension_numbers))
            count = optax.safe_increment(state.count)
            debias = 1 - self.beta2 ** count.astype(jnp.float32) if self.debias else 1.0
            nus = [
                self.beta2 * v + (1 - self.beta2) * jnp.square(o)
                for o, v in zip(orthogonal, treedef.flatten_up_to(state.nu), strict=True)
            ]
            out = []
            for o, v, g, ax in zip(orthogonal, nus, grads, axes, strict=True):
                p = rms_align(o / (jnp.sqrt(v / debias) + self.eps), ax, self.eps)
                out.append((p * shape_factor(p.shape, ax, self.shape_scale)).astype(g.dtype))
            mu = treedef.unflatten([m.astype(self.mu_dtype) for _, m in pairs])
            return treedef.unflatten(out), AdaMuonState(count=count, mu=mu, nu=treedef.unflatten(nus))

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaMuon(AdaMuonDirection, common.MatrixOptimizer):
    """AdaMuon on hidden matrices, AdamW elsewhere; hyperparameters as `optim.muon.muon` plus ``beta2``,
    ``eps``, ``sign_stabilize``, ``debias``."""

    # Muon's defaults, not swept for AdaMuon (its RMS alignment makes its updates Muon-sized).
    learning_rate: optax.ScalarOrSchedule = 1.2e-2
    weight_decay: float = 0.1


scale_by_adamuon = spec.function(AdaMuonDirection, "direction", name="scale_by_adamuon", positional=("beta", "beta2"))
adamuon = spec.function(AdaMuon, name="adamuon")
