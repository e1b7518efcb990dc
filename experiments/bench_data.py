r"""Input-pipeline speed: the loader from shards, tokenization, and the main job's wait for input.

    python -m experiments.bench_data --json_out=/tmp/data.json
    python -m experiments.bench_data --train_files='data/fineweb10B/fineweb_train_*.bin' --rows=loader

Rows:

- **loader**: tokens per second that `lm.data.batches.PackedBatches` delivers to the host (one process, batch
  ``--batch x --seq_len``, 64 x 1024 by default) from llm.c shards, with Grain read-ahead threads and
  without. Without ``--train_files`` it writes ``--synthetic_tokens`` random GPT-2-sized ids into
  temporary version-1 shards of 10^7 tokens.
- **tokenize**: MB/s of UTF-8 text through `experiments.tokenize` (``--workers`` processes) over the
  first ``--tokenize_mb`` MB of the standard-library corpus, for the byte tokenizer and a byte-level
  BPE of ``--bpe_vocab`` ids trained on the same text.
- **input_wait**: the default training job (`experiments.train`, ``--train_steps`` steps) with the
  time inside ``next(train_iter)`` summed: its share of the job's step time (median step time x steps
  after the first).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags, logging

from experiments import cli, trainer
from experiments.configs import default
from lm.data import batches as batches_lib
from lm.data import documents, shards, tokenize, tokenizer

ROWS = ("loader", "tokenize", "input_wait")
SHARD_TOKENS = 10_000_000
GPT2_VOCAB = 50257

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined under ``__main__`` only: scripts share absl's flag registry)."""
    flags.DEFINE_list("rows", list(ROWS), f"Rows to run, from {', '.join(ROWS)}.")
    flags.DEFINE_string("train_files", "", "Shards for the loader row (a glob); empty: synthetic shards.")
    flags.DEFINE_integer("synthetic_tokens", 50_000_000, "Tokens of the synthetic shards.")
    flags.DEFINE_integer("batch", 64, "Loader batch (sequences).")
    flags.DEFINE_integer("seq_len", 1024, "Loader sequence length.")
    flags.DEFINE_integer("batches", 200, "Loader batches timed (after one warm-up batch).")
    flags.DEFINE_float("tokenize_mb", 20.0, "MB of stdlib text to tokenize.")
    flags.DEFINE_integer("workers", 2, "Tokenizing processes.")
    flags.DEFINE_integer("bpe_vocab", 8192, "Vocabulary of the BPE tokenized in the tokenize row.")
    flags.DEFINE_integer("train_steps", 60, "Steps of the default job in the input_wait row.")
    cli.define_output_file_flag("json_out", "Write the results here as JSON.")


def loader_speed(streams: list[np.ndarray], batch: int, seq_len: int, batches: int, read_ahead: int) -> float:
    """Tokens per second (``batch * seq_len`` per batch) over ``batches`` batches after a warm-up one."""
    it = batches_lib.PackedBatches(batches_lib.Windows(streams, seq_len), seq_len, batch, seed=0, read_ahead=read_ahead)
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch * seq_len / (time.perf_counter() - start)


def synthetic_shards(folder: Path, tokens: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    paths = []
    for i, start in enumerate(range(0, tokens, SHARD_TOKENS)):
        size = min(SHARD_TOKENS, tokens - start)
        paths.append(shards.write(folder / f"train_{i:06d}.bin", rng.integers(0, GPT2_VOCAB, size, dtype=np.uint16)))
    return paths


def _loader_rows(scratch: Path) -> list[dict[str, Any]]:
    paths = documents.expand(FLAGS.train_files, what="--train_files") if FLAGS.train_files else synthetic_shards(scratch, FLAGS.synthetic_tokens)
    streams = [shards.read(p) for p in paths]
    source = FLAGS.train_files or f"{FLAGS.synthetic_tokens:,} synthetic tokens"
    return [
        {
            "row": "loader",
            "case": f"read_ahead={read_ahead}",
            "value": loader_speed(streams, FLAGS.batch, FLAGS.seq_len, FLAGS.batches, read_ahead),
            "unit": "tokens/s",
            "detail": f"{FLAGS.batch}x{FLAGS.seq_len} from {len(paths)} shards of {source}",
        }
        for read_ahead in (batches_lib.READ_AHEAD_BATCHES, 0)
    ]


def _stdlib_prefix(max_bytes: float) -> list[Path]:
    files, total = [], 0
    for f in documents.stdlib_files():
        files.append(f)
        total += f.stat().st_size
        if total >= max_bytes:
            break
    return files


def _tokenize_rows(scratch: Path) -> list[dict[str, Any]]:
    files = _stdlib_prefix(FLAGS.tokenize_mb * 1e6)
    bpe = tokenizer.train_bpe((t for f in files for t in documents.read(f, errors="replace")), FLAGS.bpe_vocab, scratch / "bpe")
    rows = []
    for name, spec in (("bytes", "bytes"), (f"bpe{FLAGS.bpe_vocab}", str(bpe))):
        start = time.perf_counter()
        manifest = tokenize.tokenize(spec, files, scratch / name, val_fraction=0.01, shard_tokens=SHARD_TOKENS, workers=FLAGS.workers, errors="replace")
        seconds = time.perf_counter() - start
        mb = sum(s["bytes"] for s in manifest["splits"].values()) / 1e6
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        rows.append(
            {
                "row": "tokenize",
                "case": name,
                "value": mb / seconds,
                "unit": "MB/s",
                "detail": f"{mb:.1f} MB -> {tokens:,} tokens in {seconds:.1f} s, {FLAGS.workers} workers",
            }
        )
    return rows


def _input_wait_rows(scratch: Path) -> list[dict[str, Any]]:
    waited = []
    original = batches_lib.PackedBatches.__next__

    def timed(self):
        start = time.perf_counter()
        batch = original(self)
        waited.append(time.perf_counter() - start)
        return batch

    config = default.get_config()
    config.steps = FLAGS.train_steps
    batches_lib.PackedBatches.__next__ = timed
    try:
        summary = trainer.run(config, scratch / "job")
    finally:
        batches_lib.PackedBatches.__next__ = original
    step_seconds = config.batch_size * config.data.seq_len / summary["tokens_per_second"]
    share = float(np.sum(waited[1:])) / (step_seconds * (len(waited) - 1))
    detail = f"default job, {config.steps} steps: {np.mean(waited[1:]) * 1e3:.2f} ms per batch, step {step_seconds * 1e3:.1f} ms"
    return [{"row": "input_wait", "case": "default job", "value": share, "unit": "share of step time", "detail": detail}]


def print_table(results: list[dict[str, Any]]) -> None:
    print("| row | case | value | unit | detail |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        value = f"{r['value']:.2%}" if r["unit"].startswith("share") else f"{r['value']:,.1f}" if r["value"] < 1e3 else f"{r['value']:,.0f}"
        print(f"| {r['row']} | {r['case']} | {value} | {r['unit']} | {r['detail']} |")


def main(argv: list[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    cli.require_counts("synthetic_tokens", "batch", "seq_len", "batches", "bpe_vocab", "train_steps")
    unknown = set(FLAGS.rows) - set(ROWS)
    if unknown:
        cli.usage_exit(f"--rows has {sorted(unknown)}; choose from {', '.join(ROWS)}")
    runners = {"loader": _loader_rows, "tokenize": _tokenize_rows, "input_wait": _input_wait_rows}
    results = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for row in FLAGS.rows:
                results += runners[row](Path(scratch))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    except (ValueError, OSError) as e:
        cli.usage_exit(str(e))
    print_table(results)
    if FLAGS.json_out:
        Path(FLAGS.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
