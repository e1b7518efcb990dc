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


def _failing(error: BaseException):
    def restore(*args, **kwargs):
        try:
            raise error
        except BaseException as cause:  # as orbax does: its own error around tensorstore's or the device's
            raise RuntimeError("orbax could not restore the item") from cause

    return restore


@pytest.mark.parametrize(
    "error, fix",
    [
        (ValueError('UNAVAILABLE: Error reading "w/0" in OCDBT database at "gs://bucket/run/": connection reset'), "reachable"),
        (ValueError("PERMISSION_DENIED: HTTP response code: 403"), "may read"),
        (PermissionError(13, "Permission denied"), "may read"),
        (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB"), "more memory"),
    ],
)
def test_a_read_failing_outside_the_files_names_its_cause_and_never_advises_deleting(tmp_path, monkeypatch, error, fix):
    """Storage that does not answer or refuses access, or memory that runs out, says nothing about the step's
    files: the message keeps them (a deleted step cannot come back) and names what to fix."""
    mgr = _saved(tmp_path, [1, 2])
    monkeypatch.setattr(mgr, "restore", _failing(error))
    with pytest.raises(checkpointing.CheckpointUnreadable, match=r"step 2 cannot be read now .*not known to be damaged") as info:
        checkpointing.restore(mgr, {}, {"run": "a"})
    assert fix in str(info.value) and "delete" not in str(info.value) and type(error).__name__ in str(info.value)
    assert mgr.all_steps() == [1, 2]
    mgr.close()


def test_a_damaged_step_advises_deleting_it_and_any_other_error_is_raised_as_it_is(tmp_path, monkeypatch):
    """Damage (tensorstore's DATA_LOSS here; truncated and missing files in tests/experiments/test_train.py) names
    the step to delete; an error of the code that reads (a sharding that does not fit, a bug) is no verdict on the
    files, and reaches the user as it was raised."""
    mgr = _saved(tmp_path, [1, 2])
    monkeypatch.setattr(mgr, "restore", _failing(ValueError('DATA_LOSS: Error reading "w/0": checksum mismatch')))
    with pytest.raises(checkpointing.CheckpointUnreadable, match=r"step 2 cannot be read \(ValueError: DATA_LOSS.*delete .*2 .*--restore_step=1"):
        checkpointing.restore(mgr, {}, {"run": "a"})
    monkeypatch.setattr(mgr, "restore", _failing(ValueError("One of pjit outputs with pytree key path w was given the sharding")))
    with pytest.raises(RuntimeError, match="orbax could not restore") as info:
        checkpointing.restore(mgr, {}, {"run": "a"})
    assert not isinstance(info.value, checkpointing.CheckpointError)
    mgr.close()
