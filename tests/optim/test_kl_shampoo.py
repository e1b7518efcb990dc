"""KL-Shampoo (optim/kl_shampoo.py): float64 NumPy transcription of facebookresearch/optimizers'
simplified KL-Shampoo on a matrix and a 3-D tensor, the difference from Shampoo, convergence.

Jit, inject_hyperparams, bf16, 8 devices, state_bits, checkpoints: test_common.py.
"""

import jax
import jax.numpy as jnp
import muon_reference as ref
import numpy as np
import pytest

from optim.kl_shampoo import kl_shampoo, scale_by_kl_shampoo
from optim.shampoo import scale_by_shampoo


def np_root(a, p, ridge):
    lam, vecs = np.linalg.eigh(a)
    r = ridge * max(lam[-1], 1e-16)
    return (vecs * (np.maximum(lam, 0) + r) ** (-1.0 / p)) @ vecs.T


def mode_product(x, m, i):
    """``x x_i m``: ``m`` applied along dim ``i``."""
    return np.moveaxis(np.tensordot(m, x, axes=([1], [i])), 0, i)


def np_kl_shampoo(grads, *, beta1, beta2, eps, every, start, graft, p, graft_beta2=0.999, graft_eps=1e-8):
    """Single-block KL-Shampoo on one tensor, float64: Shampoo (Nesterov, grafted) whose factor ``i``
    accumulates ``X_(i) X_(i)^T`` with ``X`` the gradient preconditioned by the cached roots of the
    other factors (facebookresearch/optimizers ``RootInvKLShampooPreconditionerList``)."""
    shape = grads[0].shape
    stats = [eps * np.eye(n) for n in shape]
    roots = [np.eye(n) for n in shape]
    mom, nu = np.zeros(shape), np.zeros(shape)
    out = []
    for t, g in enumerate(grads, start=1):
        if graft == "adam":
            nu = graft_beta2 * nu + (1 - graft_beta2) * g * g
            a = g / (np.sqrt(nu / (1 - graft_beta2**t)) + graft_eps)
        else:
            a = g
        for i in range(len(shape)):
            x = g
            for j, r in enumerate(roots):
                if j != i:
                    x = mode_product(x, r, j)
            xi = np.moveaxis(x, i, 0).reshape(shape[i], -1)
            stats[i] = beta2 * stats[i] + (1 - beta2) * xi @ xi.T
        if t >= start and (t == start or t % every == 0):
            roots = [np_root(s, p, eps) for s in stats]
        s = g
        for j, r in enumerate(roots):
            s = mode_product(s, r, j)
        d = s if graft == "none" else s * np.linalg.norm(a) / np.linalg.norm(s)
        if t < start:
            d = a
        mom = beta1 * mom + (1 - beta1) * d
        out.append(beta1 * mom + (1 - beta1) * d)
    return out


def run(tx, grads, params):
    state, update, outs = tx.init(params), jax.jit(tx.update), []
    for g in grads:
        u, state = update(jnp.asarray(g, jnp.float32), state, params)
        outs.append(np.asarray(u, np.float64))
    return outs


CASES = {
    "matrix-paper-p2-no-graft": ((5, 7), dict(graft_type="none", exponent_override=2), dict(graft="none", p=2)),
    "tensor-3d-p6": ((3, 4, 5), dict(graft_type="adam", batch_leading_axes=False, merge_dims=False), dict(graft="adam", p=6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy_transcription_and_differs_from_shampoo(name):
    shape, jax_kw, np_kw = CASES[name]
    rng = np.random.default_rng(len(shape))
    grads = [np.float32(rng.standard_normal(shape)).astype(np.float64) for _ in range(6)]
    common = dict(block_size=8, beta1=0.9, beta2=0.95, precondition_every=2, start_preconditioning_step=2, graft_beta2=0.99)
    outs = run(scale_by_kl_shampoo(**common, **jax_kw), grads, jnp.zeros(shape))
    expected = np_kl_shampoo(grads, beta1=0.9, beta2=0.95, eps=1e-6, every=2, start=2, graft_beta2=0.99, **np_kw)
    for got, want in zip(outs, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if name.startswith("matrix"):
        plain = run(scale_by_shampoo(**common, **jax_kw), grads, jnp.zeros(shape))
        np.testing.assert_allclose(plain[1], outs[1], rtol=1e-5, atol=1e-6)  # identity roots until the first refresh
        assert np.abs(plain[-1] - outs[-1]).max() > 1e-2 * np.abs(outs[-1]).max()


def test_converges_on_matrix_regression():
    tx = kl_shampoo(0.05, precondition_every=10, start_preconditioning_step=3)
    assert ref.regression_loss_ratio(tx, steps=30) < 0.05
