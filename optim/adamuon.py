"""AdaMuon: Muon with an element-wise second moment on the orthogonalised momentum (Si, Zhang and
Shen, "AdaMuon: Adaptive Muon Optimizer", arXiv:2507.11005).

For each hidden matrix ``W`` (layout ``(*batch, fan_in, fan_out)``, per matrix of the batch) with
gradient ``G``, ``m x n`` the matrix and ``t`` the step (from 1):

    D_t, M_t = momentum direction of G_t          as Muon (EMA + Nesterov, beta 0.95, by default)
    O_t = NewtonSchulz(sign(D_t))                 sign_stabilize=True (the paper's Algorithm 1)
    O_t = NewtonSchulz(D_t)                       sign_stabilize=False (the authors' code)
    V_t = beta2 V_{t-1} + (1 - beta2) O_t * O_t   element-wise, shaped like W
    P_t = O_t / (sqrt(V_t / (1 - beta2^t)) + eps)
    P_t <- sqrt(min(m, n)) P_t / (||P_t||_F + eps)                        per matrix
    W_{t+1} = W_t - lr_t (s(W) P_t + lambda W_t)

With the default shape scale ``s(W) = 0.2 sqrt(max(m, n))`` (``"moonlight"``) the update is
``0.2 sqrt(m n) P_t / ||P_t||_F``: RMS 0.2, the paper's "RMS-aligned rescaling", so AdamW's
learning rate and schedule serve (the AdamW group shares them, as in `optim.muon`).

Reference matched step by step (tests/optim/test_adamuon.py, a float64 NumPy transcription): the
authors' code, github.com/Chongjie-Si/AdaMuon ``adamuon.py`` (Nesterov EMA momentum, bias-corrected
``V``, ``eps = 1e-8``, ``beta2 = 0.999``, ``sqrt(min) / (||P|| + eps)`` then ``0.2 sqrt(max)``). That
code orthogonalises ``D_t`` itself, while the paper (Algorithm 1 and the abstract's
"sign-stabilized orthogonal update") orthogonalises ``sign(D_t)``; the default follows the paper
and ``sign_stabilize=False`` reproduces the code. pytorch-optimizer's ``AdaMuon`` is the
``sign_stabilize=False, nesterov=False`` form. The paper writes no bias correction of ``V``; with
``eps`` -> 0 the per-matrix rescaling removes it.

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
      eps: added to ``sqrt(V_t / (1 - beta2^t))`` and to ``||P_t||_F``.
      sign_stabilize: orthogonalise ``sign(D_t)`` (the paper) rather than ``D_t`` (the authors' code).
    """

    beta2: float = spec.param(0.999, valid="[0, 1)")
    eps: float = spec.param(1e-8, valid="(0, inf)")
    sign_stabilize: bool = True

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
            debias = 1 - self.beta2 ** count.astype(jnp.float32)
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
    ``eps``, ``sign_stabilize``."""

    # Muon's defaults, not swept for AdaMuon (its RMS alignment makes its updates Muon-sized).
    learning_rate: optax.ScalarOrSchedule = 1.2e-2
    weight_decay: float = 0.1


scale_by_adamuon = spec.function(AdaMuonDirection, "direction", name="scale_by_adamuon", positional=("beta", "beta2"))
adamuon = spec.function(AdaMuon, name="adamuon")
