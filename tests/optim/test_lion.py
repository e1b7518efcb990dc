"""Lion: NumPy reference of arXiv:2302.06675 Algorithm 2, optax.lion, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import labels, lion


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(2, 4, 8)).astype(np.float32), "b": rng.normal(size=(8,)).astype(np.float32)}


def _grads(seed, params):
    rng = np.random.default_rng(100 + seed)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}


def _reference(params, grads_seq, lr, b1, b2, wd):
    """Lion in float64: c = b1 m + (1-b1) g; w -= lr (sign(c) + wd w) (decay on >= 2-D); m = b2 m + (1-b2) g."""
    w = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    for grads in grads_seq:
        for k in w:
            g = grads[k].astype(np.float64)
            c = b1 * m[k] + (1 - b1) * g
            decay = wd * w[k] if w[k].ndim >= 2 else 0.0
            w[k] = w[k] - lr * (np.sign(c) + decay)
            m[k] = b2 * m[k] + (1 - b2) * g
    return w, m


def _run(tx, params, grads_seq):
    state = tx.init(params)
    step = jax.jit(tx.update)
    for grads in grads_seq:
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_matches_numpy_reference_step_by_step():
    params = _params()
    grads_seq = [_grads(t, params) for t in range(5)]
    lr, b1, b2, wd = 0.01, 0.8, 0.95, 0.3
    tx = lion.lion(lr, b1=b1, b2=b2, weight_decay=wd)
    for n in range(1, 6):
        got, state = _run(tx, params, grads_seq[:n])
        want_w, want_m = _reference(params, grads_seq[:n], lr, b1, b2, wd)
        for k in params:
            np.testing.assert_allclose(got[k], want_w[k], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(state[0].mu[k], want_m[k], rtol=1e-6, atol=1e-7)


def test_matches_optax_lion():
    params = _params(1)
    grads_seq = [_grads(t, params) for t in range(6)]
    ours, _ = _run(lion.lion(3e-3, weight_decay=0.5), params, grads_seq)
    theirs, _ = _run(optax.lion(3e-3, weight_decay=0.5, mask=labels.decay_mask), params, grads_seq)
    for k in params:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-7)
    direction, _ = jax.jit(lion.scale_by_lion().update)(grads_seq[0], lion.scale_by_lion().init(params))
    want, _ = optax.scale_by_lion().update(grads_seq[0], optax.scale_by_lion().init(params))
    for k in params:
        np.testing.assert_array_equal(direction[k], want[k])


def test_converges_on_least_squares():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = a @ target

    def loss(p):
        return jnp.mean((a @ p["w"] - y) ** 2)

    tx = lion.lion(optax.cosine_decay_schedule(0.1, 500, alpha=1e-3), weight_decay=0.0)
    params = {"w": jnp.zeros((16, 4))}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    first = float(loss(params))
    for _ in range(500):
        params, state = step(params, state)
    assert float(loss(params)) < 1e-6 * first


def test_rejects_integer_params():
    with pytest.raises(ValueError, match="floating-point"):
        lion.lion(1e-3).init({"step": jnp.zeros((3,), jnp.int32)})
