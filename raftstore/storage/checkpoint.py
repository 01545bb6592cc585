"""Durable small files: atomic checksummed write, checked read, directory fsync.

Durable means fsync (STYLE.md 3, hashicorp `file_snapshot.go`): the new image is written to
`<name>.tmp` in the same directory, fsynced, renamed over `<name>` with `os.replace` (atomic
on POSIX), and then the directory is fsynced so the rename itself survives a crash. A crash
at any point leaves either the old file or the new one, never a mix; a leftover `<name>.tmp`
is never read and is overwritten by the next write.

Not thread-safe for the same path: one writer per file (callers own that).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from raftstore.errors import CorruptionError
from raftstore.storage import format as storage_format


def fsync_dir(path: Path) -> None:
    """fsync a directory, making creations, renames and deletions in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: Path) -> Path:
    """Where `write_atomic(path, ...)` stages the new image."""
    return path.with_name(path.name + ".tmp")


def write_atomic(path: Path, kind: bytes, body: bytes) -> None:
    """Replace `path` with a checksummed frame of `body` so that a crash leaves the old file or
    the new one. Returns once the new file and its directory entry are durable. `kind` is 4
    bytes naming the file's role; `read_checked` must be given the same."""
    frame = storage_format.encode_frame(kind, body)
    staging = tmp_path(path)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            _write_all(fd, frame)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise
    fsync_dir(path.parent)


def read_checked(path: Path, kind: bytes) -> bytes:
    """The body last written by `write_atomic(path, kind, ...)`.

    Raises CorruptionError(path, 0, detail) if the file is not a valid frame of that kind
    (bad magic, version, kind, length or CRC). FileNotFoundError passes through.
    """
    data = path.read_bytes()
    try:
        return storage_format.decode_frame(data, kind)
    except storage_format.FormatError as error:
        raise CorruptionError(str(path), 0, error.detail) from error


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
