"""Byte-level tokens: ids 0-255 are bytes, then a few special tokens."""

from __future__ import annotations

import numpy as np

BOS = 256
EOS = 257  # separates documents in the packed stream
PAD = 258
VOCAB_SIZE = 259
PADDED_VOCAB_SIZE = 320  # model vocabulary: a multiple of 64, so it splits over tensor-parallel axes


def encode(text: str | bytes) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint16 token ids."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode(tokens: np.ndarray) -> str:
    """Bytes back to text; special tokens become newlines, invalid UTF-8 is replaced."""
    ids = np.asarray(tokens)
    data = bytes(int(t) if t < 256 else 10 for t in ids)
    return data.decode("utf-8", errors="replace")
