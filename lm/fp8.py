"""FP8 matrix products with per-tensor scales (``model.fp8``), and how training keeps their scaling state.

A projection ``y = x W`` (``x`` ``(tokens, in)``, ``W`` ``(in, out)``) runs as

    q(a, s, F) = cast_F(clip(a / s, -max_F, max_F))            (per-tensor scale s, format F)
    y  = (q(x, s_x, e4m3) @ q(W, s_W, e4m3)) * s_x s_W          (fp8 operands, float32 accumulation)
    dx = (q(g, s_g, G) @ q(W, s_W, e4m3)^T) * s_g s_W            (g = dL/dy; G = e5m2 for ``hybrid``,
    dW = (q(x, s_x, e4m3)^T @ q(g, s_g, G)) * s_x s_g             e4m3 for ``e4m3``)

with each scale ``s = amax / max_F`` (the largest magnitude maps to the format's largest value; a zero
or non-finite amax keeps the previous scale, 1 at first). ``amax`` is the tensor's own, now (*current*
scaling, torchtitan's / torchao's tensorwise default), or the maximum over a window of the last
``model.fp8_amax_history`` steps' amaxes, before this step's is appended (*delayed* scaling,
Transformer Engine's ``DelayedScaling`` with ``amax_compute_algo="max"``, margin 0, as in MaxText and
``flax.linen.fp8_ops``, whose scale rule, history window and quantiser this module calls).

Delayed scaling keeps state: per product the three scales and amax histories, `Fp8Scaling` variables
named as flax names them (`SCALING_NAMES`). Flax's "overwrite with gradient" carries the new values
out of the step: the backward pass returns each variable's *new value* as its gradient (the gradient's
scale and amax exist only there). The train step therefore splits them off the gradients (`split`),
keeps them from the optimizer (`exclude_scaling`: the master weights and the optimizer state are those
of the model without FP8), combines them over micro-batches and replicas by maximum (`accumulate`), and
writes them into the parameters (`overwrite`). They are parameters of the pure-dict tree in every other
way: sharded (replicated, with the ``layers`` axis of a scanned stack), checkpointed and restored on
any mesh with the rest of the model state. Under GSPMD an amax of a sharded tensor is the maximum over
its shards, so FSDP and tensor parallelism quantise exactly as one device does.

Sources: Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433 (e4m3 forward, e5m2
gradients: the ``hybrid`` recipe); NVIDIA Transformer Engine's delayed scaling recipe; flax
``linen/fp8_ops.py`` (``fp8_scaled_dot_general``); torchao ``float8`` tensorwise dynamic scaling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.linen import fp8_ops

from sharding import axes

RECIPES = ("none", "e4m3", "hybrid")
SCALINGS = ("delayed", "current")
E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
SCALING_NAMES = (
    "input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history", "output_grad_scale", "output_grad_amax_history",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one projection runs in FP8: the gradient's format, and delayed scaling's window (0: current scaling)."""

    grad_dtype: Any = E5M2
    history: int = 0

    @property
    def delayed(self) -> bool:
        return self.history > 0


def recipe(cfg: Any, *, head: bool = False) -> Recipe | None:
    """The `Recipe` of ``cfg``'s projections (``head``: of its LM head), or None where they stay in the compute dtype."""
    if cfg.fp8 == "none" or (head and not cfg.fp8_head):
        return None
    history = cfg.fp8_amax_history if cfg.fp8_scaling == "delayed" else 0
    return Recipe(E5M2 if cfg.fp8 == "hybrid" else E4M3, history)


def has_state(cfg: Any) -> bool:
    """Whether ``cfg``'s model holds delayed scaling's state (`Fp8Scaling` variables)."""
    return cfg.fp8 != "none" and cfg.fp8_scaling == "delayed"


def problems(cfg: Any) -> list[str]:
    """What is wrong with ``cfg``'s FP8 fields (`lm.config.ModelConfig`), each naming the fix."""
    out = []
    if cfg.fp8 not in RECIPES:
        out.append(f"model.fp8={cfg.fp8!r} must be one of {', '.join(RECIPES)}")
    if cfg.fp8_scaling not in SCALINGS:
        out.append(f"model.fp8_scaling={cfg.fp8_scaling!r} must be one of {', '.join(SCALINGS)}")
    if cfg.fp8_amax_history < 1:
        out.append(f"model.fp8_amax_history={cfg.fp8_amax_history} must be >= 1 (steps of amax kept for delayed scaling)")
    if cfg.fp8_head and (cfg.tie_embeddings or cfg.loss_chunk != "none"):
        out.append(
            "model.fp8_head runs the untied LM head's product in FP8, which the fused chunked loss bypasses; "
            "set model.tie_embeddings=False and model.loss_chunk=none, or model.fp8_head=False"
        )
    if cfg.fp8_head and cfg.zero_init_head:
        out.append("model.fp8_head is not built for the speedrun's zero-initialised head; set model.zero_init_head=False or model.fp8_head=False")
    return out


DELAYED_UNDER_PIPELINE = (
    "delayed FP8 scaling under a pipeline (a `stage` mesh axis) would sum the micro-batches' new scaling state; "
    "set model.fp8_scaling=current"
)


class Fp8Scaling(nnx.Variable):
    """A scale or amax history of delayed scaling: set by the train step from its gradient, never by the optimizer."""


def _scale(amax: jax.Array, previous: jax.Array, dtype: Any) -> jax.Array:
    """``amax / max_F``; ``previous`` where ``amax`` is zero or not finite (flax's ``compute_scale``)."""
    return fp8_ops.compute_scale(amax, previous, fp8_ops.get_fp8_max(dtype, jnp.float32))


def _quantize(a: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
    """``cast_F(clip(a / scale))``, the division in float32."""
    return fp8_ops.quantize(a.astype(jnp.float32), dtype, scale, jnp.float32)


def _amax(a: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(a)).astype(jnp.float32)


def _scale_and_state(a: jax.Array, dtype: Any, state: dict, name: str) -> tuple[jax.Array, dict]:
    """The scale ``a`` is quantised with, and (delayed) the new ``{name}_scale``, ``{name}_amax_history``."""
    if not state:
        return _scale(_amax(a), jnp.float32(1.0), dtype), {}
    scale = _scale(jnp.max(state[f"{name}_amax_history"]), state[f"{name}_scale"], dtype)
    return scale, {f"{name}_scale": scale, f"{name}_amax_history": fp8_ops.compute_amax_history(a, state[f"{name}_amax_history"])}


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], scale: jax.Array) -> jax.Array:
    """``scale * (a . b)`` over axes ``contract`` of two fp8 matrices, accumulated in float32."""
    out = jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)
    return fp8_ops.dequantize(out, jnp.float32, scale)


def scaled_matmul(x: jax.Array, w: jax.Array, state: dict, grad_dtype: Any) -> jax.Array:
    """``x @ w`` (``(tokens, in) @ (in, out)``) with fp8 operands, in ``x``'s dtype; see the module docstring.

    ``state``: delayed scaling's `SCALING_NAMES` arrays (scales ``(1,)``, histories ``(history,)``, as flax's), or
    ``{}`` for current scaling. The gradient of ``state`` is its new value.
    """
    return _scaled_matmul(jnp.dtype(grad_dtype), jnp.dtype(w.dtype), x, w, state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scaled_matmul(grad_dtype, w_dtype, x, w, state):
    return _forward(grad_dtype, w_dtype, x, w, state)[0]


def _forward(grad_dtype, w_dtype, x, w, state):
    s_x, new_x = _scale_and_state(x, E4M3, state, "input")
    s_w, new_w = _scale_and_state(w, E4M3, state, "kernel")
    q_x, q_w = _quantize(x, E4M3, s_x), _quantize(w, E4M3, s_w)
    y = _dot(q_x, q_w, (1, 0), s_x * s_w).astype(x.dtype)
    return y, (q_x, q_w, s_x, s_w, new_x | new_w, state)


def _backward(grad_dtype, w_dtype, residuals, g):
    q_x, q_w, s_x, s_w, new_state, state = residuals
    s_g, new_g = _scale_and_state(g, grad_dtype, state, "output_grad")
    q_g = _quantize(g, grad_dtype, s_g)
    dx = _dot(q_g, q_w, (1, 1), s_g * s_w).astype(g.dtype)
    dw = _dot(q_x, q_g, (0, 0), s_x * s_g).astype(w_dtype)
    return dx, dw, new_state | new_g


_scaled_matmul.defvjp(_forward, _backward)


def initial_scaling(name: str, shape: tuple[int, ...]) -> jax.Array:
    """A scaling leaf's value before the first step: scales 1, amax histories 0 (`_scale` keeps 1 until an amax)."""
    return jnp.zeros(shape, jnp.float32) if name.endswith("history") else jnp.ones(shape, jnp.float32)


class Fp8DotGeneral(nnx.Module):
    """`nnx.Linear`'s ``dot_general`` in FP8 (`scaled_matmul` over ``x``'s last axis), holding delayed scaling's state.

    Like `lm.layers.project` it flattens the leading axes of ``x`` into one ``tokens`` axis.
    """

    def __init__(self, recipe: Recipe):
        self.grad_dtype = recipe.grad_dtype
        if recipe.delayed:
            for name in SCALING_NAMES:
                value = initial_scaling(name, (recipe.history,) if name.endswith("history") else (1,))
                setattr(self, name, Fp8Scaling(value, out_sharding=(None,)))

    def __call__(self, x, kernel, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
        (contract_x, contract_k), batch = dimension_numbers
        if batch != ((), ()) or contract_x != (x.ndim - 1,) or contract_k != (0,) or kernel.ndim != 2:
            raise ValueError(f"FP8 projections contract x's last axis with a 2-D kernel's first; got {dimension_numbers}")
        state = {name: getattr(self, name)[...] for name in SCALING_NAMES if hasattr(self, name)}
        mesh = jax.sharding.get_abstract_mesh()
        if state and not mesh.empty and dict(mesh.shape).get(axes.STAGE, 1) > 1:
            raise ValueError(DELAYED_UNDER_PIPELINE)
        y = scaled_matmul(x.reshape(-1, x.shape[-1]), kernel, state, self.grad_dtype)
        return jax.lax.reshape(y, (*x.shape[:-1], kernel.shape[-1]), out_sharding=out_sharding)


# ------------------------------------------------------------------ the train step's side


def _is_scaling(key: Any) -> bool:
    return isinstance(key, str) and key in SCALING_NAMES


def split(tree: Any) -> tuple[Any, Any]:
    """``(rest, scaling)``: the nested dict ``tree`` (parameters or gradients) without and with only the scaling leaves."""
    if not isinstance(tree, dict):
        return tree, {}
    rest, scaling = {}, {}
    for key, value in tree.items():
        if _is_scaling(key):
            scaling[key] = value
            continue
        r, s = split(value)
        if not isinstance(value, dict) or r:
            rest[key] = r
        if s:
            scaling[key] = s
    return rest, scaling


def merge(rest: Any, scaling: Any) -> Any:
    """The inverse of `split`."""
    if not scaling:
        return rest
    out = dict(rest)
    for key, value in scaling.items():
        out[key] = merge(out[key], value) if key in out else value
    return out


def accumulate(total: Any, grads: Any) -> Any:
    """``total + grads`` over micro-batches, except the scaling leaves' new values, whose maximum is taken.

    Every micro-batch starts from the same state, so its new scales agree and the maximum of its new
    histories is the history with the step's amax (the largest over micro-batches) appended.
    """
    (rest_t, scale_t), (rest_g, scale_g) = split(total), split(grads)
    return merge(jax.tree.map(jnp.add, rest_t, rest_g), jax.tree.map(jnp.maximum, scale_t, scale_g))


def mean(grads: Any, factor: float) -> Any:
    """``grads * factor`` (the micro-batch mean of an `accumulate`d sum); the scaling leaves stay as they are."""
    rest, scaling = split(grads)
    return merge(jax.tree.map(lambda g: g * factor, rest), scaling)


def overwrite(params: Any, grads: Any, reduce: Any = lambda x: x) -> Any:
    """``params`` with every scaling leaf set to its gradient (its new value), ``reduce``-d (a max over replicas)."""
    scaling = split(grads)[1]
    return merge(split(params)[0], jax.tree.map(reduce, scaling)) if scaling else params


def exclude_scaling(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` on everything but the scaling leaves, whose updates are zero (`overwrite` sets them).

    Its state is ``tx``'s on the model without FP8 state, so placement, checkpoints and the optimizer's
    label functions see the same tree as without delayed scaling.
    """
    tx = optax.with_extra_args_support(tx)

    def init(params):
        return tx.init(split(params)[0])

    def update(updates, state, params=None, **extra):
        rest, scaling = split(updates)
        rest, state = tx.update(rest, state, None if params is None else split(params)[0], **extra)
        return merge(rest, jax.tree.map(jnp.zeros_like, scaling)), state

    return optax.GradientTransformationExtraArgs(init, update)
