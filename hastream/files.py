"""Durable file writes: write everything, replace a file atomically, fsync a directory.

Durable means fsync (hashicorp `file_snapshot.go`): the new image is written to
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
from typing import Final

TMP_SUFFIX: Final = ".tmp"


def fsync_dir(path: Path) -> None:
    """fsync a directory, making creations, renames and deletions in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """`os.write` until every byte of `data` is written (a write may be short)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def tmp_path(path: Path) -> Path:
    """Where `write_atomic(path, ...)` stages the new image."""
    return path.with_name(path.name + TMP_SUFFIX)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one.
    Returns once the new file and its directory entry are durable. `mode` applies from the
    first byte (a secret is never readable by others, not even for a moment)."""
    staging = tmp_path(path)
    staging.unlink(missing_ok=True)  # a leftover would keep its own mode
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(staging, path)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise
    fsync_dir(path.parent)
