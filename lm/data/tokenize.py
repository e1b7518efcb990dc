"""Tokenizes text into llm.c / modded-nanogpt ``.bin`` shards plus a JSON manifest (`experiments.tokenize` is its command).

Inputs are plain text files (one document each), JSONL (one document per line, its ``text`` field) and
Parquet (one per row of its ``text`` column). Every document is preceded by the tokenizer's separator
(``<|endoftext|>``, EOS, else BOS), as in llm.c's FineWeb shards, and goes to ``val_*.bin`` when a stable
hash of its text falls below ``--val_fraction``, else to ``train_*.bin``. Shards hold
``--shard_tokens`` tokens (the last of a split fewer) in version 1 (uint16) of the format in
`lm.data.shards`, or version 2 (uint32) for vocabularies over 65,536 ids. ``manifest.json`` records the
tokenizer (path and sha256), its vocabulary size and separator id, and per split the files, documents,
tokens and UTF-8 bytes, from which training reports bits per byte.

Shards are written under temporary names and moved into ``--out`` only when every one is complete, so
an interrupted or failed run leaves ``--out`` as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lm.data import documents, shards, tokenizer

MANIFEST = "manifest.json"
ERRORS = ("strict", "replace")
SPLITS = ("train", "val")

_worker_tokenizer: tokenizer.Tokenizer | None = None


def is_validation(text: str, val_fraction: float) -> bool:
    """Stable split: the first 8 hex digits of sha256(text) as a fraction of 2^32."""
    return int(hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()[:8], 16) / 2**32 < val_fraction


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer.load(spec)


def _readable(text: str) -> tuple[str, int]:
    """A document read with ``surrogateescape`` as the tokenizer sees it (undecodable bytes as U+FFFD), and
    its size in the file's bytes (what bits per byte divides by)."""
    raw = text.encode("utf-8", errors="surrogateescape")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return raw.decode("utf-8", errors="replace"), len(raw)
    return text, len(raw)


def _encode_batch(args: tuple[list[str], float]) -> list[tuple[str, np.ndarray, int]]:
    """``(split, separator + tokens, bytes in the file)`` of each document."""
    texts, val_fraction = args
    tok = _worker_tokenizer
    separator = np.array([tok.separator_id], tok.token_dtype)
    out = []
    for text, nbytes in map(_readable, texts):
        out.append(("val" if is_validation(text, val_fraction) else "train", np.concatenate([separator, tok.encode(text)]), nbytes))
    return out


def _batches(files: list[Path], val_fraction: float, errors: str, size: int = 64) -> Iterator[tuple[list[str], float]]:
    batch: list[str] = []
    for f in files:
        for text in documents.read(f, errors="surrogateescape" if errors == "replace" else errors):
            batch.append(text)
            if len(batch) == size:
                yield batch, val_fraction
                batch = []
    if batch:
        yield batch, val_fraction


class _SplitWriter:
    """Accumulates one split's tokens and writes a shard every ``shard_tokens``."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, version: int):
        self.folder, self.split, self.shard_tokens, self.version = folder, split, shard_tokens, version
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.files: list[str] = []
        self.tokens = self.bytes = self.documents = 0

    def add(self, tokens: np.ndarray, nbytes: int) -> None:
        self.pending.append(tokens)
        self.pending_tokens += tokens.size
        self.tokens += tokens.size
        self.bytes += nbytes
        self.documents += 1
        while self.pending_tokens >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            self._write(stream[: self.shard_tokens])
            self.pending = [stream[self.shard_tokens :]]
            self.pending_tokens = self.pending[0].size

    def close(self) -> None:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
        self.pending, self.pending_tokens = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.split}_{len(self.files):06d}.bin"
        shards.write(self.folder / name, tokens, version=self.version)
        self.files.append(name)

    def summary(self) -> dict:
        return {"files": self.files, "documents": self.documents, "tokens": self.tokens, "bytes": self.bytes}


def tokenize(
    spec: str, files: list[Path], out: str | Path, *, val_fraction: float, shard_tokens: int, workers: int = 0, errors: str = "strict"
) -> dict:
    """Tokenizes the documents of ``files`` into shards under ``out``; returns the manifest it writes.

    ``errors`` (`ERRORS`): a file that is not UTF-8 is refused (``strict``) or read with U+FFFD for its
    undecodable bytes (``replace``); either way the manifest counts each document's bytes as in its file.

    Raises:
      ValueError: bad arguments, an unreadable tokenizer or input, ``out`` already holds shards, or
        the input holds no training document, or with ``val_fraction`` > 0 no validation document.
    """
    out = Path(out)
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val_fraction={val_fraction} must lie in [0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens={shard_tokens} must be positive")
    if workers < 0:
        raise ValueError(f"--workers={workers} must be >= 0 (0: one per CPU core)")
    if errors not in ERRORS:
        raise ValueError(f"--errors={errors}: use one of {', '.join(ERRORS)}")
    existing = [p.name for p in out.glob("*") if p.name == MANIFEST or p.name.startswith(tuple(f"{s}_" for s in SPLITS))]
    if existing:
        raise ValueError(f"--out={out} already holds {min(existing)}; choose another folder or delete the old shards")
    tok = tokenizer.load(spec)
    if tok.separator_id is None:
        raise ValueError(f"tokenizer {spec} has no end-of-text or BOS token to separate documents")
    version = shards.version_for(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".partial-{os.getpid()}"
    staging.mkdir()
    try:
        writers = {split: _SplitWriter(staging, split, shard_tokens, version) for split in SPLITS}
        workers = workers or os.cpu_count() or 1
        total_bytes = sum(f.stat().st_size for f in files)
        with contextlib.ExitStack() as stack:
            bar = stack.enter_context(tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not sys.stderr.isatty()))
            if workers == 1:  # in this process: no fork of a process that may run JAX
                _init_worker(spec)
                encode = map
            else:
                encode = stack.enter_context(multiprocessing.get_context("fork").Pool(workers, _init_worker, (spec,))).imap
            for encoded in encode(_encode_batch, _batches(files, val_fraction, errors)):
                for split, tokens, nbytes in encoded:
                    writers[split].add(tokens, nbytes)
                    bar.update(nbytes)
        for writer in writers.values():
            writer.close()
        if writers["train"].documents == 0:
            raise ValueError(f"the input ({len(files)} files) holds no training document; give more text or a lower --val_fraction")
        if val_fraction > 0 and writers["val"].documents == 0:
            raise ValueError(
                f"none of the input's {writers['train'].documents} documents fell in the validation split (each goes there "
                f"with probability --val_fraction={val_fraction}, by a hash of its text; a plain text file is one document, "
                "a JSONL file one per line): give more documents, raise --val_fraction, or set --val_fraction=0 for "
                "training shards only"
            )
        manifest = {
            "format": "llm.c",
            "version": version,
            "tokenizer": spec,
            "tokenizer_sha256": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "separator_id": tok.separator_id,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "val_fraction": val_fraction,
            "splits": {split: writer.summary() for split, writer in writers.items()},
        }
        for split in SPLITS:
            for name in writers[split].files:
                os.replace(staging / name, out / name)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(staging / MANIFEST, out / MANIFEST)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest
