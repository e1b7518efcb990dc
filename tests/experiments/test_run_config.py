"""A run's written config (resolved, repeatable, one optimizer block), reruns that never destroy results,
and readers of a workdir that work from any folder (issue 42; issue 43, deliverable 6)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cli, restore, run_spec, trainer
from experiments.configs import default, resolved
from experiments.metrics_io import read_metrics
from lm.data import documents, tokenize, tokenizer
from optim import build, registry, schedules

REPO = Path(__file__).resolve().parents[2]


def _count(tree: dict) -> int:
    return sum(_count(v) if isinstance(v, dict) else 1 for v in tree.values())


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A 300-id BPE and shards of it, under ``root/data``; returned with ``root``."""
    root = tmp_path_factory.mktemp("bpe")
    (root / "text").mkdir()
    for i in range(30):
        (root / "text" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + y  # sum\n" * (4 + i % 7))
    files = documents.expand(str(root / "text"))
    tokenizer_file = tokenizer.train_bpe((t for f in files for t in documents.read(f)), 300, root / "tok")
    tokenize.tokenize(str(tokenizer_file), files, root / "data", val_fraction=0.2, shard_tokens=2000, workers=1)
    return root


def _config(**overrides):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 4, 8, 32
    config.eval_every, config.eval_batches, config.log_every, config.checkpoint_every = 4, 2, 1, 4
    config.devices = 1
    config.data.train_files, config.data.val_files = "data/train_*.bin", "data/val_*.bin"  # relative to the cwd
    config.update_from_flattened_dict(overrides)
    return config


@pytest.fixture(scope="module")
def run(shards):
    """A 4-step run on the shards, started in the shards' folder with relative paths; ``(workdir, summary)``."""
    cwd = os.getcwd()
    os.chdir(shards)
    try:
        summary = trainer.run(_config(), shards / "runs" / "a")
    finally:
        os.chdir(cwd)
    return shards / "runs" / "a", summary


def test_config_json_holds_every_resolved_value_and_only_the_optimizer_it_uses(run, shards):
    workdir, _ = run
    written = json.loads((workdir / "config.json").read_text())
    adamw = registry.spec_class("adamw")
    assert written["optimizer"]["learning_rate"] == adamw.learning_rate  # None before: the spec's default
    assert written["optimizer"]["weight_decay"] == adamw.weight_decay
    assert written["optimizer"]["warmup_steps"] == schedules.default_warmup(4) == 0
    assert {k for k in written["optimizer"] if k in registry.OPTIMIZERS} == {"adamw"}
    assert written["optimizer"]["lookahead"]["stepsize"] == 0.0  # the run wrappers' settings, off
    assert written["model"]["d_model"] == 128 and written["model"]["n_layers"] == 4  # the `tiny` preset's
    assert written["model"]["vocab_size"] == 384  # from the manifest: 300 padded to 128
    data = written["data"]
    assert data["train_files"] == str(shards / "data" / "train_*.bin")  # absolute: works from any folder
    assert data["tokenizer"].endswith("tokenizer.json") and data["separator_id"] is not None
    assert _count(written) < _count(default.get_config().to_dict()) / 2  # every optimizer's block: three times as many


def test_a_config_json_that_is_not_a_runs_is_named(tmp_path):
    """--config=EXPORT/config.json trained the default model with the transformers keys laid over it."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match=f"a transformers checkpoint's config.json, not a run's: .*--config.init_from_hf={tmp_path}"):
        resolved.get_config(str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(ValueError, match="is not a run's config.json .no model, data and optimizer blocks."):
        resolved.get_config(str(tmp_path / "config.json"))


def test_run_repeats_from_its_config_json_alone(run, tmp_path):
    workdir, summary = run
    config = resolved.get_config(str(workdir / "config.json"))  # what --config=runs/x/config.json loads
    again = trainer.run(config, tmp_path / "again")  # from another folder: the paths are absolute
    assert again["final_val_loss"] == summary["final_val_loss"]
    assert [r["loss"] for r in read_metrics(tmp_path / "again" / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(workdir / "metrics.jsonl")
    ]


def test_readers_of_a_workdir_need_only_the_workdir(run, shards, tmp_path, monkeypatch):
    workdir, _ = run
    (shards / "tok" / "tokenizer.json").rename(shards / "tok" / "moved.json")  # the original tokenizer is gone
    monkeypatch.chdir(tmp_path)  # and the relative shard paths do not resolve here
    try:
        tok = restore.load_tokenizer(workdir)
        assert tok.vocab_size == 300 and Path(restore.run_manifest(workdir)["tokenizer"]).parent == workdir
        spec, _, step = restore.restore_run(workdir)
        assert step == 4 and spec.cfg.vocab_size == 384
    finally:
        (shards / "tok" / "moved.json").rename(shards / "tok" / "tokenizer.json")


def test_rerun_of_a_finished_run_keeps_its_files_and_raised_steps_continue(run, shards, tmp_path, capsys):
    workdir = tmp_path / "w"
    config = resolved.get_config(str(run[0] / "config.json"))
    assert trainer.run(config, workdir, interrupt_at=2)["interrupted"]
    assert f"rerun with --workdir={workdir} to resume" in capsys.readouterr().err
    trainer.run(config, workdir)
    resumed = capsys.readouterr().err
    assert "resuming from step 2 of 4" in resumed and "learning rate" not in resumed  # the same schedule
    before = {name: (workdir / name).read_bytes() for name in ("summary.json", "config.json", "metrics.jsonl")}
    capsys.readouterr()
    again = trainer.run(config, workdir)
    assert again["finished"] and again["final_val_loss"] is not None
    assert "already finished" in capsys.readouterr().err
    assert {name: (workdir / name).read_bytes() for name in before} == before
    saved = config.optimizer.to_dict()
    config.unlock()
    config.steps, config.optimizer.learning_rate = 6, 2e-3
    longer = trainer.run(config, workdir)
    err = capsys.readouterr().err
    assert "resuming from step 4 of 6" in err
    before, now = build.learning_rate_fn(saved, 4)(4), build.learning_rate_fn(config.optimizer, 6)(4)
    assert (
        f"the learning rate of step 5 is {float(now):.3g}, where the saved run's schedule gave {float(before):.3g} "
        f"(steps=4 -> 6, optimizer.learning_rate={saved['learning_rate']} -> 0.002: the schedule is recomputed for this run)"
    ) in err
    assert longer["steps"] == 6 and json.loads((workdir / "summary.json").read_text())["steps"] == 6


def test_config_argument_materialises_only_that_optimizer():
    muon = default.get_config("muon")
    assert muon.optimizer.name == "muon"
    assert [k for k, v in muon.optimizer.items() if k in registry.OPTIMIZERS] == ["muon"]
    diloco = default.get_config("diloco")
    assert sorted(k for k, v in diloco.optimizer.items() if k in registry.OPTIMIZERS) == ["adamw", "diloco"]
    with pytest.raises(ValueError, match="unknown optimizer 'muonn'"):
        default.get_config("muonn")


def test_resolve_keeps_the_blocks_of_the_chosen_optimizer_and_its_overrides():
    config = default.get_config()  # every block, as --config.optimizer.name=X needs
    config.devices = 1
    config.optimizer.name = "diloco"
    config.optimizer.diloco.inner = "sgd"
    config.optimizer.sgd.momentum = 0.5
    spec = run_spec.build_run(config)
    out = run_spec.resolve(config, spec.cfg)
    assert sorted(k for k, v in out.optimizer.items() if k in registry.OPTIMIZERS) == ["diloco", "sgd"]
    assert out.optimizer.sgd.momentum == 0.5 and out.optimizer.learning_rate == registry.spec_class("sgd").learning_rate
    assert len(registry.OPTIMIZERS) > 10 and "muon" in config.optimizer  # the input is left whole


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_list_config_lists_every_key_with_help_and_reads_a_json_config(run, tmp_path):
    result = _cli(f"--config={run[0] / 'config.json'}", "--config.steps=9", "--list_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "--config.steps=9" in lines[[l.split()[0] for l in lines].index("--config.steps=9")]
    assert any(l.startswith("--config.optimizer.learning_rate=0.003") for l in lines)
    keys = [l for l in lines if l.startswith("--config.")]
    assert keys and all("  # " in l for l in keys), [l for l in keys if "  # " not in l]
    full = _cli("--config=experiments/configs/default.py", "--list_config", cwd=REPO)
    headers = [l for l in full.stdout.splitlines() if l.startswith("# optimizer.")]
    assert len(headers) == len(registry.OPTIMIZERS) and any(h.startswith("# optimizer.muon: defaults learning_rate") for h in headers)
    muon = _cli("--config=experiments/configs/default.py:muon", "--config.optimizer.muon.beta=0.9", "--list_config", cwd=REPO)
    assert [l for l in muon.stdout.splitlines() if l.startswith("# optimizer.")] == [headers[[h.split(":")[0] for h in headers].index("# optimizer.muon")]]
    assert any(l.startswith("--config.optimizer.muon.beta=0.9") for l in muon.stdout.splitlines())


def test_unknown_optimizer_in_the_config_argument_is_one_line(tmp_path):
    result = _cli("--config=experiments/configs/default.py:muonn", "--list_config", cwd=REPO)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "unknown optimizer 'muonn'" in result.stderr


def test_a_checked_tokenizer_that_is_not_the_shards_is_refused(shards, monkeypatch):
    monkeypatch.chdir(shards)
    config = _config(**{"data.tokenizer": "bytes"})
    with pytest.raises(cli.UsageError, match="data.tokenizer=bytes is not the tokenizer the training data was written with"):
        trainer.run(config, shards / "runs" / "refused")
    assert not (shards / "runs" / "refused").exists()


def test_help_lists_the_shared_flags_and_points_to_the_config_listing(tmp_path):
    out = _cli("--help", cwd=tmp_path).stdout
    assert "--[no]verbose" in out and "--[no]list_config" in out and "--config: Config file" in out
