"""The speedrun harness (`experiments.speedrun`) end to end on stdlib shards: it stops at its target."""

import functools
import json

import pytest

from experiments import cli, speedrun, trainer
from experiments.configs import speedrun as speedrun_config
from experiments.metrics_io import read_metrics


def _tiny_config():
    config = speedrun_config.get_config("tiny")
    config.model.update({"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "head_dim": 16, "mlp_dim": 64})
    config.model.update({"window_pattern": "LS", "attention_window": 16, "window_block": 8})
    config.steps, config.batch_size, config.data.seq_len, config.data.val_tokens = 8, 4, 32, 256
    config.eval_every, config.log_every, config.devices = 2, 1, 1
    config.target_val_loss = 5.6  # the zero head starts at log(384) = 5.95: val 5.80 after 2 steps, 5.54 after 4
    return config


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    return speedrun.stdlib_shards(tmp_path_factory.mktemp("shards"), max_files=12, val_fraction=0.3)


def test_harness_builds_stdlib_shards_and_stops_at_the_target(tmp_path, shard_dir):
    report = speedrun.run(_tiny_config(), tmp_path / "run", shard_dir=shard_dir, max_files=12, val_fraction=0.3)
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    assert manifest["tokenizer"] == "bytes" and manifest["splits"]["val"]["tokens"] > 256
    assert report["reached_target"] and report["steps_to_target"] == 4 and report["final_val_loss"] <= 5.6
    assert report["tokens_to_target"] == 4 * 4 * 32 and report["seconds_to_target"] > 0
    assert max(r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")) == 4  # stopped, not 8 steps
    assert json.loads((tmp_path / "run" / "speedrun.json").read_text()) == report
    assert "reached val loss 5.6" in speedrun.describe(report)
    # A rerun into the finished workdir keeps it as it is (was: resumed at step 4 and trained to step 8, writing
    # that run's report over this one).
    assert speedrun.run(_tiny_config(), tmp_path / "run", shard_dir=shard_dir, max_files=12, val_fraction=0.3) == report
    assert max(r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")) == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps_to_target"] == 4
    # The shards are reused for the same request only: another one (here 13 files) would have trained on these 12.
    assert speedrun.stdlib_shards(shard_dir, max_files=12, val_fraction=0.3) == shard_dir  # as the runs above did
    with pytest.raises(cli.UsageError, match="holds shards written for .'max_files': 12, 'val_fraction': 0.3., not this run's"):
        speedrun.stdlib_shards(shard_dir, max_files=13, val_fraction=0.3)
    with pytest.raises(cli.UsageError, match="--max_files=-1 must be >= 0"):  # was every file but the last
        speedrun.stdlib_shards(tmp_path / "other", max_files=-1)


def test_stdlib_shards_read_the_stdlibs_files_that_are_not_utf8(tmp_path, monkeypatch):
    """The README's CPU speedrun, all stdlib files, died on test/encoded_modules/module_iso_8859_1.py."""
    latin1, plain = tmp_path / "module_iso_8859_1.py", [tmp_path / f"plain{i}.py" for i in range(40)]
    latin1.write_bytes("s = 'café'\n".encode("latin-1"))
    for i, file in enumerate(plain):  # enough documents that some fall in the validation split
        file.write_text(f"x = {i}\n")
    monkeypatch.setattr(speedrun.corpus, "list_documents", lambda root, python_only: [latin1, *plain])
    manifest = json.loads((speedrun.stdlib_shards(tmp_path / "shards") / "manifest.json").read_text())
    assert sum(split["documents"] for split in manifest["splits"].values()) == 41
    assert sum(split["bytes"] for split in manifest["splits"].values()) == sum(f.stat().st_size for f in [latin1, *plain])


def test_a_preempted_speedrun_resumes_to_its_target_and_times_every_step(tmp_path, shard_dir):
    """The report's seconds add the preempted process's (were: only the resumed steps', with steps_to_target
    counting all of them), from the trainer's per-checkpoint record; without the record it says which it timed."""
    run = functools.partial(speedrun.run, _tiny_config(), tmp_path / "run", shard_dir=shard_dir, max_files=12, val_fraction=0.3)
    assert run(interrupt_at=2)["interrupted"]
    (first,) = [json.loads(line) for line in (tmp_path / "run" / trainer.TIMING).read_text().splitlines()]
    assert first["step"] == 2 and first["seconds"] > 0
    report = run()
    assert report["reached_target"] and report["steps_to_target"] == 4 and report["resumed_from_step"] == 2
    assert report["timed_from_step"] == 0 and report["seconds_to_target"] > first["seconds"]
    assert "(resumed at step 2; the seconds include the earlier processes' steps)" in speedrun.describe(report)
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / trainer.TIMING).read_text().splitlines()] == [2, 4]
    settings = trainer.LoopSettings(steps=4, batch_size=1, seq_len=1, eval_every=1, log_every=1, max_bad_steps=1, target_val_loss=5.6)
    unknown = trainer._to_target(settings, [9.0, 1.0, 3.0], 4, 2, None)  # a checkpoint with no record: own steps only
    assert unknown["timed_from_step"] == 2 and unknown["seconds_to_target"] == 1.0 + 3.0 + 2.0
    assert trainer._to_target(settings, [9.0, 1.0, 3.0], 4, 2, 10.0)["seconds_to_target"] == 10.0 + 6.0
    assert "the seconds are those of steps 3 on" in speedrun.describe(report | {"timed_from_step": 2})
