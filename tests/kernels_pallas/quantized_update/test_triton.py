"""The Triton quantized-update kernel in Pallas interpret mode on CPU against the XLA reference.

Codes bit for bit, scales and updates to fp32 rounding, for AdamW and Lion, 8 and 4 bits, ragged
edges (partial tiles and blocks), all-zero tiles (absmax 0), stochastic rounding with the same
uniforms, a leading axis, a 1-D parameter; per shard on 8 devices; and lowering for a GPU. The
interpreter fills outputs with NaN first (tests/kernels_pallas/attention/test_flash_api.py), so an
unwritten block fails.
"""

import re

import jax
import jax.numpy as jnp
import pytest
import qcheck

import kernels_pallas.quantized_update as qu
from kernels_pallas import backends


CASES = [
    # rule, bits, shape, stochastic, zero rows
    ("adamw", 8, (40, 70), True, 16),  # 3 x 3 programs, ragged both ways; a row of all-zero tiles
    ("adamw", 4, (2, 20, 50), False, 8),  # rank-1 + block moments, two nibbles per byte, odd columns
    ("lion", 4, (300,), True, 0),  # 1-D, stochastic
]


def _rule(name):
    return {"adamw": qcheck.ADAMW, "lion": qcheck.LION}[name]


@pytest.mark.parametrize("name,bits,shape,stochastic,zero_rows", CASES)
def test_kernel_matches_reference(name, bits, shape, stochastic, zero_rows):
    rule = _rule(name)
    p, g, moments, layouts, scalars, noise = qcheck.problem(rule, shape, bits, seed=len(shape), stochastic=stochastic, zero_rows=zero_rows)
    want = jax.jit(lambda *a: qu.quantized_update_reference(rule, *a[:3], layouts, *a[3:]))(p, g, moments, scalars, noise)
    kernel = jax.jit(
        lambda *a: qu.quantized_update(rule, *a[:3], layouts, *a[3:], interpret=True, block_sizes=qcheck.TINY_BLOCKS)
    )
    qcheck.assert_same(kernel(p, g, moments, scalars, noise), want)
    if zero_rows:
        assert float(jnp.min(want[1][0][1])) == 0.0  # the zero tiles really are zero


@pytest.mark.devices(8)
def test_sharded_on_8_devices_equals_unsharded():
    rule, shape, spec = qcheck.ADAMW, (8, 128), jax.P(None, "fsdp")  # 4-bit: rank-1 maxima all-reduced over fsdp
    p, g, moments, layouts, scalars, _ = qcheck.problem(rule, shape, 4, seed=5)
    want = jax.jit(lambda *a: qu.quantized_update_reference(rule, *a[:3], layouts, *a[3:]))(p, g, moments, scalars)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        p = jax.device_put(p, jax.NamedSharding(mesh, spec))
        step = jax.jit(lambda *a: qu.quantized_update(rule, *a[:3], layouts, *a[3:], interpret=True, spec=spec))
        got = step(p, g, moments, scalars)
    assert got[0].sharding.spec == spec
    qcheck.assert_same(got, want)


@pytest.mark.parametrize("name,bits,stochastic", [("adamw", 8, True), ("lion", 4, False)])
def test_lowers_for_cuda_with_aliased_state(name, bits, stochastic):
    rule = _rule(name)
    p, g, moments, layouts, scalars, noise = qcheck.problem(rule, (64, 96), bits, seed=1, stochastic=stochastic)
    step = jax.jit(lambda *a: qu.quantized_update(rule, *a[:3], layouts, *a[3:], backend="triton"))
    with backends.gpu_target():
        text = step.trace(p, g, moments, scalars, noise).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1
    assert "output_operand_aliases" in text  # codes and scales written in place


@pytest.mark.devices(2)
def test_inside_the_replica_step_lowers_for_cuda_and_refuses_interpret_mode():
    """Per replica in a type-checked `jax.shard_map` (tests/kernels_pallas/test_varying.py): the
    compiled kernel lowers; jax's Pallas interpreter cannot run there, so interpret mode names the XLA path."""
    rule = qcheck.ADAMW
    p, g, moments, layouts, scalars, _ = qcheck.problem(rule, (64, 96), 8, seed=2)

    def per_replica(interpret, mesh):
        def step(*args):
            args = jax.tree.map(lambda x: jax.lax.pcast(x, "data", to="varying"), args)  # per-replica state
            return qu.quantized_update(rule, *args[:3], layouts, *args[3:], backend="triton", interpret=interpret)

        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("data"), check_vma=True))

    with backends.gpu_target((2,), ("data",)) as h100s:
        text = per_replica(False, h100s).trace(p, g, moments, scalars).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="interpret mode cannot run .*optimizer.state_kernel=xla"):
        per_replica(True, mesh)(p, g, moments, scalars)


def test_bad_calls_say_what_to_do():
    p, g, moments, layouts, scalars, _ = qcheck.problem(qcheck.LION, (16, 32), 8, seed=0)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="pass interpret=True"):
            qu.quantized_update(qcheck.LION, p, g, moments, layouts, scalars)
    with pytest.raises(ValueError, match="takes 2 moments"):
        qu.quantized_update(qcheck.ADAMW, p, g, moments, layouts, scalars, interpret=True)
    with pytest.raises(ValueError, match="must be a power of two"):
        qu.BlockSizes(rows=24)


def test_parameters_past_int32_offsets_are_refused():
    from optim import quantization as qz

    big = jax.ShapeDtypeStruct((2**16, 2**15), jnp.float32)
    node = jax.eval_shape(lambda x: qz.quantize_blockwise(x, bits=8, code="signed", block_size=256), big)
    layout = qu.Moment(tuple(float(v) for v in qz.code_table("signed", 8)), node.tile)
    scalars = jax.eval_shape(lambda: qcheck.LION.scalars(jnp.int32(3), 1e-2))
    with backends.gpu_target(), pytest.raises(ValueError, match=r"quantized_update: .* >= 2\*\*31 elements.*state_kernel=xla"):
        jax.eval_shape(lambda p, g, m, s: qu.quantized_update(qcheck.LION, p, g, [m], [layout], s), big, big, qcheck.arrays(node), scalars)
