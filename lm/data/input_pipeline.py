"""The training input a `DataConfig` (``--config.data.*``) describes: the stdlib / text corpus, or pre-tokenized shards.

With ``data.train_files`` or ``data.mixture`` (`lm.data.mixture`), and ``data.val_files``, the run reads
llm.c ``.bin`` / ``.npy`` shards memory-mapped (`lm.data.shards`); a ``manifest.json`` beside them (written
by ``experiments.tokenize``) gives the vocabulary, the document separator and each split's tokens,
UTF-8 bytes and files. Without them the run reads `lm.data.corpus` (byte-level). Either way the
batches come from `lm.data.batches.PackedBatches`.

Validation is a fixed set: the first ``data.val_tokens`` targets of the validation split, exactly (the
last batch padded, its padding weighted 0: `lm.data.batches.leading_tokens`), or with ``val_tokens`` 0, ``eval_batches`` batches of windows spread evenly over
it. Bits per byte, the axis on which runs of different tokenizers compare, is the mean loss in bits
times the split's tokens (one separator per document included) over its UTF-8 bytes:

    bpb = val_loss / ln 2 * tokens / bytes

(for the byte-level corpus tokens / bytes is taken as 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import grain
import numpy as np

from lm.data import corpus, batches, documents, mixture, shards, tokenizer

MANIFEST = "manifest.json"
VOCAB_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What a run reads and how it batches it; the ``data`` config block is generated from these fields."""

    path: str = ""  # empty: the Python standard-library corpus; else a text file or folder
    seq_len: int = 128  # tokens per training sequence (<= model.max_seq_len)
    val_fraction: float = 0.02  # text corpus: share of files (by a hash of the path) held out for validation
    cache_dir: str = ""  # empty: ~/.cache/spmdlab
    # Pre-tokenized shards instead (llm.c .bin or .npy; globs, comma-separated): e.g. "data/x/train_*.bin".
    train_files: str = ""
    val_files: str = ""  # validation shards (globs); empty: the text corpus's held-out files, or none
    mixture: str = ""  # instead of train_files: "GLOB_A:0.7,GLOB_B:0.3" samples sources by weight
    val_tokens: int = 0  # fixed validation set of this many tokens (e.g. 10485760); 0: eval_batches batches
    bos_aligned: bool = False  # every sequence starts at a document start (a separator token)
    document_mask: bool = False  # attention stays inside documents (segment ids from the separator)
    separator_id: int | None = None  # None: the manifest's (EOS for the byte corpus)
    tokenizer: str = ""  # empty: the shards' manifest's (bytes for the text corpus); set: checked against it


class ValidationSet(list):
    """This process's rows of the fixed validation batches, the tokens per UTF-8 byte of their text
    (None when unknown: shards without a manifest) and, where the set is not whole batches, each batch's
    ``(rows, seq_len)`` weights per target (`lm.data.batches.leading_tokens`; None: every target counts)."""

    def __init__(self, batches: list[np.ndarray], tokens_per_byte: float | None, weights: list[np.ndarray] | None = None):
        super().__init__(batches)
        self.tokens_per_byte = tokens_per_byte
        self.weights = weights

    def bits_per_byte(self, val_loss: float) -> float | None:
        """``val_loss`` (nats per token) in bits per UTF-8 byte."""
        return None if self.tokens_per_byte is None else val_loss / math.log(2) * self.tokens_per_byte


def read_manifest(files: list[Path]) -> dict | None:
    """The ``manifest.json`` in the folder of the first of ``files``, if there is one."""
    path = files[0].parent / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); rewrite it with experiments.tokenize or remove it") from e


def tokens_per_byte(files: list[Path]) -> float | None:
    """Tokens per UTF-8 byte of the text behind shard ``files``, from the ``manifest.json`` of each one's folder:
    the splits that list them (``val_*.bin`` the validation split's, ``train_*.bin`` the training split's) summed.
    None when a folder has no manifest or a file is in none of its splits (a shard copied in by hand)."""
    tokens = text_bytes = 0
    for folder, manifest in folder_manifests(files).items():
        manifest = manifest or {}
        listed = {name: split for split, summary in manifest.get("splits", {}).items() for name in summary.get("files", ())}
        names = [Path(f).name for f in files if Path(f).parent == folder]
        if any(name not in listed for name in names):
            return None
        for split in {listed[name] for name in names}:
            tokens += manifest["splits"][split]["tokens"]
            text_bytes += manifest["splits"][split].get("bytes", 0)
    return tokens / text_bytes if text_bytes else None


def padded(vocab_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of 128 (so the embedding splits over tensor-parallel axes)."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def train_patterns(data_config: DataConfig) -> list[tuple[str, float]]:
    """The training shards' globs with their weights: ``data.mixture``'s, or ``data.train_files`` with weight 1."""
    if data_config.mixture and data_config.train_files:
        raise ValueError("data.mixture and data.train_files are both set; give one (a mixture names its own globs)")
    if data_config.path and (data_config.mixture or data_config.train_files):
        shards_key = "data.mixture" if data_config.mixture else "data.train_files"
        raise ValueError(f"data.path (a text corpus) and {shards_key} (token shards) are both set; give one")
    if data_config.mixture:
        return mixture.parse(data_config.mixture)
    return [(data_config.train_files, 1.0)] if data_config.train_files else []


def manifest_vocab_size(data_config: DataConfig) -> int | None:
    """The model vocabulary the training shards ask for: their manifests' largest, padded; None without one.

    A glob that matches nothing yet is skipped (a plan made before the data is fetched uses the model's own
    vocabulary); reading the data names it.
    """
    what = "data.mixture" if data_config.mixture else "data.train_files"
    manifests = []
    for pattern, _ in train_patterns(data_config):
        try:
            manifests += folder_manifests(documents.expand(pattern, what=what)).values()
        except documents.DocumentError:
            continue
    sizes = [int(m["vocab_size"]) for m in manifests if m is not None]
    return padded(max(sizes)) if sizes else None


def token_shares(data_config: DataConfig, sequences: int) -> dict[str, float] | None:
    """Each mixture source's share of the tokens of a run's first ``sequences`` sequences (None without a mixture)."""
    if not data_config.mixture:
        return None
    patterns = mixture.parse(data_config.mixture)
    counts = mixture.Schedule([w for _, w in patterns]).counts(sequences)
    return {p: float(c / counts.sum()) for (p, _), c in zip(patterns, counts)}


def train_manifest(data_config: DataConfig) -> dict | None:
    """The manifest of the (first source's) training shards; None for the text corpus or shards without one."""
    patterns = train_patterns(data_config)
    if not patterns:
        return None
    return read_manifest(documents.expand(patterns[0][0], what="data.mixture" if data_config.mixture else "data.train_files"))


def run_tokenizer(data_config: DataConfig) -> tokenizer.Tokenizer:
    """The tokenizer a run's data was made with: byte-level for the text corpus, else the one the training
    shards' manifest names, checked against the manifest's sha256.

    Raises:
      ValueError: the shards have no manifest, or its tokenizer file is missing or changed.
    """
    if not train_patterns(data_config):
        return tokenizer.load("bytes")
    manifest = train_manifest(data_config)
    if manifest is None or not manifest.get("tokenizer"):
        raise ValueError("the run's shards have no manifest.json naming their tokenizer; name the tokenizer file yourself")
    tok = tokenizer.load(manifest["tokenizer"])
    if manifest.get("tokenizer_sha256") not in (None, tok.fingerprint):
        raise ValueError(
            f"{manifest['tokenizer']} is not the tokenizer the shards were written with (sha256 differs from the "
            "manifest's); name the original tokenizer file"
        )
    return tok


def separator_id(data_config: DataConfig) -> int | None:
    """The token that opens (or closes) documents: ``data.separator_id``, else the training shards' manifest's,
    else EOS for the byte-level corpus; None for shards without a manifest."""
    if data_config.separator_id is not None:
        return data_config.separator_id
    if not train_patterns(data_config):
        return tokenizer.EOS
    manifest = train_manifest(data_config)
    return None if manifest is None else manifest.get("separator_id")


def document_separator(data_config: DataConfig) -> int | None:
    """The model's ``document_separator``: `separator_id` with ``data.document_mask``, else None.

    Raises:
      ValueError: ``data.document_mask`` is set and the separator is unknown.
    """
    if not data_config.document_mask:
        return None
    separator = separator_id(data_config)
    if separator is None:
        raise ValueError("data.document_mask needs the document separator: give data.separator_id or shards with a manifest.json")
    return separator


def folder_manifests(files: list[Path]) -> dict[Path, dict | None]:
    """The ``manifest.json`` (None: none) of each folder that holds some of ``files``, in their order."""
    return {folder: read_manifest([folder / MANIFEST]) for folder in dict.fromkeys(Path(f).parent for f in files)}


def _open(pattern: str, what: str, vocab_size: int) -> tuple[list[np.ndarray], dict | None]:
    """The shards of ``pattern`` and their (first folder's) manifest; the folders' manifests must name one tokenizer."""
    files = documents.expand(pattern, what=what)
    streams = [shards.read(f) for f in files]
    for f, tokens in zip(files, streams):
        shards.check_vocab(tokens, f"shard {f}", vocab_size)
    manifests = folder_manifests(files)
    _check_one_tokenizer([(f"{what} in {folder}", m) for folder, m in manifests.items()])
    return streams, next(iter(manifests.values()))


def _check_one_tokenizer(named_manifests: list[tuple[str, dict | None]]) -> None:
    """Raises `ValueError` when the manifests of a run's shards name tokenizers of different sha256: the ids of
    one would mean other text to a model of the other."""
    made_with = {name: (m["tokenizer_sha256"], m.get("tokenizer")) for name, m in named_manifests if m and m.get("tokenizer_sha256")}
    if len({sha for sha, _ in made_with.values()}) > 1:
        each = "; ".join(f"{name} with {tokenizer_name}" for name, (_, tokenizer_name) in made_with.items())
        raise ValueError(f"the run's shards were made with different tokenizers ({each}); tokenize them all with one")


def _windows(streams: list[np.ndarray], seq_len: int, data_config: DataConfig, separator_id: int | None, name: str) -> batches.Windows:
    if not data_config.bos_aligned:
        return batches.Windows(streams, seq_len, name=name)
    if separator_id is None:
        raise ValueError("data.bos_aligned needs the document separator: give data.separator_id or shards with a manifest.json")
    return batches.Windows(streams, seq_len, [batches.document_starts(s, seq_len, separator_id) for s in streams], name=name)


def build(
    d: DataConfig, vocab_size: int, *, seed: int, batch_size: int, eval_batches: int, process_index: int = 0, process_count: int = 1
) -> tuple[batches.PackedBatches, ValidationSet]:
    """This process's training batches (``batch_size`` sequences each, shuffled by ``seed``) and validation set
    (``eval_batches`` batches unless ``d.val_tokens``) for ``d``, checked against the model's ``vocab_size``.

    Raises:
      ValueError: an empty glob, a bad shard or manifest, a token id at or above ``vocab_size``, or too little data.
    """
    seq_len, batch = d.seq_len, batch_size
    num_val = d.val_tokens // (batch * seq_len) if d.val_tokens else eval_batches
    patterns = train_patterns(d)
    if not patterns:
        if d.val_files:
            raise ValueError("data.val_files is set without data.train_files; give both (or neither, for data.path)")
        streams = corpus.load(d.path, val_fraction=d.val_fraction, cache_dir=d.cache_dir or None)
        for split, tokens in streams.items():
            shards.check_vocab(tokens, f"the byte-level corpus' {split} split", vocab_size)
        train, val = [[streams["train"]]], [streams["validation"]]
        corpus_name = f"the byte-level corpus of {d.path or 'the standard library'}"
        train_names, val_name = [f"{corpus_name}'s train split"], f"{corpus_name}'s validation split (data.val_fraction={d.val_fraction})"
        val_tokens_per_byte = 1.0
    else:
        if not d.val_files:
            raise ValueError("training shards need data.val_files too (e.g. the val_*.bin shards beside them)")
        what = "data.mixture" if d.mixture else "data.train_files"
        opened = [_open(p, what, vocab_size) for p, _ in patterns]
        train = [streams for streams, _ in opened]
        train_names, val_name = [f"{what}={p}" for p, _ in patterns], f"data.val_files={d.val_files}"
        val, val_manifest = _open(d.val_files, "data.val_files", vocab_size)
        _check_one_tokenizer([*zip(train_names, (m for _, m in opened)), (val_name, val_manifest)])
        val_tokens_per_byte = tokens_per_byte(documents.expand(d.val_files, what="data.val_files"))
    separator = separator_id(d) if d.bos_aligned else None
    sources = [_windows(streams, seq_len, d, separator, name) for streams, name in zip(train, train_names, strict=True)]
    name = f"mixture={d.mixture} train_files={d.train_files} path={d.path} bos_aligned={d.bos_aligned}"
    shares = {"seed": seed, "process_index": process_index, "process_count": process_count, "name": name}
    if d.mixture:
        shuffled = [grain.MapDataset.source(s).shuffle(seed=(seed + k) % 2**32) for k, s in enumerate(sources)]
        mixed = grain.MapDataset.source(mixture.Mixture(shuffled, [w for _, w in patterns]))
        train_iter = batches.PackedBatches(mixed, seq_len, batch, shuffle=False, **shares)
    else:
        train_iter = batches.PackedBatches(sources[0], seq_len, batch, **shares)
    shard = {"process_index": process_index, "process_count": process_count}
    if d.val_tokens % (batch * seq_len):  # not whole batches: the last one padded and weighted
        rows, weights = batches.leading_tokens(batches.Windows(val, seq_len, name=val_name), batch, d.val_tokens, **shard)
        return train_iter, ValidationSet(rows, val_tokens_per_byte, weights)
    val_windows = batches.Windows(val, seq_len, name=val_name)
    validation = batches.validation_batches(val_windows, seq_len, batch, num_val, leading=bool(d.val_tokens), **shard)
    return train_iter, ValidationSet(validation, val_tokens_per_byte)
