"""DES-LOC: the step against a NumPy transcription of Algorithm 1 of arXiv:2505.22549."""

import jax
import numpy as np
import optax
import pytest

from optim import des_loc
from tests.optim.replica_harness import local_adam_reference, run_replicas


@pytest.mark.devices(4)
def test_four_replicas_match_the_numpy_rule_with_three_periods():
    """K_x = 2, K_u = 3, K_v = 5 over 12 steps: every combination of synchronised states occurs."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 5)).astype(np.float32)
    grads = rng.normal(size=(4, 12, 3, 5)).astype(np.float32) + np.arange(4, dtype=np.float32)[:, None, None, None]
    tx = des_loc.des_loc(optax.adam(0.05), sync_every=2, mu_sync_every=3, nu_sync_every=5, axis_name="replicas")
    trajectory, _, state = run_replicas(tx, {"w": w0}, {"w": grads})
    want = local_adam_reference(w0, grads, 0.05, 2, 3, 5)
    np.testing.assert_allclose(trajectory["w"], want, rtol=1e-5, atol=1e-5)  # fp32 rounding through 12 Adam steps (|x| ~ 1)
    assert np.abs(want[:, -1] - want[:1, -1]).max() > 1e-2  # between parameter averages the replicas differ
    np.testing.assert_array_equal(state.count, [12] * 4)


def test_one_replica_is_the_inner_optimizer_and_an_inner_without_moments_is_refused():
    rng = np.random.default_rng(1)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32)}
    tx, inner = des_loc.des_loc(optax.adamw(1e-2), sync_every=1, mu_sync_every=1, nu_sync_every=1), optax.adamw(1e-2)
    p, s, q, t = params, tx.init(params), params, inner.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for _ in range(3):
        g = {"a": rng.normal(size=(3, 4)).astype(np.float32)}
        u, s = step(p, s, g)
        p = optax.apply_updates(p, u)
        v, t = inner.update(g, t, q)
        q = optax.apply_updates(q, v)
    np.testing.assert_allclose(p["a"], q["a"], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="keeps no optax.ScaleByAdamState; use an Adam-family inner optimizer"):
        des_loc.des_loc(optax.sgd(0.1)).init(params)


def test_injected_periods_are_refused_naming_static_args():
    params = {"w": np.ones((2, 3), np.float32)}
    tx = optax.inject_hyperparams(des_loc.des_loc, static_args=("sync_every", "nu_sync_every"))(optax.adam(0.1), mu_sync_every=3)
    with pytest.raises(ValueError, match="mu_sync_every.*static_args"):
        jax.jit(tx.update)(params, tx.init(params), params)
