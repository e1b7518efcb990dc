"""PowerSGD against a NumPy transcription of arXiv:1905.13727 Algorithm 1 (with error feedback)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import powersgd
from tests.optim.replica_harness import AXIS, run_replicas

W, T = 2, 3


def _tree(rng, lead=()):
    return {
        "w": rng.normal(size=(*lead, 2, 6, 5)).astype(np.float32),  # stacked layers: one Q per layer
        "embed": rng.normal(size=(*lead, 8, 4)).astype(np.float32),
        "scale": rng.normal(size=(*lead, 2, 5)).astype(np.float32),  # stacked norm scales: never compressed
    }


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    return _tree(rng), _tree(rng, (W, T))


def _gram_schmidt(p):
    q = np.zeros_like(p)
    for i in range(p.shape[-1]):
        v = p[:, i] - q[:, :i] @ (q[:, :i].T @ p[:, i])
        q[:, i] = v / (np.linalg.norm(v) + 1e-8)
    return q


def _reference(grads, q0, rank_leaves):
    """Per step, the estimate every replica gets, and the final errors: Algorithm 1 matrix by matrix."""
    out = {}
    for name, g in grads.items():  # g: (W, T, *batch, n, m)
        if name not in rank_leaves:
            out[name] = (g.mean(0), None)
            continue
        batch_shape = g.shape[2:-2]
        est = np.zeros(g.shape[1:], np.float64)
        err = np.zeros((W, *g.shape[2:]))
        for b in np.ndindex(*batch_shape):
            q = q0[name][b].astype(np.float64)
            e = np.zeros((W, *g.shape[-2:]))
            for t in range(T):
                m = g[(slice(None), t, *b)] + e
                p = _gram_schmidt(np.mean([m[w] @ q for w in range(W)], axis=0))
                q = np.mean([m[w].T @ p for w in range(W)], axis=0)
                est[(t, *b)] = p @ q.T
                e = m - p @ q.T
            err[(slice(None), *b)] = e
        out[name] = (est, err)
    return out


@pytest.mark.devices(2)
def test_matches_numpy_algorithm_on_two_replicas(setup):
    """Rank 2, where the embedding (8 x 4) is compressed and the norm scales are all-reduced whole."""
    params, grads = setup
    tx = powersgd.scale_by_powersgd(2, axis_name=AXIS)
    _, updates, state = run_replicas(tx, params, grads)
    q0 = jax.tree.map(np.asarray, tx.init(params).q)
    compressed = {k for k in params if not isinstance(state.q[k], optax.MaskedNode)}
    assert compressed == {"w", "embed"}
    ref = _reference(grads, q0, compressed)
    for name, (est, err) in ref.items():
        for w in range(W):  # every replica applies the same estimate
            np.testing.assert_allclose(updates[name][w], est, rtol=2e-4, atol=2e-5)
        if err is not None:
            np.testing.assert_allclose(state.error[name], err, rtol=2e-4, atol=2e-5)


@pytest.mark.devices(2)
def test_full_rank_equals_all_reduce(setup):
    """r = min(n, m): every step's estimate is the replica mean of that step's gradients."""
    params, grads = setup
    tx = powersgd.scale_by_powersgd(5, min_compression_rate=0.0, axis_name=AXIS)
    params, grads = {"w": params["w"]}, {"w": grads["w"]}
    _, updates, state = run_replicas(tx, params, grads)
    np.testing.assert_allclose(updates["w"][0], grads["w"].mean(0), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.error["w"].sum(0), 0.0, atol=1e-4)  # local errors cancel over replicas


def test_compressed_leaves_follow_the_byte_saving_rule():
    tx = powersgd.scale_by_powersgd(4)
    params = {"big": jnp.zeros((3, 64, 32)), "small": jnp.zeros((4, 4)), "bias": jnp.zeros(64)}
    state = jax.eval_shape(tx.init, params)
    assert state.q["big"].shape == (3, 32, 4) and state.error["big"].shape == (3, 64, 32)
    assert isinstance(state.q["small"], optax.MaskedNode) and isinstance(state.q["bias"], optax.MaskedNode)
    # n m / (r (n + m)) against min_compression_rate: at rank 2, w 30/22 = 1.36, embed 32/24 = 1.33.
    at_rate = jax.eval_shape(powersgd.scale_by_powersgd(2, min_compression_rate=1.35).init, _tree(np.random.default_rng(0)))
    assert {k for k, q in at_rate.q.items() if not isinstance(q, optax.MaskedNode)} == {"w"}


def test_rank_must_be_positive():
    with pytest.raises(ValueError, match="rank=0 must be >= 1"):
        powersgd.scale_by_powersgd(0)


@pytest.mark.parametrize("shape, rank", [((3, 8), 4), ((64, 4), 8)])
def test_rank_is_capped_at_the_smaller_side(shape, rank):
    """issue 34 item 3: a rank above min(n, m) gives the gradient itself (full rank), not a worse estimate."""
    g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)}
    tx = powersgd.scale_by_powersgd(rank, min_compression_rate=0.0)
    state = tx.init(g)
    assert state.q["w"].shape == (shape[1], min(shape))
    estimate, _ = tx.update(g, state)
    np.testing.assert_allclose(estimate["w"], g["w"], atol=1e-5)


@pytest.mark.devices(2)
def test_start_iter_all_reduces_uncompressed_first(setup):
    """PyTorch's start_powerSGD_iter: the first steps are the plain replica mean, errors stay zero,
    and compression (rank 1: not the mean) starts after them."""
    params, grads = setup
    params, grads = {"w": params["w"]}, {"w": grads["w"]}
    tx = powersgd.scale_by_powersgd(1, start_iter=2, axis_name=AXIS)
    _, updates, state = run_replicas(tx, params, grads)
    mean = grads["w"].mean(0)
    np.testing.assert_allclose(updates["w"][:, :2], np.broadcast_to(mean[:2], (W, *mean[:2].shape)), rtol=1e-5, atol=1e-6)
    assert np.abs(updates["w"][0, 2] - mean[2]).max() > 0.1
    assert int(state.count[0]) == T
    # the compressed step started from zero errors: it equals a fresh compressor's first step
    _, fresh, _ = run_replicas(powersgd.scale_by_powersgd(1, axis_name=AXIS), params, {"w": grads["w"][:, 2:]})
    np.testing.assert_allclose(updates["w"][:, 2], fresh["w"][:, 0], rtol=1e-5, atol=1e-6)
