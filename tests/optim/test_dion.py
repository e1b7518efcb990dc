"""Dion (optim/dion.py): NumPy transcription of microsoft/dion's ``dion_update``, low rank, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import optax
import pytest

from optim.dion import dion, scale_by_dion


def np_dion_direction(q0, *, mu, eps, transpose_wide):
    """``dion_update`` on X = W^T per matrix, or on X^T where X is wide (fan_out < fan_in) and
    ``transpose_wide`` (microsoft/dion's ``Dion``: ``is_transposed = m < n``, the update ``(P Q^T)^T``,
    ``scaled_lr = sqrt(fan_out / fan_in)`` of X); ``q0[key]`` is the initial Q (from the JAX state)."""
    ms, qs = {}, {k: np.asarray(v, np.float64) for k, v in q0.items()}

    def direction(key, g, p):
        m = ms.get(key, np.zeros_like(g))
        out, new_m, new_q = np.empty_like(g), np.empty_like(g), np.empty_like(qs[key])
        for i in np.ndindex(g.shape[:-2]):
            x_m = m[i].T + g[i].T  # (fan_out, fan_in)
            fan_out, fan_in = x_m.shape
            flip = transpose_wide and fan_out < fan_in
            x_m = x_m.T if flip else x_m
            p_, _ = np.linalg.qr(x_m @ qs[key][i])
            r = x_m.T @ p_
            x_m = x_m - (1 - mu) * p_ @ r.T
            new_q[i] = r / (np.linalg.norm(r, axis=0, keepdims=True) + eps)
            step = p_ @ new_q[i].T
            new_m[i], step = (x_m, step.T) if flip else (x_m.T, step)
            out[i] = (np.sqrt(fan_out / fan_in) * step).T
        ms[key], qs[key] = new_m, new_q
        return out

    return direction


@pytest.mark.parametrize("rank_fraction, transpose_wide", [(1.0, True), (0.5, True), (0.5, False)])
def test_matches_numpy_reference_step_by_step(rank_fraction, transpose_wide):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.02, 0.01, 0.1
    tx = dion(
        lr, mu=0.9, rank_fraction=rank_fraction, transpose_wide=transpose_wide, weight_decay=wd, adam_lr_ratio=adam_lr / lr
    )
    state = tx.init(jax.tree.map(jnp.float32, params))
    q_tree = state.inner_states["matrix"].inner_state[0].q
    per_leaf = jax.tree.structure(params).flatten_up_to(q_tree)  # a MaskedNode on the AdamW leaves
    q0 = {i: q for i, q in enumerate(per_leaf) if not isinstance(q, optax.MaskedNode)}
    assert len(q0) == 6  # the six stacked kernels
    assert any(p.ndim == 3 and p.shape[-1] < p.shape[-2] for p in jax.tree.leaves(params))  # a wide X = W^T
    direction = np_dion_direction(q0, mu=0.9, eps=1e-8, transpose_wide=transpose_wide)
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_rank_is_a_fraction_of_the_width_and_full_rank_is_orthonormal():
    rng = np.random.default_rng(5)
    params = {"w": jnp.zeros((2, 32, 48))}
    low = scale_by_dion(rank_fraction=0.25)
    assert low.init(params).q["w"].shape == (2, 32, 8)
    g = {"w": jnp.float32(rng.standard_normal((2, 32, 48)))}
    full = scale_by_dion(mu=0.0, rank_fraction=1.0)
    update, _ = jax.jit(full.update)(g, full.init(params))
    u = np.asarray(update["w"], np.float64) / np.sqrt(48 / 32)  # Q P^T: (fan_in, fan_out), rank 32
    # full rank, one step: P spans B's column space, so Q P^T = B^T P P^T normalised column-wise
    singular = np.linalg.svd(u, compute_uv=False)
    assert singular.shape == (2, 32) and np.all(singular > 0.05)
    update_low, _ = jax.jit(low.update)(g, low.init(params))
    assert np.linalg.matrix_rank(np.asarray(update_low["w"][0], np.float64), tol=1e-4) == 8


def test_error_feedback_keeps_what_the_low_rank_step_missed():
    """mu = 0 with full rank leaves M = B - P P^T B = 0; a low rank leaves the residual."""
    rng = np.random.default_rng(6)
    params = {"w": jnp.zeros((16, 24))}
    g = {"w": jnp.float32(rng.standard_normal((16, 24)))}
    for fraction, expect_zero in ((1.0, True), (0.25, False)):
        tx = scale_by_dion(mu=0.0, rank_fraction=fraction)
        _, state = tx.update(g, tx.init(params))
        residual = float(jnp.linalg.norm(state.mu["w"])) / float(jnp.linalg.norm(g["w"]))
        assert (residual < 1e-5) == expect_zero, (fraction, residual)


def test_converges_on_matrix_regression():
    """Half rank: the error feedback brings the other half in over later steps (full rank: 60 steps)."""
    assert ref.regression_loss_ratio(dion(0.05, rank_fraction=1.0)) < 0.05
    assert ref.regression_loss_ratio(dion(0.05, rank_fraction=0.5), steps=150) < 0.05


@pytest.mark.devices(8)
@pytest.mark.parametrize("split", ["fan_in", "fan_out"])
def test_fsdp_power_iteration_moves_only_r_wide_factors_and_matches_one_device(split):
    """Weights, momentum and Q laid out as training lays them (either side of the weight split over 8
    devices): no collective carries more than an r-wide factor (GSPMD alone all-reduced and gathered
    whole matrices with fan-out split), and the steps equal the single-device ones."""
    from experiments import hlo_bytes
    from sharding import partition

    rng = np.random.default_rng(7)
    layers, fan_in, fan_out, r = 2, 64, 96, 16
    tx = scale_by_dion(rank_fraction=0.25)
    params = {"w": jnp.float32(rng.standard_normal((layers, fan_in, fan_out)))}
    grads = [{"w": jnp.float32(rng.standard_normal((layers, fan_in, fan_out)))} for _ in range(2)]

    def step(p, g, s):
        u, s = tx.update(g, s)
        return jax.tree.map(jnp.add, p, u), s

    expected = [(params, tx.init(params))]
    for g in grads:
        expected.append(jax.jit(step)(*expected[-1][:1], g, expected[-1][1]))
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        shard = {"w": jax.NamedSharding(mesh, jax.P(None, "fsdp", None) if split == "fan_in" else jax.P(None, None, "fsdp"))}
        s_shard = partition.state_shardings(jax.eval_shape(tx.init, params), params, shard, mesh)
        sharded = jax.jit(step, out_shardings=(shard, s_shard))
        p, s = jax.device_put(params, shard), jax.jit(tx.init, out_shardings=s_shard)(params)
        hlo = sharded.lower(p, jax.device_put(grads[0], shard), s).compile().as_text()
        for g, want in zip(grads, expected[1:], strict=True):
            p, s = sharded(p, jax.device_put(g, shard), s)
            ref.assert_trees_close((p, s), want)
    found = hlo_bytes.collectives(hlo, 8)
    widest = max(c.payload for c in found)  # an all-gather's payload is its gathered result
    assert widest <= layers * max(fan_in, fan_out) * r * 4 + layers * r * 4, (widest, found)
