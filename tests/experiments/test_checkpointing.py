import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import checkpointing


def _saved(tmp_path, steps):
    mgr = checkpointing.manager(tmp_path, keep=len(steps), every=1)
    for step in steps:
        checkpointing.save(mgr, step, {"w": jnp.full((4, 2), float(step))}, {"position": step}, {"run": "a"}, force=True)
    mgr.wait_until_finished()
    return mgr


def test_restores_the_newest_or_a_chosen_step_and_drops_newer_ones(tmp_path):
    mgr = _saved(tmp_path, [1, 2, 3])
    target = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    step, state, data = checkpointing.restore(mgr, target, {"run": "a"})
    assert (step, data) == (3, {"position": 3}) and np.all(np.asarray(state["w"]) == 3.0)
    step, state, _ = checkpointing.restore(mgr, target, {"run": "a"}, step=2)
    assert step == 2 and np.all(np.asarray(state["w"]) == 2.0)
    assert mgr.all_steps() == [1, 2]
    with pytest.raises(checkpointing.CheckpointError, match=r"no checkpoint at step 3 .*saved steps: \[1, 2\]"):
        checkpointing.restore(mgr, target, {"run": "a"}, step=3)
    mgr.close()


def test_arrays_of_other_shapes_are_a_mismatch_naming_the_leaf(tmp_path):
    mgr = _saved(tmp_path, [1])
    target = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    with pytest.raises(checkpointing.CheckpointMismatch, match=r"step 1 .* \(w: checkpoint \(4, 2\) vs now \(3, 2\)\).*fresh --workdir"):
        checkpointing.restore(mgr, target, {"run": "a"})
    mgr.close()


def test_only_unfinished_saves_start_afresh_with_a_warning(tmp_path, caplog):
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000").mkdir(parents=True)
    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    assert checkpointing.restore(mgr, {}, {"run": "a"}) is None
    assert "only unfinished saves ['3.orbax-checkpoint-tmp-1700000000']" in caplog.text
    mgr.close()


def test_an_older_checkpoints_meta_is_read_in_todays_form(tmp_path):
    """A checkpoint written before a model field existed (it took the field's default) or while a field was
    not yet resumable (`context_parallel`) is this run's; a field that really differs is still named."""
    import dataclasses

    from experiments import run_spec
    from lm import config as model_config

    model = dataclasses.asdict(model_config.ModelConfig())
    assert "context_parallel" in run_spec.RESUMABLE_MODEL_CHANGES
    now = {"model": {k: v for k, v in model.items() if k not in run_spec.RESUMABLE_MODEL_CHANGES}, "optimizer": {"name": "adamw"}}
    older = {"model": {k: v for k, v in model.items() if not k.startswith(("pipeline_", "router_"))}, "optimizer": {"name": "adamw"}}
    older["model"]["context_parallel"] = "ring"
    assert run_spec.upgrade_meta(older) == now
    mgr = checkpointing.manager(tmp_path, keep=1, every=1)
    checkpointing.save(mgr, 1, {"w": jnp.zeros(2)}, {"position": 1}, older, force=True)
    mgr.wait_until_finished()
    checkpointing.check_meta(mgr, 1, now, run_spec.upgrade_meta)
    with pytest.raises(checkpointing.CheckpointMismatch, match="model.router_scale: checkpoint 1.0 vs now 2.0"):
        checkpointing.check_meta(mgr, 1, {**now, "model": {**now["model"], "router_scale": 2.0}}, run_spec.upgrade_meta)
    with pytest.raises(checkpointing.CheckpointMismatch, match="model.context_parallel: checkpoint 'ring' vs now None"):
        checkpointing.check_meta(mgr, 1, now)  # read as written, the old meta differs
    mgr.close()
