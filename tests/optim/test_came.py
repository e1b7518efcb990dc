"""CAME: NumPy reference of arXiv:2307.02047 Algorithm 1 (as in yangluo7/CAME), convergence, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim import came
from sharding import partition

B1, B2, B3, EPS1, EPS2, D = 0.9, 0.999, 0.9999, 1e-30, 1e-16, 1.0


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "stack": rng.normal(size=(2, 6, 5)).astype(np.float32),  # two factored 6 x 5 matrices
        "mat": rng.normal(size=(4, 3)).astype(np.float32),  # factored
        "vec": rng.normal(size=(7,)).astype(np.float32),  # unfactored
    }


def _grads(seed, params):
    rng = np.random.default_rng(100 + seed)
    return {k: (rng.normal(size=v.shape) * rng.uniform(0.1, 3.0)).astype(np.float32) for k, v in params.items()}


def _reference_leaf(w, grads, lr, wd, b1=B1, b2=B2, b3=B3):
    """CAME on one tensor in float64, per matrix of the last two axes (the reference on each matrix)."""
    w = w.astype(np.float64)
    factored = w.ndim >= 2
    m = np.zeros_like(w)
    if factored:
        r = np.zeros(w.shape[:-1])
        c = np.zeros(w.shape[:-2] + w.shape[-1:])
        rr, cc = np.zeros_like(r), np.zeros_like(c)
    else:
        v = np.zeros_like(w)

    def approx(row, col):
        return 1 / np.sqrt(row / row.mean(-1, keepdims=True))[..., :, None] / np.sqrt(col)[..., None, :]

    def rms(x):
        return np.sqrt(np.mean(x**2, axis=(-2, -1), keepdims=True)) if x.ndim >= 2 else np.sqrt(np.mean(x**2))

    for g in grads:
        g = g.astype(np.float64)
        u = g**2 + EPS1
        if factored:
            r = b2 * r + (1 - b2) * u.mean(-1)
            c = b2 * c + (1 - b2) * u.mean(-2)
            u = approx(r, c) * g
        else:
            v = b2 * v + (1 - b2) * u
            u = g / np.sqrt(v)
        u = u / np.maximum(rms(u) / D, 1.0)
        m = b1 * m + (1 - b1) * u
        if factored:
            res = (u - m) ** 2 + EPS2
            rr = b3 * rr + (1 - b3) * res.mean(-1)
            cc = b3 * cc + (1 - b3) * res.mean(-2)
            step = approx(rr, cc) * m
        else:
            step = m
        decay = wd * w if w.ndim >= 2 else 0.0
        w = w - lr * (step + decay)
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
    grads_seq = [_grads(t, params) for t in range(6)]
    tx = came.came(1e-2, weight_decay=0.1, min_dim_size_to_factor=2)
    for n in (1, 2, 6):
        got, state = _run(tx, params, grads_seq[:n])
        for k in params:
            want_w, want_m = _reference_leaf(params[k], [g[k] for g in grads_seq[:n]], 1e-2, 0.1)
            np.testing.assert_allclose(got[k], want_w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state[0].mu[k], want_m, rtol=1e-4, atol=1e-6)


def test_state_layout_and_factoring_threshold():
    params = {"big": jnp.zeros((3, 128, 256)), "norms": jnp.zeros((3, 256)), "bias": jnp.zeros((256,))}
    state = jax.eval_shape(came.scale_by_came().init, params)
    assert state.mu["big"].shape == (3, 128, 256)
    assert (state.v_row["big"].shape, state.v_col["big"].shape) == ((3, 128, 1), (3, 1, 256))
    assert state.v["big"].shape == (1,)
    assert (state.res_row["big"].shape, state.res_col["big"].shape) == ((3, 128, 1), (3, 1, 256))
    # A stack of 3 vectors is not factored at the default min_dim_size_to_factor=128.
    for k in ("norms", "bias"):
        assert state.v[k].shape == params[k].shape and state.v_row[k].shape == (1,)


def test_update_rms_is_clipped_and_zero_gradient_is_finite():
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros((5,))}
    tx = came.scale_by_came(min_dim_size_to_factor=2)
    g = {"w": jnp.full((8, 8), 1e3).at[0, 0].set(1e6), "b": jnp.zeros((5,))}
    updates, state = jax.jit(tx.update)(g, tx.init(params))
    # First step: m = (1 - b1) U with RMS(U) <= d, and the confidence factor is finite.
    assert np.all(np.isfinite(updates["w"])) and np.all(updates["b"] == 0)
    assert float(jnp.sqrt(jnp.mean(state.mu["w"] ** 2))) <= (1 - B1) * D * (1 + 1e-5)


def test_converges_on_least_squares():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    y = a @ jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)

    def loss(p):
        return jnp.mean((a @ p["w"] - y) ** 2)

    tx = came.came(optax.cosine_decay_schedule(0.1, 400, alpha=1e-3), min_dim_size_to_factor=2)
    params = {"w": jnp.zeros((16, 8))}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    first = float(loss(params))
    for _ in range(400):
        params, state = step(params, state)
    assert float(loss(params)) < 1e-4 * first


@pytest.mark.devices(8)
def test_sharded_state_follows_params_and_matches_unsharded():
    rng = np.random.default_rng(4)
    params = {"w": rng.normal(size=(2, 16, 8)).astype(np.float32), "b": rng.normal(size=(16,)).astype(np.float32)}
    grads = _grads(0, params)
    tx = came.came(1e-2, min_dim_size_to_factor=2)
    want_updates, want_state = jax.jit(tx.update)(grads, tx.init(params), params)

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        shard = {"w": jax.NamedSharding(mesh, jax.P(None, "fsdp", None)), "b": jax.NamedSharding(mesh, jax.P("fsdp"))}
        sp, sg = jax.device_put(params, shard), jax.device_put(grads, shard)
        state_sh = partition.state_shardings(jax.eval_shape(tx.init, sp), sp, shard)
        state = jax.jit(tx.init, out_shardings=state_sh)(sp)
        updates, new_state = jax.jit(tx.update, out_shardings=(shard, state_sh))(sg, state, sp)
    s = new_state[0]
    assert s.mu["w"].sharding == shard["w"] and s.v["b"].sharding == shard["b"]
    assert s.v_row["w"].sharding.spec == jax.P(None, "fsdp", None)  # (2, 16, 1): rows stay sharded
    assert s.v_col["w"].sharding.spec == jax.P(None, None, "fsdp")  # (2, 1, 8): fsdp moves to the kept axis
    for k in params:
        np.testing.assert_allclose(updates[k], want_updates[k], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_rejects_integer_params():
    with pytest.raises(ValueError, match="floating-point"):
        came.came(1e-3).init({"ids": jnp.zeros((3, 4), jnp.int32)})
