"""Durable small files: atomic checksummed write, checked read, directory fsync.

Durable means fsync (as hashicorp `file_snapshot.go` does): the new image is written to
`<name>.tmp` in the same directory, fsynced, renamed over `<name>` with `replace` (atomic
on POSIX), and then the directory is fsynced so the rename itself survives a crash. A crash
at any point leaves either the old file or the new one, never a mix; a leftover `<name>.tmp`
is never read and is overwritten by the next write.

Every function takes the file interface as `files=` (storage/files.py; the real file system
by default), so tests can run them on a simulated disk that loses power.

Not thread-safe for the same path: one writer per file (callers own that).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hastream.errors import CorruptionError
from raftstore.storage import format as storage_format
from raftstore.storage.files import FILE_MODE, REAL_FILES, Files, read_file, write_all


def fsync_dir(path: Path, *, files: Files = REAL_FILES) -> None:
    """fsync a directory, making creations, renames and deletions in it durable."""
    files.fsync_dir(path)


def tmp_path(path: Path) -> Path:
    """Where `write_atomic(path, ...)` stages the new image."""
    return path.with_name(path.name + ".tmp")


def write_atomic(
    path: Path,
    kind: bytes,
    body: bytes | list[bytes | memoryview],
    *,
    files: Files = REAL_FILES,
) -> None:
    """Replace `path` with a checksummed frame of `body` so that a crash leaves the old file or
    the new one. Returns once the new file and its directory entry are durable. `kind` is 4
    bytes naming the file's role; `read_checked` must be given the same. `body` may come in
    parts, written as one body without being joined first (a Raft checkpoint holds an entry
    of up to ENTRY_BYTES_MAX: joining copied it twice more, into fresh memory).

    Raises OSError from the disk. Before the rename, a failure leaves `path` as it was (the
    staging file is removed); a failure of the final directory fsync leaves the new file in
    place, but maybe not durable: a power loss may bring the old one back."""
    parts = [body] if isinstance(body, bytes) else body
    frame = [storage_format.frame_header(kind, parts), *parts]
    staging = tmp_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
    fd = files.open(staging, flags, FILE_MODE)
    try:
        try:
            write_all(files, fd, frame)
            files.fsync(fd)
        finally:
            files.close(fd)
        files.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            files.unlink(staging)
        raise
    files.fsync_dir(path.parent)


def read_checked(path: Path, kind: bytes, *, files: Files = REAL_FILES) -> bytes:
    """The body last written by `write_atomic(path, kind, ...)`.

    Raises CorruptionError(path, 0, detail) if the file is not a valid frame of that kind
    (bad magic, version, kind, length or CRC). FileNotFoundError passes through.
    """
    data = read_file(files, path)
    try:
        return storage_format.decode_frame(data, kind)
    except storage_format.FormatError as error:
        raise CorruptionError(str(path), 0, error.detail) from error
