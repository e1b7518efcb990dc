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

Selection scope (``selection_scope=``). ``"global"`` picks the top ``k`` over all ``n`` slices of a
matrix, as the reference does on one device or under DDP. ``"local"`` is the reference's FSDP path,
which it takes whenever a matrix is sharded (it has no flag for it; ``dion2_update_megabatch_async``:
the top-k of each device's local shard, ``to_local(M)``): the ``n``
slices are split into ``S`` contiguous blocks, one per device of the ambient mesh axes whose device
count divides ``n`` (`optim.newton_schulz.dividing_axes`), and each block keeps its own
``ceil(fraction n / S)`` slices; the ``S`` selections are stacked into one submatrix for Newton-Schulz.
The blocks are pinned to those axes, so no device needs another's slice norms. Without a mesh (or
with ``S = 1``) local is global. The reference selects along the FSDP-sharded side; here the side is
always the shorter one (under GSPMD the optimizer does not see the layout), so a matrix FSDP shards on
its longer side is resharded for the selection.

Default ``"global"``: the reference's FSDP result depends on the world size (``S``), and this repo's
contract is that a run's numbers do not (8 devices equal 1, checkpoints resume on any mesh), so
local is opt-in, for FSDP runs where the bytes matter (docs/benchmarks.md, section 6a). Local's
stacked submatrices, whose rows lie on different devices, are placed for Newton-Schulz as Muon's
default places its matrices (`optim.newton_schulz.place_stack`, ``"auto"``); global's are left
where GSPMD puts them (the selection's partial sums are all-reduced, so they arrive replicated).

Reference matched step by step (tests/optim/test_dion2.py, a float64 NumPy transcription of
``dion2_pre_orthogonalize``, ``polar_express`` and ``dion2_post_orthogonalize``; decay on the
pre-update weight as there; local on 8 devices against the same transcription per block). Defaults
are the reference's (``fraction`` 0.25, ``ef_decay`` 0.95, weight decay 0.01) but the learning rate:
0.04 from a sweep on the default job (docs/benchmarks.md, section 1b; the reference's 0.01).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import blocking, common, spec
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


SELECTION_SCOPES = ("global", "local")


class Dion2State(NamedTuple):
    """State of `scale_by_dion2`."""

    mu: optax.Updates  # momentum buffer M_t, float32, like the parameters


def selected_rows(x: jax.Array, fraction: float, *, by_sort: bool = False) -> jax.Array:
    """One-hot ``(*batch, n, k)``: the ``k = ceil(fraction n)`` rows of ``x`` with the largest L1 norms.

    ``by_sort``: a stable sort instead of `jax.lax.top_k` (the same rows; ties go to the lower
    index in both). GSPMD partitions a sort along sharded batch axes, so a blockwise selection stays
    on each device, but gathers top_k's operand.
    """
    n = x.shape[-2]
    k = max(1, math.ceil(fraction * n))
    norms = jnp.sum(jnp.abs(x), axis=-1)
    index = jnp.argsort(-norms, axis=-1, stable=True)[..., :k] if by_sort else jax.lax.top_k(norms, k)[1]
    return (jnp.arange(n)[:, None] == index[..., None, :]).astype(x.dtype)


def selection_blocks(n: int, scope: str) -> tuple[tuple[str, ...], int]:
    """``(mesh axes, S)``: the blocks that ``n`` slices are selected in (``S = 1``: one, global)."""
    axes, _ = blocking.mesh_axes()
    if scope == "global" or not axes:
        return (), 1
    shape = jax.sharding.get_abstract_mesh().shape
    axes = ns.dividing_axes(n, {a: shape[a] for a in axes})
    return axes, math.prod(shape[a] for a in axes)


def orthogonalize_selected(y: jax.Array, fraction: float, scope: str) -> tuple[jax.Array, jax.Array]:
    """``(U scattered to the selected slices, 0/1 mask of them (*batch, n, 1))`` for slices on axis -2."""
    *batch, n, long = y.shape
    axes, blocks = selection_blocks(n, scope)
    y = y.reshape(*batch, blocks, n // blocks, long)
    if axes:
        y = jax.lax.with_sharding_constraint(y, jax.P(*[None] * len(batch), axes, None, None))
    onehot = selected_rows(y, fraction, by_sort=blocks > 1)  # (*batch, S, n / S, k)
    k = onehot.shape[-1]
    sub = (jnp.swapaxes(onehot, -1, -2) @ y).reshape(-1, blocks * k, long)
    layout = "auto" if blocks > 1 else "as_is"  # blocked rows: whole submatrices to their owners first
    u = ns.place_stack(ns.newton_schulz(ns.place_stack(sub, layout), NS_TABLE, dtype="auto"), layout)
    d = onehot @ u.reshape(*batch, blocks, k, long)
    return d.reshape(*batch, n, long), jnp.sum(onehot, axis=-1, keepdims=True).reshape(*batch, n, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dion2Direction:
    """Dion2's direction per matrix (module docstring), no learning rate.

    Attributes:
      fraction: share of the shorter side's slices orthogonalised per step.
      ef_decay: the factor the applied slices of the momentum buffer keep.
      selection_scope: ``"global"`` (top-k over the whole matrix) or ``"local"`` (per block of the
        devices that shard it, the reference's FSDP path); module docstring.
    """

    fraction: float = spec.param(0.25, valid="(0, 1]")
    ef_decay: float = spec.param(0.95, valid="[0, 1]")
    selection_scope: str = "global"

    static_args: ClassVar[tuple[str, ...]] = ("fraction",)

    def __post_init__(self) -> None:
        common.check_choice("selection_scope", self.selection_scope, SELECTION_SCOPES)
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
                u, chosen = orthogonalize_selected(y, float(self.fraction), self.selection_scope)
                d = (fan_out / fan_in) ** 0.5 * u
                m = y * (1 - (1 - ef_decay) * chosen)
                if rows_are_fan_out:
                    d, m = jnp.swapaxes(d, -1, -2), jnp.swapaxes(m, -1, -2)
                return d.astype(g.dtype), m

            out = jax.tree.map(leaf, updates, state.mu)
            d, mu = common.unzip(updates, out, 2)
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
