"""Pre-tokenized shards: llm.c / modded-nanogpt ``.bin`` files and ``.npy`` token arrays, memory-mapped.

A ``.bin`` shard is a header of 256 little-endian int32 followed by the tokens:

    header[0] = 20240520   magic
    header[1] = 1 | 2      version: 1 stores uint16 tokens (llm.c, modded-nanogpt); 2 stores uint32
                           tokens, for vocabularies of more than 65,536 ids
    header[2] = n          number of tokens
    header[3:] = 0

so the file is exactly ``1024 + n * itemsize`` bytes. Shards written by other tools in version 1 read
unchanged. A ``.npy`` shard is any 1-D array of non-negative integers.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}


class ShardError(ValueError):
    """A shard that cannot be read as tokens; the message names the file and what is wrong."""


def version_for(vocab_size: int) -> int:
    """1 (uint16 tokens) when every id fits 16 bits, else 2 (uint32)."""
    return 1 if vocab_size <= 2**16 else 2


def write(path: str | os.PathLike, tokens: np.ndarray, *, version: int = 1) -> Path:
    """Writes ``tokens`` as a ``.bin`` shard of ``version`` under a temporary name, then renames it into place.

    Raises:
      ShardError: a token does not fit the version's dtype.
    """
    path = Path(path)
    dtype = TOKEN_DTYPES[version]
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > np.iinfo(dtype).max):
        raise ShardError(f"{path}: token ids {int(tokens.min())}..{int(tokens.max())} do not fit version {version} ({dtype.name})")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = MAGIC, version, tokens.size
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
    os.replace(tmp, path)
    return path


def _read_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"shard {path} has {size} bytes, fewer than the {HEADER_BYTES}-byte llm.c header; it is truncated or not a shard")
    header = np.fromfile(path, "<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"shard {path} starts with {header[0]}, not the llm.c magic {MAGIC}; it is not an llm.c .bin shard")
    version, count = int(header[1]), int(header[2])
    if version not in TOKEN_DTYPES:
        raise ShardError(f"shard {path} has header version {version}; known versions are 1 (uint16) and 2 (uint32)")
    dtype = TOKEN_DTYPES[version]
    expected = HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise ShardError(f"shard {path} is {state}: the header promises {count} tokens ({expected} bytes) but the file has {size} bytes")
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def _read_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ShardError(f"shard {path} is not a readable .npy array ({e})") from e
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ShardError(f"shard {path} holds a {tokens.dtype} array of shape {tokens.shape}; a token shard is 1-D integers")
    return tokens


def read(path: str | os.PathLike) -> np.ndarray:
    """The tokens of a ``.bin`` or ``.npy`` shard, memory-mapped (nothing is read until indexed).

    Raises:
      ShardError: wrong magic or version, a size that disagrees with the header, or another suffix.
    """
    path = Path(path)
    if path.suffix == ".bin":
        return _read_bin(path)
    if path.suffix == ".npy":
        return _read_npy(path)
    raise ShardError(f"shard {path} is neither an llm.c .bin file nor a .npy token array")


def check_vocab(tokens: np.ndarray, name: str, vocab_size: int, *, trained: bool = False) -> None:
    """Raises `ShardError` naming the tokens (``name``, e.g. ``"shard data/train_000000.bin"``) when an id
    is negative or at least ``vocab_size``; the fix it names is a larger vocabulary for a run to come, shards of
    the model's tokenizer for a ``trained`` one."""
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        fix = "" if trained else f"set --config.model.vocab_size to at least {high + 1} or "
        raise ShardError(
            f"{name} holds token id {high if high >= vocab_size else low}, outside the model's vocabulary of "
            f"{vocab_size}; {fix}use shards of a matching tokenizer"
        )
