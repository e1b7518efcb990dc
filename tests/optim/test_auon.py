"""AuON (optim/auon.py): NumPy transcription of the paper, the bound's properties, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np

from optim.auon import auon, cosh_rms_bound
from optim.newton_schulz import MatrixAxes


def np_auon_direction(*, beta, gamma, form, nesterov, scale):
    """Maity (arXiv:2509.24320), Section 3.1, per matrix of a (*batch, fan_in, fan_out) leaf:
    X = D / (||D||_F + 1e-7), r = sqrt(mean(cosh(gamma X)^2)), U = X / (r + 1e-8)."""
    mus = {}

    def direction(key, g, p):
        d, mus[key] = ref.momentum(g, mus.get(key, 0.0), beta, form, nesterov)
        x = d / (np.linalg.norm(d, axis=(-2, -1), keepdims=True) + 1e-7)
        r = np.sqrt(np.mean(np.cosh(gamma * x) ** 2, axis=(-2, -1), keepdims=True))
        return ref.shape_scale(p.shape, scale) * x / (r + 1e-8)

    return direction


def test_matches_numpy_reference_step_by_step():
    case = {"momentum_form": "ema", "nesterov": True, "shape_scale": "jordan", "gamma": 40.0}  # cosh far from 1
    params = ref.f32(ref.model_tree(0, untied=True, scale=0.1))
    grads_seq = ref.grads_sequence(params)
    lr, adam_lr, wd = 0.5, 0.01, 0.1  # a large rate: the update, not the weights, sets the compared values
    direction = np_auon_direction(
        beta=0.9, gamma=case["gamma"], form=case["momentum_form"], nesterov=case["nesterov"], scale=case["shape_scale"]
    )
    expected = ref.run_matrix_family(params, grads_seq, direction, lr=lr, adam_lr=adam_lr, wd=wd)
    tx = auon(lr, beta=0.9, weight_decay=wd, adam_lr_ratio=adam_lr / lr, **case)
    ref.assert_trees_close(ref.run_jax(tx, params, grads_seq), expected)


def test_bound_is_scale_invariant_per_matrix_and_brakes_spiky_updates():
    rng = np.random.default_rng(0)
    d = rng.standard_normal((2, 16, 24))
    d[1] *= 1e3  # a scale per matrix of the stack: no effect
    u = np.asarray(cosh_rms_bound(jnp.float32(d), MatrixAxes()))
    # entries ~ 1/sqrt(N): r = sqrt(mean(cosh(x)^2)) ~ sqrt(1 + 1/N), and ||U||_F = 1 / r
    np.testing.assert_allclose(np.linalg.norm(u, axis=(1, 2)), [1 / np.sqrt(1 + 1 / 384)] * 2, rtol=1e-4)
    spiky = np.zeros((16, 24))
    spiky[0, 0] = 1.0  # all the energy in one entry: cosh(gamma) inflates r
    u_spiky = np.asarray(cosh_rms_bound(jnp.float32(spiky), MatrixAxes(), gamma=3.0))
    r = np.sqrt((np.cosh(3.0) ** 2 + spiky.size - 1) / spiky.size)
    np.testing.assert_allclose(np.linalg.norm(u_spiky), 1 / r, rtol=1e-5)


def test_converges_on_matrix_regression():
    assert ref.regression_loss_ratio(auon(0.3, adam_lr_ratio=0.1)) < 0.05


def test_step_has_no_matrix_product():
    """The linear-time claim, from the compiled program: no dot in AuON's matrix step."""
    tx = auon(0.1)
    params = {"blocks": {"mlp": {"up_proj": {"kernel": jnp.ones((2, 16, 24))}}}}
    text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
    assert " dot(" not in text and "convolution(" not in text
