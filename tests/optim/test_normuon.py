"""NorMuon (optim/normuon.py): NumPy reference, per-neuron normalisation, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from optim.normuon import normuon, scale_by_normuon


def np_normuon_direction(*, beta, beta2, eps, form, nesterov, coeffs, steps, scale):
    """Li et al. (arXiv:2510.05491) / reference normuon_update, on (*batch, fan_in, fan_out) leaves."""
    mus, nus = {}, {}

    def direction(key, g, p):
        d, mus[key] = ref.momentum(g, mus.get(key, 0.0), beta, form, nesterov)
        o = ref.orthogonalize(d, coeffs, steps)
        nus[key] = beta2 * nus.get(key, 0.0) + (1 - beta2) * np.mean(o * o, axis=-2, keepdims=True)
        q = o / (np.sqrt(nus[key]) + eps)
        o_norm = np.linalg.norm(o, axis=(-2, -1), keepdims=True)
        q = q * o_norm / (np.linalg.norm(q, axis=(-2, -1), keepdims=True) + eps)
        return ref.shape_scale(p.shape, scale) * q

    return direction


CASES = [
    dict(momentum_form="ema", nesterov=True, ns_coeffs="jordan", shape_scale="moonlight", beta2=0.95),
    dict(momentum_form="sum", nesterov=False, ns_coeffs="polar_express", shape_scale="jordan", beta2=0.8),
]


@pytest.mark.parametrize("case", CASES, ids=["defaults", "sum-polar_express-jordan"])
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    direction = np_normuon_direction(
        beta=0.9,
        beta2=case["beta2"],
        eps=1e-10,
        form=case["momentum_form"],
        nesterov=case["nesterov"],
        coeffs=case["ns_coeffs"],
        steps=0,
        scale=case["shape_scale"],
    )
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = normuon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_second_moment_is_one_vector_per_matrix_and_equalises_neurons():
    rng = np.random.default_rng(1)
    w = jnp.float32(rng.standard_normal((3, 16, 24)))  # (layers, fan_in, fan_out)
    g = jnp.float32(rng.standard_normal((3, 16, 24)) * np.linspace(0.1, 3.0, 24))  # unequal neurons
    tx = scale_by_normuon(beta2=0.0, shape_scale="jordan")
    state = tx.init({"w": w})
    assert state.nu["w"].shape == (3, 1, 24)
    update, state = jax.jit(tx.update)({"w": g}, state)
    update = np.asarray(update["w"], np.float64)
    # beta2 = 0: every output neuron (column) gets the same norm; the Frobenius norm is Newton-Schulz's.
    col_norms = np.linalg.norm(update, axis=1)
    np.testing.assert_allclose(col_norms, col_norms[:, :1] * np.ones_like(col_norms), rtol=1e-4)
    ortho = ref.orthogonalize(np.asarray(g, np.float64))  # the first Nesterov-EMA direction is a multiple of g
    np.testing.assert_allclose(
        np.linalg.norm(update, axis=(1, 2)), np.sqrt(1.5) * np.linalg.norm(ortho, axis=(1, 2)), rtol=1e-4
    )


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(normuon(0.1)) < 0.05
