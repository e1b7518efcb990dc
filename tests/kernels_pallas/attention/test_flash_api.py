"""kernels_pallas.attention.api: gradients by finite differences, lowering for GPU and TPU, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.test_util import check_grads

from kernels_pallas import backends
from kernels_pallas.attention import BlockSizes, flash_attention

TINY = BlockSizes(16, 16, 16, 16, 16, 16)


def test_the_interpreter_poisons_outputs_a_kernel_does_not_write():
    """The kernel tests rely on it: an unwritten tile is NaN, never a plausible zero."""

    def write_first_half(x_ref, o_ref):
        o_ref[:4] = x_ref[:4]

    out = pl.pallas_call(write_first_half, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32), interpret=True)(
        jnp.ones((8, 16))
    )
    assert np.all(out[:4] == 1) and np.all(np.isnan(out[4:]))


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(11)
    q, k, v = (jnp.float32(rng.standard_normal(s)) for s in ((1, 5, 2, 16), (1, 5, 1, 16), (1, 5, 1, 16)))
    segment_ids = jnp.int32([[0, 0, 1, 1, 1]])
    attention = jax.jit(lambda q, k, v: flash_attention(q, k, v, segment_ids=segment_ids, block_sizes=TINY, interpret=True))
    check_grads(attention, (q, k, v), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


def _abstract(b=2, t=300, h=4, kv=2, d=64, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
    k = jax.ShapeDtypeStruct((b, t, kv, d), dtype)
    return q, k, k, jax.ShapeDtypeStruct((b, t), jnp.int32)


def _lowered_custom_calls(backend, platform, **kwargs):
    def loss(q, k, v, segment_ids):
        out, max_logits = flash_attention(q, k, v, segment_ids=segment_ids, return_max_logits=True, backend=backend, **kwargs)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(max_logits)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*_abstract()).lower(lowering_platforms=(platform,)).as_text()
    return re.findall(r"custom_call @([\w$.]+)", text)


def test_triton_kernels_lower_for_cuda():
    """Pallas -> Triton IR runs on the host for an abstract H100 (experiments/check_sm90.py compiles it)."""
    with backends.gpu_target():
        calls = _lowered_custom_calls(None, "cuda")  # the Triton backend chosen from the mesh's platform
    assert len([c for c in calls if "triton" in c]) == 3, calls  # forward, dQ, dK/dV


TPU = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice("TPU v5 lite", 1, "tpu"))


def test_mosaic_kernels_lower_for_tpu():
    """Pallas -> Mosaic MLIR for a TPU v5e runs on the host; Mosaic's compiler needs a TPU (not here)."""
    with jax.sharding.use_abstract_mesh(TPU):
        calls = _lowered_custom_calls(None, "tpu")  # the TPU backend chosen from the mesh's platform
    assert calls.count("tpu_custom_call") == 3, calls


def test_tpu_block_sizes_must_fit_the_vector_tiles():
    with jax.sharding.use_abstract_mesh(TPU), pytest.raises(ValueError, match="block_kv=64 must be a multiple of 128"):
        _lowered_custom_calls(None, "tpu", block_sizes=BlockSizes(block_kv=64))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"interpret": True, "block_sizes": BlockSizes(block_q=48)}, "block_q=48 must be a power of two"),
        ({"interpret": True, "segment_ids": jnp.zeros((2, 8))}, "segment_ids must be integers"),
        ({"interpret": True, "segment_ids": jnp.zeros((2, 9), jnp.int32)}, r"expected \(batch, seq\) = \(2, 8\)"),
        ({"interpret": True, "backend": "cuda"}, f"flash_attention: no backend 'cuda' for platform '{backends.platform()}'; pass backend= one of triton"),
    ],
)
def test_bad_calls_say_what_to_do(kwargs, message):
    q = jnp.zeros((2, 8, 4, 16))
    with pytest.raises(ValueError, match=message):
        flash_attention(q, q[:, :, :2], q[:, :, :2], **kwargs)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU-only refusal")
def test_cpu_without_interpret_mode_is_refused():
    q = jnp.zeros((2, 8, 4, 16))
    with pytest.raises(ValueError, match="do not compile for cpu: pass interpret=True"):
        flash_attention(q, q, q)


def test_mixed_dtypes_are_refused():
    q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="one dtype among float32, bfloat16, float16"):
        flash_attention(q, q.astype(jnp.float32), q, interpret=True)


def test_triton_defaults_shrink_blocks_for_wide_rows():
    """Rows of more than 256 bytes (bf16 head_dim 256 or MLA, fp32 head_dim 128+) spilled or overflowed
    shared memory at the old 128 / 64 blocks when compiled for sm_90a (experiments/check_sm90.py)."""
    from kernels_pallas.attention import triton

    narrow, mla, wide = (triton.default_block_sizes(d, dv, dtype) for d, dv, dtype in [(64, 64, jnp.bfloat16), (256, 128, jnp.bfloat16), (256, 256, jnp.float32)])
    assert (narrow.block_q, narrow.block_kv, narrow.num_warps) == (128, 64, 4)
    assert (mla.block_q, mla.block_kv_dq, mla.block_q_dkv, mla.num_warps) == (64, 32, 32, 8)
    assert wide.block_q == wide.block_kv_dkv == 32
    assert triton.default_block_sizes(64, 64, jnp.float32).num_warps == 8  # 4 warps spilled in fp32
    # bf16 head_dim 128 with segment ids or a window: the dK/dV kernel's 64-row query tiles spilled
    assert triton.default_block_sizes(128, 128, jnp.bfloat16).block_q_dkv == 64
    assert triton.default_block_sizes(128, 128, jnp.bfloat16, masked=True).block_q_dkv == 32
    assert triton.default_block_sizes(64, 64, jnp.bfloat16, masked=True).block_q_dkv == 64


def test_operands_past_int32_offsets_are_refused():
    q = jax.ShapeDtypeStruct((2**13, 2048, 16, 8), jnp.bfloat16)
    with backends.gpu_target(), pytest.raises(ValueError, match=r"flash_attention: an operand of shape .* >= 2\*\*31 elements.*model.attention=xla"):
        jax.eval_shape(lambda q: flash_attention(q, q, q, backend="triton"), q)
