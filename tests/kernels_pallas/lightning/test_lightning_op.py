"""Lightning attention (`kernels_pallas.lightning`): the XLA blocked form against the token-by-token recurrence
(`recurrent_reference`, NumPy), its explicit backward against autodiff, and the Pallas kernels against it.

Shapes are small but cover the cases: a length that is not a multiple of the block (the padded last
block must not decay the final state), three documents, one boundary inside a block and one on a block edge (state resets), a
non-zero initial state (decoding), and heads with different decays. On CPU the Triton kernel runs in
Pallas interpret mode and the Mosaic kernel in TPU interpret mode (fresh buffers poisoned with NaN).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.lightning import api, reference
from tests.kernels_pallas.lightning import recurrent_reference

BATCH, SEQ, HEADS, DIM, BLOCK = 1, 21, 2, 8, 8
SLOPES = np.array([0.08, 0.9], np.float32)


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((BATCH, SEQ, HEADS, DIM)).astype(np.float32) * 0.5 for _ in range(3))
    segment_ids = np.zeros((BATCH, SEQ), np.int32)
    segment_ids[0, 5:] = 1  # a boundary inside the first block
    segment_ids[0, 16:] = 3  # one on a block edge
    state = rng.standard_normal((BATCH, HEADS, DIM, DIM)).astype(np.float32)
    return q, k, v, segment_ids, state


def _loss(fn, segment_ids):
    """A scalar of the op's output and final state with non-uniform cotangents for both."""

    def loss(q, k, v, state):
        out, final = fn(q, k, v, jnp.asarray(SLOPES), segment_ids=jnp.asarray(segment_ids), state=state, block=BLOCK)
        return jnp.sum(out * jnp.sin(out)) + 0.1 * jnp.sum(final**2), (out, final)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.fixture(scope="module")
def xla_result(operands):
    q, k, v, segment_ids, state = operands
    return _loss(lambda *a, **kw: api.lightning_attention(*a, implementation="xla", **kw), segment_ids)(q, k, v, state)


def test_blocked_form_equals_the_recurrence_token_by_token(operands, xla_result):
    q, k, v, segment_ids, state = operands
    (_, (out, final)), _ = xla_result
    want_out, want_state = recurrent_reference.recurrent(q, k, v, SLOPES, segment_ids, state)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, want_state, rtol=1e-5, atol=1e-5)
    # Without documents the state runs through: the recurrence differs, and so does the op.
    free, _ = reference.lightning_attention(q, k, v, jnp.asarray(SLOPES), state=state, block=BLOCK)
    np.testing.assert_allclose(free, recurrent_reference.recurrent(q, k, v, SLOPES, None, state)[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(free, want_out, atol=1e-3)


def test_explicit_backward_equals_autodiff_of_the_scan(operands, xla_result):
    q, k, v, segment_ids, state = operands
    _, grads = xla_result
    _, want = _loss(reference.lightning_attention, segment_ids)(q, k, v, state)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_pallas_kernels_equal_the_xla_form_forward_and_backward(operands, xla_result, backend):
    if backend == "mosaic_tpu" and jax.default_backend() == "gpu":
        pytest.skip("the TPU interpreter runs on CPU hosts")
    q, k, v, segment_ids, state = operands
    interpret = jax.default_backend() == "cpu" or backend == "mosaic_tpu"
    fn = lambda *a, **kw: api.lightning_attention(*a, backend=backend, interpret=interpret, **kw)
    (_, (out, final)), grads = _loss(fn, segment_ids)(q, k, v, state)
    (_, (want_out, want_final)), want_grads = xla_result
    tol = 1e-5 if jax.default_backend() == "cpu" else 5e-3  # compiled float32 dots meet in TF32 on a GPU
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(final, want_final, rtol=tol, atol=tol)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=10 * tol, atol=10 * tol)


def test_bad_operands_name_the_fix():
    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="one decay rate per head"):
        api.lightning_attention(x, x, x, jnp.zeros(3))
    with pytest.raises(ValueError, match="unknown lightning attention implementation"):
        api.lightning_attention(x, x, x, jnp.zeros(2), implementation="cudnn")
