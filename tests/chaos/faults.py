"""Environment faults on real files and mounts: a small tmpfs as a node's data disk (filled
and freed), a flipped byte in a data segment, a segment header, a checkpoint or the Raft
journal, and the open-file count of a process.

Files are found the way an operator would, by glob under the node's directories, so a
layout change (say, an incarnation id in table directory names) does not break the tests.
The byte layouts used to aim a flip are the documented ones (docs/design.md).
"""

from __future__ import annotations

import errno
import os
import random
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from raftstore.storage.files import REAL_FILES

MIB: Final = 1024 * 1024
RECORD_HEADER_BYTES: Final = 48  # data-file record header (storage/format.py)
_PAYLOAD_LENGTH: Final = struct.Struct("<I")  # at byte 8 of a record header
_INDEX: Final = struct.Struct("<Q")  # a journal record's, at its byte 8
JOURNAL_HEADER_BYTES: Final = 8  # raft.journal file header
JOURNAL_ENTRY_HEADER_BYTES: Final = 24  # crc u32 | command_len u32 | idx u64 | term u64
_FILL_CHUNK: Final = b"\0" * MIB


class MountRefused(Exception):
    """tmpfs cannot be mounted here (not root, no CAP_SYS_ADMIN, a container policy)."""


@dataclass
class Tmpfs:
    """A tmpfs of `size_bytes` mounted at `path` (a node's persistenceDir), created before
    the node starts. `fill()` writes a filler file until the disk is full (ENOSPC);
    `free()` grows the mount by `grow_bytes` and removes the filler."""

    path: Path
    size_bytes: int
    mounted: bool = False

    @property
    def filler(self) -> Path:
        return self.path / "zz-chaos-filler"

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _run_mount(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.path)]
        )
        self.mounted = True

    def mount_or_skip(self) -> Tmpfs:
        """`mount()`, or skip the calling test where no tmpfs can be mounted."""
        try:
            self.mount()
        except MountRefused as refused:
            pytest.skip(f"no tmpfs here: {refused}")
        return self

    def resize(self, size_bytes: int) -> None:
        _run_mount(["mount", "-o", f"remount,size={size_bytes}", str(self.path)])
        self.size_bytes = size_bytes

    def free_bytes(self) -> int:
        return free_bytes(self.path)

    def fill(self) -> int:
        """Write zeros into the filler file until ENOSPC; returns the bytes written."""
        written = 0
        with self.filler.open("ab", buffering=0) as filler:
            while True:  # bounded by the mount's size
                try:
                    written += filler.write(_FILL_CHUNK)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    break
            # The last partial chunk: fill page by page to leave nothing free.
            while True:  # bounded by the mount's size
                try:
                    written += filler.write(b"\0" * 4096)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    return written

    def free(self, grow_bytes: int = 8 * MIB) -> None:
        """Grow the mount (what an operator does first), then remove the filler."""
        self.resize(self.size_bytes + grow_bytes)
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)
            self.mounted = False


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still write on the file system holding `path`."""
    return REAL_FILES.free_bytes(path)


def _run_mount(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise MountRefused(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")


def tmpfs_refusal(probe_dir: Path) -> str | None:
    """Why a tmpfs cannot be mounted here, or None if it can (mounts and unmounts one)."""
    disk = Tmpfs(probe_dir / "mount-probe", 1 * MIB)
    try:
        disk.mount()
    except (MountRefused, OSError) as error:
        return f"cannot mount tmpfs (needs root/CAP_SYS_ADMIN): {error}"
    disk.unmount()
    return None


def scratch_dir() -> Path:
    """A fresh temporary directory (for the mount probe)."""
    return Path(tempfile.mkdtemp(prefix="chaos-probe-"))


def open_files(pid: int) -> int:
    """How many file descriptors process `pid` has open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- files of a stopped node ---------------------------------------------------------------


def segment_files(persistence_dir: Path, group: int) -> list[Path]:
    """The data segments of every live table of `group` (not those moved aside as corrupt)."""
    found = (persistence_dir / f"group-{group}").glob("*/seg-*.dat")
    return sorted(path for path in found if ".corrupt" not in path.parent.name)


def record_spans(segment: bytes) -> list[tuple[int, int]]:
    """(record start, record end) of each whole record in a data segment, by its headers."""
    spans: list[tuple[int, int]] = []
    position = 0
    while position + RECORD_HEADER_BYTES <= len(segment):
        (payload_length,) = _PAYLOAD_LENGTH.unpack_from(segment, position + 8)
        end = position + RECORD_HEADER_BYTES + payload_length
        if end > len(segment):
            break
        spans.append((position, end))
        position = end
    return spans


def journal_entry_spans(journal: bytes, start: int = JOURNAL_HEADER_BYTES) -> list[tuple[int, int]]:
    """(entry start, entry end) of each whole entry of a journal segment file from `start`
    (where its live records begin), up to the zeros the newest segment was grown by, or to
    the first record whose index does not follow (a reused segment's older records)."""
    spans: list[tuple[int, int]] = []
    position = start
    previous: int | None = None
    while position + JOURNAL_ENTRY_HEADER_BYTES <= len(journal):
        if not any(journal[position : position + JOURNAL_ENTRY_HEADER_BYTES]):
            break  # no record has an all-zero header (its index is at least 1)
        (command_length,) = _PAYLOAD_LENGTH.unpack_from(journal, position + 4)
        (index,) = _INDEX.unpack_from(journal, position + 8)
        end = position + JOURNAL_ENTRY_HEADER_BYTES + command_length
        if end > len(journal) or (previous is not None and index != previous + 1):
            break
        spans.append((position, end))
        position, previous = end, index
    return spans


@dataclass(frozen=True, slots=True)
class Flip:
    """A byte flipped at `position` of `path` (`before` ^ 0xFF); `what` says where."""

    path: Path
    position: int
    what: str

    def __str__(self) -> str:
        return f"{self.what} byte {self.position} of {self.path}"


def flip_byte(path: Path, position: int, what: str) -> Flip:
    with path.open("r+b") as file:
        file.seek(position)
        before = file.read(1)
        assert len(before) == 1, f"{path} has no byte {position}"
        file.seek(position)
        file.write(bytes([before[0] ^ 0xFF]))
        file.flush()
        os.fsync(file.fileno())
    return Flip(path, position, what)


def flip_segment_payload(rng: random.Random, segments: list[Path]) -> Flip | None:
    """Flip a byte inside the payload of a random record of a random segment."""
    candidates = [(path, span) for path in segments for span in record_spans(path.read_bytes())]
    candidates = [
        (path, (start, end))
        for path, (start, end) in candidates
        if end > start + RECORD_HEADER_BYTES
    ]
    if not candidates:
        return None
    path, (start, end) = rng.choice(candidates)
    return flip_byte(path, rng.randrange(start + RECORD_HEADER_BYTES, end), "record payload")


def flip_segment_header(rng: random.Random, segments: list[Path]) -> Flip | None:
    """Flip a byte inside the 48-byte header of a random record of a random segment."""
    candidates = [(path, span) for path in segments for span in record_spans(path.read_bytes())]
    if not candidates:
        return None
    path, (start, _) = rng.choice(candidates)
    return flip_byte(path, start + rng.randrange(RECORD_HEADER_BYTES), "record header")


def flip_journal_entry(rng: random.Random, segments: list[tuple[Path, int]]) -> Flip | None:
    """Flip a byte inside a random live entry (not a file header, nor a record before the
    log's start) of a group's journal: its segment files, each with where its live records
    begin (journal.live_segments)."""
    candidates = [
        (path, span)
        for path, start in segments
        if path.exists()
        for span in journal_entry_spans(path.read_bytes(), start)
    ]
    if not candidates:
        return None
    path, (start, end) = rng.choice(candidates)
    return flip_byte(path, rng.randrange(start, end), "journal entry")


def flip_anywhere(rng: random.Random, path: Path, what: str) -> Flip | None:
    size = path.stat().st_size if path.exists() else 0
    if size == 0:
        return None
    return flip_byte(path, rng.randrange(size), what)
