"""A workdir in object storage (`experiments.storage`): a local folder registered with fsspec as ``gs://`` stands in
for the bucket, so the run's metrics, TensorBoard events, plot and checkpoint listing go through the same
`etils.epath` calls as on GCS (orbax's array bytes go through tensorstore's own GCS driver; not stood in here)."""

import importlib
import os

import fsspec
import jax
import jax.numpy as jnp
import pytest
from fsspec.implementations.local import LocalFileSystem

from experiments import checkpointing, metrics_io, profiling, storage, trainer
from experiments.cli import UsageError
from experiments.configs import default


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """``gs://<name>/...`` read and written in ``tmp_path/<name>/...`` (epath's fsspec backend asks for ``gcs``)."""

    class FakeBucket(LocalFileSystem):
        protocol = ("gs", "gcs")

        def __init__(self, *args, finalize_on_close=None, **kwargs):  # epath passes GCS's option
            super().__init__(*args, **kwargs)

        @classmethod
        def _strip_protocol(cls, path):
            path = fsspec.utils.stringify_path(path)
            return super()._strip_protocol(str(tmp_path / path.removeprefix("gs://")) if path.startswith("gs://") else path)

    for name in FakeBucket.protocol:  # fsspec's registry (a read-only view of this dict), restored after the test
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, FakeBucket)
    filesystems = storage.epath.Path("gs://b")._backend._get_filesystem  # epath caches one per protocol
    filesystems.cache_clear()
    yield tmp_path
    filesystems.cache_clear()


def test_metrics_tensorboard_and_plot_go_to_the_bucket_and_resume_there(bucket):
    assert storage.is_remote("gs://b/run") and not storage.is_remote("runs/gs://x")
    writer = metrics_io.MetricsWriter("gs://b/run", config={"optimizer": {"name": "adamw"}})
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": 4.0 - step})
    writer.write_summary({"final_train_loss": 1.0})
    writer.close()
    metrics_io.plot_losses("gs://b/run/metrics.jsonl", "gs://b/run/loss.png")
    metrics_io.MetricsWriter("gs://b/other", enabled=False).write({"step": 1, "loss": 0.0})  # processes other than 0

    run = bucket / "b" / "run"
    assert [r["loss"] for r in metrics_io.read_metrics(run / "metrics.jsonl")] == [3.0, 2.0, 1.0]
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG")
    events = [os.path.join(d, f) for d, _, files in os.walk(run / "tensorboard") for f in files]
    assert len(events) == 2 and all(os.path.getsize(e) > 0 for e in events)  # scalars, and hparams with the summary
    assert not (bucket / "b" / "other").exists()

    resumed = metrics_io.MetricsWriter("gs://b/run", resume_step=2)  # resumed from step 2: step 3 is logged again
    resumed.write({"step": 3, "loss": 0.5})
    resumed.close()
    assert [r["loss"] for r in metrics_io.read_metrics("gs://b/run/metrics.jsonl")] == [3.0, 2.0, 0.5]


def test_checkpoints_are_listed_in_the_bucket_and_s3_names_the_fix(bucket):
    (bucket / "b" / "run" / "checkpoints" / "4").mkdir(parents=True)
    (bucket / "b" / "run" / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()  # a save cut short
    assert checkpointing.latest_step("gs://b/run") == 4
    assert str(storage.workdir("gs://b/run")) == "gs://b/run"
    with pytest.raises(UsageError, match="mount the bucket"):
        trainer.run(default.get_config(), "s3://b/run")


def test_a_profiler_trace_lands_in_the_bucket_from_process_0_only(bucket):
    """jax's profiler writes local files: the trace of steps 2-3 is copied into the bucket when it stops; a process
    other than 0 (``enabled=False``) traces nothing."""
    step, x = jax.jit(lambda v: v * 2.0 + 1.0), jnp.ones(8)
    for run, enabled in (("run", True), ("other", False)):
        trace = profiling.StepTrace((2, 3), f"gs://b/{run}", enabled=enabled)
        for i in (1, 2, 3, 4):
            with trace.begin(i, x):
                x = step(x)
            trace.end(i, x)
        trace.close(x)
    steps = {e["args"]["step_num"] for e in profiling.load_events(bucket / "b" / "run") if e.get("name") == "train"}
    assert steps == {"2", "3"}, steps
    assert list((bucket / "b" / "run" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert not (bucket / "b" / "other").exists()


def test_a_wandb_run_lands_in_the_bucket(bucket):
    """wandb writes local files only: an offline run's folder is copied into the bucket when the writer closes."""
    pytest.importorskip("wandb")
    writer = metrics_io.MetricsWriter("gs://b/run", config={"steps": 1}, wandb={"project": "spmdlab-test", "mode": "offline"})
    writer.write({"step": 1, "loss": 2.0})
    writer.close()
    assert (bucket / "b" / "run" / "wandb_id").is_file()
    assert list((bucket / "b" / "run" / "wandb").glob("offline-run-*/files"))
