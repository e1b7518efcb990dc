"""The replica-local train step: each replica's gradient inside `jax.shard_map`, per-replica state.

Compilation is the cost, so each cross-replica optimizer compiles one train step (built through
the registry as `experiments.train` builds it, on ``data:8``), trains, checkpoints at step 2,
restores, and continues with the same program. `trainer.run` with replicas end to end, checkpointing
and resuming across processes, runs in tests/sharding/test_multihost_and_resharding.py.
"""

import functools
import math
import tempfile

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from experiments import checkpointing, cli, restore, run_spec, train_lib, trainer
from experiments.configs import default
from lm import config as config_lib
from lm import model as model_lib
from lm import moe
from optim import cross_replica, diloco, registry
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

# Replicas are devices: every test here builds meshes of up to 8 (skipped on a one-GPU box).
pytestmark = pytest.mark.devices(8)

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SMALL_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "mlp_dim": 64}
CROSS_REPLICA = {
    "demo": {"optimizer.learning_rate": 3e-3, "optimizer.demo.chunk": 16, "optimizer.demo.topk": 8},
    "diloco": {"optimizer.diloco.sync_every": 2},
    "streaming_diloco": {"optimizer.streaming_diloco.sync_every": 2, "optimizer.streaming_diloco.exchange": "bfloat16"},
    "powersgd": {"optimizer.powersgd.rank": 2},
    "noloco": {"optimizer.noloco.sync_every": 2},
    "des_loc": {"optimizer.des_loc.sync_every": 2, "optimizer.des_loc.mu_sync_every": 3, "optimizer.des_loc.nu_sync_every": 4},
    "mt_dao": {"optimizer.mt_dao.sync_every": 2, "optimizer.mt_dao.mu_sync_every": 3, "optimizer.mt_dao.nu_sync_every": 4},
}
STEPS, SAVED_AT = 4, 2


def _config(name, mesh="data:8", **overrides):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = STEPS, 8, 16
    config.eval_every, config.eval_batches, config.log_every, config.checkpoint_every = STEPS, 1, 1, 100
    config.model.update(SMALL_MODEL)
    config.mesh, config.replicas = mesh, "data"
    config.optimizer.name = name
    config.optimizer.warmup_steps = 0
    config.update_from_flattened_dict({**CROSS_REPLICA[name], **overrides})
    return config


def test_cross_replica_optimizers_are_registered_with_the_replica_axis():
    assert {n for n, c in registry.OPTIMIZERS.items() if c.replica_local} == set(CROSS_REPLICA)
    assert set(CROSS_REPLICA) <= set(registry.OPTIMIZERS)


@functools.cache
def _trained(name):
    """(straight losses, resumed losses, straight final state, resumed final state, run spec)."""
    spec = run_spec.build_run(_config(name))
    shardings = spec.shardings
    step_fn = train_lib.make_train_step(spec.model_def, spec.tx, replica_axis=shardings.replica_axis)
    step = jax.jit(step_fn, in_shardings=(shardings.state, shardings.batch), out_shardings=(shardings.state, None),
                   compiler_options=FAST_COMPILE)  # fmt: skip
    batches = [np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)] * STEPS  # loss falls on it
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):

        def run(state, batches):
            losses = []
            for b in batches:
                state, metrics = step(state, train_lib.global_batch(b, shardings))
                assert bool(metrics["finite"])
                losses.append(float(metrics["loss"]))
            return state, losses

        state, straight = run(train_lib.init_state(spec.model_def, spec.tx, 0, shardings), batches[:SAVED_AT])
        with tempfile.TemporaryDirectory() as tmp, ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(f"{tmp}/state", state)
            checkpointer.wait_until_finished()
            restored = checkpointer.restore(f"{tmp}/state", train_lib.abstract_state(spec.model_def, spec.tx, shardings))
        final, rest = run(state, batches[SAVED_AT:])
        resumed_final, resumed = run(restored, batches[SAVED_AT:])
    return straight + rest, straight + resumed, jax.device_get(final), jax.device_get(resumed_final), spec


@pytest.mark.parametrize("name", sorted(CROSS_REPLICA))
def test_cross_replica_optimizer_trains_on_8_replicas_and_resumes_bit_exactly(name):
    losses, resumed, final, resumed_final, spec = _trained(name)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0] - 0.01  # it learned something
    assert resumed == losses
    jax.tree.map(np.testing.assert_array_equal, resumed_final, final)
    # Per-replica state: a leading axis of one slice per replica, sharded over the replica axis.
    for leaf in jax.tree.leaves(spec.shardings.state["opt_state"]):
        assert leaf.spec[0] == "data"
    for leaf in jax.tree.leaves(final["params"]):
        assert leaf.shape[0] == 8


def test_diloco_replicas_agree_after_a_synchronisation_and_keep_their_own_inner_state():
    final = _trained("diloco")[2]  # after 4 steps, H = 2: just synchronised
    for leaf in jax.tree.leaves(final["params"]):  # each replica lands on theta up to one rounding
        np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), rtol=1e-6, atol=1e-9)
    # The inner AdamW's moments saw each replica's own data.
    is_diloco = lambda x: isinstance(x, diloco.DiLoCoState)  # noqa: E731
    (state,) = [x for x in jax.tree.leaves(final["opt_state"], is_leaf=is_diloco) if is_diloco(x)]
    moments = [x for x in jax.tree.leaves(state.inner) if x.ndim > 2]
    assert moments and all(np.any(x[0] != x[1]) for x in moments)


def test_a_replica_local_checkpoint_resumes_only_on_the_same_replica_count(tmp_path):
    """`trainer.run` refuses a checkpoint of 8 replicas on 4 (before compiling anything)."""
    *_, final, _, spec = _trained("diloco")
    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    checkpointing.save(mgr, STEPS, final, {}, run_spec.run_meta(_config("diloco"), spec.cfg, 8), force=True)
    mgr.wait_until_finished()
    with pytest.raises(cli.UsageError, match="replicas.count: checkpoint 8 vs now 4"):
        trainer.run(_config("diloco", mesh="data:4,fsdp:2"), tmp_path)
    # Its readers (sample, evaluate, export_hf) take the replica mean, as the run evaluates, on one device (were:
    # refused, "replicas.count: checkpoint 8 vs now 1", so a replica-local run could not be used at all).
    (tmp_path / "config.json").write_text(run_spec.resolve(_config("diloco"), spec.cfg).to_json_best_effort())
    reader, params, step = restore.restore_run(tmp_path)
    assert step == STEPS and reader.mesh.size == 1
    jax.tree.map(lambda p, f: np.testing.assert_allclose(p, np.mean(f, axis=0), rtol=1e-6, atol=1e-7), params, final["params"])
    # ... and on a mesh of more replicas than were saved, which does not divide them (was: IndivisibleError, and
    # advice to delete the checkpoint): 2 saved replicas read on data:8
    two = final | {k: jax.tree.map(lambda x: np.asarray(x)[:2], final[k]) for k in ("params", "opt_state")}
    checkpointing.save(mgr, STEPS + 1, two, {}, run_spec.run_meta(_config("diloco"), spec.cfg, 2), force=True)
    mgr.wait_until_finished()
    reader, params, step = restore.restore_run(tmp_path, mesh="data:8", devices=8)
    assert step == STEPS + 1 and reader.mesh.size == 8
    jax.tree.map(lambda p, f: np.testing.assert_allclose(p, np.mean(f[:2], axis=0), rtol=1e-6, atol=1e-7), params, final["params"])


def _sgd_steps(mesh_spec, replica_axis, batches):
    """SGD steps on ``batches`` (with the replica mean when the step is replica-local): the params,
    the losses, and ``evaluate(params)``, the jitted eval step on ``batches[0]``."""
    model_def = model_lib.define(config_lib.from_preset("tiny", **SMALL_MODEL))
    tx = optax.sgd(0.5, momentum=0.9)
    if replica_axis:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    mesh = mesh_lib.make_mesh(mesh_spec, None if replica_axis else jax.devices()[:1])
    rules = rules_lib.make_rules()
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        step_fn = train_lib.make_train_step(model_def, tx, replica_axis=replica_axis)
        step = jax.jit(step_fn, in_shardings=(shardings.state, shardings.batch), compiler_options=FAST_COMPILE)
        losses = []
        for batch in batches:
            state, metrics = step(state, train_lib.global_batch(batch, shardings))
            losses.append(float(metrics["loss"]))
    eval_step = train_lib.jit_eval_step(train_lib.make_eval_step(model_def), shardings)

    def evaluate(params):
        with jax.set_mesh(mesh), partition.use_rules(rules):
            placed = jax.device_put(params, shardings.state["params"])
            return float(eval_step(placed, train_lib.global_batch(batches[0], shardings)))

    return jax.tree.map(np.asarray, state["params"]), losses, evaluate, shardings


def test_replica_local_data_parallel_matches_one_device_and_evaluates_the_replica_mean():
    """4 replicas of 2 FSDP shards each, gradients averaged over replicas == the whole batch on one
    device; evaluation of replicas that differ is evaluation of their mean."""
    batches = [np.random.default_rng(i).integers(0, 256, (8, 17)).astype(np.int32) for i in range(2)]
    ref_params, ref_losses, ref_evaluate, _ = _sgd_steps("data:1", None, batches)
    params, losses, evaluate, shardings = _sgd_steps("data:4,fsdp:2", "data", batches)
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert leaf.shape == (4, *ref.shape)
        assert np.all(leaf == leaf[:1])  # replicas stay identical
        np.testing.assert_allclose(leaf[0], ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # One slice per replica: a device holds one copy of the model, as with replicated parameters.
    assert shardings.state["params"]["embed"]["embedding"].spec == jax.P("data", None, "fsdp")
    rng = np.random.default_rng(1)
    spread = jax.tree.map(lambda p: p + 0.01 * rng.normal(size=p.shape).astype(p.dtype), params)
    mean = jax.tree.map(lambda p: p.mean(0), spread)
    np.testing.assert_allclose(evaluate(spread), ref_evaluate(mean), rtol=1e-5)


@pytest.mark.parametrize(
    "mesh_spec, rules, overrides, message",
    [
        ("fsdp:8", "fsdp", "", "not an axis of mesh"),
        ("data:8", "fsdp", "embed=data", "shard parameters over 'data'"),
        ("data:4,fsdp:2", "fsdp", "batch=fsdp", "batch is not split over mesh axis 'data'"),
        ("data:2,fsdp:2,tensor:2", "tp", "", "keep one, e.g. --config.mesh=data:2,fsdp:4"),
    ],
)
def test_bad_replica_setups_are_usage_errors_naming_the_fix(mesh_spec, rules, overrides, message):
    config = default.get_config()
    config.mesh, config.rules, config.rule_overrides, config.replicas = mesh_spec, rules, overrides, "data"
    with pytest.raises(cli.UsageError, match=message):
        run_spec.build_run(config)


def test_demo_chunks_straddling_shards_are_a_usage_error():
    config = _config("demo", mesh="data:2,fsdp:4", **{"optimizer.demo.chunk": 64})
    config.model.update({"d_model": 96, "head_dim": 24})  # 96 / 4 = 24 per shard, chunk 48 straddles
    with pytest.raises(cli.UsageError, match="would straddle shards of .*; set optimizer.demo.chunk to a divisor"):
        run_spec.build_run(config)


def test_a_wrapper_inner_optimizer_is_configured_by_its_own_block():
    config = _config("diloco", **{"optimizer.diloco.inner": "sgd", "optimizer.sgd.momentum": 0.0})
    assert "sgd" in run_spec.run_meta(config, run_spec.build_run(config).cfg, 8)["optimizer"]
    with pytest.raises(cli.UsageError, match="optimizer.diloco.inner='muon_clip' cannot run inside diloco"):
        run_spec.build_run(_config("diloco", **{"optimizer.diloco.inner": "muon_clip"}))


@pytest.mark.parametrize("name", sorted(CROSS_REPLICA))
def test_a_cross_replica_optimizer_on_several_devices_needs_a_replica_axis(name):
    config = _config(name)
    config.replicas = ""
    with pytest.raises(cli.UsageError, match=rf"optimizer '{name}' exchanges updates .* add --config.replicas=data"):
        run_spec.build_run(config)
    config.devices, config.mesh = 1, ""
    run_spec.build_run(config)  # one device is one replica: nothing is lost


def _moe_step(replica_axis, batch, grad_accum_steps=1):
    """One AdamW step of a 1-layer, 4-expert top-1 MoE with the router-bias step on mesh ``data:2``:
    the new parameters (one replica's slice when replica-local) and the metrics."""
    cfg = config_lib.from_preset("moe-tiny", **{**SMALL_MODEL, "n_layers": 1}, n_experts=4, experts_per_token=1, expert_mlp_dim=32)
    model_def = model_lib.define(cfg)
    tx = optax.adamw(1e-2)
    if replica_axis:
        tx = optax.chain(cross_replica.mean_over_replicas(replica_axis), tx)
    mesh, rules = mesh_lib.make_mesh("data:2", jax.devices()[:2]), rules_lib.make_rules()
    shardings = train_lib.make_shardings(model_def, tx, mesh, rules, replica_axis)
    with jax.set_mesh(mesh), partition.use_rules(rules):
        state = train_lib.init_state(model_def, tx, 0, shardings)
        balancing = moe.Balancing(bias_rate=0.1)
        step_fn = train_lib.make_train_step(
            model_def, tx, balancing=balancing, replica_axis=replica_axis, grad_accum_steps=grad_accum_steps
        )
        step = jax.jit(step_fn, in_shardings=(shardings.state, shardings.batch), compiler_options=FAST_COMPILE)
        state, metrics = step(state, train_lib.global_batch(batch, shardings))
    return jax.tree.map(np.asarray, state["params"]), jax.device_get(metrics)


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_moe_counts_are_summed_over_replicas_so_a_replica_local_step_is_the_gspmd_step(grad_accum_steps):
    """Global balancing and the router-bias step see every replica's rows (issue 34, item 2): each
    replica's router bias and the loss equal the GSPMD step's (per-replica counts gave each replica
    its own bias and a per-replica balancing loss). With gradient accumulation too: the scan's zero sums
    were typed as varying over no axis, and the replica-local step failed to trace (an AssertionError)."""
    batch = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    ref_params, ref_metrics = _moe_step(None, batch, grad_accum_steps)
    params, metrics = _moe_step("data", batch, grad_accum_steps)
    ref_bias = ref_params["blocks"]["mlp"]["router"]["bias"]
    bias = params["blocks"]["mlp"]["router"]["bias"]
    assert np.any(ref_bias != 0)
    np.testing.assert_array_equal(bias, np.broadcast_to(ref_bias, bias.shape))
    for key in ("loss", "moe_balance_loss", "expert_load_max"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(leaf, np.broadcast_to(ref, leaf.shape), rtol=1e-4, atol=1e-6)
