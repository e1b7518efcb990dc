"""Block-wise dynamic / linear codes and rank-1 quantization: tables, layout, round-trip error."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import quantization as qz


def _spacing_bound(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Largest |nearest code - y| for normalised values ``y``: half the gap around y, or the distance
    to the table's end outside its range."""
    k = np.clip(np.searchsorted(table, y), 1, len(table) - 1)
    lo, hi = table[k - 1], table[k]
    inside = (y >= lo) & (y <= hi)
    return np.where(inside, (hi - lo) / 2, np.minimum(np.abs(y - lo), np.abs(y - hi)))


def _blocks(x: np.ndarray, tile: tuple[int, int]):
    """Yields (index, block) over the tiles of the last two axes (a 1-D array as one row)."""
    m = x.reshape(x.shape if x.ndim >= 2 else (1, *x.shape))
    tr, tc = tile
    for lead in np.ndindex(*m.shape[:-2]):
        for a in range(0, m.shape[-2], tr):
            for b in range(0, m.shape[-1], tc):
                yield (*lead, slice(a, a + tr), slice(b, b + tc)), m


def _check_blockwise(x: np.ndarray, q: qz.BlockQuantized) -> None:
    table = qz.code_table(q.code, q.bits).astype(np.float64)
    got = np.asarray(qz.dequantize(q), np.float64)
    assert got.shape == x.shape and np.all(np.isfinite(got))
    x2 = x.reshape(x.shape if x.ndim >= 2 else (1, *x.shape)).astype(np.float64)
    g2 = got.reshape(x2.shape)
    for idx, _ in _blocks(x, q.tile):
        blk, dec = x2[idx], g2[idx]
        absmax = np.abs(blk).max()
        if absmax == 0:
            np.testing.assert_array_equal(dec, 0.0)
            continue
        y = blk / absmax
        bound = _spacing_bound(y, table) * absmax
        assert np.all(np.abs(dec - blk) <= bound * (1 + 1e-5) + 1e-7 * absmax)


def test_code_tables():
    for code, bits in [("signed", 8), ("unsigned", 8), ("signed", 4), ("unsigned", 4), ("linear", 4), ("linear", 8)]:
        t = qz.code_table(code, bits)
        assert t.dtype == np.float32 and len(t) == 2**bits and np.all(np.diff(t) > 0) and t[-1] == 1.0
        assert (0.0 in t) == (code != "linear")
        assert (t.min() < 0) == (code == "signed")
    # 4-bit dynamic-exponent (DE) map of arXiv:2309.01507: 10^0 x 4 fractions, 10^-1 x 2, 10^-2 x 1, 0, 1.
    de = [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875]
    np.testing.assert_allclose(qz.code_table("signed", 4), sorted([-v for v in de] + [0.0] + de + [1.0]), rtol=1e-6)
    np.testing.assert_allclose(qz.code_table("linear", 4), np.arange(1, 17) / 16)
    signed8 = qz.code_table("signed", 8)  # bitsandbytes' dynamic map: 127 magnitudes from 5.5e-7 to 1 - 0.9/128
    assert np.sum(signed8 > 0) == 128 and signed8[signed8 > 0][0] == pytest.approx(5.5e-7)
    assert signed8[-2] == pytest.approx(1 - 0.9 / 128)
    unsigned8 = qz.code_table("unsigned", 8)  # the sign bit buys one more fraction bit per exponent
    assert unsigned8[1] == pytest.approx(10**-6 * 0.325) and unsigned8[-2] == pytest.approx(1 - 0.9 / 256)
    with pytest.raises(ValueError, match="bits"):
        qz.code_table("signed", 3)


def test_tile_shape():
    assert qz.tile_shape((4, 64, 64), 256) == (16, 16)
    assert qz.tile_shape((64, 64), 128) == (8, 16)
    assert qz.tile_shape((64, 64), 2048) == (32, 64)
    assert qz.tile_shape((8, 512), 256) == (8, 32)  # fewer rows than 16: wider tiles, still 256 elements
    assert qz.tile_shape((1, 512), 256) == (1, 256)
    assert qz.tile_shape((5000,), 256) == (1, 256)
    with pytest.raises(ValueError, match="power of two"):
        qz.tile_shape((64, 64), 100)


_RNG = np.random.default_rng(0)


def _distributions(shape):
    """Normal, heavy-tailed (Cauchy), all-zero and tiny-magnitude (1e-30) arrays, stacked on axis 0."""
    return np.stack(
        [_RNG.normal(size=shape), _RNG.standard_cauchy(size=shape), np.zeros(shape), _RNG.normal(size=shape) * 1e-30]
    ).astype(np.float32)


@pytest.mark.parametrize(
    "bits,code,block", [(8, "signed", 256), (8, "unsigned", 256), (4, "signed", 128), (4, "linear", 128)]
)
def test_blockwise_round_trip_within_code_spacing(bits, code, block):
    x = _distributions((40, 70))  # ragged tiles along both axes; each distribution its own matrix
    x = x if code == "signed" else np.abs(x)
    q = jax.jit(lambda x: qz.quantize_blockwise(x, bits=bits, code=code, block_size=block))(jnp.asarray(x))
    _check_blockwise(x, q)


def test_zero_blocks_give_zeros_and_no_nan():
    x = _RNG.normal(size=(32, 48)).astype(np.float32)
    x[:16, :16] = 0.0  # one whole tile
    x[16:, 32:] *= 1e-35  # a tile of subnormal-range magnitudes next to normal ones

    for bits, code, block in [(8, "signed", 256), (4, "linear", 256)]:
        quantize = jax.jit(lambda x: qz.quantize_blockwise(x, bits=bits, code=code, block_size=block))
        q = quantize(jnp.asarray(np.abs(x) if code == "linear" else x))
        dec = np.asarray(jax.jit(qz.dequantize)(q))
        assert np.all(np.isfinite(dec)) and np.all(np.isfinite(q.absmax))
        np.testing.assert_array_equal(dec[:16, :16], 0.0)
        assert float(q.absmax[0, 0]) == 0.0


def test_layout_and_nibble_packing():
    q8 = jax.eval_shape(qz.quantize_blockwise, jnp.zeros((3, 40, 70)))
    assert (q8.codes.shape, q8.codes.dtype, q8.absmax.shape, q8.tile) == ((3, 40, 70), jnp.uint8, (3, 3, 5), (16, 16))
    q4 = jax.eval_shape(lambda x: qz.quantize_blockwise(x, bits=4, block_size=128), jnp.zeros((3, 40, 71)))
    assert (q4.codes.shape, q4.absmax.shape, q4.tile) == ((3, 40, 36), (3, 5, 5), (8, 16))
    r = jax.eval_shape(qz.quantize_rank1, jnp.zeros((3, 40, 71)))
    assert (r.codes.shape, r.row.shape, r.col.shape) == ((3, 40, 36), (3, 40, 1), (3, 1, 71))
    q1 = jax.eval_shape(qz.quantize_blockwise, jnp.zeros((1000,)))
    assert (q1.codes.shape, q1.absmax.shape, q1.tile) == ((1000,), (4,), (1, 256))
    # Linear 4-bit code k is (k + 1) / 16: a row 1/16 .. 16/16 (absmax 1) codes to 0 .. 15, and byte j holds
    # column 2j in its low nibble and column 2j + 1 in its high nibble.
    row = jnp.arange(1, 17, dtype=jnp.float32)[None] / 16
    q = jax.jit(lambda x: qz.quantize_blockwise(x, bits=4, code="linear", block_size=16))(row)
    np.testing.assert_array_equal(q.codes[0], [k | (k + 1) << 4 for k in range(0, 16, 2)])
    np.testing.assert_array_equal(jax.jit(qz.dequantize)(q), row)


def test_rank1_round_trip_within_code_spacing():
    v = (_RNG.standard_cauchy(size=(2, 24, 30)) ** 2).astype(np.float32)
    v[0, 3, :] = 0.0  # a zero row
    q = jax.jit(qz.quantize_rank1)(jnp.asarray(v))
    dec = np.asarray(jax.jit(qz.dequantize)(q), np.float64)
    assert np.all(np.isfinite(dec))
    np.testing.assert_array_equal(dec[0, 3], 0.0)
    scale = np.minimum(np.abs(v).max(-1, keepdims=True), np.abs(v).max(-2, keepdims=True)).astype(np.float64)
    y = np.divide(v, scale, out=np.zeros_like(scale * v), where=scale > 0)
    bound = _spacing_bound(y, qz.code_table("linear", 4).astype(np.float64)) * scale
    assert np.all(np.abs(dec - v) <= bound * (1 + 1e-5) + 1e-30)
    # The zero-free linear code never decodes a positive entry to zero.
    assert np.all(dec[v > 0] > 0)
    with pytest.raises(ValueError, match="2 axes"):
        qz.quantize_rank1(jnp.ones((8,)))


def test_stochastic_rounding_is_unbiased_between_neighbours():
    x = jnp.asarray(_RNG.normal(size=(16, 16)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 2000)
    decode = jax.jit(jax.vmap(lambda k: qz.dequantize(qz.quantize_blockwise(x, bits=4, block_size=256, key=k))))
    samples = np.asarray(decode(keys))
    table = qz.code_table("signed", 4) * float(jnp.max(jnp.abs(x)))
    xs = np.asarray(x)
    k = np.clip(np.searchsorted(table, xs, side="right"), 1, len(table) - 1)
    below = xs < table[0]  # the signed 4-bit table stops at -0.8875: such values clamp to its first entry
    lo, hi = np.where(below, table[0], table[k - 1]), np.where(below, table[0], table[k])
    assert np.all(np.isclose(samples, lo, rtol=1e-6) | np.isclose(samples, hi, rtol=1e-6))
    gap = np.max(np.diff(table))
    np.testing.assert_allclose(samples.mean(0)[~below], xs[~below], atol=4 * gap / np.sqrt(len(keys)))


def test_dtype_is_kept_and_scalars_rejected():
    x = jnp.asarray(_RNG.normal(size=(20, 20)), jnp.bfloat16)
    assert jax.eval_shape(lambda x: qz.dequantize(qz.quantize_blockwise(x)), x).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="scalar"):
        qz.quantize_blockwise(jnp.float32(1.0))


@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(
    shape=st.lists(st.integers(1, 37), min_size=1, max_size=3).map(tuple),
    bits=st.sampled_from([8, 4]),
    block=st.sampled_from([16, 64, 256]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_shape(shape, bits, block, seed):
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    q = jax.jit(lambda x: qz.quantize_blockwise(x, bits=bits, block_size=block))(jnp.asarray(x))
    _check_blockwise(x, q)
