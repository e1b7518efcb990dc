"""Muon: momentum orthogonalised by Newton-Schulz (Jordan et al. 2024; Liu et al., arXiv:2502.16982).

For each hidden weight matrix ``W`` (layout ``(*batch, fan_in, fan_out)``, the transpose of PyTorch's
``(out, in)``) with gradient ``G``:

    M_t = beta M_{t-1} + (1 - beta) G_t                        momentum_form="ema" (Jordan)
    M_t = beta M_{t-1} + G_t                                   momentum_form="sum" (Moonlight, torch SGD)
    D_t = beta M_t + (1 - beta) G_t   (ema)  |  G_t + beta M_t (sum)    with nesterov=True
    D_t = M_t                                                  with nesterov=False
    O_t = NewtonSchulz(D_t)                                    ~ U V^T for D_t = U S V^T
    W_{t+1} = W_t - lr_t (s(W) O_t + lambda W_t)

Shape scale ``s(W)`` (``shape_scale=``), with fan_in / fan_out the input / output sizes:

- ``"jordan"``: ``sqrt(max(1, fan_out / fan_in))`` (Jordan's ``max(1, rows/cols)`` on PyTorch's
  ``(out, in)`` weights, https://kellerjordan.github.io/posts/muon/); the update's RMS-to-RMS
  operator norm is then ``lr`` for matrices with ``fan_out >= fan_in``.
- ``"moonlight"`` (default): ``0.2 sqrt(max(fan_in, fan_out))`` (Liu et al.); the update's RMS is
  ~0.2 like AdamW's, so one learning rate and one schedule serve the Muon and the AdamW groups.

The two momentum forms differ by the constant factor ``1 - beta``, which the Frobenius normalisation
inside Newton-Schulz removes, so they give the same update up to ``ns_eps``; both are kept so that a
reference's state can be reproduced literally. The weight decay ``lambda`` multiplies the unscaled
learning rate (decoupled, as in Moonlight).

`muon` routes parameters with `optim.labels.matrix_labels`: hidden matrices to Muon; embeddings
(including a tied embedding, which is also the LM head), the LM head, norms, biases and scalars to
AdamW with learning rate ``adam_lr_ratio * learning_rate`` (or ``adam_learning_rate``).

Matching ``optax.contrib.muon``: optax bias-corrects its EMA, which is a scalar factor Newton-Schulz
removes for ``nesterov=False`` but changes the mix of ``M_t`` and ``G_t`` for ``nesterov=True``. So on
the matrices ``muon(momentum_form="ema", nesterov=False, shape_scale="jordan")`` equals
``optax.contrib.muon(nesterov=False)`` (``"moonlight"``: ``consistent_rms=0.2``) with the same
``eps``; the AdamW groups agree with ``adam_b2=0.95`` on the optax side and no decay of 1-D leaves
(optax decays every Adam leaf by ``adam_weight_decay``, this module only weights, `optim.labels.decay_mask`).
tests/optim/test_muon.py checks it; its default ``adam_b2`` (0.999) and Nesterov form differ.

Newton-Schulz presets, batching and sharding: optim/newton_schulz.py. Under
`optax.inject_hyperparams` every numeric argument (``ns_steps`` included) may be injected.

The family is built by composition. `scale_by_muon_core` is the pipeline above with two optional
per-matrix steps that a variant plugs in, each with its own state field next to the momentum ``mu``:
a correction of the gradient before the momentum (MARS-M, optim/mars_muon.py) and a normalisation of
``O_t`` before the shape scale (NorMuon, optim/normuon.py). MuonClip chains a QK-clip step after the
full optimizer (optim/muon_clip.py). AuON (optim/auon.py) replaces Newton-Schulz itself: the core
calls its spec's ``orthogonalize``. Hyperparameters are declared once, in the spec dataclasses
`NewtonSchulz` and `MatrixMomentum` (momentum and shape scale; `MuonDirection` is both) here, shared
by every variant, and the AdamW group (`optim.common.AdamGroup`); `muon` and `scale_by_muon` are
generated from them (`optim.spec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, labels, shapes, spec
from optim import newton_schulz as ns

MOMENTUM_FORMS = ("ema", "sum")
SHAPE_SCALES = ("jordan", "moonlight")
DTYPES = ("float32", "bfloat16")


class MuonState(NamedTuple):
    """State of `scale_by_muon`."""

    mu: optax.Updates  # momentum buffer M_t, shaped like the parameters


def check_matrices(params: Any, axes: ns.AxesSpec, family: str) -> None:
    """Raises a ValueError naming the fix for leaves a matrix optimizer cannot take."""
    common.check_floating(params, family, "label it 'adam'")
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    for (path, p), ax in zip(leaves_with_path, treedef.flatten_up_to(ns.matrix_axes_tree(params, axes)), strict=True):
        if p.ndim < 2:
            where = "/".join(labels.path_names(path)) or "<root>"
            raise ValueError(
                f"{family} got the {p.ndim}-D leaf {where} {p.shape}; only matrices can be orthogonalised: "
                "label it 'adam' (param_labels) or use the family's full optimizer, which does so by default"
            )
        ns.split_axes(p.shape, ax)


def momentum_direction(
    g: jax.Array, mu: jax.Array, beta: jax.typing.ArrayLike, form: str, nesterov: bool
) -> tuple[jax.Array, jax.Array]:
    """``(D_t, M_t)`` for one leaf (see the module docstring); float32 math."""
    g = g.astype(jnp.float32)
    mu = mu.astype(jnp.float32)
    beta = jnp.asarray(beta, jnp.float32)  # ``1 - beta`` rounds alike when optax.inject_hyperparams made it an array
    if form == "ema":
        mu = beta * mu + (1 - beta) * g
        direction = beta * mu + (1 - beta) * g if nesterov else mu
    else:
        mu = beta * mu + g
        direction = g + beta * mu if nesterov else mu
    return direction, mu


def shape_factor(shape: tuple[int, ...], axes: ns.MatrixAxes, kind: str) -> float:
    """The factor ``s(W)`` of the module docstring for a leaf of ``shape``."""
    fan_in, fan_out = ns.fans(shape, axes)
    if kind == "jordan":
        return max(1.0, fan_out / fan_in) ** 0.5
    return 0.2 * max(fan_in, fan_out) ** 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class NewtonSchulz:
    """The Newton-Schulz iteration of the Muon family (`optim.newton_schulz.orthogonalize`).

    Attributes:
      ns_coeffs: preset (``"jordan"``, ``"polar_express"``, ``"turbo"``) or a table of (a, b, c) rows.
      ns_steps: Newton-Schulz steps; 0 means the preset's own count (5, 5, 4).
      ns_dtype: ``"float32"``, ``"bfloat16"`` (fp32 coefficients and accumulation) or ``"auto"``:
        float32 on CPU, where bf16 matmuls are not faster, bfloat16 on GPU and TPU.
      ns_eps: added to the Frobenius norm before the iteration.
      ns_batching: ``"same_shape"`` (one call per group of equal-shape matrices), ``"none"`` (one per
        leaf) or ``"auto"`` (``"none"`` on CPU, else ``"same_shape"``).
      ns_sharding: ``"auto"`` (whole matrices to the devices of the mesh axes that divide the
        stack, replicated over the others), ``"as_is"``, ``"replicated"`` or ``"owner"``; see
        `newton_schulz.orthogonalize`.
    """

    ns_coeffs: ns.Coeffs = "jordan"
    ns_steps: int = spec.param(0, valid="[0, inf)")
    ns_dtype: str = "auto"
    ns_eps: float = spec.param(1e-7, valid="(0, inf)")
    ns_batching: str = "auto"
    ns_sharding: str = "auto"

    def __post_init__(self) -> None:
        common.check_choice("ns_dtype", self.ns_dtype, ns.DTYPES)
        common.check_choice("ns_sharding", self.ns_sharding, ns.SHARDING_MODES)
        common.check_choice("ns_batching", self.ns_batching, ns.BATCHING_MODES)
        ns.resolve(self.ns_coeffs)

    def orthogonalize(self, tree: Any, axes: ns.AxesSpec) -> Any:
        return ns.orthogonalize(
            tree,
            axes,
            coeffs=self.ns_coeffs,
            steps=self.ns_steps,
            eps=self.ns_eps,
            dtype=self.ns_dtype,
            batching=self.ns_batching,
            sharding=self.ns_sharding,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatrixMomentum:
    """The momentum and shape scale of the Muon family; a subclass supplies the per-matrix map
    ``orthogonalize(tree, axes)`` (`NewtonSchulz`'s, or AuON's bound, optim/auon.py).

    Attributes:
      beta: momentum coefficient.
      momentum_form: ``"ema"`` or ``"sum"``.
      nesterov: Nesterov look-ahead (Jordan's default).
      shape_scale: ``"jordan"`` or ``"moonlight"``.
      mu_dtype: storage dtype of the momentum.
      dimension_numbers: a `MatrixAxes` for every leaf, a callable mapping the updates to a tree of
        them, or None for ``(*batch, fan_in, fan_out)``.
    """

    beta: float = spec.param(0.95, valid="[0, 1)")
    momentum_form: str = "ema"
    nesterov: bool = True
    shape_scale: str = "moonlight"
    mu_dtype: str = "float32"
    dimension_numbers: ns.AxesSpec = spec.code_only()

    family: ClassVar[str] = "muon"  # the optimizer's name in error messages

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        common.check_choice("momentum_form", self.momentum_form, MOMENTUM_FORMS)
        common.check_choice("shape_scale", self.shape_scale, SHAPE_SCALES)
        common.check_choice("mu_dtype", self.mu_dtype, DTYPES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonDirection(MatrixMomentum, NewtonSchulz):
    """Muon's direction ``s(W) NewtonSchulz(D_t)`` for a pytree of matrices (no learning rate).

    (beta, momentum_form, nesterov, shape_scale, mu_dtype, dimension_numbers: `MatrixMomentum`;
    ns_*: `NewtonSchulz`.)
    """

    def direction(self) -> optax.GradientTransformation:
        return scale_by_muon_core(self, MuonState)


class MatrixStep(NamedTuple):
    """A per-matrix step that a Muon variant plugs into `scale_by_muon_core`, with its state field."""

    field: str  # name of its state field: one leaf per parameter
    init: Callable[[jax.Array, ns.MatrixAxes], jax.Array]  # (parameter, axes) -> initial state leaf
    # (x, state leaf, axes) -> (new x, new state leaf)
    apply: Callable[[jax.Array, jax.Array, ns.MatrixAxes], tuple[jax.Array, jax.Array]]


def scale_by_muon_core(
    h: MatrixMomentum,
    state_type: Callable[..., Any],
    *,
    correction: MatrixStep | None = None,
    normalization: MatrixStep | None = None,
) -> optax.GradientTransformation:
    """Muon's pipeline with a variant's steps plugged in (identity where None), per matrix::

        c_t = correction(G_t)                    state field correction.field (MARS-M)
        D_t, M_t = momentum direction of c_t     state field mu
        O_t = h.orthogonalize(D_t)               Newton-Schulz, batched over the tree (AuON: a bound)
        P_t = normalization(O_t)                 state field normalization.field (NorMuon)
        update = s(W) P_t                        in the gradient's dtype

    ``state_type`` is the variant's state NamedTuple: ``mu`` and the steps' fields.
    """
    steps = [s for s in (correction, normalization) if s is not None]

    def init_fn(params):
        check_matrices(params, h.dimension_numbers, h.family)
        axes = ns.matrix_axes_tree(params, h.dimension_numbers)
        fields = {s.field: jax.tree.map(s.init, params, axes) for s in steps}
        return state_type(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, h.mu_dtype), params), **fields)

    def run(step, xs, state, axes, treedef):
        leaves = treedef.flatten_up_to(getattr(state, step.field))
        pairs = [step.apply(x, leaf, ax) for x, leaf, ax in zip(xs, leaves, axes, strict=True)]
        return [x for x, _ in pairs], treedef.unflatten([leaf for _, leaf in pairs])

    def update_fn(updates, state, params=None):
        del params
        shapes.check_like(updates, state.mu, "muon")
        grads, treedef = jax.tree.flatten(updates)
        axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, h.dimension_numbers))
        new_fields = {}
        xs = grads
        if correction is not None:
            xs, new_fields[correction.field] = run(correction, xs, state, axes, treedef)
        pairs = [
            momentum_direction(x, m, h.beta, h.momentum_form, h.nesterov)
            for x, m in zip(xs, treedef.flatten_up_to(state.mu), strict=True)
        ]
        xs = treedef.flatten_up_to(h.orthogonalize(treedef.unflatten([d for d, _ in pairs]), h.dimension_numbers))
        if normalization is not None:
            xs, new_fields[normalization.field] = run(normalization, xs, state, axes, treedef)
        scaled = [x * shape_factor(x.shape, ax, h.shape_scale) for x, ax in zip(xs, axes, strict=True)]
        out = [x.astype(g.dtype) for x, g in zip(scaled, grads, strict=True)]
        mu = treedef.unflatten([m.astype(h.mu_dtype) for _, m in pairs])
        return treedef.unflatten(out), state_type(mu=mu, **new_fields)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Muon(MuonDirection, common.MatrixOptimizer):
    """Muon on hidden matrices, AdamW on everything else (`optim.muon` module docstring).

    Defaults: Jordan's momentum (EMA, Nesterov, beta 0.95) and Newton-Schulz (5 steps of
    (3.4445, -4.7750, 2.0315)); Moonlight's shape scale and weight decay 0.1, so the learning rate
    is AdamW-like (~1e-3 to 1e-2) and shared with the AdamW group. With ``shape_scale="jordan"``
    use Jordan's ``learning_rate=0.02`` and an ``adam_lr_ratio`` of ~0.1. Hyperparameters:
    `MuonDirection`, `NewtonSchulz`, `optim.common.AdamGroup`.

    Example:
      >>> tx = muon(optax.cosine_decay_schedule(3e-3, 1000))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
    """

    learning_rate: optax.ScalarOrSchedule = 1.2e-2  # docs/benchmarks.md, "Default learning rates"
    weight_decay: float = 0.1


scale_by_muon = spec.function(MuonDirection, "direction", name="scale_by_muon", positional=("beta",))
muon = spec.function(Muon, name="muon")
