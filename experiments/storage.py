"""A run's workdir as a path on a local disk or in object storage (``gs://bucket/run``), through `etils.epath`.

Everything a run writes into its workdir goes through the `epath.Path` that `workdir` returns: the
config, metrics, summary and plots (`etils.epath`'s fsspec backend: ``pip install gcsfs`` for
``gs://``, ``s3fs`` for ``s3://``), TensorBoard events (`register_tensorboard_schemes`) and orbax
checkpoints (orbax takes the same path; its arrays go through tensorstore's own GCS driver). Object
stores have no append: a file that grows (``metrics.jsonl``, an events file) is rewritten whole. What a
library writes only to local files (jax's profiler traces) is written to a local folder first and
copied into the workdir whole (`staging_folder`, `publish`).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile

from etils import epath

# URL schemes of object stores that epath reads and writes.
REMOTE_SCHEMES = ("gs", "s3")


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object-store URL (``gs://...``, ``s3://...``)."""
    return str(path).partition("://")[0] in REMOTE_SCHEMES and "://" in str(path)


def workdir(path: str | os.PathLike) -> epath.Path:
    """``path`` as an `epath.Path`: a URL as it is, a local path made absolute (orbax needs absolute paths)."""
    return epath.Path(path) if is_remote(path) else epath.Path(os.path.abspath(path))


def check_checkpoints(path: epath.Path) -> None:
    """Raises ValueError for a workdir whose checkpoints orbax cannot write (it has no S3 driver)."""
    if str(path).startswith("s3://"):
        raise ValueError(
            f"orbax writes checkpoints to local paths and gs:// only, not {path}: mount the bucket "
            "(e.g. mountpoint-s3) and pass the mount's path as --workdir"
        )


def staging_folder(workdir: epath.Path, prefix: str) -> str | None:
    """A fresh local folder for a library that writes local files only, when ``workdir`` is in object storage
    (None: it writes into ``workdir`` itself); `publish` copies it over."""
    return tempfile.mkdtemp(prefix=prefix) if is_remote(workdir) else None


def publish(local: str | os.PathLike, destination: epath.Path) -> None:
    """Copies every file under the local folder ``local`` to the same relative path under ``destination``, then
    removes ``local``."""
    for root, _, files in os.walk(local):
        for name in files:
            source = os.path.join(root, name)
            target = destination / os.path.relpath(source, local)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(source, "rb") as f:
                target.write_bytes(f.read())
    shutil.rmtree(local)


class _ObjectRecordWriter:
    """A TensorBoard events file in object storage: written whole on every flush (no append there)."""

    def __init__(self, path: str):
        self.path, self.buffer = epath.Path(path), io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        self.path.write_bytes(self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _ObjectRecordWriterFactory:
    def open(self, path: str) -> _ObjectRecordWriter:
        return _ObjectRecordWriter(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def register_tensorboard_schemes() -> None:
    """tensorboardX writes ``gs://`` and ``s3://`` event files through epath (not its own cloud clients)."""
    from tensorboardX import record_writer

    for scheme in REMOTE_SCHEMES:
        record_writer.register_writer_factory(scheme, _ObjectRecordWriterFactory())
