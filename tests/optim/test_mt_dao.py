"""MT-DAO (optim/mt_dao.py): the step against a NumPy transcription of arXiv:2510.05361's N = 1 rule."""

import numpy as np
import pytest

from optim import mt_dao
from tests.optim.replica_harness import local_adam_reference, run_replicas


@pytest.mark.devices(4)
def test_four_replicas_match_the_numpy_rule_with_three_periods():
    """K_x = 2, K_u = 3, K_v = 5 over 12 steps: every combination of synchronised states occurs."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 5)).astype(np.float32)
    grads = rng.normal(size=(4, 12, 3, 5)).astype(np.float32) + np.arange(4, dtype=np.float32)[:, None, None, None]
    kw = {"b1": 0.99, "b2": 0.95, "omega": 0.6, "weight_decay": 0.1}
    tx = mt_dao.mt_dao(0.05, sync_every=2, mu_sync_every=3, nu_sync_every=5, axis_name="replicas", **kw)
    trajectory, _, _ = run_replicas(tx, {"w": w0}, {"w": grads})
    want = local_adam_reference(w0, grads, 0.05, 2, 3, 5, b1=0.99, b2=0.95, omega=0.6, wd=0.1)
    np.testing.assert_allclose(trajectory["w"], want, rtol=1e-5, atol=1e-5)  # fp32 rounding through 12 steps (|x| ~ 1)
    assert np.abs(want[:, -1] - want[:1, -1]).max() > 1e-2  # between parameter averages the replicas differ


def test_one_replica_converges_on_matrix_regression():
    from tests.optim import muon_reference as ref

    assert ref.regression_loss_ratio(mt_dao.mt_dao(0.05), steps=60) < 0.05
