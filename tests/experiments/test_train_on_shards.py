"""Training from pre-tokenized shards (`lm.data.input_pipeline` behind `experiments.train`): vocabulary from the
manifest, bits per byte, exact resume, and bad shards as usage errors."""

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from experiments import cli, run_spec, train_lib, trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm import model as model_lib
from lm.data import batches, documents, shards, tokenize, tokenizer
from sharding import partition


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    (root / "text").mkdir()
    for i in range(40):
        (root / "text" / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}  # ünï\n" * (5 + i % 9))
    tokenize.tokenize("bytes", documents.expand(str(root / "text")), root / "out", val_fraction=0.2, shard_tokens=3000, workers=1)
    return root / "out"


def _config(dataset, **overrides):
    config = default.get_config()
    config.steps, config.batch_size, config.data.seq_len = 6, 8, 32
    config.eval_every, config.eval_batches, config.log_every = 3, 2, 1
    config.checkpoint_every, config.devices = 100, 1
    config.optimizer.warmup_steps = 2
    config.data.train_files = str(dataset / "train_*.bin")
    config.data.val_files = str(dataset / "val_*.bin")
    config.update_from_flattened_dict(overrides)
    return config


@pytest.fixture(scope="module")
def straight(dataset, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    return trainer.run(_config(dataset), workdir), read_metrics(workdir / "metrics.jsonl")


def test_run_on_shards_takes_the_manifests_vocabulary_and_reports_bits_per_byte(dataset, straight):
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["files"]) > 1
    assert run_spec.model_config(_config(dataset)).vocab_size == 384  # 259 padded to a multiple of 128
    summary, records = straight
    val = manifest["splits"]["val"]
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    for r in evaluated:
        assert r["val_bits_per_byte"] == pytest.approx(r["val_loss"] / math.log(2) * val["tokens"] / val["bytes"])
    assert summary["final_val_bits_per_byte"] == evaluated[-1]["val_bits_per_byte"]


def test_interrupted_run_on_shards_resumes_bit_for_bit(dataset, straight, tmp_path):
    config = _config(dataset)
    assert trainer.run(config, tmp_path, interrupt_at=4)["interrupted"]
    assert trainer.run(config, tmp_path)["resumed_from_step"] == 4
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    for key in ("step", "loss", "grad_norm", "val_loss", "val_bits_per_byte"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in straight[1]], key


def test_loader_resumes_onto_another_process_count(dataset):
    streams = [shards.read(p) for p in documents.expand(str(dataset / "train_*.bin"))]
    windows = batches.Windows(streams, 32, [batches.document_starts(s, 32, tokenizer.EOS) for s in streams])
    one = batches.PackedBatches(windows, 32, 8, seed=5)
    [next(one) for _ in range(3)]
    state = one.get_state()
    expected = [next(one) for _ in range(4)]
    halves = []
    for index in range(2):
        it = batches.PackedBatches(windows, 32, 8, seed=5, process_index=index, process_count=2)
        it.set_state(state)
        halves.append([next(it) for _ in range(4)])
    np.testing.assert_array_equal(np.concatenate(halves, axis=1), expected)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.vocab_size": 256}, "shard .*train_000000.bin holds token id 257, outside the model's vocabulary of 256"),
        ({"data.train_files": "/no/such/*.bin"}, "data.train_files='/no/such/\\*.bin' matches no files"),
        ({"data.val_files": ""}, "training shards need data.val_files"),
        ({"data.val_tokens": 10**6}, "data.val_tokens=1000000 needs 31250 validation windows"),
    ],
)
def test_bad_shard_input_is_a_usage_error(dataset, tmp_path, overrides, message):
    with pytest.raises(cli.UsageError, match=message):
        trainer.run(_config(dataset, **overrides), tmp_path)


def test_corrupt_shard_is_a_usage_error_naming_it(dataset, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    raw = (dataset / "train_000000.bin").read_bytes()
    (broken / "train_000000.bin").write_bytes(raw[:-7])
    with pytest.raises(cli.UsageError, match="broken/train_000000.bin is truncated"):
        trainer.run(_config(dataset, **{"data.train_files": str(broken / "*.bin")}), tmp_path / "run")


def test_fixed_validation_set_is_the_leading_val_tokens_for_any_batch_size(dataset):
    _, val = trainer.load_data(_config(dataset, **{"data.val_tokens": 2 * 8 * 32}), 384)
    assert len(val) == 2 and val[0].shape == (8, 33) and val.weights is None
    stream = shards.read(dataset / "val_000000.bin")
    np.testing.assert_array_equal(np.concatenate(val)[:, :-1].reshape(-1), stream[: 2 * 8 * 32])
    _, halves = trainer.load_data(_config(dataset, **{"data.val_tokens": 2 * 8 * 32, "batch_size": 4}), 384)
    np.testing.assert_array_equal(np.concatenate(halves), np.concatenate(val))


def test_a_validation_set_of_partial_batches_is_its_exact_token_mean(dataset):
    """val_tokens = 2 batches + 2 windows + 5 tokens: the third batch is padded and weighted; the trainer's
    mean equals a NumPy mean over exactly those targets (modded-nanogpt's fixed 10,485,760 is 213 1/3 windows)."""
    tokens = 2 * 8 * 32 + 2 * 32 + 5
    config = _config(dataset, **{"data.val_tokens": tokens, "model.n_layers": 1, "model.d_model": 32, "model.mlp_dim": 64})
    _, val = trainer.load_data(config, 384)
    assert len(val) == 3 and sum(float(w.sum()) for w in val.weights) == tokens
    targets = np.concatenate(val)[:, 1:][np.concatenate(val.weights) > 0]
    np.testing.assert_array_equal(targets, shards.read(dataset / "val_000000.bin")[1 : tokens + 1])  # the leading targets, in order
    spec = run_spec.build_run(config)
    params = model_lib.init_params(spec.model_def, 0)
    chunked = model_lib.define(dataclasses.replace(spec.cfg, loss_chunk="64"))  # the head in 4 chunks of 8 x 8 tokens
    with jax.set_mesh(spec.mesh), partition.use_rules(spec.rules):
        got = [
            trainer._evaluate(train_lib.jit_eval_step(train_lib.make_weighted_eval_step(m), spec.shardings, weighted=True), params, val, spec.shardings)
            for m in (spec.model_def, chunked)
        ]
    windows = np.concatenate(val)[: -(-tokens // 32)]
    logits = np.asarray(jax.jit(lambda t: model_lib.apply(spec.model_def, params, t))(windows[:, :-1]), np.float64)
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0].reshape(-1)
    np.testing.assert_allclose(got, [np.mean(nll[:tokens])] * 2, rtol=1e-5)


def test_mixture_run_reports_each_sources_token_share(dataset, tmp_path):
    tokenize.tokenize("bytes", [dataset / "manifest.json"], tmp_path / "other", val_fraction=0.0, shard_tokens=10**6, workers=1)
    a, b = str(dataset / "train_*.bin"), str(tmp_path / "other" / "train_*.bin")
    config = _config(dataset, **{"data.train_files": "", "data.mixture": f"{a}:0.75,{b}:0.25", "steps": 5})
    summary = trainer.run(config, tmp_path / "run")
    assert summary["data_token_share"] == {a: 0.75, b: 0.25}  # 40 samples: exact multiples of the 4-slot cycle
    with pytest.raises(cli.UsageError, match="data.mixture and data.train_files are both set"):
        trainer.run(_config(dataset, **{"data.mixture": f"{a}:1"}), tmp_path / "both")


def test_resume_on_other_training_data_is_refused(dataset, tmp_path):
    trainer.run(_config(dataset), tmp_path, interrupt_at=2)
    with pytest.raises(cli.UsageError, match="checkpointed data state has name=.*bos_aligned=False but this run has .*bos_aligned=True"):
        trainer.run(_config(dataset, **{"data.bos_aligned": True}), tmp_path)


def test_byte_corpus_above_the_models_vocabulary_is_a_usage_error(tmp_path):
    config = default.get_config()
    config.model.vocab_size = 200
    with pytest.raises(cli.UsageError, match="byte-level corpus' train split holds token id 257, outside the model's vocabulary of 200"):
        trainer.run(config, tmp_path)
