"""Drop-Muon: Muon on a random suffix of the layers each step (Gruntkowska, Maziane, Qu and Richtárik,
"Drop-Muon: Update Less, Converge Faster", arXiv:2510.02239).

Randomized progressive training over ``b`` layers (0-based here): each step ``k`` draws a start
``s_k`` and updates only the layers ``S_k = {s_k, ..., b - 1}``; the others are frozen, momentum and
weights alike. For layer ``i`` with gradient ``G_i`` and momentum ``M_i``:

    i not in S_k:  M_i <- M_i,                      W_i <- W_i
    i in S_k:      D_i, M_i <- momentum direction of G_i (Muon's: EMA + Nesterov by default)
                   W_i <- W_i - lr_k (s(W) NewtonSchulz(D_i) + lambda W_i)

``s_k`` is drawn uniformly from ``{0, ..., b - 1}`` (the paper's "uniform index sampling" of its
experiments), from ``seed`` and the step count, so a resumed run draws the same layers. Layer ``i``
then moves with probability ``(i + 1) / b``: the last layer every step, the first one step in ``b``.

Layers are the leading axis of the scan-stacked hidden matrices (``(layers, *batch, fan_in,
fan_out)``; every stack must have the same depth ``b``), selected per layer inside each stacked leaf.
A hidden matrix outside a stack has no depth and is updated every step (a model whose layers are
separate leaves gets Muon). Embeddings, LM head, norms and biases take AdamW every step.

Compute saved: Newton-Schulz runs only on the active layers. The step is a `jax.lax.switch` over
``s_k`` whose branch ``j`` orthogonalises the ``b - j`` layers ``j..b-1`` of every stack, so a step
runs ``(b - s_k)`` of the stack's ``b`` Newton-Schulz iterations, ``(b + 1) / (2 b)`` of them in
expectation (tests/optim/test_drop_muon.py counts them per branch in the compiled HLO; figures in
docs/benchmarks.md). The compiled program holds ``b`` copies of the orthogonalisation (compile time
grows with depth). The backward pass through the frozen layers, which the paper also saves, is still
computed by the train step here.

Weight decay applies to the active layers only (the frozen ones keep their weights exactly), so the
full optimizer decays inside the direction; `scale_by_drop_muon` alone decays nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optim import common, labels, shapes, spec
from optim import newton_schulz as ns
from optim.muon import MuonDirection, check_matrices, momentum_direction, shape_factor


class DropMuonState(NamedTuple):
    """State of `scale_by_drop_muon`."""

    mu: optax.Updates  # momentum buffer M_t, shaped like the parameters (frozen rows kept)
    count: jax.Array  # steps taken, int32: with ``seed``, the step's draw of s_k


def stack_depth(tree: Any, axes_tree: Any) -> int:
    """The common depth ``b`` of the stacked matrices of ``tree`` (0 when none is stacked)."""
    depths = set()
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    axes = jax.tree.structure(tree).flatten_up_to(axes_tree)
    for (path, x), ax in zip(leaves_with_path, axes, strict=True):
        batch, _, _ = ns.split_axes(x.shape, ax)
        if batch:
            if batch[0] != 0:
                raise ValueError(f"drop_muon needs the layer axis first: {labels.path_names(path)} {x.shape}")
            depths.add(x.shape[0])
    if len(depths) > 1:
        raise ValueError(f"drop_muon needs every layer stack to have one depth, got {sorted(depths)}; label the others 'adam'")
    return depths.pop() if depths else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DropMuonDirection(MuonDirection):
    """Drop-Muon's direction (module docstring); other fields as `optim.muon.MuonDirection`.

    Attributes:
      seed: seeds the draws of the first active layer (with the step count).
    """

    seed: int = 0

    family: ClassVar[str] = "drop_muon"

    def direction(self, weight_decay: float = 0.0) -> optax.GradientTransformation:
        """The update ``s(W) O_t + weight_decay W_t`` on the active layers, 0 on the frozen ones."""

        def init_fn(params):
            check_matrices(params, self.dimension_numbers, self.family)
            stack_depth(params, ns.matrix_axes_tree(params, self.dimension_numbers))
            mu = jax.tree.map(lambda p: jnp.zeros(p.shape, self.mu_dtype), params)
            return DropMuonState(mu=mu, count=jnp.zeros([], jnp.int32))

        def update_fn(updates, state, params=None):
            shapes.check_like(updates, state.mu, self.family)
            if params is None and not (isinstance(weight_decay, float | int) and weight_decay == 0):
                raise ValueError("drop_muon's weight decay needs the parameters: call update(grads, state, params)")
            grads, treedef = jax.tree.flatten(updates)
            axes = treedef.flatten_up_to(ns.matrix_axes_tree(updates, self.dimension_numbers))
            depth = stack_depth(updates, treedef.unflatten(axes))
            key = jax.random.fold_in(jax.random.key(self.seed), state.count)
            start = jax.random.randint(key, (), 0, max(depth, 1))
            stacked = [bool(ns.split_axes(g.shape, ax)[0]) for g, ax in zip(grads, axes, strict=True)]

            def active(x, is_stacked):
                """Per entry of ``x``: whether its layer moves this step (broadcast over the matrix)."""
                if not is_stacked:
                    return jnp.ones((1,) * x.ndim, bool)
                return (jnp.arange(x.shape[0]) >= start).reshape((-1,) + (1,) * (x.ndim - 1))

            masks = [active(g, st) for g, st in zip(grads, stacked, strict=True)]
            pairs = [
                momentum_direction(g, m, self.beta, self.momentum_form, self.nesterov)
                for g, m in zip(grads, treedef.flatten_up_to(state.mu), strict=True)
            ]
            directions = [d for d, _ in pairs]
            ortho = self._orthogonalize_active(directions, stacked, axes, start, depth)
            ps = treedef.flatten_up_to(params) if params is not None else [None] * len(grads)
            out = []
            for o, g, p, ax, mask in zip(ortho, grads, ps, axes, masks, strict=True):
                u = o * shape_factor(o.shape, ax, self.shape_scale)
                if p is not None:
                    u = u + jnp.asarray(weight_decay, jnp.float32) * p.astype(jnp.float32)
                out.append(jnp.where(mask, u, 0.0).astype(g.dtype))
            mu = [
                jnp.where(mask, m_new, m_old.astype(jnp.float32)).astype(self.mu_dtype)
                for (_, m_new), m_old, mask in zip(pairs, treedef.flatten_up_to(state.mu), masks, strict=True)
            ]
            new_state = DropMuonState(mu=treedef.unflatten(mu), count=optax.safe_increment(state.count))
            return treedef.unflatten(out), new_state

        return optax.GradientTransformation(init_fn, update_fn)

    def _orthogonalize_active(self, directions, stacked, axes, start, depth):
        """NewtonSchulz of every direction, on the layers ``start..depth-1`` only of the stacked ones
        (zeros on the others): one `jax.lax.switch` branch per value of ``start``."""
        flat = [d for d, st in zip(directions, stacked, strict=True) if not st]
        flat_axes = [ax for ax, st in zip(axes, stacked, strict=True) if not st]
        flat_out = iter(self.orthogonalize(flat, lambda _: flat_axes) if flat else [])
        stacks = [d for d, st in zip(directions, stacked, strict=True) if st]
        stack_axes = [ax for ax, st in zip(axes, stacked, strict=True) if st]

        def branch(j):
            def run(xs):
                done = self.orthogonalize([x[j:] for x in xs], lambda _: stack_axes)
                return [jnp.concatenate([jnp.zeros_like(x[:j]), o.astype(x.dtype)]) for x, o in zip(xs, done, strict=True)]

            return run

        stack_out = iter(jax.lax.switch(start, [branch(j) for j in range(depth)], stacks) if stacks else [])
        return [next(stack_out) if st else next(flat_out) for st in stacked]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DropMuon(DropMuonDirection, common.MatrixOptimizer):
    """Drop-Muon on hidden matrices, AdamW elsewhere; hyperparameters as `optim.muon.muon` plus ``seed``."""

    learning_rate: optax.ScalarOrSchedule = 2.4e-2  # swept on `tiny` (docs/benchmarks.md, section 1b): 2x Muon's
    weight_decay: float = 0.1

    def transform(self) -> optax.GradientTransformationExtraArgs:
        full = common.with_adam(
            self.direction(self.weight_decay),
            self.learning_rate,
            weight_decay=self.weight_decay,
            decay_matrices=False,
            **spec.values(self, common.AdamGroup),
        )
        return shapes.checked(full, "dropmuon")


scale_by_drop_muon = spec.function(DropMuonDirection, "direction", name="scale_by_drop_muon", positional=("beta",))
drop_muon = spec.function(DropMuon, name="drop_muon")
