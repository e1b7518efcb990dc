"""Dion's orthonormalisation: Householder QR on CPU, shifted Cholesky QR 3 (matrix products) on accelerators."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import dion


def _positive_diagonal_qr(p):
    """NumPy's (float64 Householder) ``Q`` with columns signed so that ``R``'s diagonal is positive."""
    q, r = np.linalg.qr(np.asarray(p, np.float64))
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


@pytest.mark.parametrize("shape", [(64, 16), (3, 96, 24), (32, 32)])
def test_cholesky_qr_equals_householder(shape):
    p = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(jax.jit(dion.cholesky_qr)(p), _positive_diagonal_qr(p), atol=2e-6)


def test_ill_conditioned_factor_stays_on_the_products():
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((128, 16)))
    v, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    p = ((u * np.logspace(0, -5, 16)) @ v).astype(np.float32)  # cond 1e5: unshifted Cholesky QR fails in float32
    q = np.asarray(jax.jit(dion.cholesky_qr)(p), np.float64)
    np.testing.assert_allclose(q.T @ q, np.eye(16), atol=2e-6)
    assert np.all(np.diag(q.T @ p) > 0)  # Cholesky's R (Householder's has diagonal entries of both signs here)


def test_rank_deficient_factor_falls_back_to_householder():
    rng = np.random.default_rng(2)
    p = (rng.standard_normal((64, 3)) @ rng.standard_normal((3, 12))).astype(np.float32)  # rank 3 < r = 12
    q = np.asarray(jax.jit(dion.cholesky_qr)(p), np.float64)
    np.testing.assert_allclose(q.T @ q, np.eye(12), atol=2e-6)
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-4)


def test_the_platform_picks_the_method():
    p = jax.ShapeDtypeStruct((3, 96, 24), jnp.float32)
    cpu = jax.jit(dion.orthonormalize).lower(p).as_text()
    assert "geqrf" in cpu and "potrf" not in cpu
    cuda = jax.export.export(jax.jit(dion.orthonormalize), platforms=["cuda"])(p).mlir_module()
    targets = set(re.findall(r"custom_call @(\w+)", cuda))
    assert "cusolver_potrf_ffi" in targets and "stablehlo.case" in cuda  # Cholesky, Householder only behind the check


def test_dion_steps_agree_between_the_two_methods(monkeypatch):
    """The direction ``Q P^T`` and the momentum do not depend on ``P``'s column signs; ``Q``'s columns may flip."""
    rng = np.random.default_rng(3)
    params = {"w": jnp.zeros((2, 48, 32)), "v": jnp.zeros((40, 24))}
    grads = [{k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()} for _ in range(3)]
    tx = dion.scale_by_dion(mu=0.9, rank_fraction=0.25)

    def run():
        state, out = tx.init(params), []
        for g in grads:
            d, state = jax.jit(tx.update)(g, state)
            out.append((d, state.mu, jax.tree.map(jnp.abs, state.q)))
        return out

    householder = run()
    monkeypatch.setattr(dion, "orthonormalize", dion.cholesky_qr)
    cholesky = run()
    for got, want in zip(jax.tree.leaves(cholesky), jax.tree.leaves(householder), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
