"""The grouped-matmul kernels against `jax.lax.ragged_dot`, forward and both gradients.

On CPU the Triton kernels run in Pallas interpret mode (the interpreter fills outputs with NaN first,
so a row a kernel forgets to write fails the comparison); with a GPU as JAX's default backend
(tests/conftest.py) they run compiled. The Mosaic TPU kernels run in TPU interpret mode everywhere but
on a TPU: `pltpu.InterpretParams` simulates VMEM, the block DMAs and the output block that stays
resident across grid steps, poisons fresh buffers with NaN and raises on out-of-bounds reads. Tiles
of 16 are smaller than a compiled TPU kernel takes (8 x 128), so that small operands span several.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import backends
from kernels_pallas.gmm import api, base, mosaic_tpu, reference

TILING = base.Tiling(block_m=16, block_k=16, block_n=16)
INTERPRET = {
    "triton": jax.default_backend() == "cpu",
    "mosaic_tpu": jax.default_backend() != "tpu" and pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise"),
}
# Compiled, float32 tiles meet in TF32 (10-bit mantissa) dots; the reference runs at full precision.
TF32_TOLERANCE = 5e-3

# (m, k, n, group sizes): partial row / k / n tiles, empty groups (first, middle, last), a group inside
# one tile, groups spanning tiles, rows past the groups; then groups aligned with whole tiles.
CASES = [
    (47, 24, 20, (0, 7, 0, 30, 1, 7, 0)),
    (32, 16, 16, (16, 16)),
]


def _operands(m, k, n, sizes, dtype=jnp.float32):
    rng = np.random.default_rng(m * k + n)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.asarray(rng.standard_normal((m, n)), jnp.float32)


@pytest.mark.parametrize("m, k, n, sizes", CASES)
def test_work_items_cover_each_groups_rows_exactly_once(m, k, n, sizes):
    items = jax.jit(base.work_items, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, 16)
    group, tile, start, end = (np.asarray(a) for a in items)
    covered = np.full(m, -1)
    real = end > start
    for g, t, s, e in zip(group, tile, start, end):
        assert e == s or t * 16 <= s < e <= t * 16 + 16
        assert np.all(covered[s:e] == -1)
        covered[s:e] = g
    # In order of (group, tile); surplus items come last and repeat the last real one's group and tile.
    assert np.all(np.diff(group) >= 0) and np.all(np.diff(tile) >= 0)
    last = np.flatnonzero(real)[-1]
    assert not real[last + 1 :].any() and np.all(group[last:] == group[last]) and np.all(tile[last:] == tile[last])
    offsets = np.cumsum((0, *sizes))
    expected = np.full(m, -1)
    for g in range(len(sizes)):
        expected[offsets[g] : offsets[g + 1]] = g
    np.testing.assert_array_equal(covered, expected)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("m, k, n, sizes", CASES)
def test_kernels_match_ragged_dot_forward_and_backward(m, k, n, sizes, backend):
    lhs, rhs, group_sizes, dout = _operands(m, k, n, sizes)

    def loss(impl):
        return lambda lhs, rhs: jnp.sum(impl(lhs, rhs, group_sizes) * dout)

    kernel = lambda a, b, g: api.gmm(a, b, g, backend=backend, interpret=INTERPRET[backend], tiling=TILING)
    out, (dlhs, drhs) = jax.jit(lambda a, b: (kernel(a, b, group_sizes), jax.grad(loss(kernel), argnums=(0, 1))(a, b)))(lhs, rhs)
    with jax.default_matmul_precision("highest"):
        want_out = reference.gmm(lhs, rhs, group_sizes)
        want_dlhs, want_drhs = jax.grad(loss(reference.gmm), argnums=(0, 1))(lhs, rhs)
    tol = 1e-4 if INTERPRET[backend] else TF32_TOLERANCE
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(dlhs, want_dlhs, atol=tol, rtol=tol)
    np.testing.assert_allclose(drhs, want_drhs, atol=tol, rtol=tol)
    np.testing.assert_allclose(reference.tgmm(lhs, dout, group_sizes), want_drhs, atol=1e-4, rtol=1e-4)
    assert not np.any(np.asarray(drhs)[np.asarray(sizes) == 0])  # an empty group gets a zero gradient


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_bfloat16_accumulates_in_float32(backend):
    lhs, rhs, group_sizes, _ = _operands(48, 32, 32, (20, 0, 28), jnp.bfloat16)
    out = api.gmm(lhs, rhs, group_sizes, backend=backend, interpret=INTERPRET[backend], tiling=TILING)
    want = reference.gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), want, atol=0.1, rtol=2e-2)


def test_default_backend_on_cpu_is_ragged_dot_and_bad_input_names_the_fix():
    lhs, rhs, group_sizes, _ = _operands(8, 16, 16, (5, 3))
    np.testing.assert_array_equal(api.gmm(lhs, rhs, group_sizes), jax.lax.ragged_dot(lhs, rhs, group_sizes))
    with pytest.raises(ValueError, match="one matrix per group"):
        api.gmm(lhs, rhs[:1], group_sizes)
    with pytest.raises(ValueError, match="unknown gmm backend 'cuda'"):
        api.gmm(lhs, rhs, group_sizes, backend="cuda")


def test_forward_and_backward_lower_to_triton_for_a_gpu_on_any_host():
    """Lowering for an abstract H100 checks what Triton-specific code may use (experiments/check_sm90.py compiles it)."""
    lhs, rhs = jax.ShapeDtypeStruct((100, 64), jnp.bfloat16), jax.ShapeDtypeStruct((4, 64, 128), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def forward_and_pullback(a, b, g):
        out, pullback = jax.vjp(lambda a, b: api.gmm(a, b, g, backend="triton", interpret=False), a, b)
        return out, pullback(out)

    with backends.gpu_target():
        text = jax.jit(forward_and_pullback).trace(lhs, rhs, group_sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3  # gmm, gmm with rhs transposed (dlhs), tgmm (drhs)


def test_tpu_kernels_lower_to_mosaic_on_any_host():
    """Pallas -> Mosaic MLIR for a TPU runs on the host at the default (8, 128)-aligned tiles; Mosaic's
    compiler needs a TPU (not here), so this checks what lowering checks (block shapes, ops), no more."""
    lhs, rhs = jax.ShapeDtypeStruct((200, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    group_sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

    def forward_and_pullback(a, b, g):
        out, pullback = jax.vjp(lambda a, b: api.gmm(a, b, g, backend="mosaic_tpu", interpret=False), a, b)
        return out, pullback(out)

    text = jax.jit(forward_and_pullback).trace(lhs, rhs, group_sizes).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # gmm, gmm with rhs transposed (dlhs), tgmm (drhs)
    assert mosaic_tpu.DEFAULT_TILING.block_k % 128 == 0 and mosaic_tpu.DEFAULT_TILING.block_n % 128 == 0


def test_triton_tiling_over_the_h100_shared_memory_is_refused_before_the_gpu():
    """The old default (3 stages of 128 x 64 and 128 x 128 fp32 tiles) needed 288 KiB in tgmm; the default
    now takes 2 stages for 4-byte operands (192 KiB), and a tiling that does not fit names the fix."""
    from kernels_pallas.gmm import triton

    assert triton.shared_bytes("tgmm", base.Tiling(num_stages=3), jnp.float32) == 288 * 1024
    assert triton.shared_bytes("tgmm", base.Tiling(), jnp.float32) == 192 * 1024
    assert triton.shared_bytes("tgmm", base.Tiling(), jnp.bfloat16) == 144 * 1024
    lhs, dout = jax.ShapeDtypeStruct((256, 128), jnp.float32), jax.ShapeDtypeStruct((256, 128), jnp.float32)
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match="tgmm: .* needs up to 288 KiB of shared memory, .* lower num_stages, block_k or block_n"):
        jax.eval_shape(lambda a, b, g: triton.tgmm(a, b, g, tiling=base.Tiling(num_stages=3)), lhs, dout, sizes)
    jax.eval_shape(lambda a, b, g: triton.tgmm(a, b, g, tiling=base.Tiling(num_stages=3), interpret=True), lhs, dout, sizes)


def test_operands_past_int32_offsets_are_refused():
    lhs, rhs = jax.ShapeDtypeStruct((2**21, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((4, 1024, 128), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"gmm: an operand of shape \(2097152, 1024\) .* >= 2\*\*31 elements.*moe_matmul=ragged_dot"):
        jax.eval_shape(lambda a, b, g: api.gmm(a, b, g, backend="triton", interpret=False), lhs, rhs, sizes)
