"""The checkpoint file of a Raft replica (pysyncobj's full dump file).

It is a group checkpoint (storage/group_checkpoint.py, written and read atomically by
storage/checkpoint.py) whose trailer holds pysyncobj's last two entries, which it needs to
resume its log after the checkpoint, little-endian:

    idx u64 | term u64 | length u32 | command     the last applied entry
    idx u64 | term u64 | length u32 | command     the one before it (written without its
                                                  command: see `write`)

Every function takes the file interface as `files=` (storage/files.py; the real file system
by default).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hastream.errors import CorruptionError
from raftstore.storage import checkpoint, group_checkpoint
from raftstore.storage.files import FILE_MODE, REAL_FILES, Files
from raftstore.storage.format import parts_nbytes
from raftstore.storage.journal import DurableJournal, Entry

_TRAILER_ENTRY: Final = struct.Struct("<QQI")


@dataclass(frozen=True, slots=True)
class RaftCheckpoint:
    lsn: int
    state: bytes
    last: Entry  # the last entry the state includes
    previous: Entry  # the entry before it


def encode_trailer(last: Entry, previous: Entry) -> bytes:
    return b"".join(trailer_parts(last, previous))


def trailer_parts(last: Entry, previous: Entry) -> list[bytes]:
    """`encode_trailer`'s bytes in parts, the commands not copied."""
    parts: list[bytes] = []
    for command, idx, term in (last, previous):
        parts += [_TRAILER_ENTRY.pack(idx, term, len(command)), command]
    return parts


def decode_trailer(path: Path, trailer: bytes) -> tuple[Entry, Entry]:
    """(last, previous). Raises CorruptionError(path, ...) on anything `encode_trailer` did
    not write."""
    entries: list[Entry] = []
    position = 0
    for _ in range(2):
        if position + _TRAILER_ENTRY.size > len(trailer):
            raise CorruptionError(str(path), position, "checkpoint trailer is short")
        idx, term, length = _TRAILER_ENTRY.unpack_from(trailer, position)
        position += _TRAILER_ENTRY.size
        command = trailer[position : position + length]
        if len(command) != length:
            raise CorruptionError(str(path), position, "checkpoint trailer entry is short")
        entries.append((command, idx, term))
        position += length
    if position != len(trailer):
        raise CorruptionError(str(path), position, "trailing bytes after the trailer entries")
    return entries[0], entries[1]


def write(path: Path, image: RaftCheckpoint, *, files: Files = REAL_FILES) -> int:
    """Replace the checkpoint at `path` durably (file and directory fsynced); returns the
    size of its body. Raises OSError from the disk (storage/checkpoint.write_atomic).

    The previous entry is stored without its command. pysyncobj needs only its index and
    term (the first entry of its log after a restore: prevLogTerm checks, never sent, since
    a follower that far behind gets the checkpoint; never applied, since the last entry is),
    while the last entry's command is sent to a follower one entry behind. Entries are up
    to 16 MiB: this halves the file, written every checkpoint (every ~2 s under a heavy
    load), and restores the same pysyncobj state (trim_journal_to compares index and term)."""
    _, previous_idx, previous_term = image.previous
    body = group_checkpoint.encode_parts(
        image.lsn, image.state, trailer_parts(image.last, (b"", previous_idx, previous_term))
    )
    checkpoint.write_atomic(path, group_checkpoint.KIND, body, files=files)
    return parts_nbytes(body)


def read(path: Path, *, files: Files = REAL_FILES) -> RaftCheckpoint:
    """The checkpoint at `path`, made durable first. Raises CorruptionError (the frame or
    the trailer), FormatError (a layout of another version), OSError."""
    # A checkpoint a leader installed here was renamed into place without fsync, and
    # pysyncobj clears the journal right after it is loaded: make it durable first.
    _fsync_file_and_dir(path, files)
    decoded = group_checkpoint.decode(
        checkpoint.read_checked(path, group_checkpoint.KIND, files=files)
    )
    last, previous = decode_trailer(path, decoded.trailer)
    return RaftCheckpoint(lsn=decoded.lsn, state=decoded.state, last=last, previous=previous)


def trim_journal_to(journal: DurableJournal, last: Entry, previous: Entry) -> tuple[Entry, Entry]:
    """Make the journal start with the checkpoint's two entries when it holds them, so
    pysyncobj keeps every entry after them (it clears the journal on any mismatch). Returns
    the (last, previous) pysyncobj is to resume from."""
    if len(journal) == 0:
        return last, previous
    first_idx = journal[0][1]
    position = previous[1] - first_idx
    if position < 0 or position + 1 >= len(journal):
        return last, previous
    held_previous, held_last = journal[position], journal[position + 1]
    if (held_previous[1:], held_last[1:]) != (previous[1:], last[1:]):
        return last, previous
    if position > 0:
        journal.drop_first(position)
    return journal[1], journal[0]


def _fsync_file_and_dir(path: Path, files: Files) -> None:
    fd = files.open(path, os.O_RDONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        files.fsync(fd)
    finally:
        files.close(fd)
    files.fsync_dir(path.parent)
