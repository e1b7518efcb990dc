"""Inputs that are refused in one line naming the fix (exit code 2 at the command line): the rows of the
README's bad-input table that issue 42 added, each checked here."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags
from ml_collections import config_flags

from experiments import cli, run_spec, trainer
from experiments.configs import default
from lm.data import documents, tokenize
from tests.experiments import command_lines

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_train import small_config  # noqa: E402


def test_runs_started_in_the_same_second_get_their_own_workdirs(tmp_path, monkeypatch):
    """A sweep launched in a loop without --workdir (was: every run of a second wrote into one folder)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda _: "20261207-120000")
    made = [cli.fresh_workdir("tiny-adamw") for _ in range(3)]
    assert made == ["runs/20261207-120000-tiny-adamw", "runs/20261207-120000-tiny-adamw-2", "runs/20261207-120000-tiny-adamw-3"]
    assert all((tmp_path / path).is_dir() for path in made)
    with pytest.raises(cli.UsageError, match="a job of 2 processes needs --workdir"):
        cli.fresh_workdir("tiny-adamw", process_count=2)


def test_an_output_file_flag_makes_its_folder_and_refuses_a_folder_or_unwritable_path(tmp_path):
    """Every benchmark's --json_out (and evaluate's --out) is checked as the flags are parsed (bench_optimizer_step
    ran its rows, then died in `open` on a missing folder, its results lost)."""
    out = tmp_path / "new" / "deeper" / "results.json"
    values = flags.FlagValues()
    cli.define_output_file_flag("json_out", "Write the rows here.", flag_values=values)
    values(["bench", f"--json_out={out}"])
    assert out.parent.is_dir() and not out.exists()
    (tmp_path / "a_file").write_text("")
    for path, message in ((tmp_path, "is a folder; give a file name"), (tmp_path / "a_file" / "x.json", "cannot make the folder")):
        values = flags.FlagValues()
        cli.define_output_file_flag("json_out", "Write the rows here.", flag_values=values)
        with pytest.raises(flags.IllegalFlagValueError, match=message):
            values(["bench", f"--json_out={path}"])


def test_an_output_folder_flag_refuses_a_file_or_a_path_under_one(tmp_path):
    """Every script's output folder (--workdir, --out, --shards) is checked as the flags are parsed: a file there
    ended in a traceback from ``makedirs`` (train, compare_optimizers), or an error naming errno 17."""
    (tmp_path / "a_file").write_text("")
    writers = {
        "experiments.train": ["--workdir"], "experiments.compare_optimizers": ["--workdir"], "experiments.bench_comm": ["--workdir"],
        "experiments.eval_lopt": ["--workdir"], "experiments.meta_train": ["--workdir"], "experiments.speedrun": ["--workdir", "--shards"],
        "experiments.export_hf": ["--out"], "experiments.tokenize": ["--out"], "experiments.train_tokenizer": ["--out"],
    }  # fmt: skip
    required = {"experiments.export_hf": ["--workdir=run"], "experiments.speedrun": ["--workdir=run"]}
    calls = [
        (module, [*required.get(module, []), f"{flag}={path}"])
        for module, names in writers.items()
        for flag in names
        for path in (tmp_path / "a_file", tmp_path / "a_file" / "below", tmp_path / "new" / "folder")
    ]
    refused = {(module, args[-1]): why for module, args, why in command_lines.refusals(calls)}
    for module, args in calls:
        if "a_file" in args[-1]:
            assert "a_file is a file, not a folder; give a folder" in refused.get((module, args[-1]), ""), (module, args)
        else:
            assert (module, args[-1]) not in refused, refused[(module, args[-1])]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 0}, "config.batch_size=0 must be >= 1"),
        ({"data.seq_len": 0}, "config.data.seq_len=0 must be >= 1"),
        ({"steps": -3}, "config.steps=-3 must be >= 1"),
        ({"eval_every": 0}, "config.eval_every=0 must be >= 1"),
        ({"log_every": -1}, "config.log_every=-1 must be >= 1"),
        ({"model.d_model": 0}, "config.model.d_model=0 must be >= 1"),
        ({"optimizer.warmup_steps": -1}, "config.optimizer.warmup_steps=-1 must be >= 0"),
        # a negative clipping norm or loss weight would ascend the loss; these were accepted
        ({"optimizer.grad_clip_norm": -1.0}, "config.optimizer.grad_clip_norm=-1.0 must be >= 0"),
        ({"loss.z_loss": -1e-4}, "config.loss.z_loss=-0.0001 must be >= 0"),
        ({"moe.balance_loss": -0.01}, "config.moe.balance_loss=-0.01 must be >= 0"),
        ({"optimizer.min_lr_ratio": 1.5}, "optimizer.min_lr_ratio=1.5 must lie in \\[0, 1\\]"),
        # settings the schedule does not read; these were ignored
        ({"optimizer.decay_fraction": 0.3}, "optimizer.decay_fraction=0.3 is not read by schedule 'cosine'; leave it at 0.2"),
        ({"optimizer.schedule": "constant", "optimizer.min_lr_ratio": 0.0}, "optimizer.min_lr_ratio=0.0 is not read by schedule 'constant'"),
        ({"model.rope_theta": 0.0}, "model.rope_theta=0.0 must be > 0"),
        ({"optimizer.state_kernel": "triton"}, "optimizer.state_kernel='triton' must be one of auto, xla, pallas"),  # ignored at fp32
        ({"mesh": "foo:1"}, None),  # a one-device axis no rule uses does no duplicate work: accepted
        pytest.param({"mesh": "data:4,foo:2", "devices": 8}, "mesh axis 'foo' \\(2 devices\\) is used by no rule of --config.rules=fsdp",
                     marks=pytest.mark.devices(8)),
        pytest.param({"mesh": "fsdp:4,tensor:2", "devices": 8}, "mesh axis 'tensor' .* used by no rule of --config.rules=fsdp, .* mlp=tensor",
                     marks=pytest.mark.devices(8)),
        pytest.param({"mesh": "data:2,seq:4", "rules": "sp", "devices": 8, "model.attention_window": 16, "model.window_block": 8},
                     "model.attention_window=16 attends within whole sequences, and the rules split the sequence over seq",
                     marks=pytest.mark.devices(8)),
        # found at the first evaluation, after training had started (a traceback from the traced step)
        pytest.param({"mesh": "stage:2,data:4", "devices": 8, "model.n_layers": 2, "model.pipeline_microbatches": 2,
                      "model.pipeline_vocab_parallel": True, "model.tie_embeddings": False, "data.val_tokens": 1000},
                     "data.val_tokens=1000 is not whole batches of 8 x 32 targets, .* a multiple of 256 \\(e.g. 768 or 1024\\)",
                     marks=pytest.mark.devices(8)),
        ({"optimizer.name": "muon_clip", "model.attention_window": 16}, "muon_clip clips by the attention's max logits, .* model.attention_window=0"),
        ({"rule_overrides": "mlp=tensor"}, "rule_overrides mlp=tensor: mesh axis 'tensor' is not in mesh \\{'data': 1\\}"),
        ({"rule_overrides": "mlp=tensor?"}, None),  # an optional axis may be absent
        # warmup scales with a short run, so the first real mistake is named, not warmup > steps
        ({"steps": 2, "optimizer.warmup_steps": None, "data.path": "/no/such/corpus"}, "does not exist"),
        ({"steps": 2, "optimizer.warmup_steps": 5}, "optimizer.warmup_steps=5 must lie in \\[0, steps=2\\]"),
        ({"data.path": "corpus.txt", "data.train_files": "x/train_*.bin"}, "data.path \\(a text corpus\\) and data.train_files \\(token shards\\) are both set"),
        ({"optimizer.name": "micro_adam", "optimizer.micro_adam.topk_block": 1000}, "topk_block=1000 must be a power of two >= 2, e.g. 512"),
        ({"wandb.project": "p"}, "wandb.project=p needs Weights & Biases: pip install -e '.\\[wandb\\]'"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_key(tmp_path, overrides, message):
    if "wandb.project" in overrides and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    config = small_config(**overrides)
    if message is None:
        spec = run_spec.build_run(config)
        assert spec.mesh.size == 1
        return
    with pytest.raises(cli.UsageError, match=message):
        trainer.run(config, tmp_path / "w")
    assert not (tmp_path / "w").exists()  # refused before anything is written


def test_a_short_run_takes_a_short_warmup():
    spec = run_spec.build_run(small_config(steps=2, **{"optimizer.warmup_steps": None}))
    assert spec.tx is not None  # warmup min(20, 2 // 10) = 0 fits in 2 steps


def test_error_messages_keep_their_closing_quote(monkeypatch):
    def check(config):
        raise ValueError("data.path='x y'")

    monkeypatch.setattr(run_spec, "check_values", check)
    with pytest.raises(cli.UsageError) as e:
        run_spec.build_run(small_config())
    assert str(e.value) == "data.path='x y'"


def _main(module, *args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(result, message):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_cli_zero_batch_and_missing_json_config_exit_2_in_one_line(tmp_path):
    _one_line_exit_2(_main("experiments.train", f"--workdir={tmp_path}", "--config.batch_size=0", cwd=tmp_path), "config.batch_size=0 must be >= 1")
    _one_line_exit_2(_main("experiments.train", "--config=nowhere/config.json", cwd=tmp_path), "--config=nowhere/config.json: no such file")


@pytest.mark.parametrize(
    "config, message",
    [
        ("", r"IsADirectoryError: \[Errno 21\] Is a directory: '.*'\)"),  # were tracebacks: the folder's at first use,
        ("missing.py", r"No such file or directory: '.*missing.py'\)"),  # the missing file's too
        ("notes.txt", r"SyntaxError: invalid syntax \(notes.txt, line 1\)\)"),  # not Python
        ("bad.py", r"NameError: name 'hello' is not defined, at .*bad.py line 1\)"),  # a bug in it
    ],
)
def test_a_config_file_that_fails_to_load_is_one_line_and_exit_2(config, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("hello world\n")
    (tmp_path / "bad.py").write_text("hello\n")
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config", flag_values=values, lock_config=True)
    monkeypatch.setattr(flags, "FLAGS", values)  # `cli.parse_flags` parses the process's flags
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(["train", f"--config={tmp_path / config}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and re.search("error: the --config file failed to load .*" + message, err), err
    assert err.rstrip().endswith("give a Python file with get_config() (experiments/configs/) or a run's config.json")


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.optimizer.nme=sgd", """unknown config key 'optimizer.nme' (Did you mean "name" instead of "nme"?); the keys are listed in """),
        ("--config.x.y=1", "unknown config key 'x'; the keys are listed in "),
        ("--config.replicas.axis=data", "--config.replicas.axis: 'replicas' is a setting, not a block of keys"),
    ],
)
@pytest.mark.parametrize("config", ["experiments/configs/tiny_muon.py", "config.json"])
def test_an_override_the_given_config_file_lacks_is_named_like_one_of_the_default_file(
    config, override, message, tmp_path, monkeypatch, capsys
):
    """With ``--config=FILE`` the overrides are applied while absl parses: an unknown key read "the --config file
    failed to load (AttributeError ...)" or "'x'", a key below a setting "string indices must be integers"."""
    if config == "config.json":
        (tmp_path / config).write_text(json.dumps(default.get_config().to_dict()))
        config = str(tmp_path / config)
    else:
        config = str(REPO / config)
    argv = ["train", f"--config={config}", override]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections defines the override flags that argv names
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", cli.DEFAULT_CONFIG, "config", flag_values=values, lock_config=True)
    monkeypatch.setattr(flags, "FLAGS", values)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_flags(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err
    if "unknown" in message:
        assert err.rstrip().endswith(config)  # the file the user gave, not the reader of a run's config.json


LATIN1 = "café = 'naïve'\n".encode("latin-1") * 50


def test_non_utf8_text_is_refused_naming_file_and_byte(tmp_path):
    (tmp_path / "in.txt").write_bytes(LATIN1)
    with pytest.raises(documents.DocumentError, match=r"in.txt is not UTF-8 \(byte 3: .*--errors=replace"):
        tokenize.tokenize("bytes", [tmp_path / "in.txt"], tmp_path / "out", val_fraction=0.0, shard_tokens=10**6, workers=1)
    assert not list((tmp_path / "out").glob("*.bin"))
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "' + LATIN1[:20] + b'"}\n')
    with pytest.raises(documents.DocumentError, match="in.jsonl is not UTF-8"):
        list(documents.read(tmp_path / "in.jsonl"))


def test_replaced_bytes_are_counted_as_the_bytes_they_were(tmp_path):
    (tmp_path / "in.txt").write_bytes(LATIN1)
    manifest = tokenize.tokenize("bytes", [tmp_path / "in.txt"], tmp_path / "out", val_fraction=0.0, shard_tokens=10**6, workers=1, errors="replace")
    assert manifest["splits"]["train"]["bytes"] == len(LATIN1)  # not the 3 bytes of each U+FFFD
    assert manifest["splits"]["train"]["tokens"] == 1 + len(LATIN1.decode("utf-8", errors="replace").encode("utf-8"))


def test_cli_tokenize_and_train_tokenizer_refuse_non_utf8_with_exit_2(tmp_path):
    (tmp_path / "in.txt").write_bytes(LATIN1)
    result = _main("experiments.tokenize", f"--input={tmp_path / 'in.txt'}", f"--out={tmp_path / 'out'}", "--workers=1", cwd=tmp_path)
    _one_line_exit_2(result, "in.txt is not UTF-8")
    result = _main("experiments.train_tokenizer", f"--input={tmp_path / 'in.txt'}", f"--out={tmp_path / 'tok'}", "--vocab_size=300", cwd=tmp_path)
    _one_line_exit_2(result, "in.txt is not UTF-8")
    result = _main("experiments.tokenize", f"--input={tmp_path / 'in.txt'}", f"--out={tmp_path / 'out'}", "--workers=1", "--errors=replace", "--val_fraction=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"]["train"]["bytes"] == len(LATIN1)


def test_an_unknown_data_setting_is_named():
    config = small_config()
    with config.data.unlocked():
        config.data.shuffle_buffer_typo = 3
    with pytest.raises(ValueError, match="config.data has no setting shuffle_buffer_typo: the data settings are .*seq_len"):
        run_spec.data_config(config)


def test_a_count_flag_below_one_is_named(capsys):
    """`cli.check_counts` and `cli.require_counts`, which the benchmarks call before compiling (bench_optimizer_step's
    --repeats=0 died in `statistics.median` after compiling every row; bench_data's --batches=0 reported 0 tokens/s)."""
    values = flags.FlagValues()
    flags.DEFINE_integer("repeats", 0, "a count", flag_values=values)
    for count in (0, -2):
        values["repeats"].value = count
        with pytest.raises(cli.UsageError, match=f"--repeats={count} must be >= 1"):
            cli.check_counts("repeats", flag_values=values)
        with pytest.raises(SystemExit) as exit_info:  # the benchmarks' mains (bench_kernels --iters=0 crashed likewise)
            cli.require_counts("repeats", flag_values=values)
        assert exit_info.value.code == 2 and f"error: --repeats={count} must be >= 1" in capsys.readouterr().err
    values["repeats"].value = 1
    cli.check_counts("repeats", flag_values=values)
    cli.require_counts("repeats", flag_values=values)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.optimizer.muon.learning_rate=1", "unknown config key 'optimizer.muon.learning_rate' (did you mean --config.optimizer.learning_rate?)"),
        ("--config.model.seq_len=64", """unknown config key 'model.seq_len' (Did you mean "max_seq_len" instead of "seq_len"? or --config.data.seq_len?)"""),
        ("--config.lr=1", f"unknown config key 'lr'; the keys are listed in {cli.DEFAULT_CONFIG}"),
        # absl's own flag, defined in every script: as --config.workdir for train.py's --workdir
        ("--config.verbosity=1", "unknown config key 'verbosity' (--verbosity is a flag of this script, not a config key)"),
        ("--config.model.x.y=1", "unknown config key 'model.x';"),
        ("--config.x.y=1", "unknown config key 'x';"),
        # a key below a setting: ml_collections raised TypeError (a str), ValueError (None) or AttributeError (an int)
        ("--config.replicas.axis=data", "--config.replicas.axis: 'replicas' is a setting, not a block of keys; give --config.replicas=VALUE"),
        ("--config.model.n_layers.x=1", "'model.n_layers' is a setting, not a block of keys; give --config.model.n_layers=VALUE"),
        ("--config.steps.x=1", "'steps' is a setting, not a block of keys"),
    ],
)
def test_an_unknown_config_key_is_named_whole_with_the_blocks_that_have_it(monkeypatch, capsys, override, message):
    """ml_collections names only the last part of an unknown ``--config.<key>`` (was: "unknown config key
    'learning_rate'"); the same key in another block is the likely fix."""
    monkeypatch.setattr(sys, "argv", ["train", override])
    with pytest.raises(SystemExit) as exit_:
        cli.define_config_flag(cli.DEFAULT_CONFIG)  # refused before the flag is registered
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_every_script_parses_its_flags_into_one_line_errors():
    """absl's own parser answers a mistyped flag with a "FATAL Flags parsing error" block and exit code 1;
    `cli.parse_flags` with one line and exit code 2 (evaluate, sample and six more used absl's)."""
    scripts = {p.name: p.read_text() for p in (REPO / "experiments").glob("*.py") if "app.run(" in p.read_text()}
    assert len(scripts) >= 20, sorted(scripts)
    pattern = re.compile(r"app\.run\(.*flags_parser=cli\.parse_flags")
    assert sorted(name for name, text in scripts.items() if not pattern.search(text)) == []
    result = _main("experiments.sample", "--workdir=w", "--bogus=1", cwd=REPO)
    _one_line_exit_2(result, "Unknown command line flag 'bogus'")


def test_bench_context_refuses_zero_steps_in_one_line(tmp_path):
    """``--sections=exact --exact_steps=0`` ended in an IndexError traceback after the model was built."""
    result = _main("experiments.bench_context", "--sections=exact", "--exact_steps=0", cwd=tmp_path)
    _one_line_exit_2(result, "--exact_steps=0 must be >= 1")


def test_an_int_list_flag_refuses_what_is_not_positive_integers():
    """bench_lightning --seqs=abc, bench_pipeline --microbatches=x, bench_context --seq_lens=abc: ValueError tracebacks
    where the script read them."""
    values = flags.FlagValues()
    cli.define_int_list_flag("seqs", [256, 1024], "lengths", flag_values=values)
    cli.define_int_list_flag("batches", [8], "batches", allow_empty=True, flag_values=values)
    values(["bench", "--seqs=4,16", "--batches="])
    assert (values.seqs, values.batches) == (["4", "16"], [])
    for bad, why in (("abc", "not comma-separated positive integers, e.g. 256,1024"), ("4,0", "not comma-separated"), ("", "empty")):
        with pytest.raises(flags.IllegalFlagValueError, match=why):
            values(["bench", f"--seqs={bad}"])
    cli.define_int_list_flag("ids", None, "devices", minimum=0, example="0,1", flag_values=values)
    values(["bench", "--seqs=4", "--ids=0,3"])
    assert values.ids == ["0", "3"]
    with pytest.raises(flags.IllegalFlagValueError, match=r"not comma-separated integers >= 0, e.g. 0,1"):
        values(["bench", "--ids=a,b"])  # train --local_device_ids=a,b said "invalid literal for int()"

