"""DiLoCo and Streaming DiLoCo: hand-computed two-replica oracles and their special cases."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import cross_replica, diloco
from tests.optim.replica_harness import AXIS, run_replicas


def _quadratic_grad(params, target):
    """Replica loss 0.5 (w - a)^2 on a scalar w: gradient w - a."""
    return {"w": params["w"] - target}


@pytest.mark.devices(2)
def test_two_replica_linear_model_matches_hand_computation():
    """Inner SGD lr 0.5, H = 2, the paper's outer Nesterov (0.7, 0.9); targets a = 1 and a = 3, w0 = 0.

    Round 1: replica 1 goes 0 -> 0.5 -> 0.75, replica 2 goes 0 -> 1.5 -> 2.25.
      Delta = mean(0 - 0.75, 0 - 2.25) = -1.5;  m = -1.5;  theta = 0 - 0.7 (-1.5 + 0.9 * -1.5) = 1.995.
    Round 2 (both from 1.995): 1.995 -> 1.4975 -> 1.24875 and 1.995 -> 2.4975 -> 2.74875.
      Delta = mean(0.74625, -0.75375) = -0.00375;  m = 0.9 * -1.5 - 0.00375 = -1.35375;
      theta = 1.995 - 0.7 (-0.00375 + 0.9 * -1.35375) = 2.8504875.
    """
    tx = diloco.diloco(optax.sgd(0.5), sync_every=2, axis_name=AXIS)
    targets = np.array([[1.0] * 4, [3.0] * 4], np.float32)
    trajectory, _, state = run_replicas(tx, {"w": jnp.float32(0.0)}, targets, _quadratic_grad)
    w = trajectory["w"]  # (replica, step)
    np.testing.assert_allclose(w[:, 0], [0.5, 1.5], rtol=1e-6)
    np.testing.assert_allclose(w[:, 1], [1.995, 1.995], rtol=1e-6)  # post-sync: both replicas at theta
    np.testing.assert_allclose(w[:, 2], [1.4975, 2.4975], rtol=1e-6)
    np.testing.assert_allclose(w[:, 3], [2.8504875, 2.8504875], rtol=1e-6)
    losses = 0.5 * (w - targets) ** 2
    np.testing.assert_allclose(losses[:, 1], [0.4950125, 0.5050125], rtol=1e-5)
    np.testing.assert_allclose(losses[:, 3], [1.7121520, 0.0111770], rtol=1e-5)
    np.testing.assert_allclose(state.outer_momentum["w"], [-1.35375, -1.35375], rtol=1e-6)
    np.testing.assert_array_equal(state.count, [4, 4])


@pytest.mark.devices(2)
@pytest.mark.parametrize("streaming", [False, True], ids=["diloco", "streaming_p1"])
def test_warm_start_is_data_parallel_then_rounds_from_its_end(streaming):
    """W = 2 data-parallel steps, then H = 2 (inner SGD lr 0.5, outer Nesterov 0.7 / 0.9, a = 1 and 3, w0 = 0).

    Steps 1-2 take the mean gradient: 0 -> 1.0 (mean(-1, -3) = -2) -> 1.5 (mean(0, -2) = -1); theta = 1.5.
    Steps 3-4 are local: 1.5 -> 1.25 -> 1.125 and 1.5 -> 2.25 -> 2.625.
      Delta = mean(0.375, -1.125) = -0.375;  m = -0.375;  theta = 1.5 - 0.7 (-0.375 + 0.9 * -0.375) = 1.99875.
    Streaming with P = 1, tau = 0, alpha = 0 takes the same steps.
    """
    if streaming:
        tx = diloco.streaming_diloco(
            optax.sgd(0.5), sync_every=2, fragments=1, overlap=0, mixing=0.0, exchange="float32", warm_start_steps=2, axis_name=AXIS
        )
    else:
        tx = diloco.diloco(optax.sgd(0.5), sync_every=2, warm_start_steps=2, axis_name=AXIS)
    targets = np.array([[1.0] * 4, [3.0] * 4], np.float32)
    trajectory, _, state = run_replicas(tx, {"w": jnp.float32(0.0)}, targets, _quadratic_grad)
    np.testing.assert_allclose(trajectory["w"], [[1.0, 1.5, 1.25, 1.99875], [1.0, 1.5, 2.25, 1.99875]], rtol=1e-6)
    np.testing.assert_allclose(state.outer_momentum["w"], [-0.375, -0.375], rtol=1e-6)
    with pytest.raises(ValueError, match="warm_start_steps=-1 must be >= 0"):
        diloco.diloco(optax.sgd(0.5), warm_start_steps=-1)


def _random_problem(seed=0, replicas=2, steps=6):
    rng = np.random.default_rng(seed)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = jax.tree.map(lambda p: rng.normal(size=(replicas, steps, *p.shape)).astype(np.float32), params)
    return params, grads


def test_one_replica_h1_outer_lr1_momentum0_is_the_inner_optimizer():
    params, grads = _random_problem(replicas=1)
    tx = diloco.diloco(optax.adamw(1e-2), sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0)
    inner = optax.adamw(1e-2)
    p, s, q, t = params, tx.init(params), params, inner.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for k in range(grads["a"].shape[1]):
        g = jax.tree.map(lambda x: x[0, k], grads)
        u, s = step(p, s, g)
        p = optax.apply_updates(p, u)
        v, t = inner.update(g, t, q)
        q = optax.apply_updates(q, v)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.devices(2)
def test_outer_lr1_momentum0_is_parameter_averaging_every_h_steps():
    params, grads = _random_problem()
    h, inner = 3, optax.adam(0.05)
    tx = diloco.diloco(inner, sync_every=h, outer_learning_rate=1.0, outer_momentum=0.0, axis_name=AXIS)
    trajectory, _, _ = run_replicas(tx, params, grads)
    # Reference: each replica alone with its own inner state, parameters averaged every h steps.
    ps, states = [params, params], [inner.init(params), inner.init(params)]
    for k in range(grads["a"].shape[1]):
        for w in range(2):
            u, states[w] = inner.update(jax.tree.map(lambda x: x[w, k], grads), states[w], ps[w])
            ps[w] = optax.apply_updates(ps[w], u)
        if (k + 1) % h == 0:
            ps = [jax.tree.map(lambda a, b: (a + b) / 2, *ps)] * 2
        for w in range(2):
            for name in params:
                np.testing.assert_allclose(trajectory[name][w, k], ps[w][name], rtol=1e-5, atol=1e-6)


@pytest.mark.devices(2)
def test_streaming_with_one_fragment_no_overlap_no_mixing_is_diloco():
    params, grads = _random_problem(steps=4)
    kwargs = dict(sync_every=2, outer_learning_rate=0.7, outer_momentum=0.9, axis_name=AXIS)
    want, _, _ = run_replicas(diloco.diloco(optax.adam(0.05), **kwargs), params, grads)
    tx = diloco.streaming_diloco(optax.adam(0.05), fragments=1, overlap=0, mixing=0.0, exchange="float32", **kwargs)
    got, _, _ = run_replicas(tx, params, grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _streaming_reference(w0, grads, lr, h, fragments, overlap, mixing, eta, mu):
    """NumPy Algorithm 2 of arXiv:2501.18512 on stacked layers ``(L, d)``, inner SGD, per replica."""
    replicas, steps, layers = grads.shape[:3]
    local = np.repeat(w0[None].astype(np.float64), replicas, 0)
    theta, m, pending = w0.astype(np.float64), np.zeros_like(w0, np.float64), np.zeros_like(w0, np.float64)
    offsets = [p * h // fragments for p in range(fragments)]
    out = []
    for t in range(1, steps + 1):
        local = local - lr * grads[:, t - 1]
        for p in range(fragments):
            rows = np.arange(p, layers, fragments)
            if t >= offsets[p] and (t - offsets[p]) % h == 0 and t > 0:
                pending[rows] = np.mean(theta[rows] - local[:, rows], axis=0)
            if t - overlap >= offsets[p] and (t - overlap - offsets[p]) % h == 0 and t - overlap > 0:
                m[rows] = mu * m[rows] + pending[rows]
                theta[rows] = theta[rows] - eta * (pending[rows] + mu * m[rows])
                local[:, rows] = mixing * local[:, rows] + (1 - mixing) * theta[rows]
        out.append(local.copy())
    return np.stack(out, axis=1)


@pytest.mark.devices(2)
def test_streaming_fragments_overlap_and_mixing_match_numpy_algorithm():
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = rng.normal(size=(2, 9, 4, 3)).astype(np.float32)
    cfg = dict(h=4, fragments=2, overlap=1, mixing=0.5, eta=0.7, mu=0.9)
    tx = diloco.streaming_diloco(
        optax.sgd(0.1), sync_every=cfg["h"], fragments=cfg["fragments"], overlap=cfg["overlap"], mixing=cfg["mixing"],
        outer_learning_rate=cfg["eta"], outer_momentum=cfg["mu"], exchange="float32", axis_name=AXIS,
    )  # fmt: skip
    trajectory, _, _ = run_replicas(tx, {"blocks": w0}, {"blocks": grads})
    want = _streaming_reference(w0, grads, 0.1, **cfg)
    np.testing.assert_allclose(trajectory["blocks"], want, rtol=1e-5, atol=1e-6)
    # Schedule: fragment 1 (layers 1, 3) is sent at step 2 and received at step 3 with mixing 0.5, which
    # halves the gap between the replicas; fragment 0 (layers 0, 2) is not touched until step 5.
    gap = trajectory["blocks"][0] - trajectory["blocks"][1]  # (step, layer, d)
    drift = 0.1 * (grads[1, 2] - grads[0, 2])  # what step 3's inner SGD adds to the gap
    np.testing.assert_allclose(gap[2, 1::2], 0.5 * (gap[1, 1::2] + drift[1::2]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gap[2, 0::2], gap[1, 0::2] + drift[0::2], rtol=1e-5, atol=1e-6)


@pytest.mark.devices(4)
@pytest.mark.parametrize("exchange, tol", [("float32", 1e-6), ("bfloat16", 1e-2), ("int8", 3e-2), ("int4", 0.3)])
def test_quantized_mean_is_the_fp32_mean_up_to_its_precision(exchange, tol):
    x = np.random.default_rng(0).normal(size=(4, 1, 700)).astype(np.float32)  # not a multiple of the chunking
    mesh = jax.make_mesh((4,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    fn = jax.shard_map(
        lambda v: cross_replica.quantized_mean(v[0, 0], AXIS, exchange)[None, None], mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)
    )
    got = np.asarray(jax.jit(fn)(x))[:, 0]
    want = x[:, 0].mean(0)
    assert np.all(got == got[:1])  # every replica decodes the same mean
    np.testing.assert_allclose(got[0], want, atol=tol * np.abs(want).max())
    assert np.abs(got[0] - want).max() > 0 or exchange == "float32"
