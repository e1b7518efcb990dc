"""The replica-local train step: each replica's gradient inside `jax.shard_map`, per-replica state."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train, train_lib
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm import config as config_lib
from lm import model as model_lib
from optim import cross_replica
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib


def _steps(mesh_spec, replica_axis, batches):
    """Params after SGD steps on ``batches``, with the replica mean when the step is replica-local."""
    model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=1))
    tx = optax.sgd(0.5, momentum=0.9)
    if replica_axis:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    mesh = mesh_lib.make_mesh(mesh_spec, None if replica_axis else jax.devices()[:1])
    rules = rules_lib.make_rules()
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step = train_lib.jit_train_step(train_lib.make_train_step(model_def, tx, replica_axis=replica_axis), shardings)
        losses = []
        for batch in batches:
            state, metrics = step(state, train_lib.global_batch(batch, shardings))
            losses.append(float(metrics["loss"]))
    return jax.tree.map(np.asarray, state["params"]), losses, shardings


@pytest.fixture(scope="module")
def batches():
    return [np.random.default_rng(i).integers(0, 256, (16, 17)).astype(np.int32) for i in range(2)]


def test_replica_local_data_parallel_matches_one_device(batches):
    """4 replicas of 2 FSDP shards each, gradients averaged over replicas == the whole batch on one device."""
    ref_params, ref_losses, _ = _steps("data:1", None, batches)
    params, losses, shardings = _steps("data:4,fsdp:2", "data", batches)
    replicas = shardings.replicas
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert leaf.shape == (replicas, *ref.shape)
        assert np.all(leaf == leaf[:1])  # replicas stay identical
        np.testing.assert_allclose(leaf[0], ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # One slice per replica: a device holds one copy of the model, as with replicated parameters.
    embedding = shardings.state["params"]["embed"]["embedding"]
    assert embedding.spec == jax.P("data", None, "fsdp")


def test_eval_uses_the_replica_mean_of_the_parameters():
    model_def = model_lib.define(config_lib.from_preset("tiny", n_layers=1))
    tx = optax.sgd(0.1)
    mesh = mesh_lib.make_mesh("data:8")
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules_lib.make_rules(), "data")
    eval_fn = train_lib.make_eval_step(model_def)
    batch = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    with jax.set_mesh(mesh):
        params = train_lib.init_state(model_def, tx, 0, shardings)["params"]
        noise = jax.tree.map(lambda p: jnp.asarray(np.random.default_rng(1).normal(size=p.shape), p.dtype) * 0.01, params)
        spread = jax.jit(lambda p, n: jax.tree.map(jnp.add, p, n), out_shardings=shardings.state["params"])(params, noise)
        got = train_lib.jit_eval_step(eval_fn, shardings)(spread, train_lib.global_batch(batch, shardings))
        mean = jax.tree.map(lambda p: np.asarray(p).mean(0), spread)
        want = jax.jit(eval_fn)(mean, jnp.asarray(batch))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize(
    "mesh_spec, rules, overrides, message",
    [
        ("fsdp:8", "fsdp", "", "not an axis of mesh"),
        ("data:8", "fsdp", "embed=data", "shard parameters over 'data'"),
        ("data:8", "fsdp", "batch=fsdp", "batch is not split over mesh axis 'data'"),
        ("data:2,fsdp:2,tensor:2", "tp", "", "keep one, e.g. --config.mesh=data:2,fsdp:4"),
    ],
)
def test_bad_replica_setups_are_usage_errors_naming_the_fix(mesh_spec, rules, overrides, message):
    config = default.get_config()
    config.mesh, config.rules, config.rule_overrides, config.replicas = mesh_spec, rules, overrides, "data"
    with pytest.raises(train.UsageError, match=message):
        train.build_run(config)


CROSS_REPLICA = {
    "demo": {"optimizer.learning_rate": 1e-3},
    "diloco": {"optimizer.diloco.sync_every": 2},
    "streaming_diloco": {"optimizer.streaming_diloco.sync_every": 2, "model.n_layers": 2},
    "powersgd": {"optimizer.powersgd.rank": 2},
}


def _run_config(name, mesh="data:8", **overrides):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 4, 8, 16
    config.eval_every, config.eval_batches, config.log_every, config.checkpoint_every = 4, 1, 1, 100
    config.model.n_layers = 1
    config.mesh, config.replicas = mesh, "data"
    config.optimizer.name = name
    config.optimizer.warmup_steps = 0
    for key, value in {**CROSS_REPLICA[name], **overrides}.items():
        target = config
        *path, last = key.split(".")
        for p in path:
            target = target[p]
        target[last] = value
    return config


@pytest.mark.parametrize("name", sorted(CROSS_REPLICA))
def test_cross_replica_optimizer_trains_on_replicas_and_resumes_bit_exactly(name, tmp_path):
    straight = train.run(_run_config(name), tmp_path / "straight")
    assert straight["skipped_steps"] == 0 and straight["final_train_loss"] < math.log(320)  # it learned something
    assert train.run(_run_config(name), tmp_path / "resumed", interrupt_at=2)["interrupted"]
    resumed = train.run(_run_config(name), tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 2
    keys = ("step", "loss", "grad_norm", "val_loss")
    want, got = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("straight", "resumed"))
    assert [[r.get(k) for k in keys] for r in got] == [[r.get(k) for k in keys] for r in want]
    if name == "diloco":  # per-replica state cannot be re-split over another replica count
        with pytest.raises(train.UsageError, match="replicas.count: checkpoint 8 vs now 4"):
            train.run(_run_config(name, mesh="data:4,fsdp:2", steps=6), tmp_path / "resumed")
