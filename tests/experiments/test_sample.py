"""Sampling from a training run's checkpoint: a `tiny` MLA model trained a few steps, then sampled."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import cli, restore, sample, trainer
from experiments.configs import default
from experiments.metrics_io import read_metrics
from lm.data import tokenizer


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mla_run")
    config = default.get_config()
    config.update_from_flattened_dict(
        {"steps": 8, "batch_size": 8, "data.seq_len": 32, "eval_every": 8, "eval_batches": 1, "log_every": 1,
         "checkpoint_every": 4, "devices": 1, "optimizer.warmup_steps": 2, "model.attention_type": "mla"}
    )
    trainer.run(config, workdir)
    return workdir


def test_tiny_mla_trains(mla_run):
    losses = [r["loss"] for r in read_metrics(mla_run / "metrics.jsonl")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5


def test_samples_from_the_newest_checkpoint(mla_run):
    model_def, params, step = restore.load_params(mla_run)
    assert step == 8 and model_def.config.attention_type == "mla"
    texts = sample.sample(model_def, params, "def ", num_samples=3, max_new_tokens=12, temperature=1.0, top_p=0.9)
    assert len(texts) == 3 and all(t.startswith("def ") and len(t.encode()) <= 4 + 12 * 3 for t in texts)
    again = sample.sample(model_def, params, "def ", num_samples=3, max_new_tokens=12, temperature=1.0, top_p=0.9)
    assert again == texts  # same seed, same samples


def test_loads_an_earlier_step_on_request_and_keeps_the_newer_ones(mla_run):
    _, early, step = restore.load_params(mla_run, step=4)
    _, late, newest = restore.load_params(mla_run)
    assert (step, newest) == (4, 8)  # unlike a resumed run, the sampler deletes no checkpoint
    assert not np.allclose(early["blocks"]["attn"]["kv_down"]["kernel"], late["blocks"]["attn"]["kv_down"]["kernel"])


def test_bad_workdir_and_settings_name_the_fix(mla_run, tmp_path):
    with pytest.raises(cli.UsageError, match="pass the --workdir of a training run"):
        restore.load_params(tmp_path)
    with pytest.raises(cli.UsageError, match="no checkpoint at step 5"):
        restore.load_params(mla_run, step=5)
    model_def, params, _ = restore.load_params(mla_run)
    with pytest.raises(cli.UsageError, match="max_new_tokens=5000 need 5002 positions, beyond model.max_seq_len"):
        sample.sample(model_def, params, "x", max_new_tokens=5000)
    with pytest.raises(cli.UsageError, match=r"the prompt's \d+ tokens .* shorten the prompt"):  # was: "a cache of"
        sample.sample(model_def, params, "x" * 5000, max_new_tokens=1)
    for count in (0, -1):  # a zero-row batch crashed inside jax; a negative one named no flag
        with pytest.raises(cli.UsageError, match=f"--num_samples={count} must be >= 1"):
            sample.sample(model_def, params, "x", num_samples=count)


def test_the_command_line_prints_the_sample_without_library_logs(mla_run):
    args = [sys.executable, "-m", "experiments.sample", f"--workdir={mla_run}", "--max_new_tokens=4"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=Path(sample.__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [f"# {mla_run}, checkpoint step 8"]
    assert result.stdout.startswith("----- sample 0 -----\ndef ")


def test_samples_decode_with_the_given_tokenizer(mla_run):
    """A tokenizer other than bytes encodes the prompt and decodes the sample (here a byte-level one whose
    vocabulary stops short of the specials, so the sample is plain UTF-8 bytes and has no separator to end at)."""
    model_def, params, _ = restore.load_params(mla_run)
    plain = tokenizer.Tokenizer(
        name="plain-bytes", vocab_size=256, bos_id=None, eos_id=None, fingerprint="",
        _encode=lambda text: list(text.encode()), _decode=lambda ids: bytes(ids).decode(errors="replace"),
    )  # fmt: skip
    texts = sample.sample(model_def, params, "def ", num_samples=2, max_new_tokens=8, temperature=1.0, tok=plain)
    assert all(t.startswith("def ") for t in texts)
    assert all(len(t.encode()) == 4 + 8 for t in texts if "\ufffd" not in t)  # no early stop without a separator
