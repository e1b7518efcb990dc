"""Token corpora on disk: the Python standard library by default, or any text file or folder.

A corpus is two flat uint16 token streams, ``train`` and ``validation``, each the concatenation of
its documents' bytes with `tokenizer.EOS` after every document. Documents are files; a file goes to
validation when a stable hash of its path (relative to the corpus root) falls below
``val_fraction``. A single-file corpus has no paths to hash, so its last ``val_fraction`` of bytes is
the validation split. Streams are cached as ``.npy`` files and opened memory-mapped; the cache key
covers the file list, sizes, modification times and the split, so an edited corpus is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from lm.data import tokenizer

SPLITS = ("train", "validation")
_FORMAT_VERSION = 1
RECORD_SUFFIXES = (".jsonl", ".parquet")  # documents in records: `lm.data.documents` reads them, for experiments.tokenize
_TOKENIZE_HINT = (
    "JSONL and Parquet documents go through python -m experiments.tokenize --input=PATH --out=DIR, then "
    "--config.data.train_files='DIR/train_*.bin' --config.data.val_files='DIR/val_*.bin'"
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPMDLAB_CACHE", Path.home() / ".cache" / "spmdlab"))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def list_documents(root: Path, *, python_only: bool) -> list[Path]:
    """Sorted document files under ``root`` (``.py`` files outside site-packages for the stdlib)."""
    if root.is_file():
        return [root]
    if python_only:
        files = []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d != "site-packages"]  # never walk installed packages
            files += [Path(folder) / n for n in names if n.endswith(".py")]
        files = [p for p in files if "site-packages" not in p.parts and p.is_file()]
    else:
        files = [
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts) and _is_text(p)
        ]
    return sorted(files)


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Stable split: the first 8 hex digits of sha256(path) as a fraction of 2^32."""
    h = int(hashlib.sha256(relative_path.encode("utf-8")).hexdigest()[:8], 16)
    return h / 2**32 < val_fraction


def _cache_key(root: Path, files: list[Path], val_fraction: float) -> str:
    h = hashlib.sha256(f"{_FORMAT_VERSION}|{root.resolve()}|{val_fraction!r}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _write_stream(path: Path, chunks: list[np.ndarray]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")  # processes may build the same cache at once
    np.save(tmp, np.concatenate(chunks) if chunks else np.zeros((0,), np.uint16))
    os.replace(tmp, path)


def load(path: str = "", *, val_fraction: float = 0.02, cache_dir: str | os.PathLike | None = None) -> dict[str, np.ndarray]:
    """The corpus at ``path`` (empty: the standard library) as memory-mapped token streams.

    Returns:
      ``{"train": uint16 array, "validation": uint16 array}``.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: no text documents were found, or (a folder) none fell in a split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")
    root = Path(path).expanduser() if path else stdlib_root()
    if not root.exists():
        raise FileNotFoundError(f"data.path {str(root)!r} does not exist; give a text file or folder, or leave it empty for the stdlib corpus")
    if root.is_file() and not _is_text(root):
        raise ValueError(f"data.path {str(root)!r} is not a text file (it holds NUL bytes); {_TOKENIZE_HINT}")
    files = list_documents(root, python_only=not path)
    if not files:
        raise ValueError(f"no text files under data.path {str(root)!r} (files holding NUL bytes are skipped); {_TOKENIZE_HINT}")
    if records := [f for f in files if f.suffix.lower() in RECORD_SUFFIXES]:
        raise ValueError(
            f"data.path reads each file's bytes as one document, and {str(records[0])!r} ({len(records)} such file(s)) "
            f"holds records whose 'text' fields are the documents; {_TOKENIZE_HINT}"
        )
    cache = Path(cache_dir or default_cache_dir()) / f"corpus-{_cache_key(root, files, val_fraction)}"
    paths = {split: cache / f"{split}.npy" for split in SPLITS}
    if not all(p.exists() for p in paths.values()):
        cache.mkdir(parents=True, exist_ok=True)
        chunks: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        eos = np.array([tokenizer.EOS], np.uint16)
        if root.is_file():
            tokens = tokenizer.encode(root.read_bytes())
            cut = int(round(len(tokens) * (1 - val_fraction)))
            chunks["train"] = [tokens[:cut], eos]
            chunks["validation"] = [tokens[cut:], eos]
        else:
            for f in files:
                split = "validation" if is_validation(f.relative_to(root).as_posix(), val_fraction) else "train"
                chunks[split] += [tokenizer.encode(f.read_bytes()), eos]
            if empty := [split for split in SPLITS if not chunks[split]]:
                raise ValueError(
                    f"none of the {len(files)} files under data.path {str(root)!r} fell in the {empty[0]} split "
                    f"(data.val_fraction={val_fraction} of the files go to validation, by a hash of each path); "
                    f"{'raise' if empty[0] == 'validation' else 'lower'} data.val_fraction or add files"
                )
        for split in SPLITS:
            _write_stream(paths[split], chunks[split])
        (cache / "info.json").write_text(
            json.dumps({"root": str(root), "files": len(files), "val_fraction": val_fraction}, indent=1)
        )
    return {split: np.load(paths[split], mmap_mode="r") for split in SPLITS}
