"""Shampoo: blocked, grafted Kronecker-factored AdaGrad with distributed inverse roots.

Gupta, Koren & Singer, "Shampoo" (arXiv:1802.09568); Anil et al., "Scalable Second Order
Optimization for Deep Learning" (distributed Shampoo, arXiv:2002.09018; reference matched: the
``distributed_shampoo`` of google-research/scalable_shampoo/optax); Shi et al., "A Distributed
Data-Parallel PyTorch Implementation of Distributed Shampoo" (arXiv:2309.06497, the AlgoPerf winner).

Each parameter is reshaped and cut into blocks (`optim.blocking`: leading axes are batch axes,
small dims merged, blocks of at most ``block_size`` per dim; dims longer than ``max_precond_dim``
are not preconditioned). For a 2-D block ``G_t`` (k-D blocks: one factor per dim)::

    L_t = beta2 L_{t-1} + (1 - beta2) G_t G_t^T,  R_t = beta2 R_{t-1} + (1 - beta2) G_t^T G_t
          (beta2 = 1: the AdaGrad sums L_t = L_{t-1} + G_t G_t^T); L_0 = R_0 = matrix_eps * I
    every precondition_every steps (and at start_preconditioning_step):
      P_L = (L_t + r I)^(-1/p), P_R = (R_t + r I)^(-1/p),  r = matrix_eps * lambda_max,
      p = 2k (k = number of preconditioned dims of the tensor) or exponent_override;
      a root that is not finite or whose error exceeds failure_threshold is rejected: the previous
      P is kept and ``root_failures`` counts it
    S_t = P_L G_t P_R                                    (identity on unpreconditioned dims)
    A_t = graft direction: g / (sqrt(v_t / (1 - b^t)) + eps) "adam", g / (sqrt(v_t) + eps)
          "rmsprop" (v EMA with graft_beta2) or "adagrad" (v sum), g "sgd"
    D_t = S_t ||A_t|| / ||S_t||    per parameter (per block with graft_per_block; per batch entry
          of stacked layers); D_t = S_t for graft_type="none" (the original Shampoo)
    D_t = A_t                      before start_preconditioning_step, and for parameters with no
                                   preconditioned dim (1-D leaves, dims > max_precond_dim)
    M_t = beta1 M_{t-1} + (1 - beta1) D_t;  update = beta1 M_t + (1 - beta1) D_t (nesterov) or M_t

Differences from the reference: one momentum buffer over the grafted direction (as in
arXiv:2309.06497) instead of separate Shampoo and graft buffers; momentum is an EMA (the
reference's ``moving_average_for_momentum=True``) so learning rates are Adam-like; weight decay is
decoupled (`shampoo` chains `optax.add_decayed_weights`).

Distributed computation: statistics and preconditioners of all parameters are stacked per
(block side, exponent) group into ``(n_blocks, b, b)`` arrays whose shapes do not depend on the mesh
(so checkpoints restore onto any mesh) and which are spread over all devices (`optim.blocking`).
Under `jit` each device computes the roots of its slice of blocks (eigh or Newton batched); GSPMD
gathers the preconditioners where the gradients need them. For ``jit(tx.init,
out_shardings=...)`` use `optim.placement.state_shardings`. Roots are computed under
`lax.cond`, so steps that do not refresh them cost statistics + preconditioning only.

Under `optax.inject_hyperparams` the integer arguments that set array shapes must be static:
``static_args=STATIC_ARGS``. The stacks' group keys come from the parameters' shapes, so
`optax.tree.map_params` (which initialises on a shapeless placeholder) cannot map this state: use
`optim.blocking.map_params`, its equivalent (e.g. for the state's partition specs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import blocking, common, matrix_roots, shapes, spec

GRAFT_TYPES = ("adam", "adagrad", "rmsprop", "sgd", "none")
STATIC_ARGS = ("block_size", "max_precond_dim", "exponent_override")


class ShampooState(NamedTuple):
    """State of `scale_by_shampoo`."""

    count: jax.Array  # steps taken (int32)
    momentum: optax.Updates  # M_t, float32, shaped like the parameters
    graft_nu: optax.Updates  # graft second moment v_t, like the parameters (None for sgd / none)
    stats: blocking.BlockStacks  # L and R factors: (n_blocks, b, b) per group, spread over devices
    preconds: blocking.BlockStacks  # their inverse roots, same layout
    root_failures: jax.Array  # roots rejected so far (NaN or error > failure_threshold), int32


def _group_key(p: int, b: int) -> str:
    """Name of the stack of ``(b, b)`` factors whose roots use exponent ``-1/p``."""
    return f"p{p}_b{b}"


def _exponent_of(key: str) -> int:
    return int(key[1 : key.index("_")])


def _graft(kind: str, g: jax.Array, nu: jax.Array | None, t: jax.Array, beta2: Any, eps: Any):
    """(graft direction A_t, new v_t) for one leaf, float32."""
    if kind in ("sgd", "none"):
        return g, None
    if kind == "adagrad":
        nu = nu + g * g
        return g / (jnp.sqrt(nu) + eps), nu
    nu = (beta2 * nu + (1 - beta2) * g * g).astype(g.dtype)
    if kind == "adam":  # beta2**t: float64 under x64 for an int32 t, so the result is cast back
        return (g / (jnp.sqrt(nu / (1 - beta2**t)) + eps)).astype(g.dtype), nu
    return g / (jnp.sqrt(nu) + eps), nu


def _rescale(direction: jax.Array, target: jax.Array, reduce_axes: tuple[int, ...]) -> jax.Array:
    """``direction * ||target|| / ||direction||`` with norms over ``reduce_axes`` (0 where direction is 0)."""
    d_norm = jnp.sqrt(jnp.sum(direction * direction, axis=reduce_axes, keepdims=True))
    t_norm = jnp.sqrt(jnp.sum(target * target, axis=reduce_axes, keepdims=True))
    return direction * jnp.where(d_norm > 0, t_norm / jnp.where(d_norm > 0, d_norm, 1.0), 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShampooDirection:
    """Shampoo's grafted, momentum-averaged direction (module docstring); no learning rate.

    Attributes:
      block_size: longest block side per dim (distributed Shampoo's blocking).
      beta1: momentum coefficient (0 disables momentum).
      beta2: statistics EMA coefficient; 1.0 gives the AdaGrad sums of the original Shampoo.
      nesterov: Nesterov look-ahead on the momentum.
      matrix_eps: statistics start at ``matrix_eps * I``; ridge ``matrix_eps * lambda_max``.
      precondition_every: steps between root refreshes.
      start_preconditioning_step: first step (1-based) that uses Shampoo; before it the graft
        direction alone. -1: ``precondition_every`` (as arXiv:2309.06497).
      exponent_override: use ``X^(-1/exponent_override)`` instead of ``X^(-1/(2k))``; 0: off.
      max_precond_dim: dims longer than this (after merging) are not preconditioned.
      root_method: ``"eigh"`` or ``"newton"`` (`optim.matrix_roots`).
      failure_threshold: largest accepted root error.
      newton_iters: iteration cap of the Newton method.
      graft_type: ``"adam"``, ``"adagrad"``, ``"rmsprop"``, ``"sgd"`` or ``"none"``.
      graft_beta2: second-moment EMA of the adam / rmsprop graft.
      graft_eps: epsilon of the adam / rmsprop / adagrad graft.
      graft_per_block: graft each block's norm instead of each parameter's.
      merge_dims: merge adjacent small dims up to ``block_size`` (`blocking.merge_small_dims`).
      batch_leading_axes: axes before the last two are batch axes (scan-stacked layers): each entry
        gets its own statistics. False: every axis is a tensor dim.
      matmul_precision: statistics and preconditioning matmuls, ``"auto"`` | ``"highest"`` |
        ``"high"`` (`blocking.matmul_precision`; roots always in full fp32).
    """

    block_size: int = spec.param(1024, valid="[1, inf)")
    beta1: float = spec.param(0.9, valid="[0, 1)")
    beta2: float = spec.param(0.999, valid="(0, 1]")
    nesterov: bool = True
    matrix_eps: float = spec.param(1e-6, valid="(0, inf)")
    precondition_every: int = spec.param(100, valid="[1, inf)")
    start_preconditioning_step: int = spec.param(-1, valid="[-1, inf)")
    exponent_override: int = spec.param(0, valid="[0, inf)")
    max_precond_dim: int = spec.param(4096, valid="[1, inf)")
    root_method: str = "eigh"
    failure_threshold: float = spec.param(0.1, valid="(0, inf)")
    newton_iters: int = spec.param(100, valid="[1, inf)")
    graft_type: str = "adam"
    graft_beta2: float = spec.param(0.999, valid="(0, 1]")
    graft_eps: float = spec.param(1e-8, valid="(0, inf)")
    graft_per_block: bool = False
    merge_dims: bool = True
    batch_leading_axes: bool = spec.code_only(True)
    matmul_precision: str = "auto"

    static_args: ClassVar[tuple[str, ...]] = STATIC_ARGS

    def direction(self) -> optax.GradientTransformation:
        return _scale_by_shampoo(self)

    def outer_products(
        self,
        stack: blocking.StackLayout,
        blocks: list[list[jax.Array] | None],
        preconds: blocking.BlockStacks,
        precision: jax.lax.Precision,
    ) -> blocking.BlockStacks:
        """This step's ``G_(k) G_(k)^T`` of every block and preconditioned dim ``k``, stacked like the
        statistics (`optim.kl_shampoo` preconditions ``G`` first with the current roots ``preconds``)."""
        del preconds
        return blocking.factor_statistics(stack, blocks, precision)


def _scale_by_shampoo(h: ShampooDirection) -> optax.GradientTransformation:
    block_size = common.static_int("block_size", h.block_size, STATIC_ARGS)
    max_precond_dim = common.static_int("max_precond_dim", h.max_precond_dim, STATIC_ARGS)
    exponent_override = common.static_int("exponent_override", h.exponent_override, STATIC_ARGS)
    if block_size < 1 or max_precond_dim < 1 or exponent_override < 0:
        raise ValueError(
            f"need block_size >= 1, max_precond_dim >= 1 and exponent_override >= 0; got {block_size}, "
            f"{max_precond_dim}, {exponent_override}"
        )
    common.check_choice("graft_type", h.graft_type, GRAFT_TYPES)
    common.check_choice("root_method", h.root_method, matrix_roots.METHODS)
    precision = blocking.matmul_precision(h.matmul_precision)
    has_nu = h.graft_type in ("adam", "adagrad", "rmsprop")

    def make_layout(leaf: jax.Array) -> blocking.TensorLayout | None:
        if leaf.ndim < 2:
            return None
        layout = blocking.tensor_layout(
            leaf.shape,
            block_size=block_size,
            max_precond_dim=max_precond_dim,
            merge_dims=h.merge_dims,
            batch_leading_axes=h.batch_leading_axes,
        )
        return layout if layout.rank else None

    def exponent(layout: blocking.TensorLayout) -> int:
        return exponent_override or 2 * layout.rank

    def layouts(tree: Any) -> tuple[list[jax.Array], Any, list, blocking.StackLayout]:
        leaves, treedef, tensors = blocking.layout_tree(tree, make_layout)
        stack = blocking.stack_layout(tensors, lambda b, t: _group_key(exponent(t), b))
        return leaves, treedef, tensors, stack

    def init_fn(params):
        leaves, treedef, _, stack = layouts(params)

        def eyes(scale):
            return blocking.BlockStacks(
                {key: blocking.constrain_blocks(scale * blocking.identity_fill(n, b)) for key, b, n in stack.groups}
            )

        def zeros():  # a fresh buffer per field: a donating jit step must never see one twice
            return treedef.unflatten([jnp.zeros(p.shape, jnp.float32) for p in leaves])

        return ShampooState(
            count=jnp.zeros([], jnp.int32),
            momentum=zeros(),
            graft_nu=zeros() if has_nu else None,
            stats=common.by_shapes(params, lambda: eyes(h.matrix_eps)),
            preconds=common.by_shapes(params, lambda: eyes(1.0)),
            root_failures=jnp.zeros([], jnp.int32),
        )

    def refresh_roots(stack: blocking.StackLayout, stats, preconds):
        new, failures = blocking.BlockStacks(), jnp.zeros([], jnp.int32)
        for key in stats:
            root = functools.partial(
                matrix_roots.inverse_pth_root,
                p=_exponent_of(key),
                method=h.root_method,
                ridge_epsilon=h.matrix_eps,
                newton_iters=h.newton_iters,
            )
            roots, errors = blocking.spread_blocks(root, stats[key])
            ok = matrix_roots.accepted(roots, errors, h.failure_threshold)
            new[key] = blocking.constrain_blocks(jnp.where(ok[:, None, None], roots, preconds[key]))
            failures += jnp.sum(~ok).astype(jnp.int32)
        return new, failures

    def update_fn(updates, state, params=None):
        del params
        shapes.check_like(updates, state.momentum, "shampoo")
        grads, treedef, tensors, stack = layouts(updates)
        t = state.count + 1
        start = jnp.where(h.start_preconditioning_step < 0, h.precondition_every, h.start_preconditioning_step)
        use_shampoo = t >= start

        g32 = [g.astype(jnp.float32) for g in grads]
        nus = treedef.flatten_up_to(state.graft_nu) if has_nu else [None] * len(grads)
        grafts = [_graft(h.graft_type, g, nu, t, h.graft_beta2, h.graft_eps) for g, nu in zip(g32, nus, strict=True)]

        blocks = [None if lay is None else lay.to_blocks(g) for g, lay in zip(g32, tensors, strict=True)]
        outer = h.outer_products(stack, blocks, state.preconds, precision)
        w2 = jnp.where(h.beta2 == 1.0, 1.0, 1.0 - h.beta2)
        stats = blocking.BlockStacks(
            {k: blocking.constrain_blocks(h.beta2 * state.stats[k] + w2 * outer[k]) for k in state.stats}
        )

        refresh = use_shampoo & ((t == start) | (t % h.precondition_every == 0))
        preconds, failures = jax.lax.cond(
            refresh,
            lambda s, p: refresh_roots(stack, s, p),
            lambda s, p: (p, jnp.zeros([], jnp.int32)),
            stats,
            state.preconds,
        )
        mats = blocking.unstack(stack, preconds)

        directions = []
        for g, (graft_dir, _), lay, leaf_blocks, leaf_mats in zip(g32, grafts, tensors, blocks, mats, strict=True):
            if lay is None:
                directions.append(graft_dir)
                continue
            pre = blocking.apply_factors(leaf_blocks, leaf_mats, precision=precision)
            if h.graft_type == "none":
                shampoo_dir = lay.from_blocks(pre)
            elif h.graft_per_block:
                target = lay.to_blocks(graft_dir)
                shampoo_dir = lay.from_blocks(
                    [_rescale(s, a, tuple(range(1, s.ndim))) for s, a in zip(pre, target, strict=True)]
                )
            else:
                flat = lay.from_blocks(pre).reshape(lay.batch, -1)
                shampoo_dir = _rescale(flat, graft_dir.reshape(lay.batch, -1), (1,)).reshape(g.shape)
            directions.append(jnp.where(use_shampoo, shampoo_dir, graft_dir))

        momentum = []
        out = []
        for d, m, g in zip(directions, treedef.flatten_up_to(state.momentum), grads, strict=True):
            m = (h.beta1 * m + (1 - h.beta1) * d).astype(m.dtype)
            momentum.append(m)
            out.append((h.beta1 * m + (1 - h.beta1) * d if h.nesterov else m).astype(g.dtype))
        new_state = ShampooState(
            count=t,
            momentum=treedef.unflatten(momentum),
            graft_nu=treedef.unflatten([nu for _, nu in grafts]) if has_nu else None,
            stats=stats,
            preconds=preconds,
            root_failures=state.root_failures + failures,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def root_failures(opt_state: Any) -> jax.Array:
    """Total rejected roots over every `ShampooState` inside ``opt_state`` (a metric; 0 if none)."""
    states = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ShampooState))
    counts = [s.root_failures for s in states if isinstance(s, ShampooState)]
    return sum(counts, jnp.zeros([], jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shampoo(ShampooDirection, common.MatrixOptimizer):
    """Shampoo on hidden matrices, AdamW on embeddings, LM head, norms, biases and scalars.

    Matrix leaves: ``chain(scale_by_shampoo(...), add_decayed_weights(weight_decay),
    scale_by_learning_rate(learning_rate))``; the rest: AdamW with ``adam_lr_ratio * learning_rate``
    (or ``adam_learning_rate``), see `optim.common.with_adam`. With the default Adam graft the update
    has Adam's scale, so Adam's learning rate and schedule carry over. Defaults follow distributed
    Shampoo (arXiv:2002.09018: beta1 0.9, beta2 0.999, Nesterov, matrix_eps 1e-6, failure
    threshold 0.1, no weight decay) with the issue's block size 1024 and refresh every 100 steps.
    Hyperparameters: `ShampooDirection`, `optim.common.AdamGroup`.

    Example:
      >>> tx = shampoo(optax.cosine_decay_schedule(1e-3, 1000), precondition_every=10)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params)
    """

    learning_rate: optax.ScalarOrSchedule = 3e-3
    weight_decay: float = 0.0


scale_by_shampoo = spec.function(
    ShampooDirection, "direction", name="scale_by_shampoo", positional=("block_size", "beta1", "beta2")
)
shampoo = spec.function(Shampoo, name="shampoo")
