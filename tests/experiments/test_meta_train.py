"""Meta-training of the learned optimizer: the ES / PES estimators against true gradients, and a short run.

The estimators are checked statistically on unrolled systems whose meta-loss is quadratic in theta,
where Gaussian smoothing changes nothing, so antithetic ES is unbiased for the gradient of one
truncation and PES for the gradient through the whole unrolled history; tolerances are five
standard errors of the mean over the (fixed-seed) samples.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import lopt_tasks, meta_train

DIM, SIGMA, PAIRS, SAMPLES = 3, 0.1, 2, 4000
A = jnp.asarray([[2.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 0.5]])
B = jnp.asarray([0.3, -1.0, 0.5])
THETA = jnp.asarray([0.2, -0.4, 1.0])


def _within_five_standard_errors(samples, truth):
    samples = np.asarray(samples, np.float64)
    mean, stderr = samples.mean(axis=0), samples.std(axis=0) / np.sqrt(samples.shape[0])
    return np.all(np.abs(mean - np.asarray(truth)) <= 5 * stderr), mean, stderr


def test_antithetic_es_is_unbiased_on_a_quadratic():
    def unroll(theta, state, key):
        return state, 0.5 * theta @ A @ theta + B @ theta

    def one(key):
        return meta_train.es_estimate(unroll, THETA, jnp.zeros(()), key, pairs=PAIRS, sigma=SIGMA)[0]

    grads = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), SAMPLES))
    ok, mean, stderr = _within_five_standard_errors(grads, A @ THETA + B)
    assert ok, (mean, A @ THETA + B, stderr)


def test_pes_is_unbiased_through_the_unroll_and_truncated_es_is_not():
    """s <- 0.5 s + theta per truncation, meta-loss |s - c|^2 / 2: after T truncations PES estimates
    the gradient through all T steps; truncated ES only that of the last one (a different vector)."""
    c, truncations = jnp.asarray([1.0, 0.0, -1.0]), 4

    def unroll(theta, s, key):
        s = 0.5 * s + theta
        return s, 0.5 * jnp.sum(jnp.square(s - c))

    def full_loss(theta):
        s = jnp.zeros(DIM)
        for _ in range(truncations):
            s, loss = unroll(theta, s, None)
        return loss

    def pes(key):
        def body(carry, k):
            states, xi = carry
            grad, states, xi, _ = meta_train.pes_estimate(unroll, THETA, states, xi, k, pairs=PAIRS, sigma=SIGMA)
            return (states, xi), grad

        start = (jnp.zeros((2 * PAIRS, DIM)), jnp.zeros((2 * PAIRS, DIM)))
        return jax.lax.scan(body, start, jax.random.split(key, truncations))[1][-1]

    def es(key):
        def body(state, k):
            grad, state, _ = meta_train.es_estimate(unroll, THETA, state, k, pairs=PAIRS, sigma=SIGMA)
            return state, grad

        return jax.lax.scan(body, jnp.zeros(DIM), jax.random.split(key, truncations))[1][-1]

    keys = jax.random.split(jax.random.key(1), SAMPLES)
    truth = jax.grad(full_loss)(THETA)
    ok, mean, stderr = _within_five_standard_errors(jax.jit(jax.vmap(pes))(keys), truth)
    assert ok, (mean, truth, stderr)
    ok, mean, stderr = _within_five_standard_errors(jax.jit(jax.vmap(es))(keys), truth)
    assert not ok, "truncated ES should be biased here (it ignores the theta-dependence of the carried state)"


@pytest.fixture(scope="module")
def toy_task():
    return lopt_tasks.mlp_task("mlp_regression", d_in=4, width=8, depth=1, d_out=2, batch=16)


def _episode_meta_loss(trainer, task, theta, keys, horizon):
    """Mean meta-loss of whole episodes of ``horizon`` steps with ``theta`` (no perturbation) over task keys."""
    unroll = meta_train.make_unroll(task, trainer.unravel, horizon)

    @jax.jit
    def one(key):
        episode = meta_train.new_episode(task, trainer.unravel, theta, key, jnp.int32(horizon))
        return unroll(theta, episode, key)[1]

    return float(np.mean([one(k) for k in keys]))


def test_meta_training_lowers_the_meta_loss_on_a_toy_family(toy_task):
    """PES with its population of 8 split over the 8 devices."""
    mesh = jax.make_mesh((8,), ("population",), axis_types=(jax.sharding.AxisType.Auto,))
    trainer = meta_train.MetaTrainer(
        [toy_task], estimator="pes", pairs=4, sigma=0.01, truncation=5, learning_rate=1e-2, clip=1.0,
        weight_decay=0.0, mesh=mesh, seed=0, warm_start=False,
    )
    held_out = jax.random.split(jax.random.key(123), 4)
    before = _episode_meta_loss(trainer, toy_task, trainer.theta, held_out, 20)
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(6):
            trainer.run_episode(toy_task, 20, losses.append)
    after = _episode_meta_loss(trainer, toy_task, trainer.theta, held_out, 20)
    assert trainer.iteration == 24 and all(np.isfinite(losses))
    assert after < 0.9 * before, (before, after)


def test_checkpoint_resumes_the_meta_state(toy_task, tmp_path):
    kwargs = dict(estimator="es", pairs=2, sigma=0.01, truncation=5, learning_rate=1e-2, clip=1.0, weight_decay=0.0, mesh=None, seed=0)
    trainer = meta_train.MetaTrainer([toy_task], **kwargs)
    trainer.run_episode(toy_task, 10, lambda loss: None)
    trainer.save(tmp_path / "ck.npz", [1.0, 2.0])
    resumed = meta_train.MetaTrainer([toy_task], **{**kwargs, "seed": 5})
    assert resumed.restore(tmp_path / "ck.npz") == [1.0, 2.0]
    assert resumed.iteration == 2
    np.testing.assert_array_equal(resumed.theta, trainer.theta)
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(trainer.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
