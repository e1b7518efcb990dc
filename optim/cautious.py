"""Cautious updates: keep only the update entries that agree in sign with the current gradient
(Liang et al., "Cautious Optimizers: Improving Training with One Line of Code", arXiv:2411.16085).

For each leaf with update ``u`` (from any momentum method: AdamW, Lion, Muon, ...) and gradient ``g``:

    phi = 1[u * g > 0]                      (direction convention: ``p <- p - lr u``)
    u'  = u * phi * n / (sum(phi) + eps)    n = number of entries of the leaf

The rescaling keeps the mean update size; ``eps = 1`` as in the reference code
(kyleliang919/C-Optim, ``mask.numel() / (mask.sum() + 1)``), so an all-disagreeing leaf gives a
zero update. The mask and the count are per leaf (per tensor, as in the reference).

`cautious` wraps a whole transform. Two sign conventions:

- ``descent=True`` (default): ``inner`` returns updates that are *added* to the parameters, the
  optax convention of a full optimizer such as ``optax.adamw(lr)``, whose update is ``-lr (d + lambda w)``.
  An entry is kept where it has the sign of ``-g``.
- ``descent=False``: ``inner`` returns a gradient-like direction (``optax.scale_by_adam()``), kept
  where it has the sign of ``g``. ``chain(cautious(scale_by_adam(), descent=False),
  add_decayed_weights(lambda), scale_by_learning_rate(lr))`` is the paper's C-AdamW exactly.

Wrapping a full optimizer (what ``optimizer.cautious=True`` does for every registered optimizer)
masks and rescales its weight-decay term together with its direction; the paper applies the decay
to every entry. With decoupled decay ``lambda |w| << |d|`` the masks agree except on entries where the
direction is about zero, and the decay is kept with probability ``sum(phi) / n`` and scaled by about
``n / sum(phi)``, so its expected size is unchanged.

"The current gradient" is what the wrapper receives. In `optim.build.build` the global-norm
clip runs before it, which multiplies every entry by one positive factor, so the mask is the one of
the raw (mean over micro-batches) gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optim import spec


def cautious(
    inner: optax.GradientTransformation,
    *,
    eps: float = 1.0,
    descent: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that its update entries whose sign disagrees with the gradient are zeroed.

    Args:
      inner: any transform; its state is this wrapper's state, unchanged.
      eps: added to the number of kept entries before rescaling by ``n / (kept + eps)``.
      descent: True when ``inner`` returns updates to add to the parameters (a full optimizer),
        False when it returns a gradient-like direction (a ``scale_by_*`` transform).
    """
    spec.check_value("eps", eps, "(0, inf)")
    inner = optax.with_extra_args_support(inner)
    sign = -1.0 if descent else 1.0

    def mask(u: jax.Array, g: jax.Array) -> jax.Array:
        keep = (sign * u * g > 0).astype(jnp.float32)
        scale = keep.size / (jnp.sum(keep) + eps)
        return (u * keep * scale).astype(u.dtype)

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, state = inner.update(updates, state, params, **extra_args)
        return jax.tree.map(mask, new_updates, updates), state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
