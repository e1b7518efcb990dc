"""kernels_pallas.attention.reference: the XLA definition of correct, against a float64 NumPy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import reference


def numpy_attention(q, k, v, *, causal, sm_scale, segment_ids):
    """Per batch row and query head, straight from the formula (float64)."""
    b, t, h, _ = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, t, h, v.shape[-1]))
    max_logits = np.full(h, -np.inf)
    allowed = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
    for row in range(b):
        mask = allowed if segment_ids is None else allowed & (segment_ids[row][:, None] == segment_ids[row][None, :])
        for head in range(h):
            logits = sm_scale * q[row, :, head] @ k[row, :, head // group].T
            logits = np.where(mask, logits, -np.inf)
            max_logits[head] = max(max_logits[head], logits.max())
            weights = np.exp(logits - logits.max(-1, keepdims=True))
            out[row, :, head] = (weights / weights.sum(-1, keepdims=True)) @ v[row, :, head // group]
    return out, max_logits


def _inputs(seed, b, t, h, kv, d, dv):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, t, h, d)), rng.standard_normal((b, t, kv, d)), rng.standard_normal((b, t, kv, dv))


@pytest.mark.parametrize(
    "causal, segments, kv_heads, v_head_dim, sm_scale",
    [(True, True, 2, 12, 0.7), (False, False, 4, 8, None), (False, True, 1, 8, None)],
)
def test_matches_numpy(causal, segments, kv_heads, v_head_dim, sm_scale):
    q, k, v = _inputs(kv_heads, 2, 9, 4, kv_heads, 8, v_head_dim)
    segment_ids = np.sort(np.random.default_rng(7).integers(0, 3, (2, 9)), axis=1) if segments else None
    out, max_logits = reference.attention(
        *(jnp.float32(x) for x in (q, k, v)), causal=causal, sm_scale=sm_scale,
        segment_ids=None if segment_ids is None else jnp.int32(segment_ids), return_max_logits=True,
    )
    want_out, want_max = numpy_attention(q, k, v, causal=causal, sm_scale=sm_scale or 8**-0.5, segment_ids=segment_ids)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(max_logits, want_max, rtol=1e-5)


@pytest.mark.parametrize("causal, segments", [(True, False), (False, True)])
def test_blockwise_max_logits_equal_the_full_ones(causal, segments):
    q, k, _ = (jnp.float32(x) for x in _inputs(3, 2, 13, 4, 2, 8, 8))
    segment_ids = jnp.int32(np.sort(np.random.default_rng(1).integers(0, 4, (2, 13)), axis=1)) if segments else None
    _, full = reference.attention(q, k, k, causal=causal, segment_ids=segment_ids, return_max_logits=True)
    blockwise = jax.jit(lambda q, k: reference.max_logits(q, k, causal=causal, segment_ids=segment_ids, block_q=5))(q, k)
    np.testing.assert_allclose(blockwise, full, rtol=1e-6)


@pytest.mark.parametrize("blocks, segments", [(4, True)])
def test_causal_query_blocks_change_nothing(monkeypatch, blocks, segments):
    """Query blocks that skip the keys above the diagonal: output, max logits and gradients as one block's."""
    q, k, v = (jnp.float32(x) for x in _inputs(5, 2, 64, 4, 2, 8, 8))
    segment_ids = jnp.int32(np.sort(np.random.default_rng(2).integers(0, 3, (2, 64)), axis=1)) if segments else None
    weights = jnp.float32(np.random.default_rng(3).standard_normal((2, 64, 4, 8)))

    def loss(q, k, v):
        out, max_logits = reference.attention(q, k, v, segment_ids=segment_ids, return_max_logits=True)
        return jnp.sum(out * weights), (out, max_logits)

    def run(n):
        monkeypatch.setattr(reference, "causal_blocks", lambda t: n)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    blocked = run(blocks)
    for got, want in zip(jax.tree.leaves(blocked), jax.tree.leaves(run(1)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    want_out, _ = numpy_attention(q, k, v, causal=True, sm_scale=8**-0.5, segment_ids=segment_ids)
    np.testing.assert_allclose(blocked[1][0], want_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 8, 4, 16), (2, 8, 3, 16), (2, 8, 3, 16)), "4 query heads do not split into groups over 3"),
        (((2, 8, 4, 16), (2, 6, 2, 16), (2, 6, 2, 16)), "need q's batch and sequence length"),
        (((2, 8, 4, 16), (2, 8, 2, 8), (2, 8, 2, 16)), "k needs q's head_dim"),
        (((2, 8, 64), (2, 8, 64), (2, 8, 64)), r"\(batch, seq, heads, head_dim\)"),
    ],
)
def test_bad_shapes_say_what_fits(shapes, message):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        reference.attention(q, k, v)


def test_the_causal_mask_is_computed_not_a_constant_of_the_program():
    """The blocked causal path's masks come from iotas: a NumPy mask became a (rows, keys) constant per block in
    the program, forward and backward (gpt2-124m's train step held 17 MB of them at T = 1024)."""
    q = k = v = jax.ShapeDtypeStruct((1, 256, 2, 8), jnp.float32)
    assert reference.causal_blocks(256) == 4

    def loss(q, k, v):
        return jnp.sum(reference.attention(q, k, v, causal=True))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    constants = [line for line in text.splitlines() if "stablehlo.constant dense<" in line]
    assert constants and max(map(len, constants)) < 500, max(constants, key=len)[:200]
