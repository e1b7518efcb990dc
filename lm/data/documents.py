"""Documents of raw text from files: plain text, JSONL (a ``text`` field) or Parquet (a ``text`` column).

A plain-text file is one document; each JSONL line and each Parquet row is one.
"""

from __future__ import annotations

import glob as glob_lib
import json
from collections.abc import Iterator
from pathlib import Path

from lm.data import corpus

TEXT_FIELD = "text"


class DocumentError(ValueError):
    """An input pattern or file that cannot be read as documents; the message names it."""


def expand(pattern: str, *, what: str = "--input") -> list[Path]:
    """Sorted files matching ``pattern`` (a glob, comma-separated globs, or a folder: every file under it)."""
    files: set[Path] = set()
    for part in filter(None, (p.strip() for p in pattern.split(","))):
        path = Path(part).expanduser()
        if path.is_dir():
            files |= {p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)}
        else:
            files |= {Path(p) for p in glob_lib.glob(str(path), recursive=True) if Path(p).is_file()}
    if not files:
        raise DocumentError(f"{what}={pattern!r} matches no files; give a file, a folder or a glob such as 'data/*.jsonl'")
    return sorted(files)


def stdlib_files() -> list[Path]:
    """The default corpus: the Python standard library's source files."""
    return corpus.list_documents(corpus.stdlib_root(), python_only=True)


def _jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[TEXT_FIELD]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DocumentError(f"{path} line {number} is not a JSON object with a string {TEXT_FIELD!r} field") from e
            yield str(text)


def _parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DocumentError(f"reading {path} needs pyarrow: pip install -e '.[data]'") from e
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise DocumentError(f"{path} is not a Parquet file ({' '.join(str(e).split())[:160]})") from e
    if TEXT_FIELD not in table.schema_arrow.names:
        raise DocumentError(f"{path} has no {TEXT_FIELD!r} column (columns: {table.schema_arrow.names})")
    for batch in table.iter_batches(columns=[TEXT_FIELD]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def read(path: Path) -> Iterator[str]:
    """The text of every document in ``path``, chosen by its suffix (``.jsonl``, ``.parquet``, else text)."""
    if path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    else:
        yield path.read_bytes().decode("utf-8", errors="replace")
