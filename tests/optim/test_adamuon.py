"""AdaMuon (optim/adamuon.py): NumPy transcription of the paper and the authors' code, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from optim.adamuon import adamuon, scale_by_adamuon


def np_adamuon_direction(*, beta, beta2, eps, form, nesterov, sign, coeffs, scale, debias):
    """Si et al. (arXiv:2507.11005) Algorithm 1 / github.com/Chongjie-Si/AdaMuon, per (fan_in, fan_out) matrix:
    their code (gpt2 and Megatron, 369f0b3) takes the sign, decays V by beta2 = momentum, no bias correction;
    their first upload (3b84e03) orthogonalised D itself with a bias-corrected V."""
    mus, nus, steps = {}, {}, {}

    def direction(key, g, p):
        d, mus[key] = ref.momentum(g, mus.get(key, 0.0), beta, form, nesterov)
        o = ref.orthogonalize(np.sign(d) if sign else d, coeffs)
        nus[key] = beta2 * nus.get(key, 0.0) + (1 - beta2) * o * o
        steps[key] = t = steps.get(key, 0) + 1
        q = o / (np.sqrt(nus[key] / ((1 - beta2**t) if debias else 1.0)) + eps)
        out = np.empty_like(q)
        for i in np.ndindex(q.shape[:-2]):
            m = q[i]
            out[i] = np.sqrt(min(m.shape)) * m / (np.linalg.norm(m) + eps)
        return ref.shape_scale(p.shape, scale) * out

    return direction


CASES = [
    {},  # the defaults: the authors' code
    {
        "sign_stabilize": False,
        "momentum_form": "sum",
        "nesterov": False,
        "ns_coeffs": "polar_express",
        "shape_scale": "jordan",
        "beta2": 0.9,
        "debias": True,
    },
]
AUTHORS = {
    "sign_stabilize": True,
    "momentum_form": "ema",
    "nesterov": True,
    "ns_coeffs": "jordan",
    "shape_scale": "moonlight",
    "beta2": 0.95,
    "debias": False,
}


@pytest.mark.parametrize("case", CASES, ids=["defaults-authors-code", "first-upload-sum-polar_express-jordan"])
def test_matches_numpy_reference_step_by_step(case):
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.05, 0.01, 0.1
    rule = AUTHORS | case
    direction = np_adamuon_direction(
        beta=0.95,
        beta2=rule["beta2"],
        eps=1e-8,
        form=rule["momentum_form"],
        nesterov=rule["nesterov"],
        sign=rule["sign_stabilize"],
        coeffs=rule["ns_coeffs"],
        scale=rule["shape_scale"],
        debias=rule["debias"],
    )
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = adamuon(lr, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_update_has_rms_0_2_and_the_sign_changes_it():
    rng = np.random.default_rng(1)
    g = {"w": jnp.float32(rng.standard_normal((3, 16, 24)) * np.linspace(0.1, 3.0, 24))}
    updates = {}
    for sign in (True, False):
        tx = scale_by_adamuon(sign_stabilize=sign)
        update, state = jax.jit(tx.update)(g, tx.init(g))
        updates[sign] = np.asarray(update["w"], np.float64)
        assert state.nu["w"].shape == (3, 16, 24) and int(state.count) == 1
        rms = np.sqrt(np.mean(np.square(updates[sign]), axis=(1, 2)))
        np.testing.assert_allclose(rms, 0.2, rtol=1e-5)
    assert np.abs(updates[True] - updates[False]).max() > 1e-2


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(adamuon(0.05)) < 0.05
