"""kernels_pallas.attention.partial: two key blocks merged by their log-sum-exp give whole attention.

Queries at positions ``S .. 2S-1`` attend to keys ``0 .. 2S-1`` as two square blocks: the earlier
keys unmasked, their own positions causally. Merged forward and summed per-block gradients (from
the merged output and lse) must equal `reference.attention` over the whole sequence, for the XLA
blocks and for the Triton and Mosaic kernels in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import api, partial, reference

S, HEADS, KV_HEADS, HEAD_DIM, V_HEAD_DIM = 24, 4, 2, 16, 12  # a ragged 24 rows: the kernels pad to their tiles

# (implementation, backend, segments): packed documents, query and key ids apart, in every implementation.
CASES = [("xla", None, True), ("pallas", "triton", True), ("pallas", "mosaic_tpu", True)]


def _inputs(segments: bool):
    rng = np.random.default_rng(7)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q, k, v = normal(2, 2 * S, HEADS, HEAD_DIM), normal(2, 2 * S, KV_HEADS, HEAD_DIM), normal(2, 2 * S, KV_HEADS, V_HEAD_DIM)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (2, 2 * S)), axis=1), jnp.int32) if segments else None
    return q, k, v, seg, normal(2, S, HEADS, V_HEAD_DIM)


@pytest.mark.parametrize("implementation, backend, segments", CASES)
def test_two_merged_blocks_equal_whole_attention(implementation, backend, segments):
    q, k, v, seg, d_out = _inputs(segments)
    late = lambda x: None if x is None else x[:, S:]  # noqa: E731
    early = lambda x: None if x is None else x[:, :S]  # noqa: E731
    options = {"implementation": implementation, "backend": backend, "interpret": backend is not None}

    def whole(q_late, k, v):
        return reference.attention(jnp.concatenate([q[:, :S], q_late], 1), k, v, segment_ids=seg)[:, S:]

    expected, vjp = jax.vjp(whole, late(q), k, v)
    expected_grads = vjp(d_out)

    forward = jax.jit(partial.forward, static_argnames=("causal", *options))
    backward = jax.jit(partial.backward, static_argnames=("causal", *options))
    blocks = [(early(k), early(v), early(seg), False), (late(k), late(v), late(seg), True)]
    results = [forward(late(q), kb, vb, late(seg), sb, causal=causal, **options) for kb, vb, sb, causal in blocks]
    out, lse, _ = partial.merge(*results)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(_whole_logits(q, k, seg), axis=-1), rtol=1e-5, atol=1e-5)

    grads = [backward(late(q), kb, vb, late(seg), sb, out, lse, d_out, causal=causal, **options) for kb, vb, sb, causal in blocks]
    np.testing.assert_allclose(grads[0][0] + grads[1][0], expected_grads[0], rtol=1e-4, atol=1e-5)
    for got, want in zip((jnp.concatenate([grads[0][i], grads[1][i]], 1) for i in (1, 2)), expected_grads[1:], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _whole_logits(q, k, seg):
    """The late queries' float32 logits over all keys, ``(batch, heads, S, 2S)``, ``-inf`` where masked."""
    grouped = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
    logits = jnp.einsum("bshd,bthd->bhst", q, grouped) * HEAD_DIM**-0.5
    allowed = reference.mask(2 * S, causal=True, segment_ids=seg)[:, None]
    return jnp.where(allowed, logits, -jnp.inf)[:, :, S:]


def test_the_kernel_blocks_are_square():
    q, k, v, _, _ = _inputs(False)
    with pytest.raises(ValueError, match="as many queries as keys; got 24 and 48"):
        partial.forward(q[:, S:], k, v, causal=False, implementation="pallas", backend="triton", interpret=True)


def test_cudnn_falls_back_with_one_logged_reason(caplog):
    api._LOGGED.clear()
    with caplog.at_level("WARNING", logger=api.__name__):
        assert api.block_implementation("cudnn", "gpu", jnp.bfloat16) == "pallas"
        assert api.block_implementation("cudnn", "gpu", jnp.float32) == "xla"
        assert api.block_implementation("cudnn", "gpu", jnp.bfloat16) == "pallas"
    assert [r.getMessage().count("no log-sum-exp") for r in caplog.records] == [1, 1]
    assert api.block_implementation("auto", "tpu", jnp.float32) == "pallas"
    assert api.block_implementation("auto", "cpu", jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        api.block_implementation("flash", "gpu", jnp.bfloat16)
