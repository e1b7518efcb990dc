"""DeMo (arXiv:2411.19870): chunked DCT, top-k with error feedback, mean over pickers, signSGD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.fft

from optim import demo
from tests.optim.replica_harness import AXIS, run_replicas


def _problem(replicas=2, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": rng.normal(size=(2, 12, 8)).astype(np.float32),  # stacked layers of 12 x 8 matrices
        "scale": rng.normal(size=(2, 8)).astype(np.float32),  # stacked norm scales: 1-D DCT
        "bias": rng.normal(size=(6,)).astype(np.float32),
    }
    grads = jax.tree.map(lambda p: rng.normal(size=(replicas, steps, *p.shape)).astype(np.float32), params)
    return params, grads


def test_chunks_are_the_largest_divisor_up_to_chunk():
    assert [demo.chunk_size(n, 64) for n in (128, 384, 320, 32, 100, 7)] == [64, 64, 64, 32, 50, 7]


@pytest.mark.parametrize("shape, chunks", [((2, 12, 8), (4, 8)), ((10,), (5,))])
def test_chunked_dct_matches_scipy_and_round_trips(shape, chunks):
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    coeffs = np.asarray(demo.encode(jnp.asarray(x), chunks))
    if len(chunks) == 2:  # chunk (a, b) of layer l: scipy's orthonormal 2-D DCT-II of that block
        block = x[1, 4:8, 0:8]
        np.testing.assert_allclose(coeffs[1, 1, 0], scipy.fft.dctn(block, norm="ortho").ravel(), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(coeffs[1], scipy.fft.dct(x[5:10], norm="ortho"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(demo.decode(jnp.asarray(coeffs), chunks), x, rtol=1e-5, atol=1e-5)


def test_all_coefficients_on_one_replica_is_signsgd_on_the_momentum_with_zero_residual():
    params, grads = _problem(replicas=1)
    lr, beta = 0.01, 0.9
    tx = demo.demo(lr, beta=beta, topk=64, chunk=8)  # 12 x 8 -> chunks 6 x 8 = 48 coefficients; vectors 8, 6
    _, updates, state = run_replicas(tx, params, grads)
    for t in range(3):  # the residual left by step t - 1 is zero, so the momentum is beta 0 + lr g_t
        for name in params:
            np.testing.assert_array_equal(updates[name][0, t], -lr * np.sign(lr * grads[name][0, t]))
    for name in params:
        np.testing.assert_allclose(state[0].delta[name][0], 0.0, atol=1e-7)  # delta = 0 after sending everything


def test_mean_over_pickers_on_a_hand_case():
    """Replica 0 sends coefficients {0: 1, 2: 4}, replica 1 sends {2: 2, 3: -6}; nobody sends 1."""
    idx = jnp.array([[[0, 2]], [[2, 3]]])
    values = jnp.array([[[1.0, 4.0]], [[2.0, -6.0]]])
    np.testing.assert_array_equal(demo.mean_over_pickers((1, 4), idx, values), [[1.0, 0.0, 3.0, -6.0]])


@pytest.mark.devices(2)
def test_two_replicas_match_a_numpy_transcription():
    params, grads = _problem()
    lr, beta, topk, chunk, wd = 0.01, 0.9, 5, 4, 0.1
    tx = demo.demo(lr, beta=beta, topk=topk, chunk=chunk, weight_decay=wd, axis_name=AXIS)
    trajectory, _, _ = run_replicas(tx, params, grads)
    chunks = {"w": (4, 4), "scale": (4,), "bias": (3,)}
    theta = {k: np.repeat(v[None].astype(np.float64), 2, 0) for k, v in params.items()}
    delta = {k: np.zeros_like(v) for k, v in theta.items()}
    for t in range(3):
        for name, c in chunks.items():
            sent = []
            for w in range(2):
                delta[name][w] = beta * delta[name][w] + lr * grads[name][w, t]
                coeffs = np.asarray(demo.encode(jnp.asarray(delta[name][w], jnp.float32), c), np.float64)
                keep = np.argsort(-np.abs(coeffs), axis=-1, kind="stable")[..., : min(topk, coeffs.shape[-1])]
                picked = np.zeros_like(coeffs)
                np.put_along_axis(picked, keep, np.take_along_axis(coeffs, keep, -1), -1)
                delta[name][w] -= np.asarray(demo.decode(jnp.asarray(picked, jnp.float32), c))
                sent.append((picked, np.abs(picked) > 0))
            total, count = sum(s[0] for s in sent), sum(s[1] for s in sent)
            step = np.sign(np.asarray(demo.decode(jnp.asarray(total / np.maximum(count, 1), jnp.float32), c)))
            decay = wd if name == "w" else 0.0  # by role: the stacked scale is a vector
            theta[name] = theta[name] - lr * (step + decay * theta[name])
            np.testing.assert_allclose(trajectory[name][:, t], theta[name], rtol=1e-5, atol=1e-6)


@pytest.mark.devices(4)
def test_identical_gradients_on_four_replicas_equal_one_replica_and_replicas_agree_bitwise():
    params, grads = _problem(replicas=1, steps=2)
    four = jax.tree.map(lambda g: np.repeat(g, 4, axis=0), grads)
    one, _, _ = run_replicas(demo.demo(0.01, topk=3, chunk=4, axis_name=AXIS), params, grads)
    many, _, _ = run_replicas(demo.demo(0.01, topk=3, chunk=4, axis_name=AXIS), params, four)
    for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(a, np.repeat(b, 4, axis=0))


@pytest.mark.devices(2)
def test_bf16_values_and_int16_indices_are_what_is_gathered():
    params, grads = _problem()
    tx = demo.demo(0.01, topk=3, chunk=4, value_dtype="bfloat16", index_dtype="int16", axis_name=AXIS)
    mesh = jax.make_mesh((2,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    state = jax.tree.map(lambda x: np.broadcast_to(x, (2, *np.shape(x))), tx.init(params))

    def step(g, s, p):
        u, s = tx.update(*jax.tree.map(lambda x: x[0], (g, s, p)))
        return jax.tree.map(lambda x: x[None], (u, s))

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)))
    per_replica = jax.tree.map(lambda x: np.broadcast_to(x, (2, *x.shape)), params)
    hlo = fn.lower(jax.tree.map(lambda g: g[:, 0], grads), state, per_replica).as_text()
    gathers = [line for line in hlo.splitlines() if "all_gather" in line]
    assert gathers and all(("bf16" in line) or ("i16" in line) for line in gathers)


@pytest.mark.devices(8)
def test_chunks_that_straddle_shards_are_refused():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": jax.ShapeDtypeStruct((4, 128, 384), jnp.float32)}
    shardings = {"w": jax.NamedSharding(mesh, jax.P(None, "fsdp", None))}
    with pytest.raises(ValueError, match="straddle shards of 16; set optimizer.demo.chunk to a divisor of 16"):
        demo.check_chunk_layout(params, shardings, 64)
    demo.check_chunk_layout(params, shardings, 16)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="int16"):
        demo.scale_by_demo(1e-3, chunk=256, index_dtype="int16")
    with pytest.raises(ValueError, match="beta"):
        demo.scale_by_demo(1e-3, beta=1.0)
    assert isinstance(demo.demo(1e-3), optax.GradientTransformation)
