"""Inverse p-th roots (optim/matrix_roots.py) against float64 NumPy, and failure detection."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim import matrix_roots


def spd_batch(rng, n, b, cond):
    q, _ = np.linalg.qr(rng.normal(size=(n, b, b)))
    lam = np.logspace(0, -np.log10(cond), b)
    return (q * lam) @ np.swapaxes(q, -1, -2)


def reference_root(a, p, ridge):
    lam, vecs = np.linalg.eigh(a)
    r = ridge * max(lam[-1], 1e-16)
    return (vecs * (np.maximum(lam, 0) + r) ** (-1.0 / p)) @ vecs.T


@pytest.mark.parametrize("method", ["eigh", "newton"])
@pytest.mark.parametrize("p", [2, 4])
def test_root_matches_float64_reference(method, p):
    rng = np.random.default_rng(p)
    mats = spd_batch(rng, 3, 12, cond=1e3)
    roots, errors = jax.jit(lambda a: matrix_roots.inverse_pth_root(a, p, method=method, ridge_epsilon=1e-6))(
        jnp.asarray(mats, jnp.float32)
    )
    expected = np.stack([reference_root(a, p, 1e-6) for a in mats])
    np.testing.assert_allclose(np.asarray(roots), expected, atol=2e-5 * np.abs(expected).max())
    assert np.all(np.asarray(errors) < 1e-4)
    assert np.all(np.asarray(matrix_roots.accepted(roots, errors, 0.1)))


@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_ridge_is_relative_to_the_largest_eigenvalue(method):
    # A rank-1 matrix scaled by 1e4: the null space gets (1e-4 * 1e4)^(-1/2) = 1 exactly when scale-free.
    v = np.array([1.0, 2.0, 2.0]) / 3.0
    a = 1e4 * np.outer(v, v)
    roots, _ = matrix_roots.inverse_pth_root(jnp.asarray(a[None], jnp.float32), 2, method=method, ridge_epsilon=1e-4)
    expected = reference_root(a, 2, 1e-4)
    np.testing.assert_allclose(np.asarray(roots[0]), expected, rtol=1e-3, atol=1e-3)


def test_nan_input_is_rejected():
    mats = np.tile(np.eye(4, dtype=np.float32), (2, 1, 1))
    mats[1, 0, 1] = np.nan
    for method in ("eigh", "newton"):
        roots, errors = jax.jit(functools.partial(matrix_roots.inverse_pth_root, p=4, method=method))(jnp.asarray(mats))
        np.testing.assert_array_equal(np.asarray(matrix_roots.accepted(roots, errors, 0.1)), [True, False])


def test_unconverged_newton_is_rejected():
    mats = jnp.asarray(spd_batch(np.random.default_rng(0), 2, 8, cond=1e4), jnp.float32)
    roots, errors = matrix_roots.inverse_pth_root(mats, 4, method="newton", newton_iters=1)
    assert np.all(np.asarray(errors) > 0.1)
    assert not np.any(np.asarray(matrix_roots.accepted(roots, errors, 0.1)))


def test_matrix_power_and_max_eigenvalue():
    a = spd_batch(np.random.default_rng(1), 2, 5, cond=10.0)
    x = jnp.asarray(a, jnp.float32)
    for p in (1, 2, 3, 5):
        np.testing.assert_allclose(matrix_roots.matrix_power(x, p), np.linalg.matrix_power(a, p), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(matrix_roots.max_eigenvalue(x), np.linalg.eigvalsh(a)[:, -1], rtol=1e-4)


def test_bad_arguments_raise():
    x = jnp.eye(3)[None]
    with pytest.raises(ValueError, match="root method"):
        matrix_roots.inverse_pth_root(x, 4, method="svd")
    with pytest.raises(ValueError, match="positive integer"):
        matrix_roots.inverse_pth_root(x, 0)


def test_lapack_each_matches_the_batched_call_one_matrix_per_call():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 6, 4)), jnp.float32)
    svd = functools.partial(jnp.linalg.svd, full_matrices=False)
    for got, want in zip(jax.jit(functools.partial(matrix_roots.lapack_each, svd))(x), svd(x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    lowered = jax.jit(functools.partial(matrix_roots.lapack_each, jnp.linalg.qr)).lower(x).as_text()
    assert 'num_batch_dims = "0"' in lowered and 'num_batch_dims = "1"' not in lowered


@pytest.mark.parametrize("family", ["conda", "dion"])
def test_stacked_matrix_optimizers_call_lapack_one_matrix_at_a_time(family):
    """jax 0.10's batched CPU LAPACK kernels wait on the intra-op pool they split the batch over, so
    8 devices running them at once can hold every pool thread and hang (the registry's step did)."""
    from optim.conda import scale_by_conda
    from optim.dion import scale_by_dion

    tx = {"conda": scale_by_conda, "dion": scale_by_dion}[family]()
    params = {"w": jnp.zeros((2, 16, 24))}
    lowered = jax.jit(tx.update).lower(params, tx.init(params)).as_text()
    calls = [line for line in lowered.splitlines() if "custom_call @lapack_" in line]
    assert calls and all('num_batch_dims = "0"' in line for line in calls), calls
