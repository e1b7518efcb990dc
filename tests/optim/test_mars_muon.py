"""MARS-M (optim/mars_muon.py): NumPy reference, clipping, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from optim.mars_muon import mars_muon, scale_by_mars_muon
from optim.muon import muon


def np_mars_direction(*, beta, gamma, clip, form, nesterov, coeffs, scale):
    """Liu, Yuan & Gu (arXiv:2510.21800), MARS-M-approx, per matrix of (*batch, fan_in, fan_out)."""
    mus, prev = {}, {}

    def direction(key, g, p):
        c = g + gamma * beta / (1 - beta) * (g - prev.get(key, 0.0))
        prev[key] = g
        if clip:
            c = c / np.maximum(np.linalg.norm(c, axis=(-2, -1), keepdims=True), 1.0)
        d, mus[key] = ref.momentum(c, mus.get(key, 0.0), beta, form, nesterov)
        return ref.shape_scale(p.shape, scale) * ref.orthogonalize(d, coeffs)

    return direction


CASES = [  # gradients of scale 1 have matrix norms ~10: clipping active in the first case
    dict(gamma=0.025, clip_c=True, momentum_form="ema", nesterov=False, ns_coeffs="jordan", shape_scale="moonlight"),
    dict(gamma=0.1, clip_c=False, momentum_form="sum", nesterov=True, ns_coeffs="turbo", shape_scale="jordan"),
]


@pytest.mark.parametrize("case", CASES, ids=["defaults", "noclip-sum-nesterov-turbo"])
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    direction = np_mars_direction(
        beta=0.9,
        gamma=case["gamma"],
        clip=case["clip_c"],
        form=case["momentum_form"],
        nesterov=case["nesterov"],
        coeffs=case["ns_coeffs"],
        scale=case["shape_scale"],
    )
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = mars_muon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_without_correction_or_clipping_it_is_muon():
    params = ref.f32(ref.model_tree(1, scale=0.1))
    grads_seq = ref.grads_sequence(params, n=3, scale=0.01)
    mars = mars_muon(0.02, gamma=0.0, clip_c=False)
    plain = muon(0.02, nesterov=False)
    ref.assert_trees_close(ref.run_jax(mars, params, grads_seq), ref.run_jax(plain, params, grads_seq), rtol=1e-6)


def test_state_keeps_the_previous_gradient():
    params = {"w": jnp.ones((2, 8, 12))}
    tx = scale_by_mars_muon()
    g = {"w": jnp.full((2, 8, 12), 0.5)}
    _, state = tx.update(g, tx.init(params))
    np.testing.assert_array_equal(state.prev_grad["w"], g["w"])


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(mars_muon(0.1)) < 0.05
