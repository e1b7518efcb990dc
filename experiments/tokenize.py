r"""Tokenizes text into llm.c / modded-nanogpt ``.bin`` shards plus a JSON manifest (`lm.data.tokenize`).

    python -m experiments.tokenize --tokenizer=runs/bpe8k/tokenizer.json --out=data/stdlib-bpe8k
    python -m experiments.tokenize --tokenizer=runs/bpe8k/tokenizer.json --input='texts/*.jsonl' --out=data/mine

With no ``--input`` it reads the standard-library corpus (`lm.data.corpus`'s default).
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from lm.data import documents
from lm.data.tokenize import ERRORS, tokenize

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined under ``__main__`` only: scripts share absl's flag registry)."""
    flags.DEFINE_string("tokenizer", "bytes", "'bytes' or a local tokenizer.json / SentencePiece .model / .tiktoken file.")
    flags.DEFINE_string("input", "", "Text / JSONL / Parquet files (a glob, comma-separated globs or a folder); empty: the stdlib corpus.")
    cli.define_output_folder_flag("out", None, "Output folder for train_*.bin, val_*.bin and manifest.json (must hold no manifest).")
    flags.DEFINE_float("val_fraction", 0.01, "Share of documents (by a hash of their text) written to val_*.bin.")
    flags.DEFINE_integer("shard_tokens", 100_000_000, "Tokens per shard (modded-nanogpt's FineWeb shards hold 10^8).")
    flags.DEFINE_integer("workers", 0, "Tokenizing processes; 0: one per CPU core.")
    flags.DEFINE_enum(
        "errors", None, list(ERRORS),
        "Bytes that are not UTF-8: strict refuses the file, replace reads them as U+FFFD (counted as the bytes they "
        "were); default: strict for --input, replace for the stdlib corpus (4 of its files are Latin-1 / KOI8-R)",
    )  # fmt: skip


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS.out:
        cli.usage_exit("--out is required: the folder to write the shards and manifest.json into")
    try:
        files = documents.expand(FLAGS.input) if FLAGS.input else documents.stdlib_files()
        manifest = tokenize(
            FLAGS.tokenizer, files, FLAGS.out, val_fraction=FLAGS.val_fraction, shard_tokens=FLAGS.shard_tokens,
            workers=FLAGS.workers, errors=FLAGS.errors or ("strict" if FLAGS.input else "replace"),
        )  # fmt: skip
    except (ValueError, OSError) as e:
        cli.usage_exit(str(e))
    counts = {split: (s["tokens"], len(s["files"])) for split, s in manifest["splits"].items()}
    print(f"wrote {FLAGS.out}: " + ", ".join(f"{split} {n:,} tokens in {k} shards" for split, (n, k) in counts.items()))


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
