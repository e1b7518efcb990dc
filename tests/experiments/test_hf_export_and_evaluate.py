"""A training run exported as a transformers checkpoint, trained on from it, and evaluated.

One small Qwen3-shaped run (QK-norm) on 8 CPU devices; the export, the import into a new run and
the evaluations all read it.
"""

import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import cli, evaluate, export_hf, restore, run_spec, trainer
from experiments.configs import default
from lm import hf
from lm import model as model_lib
from lm.data import shards, tokenizer

REPO = Path(evaluate.__file__).parents[1]
TASK = REPO / "tests" / "data" / "eval" / "synthetic_choice.jsonl"
MODEL = {"model.n_layers": 2, "model.d_model": 64, "model.mlp_dim": 128, "model.head_dim": 16, "model.qk_norm": True}


def _config(**overrides):
    config = default.get_config()
    config.update_from_flattened_dict(
        {"steps": 4, "batch_size": 8, "data.seq_len": 32, "eval_every": 4, "eval_batches": 2, "log_every": 1,
         "checkpoint_every": 4, "optimizer.warmup_steps": 1, **overrides}
    )  # fmt: skip
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    trainer.run(_config(**MODEL), workdir)
    return workdir


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_hf.export(run, out, max_shard_bytes=100_000)
    return out


def test_the_export_is_the_runs_model(run, exported):
    assert json.loads((exported / hf.CONFIG).read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (exported / hf.INDEX_FILE).is_file()
    model_def, params, step = restore.load_params(run)
    hf_def, hf_params = hf.load_model(exported)
    assert step == 4 and hf_def.config == model_def.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_capacity_limited_moe_export_says_transformers_routes_every_token(tmp_path, monkeypatch, caplog):
    """transformers' Mixtral has no expert capacity: the export is the dropless model the run samples with, and
    says so, since its logits differ from the run's forward pass wherever a token overflowed."""
    import dataclasses

    from lm.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=32, max_seq_len=32,
        n_experts=4, experts_per_token=2, expert_mlp_dim=32, normalize_router_weights=True,
    )  # fmt: skip
    monkeypatch.setattr(export_hf, "run_manifest", lambda workdir: None)
    for factor, warned in ((1.25, True), (0.0, False)):
        model_def = model_lib.define(dataclasses.replace(cfg, capacity_factor=factor))
        monkeypatch.setattr(export_hf, "load_params", lambda *_, m=model_def: (m, model_lib.init_params(m, 0), 4))
        caplog.clear()
        export_hf.export(tmp_path / "run", tmp_path / f"export{factor}")
        assert ("routes every token (dropless)" in caplog.text) == warned, caplog.text
        assert "MixtralForCausalLM" in caplog.text or not warned


def test_a_run_starts_from_the_export(run, exported, tmp_path):
    config = _config(**{"init_from_hf": str(exported), "optimizer.learning_rate": 0.0, "steps": 2, "checkpoint_every": 2})
    trainer.run(config, tmp_path)
    _, start, _ = restore.load_params(tmp_path)
    _, trained, _ = restore.load_params(run)
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_that_contradicts_the_checkpoint_is_refused(exported, tmp_path):
    with pytest.raises(cli.UsageError, match=r"model.d_model=96 \(config.json: 64\)"):
        trainer.run(_config(**{"init_from_hf": str(exported), "model.d_model": 96}), tmp_path)
    # a setting the checkpoint's architecture does not compute (it has no parameters to contradict)
    with pytest.raises(cli.UsageError, match=r"init_from_hf: .*model.logit_softcap=15.0: transformers'"):
        trainer.run(_config(**{"init_from_hf": str(exported), "model.logit_softcap": 15.0}), tmp_path / "capped")
    assert not (tmp_path / "capped").exists()
    # a preset chosen beside the checkpoint (was: ignored, the run trained the checkpoint's shape)
    with pytest.raises(cli.UsageError, match=r"model.preset=small \(d_model=512; config.json: 64\); drop those keys"):
        trainer.run(_config(**{"init_from_hf": str(exported), "model.preset": "small"}), tmp_path / "small")
    assert not (tmp_path / "small").exists()


def test_validation_bits_per_byte_match_training(run):
    summary = json.loads((run / "summary.json").read_text())
    results = evaluate.evaluate(workdir=str(run), batch_size=8)
    assert math.isclose(results["val_loss"], summary["final_val_loss"], rel_tol=1e-5)
    assert math.isclose(results["val_bits_per_byte"], summary["final_val_loss"] / math.log(2), rel_tol=1e-5)


def _forward(model_def):
    return jax.jit(functools.partial(model_lib.apply, model_def))


def _one_device_log_likelihood(forward, params, tokens, n_scored, width=128):
    """Log-likelihood of the last ``n_scored`` tokens of ``tokens``, one row on one device (right-padded to
    ``width``, which causal attention keeps from the scored positions, so one program serves every row)."""
    params = jax.device_put(params, jax.devices()[0])
    padded = np.zeros(width, np.int32)
    padded[: len(tokens)] = tokens
    logits = forward(params, jnp.asarray(padded[None, :-1]))[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return sum(logp[t - 1, tokens[t]] for t in range(len(tokens) - n_scored, len(tokens)))


def test_multiple_choice_equals_unbatched_scoring_of_each_choice(exported):
    scorer = evaluate.from_hf(exported)
    assert scorer.batch_shards == jax.device_count()  # the batch split over every device (8 fake CPU ones; 1 on a one-GPU box)
    questions = evaluate.read_questions(TASK)
    results = evaluate.multiple_choice(scorer, questions, batch_size=5)
    tok, sep = scorer.tokenizer, scorer.tokenizer.separator_id
    forward = _forward(scorer.model_def)
    correct = correct_norm = 0
    for q in questions:
        scores = []
        for choice in q.choices:
            answer = tok.encode(choice)
            tokens = np.concatenate([[sep], tok.encode(q.context), answer]).astype(np.int32)
            scores.append(_one_device_log_likelihood(forward, scorer.params, tokens, len(answer)))
        scores = np.array(scores)
        correct += int(np.argmax(scores) == q.label)
        correct_norm += int(np.argmax(scores / [len(c.encode()) for c in q.choices]) == q.label)
    n = len(questions)
    assert results["n"] == n and results["acc"] == correct / n and results["acc_norm"] == correct_norm / n
    assert results["acc_stderr"] == pytest.approx(math.sqrt(correct / n * (1 - correct / n) / n))


def test_text_bits_per_byte_of_the_run_and_its_export_agree(run, exported, tmp_path):
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x * 2  # ünï\n" * 6)
    ours = evaluate.evaluate(workdir=str(run), text=str(text), seq_len=24, batch_size=4)["text_bits_per_byte"]
    theirs = evaluate.evaluate(hf_dir=str(exported), text=str(text), seq_len=24, batch_size=4)["text_bits_per_byte"]
    scorer = evaluate.from_hf(exported)
    stream = np.concatenate([[scorer.tokenizer.separator_id], scorer.tokenizer.encode(text.read_text())]).astype(np.int32)
    assert len(stream) > 3 * 24  # several windows, the last one short
    windows = [stream[start : start + 25] for start in range(0, len(stream) - 1, 24)]
    forward = _forward(scorer.model_def)
    nats = -sum(_one_device_log_likelihood(forward, scorer.params, w, len(w) - 1) for w in windows)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert ours == pytest.approx(nats / math.log(2) / len(text.read_bytes()), rel=1e-5)
    text.write_bytes(b"caf\xe9")  # Latin-1 (was: a UnicodeDecodeError traceback)
    with pytest.raises(cli.UsageError, match=r"--text=.* is not UTF-8 \(byte 3: b'\\xe9'\)"):
        evaluate.evaluate(hf_dir=str(exported), text=str(text), seq_len=24)
    text.write_text("")  # was: 0 bits per byte
    with pytest.raises(cli.UsageError, match=r"--text=.* is empty; give a file with text to score"):
        evaluate.evaluate(hf_dir=str(exported), text=str(text), seq_len=24)
    with pytest.raises(cli.UsageError, match=r"--text=.* is a folder; give a UTF-8 text file"):  # was: "does not exist"
        evaluate.evaluate(hf_dir=str(exported), text=str(text.parent), seq_len=24)


@pytest.mark.parametrize(
    "line, message",
    [('{"context": "a", "choices": ["b"], "label": 0}', "needs >= 2 choices"), ("not json", "line 1 is not"),
     ('{"question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"}',
      r"answerKey 'C' is none of the choices' labels \['A', 'B'\]")],  # was: "'C' is not in list"
)  # fmt: skip
def test_a_malformed_task_line_is_named(tmp_path, line, message):
    path = tmp_path / "task.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(cli.UsageError, match=message):
        evaluate.read_questions(path)
    path.write_bytes(b'{"context": "caf\xe9"}\n')  # Latin-1 (was: a UnicodeDecodeError traceback)
    with pytest.raises(cli.UsageError, match=r"task file .* is not UTF-8 \(byte 16"):
        evaluate.read_questions(path)
    with pytest.raises(cli.UsageError, match=r"task file .* is a folder; give a file of JSONL lines"):
        evaluate.read_questions(tmp_path)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"hf_dir": "x", "step": 3}, "--step=3 picks a checkpoint of --workdir; an --hf folder holds one set of weights"),
        ({"hf_dir": "x", "val_files": "v", "max_tokens": -1}, "--max_tokens=-1 must be >= 0"),
        ({"workdir": "x", "max_tokens": 1000}, "--max_tokens=1000 bounds --val_files; give the shards"),  # was ignored
        ({"workdir": "x", "seq_len": 64}, "--seq_len=64 is the window of --text and --val_files"),  # was ignored
        ({"workdir": "x", "hf_dir": "y"}, "give exactly one of --workdir"),
    ],
)
def test_conflicting_or_out_of_range_evaluate_arguments_are_named(arguments, message):
    with pytest.raises(cli.UsageError, match=message):
        evaluate.evaluate(**arguments)


def test_the_command_lines_export_and_evaluate(run, tmp_path):
    out = tmp_path / "hf"
    args = [sys.executable, "-m", "experiments.export_hf", f"--workdir={run}", f"--out={out}"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(out / hf.CONFIG), str(out / hf.SINGLE_FILE)]
    # On a CPU split in two, as the mesh's error asks (`sharding.mesh`: "the scripts' --cpu_devices=2").
    args = [sys.executable, "-m", "experiments.evaluate", f"--hf={out}", f"--tasks={TASK}", "--batch_size=8", "--mesh=data:2", "--cpu_devices=2"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    choice = json.loads(result.stdout)["synthetic_choice"]
    in_process = evaluate.multiple_choice(evaluate.from_hf(out), evaluate.read_questions(TASK), batch_size=8)
    assert choice["n"] == 12 and choice == pytest.approx(in_process, rel=1e-5)


def test_an_export_into_a_run_or_a_foreign_folder_is_refused_before_it_writes(run, exported, tmp_path):
    """--out=WORKDIR wrote the transformers config.json over the run's: sample, evaluate, export and a resume then
    died with AttributeError: 'data'. And a run into an export (--workdir = init_from_hf) wrote its own over the
    export's, leaving weights without a config."""
    folder = tmp_path / "export"
    shutil.copytree(exported, folder)
    with pytest.raises(cli.UsageError, match="holds a config.json that is not a training run's .a transformers export.."):
        trainer.run(_config(init_from_hf=str(folder)), folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in exported.iterdir())
    assert (folder / hf.CONFIG).read_bytes() == (exported / hf.CONFIG).read_bytes()
    before = {p: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(cli.UsageError, match=r"holds a training run, whose config.json the export would replace; .*/hf\)"):
        export_hf.export(run, run)
    assert {p: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    (tmp_path / hf.CONFIG).write_text('{"note": "my own settings"}')
    with pytest.raises(cli.UsageError, match="holds a config.json that is not a transformers checkpoint's"):
        export_hf.export(run, tmp_path)
    assert (tmp_path / hf.CONFIG).read_text() == '{"note": "my own settings"}'
    # a workdir whose config.json an older export replaced is named as such (was: AttributeError: 'data')
    for text, message in (('{"architectures": ["LlamaForCausalLM"]}', "is a transformers checkpoint's config, not a training run's"),
                          ("[1]", "is not a run's config, without the model, data and optimizer blocks")):  # fmt: skip
        (tmp_path / hf.CONFIG).write_text(text)
        with pytest.raises(cli.UsageError, match=message):
            restore.run_config(tmp_path)
    with pytest.raises(cli.UsageError, match="is a training run's config, not a transformers checkpoint's: export the run first"):
        evaluate.from_hf(run)  # the run's folder given as an export


def test_the_runs_subword_tokenizer_is_copied_only_while_it_is_the_one_the_shards_were_made_with(tmp_path):
    source = tmp_path / "bpe" / "tokenizer.json"
    source.parent.mkdir()
    source.write_text('{"model": "stand-in"}')
    manifest = {"tokenizer": str(source.parent), "tokenizer_sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    out = tmp_path / "out"
    out.mkdir()
    assert export_hf.copy_tokenizer(manifest, out) == out / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == source.read_bytes()
    assert export_hf.copy_tokenizer({"tokenizer": "bytes"}, out) is None
    source.write_text('{"model": "changed since"}')
    (out / "tokenizer.json").unlink()
    assert export_hf.copy_tokenizer(manifest, out) is None and not (out / "tokenizer.json").exists()


def test_a_checkpoints_tokenizer_must_be_the_one_its_training_data_was_made_with(run, exported, tmp_path):
    """init_from_hf of a checkpoint holding a subword tokenizer trained on the byte-level corpus (was: silently,
    its ids meaning other text); evaluate --hf reads a SentencePiece export's tokenizer.model (was: bytes)."""
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    (folder / "tokenizer.model").write_bytes(b"stand-in SentencePiece model")
    assert tokenizer.find_in(folder) == folder / "tokenizer.model" and tokenizer.find_in(exported) is None
    with pytest.raises(tokenizer.TokenizerError, match="tokenizer.model"):  # read as SentencePiece (was: bytes, silently)
        evaluate.from_hf(folder)
    (folder / "tokenizer.json").write_text('{"model": "stand-in"}')
    assert tokenizer.find_in(folder) == folder / "tokenizer.json"  # transformers' own file first
    with pytest.raises(cli.UsageError, match=r"trained with its tokenizer.json, but this run's data was made with the byte-level tokenizer"):
        trainer.run(_config(init_from_hf=str(folder)), tmp_path / "refused")
    assert not (tmp_path / "refused" / "config.json").exists()
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        shards.write(data / f"{split}_0.bin", np.arange(300, dtype=np.uint16) % 200)
    files = {"init_from_hf": str(folder), "data.train_files": str(data / "train_*.bin"), "data.val_files": str(data / "val_*.bin")}
    for tokenizer_file, accepted in ((folder / "tokenizer.json", True), (folder / "tokenizer.model", False)):
        manifest = {"tokenizer": str(tokenizer_file), "tokenizer_sha256": tokenizer.file_fingerprint(tokenizer_file)}
        (data / "manifest.json").write_text(json.dumps(manifest))
        if accepted:
            run_spec.check_hf_tokenizer(_config(**files))
        else:
            with pytest.raises(ValueError, match=r"made with .*tokenizer.model \(the shards' manifest\); train on shards of its tokenizer"):
                run_spec.check_hf_tokenizer(_config(**files))
    # An export into that folder replaces the earlier one whole (was: its index and shards were read before the
    # new model.safetensors, and its tokenizer.json with them).
    export_hf.export(run, folder)
    assert sorted(p.name for p in folder.iterdir()) == [hf.CONFIG, hf.SINGLE_FILE]
    for a, b in zip(jax.tree.leaves(hf.load_model(folder)[1]), jax.tree.leaves(hf.load_model(exported)[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bits_per_byte_of_held_out_shards(exported, tmp_path):
    scorer = evaluate.from_hf(exported)
    streams = [np.asarray(scorer.tokenizer.encode(f"def f{i}(x):\n    return x + {i}  # ünï\n" * 3), np.int32) for i in range(2)]
    for i, stream in enumerate(streams):
        shards.write(tmp_path / f"val_{i}.bin", stream)
    shards.write(tmp_path / "train_0.bin", streams[0])
    # 1.5 tokens per byte in the validation split, 1.25 in the training split
    manifest = {"splits": {"train": {"tokens": 500, "bytes": 400, "files": ["train_0.bin"]}, "val": {"tokens": 300, "bytes": 200, "files": ["val_0.bin", "val_1.bin"]}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    results = evaluate.evaluate(hf_dir=str(exported), val_files=str(tmp_path / "val_*.bin"), seq_len=24, batch_size=4)
    forward = _forward(scorer.model_def)
    windows = [s[k : k + 25] for s in streams for k in range(0, len(s) - 24, 25)]
    nats = -sum(_one_device_log_likelihood(forward, scorer.params, w, 24) for w in windows)
    assert results["shards_tokens"] == 24 * len(windows) and len(windows) > 4
    assert results["shards_loss"] == pytest.approx(nats / (24 * len(windows)), rel=1e-5)
    assert results["shards_bits_per_byte"] == pytest.approx(results["shards_loss"] / math.log(2) * 1.5, rel=1e-6)
    # training shards take the training split's tokens per byte (was: the validation split's, whatever was scored);
    # a shard the manifest does not list has none
    on_train = evaluate.evaluate(hf_dir=str(exported), val_files=str(tmp_path / "train_0.bin"), seq_len=24, batch_size=4)
    assert on_train["shards_bits_per_byte"] == pytest.approx(on_train["shards_loss"] / math.log(2) * 1.25, rel=1e-6)
    shards.write(tmp_path / "val_9.bin", streams[1])
    assert evaluate.evaluate(hf_dir=str(exported), val_files=str(tmp_path / "val_9.bin"), seq_len=24, batch_size=4)["shards_bits_per_byte"] is None
    (tmp_path / "val_9.bin").unlink()
    # shards of another tokenizer whose ids all fit the vocabulary (was: scored silently, as the model's tokens)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest | {"tokenizer": "bpe.json", "tokenizer_sha256": "0" * 64}))
    with pytest.raises(cli.UsageError, match=r"tokenized with bpe.json, not with this model's tokenizer \(bytes\)"):
        evaluate.evaluate(hf_dir=str(exported), val_files=str(tmp_path / "val_*.bin"), seq_len=24, batch_size=4)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest | {"tokenizer": "bytes", "tokenizer_sha256": scorer.tokenizer.fingerprint}))
    assert evaluate.evaluate(hf_dir=str(exported), val_files=str(tmp_path / "val_*.bin"), seq_len=24, batch_size=4) == results
    # ... in any folder of the pattern (was: only the first folder's manifest was read)
    other = tmp_path / "other"
    other.mkdir()
    shards.write(other / "val_0.bin", streams[0])
    (other / "manifest.json").write_text(json.dumps({"tokenizer": "bpe.json", "tokenizer_sha256": "0" * 64}))
    with pytest.raises(cli.UsageError, match=r"the shards in .*other were tokenized with bpe.json, not with this model's"):
        evaluate.evaluate(hf_dir=str(exported), val_files=f"{tmp_path / 'val_*.bin'},{other / 'val_*.bin'}", seq_len=24, batch_size=4)


def _broken_copy(exported, tmp_path, damage):
    """A copy of the export with one file damaged: ``truncated``, ``missing_shard`` or ``malformed_config``."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in exported.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-64])
        return broken, shard
    if damage == "missing_shard":
        shard.unlink()
        return broken, shard
    (broken / hf.CONFIG).write_text((broken / hf.CONFIG).read_text()[:-20])
    return broken, broken / hf.CONFIG


@pytest.mark.parametrize(
    "entry, damage",
    [("evaluate", "truncated"), ("evaluate", "malformed_config"), ("train", "missing_shard"), ("train", "truncated"),
     ("export", None), ("sample", None)],
)  # fmt: skip
def test_every_io_failure_is_one_line_naming_the_file_exit_2(run, exported, tmp_path, entry, damage):
    if entry == "evaluate":
        broken, named = _broken_copy(exported, tmp_path, damage)
        args = ["experiments.evaluate", f"--hf={broken}", f"--tasks={TASK}"]
    elif entry == "train":
        broken, named = _broken_copy(exported, tmp_path, damage)
        args = ["experiments.train", "--config=experiments/configs/default.py", f"--config.init_from_hf={broken}",
                "--config.steps=1", "--config.optimizer.warmup_steps=0", f"--workdir={tmp_path / 'run'}"]  # fmt: skip
    elif entry == "export":  # the output folder cannot be made: a file is in the way
        (tmp_path / "file").write_text("")
        named = tmp_path / "file" / "hf"
        args = ["experiments.export_hf", f"--workdir={run}", f"--out={named}"]
    else:  # the run's own config.json is damaged
        workdir = tmp_path / "run"
        workdir.mkdir()
        named = workdir / "config.json"
        named.write_text((run / "config.json").read_text()[:50])
        args = ["experiments.sample", f"--workdir={workdir}"]
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(named) in lines[0], result.stderr


def test_hellaswag_and_arc_lines_are_read_as_released(tmp_path):
    """Their released JSONL lines need no conversion; the context and choices are lm-evaluation-harness's."""
    hellaswag = {
        "ind": 4, "activity_label": "Removing ice from car", "ctx_a": "Then, the man writes over the snow covering the window of a car.",
        "ctx_b": "then", "ctx": "unused here", "split": "val", "label": 2,
        "endings": [", the man adds wax to the windshield.", " dry it [title] Step two.  Rinse it [step] off.", " the man stops.", " he goes."],
    }  # fmt: skip
    arc = {"id": "q1", "question": {"stem": "Which is a gas?", "choices": [{"text": "ice", "label": "A"}, {"text": "steam", "label": "B"}]}, "answerKey": "B"}
    arc_hf = {"id": "q2", "question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"], "label": ["1", "2", "3"]}, "answerKey": "3"}
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (hellaswag, arc, arc_hf)) + "\n")
    first, second, third = evaluate.read_questions(path)
    assert first == evaluate.Question(
        "Removing ice from car: Then, the man writes over the snow covering the window of a car. Then",
        (" , the man adds wax to the windshield.", " dry it. Step two. Rinse it off.", " the man stops.", " he goes."),
        2,
    )
    assert second == evaluate.Question("Question: Which is a gas?\nAnswer:", (" ice", " steam"), 1)
    assert third == evaluate.Question("Question: Which is a gas?\nAnswer:", (" ice", " steam", " rock"), 2)
    path.write_text(json.dumps(hellaswag | {"label": ""}) + "\n")
    with pytest.raises(cli.UsageError, match="line 1 .*no label: HellaSwag's test split has none"):
        evaluate.read_questions(path)
