"""Building blocks: RMSNorm, rotary position embeddings, the SwiGLU MLP, a logically-named Linear, and the token Embed."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from lm import fp8
from sharding.partition import constrain


class Embed(nnx.Embed):
    """`nnx.Embed` that gathers rows of the float32 table and casts them to ``dtype``.

    ``nnx.Embed`` casts the whole table to ``dtype`` and gathers from that, so the backward pass adds up a
    token's gradient over its occurrences in ``dtype``: a frequent token's thousands of bf16 rows summed in
    bf16. Here ``d table[v] = sum_{t: x_t = v} dy_t`` accumulates in float32, as PyTorch's fp32 embedding
    does under autocast; the forward values are the same (rounding commutes with the gather).
    """

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        if out_sharding is not None or not jnp.issubdtype(inputs.dtype, jnp.integer) or self.num_embeddings == 1:
            return super().__call__(inputs, out_sharding=out_sharding)
        rows = jnp.take(self.embedding[...], inputs, axis=0)
        return rows if self.dtype is None else rows.astype(self.dtype)


def linear(
    fan_in: int,
    fan_out: int,
    names: tuple[str, str],
    *,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    scale: float = 1.0,
    fp8_recipe: fp8.Recipe | None = None,
) -> nnx.Linear:
    """Bias-free Linear, kernel ``(fan_in, fan_out)`` with logical ``names``, std ``scale / sqrt(fan_in)``;
    its product in FP8 with ``fp8_recipe`` (`lm.fp8`)."""
    init = nnx.initializers.variance_scaling(scale**2, "fan_in", "truncated_normal")
    return nnx.Linear(
        fan_in,
        fan_out,
        use_bias=False,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.with_partitioning(init, names),
        dot_general=project if fp8_recipe is None else fp8.Fp8DotGeneral(fp8_recipe),
        rngs=rngs,
    )


def project(x, kernel, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``x @ kernel`` over ``x``'s last axis (`nnx.Linear`'s ``dot_general``), as one ``(tokens, in)`` product.

    The value is `jax.lax.dot_general`'s. Flattening the leading axes first makes autodiff's kernel
    gradient ``x^T g`` a plain product of two ``(tokens, features)`` matrices over their rows; on the
    ``(batch, seq, features)`` arrays it is ``(g^T x)^T`` over two axes, which XLA:CPU computes after
    storing ``g`` transposed, ``(features, tokens)``: on the `tiny` step those copies, fused into
    SwiGLU's backward, took longer than the MLP's weight-gradient products themselves.
    """
    (contract_x, contract_k), batch = dimension_numbers
    kwargs = dict(precision=precision, preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    if batch != ((), ()) or contract_x != (x.ndim - 1,) or contract_k != (0,) or kernel.ndim != 2 or x.ndim == 2:
        return jax.lax.dot_general(x, kernel, dimension_numbers, **kwargs)
    y = jax.lax.dot_general(x.reshape(-1, x.shape[-1]), kernel, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type)
    return jax.lax.reshape(y, (*x.shape[:-1], kernel.shape[-1]), out_sharding=out_sharding)


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x^2) + eps) * scale``, computed in float32 (Zhang & Sennrich, arXiv:1910.07467)."""

    def __init__(self, dim: int, axis_name: str, *, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=(axis_name,))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.dtype)


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """RMSNorm in float32, recomputed in the backward pass from ``x`` and ``scale`` (`jax.checkpoint`).

    Left to autodiff, the backward pass would keep float32 copies of ``x`` and of the normalised
    values: twice the bytes of the input, per norm. An unrolled XLA program fuses them away, but
    under ``scan_layers`` they become per-layer buffers written in the forward loop and read in the
    backward one (`lm.remat`). Recomputing them is a few elementwise passes over ``x``.
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(dtype)


@jax.checkpoint
def swiglu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, recomputed in the backward pass from the two projections (`rms_norm` says why)."""
    return jax.nn.silu(gate) * up


def rotary_embedding(
    x: jax.Array, positions: jax.Array, theta: float, *, freqs: jax.Array | None = None, scale: float = 1.0
) -> jax.Array:
    """RoPE (Su et al., arXiv:2104.09864), rotate-half form: pairs ``(x_i, x_{i + d/2})``.

    Args:
      x: ``(batch, seq, heads, head_dim)``.
      positions: ``(seq,)`` integer positions.
      theta: base of the frequencies ``theta^(-2i/d)``.
      freqs: ``(head_dim / 2,)`` frequencies instead of theta's (a scaled RoPE, `lm.rope`).
      scale: multiplies the rotated vector (YaRN's attention factor).
    """
    half = x.shape[-1] // 2
    if freqs is None:
        freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # (seq, half)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer, arXiv:2002.05202)."""

    def __init__(
        self, d_model: int, hidden: int, *, out_scale: float, dtype: jnp.dtype, rngs: nnx.Rngs, fp8_recipe: fp8.Recipe | None = None
    ):
        kw = {"dtype": dtype, "rngs": rngs, "fp8_recipe": fp8_recipe}
        self.gate_proj = linear(d_model, hidden, ("embed", "mlp"), **kw)
        self.up_proj = linear(d_model, hidden, ("embed", "mlp"), **kw)
        self.down_proj = linear(hidden, d_model, ("mlp", "embed"), scale=out_scale, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = swiglu_gate(self.gate_proj(x), self.up_proj(x))
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
        return self.down_proj(hidden)


def split_heads(x: jax.Array, n_heads: int, logical: Sequence[str]) -> jax.Array:
    """``(batch, seq, n_heads * head_dim) -> (batch, seq, n_heads, head_dim)``, constrained."""
    b, s, _ = x.shape
    return constrain(x.reshape(b, s, n_heads, -1), logical)
