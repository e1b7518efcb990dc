"""Dion2: orthonormal updates on a selected fraction of the momentum's rows, with error feedback
(arXiv:2512.16928; microsoft/dion ``dion/dion2.py``), the successor of Dion (arXiv:2504.05295,
`optim.dion`).

For each hidden matrix ``W`` (layout ``(*batch, fan_in, fan_out)``, per matrix) with gradient ``G``,
written for PyTorch's ``X = W^T`` (``(fan_out, fan_in)``) as the reference does, slices taken along
``X``'s shorter side (its rows when ``fan_out <= fan_in``, else its columns), ``n`` of them:

    B_t = M_{t-1} + G_t                                     (no momentum decay: error feedback)
    s_i = ||B_t[i]||_1                                       per slice
    I   = the k = ceil(fraction n) slices with the largest s_i
    M_t = B_t with the slices in I scaled by ef_decay         what was applied decays, the rest waits
    U   = NewtonSchulz(B_t[I])                                (k, long side): the selected submatrix
    W_{t+1} = W_t - lr_t (sqrt(fan_out / fan_in) U scattered to the slices I (0 elsewhere) + lambda W_t)

Dion's low-rank power iteration (a rank-r approximation of all of ``B``) becomes an exact
orthogonalisation of ``k`` whole slices of it: the state is Dion's momentum buffer without ``Q``,
the error feedback is the same idea (``ef_decay`` plays Dion's ``mu``: the share of an applied
slice kept), and the update scale is Dion's. Newton-Schulz is the reference's default, its Polar
Express table (5 steps, Frobenius norm times 1.02, folded into the first row here), in float32 on
CPU and bf16 matmuls elsewhere (`optim.newton_schulz`, ``dtype="auto"``; the reference runs bf16).

Reference matched step by step (tests/optim/test_dion2.py, a float64 NumPy transcription of
``dion2_pre_orthogonalize``, ``polar_express`` and ``dion2_post_orthogonalize``; decay on the
pre-update weight as there). Defaults are the reference's (``fraction`` 0.25, ``ef_decay`` 0.95,
weight decay 0.01) but the learning rate, 0.04 from a sweep on the default job (the reference's 0.01). Single device and GSPMD: the selection is over the whole
matrix (the reference's ``selection_scope="global"``; its default ``"local"`` picks per FSDP shard).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, spec
from optim import newton_schulz as ns
from optim.muon import check_matrices

_REFERENCE_NORM = 1.02  # polar_express divides by 1.02 ||X||_F
_POLAR_EXPRESS = (  # microsoft/dion polar_express.py's table
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NS_TABLE = (
    tuple(c / _REFERENCE_NORM**p for c, p in zip(_POLAR_EXPRESS[0], (1, 3, 5), strict=True)),
    *_POLAR_EXPRESS[1:],
)


class Dion2State(NamedTuple):
    """State of `scale_by_dion2`."""

    mu: optax.Updates  # momentum buffer M_t, float32, like the parameters


def selected_rows(x: jax.Array, fraction: float) -> jax.Array:
    """One-hot ``(*batch, n, k)``: the ``k = ceil(fraction n)`` rows of ``x`` with the largest L1 norms."""
    n = x.shape[-2]
    k = max(1, math.ceil(fraction * n))
    _, index = jax.lax.top_k(jnp.sum(jnp.abs(x), axis=-1), k)
    return (jnp.arange(n)[:, None] == index[..., None, :]).astype(x.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dion2Direction:
    """Dion2's direction per matrix (module docstring), no learning rate.

    Attributes:
      fraction: share of the shorter side's slices orthogonalised per step.
      ef_decay: the factor the applied slices of the momentum buffer keep.
    """

    fraction: float = spec.param(0.25, valid="(0, 1]")
    ef_decay: float = spec.param(0.95, valid="[0, 1]")

    static_args: ClassVar[tuple[str, ...]] = ("fraction",)
    family: ClassVar[str] = "dion2"

    def direction(self) -> optax.GradientTransformation:
        def init_fn(params):
            check_matrices(params, None, self.family)
            try:
                float(self.fraction)
            except jax.errors.ConcretizationTypeError:
                raise ValueError(
                    "fraction sets how many slices are selected; with optax.inject_hyperparams pass "
                    f"static_args={Dion2Direction.static_args}"
                ) from None
            return Dion2State(mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

        def update_fn(updates, state, params=None, **extra):
            del params, extra
            ef_decay = jnp.asarray(self.ef_decay, jnp.float32)

            def leaf(g, m):
                fan_in, fan_out = g.shape[-2:]
                b = m + g.astype(jnp.float32)
                rows_are_fan_out = fan_out <= fan_in  # X = W^T: X's rows are W's columns
                y = jnp.swapaxes(b, -1, -2) if rows_are_fan_out else b  # slices on axis -2
                onehot = selected_rows(y, float(self.fraction))
                chosen = jnp.sum(onehot, axis=-1, keepdims=True)  # 1 on selected slices
                u = ns.newton_schulz(jnp.swapaxes(onehot, -1, -2) @ y, NS_TABLE, dtype="auto")
                d = (fan_out / fan_in) ** 0.5 * (onehot @ u)
                m = y * (1 - (1 - ef_decay) * chosen)
                if rows_are_fan_out:
                    d, m = jnp.swapaxes(d, -1, -2), jnp.swapaxes(m, -1, -2)
                return d.astype(g.dtype), m

            out = jax.tree.map(leaf, updates, state.mu)
            treedef = jax.tree.structure(updates)
            d, mu = (treedef.unflatten(x) for x in zip(*treedef.flatten_up_to(out), strict=True))
            return d, Dion2State(mu=mu)

        return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dion2(Dion2Direction, common.MatrixOptimizer):
    """Dion2 on hidden matrices, AdamW elsewhere (module docstring); AdamW group: `optim.common.AdamGroup`."""

    learning_rate: optax.ScalarOrSchedule = 0.04  # best of 5e-3 to 8e-2: docs/benchmarks.md section 1b
    weight_decay: float = 0.01
    adam_lr_ratio: float = spec.param(0.3, valid="[0, inf)")  # swept with the rate: AdamW group at 1.2e-2


scale_by_dion2 = spec.function(Dion2Direction, "direction", name="scale_by_dion2", positional=("fraction",))
dion2 = spec.function(Dion2, name="dion2")
