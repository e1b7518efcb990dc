"""Lion: the sign of an interpolated momentum (Chen et al., "Symbolic Discovery of Optimization
Algorithms", arXiv:2302.06675, Algorithm 2).

For each parameter ``w`` with gradient ``g_t``:

    c_t = b1 m_{t-1} + (1 - b1) g_t
    u_t = sign(c_t)
    m_t = b2 m_{t-1} + (1 - b2) g_t
    w_t = w_{t-1} - lr_t (u_t + lambda w_{t-1})

Defaults ``b1 = 0.9``, ``b2 = 0.99`` (the paper's). Every update entry is +-1, so Lion wants a
learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (the paper's advice; the
default ``weight_decay = 1.0`` is 10x the repository's AdamW default, so ``lr * lambda`` stays similar
at a 10x smaller ``lr``). One state buffer: 4 bytes per parameter in fp32, 1 with
`optim.quantize_state`. Matches ``optax.lion`` (tests/optim/test_lion.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import labels


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`."""

    mu: optax.Updates  # momentum m_t, shaped like the parameters


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """The Lion direction ``sign(b1 m + (1 - b1) g)``; momentum ``m <- b2 m + (1 - b2) g``.

    Args:
      b1: interpolation between momentum and gradient for the update.
      b2: decay of the momentum.
    """

    def init_fn(params: optax.Params) -> ScaleByLionState:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            if not jnp.issubdtype(p.dtype, jnp.floating):
                where = "/".join(labels.path_names(path)) or "<root>"
                raise ValueError(f"lion needs floating-point parameters, got {where} of dtype {p.dtype}; mask it out")
        return ScaleByLionState(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update_fn(updates: optax.Updates, state: ScaleByLionState, params: optax.Params | None = None):
        del params
        direction = jax.tree.map(lambda g, m: jnp.sign(b1 * m + (1 - b1) * g).astype(g.dtype), updates, state.mu)
        mu = jax.tree.map(lambda g, m: b2 * m + (1 - b2) * g, updates, state.mu)
        return direction, ScaleByLionState(mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def lion(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1.0,
) -> optax.GradientTransformation:
    """Lion with decoupled weight decay on leaves of two or more axes (`optim.labels.decay_mask`).

    ``w <- w - lr (sign(b1 m + (1 - b1) g) + weight_decay w)``.
    """
    return optax.chain(
        scale_by_lion(b1=b1, b2=b2),
        optax.add_decayed_weights(weight_decay, mask=labels.decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
