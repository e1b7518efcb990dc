"""Meta-training of the learned optimizer: the ES / PES estimators against true gradients, and a short run.

The estimators are checked statistically on unrolled systems whose meta-loss is quadratic in theta,
where Gaussian smoothing changes nothing, so antithetic ES is unbiased for the gradient of one
truncation and PES for the gradient through the whole unrolled history; tolerances are five
standard errors of the mean over the (fixed-seed) samples.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from experiments import cli, lopt_tasks, meta_train
from optim.learned import mlp_lopt

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
    return lopt_tasks.mlp_task("mlp_regression", d_in=2, width=4, depth=0, d_out=1, batch=8)  # linear


def _episode_meta_loss(trainer, task, horizon):
    """``theta -> `` mean meta-loss of whole episodes of ``horizon`` steps (no perturbation) on 4 held-out task keys."""
    unroll = meta_train.make_unroll(task, trainer.unravel, horizon)
    keys = jax.random.split(jax.random.key(123), 4)

    def one(theta, key):
        episode = meta_train.new_episode(task, trainer.unravel, theta, key, jnp.int32(horizon))
        return unroll(theta, episode, key)[1]

    return jax.jit(lambda theta: jnp.mean(jax.vmap(one, in_axes=(None, 0))(theta, keys)))


def test_meta_training_lowers_the_meta_loss_on_a_toy_family(toy_task):
    """PES from random meta-parameters on a linear-regression family. Steps of 1e-3 move a 10-step
    episode's loss by a few percent, so the bar is an absolute drop of 0.01 in the (deterministic)
    held-out meta-loss; ascending meta-gradients raise it instead."""
    trainer = meta_train.MetaTrainer(
        [toy_task], estimator="pes", pairs=2, sigma=0.01, truncation=5, learning_rate=1e-1, clip=1.0,
        weight_decay=0.0, mesh=None, seed=0, warm_start=False,
    )
    meta_loss = _episode_meta_loss(trainer, toy_task, 10)
    before = float(meta_loss(trainer.theta))
    losses = []
    for _ in range(8):
        trainer.run_episode(toy_task, 10, losses.append)
    after = float(meta_loss(trainer.theta))
    assert trainer.iteration == 16 and np.all(np.isfinite(losses)), (trainer.iteration, losses)
    assert after < before - 0.01, (before, after)


@pytest.mark.devices(8)
def test_population_is_sharded_over_the_devices():
    mesh = jax.make_mesh((8,), ("population",), axis_types=(jax.sharding.AxisType.Auto,))

    def unroll(theta, s, key):
        return 0.5 * s + theta, jnp.sum(jnp.square(s))

    @jax.jit
    def step(states, xi, key):
        return meta_train.pes_estimate(unroll, THETA, states, xi, key, pairs=4, sigma=SIGMA, mesh=mesh)

    with jax.set_mesh(mesh):
        grad, states, xi, _ = step(jnp.zeros((8, DIM)), jnp.zeros((8, DIM)), jax.random.key(0))
    for x in (states, xi):
        assert x.sharding.spec[0] == "population" and len(x.addressable_shards) == 8
        assert x.addressable_shards[0].data.shape == (1, DIM)
    assert grad.shape == (DIM,)


def test_checkpoint_resumes_the_meta_state(toy_task, tmp_path):
    kwargs = dict(estimator="es", pairs=2, sigma=0.01, truncation=5, learning_rate=1e-2, clip=1.0, weight_decay=0.0, mesh=None, seed=0)
    trainer = meta_train.MetaTrainer([toy_task], **kwargs)
    trainer.theta, trainer.iteration = trainer.theta + 1.0, 2
    trainer.opt_state = jax.tree.map(lambda x: x + 1, trainer.opt_state)
    trainer.save(tmp_path / "ck.npz", [1.0, 2.0], {"settings": {"pairs": 2}, "wall_seconds": 3.5})
    resumed = meta_train.MetaTrainer([toy_task], **{**kwargs, "seed": 5})
    assert resumed.restore(tmp_path / "ck.npz") == ([1.0, 2.0], {"settings": {"pairs": 2}, "wall_seconds": 3.5})
    assert resumed.iteration == 2
    np.testing.assert_array_equal(resumed.theta, trainer.theta)
    for a, b in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(trainer.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_meta_training_can_start_from_shipped_weights(toy_task):
    """``--init_weights=lopt``: the starting meta-parameters are the shipped ones, not the warm start."""
    kwargs = dict(estimator="es", pairs=2, sigma=0.01, truncation=5, learning_rate=1e-2, clip=1.0, weight_decay=0.0, mesh=None, seed=0)
    shipped = mlp_lopt.load_meta_params(mlp_lopt.weights_path("lopt"))
    trainer = meta_train.MetaTrainer([toy_task], **kwargs, initial=shipped)
    for a, b in zip(jax.tree.leaves(trainer.meta_params()), jax.tree.leaves(shipped), strict=True):
        np.testing.assert_array_equal(a, b)
    warm = meta_train.MetaTrainer([toy_task], **kwargs).meta_params()
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(shipped), strict=True))


def test_task_family_parses_widths_depths_and_model_presets():
    narrow, small = lopt_tasks.family("lm-w16-d1, small")
    assert (narrow.name, small.name) == ("lm-w16-d1", "small")
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    preset = lopt_tasks.preset_model_def("small", 32).abstract_params
    assert count(jax.eval_shape(small.init, jax.random.key(0))) == count(preset) > 20 * count(jax.eval_shape(narrow.init, jax.random.key(0)))


def test_a_resumed_run_must_have_the_checkpoints_settings():
    """Was: a rerun with --estimator=es continued a PES run's meta-state and wrote a record naming ES alone."""
    values = flags.FlagValues()
    for name, default in {"pairs": 4, "truncation": 10, "min_horizon": 50, "max_horizon": 200, "seed": 0, "mup_base_fan_in": 0}.items():
        flags.DEFINE_integer(name, default, name, flag_values=values)
    for name, default in {"sigma": 0.01, "learning_rate": 3e-3, "clip": 1.0, "weight_decay": 1e-4}.items():
        flags.DEFINE_float(name, default, name, flag_values=values)
    for name, default in {"estimator": "pes", "tasks": "mlp_regression", "init_weights": ""}.items():
        flags.DEFINE_string(name, default, name, flag_values=values)
    flags.DEFINE_bool("warm_start", True, "warm_start", flag_values=values)
    values.mark_as_parsed()
    saved = json.loads(json.dumps(meta_train.run_settings(values)))  # as the checkpoint holds them
    meta_train.check_resume(Path("w"), saved, meta_train.run_settings(values))
    meta_train.check_resume(Path("w"), None, meta_train.run_settings(values))  # an older checkpoint: not checked
    values["estimator"].value, values["sigma"].value = "es", 0.02
    with pytest.raises(cli.UsageError, match=r"^w holds a meta-training run with other settings \(estimator: pes -> es, sigma: 0.01 -> 0.02\)"):
        meta_train.check_resume(Path("w"), saved, meta_train.run_settings(values))


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("truncation", 0, "--truncation=0 must be >= 1"),  # was a ZeroDivisionError
        ("checkpoint_every", 0, "--checkpoint_every=0 must be >= 1"),  # was a ZeroDivisionError after the first episode
        ("sigma", 0.0, "--sigma=0.0 must be > 0"),
        ("max_horizon", 5, "--max_horizon=5 must be at least --min_horizon=1 and --truncation=10"),  # was an endless loop
        ("min_horizon", 300, "--max_horizon=200 must be at least --min_horizon=300"),
    ],
)
def test_a_schedule_that_cannot_run_is_named(flag, value, message):
    values = flags.FlagValues()
    defaults = {"iterations": 10, "pairs": 4, "truncation": 10, "min_horizon": 1, "max_horizon": 200, "checkpoint_every": 50, "num_devices": 0}
    for name, default in defaults.items():
        flags.DEFINE_integer(name, default, name, flag_values=values)
    flags.DEFINE_float("sigma", 0.01, "sigma", flag_values=values)
    values.mark_as_parsed()
    meta_train.check_schedule(values)
    values[flag].value = value
    with pytest.raises(cli.UsageError, match=message):
        meta_train.check_schedule(values)


def _command_line(workdir, *args):
    values = flags.FlagValues()
    meta_train.define_flags(values)
    values(["meta_train", f"--workdir={workdir}", "--estimator=es", "--pairs=4", "--truncation=2", "--min_horizon=2",
            "--max_horizon=4", "--checkpoint_every=2", "--nowarm_start", *args])  # fmt: skip
    return values


def test_the_command_line_writes_resumes_and_keeps_a_finished_run(toy_task, tmp_path, monkeypatch, capsys):
    """`meta_train.train` as ``python -m experiments.meta_train`` runs it, on the toy family: the weights with their
    record, the metrics and the checkpoint; a rerun of a finished run changes nothing, a raised --iterations
    continues it, other settings are refused (the flags of a fresh FlagValues, so no subprocess compiles)."""
    monkeypatch.setattr(lopt_tasks, "family", lambda names: [toy_task])
    meta_train.train(_command_line(tmp_path, "--iterations=4"))
    record = json.loads((tmp_path / "lopt.json").read_text())
    assert record["iterations"] == 4 and record["estimator"] == "es" and record["pairs"] == 4
    assert record["machine"].endswith(f"({jax.devices()[0].platform})")  # was "... no accelerator" on any machine
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4] and all(np.isfinite(line["meta_loss"]) for line in lines)
    assert np.isclose(record["final_meta_loss_mean_last_50"], np.mean([line["meta_loss"] for line in lines]))
    weights = mlp_lopt.load_meta_params(tmp_path / "lopt.npz")
    assert (tmp_path / "meta_loss.png").stat().st_size > 0 and (tmp_path / "checkpoint.npz").is_file()
    finished = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    capsys.readouterr()
    meta_train.train(_command_line(tmp_path, "--iterations=4"))
    assert "already finished" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == finished
    meta_train.train(_command_line(tmp_path, "--iterations=6"))
    assert "resumed at meta-iteration 4" in capsys.readouterr().out
    assert json.loads((tmp_path / "lopt.json").read_text())["iterations"] == 6
    assert [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    continued = mlp_lopt.load_meta_params(tmp_path / "lopt.npz")
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(weights), jax.tree.leaves(continued), strict=True))
    with pytest.raises(SystemExit) as exit_info:
        meta_train.train(_command_line(tmp_path, "--iterations=8", "--sigma=0.02"))
    assert exit_info.value.code == 2 and "other settings (sigma: 0.01 -> 0.02)" in capsys.readouterr().err

