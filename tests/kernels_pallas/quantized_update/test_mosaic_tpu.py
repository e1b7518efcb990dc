"""The Mosaic TPU quantized-update kernel in TPU interpret mode on CPU: exactly the XLA reference.

`pltpu.InterpretParams` simulates the block copies into VMEM and the scalar tables in SMEM, and with
``uninitialized_memory="nan"`` a fresh output starts as NaN, so an unwritten block fails. Codes,
scales and updates must be bit for bit the reference's (the kernel is gather-free, not approximate):
8 and 4 bits (the AdamW rule; Lion's is the same shared `base` code the Triton tests run), nearest
and stochastic rounding, ragged edges (partial tiles and blocks), all-zero tiles (absmax 0), rank-1
second moments over a leading axis. And `auto` takes it under a TPU mesh, lowering to Mosaic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qcheck
from jax.experimental.pallas import tpu as pltpu

import kernels_pallas.quantized_update as qu
from optim import labels
from optim.quantize_state import Fused, quantize_state


CASES = [
    # bits, shape, stochastic, zero rows, blocks. Every SMEM table read is a host callback in the
    # interpreter, so the 256-entry case keeps to 2 x 2 blocks; stochastic rounding runs on 16 entries.
    (8, (40, 70), False, 16, qu.BlockSizes(rows=32, cols=64)),  # ragged both ways, a row of zero tiles
    (4, (2, 20, 50), True, 8, qcheck.TINY_BLOCKS),  # rank-1 + block moments, packed nibbles, odd columns
]


@pytest.mark.parametrize("bits,shape,stochastic,zero_rows,blocks", CASES)
def test_kernel_equals_reference_exactly(bits, shape, stochastic, zero_rows, blocks):
    rule = qcheck.ADAMW
    p, g, moments, layouts, scalars, noise = qcheck.problem(rule, shape, bits, seed=len(shape) + bits, stochastic=stochastic, zero_rows=zero_rows)
    want = jax.jit(lambda *a: qu.quantized_update_reference(rule, *a[:3], layouts, *a[3:]))(p, g, moments, scalars, noise)
    params = pltpu.InterpretParams(uninitialized_memory="nan")
    kernel = jax.jit(
        lambda *a: qu.quantized_update(rule, *a[:3], layouts, *a[3:], backend="mosaic_tpu", interpret=params, block_sizes=blocks)
    )
    got = kernel(p, g, moments, scalars, noise)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        np.testing.assert_array_equal(a, b)
    if zero_rows:
        assert float(jnp.min(want[1][0][1])) == 0.0  # the zero tiles really are zero


def test_auto_takes_the_mosaic_kernel_on_a_tpu_and_it_lowers_with_state_in_place():
    """Under a TPU mesh, `quantize_state(kernel="auto")` lowers (Pallas -> Mosaic, on this CPU host) to one TPU custom call."""
    params = {"w": jnp.ones((16, 256))}
    inner = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1, mask=labels.decay_mask)
    tx = quantize_state(inner, 8, kernel="auto", fused=Fused(qcheck.ADAMW, 1e-3), mask=lambda p: {"w": True})
    state = tx.init(params)
    tpu = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=tpu)):
        assert qu.available()
        text = jax.jit(tx.update).trace(params, state, params).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1
    assert "output_operand_aliases" in text  # codes and scales written in place
