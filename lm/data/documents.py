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


def _jsonl(path: Path, errors: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors=errors) as f:
        for number, line in enumerate(_decoded(f, path), 1):
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


def _not_utf8(path: Path, error: UnicodeDecodeError) -> DocumentError:
    bad = error.object[error.start : error.start + 4]
    return DocumentError(
        f"{path} is not UTF-8 (byte {error.start}: {bad!r}); convert it (e.g. iconv -f latin1 -t utf-8) or pass "
        "--errors=replace to read undecodable bytes as U+FFFD"
    )


def _decoded(lines: Iterator[str], path: Path) -> Iterator[str]:
    try:
        yield from lines
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from e


def read(path: Path, *, errors: str = "strict") -> Iterator[str]:
    """The text of every document in ``path``, chosen by its suffix (``.jsonl``, ``.parquet``, else text).

    Text is UTF-8; ``errors`` is the codec's handler for bytes that are not: ``strict`` raises a
    `DocumentError` naming the file and byte, ``replace`` reads them as U+FFFD, ``surrogateescape``
    keeps them recoverable (``text.encode("utf-8", "surrogateescape")`` gives the file's bytes back).
    """
    if path.suffix == ".jsonl":
        yield from _jsonl(path, errors)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    else:
        try:
            yield path.read_bytes().decode("utf-8", errors=errors)
        except UnicodeDecodeError as e:
            raise _not_utf8(path, e) from e
