"""Tokenizers behind one interface, loaded from local files only (nothing is downloaded).

The byte-level tokenizer is the default: ids 0-255 are bytes, then `BOS`, `EOS` (which separates
documents in a packed stream) and `PAD`. The module-level `encode` / `decode` are its functions.

`load(spec)` also reads a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library), a SentencePiece
``.model`` (``sentencepiece``) and a tiktoken-format BPE rank file ``.tiktoken`` (``tiktoken``; lines of
``base64(token) rank``). Each is a `Tokenizer`: ``encode``, ``decode``, ``vocab_size`` and the ids of
its special tokens, with ``separator_id`` the token written between documents.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

BOS = 256
EOS = 257  # separates documents in the packed stream
PAD = 258
VOCAB_SIZE = 259
PADDED_VOCAB_SIZE = 320  # model vocabulary: a multiple of 64, so it splits over tensor-parallel axes

# Special-token spellings searched in a vocabulary, most common first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")

# Pre-tokenization of a tiktoken rank file, which stores no pattern: runs of letters (with one leading
# non-letter), numbers of up to three digits, punctuation runs, and whitespace (GPT-4's split).
TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
TIKTOKEN_EOS = "<|endoftext|>"
MIN_BPE_VOCAB = 256 + 1  # `train_bpe`: every byte, plus the separator
FILE_NAMES = ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken")  # in a checkpoint folder, by preference


class TokenizerError(ValueError):
    """A tokenizer spec or file that cannot be loaded; the message names the file and the fix."""


def encode(text: str | bytes) -> np.ndarray:
    """UTF-8 bytes of ``text`` as uint16 token ids."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def decode(tokens: np.ndarray) -> str:
    """Bytes back to text; special tokens become newlines, invalid UTF-8 is replaced."""
    ids = np.asarray(tokens)
    data = bytes(int(t) if t < 256 else 10 for t in ids)
    return data.decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer.

    Attributes:
      name: the spec it was loaded from (``bytes`` or a file path).
      vocab_size: number of token ids, special tokens included.
      bos_id, eos_id: ids of the begin / end-of-text tokens (None where the vocabulary has none).
      separator_id: the id written after every document of a packed stream (EOS, else BOS).
      fingerprint: sha256 of the tokenizer file (of ``b"bytes"`` for the byte-level one).
    """

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    fingerprint: str
    _encode: Callable[[str], Sequence[int]] = dataclasses.field(repr=False)
    _decode: Callable[[list[int]], str] = dataclasses.field(repr=False)

    @property
    def separator_id(self) -> int | None:
        return self.eos_id if self.eos_id is not None else self.bos_id

    @property
    def token_dtype(self) -> type:
        """The narrowest unsigned dtype holding every id (uint16 up to 65,536 ids)."""
        return np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no special tokens added)."""
        return np.asarray(self._encode(text), dtype=self.token_dtype)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _bytes_tokenizer() -> Tokenizer:
    return Tokenizer(
        name="bytes",
        vocab_size=VOCAB_SIZE,
        bos_id=BOS,
        eos_id=EOS,
        fingerprint=hashlib.sha256(b"bytes").hexdigest(),
        _encode=encode,
        _decode=lambda ids: decode(np.asarray(ids)),
    )


def _first_id(lookup: Callable[[str], int | None], names: Sequence[str]) -> int | None:
    for name in names:
        token_id = lookup(name)
        if token_id is not None:
            return token_id
    return None


def _import(module: str, path: Path):
    try:
        return __import__(module)
    except ImportError as e:
        raise TokenizerError(f"reading {path} needs the {module!r} package: pip install -e '.[data]'") from e


def _huggingface(path: Path, fingerprint: str) -> Tokenizer:
    tokenizers = _import("tokenizers", path)
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception for bad JSON
        raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json ({' '.join(str(e).split())[:160]})") from e
    return Tokenizer(
        name=str(path),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_id=_first_id(tok.token_to_id, _BOS_NAMES),
        eos_id=_first_id(tok.token_to_id, _EOS_NAMES),
        fingerprint=fingerprint,
        _encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
        _decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
    )


def _sentencepiece(path: Path, fingerprint: str) -> Tokenizer:
    spm = _import("sentencepiece", path)
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{path} is not a SentencePiece model ({' '.join(str(e).split())[:160]})") from e
    return Tokenizer(
        name=str(path),
        vocab_size=sp.vocab_size(),
        bos_id=sp.bos_id() if sp.bos_id() >= 0 else None,
        eos_id=sp.eos_id() if sp.eos_id() >= 0 else None,
        fingerprint=fingerprint,
        _encode=sp.encode,
        _decode=sp.decode,
    )


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one ``base64(token) rank`` per line, ranks 0..n-1."""
    ranks = {}
    for number, line in enumerate(path.read_text(encoding="ascii", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise TokenizerError(f"{path} line {number} is not 'base64-token rank' ({line[:40]!r}); is it a .tiktoken file?") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: the ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _tiktoken(path: Path, fingerprint: str) -> Tokenizer:
    tiktoken = _import("tiktoken", path)
    ranks = read_tiktoken_ranks(path)
    eos = len(ranks)
    enc = tiktoken.Encoding(path.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={TIKTOKEN_EOS: eos})
    return Tokenizer(
        name=str(path),
        vocab_size=enc.n_vocab,
        bos_id=None,
        eos_id=eos,
        fingerprint=fingerprint,
        _encode=enc.encode_ordinary,
        _decode=enc.decode,
    )


_LOADERS = {".json": _huggingface, ".model": _sentencepiece, ".tiktoken": _tiktoken}


def load(spec: str = "bytes") -> Tokenizer:
    """The tokenizer named by ``spec``.

    Args:
      spec: ``bytes`` (the default byte-level tokenizer), or a path to a ``tokenizer.json`` (or a folder
        holding one), a SentencePiece ``.model``, or a tiktoken ``.tiktoken`` rank file.

    Raises:
      TokenizerError: the file is missing, of an unknown kind, malformed, or its library is not installed.
    """
    if spec in ("", "bytes"):
        return _bytes_tokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {str(path)!r} does not exist; give 'bytes' or a local tokenizer.json, .model or .tiktoken file")
    loader = _LOADERS.get(path.suffix)
    if loader is None:
        raise TokenizerError(f"tokenizer file {str(path)!r} has an unknown kind; expected tokenizer.json, a SentencePiece .model or a .tiktoken rank file")
    return loader(path, file_fingerprint(path))


def file_fingerprint(path: str | Path) -> str:
    """A tokenizer file's `Tokenizer.fingerprint` (its sha256), without loading it or its library."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def find_in(directory: str | Path) -> Path | None:
    """The tokenizer file of a checkpoint folder (a transformers checkpoint, an export): the first of
    `FILE_NAMES` it holds; None when it holds none (a byte-level export)."""
    return next((Path(directory) / name for name in FILE_NAMES if (Path(directory) / name).is_file()), None)


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Trains a byte-level BPE of ``vocab_size`` ids on ``texts``; returns the path of its ``tokenizer.json``.

    Raises:
      ValueError: ``vocab_size`` is below 257 (every byte and the separator), or ``out_dir`` already holds a
        ``tokenizer.json`` (shards made with it, and runs, name it and check its sha256: it is not written over).
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"--vocab_size={vocab_size} must be at least {MIN_BPE_VOCAB} (256 bytes and the separator)")
    if (Path(out_dir) / "tokenizer.json").exists():
        raise ValueError(
            f"{Path(out_dir) / 'tokenizer.json'} exists and is not written over (shards made with it name it in their "
            "manifest); give another --out or delete it"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TIKTOKEN_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    bpe.train_from_iterator(texts, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    bpe.save(str(tmp))
    tmp.replace(path)
    return path
