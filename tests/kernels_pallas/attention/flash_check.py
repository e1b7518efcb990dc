"""Shared by the flash-attention kernel tests: cases, fresh random inputs, the comparison with the reference.

Tolerances, against `reference.attention` evaluated in float32 on the same (rounded) inputs:
float32 inputs agree to 2e-5 (absolute and relative; only summation order differs), bfloat16 inputs
to 3e-2 (bf16's 8-bit mantissa: outputs and gradients are rounded to bf16, and the probabilities
are rounded to bf16 before the P V and dS K products, as in the bf16 reference). The max logits
are float32 in both, from the same float32 logits: 2e-5 for either input dtype. Compiled on a GPU
(``INTERPRET`` false), float32 matmuls run in TF32 in the kernel and in XLA alike (JAX's default
precision), so float32 is held to 5e-3 there and the max logits to 1e-2; not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attention import api, reference
from kernels_pallas.attention.base import BlockSizes

INTERPRET = jax.default_backend() == "cpu"  # see tests/conftest.py to run the kernels compiled on a GPU
TOLERANCE = {"float32": 2e-5 if INTERPRET else 5e-3, "bfloat16": 3e-2}
MAX_LOGITS_TOLERANCE = 2e-5 if INTERPRET else 1e-2


@dataclasses.dataclass(frozen=True)
class Case:
    seq: int
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    v_head_dim: int | None = None
    causal: bool = True
    sm_scale: float | None = None
    segments: bool = False
    dtype: str = "float32"
    batch: int = 2
    blocks: tuple[int, int] = (16, 16)  # (query rows, key rows) of every kernel's tiles

    @property
    def block_sizes(self) -> BlockSizes:
        bq, bk = self.blocks
        return BlockSizes(bq, bk, bq, bk, bq, bk)


def inputs(case: Case) -> dict:
    """q, k, v, the output cotangent and segment ids, drawn from a seed of their own per case."""
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    dv = case.v_head_dim or case.head_dim
    shapes = {
        "q": (case.batch, case.seq, case.heads, case.head_dim),
        "k": (case.batch, case.seq, case.kv_heads, case.head_dim),
        "v": (case.batch, case.seq, case.kv_heads, dv),
        "d_out": (case.batch, case.seq, case.heads, dv),
    }
    arrays = {name: jnp.asarray(rng.standard_normal(shape), case.dtype) for name, shape in shapes.items()}
    # Three documents of random lengths per row (some may be empty): every query has its own key.
    arrays["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (case.batch, case.seq)), axis=1), jnp.int32) if case.segments else None
    return arrays


def _with_grads(attention, x: dict):
    """``(out, max_logits, (dq, dk, dv))`` of ``attention(q, k, v)`` pulled back along ``x["d_out"]``."""
    (out, max_logits), pullback = jax.vjp(attention, x["q"], x["k"], x["v"])
    return out, max_logits, pullback((x["d_out"], jnp.zeros_like(max_logits)))


def compare(case: Case, **kernel_kwargs) -> None:
    """Kernel vs reference: output, per-head max logits, and the three gradients."""
    x = inputs(case)
    kw = {"causal": case.causal, "sm_scale": case.sm_scale, "segment_ids": x["segment_ids"], "return_max_logits": True}
    kernel = jax.jit(lambda x: _with_grads(
        lambda q, k, v: api.flash_attention(q, k, v, block_sizes=case.block_sizes, **kw, **kernel_kwargs), x
    ))(x)
    upcast = {n: None if a is None else (a.astype(jnp.float32) if n != "segment_ids" else a) for n, a in x.items()}
    expected = jax.jit(lambda x: _with_grads(lambda q, k, v: reference.attention(q, k, v, **kw), x))(upcast)
    tol = TOLERANCE[case.dtype]
    (out, max_logits, grads), (ref_out, ref_max, ref_grads) = kernel, expected
    assert out.dtype == x["q"].dtype and out.shape == ref_out.shape
    np.testing.assert_allclose(np.float32(out), ref_out, atol=tol, rtol=tol, err_msg="output")
    np.testing.assert_allclose(max_logits, ref_max, atol=MAX_LOGITS_TOLERANCE, rtol=MAX_LOGITS_TOLERANCE, err_msg="max logits")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert got.dtype == x["q"].dtype and got.shape == want.shape, name
        np.testing.assert_allclose(np.float32(got), want, atol=tol, rtol=tol, err_msg=name)
