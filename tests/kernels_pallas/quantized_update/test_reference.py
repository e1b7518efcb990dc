"""reference.quantized_update is bit for bit the step optim.quantize_state takes (AdamW, Lion; 8 and 4 bits)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qcheck

import kernels_pallas.quantized_update as qu
from optim import labels
from optim import quantization as qz
from optim.quantize_state import quantize_state

CASES = [
    ("adamw", 8, (33, 70), True),  # ragged tiles, stochastic rounding
    ("adamw", 4, (2, 20, 50), False),  # rank-1 second moment over a leading axis, packed nibbles, odd column count
    ("adamw", 4, (301,), True),  # 1-D: blocks of 128 with the linear code
    ("lion", 4, (3, 17), False),  # fewer rows than a tile
]


@pytest.mark.parametrize("name,bits,shape,stochastic", CASES)
def test_reference_is_quantize_state_bit_for_bit(name, bits, shape, stochastic):
    rng = np.random.default_rng(bits)
    rule = {"adamw": qcheck.ADAMW, "lion": qcheck.LION}[name]
    inner = {"adamw": optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1), "lion": optax.lion(1e-2, b1=0.9, b2=0.99, weight_decay=0.5)}[name]
    tx = quantize_state(inner, bits, mask=lambda p: {"w": True}, stochastic_rounding=stochastic, seed=3)
    params = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
    state = tx.init(params)
    # Both op by op: under jit, XLA:CPU may contract a multiply-add into an FMA in one program and not
    # in the other, which moves fp32 values by an ulp (the kernel tests allow for that).
    for _ in range(2):
        grads = {"w": jnp.asarray(rng.normal(size=shape), jnp.float32)}
        nodes = jax.tree.leaves(state.view(), is_leaf=qz.is_quantized)
        index = [i for i, n in enumerate(nodes) if qz.is_quantized(n)]
        layouts = [qcheck.layout(nodes[i]) for i in index]
        noise = None
        if stochastic:
            key = jax.random.fold_in(jax.random.key(3), state.count)
            noise = [qu.rounding_noise(jax.random.fold_in(key, i), m, shape) for i, m in zip(index, layouts)]
        scalars = rule.scalars(state.count + 1, 1e-2)
        want = qu.quantized_update_reference(
            rule, params["w"], grads["w"], [qcheck.arrays(nodes[i]) for i in index], layouts, scalars, noise
        )
        updates, state = tx.update(grads, state, params)
        nodes = jax.tree.leaves(state.view(), is_leaf=qz.is_quantized)
        for got, node in zip(want[1], [nodes[i] for i in index], strict=True):
            for a, b in zip(got, qcheck.arrays(node), strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(want[0], updates["w"])
        params = optax.apply_updates(params, updates)
    assert labels.decay_mask(params)["w"] == (len(shape) >= 2)
