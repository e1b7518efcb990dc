"""MuonH / AdamH (optim/hyperball.py): NumPy transcription of levanter's rules, the sphere, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim.hyperball import adam_hyperball, muon_hyperball


def np_project(w, u, lr):
    """levanter's AdamH ``_adamh_projected_update`` map, per matrix, in its closed form, with the
    radius its MuonH takes: the current norm."""
    r = np.linalg.norm(w)
    u_norm = max(np.linalg.norm(u), 1e-10)
    sq = np.sum(w * w) - 2 * lr * r * np.sum(w * u) / u_norm + lr**2 * r**2
    ratio = r / np.sqrt(max(sq, 1e-10))
    return w * ratio - u * lr * r * ratio / u_norm


def np_hyperball(params, grads_seq, base, *, lr, adam_lr, wd):
    """Hyperball on hidden matrices, AdamW elsewhere (ref.AdamW)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    values = [leaf for _, leaf in flat]
    adam = ref.AdamW()
    history = []
    for grads in grads_seq:
        new = []
        for i, ((path, _), p, g) in enumerate(zip(flat, values, jax.tree.leaves(grads), strict=True)):
            if ref.is_matrix(path, p):
                u = base(i, g)
                out = np.empty_like(p)
                for j in np.ndindex(p.shape[:-2]):
                    out[j] = np_project(p[j], u[j], lr)
                new.append(out)
            else:
                new.append(p + adam.update(i, g, p, adam_lr, wd if ref.is_decayed(path, p) else 0.0))
        values = new
        history.append(treedef.unflatten(values))
    return history


def np_muon_base(beta):
    mus = {}

    def base(key, g):
        d, mus[key] = ref.momentum(g, mus.get(key, 0.0), beta, "ema", True)
        return ref.orthogonalize(d)

    return base


def np_adam_base(b1, b2, eps):
    m, v, t = {}, {}, {}

    def base(key, g):
        m[key] = b1 * m.get(key, 0.0) + (1 - b1) * g
        v[key] = b2 * v.get(key, 0.0) + (1 - b2) * g * g
        t[key] = t.get(key, 0) + 1
        return (m[key] / (1 - b1 ** t[key])) / (np.sqrt(v[key] / (1 - b2 ** t[key])) + eps)

    return base


@pytest.mark.parametrize("family", ["muon", "adam"])
def test_matches_numpy_reference_step_by_step(family):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    if family == "muon":
        base = np_muon_base(0.9)
        tx = muon_hyperball(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, ns_batching="none")
    else:
        base = np_adam_base(0.9, 0.95, 1e-8)
        tx = adam_hyperball(lr, weight_decay=wd, adam_lr_ratio=adam_lr / lr)
    expected = np_hyperball(params, grads_seq, base, lr=lr, adam_lr=adam_lr, wd=wd)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


@pytest.mark.parametrize("make", [muon_hyperball, adam_hyperball], ids=["muon", "adam"])
def test_matrices_stay_on_their_initial_sphere_and_move_by_the_relative_step(make):
    rng = np.random.default_rng(2)
    w0 = jnp.float32(rng.standard_normal((3, 16, 24)))
    params = {"blocks": {"kernel": w0}}
    tx = make(0.1)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for _ in range(5):
        g = {"blocks": {"kernel": jnp.float32(rng.standard_normal((3, 16, 24)))}}
        u, state = step(g, state, params)
        new = optax.apply_updates(params, u)
        before, after = (np.linalg.norm(np.asarray(x["blocks"]["kernel"]), axis=(1, 2)) for x in (params, new))
        np.testing.assert_allclose(after, np.linalg.norm(np.asarray(w0), axis=(1, 2)), rtol=1e-5)
        # the step moves W by the angle atan(lr sin phi / (1 - lr cos phi)) <= asin(lr) on its sphere;
        # random gradients are nearly orthogonal to W (phi ~ 90 degrees): an angle of ~ atan(lr)
        moved = np.linalg.norm(np.asarray(u["blocks"]["kernel"]), axis=(1, 2))
        assert np.all(moved <= 2 * np.sin(np.arcsin(0.1) / 2) * before * (1 + 1e-5))
        assert np.all(moved > 0.09 * before)
        params = new


def test_converges_on_matrix_regression():
    """A fixed-norm W cannot fit arbitrary targets, so the regression starts from ||W_true||'s sphere."""
    rng = np.random.default_rng(0)
    x = jnp.float32(rng.standard_normal((64, 16)))
    w_true = jnp.float32(rng.standard_normal((16, 24)) / 4)
    y = x @ w_true
    w0 = jnp.float32(rng.standard_normal((16, 24)))
    params = {"w": w0 * jnp.linalg.norm(w_true) / jnp.linalg.norm(w0)}

    def loss(p):
        return jnp.mean(jnp.square(x @ p["w"] - y))

    for make in (muon_hyperball, adam_hyperball):
        tx = make(optax.cosine_decay_schedule(0.2, 60))
        p, state = params, tx.init(params)
        for _ in range(60):
            u, state = tx.update(jax.grad(loss)(p), state, p)
            p = optax.apply_updates(p, u)
        assert float(loss(p)) < 0.05 * float(loss(params)), make
