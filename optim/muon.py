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
(optax decays every Adam leaf by ``adam_weight_decay``, this module only leaves of two or more axes).
tests/optim/test_muon.py checks it; its default ``adam_b2`` (0.999) and Nesterov form differ.

Newton-Schulz presets, batching and sharding: optim/newton_schulz.py. Under
`optax.inject_hyperparams` every numeric argument (``ns_steps`` included) may be injected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import labels
from optim import newton_schulz as ns

MOMENTUM_FORMS = ("ema", "sum")
SHAPE_SCALES = ("jordan", "moonlight")
DTYPES = ("float32", "bfloat16")


class MuonState(NamedTuple):
    """State of `scale_by_muon`."""

    mu: optax.Updates  # momentum buffer M_t, shaped like the parameters


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")


def check_matrices(params: Any, axes: ns.AxesSpec, family: str) -> None:
    """Raises a ValueError naming the fix for leaves a matrix optimizer cannot take."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    for (path, p), ax in zip(leaves_with_path, treedef.flatten_up_to(ns.matrix_axes_tree(params, axes)), strict=True):
        where = "/".join(labels.path_names(path)) or "<root>"
        if p.ndim < 2:
            raise ValueError(
                f"{family} got the {p.ndim}-D leaf {where} {p.shape}; only matrices can be orthogonalised: "
                "label it 'adam' (param_labels) or use the family's full optimizer, which does so by default"
            )
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(
                f"{family} needs floating-point parameters, got {where} of dtype {p.dtype}; label it 'adam'"
            )
        ns.split_axes(p.shape, ax)


def momentum_direction(
    g: jax.Array, mu: jax.Array, beta: jax.typing.ArrayLike, form: str, nesterov: bool
) -> tuple[jax.Array, jax.Array]:
    """``(D_t, M_t)`` for one leaf (see the module docstring); float32 math."""
    g = g.astype(jnp.float32)
    mu = mu.astype(jnp.float32)
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


def scale_by_muon(
    beta: float = 0.95,
    *,
    momentum_form: str = "ema",
    nesterov: bool = True,
    ns_coeffs: ns.Coeffs = "jordan",
    ns_steps: int = 0,
    ns_dtype: str = "float32",
    ns_eps: float = 1e-7,
    shape_scale: str = "moonlight",
    mu_dtype: str = "float32",
    ns_batching: str = "auto",
    ns_sharding: str = "as_is",
    dimension_numbers: ns.AxesSpec = None,
) -> optax.GradientTransformation:
    """Muon's direction ``s(W) NewtonSchulz(D_t)`` for a pytree of matrices (no learning rate).

    Args:
      beta: momentum coefficient.
      momentum_form: ``"ema"`` or ``"sum"``.
      nesterov: Nesterov look-ahead (Jordan's default).
      ns_coeffs: Newton-Schulz preset (``"jordan"``, ``"polar_express"``, ``"turbo"``) or table.
      ns_steps: Newton-Schulz steps; 0 means the preset's own count (5, 5, 4).
      ns_dtype: ``"float32"`` or ``"bfloat16"`` for the iteration.
      ns_eps: added to the Frobenius norm before the iteration.
      shape_scale: ``"jordan"`` or ``"moonlight"``.
      mu_dtype: storage dtype of the momentum.
      ns_batching: ``"same_shape"`` (one Newton-Schulz call per group of equal-shape matrices),
        ``"none"`` (one per leaf) or ``"auto"`` (``"none"`` on CPU, else ``"same_shape"``).
      ns_sharding: ``"as_is"``, ``"replicated"`` or ``"owner"``; see `newton_schulz.orthogonalize`.
      dimension_numbers: a `MatrixAxes` for every leaf, a callable mapping the updates to a tree of
        them, or None for ``(*batch, fan_in, fan_out)``.
    """
    check_choice("momentum_form", momentum_form, MOMENTUM_FORMS)
    check_choice("shape_scale", shape_scale, SHAPE_SCALES)
    check_choice("ns_dtype", ns_dtype, DTYPES)
    check_choice("mu_dtype", mu_dtype, DTYPES)
    check_choice("ns_sharding", ns_sharding, ns.SHARDING_MODES)
    check_choice("ns_batching", ns_batching, ns.BATCHING_MODES)
    ns.resolve(ns_coeffs)

    def init_fn(params):
        check_matrices(params, dimension_numbers, "muon")
        return MuonState(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params))

    def update_fn(updates, state, params=None):
        del params
        grads, treedef = jax.tree.flatten(updates)
        pairs = [
            momentum_direction(g, m, beta, momentum_form, nesterov)
            for g, m in zip(grads, treedef.flatten_up_to(state.mu), strict=True)
        ]
        ortho = orthogonalize_and_scale(
            treedef.unflatten([d for d, _ in pairs]),
            dimension_numbers,
            coeffs=ns_coeffs,
            steps=ns_steps,
            eps=ns_eps,
            dtype=ns_dtype,
            batching=ns_batching,
            sharding=ns_sharding,
            kind=shape_scale,
        )
        new_updates = jax.tree.map(lambda o, g: o.astype(g.dtype), ortho, updates)
        mu = treedef.unflatten([m.astype(mu_dtype) for _, m in pairs])
        return new_updates, MuonState(mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def orthogonalize_and_scale(tree: Any, axes: ns.AxesSpec, *, kind: str, **ns_kwargs: Any) -> Any:
    """``s(W) NewtonSchulz(X)`` for every leaf ``X`` of ``tree``."""
    ortho = ns.orthogonalize(tree, axes, **ns_kwargs)
    axes_tree = ns.matrix_axes_tree(tree, axes)
    return jax.tree.map(lambda o, ax: o * shape_factor(o.shape, ax, kind), ortho, axes_tree)


def with_adam(
    matrix_direction: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float,
    adam_lr_ratio: float,
    adam_learning_rate: optax.ScalarOrSchedule | None,
    adam_b1: float,
    adam_b2: float,
    adam_eps: float,
    param_labels: Callable[[Any], Any] | Any | None,
) -> optax.GradientTransformationExtraArgs:
    """The full optimizer of a matrix family: its direction on "matrix" leaves, AdamW elsewhere.

    "matrix": ``chain(direction, add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``.
    "adam": ``adamw(adam_lr, adam_b1, adam_b2, adam_eps, weight_decay)``, decaying leaves of two or
    more axes (embeddings yes, norms and biases no). ``adam_lr`` is ``adam_learning_rate`` if given,
    else ``adam_lr_ratio * learning_rate`` (following the same schedule). Labels come from
    ``param_labels`` (a label tree or function) or `optim.labels.matrix_labels`.
    """
    if adam_learning_rate is None:
        if callable(learning_rate):

            def adam_learning_rate(count):
                return adam_lr_ratio * learning_rate(count)

        else:
            adam_learning_rate = adam_lr_ratio * learning_rate
    matrix = optax.chain(
        matrix_direction,
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam = optax.adamw(
        adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps, weight_decay=weight_decay, mask=labels.decay_mask
    )
    return optax.partition(
        {labels.MATRIX: matrix, labels.ADAM: adam},
        labels.matrix_labels if param_labels is None else param_labels,
    )


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    momentum_form: str = "ema",
    nesterov: bool = True,
    ns_coeffs: ns.Coeffs = "jordan",
    ns_steps: int = 0,
    ns_dtype: str = "float32",
    ns_eps: float = 1e-7,
    shape_scale: str = "moonlight",
    weight_decay: float = 0.1,
    adam_lr_ratio: float = 1.0,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-8,
    mu_dtype: str = "float32",
    ns_batching: str = "auto",
    ns_sharding: str = "as_is",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    param_labels: Callable[[Any], Any] | Any | None = None,
    dimension_numbers: ns.AxesSpec = None,
) -> optax.GradientTransformationExtraArgs:
    """Muon on hidden matrices, AdamW on everything else (module docstring).

    Defaults: Jordan's momentum (EMA, Nesterov, beta 0.95) and Newton-Schulz (5 steps of
    (3.4445, -4.7750, 2.0315)); Moonlight's shape scale and weight decay 0.1, so the learning rate
    is AdamW-like (~1e-3 to 1e-2) and shared with the AdamW group. With ``shape_scale="jordan"``
    use Jordan's ``learning_rate=0.02`` and an ``adam_lr_ratio`` of ~0.1.

    Example:
      >>> tx = muon(optax.cosine_decay_schedule(3e-3, 1000))
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
    """
    direction = scale_by_muon(
        beta,
        momentum_form=momentum_form,
        nesterov=nesterov,
        ns_coeffs=ns_coeffs,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        ns_eps=ns_eps,
        shape_scale=shape_scale,
        mu_dtype=mu_dtype,
        ns_batching=ns_batching,
        ns_sharding=ns_sharding,
        dimension_numbers=dimension_numbers,
    )
    return with_adam(
        direction,
        learning_rate,
        weight_decay=weight_decay,
        adam_lr_ratio=adam_lr_ratio,
        adam_learning_rate=adam_learning_rate,
        adam_b1=adam_b1,
        adam_b2=adam_b2,
        adam_eps=adam_eps,
        param_labels=param_labels,
    )
