r"""Trains a byte-level BPE tokenizer offline and writes ``DIR/tokenizer.json``.

    python -m experiments.train_tokenizer --vocab_size=8192 --out=runs/bpe8k
    python -m experiments.train_tokenizer --vocab_size=32768 --out=runs/bpe32k --input='texts/*.jsonl'

With no ``--input`` it trains on the standard-library corpus (`lm.data.corpus`'s default) with `lm.data.tokenizer.train_bpe`. The tokenizer
splits text GPT-2 style into words and byte-level pieces, so any text encodes with no unknown token,
and it reserves ``<|endoftext|>`` as the document separator. Load it with
``lm.data.tokenizer.load("DIR/tokenizer.json")``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from absl import app, flags

from experiments import cli
from lm.data import documents, tokenizer

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined under ``__main__`` only: scripts share absl's flag registry)."""
    flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size, the separator included.")
    cli.define_output_folder_flag("out", None, "Output folder; receives tokenizer.json.")
    flags.DEFINE_string("input", "", "Text / JSONL / Parquet files (glob, comma-separated globs or a folder); empty: the stdlib corpus.")
    flags.DEFINE_integer("max_bytes", 40_000_000, "Train on the first documents (in path order) until this many UTF-8 bytes are read.")
    flags.DEFINE_enum(
        "errors", None, ["strict", "replace"],
        "Bytes that are not UTF-8: strict refuses the file, replace reads them as U+FFFD; default: strict for "
        "--input, replace for the stdlib corpus (4 of its files are Latin-1 / KOI8-R)",
    )  # fmt: skip


def _budgeted(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """``texts`` up to and including the one that brings their UTF-8 size to ``max_bytes``."""
    total = 0
    for text in texts:
        yield text
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            return


def main(argv: list[str]) -> None:
    del argv
    if not FLAGS.out:
        cli.usage_exit("--out is required: the folder to write tokenizer.json into")
    cli.require_counts("max_bytes")
    try:
        files = documents.expand(FLAGS.input) if FLAGS.input else documents.stdlib_files()
        errors = FLAGS.errors or ("strict" if FLAGS.input else "replace")
        texts = (text for f in files for text in documents.read(f, errors=errors))
        path = tokenizer.train_bpe(_budgeted(texts, FLAGS.max_bytes), FLAGS.vocab_size, FLAGS.out)
        tok = tokenizer.load(str(path))
    except (ValueError, OSError) as e:
        cli.usage_exit(str(e))
    print(f"wrote {path} ({tok.vocab_size} ids, separator {tok.separator_id})")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.parse_flags)
