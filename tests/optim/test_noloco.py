"""NoLoCo: the partner schedule, and the step against a NumPy transcription of arXiv:2506.10911."""

import itertools

import jax
import numpy as np
import optax
import pytest

from optim import noloco
from tests.optim.replica_harness import run_replicas


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_round_robin_pairs_every_two_replicas_once(replicas):
    schedule = noloco.round_robin_partners(replicas)
    assert len(schedule) == replicas - 1
    met = []
    for partner in schedule:
        assert all(partner[partner[i]] == i != partner[i] for i in range(replicas))  # a perfect matching
        met += [frozenset((i, p)) for i, p in enumerate(partner) if i < p]
    assert sorted(met, key=sorted) == sorted(map(frozenset, itertools.combinations(range(replicas), 2)), key=sorted)
    with pytest.raises(ValueError, match="number must be even; got 3"):
        noloco.round_robin_partners(3)


def _pair_mean(x, partner):
    """Per replica, the mean of its value and its partner's."""
    return (x + x[partner]) / 2


def _reference(w0, grads, lr, h, alpha, beta, gamma):
    """The paper's rule in float64, inner SGD: ``(W, T, ...)`` parameters after each step."""
    replicas, steps = grads.shape[:2]
    schedule = noloco.round_robin_partners(replicas)
    theta = np.repeat(w0[None].astype(np.float64), replicas, 0)
    phi, delta = theta.copy(), np.zeros_like(theta)
    out = []
    for t in range(1, steps + 1):
        theta = theta - lr * grads[:, t - 1]
        if t % h == 0:
            partner = schedule[(t // h - 1) % len(schedule)]
            outer_grad = phi - theta
            delta = alpha * delta - beta * _pair_mean(outer_grad, partner) - gamma * (phi - _pair_mean(phi, partner))
            phi = phi + delta
            theta = phi.copy()
        out.append(theta)
    return np.stack(out, axis=1)


@pytest.mark.devices(4)
@pytest.mark.parametrize("gamma", [0.7, 0.3], ids=["gamma_is_beta_sends_theta", "gamma_own_sends_theta_and_phi"])
def test_four_replicas_match_the_numpy_rule_through_every_pairing(gamma):
    """4 replicas, H = 2, 10 steps: 5 rounds, so the 3 pairings of the schedule come round again."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 5)).astype(np.float32)
    grads = rng.normal(size=(4, 10, 3, 5)).astype(np.float32)
    cfg = dict(h=2, alpha=0.5, beta=0.7, gamma=gamma)
    tx = noloco.noloco(
        optax.sgd(0.1), sync_every=cfg["h"], outer_momentum=cfg["alpha"], outer_learning_rate=cfg["beta"], partner_pull=gamma,
        axis_name="replicas",
    )  # fmt: skip
    trajectory, _, state = run_replicas(tx, {"w": w0}, {"w": grads})
    want = _reference(w0, grads, 0.1, **cfg)
    np.testing.assert_allclose(trajectory["w"], want, rtol=1e-5, atol=1e-6)
    assert np.abs(want[:, -1] - want[:1, -1]).max() > 1e-2  # no all-reduce: the replicas still differ
    np.testing.assert_allclose(state.outer_params["w"], want[:, -1], rtol=1e-5, atol=1e-6)


def test_one_replica_h1_momentum0_beta1_is_the_inner_optimizer():
    """Alone, ``delta = -beta (phi - theta)``: with beta 1 the slow weights follow the fast ones."""
    rng = np.random.default_rng(1)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32)}
    tx = noloco.noloco(optax.adam(1e-2), sync_every=1, outer_learning_rate=1.0, outer_momentum=0.0, partner_pull=1.0)
    inner = optax.adam(1e-2)
    p, s, q, t = params, tx.init(params), params, inner.init(params)
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    for _ in range(3):
        g = {"a": rng.normal(size=(3, 4)).astype(np.float32)}
        u, s = step(p, s, g)
        p = optax.apply_updates(p, u)
        v, t = inner.update(g, t, q)
        q = optax.apply_updates(q, v)
    np.testing.assert_allclose(p["a"], q["a"], rtol=1e-6, atol=1e-7)


@pytest.mark.devices(4)
def test_injected_hyperparameters_take_the_general_exchange_and_agree_with_the_theta_only_one():
    """Injected beta and gamma are arrays, so the step sends theta and phi; equal values must give the
    step that sends theta alone. Injecting the round length is refused, naming ``static_args``."""
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = rng.normal(size=(4, 6, 4, 3)).astype(np.float32)
    kwargs = dict(sync_every=2, outer_learning_rate=0.6, partner_pull=0.6, axis_name="replicas")
    injected = optax.inject_hyperparams(noloco.noloco, static_args=noloco.NoLoCo.static_args)(optax.sgd(0.1), **kwargs)
    got, _, _ = run_replicas(injected, {"w": w0}, {"w": grads})
    want, _, _ = run_replicas(noloco.noloco(optax.sgd(0.1), **kwargs), {"w": w0}, {"w": grads})
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    bad = optax.inject_hyperparams(noloco.noloco, static_args=())(optax.sgd(0.1), sync_every=2)
    with pytest.raises(ValueError, match="sync_every.*static_args"):
        jax.jit(bad.update)({"w": w0}, bad.init({"w": w0}), {"w": w0})
