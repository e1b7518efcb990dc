"""Cautious wrapper: NumPy C-AdamW / C-Lion (arXiv:2411.16085), sign conventions, registry, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import default
from optim import adamw, build, cautious, labels, lion
from sharding import partition


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(2, 4, 6)).astype(np.float32), "b": rng.normal(size=(6,)).astype(np.float32)}


def _grads(seed, params):
    rng = np.random.default_rng(100 + seed)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}


def _run(tx, params, grads_seq):
    state = tx.init(params)
    step = jax.jit(tx.update)
    for grads in grads_seq:
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _mask(u, g):
    """The paper's mask on a direction u (p <- p - lr u): phi = 1[u g > 0], rescaled by n / (sum(phi) + 1)."""
    phi = (u * g > 0).astype(np.float64)
    return phi * phi.size / (phi.sum() + 1)


def _reference_c_adamw(params, grads_seq, lr, b1, b2, eps, wd):
    w = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    for t, grads in enumerate(grads_seq, start=1):
        for k in w:
            g = grads[k].astype(np.float64)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g**2
            u = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            decay = wd * w[k] if w[k].ndim >= 2 else 0.0
            w[k] = w[k] - lr * (u * _mask(u, g) + decay)
    return w


def _reference_c_lion(params, grads_seq, lr, b1, b2, wd):
    w = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    for grads in grads_seq:
        for k in w:
            g = grads[k].astype(np.float64)
            u = np.sign(b1 * m[k] + (1 - b1) * g)
            decay = wd * w[k] if w[k].ndim >= 2 else 0.0
            w[k] = w[k] - lr * (u * _mask(u, g) + decay)
            m[k] = b2 * m[k] + (1 - b2) * g
    return w


def test_c_adamw_matches_numpy_reference():
    params = _params()
    grads_seq = [_grads(t, params) for t in range(5)]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    tx = optax.chain(
        cautious.cautious(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), descent=False),
        optax.add_decayed_weights(wd, mask=labels.decay_mask),
        optax.scale_by_learning_rate(lr),
    )
    got = _run(tx, params, grads_seq)
    want = _reference_c_adamw(params, grads_seq, lr, b1, b2, eps, wd)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_c_lion_matches_numpy_reference():
    params = _params(1)
    grads_seq = [_grads(t, params) for t in range(5)]
    tx = optax.chain(
        cautious.cautious(lion.scale_by_lion(b1=0.9, b2=0.99), descent=False),
        optax.add_decayed_weights(0.5, mask=labels.decay_mask),
        optax.scale_by_learning_rate(3e-3),
    )
    got = _run(tx, params, grads_seq)
    want = _reference_c_lion(params, grads_seq, 3e-3, 0.9, 0.99, 0.5)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)


def test_descent_convention_on_a_full_optimizer_equals_direction_convention():
    params = _params(2)
    grads_seq = [_grads(t, params) for t in range(4)]
    full = cautious.cautious(optax.adamw(1e-2, weight_decay=0.0))
    direction = optax.chain(cautious.cautious(optax.scale_by_adam(), descent=False), optax.scale_by_learning_rate(1e-2))
    a, b = _run(full, params, grads_seq), _run(direction, params, grads_seq)
    for k in params:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7)


def _fixed(update):
    """A stateless transform that always proposes ``update``."""
    return optax.GradientTransformation(lambda p: optax.EmptyState(), lambda g, s, p=None: (update, s))


def test_mask_count_rescaling_and_gradient_scale_invariance():
    u = jnp.asarray([[-1.0, 2.0, -3.0, 4.0], [0.5, -0.5, 1.5, -2.5]])
    g = jnp.asarray([[1.0, 1.0, 1.0, -1.0], [-1.0, -1.0, 0.0, 1.0]])
    tx = cautious.cautious(_fixed(u))  # descent: keep entries of sign -g
    out, _ = tx.update(g, tx.init(g))
    keep = np.array([[1, 0, 1, 1], [1, 0, 0, 1]], np.float32)  # g = 0 never agrees
    np.testing.assert_allclose(out, np.asarray(u) * keep * 8 / (keep.sum() + 1.0), rtol=1e-6)
    # A global-norm clip multiplies g by one positive factor: the mask does not change.
    scaled, _ = tx.update(1e-3 * g, tx.init(g))
    np.testing.assert_array_equal(out, scaled)
    # Every entry disagreeing: a zero update, never NaN.
    none, _ = cautious.cautious(_fixed({"a": jnp.ones(5)})).update({"a": jnp.ones(5)}, optax.EmptyState())
    np.testing.assert_array_equal(none["a"], 0.0)


def test_c_muon_keeps_only_descent_entries():
    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)}
    grads = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(8, 8)), jnp.float32)}
    tx = cautious.cautious(optax.contrib.muon(1e-2))
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    u, g = np.asarray(updates["w"]), np.asarray(grads["w"])
    assert np.all(u * g <= 0) and 0 < np.count_nonzero(u) < u.size


def test_registry_option_wraps_every_optimizer_inside_the_clip():
    config = default.get_config().optimizer
    config.cautious = True
    params = _params(3)
    grads = _grads(0, params)
    for name in ("adamw", "sgd", "lion", "came", "muon"):
        config.name = name
        tx = build.build(config, 100)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        for k in params:
            assert np.all(np.asarray(updates[k]) * grads[k] <= 0), name
    config.name = "adamw"
    want_tx = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        cautious.cautious(adamw.adamw(build.learning_rate_fn(config, 100))),
    )
    got = _run(build.build(config, 100), params, [grads])
    want = _run(want_tx, params, [grads])
    for k in params:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.devices(8)
def test_sharded_matches_unsharded():
    params = {"w": np.random.default_rng(5).normal(size=(4, 16, 8)).astype(np.float32), "b": np.ones(16, np.float32)}
    grads = _grads(1, params)
    tx = cautious.cautious(adamw.adamw(1e-2))
    want_updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        shard = {"w": jax.NamedSharding(mesh, jax.P(None, "fsdp", None)), "b": jax.NamedSharding(mesh, jax.P("fsdp"))}
        sp, sg = jax.device_put(params, shard), jax.device_put(grads, shard)
        state_sh = partition.state_shardings(jax.eval_shape(tx.init, sp), sp, shard)
        state = jax.jit(tx.init, out_shardings=state_sh)(sp)
        updates, new_state = jax.jit(tx.update, out_shardings=(shard, state_sh))(sg, state, sp)
    assert new_state[0].mu["w"].sharding == shard["w"]
    for k in params:
        np.testing.assert_allclose(updates[k], want_updates[k], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("descent", [True, False])
def test_passes_extra_args_through(descent):
    tx = cautious.cautious(optax.adam(1e-2), descent=descent)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    params = {"w": jnp.ones(3)}
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params, loss=jnp.float32(1.0))
    assert np.all(np.isfinite(updates["w"]))
