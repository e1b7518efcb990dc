"""Shared by the quantized-update tests: random quantized moments and the comparison with the reference."""

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas.quantized_update as qu
from optim import quantization as qz

ADAMW = qu.AdamW(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
LION = qu.Lion(b1=0.9, b2=0.99, weight_decay=0.5)
TINY_BLOCKS = qu.BlockSizes(rows=16, cols=32)  # several programs per array at test shapes


def layout(node: qz.Quantized) -> qu.Moment:
    table = tuple(float(v) for v in qz.code_table(node.code, node.bits))
    return qu.Moment(table, node.tile if isinstance(node, qz.BlockQuantized) else None)


def arrays(node: qz.Quantized) -> tuple[jax.Array, ...]:
    return (node.codes, node.absmax) if isinstance(node, qz.BlockQuantized) else (node.codes, node.row, node.col)


def problem(rule, shape, bits, *, seed, stochastic=False, zero_rows=0):
    """Random ``(param, grad, moments, layouts, scalars, noise)`` in `quantize_state`'s layouts.

    The first ``zero_rows`` rows are zero in every input, so their tiles' new moments are all zero.
    """
    rng = np.random.default_rng(seed)
    p, g, m = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    v = rng.random(size=shape).astype(np.float32)
    if zero_rows:
        for x in (p, g, m, v):
            x[..., :zero_rows, :] = 0
    nodes = [qz.quantize_blockwise(jnp.asarray(m), bits=bits, code="signed", block_size=256 if bits == 8 else 128)]
    if isinstance(rule, qu.AdamW):
        if bits == 4 and len(shape) >= 2:
            nodes.append(qz.quantize_rank1(jnp.asarray(v), bits=4, code="linear"))
        else:
            code = "linear" if bits == 4 else "unsigned"
            nodes.append(qz.quantize_blockwise(jnp.asarray(v), bits=bits, code=code, block_size=256 if bits == 8 else 128))
    layouts = [layout(n) for n in nodes]
    noise = None
    if stochastic:
        noise = [qu.rounding_noise(jax.random.key(seed + i), m, shape) for i, m in enumerate(layouts)]
    scalars = rule.scalars(jnp.int32(3), 1e-2)
    return p, g, [arrays(n) for n in nodes], layouts, scalars, noise


def assert_same(got, want):
    """Codes bit for bit; scales, maxima and updates to fp32 rounding (XLA and Triton may contract to FMA)."""
    (got_u, got_m), (want_u, want_m) = got, want
    for a, b in zip(jax.tree.leaves(got_m), jax.tree.leaves(want_m), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if a.dtype == jnp.uint8:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert got_u.shape == want_u.shape and got_u.dtype == want_u.dtype
    np.testing.assert_allclose(got_u, want_u, rtol=1e-6, atol=1e-7)
