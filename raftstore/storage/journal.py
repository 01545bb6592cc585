"""The Raft log on disk: checksummed, fsynced, torn-tail safe.

pysyncobj's own FileJournal never fsyncs, has no checksum and a 32-bit offset
(PYSYNCOBJ-FACTS 1). This class has the same duck-typed interface (add, clear,
deleteEntriesFrom, deleteEntriesTo, __getitem__, __len__, term/vote/commit metadata) and is
plugged in by `replication.py`; it never imports pysyncobj itself.

Layout of `<dir>/raft.journal`:

    file header:  magic "HSRJ" (4) | version u8 | reserved (3)
    record:       crc32 u32 | command_len u32 | idx u64 | term u64 | command bytes
                  crc32 covers command_len, idx, term and the command

`add()` only writes (page cache); `sync()` makes everything written so far durable with one
fdatasync. The replication adapter calls `sync()` before a follower acknowledges entries and
before the leader counts itself toward a commit, so "acknowledged" means "fsynced on a
majority". Group commit falls out of this: every entry added during one tick shares one
fdatasync.

Term, vote and commit index live in `<dir>/raft.meta`, written atomically (tmp, fsync,
rename, fsync dir). Term and vote are stored synchronously before pysyncobj sends any message
that reflects them; the commit index at most once per second (a stale commit index is safe:
it only delays re-applying entries after a restart).

Recovery: a record that is incomplete or fails its CRC at the very end of the file is a torn
write (it was never acknowledged, because acknowledgement waits for fdatasync): it is
truncated with a WARNING. A failing record followed by more data is corruption: the node
refuses to start (CorruptionError) rather than forget acknowledged entries. So is a failing
record whose index `raft.meta` says was fdatasynced (`synced_last_index`, stored with the
commit index at most once per second, and at once when the log is cut below it): a damaged
length field can make an old record look like a torn tail, and a node that dropped entries
it acknowledged could vote a candidate missing committed entries into office.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Final

from raftstore.errors import CorruptionError
from raftstore.storage import checkpoint

log = logging.getLogger(__name__)

FILE_MAGIC: Final = b"HSRJ"
FILE_VERSION: Final = 1
_FILE_HEADER: Final = struct.Struct("<4sB3x")
_RECORD_HEADER: Final = struct.Struct("<IIQQ")  # crc32, command_len, idx, term
_CRC_COVERED: Final = struct.Struct("<IQQ")  # command_len, idx, term
META_KIND: Final = b"META"
COMMAND_BYTES_MAX: Final = 1 << 31

Entry = tuple[bytes, int, int]  # (command, idx, term): pysyncobj's journal entry shape


def _encode_record(command: bytes, idx: int, term: int) -> tuple[bytes, bytes]:
    covered = _CRC_COVERED.pack(len(command), idx, term)
    crc = zlib.crc32(command, zlib.crc32(covered))
    return struct.pack("<I", crc) + covered, command


class DurableJournal:
    """The Raft log of one group on one node. Runs on pysyncobj's tick thread only."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._directory = directory
        self._path = directory / "raft.journal"
        self._meta_path = directory / "raft.meta"
        self._entries: list[Entry] = []
        self._positions: list[int] = []  # file position of each entry's record
        self._bytes_total = 0  # command bytes held (pysyncobj keeps the whole log in RAM)
        self._dirty = False
        self._meta: dict[str, Any] = self._load_meta()
        self._meta_dirty = False
        self._fd = self._open_and_recover()
        self.syncs = 0  # fdatasync calls, for stats

    # --- recovery -------------------------------------------------------------------

    def _load_meta(self) -> dict[str, Any]:
        try:
            body = checkpoint.read_checked(self._meta_path, META_KIND)
        except FileNotFoundError:
            return {}
        meta: dict[str, Any] = json.loads(body)
        return meta

    def _open_and_recover(self) -> int:
        fresh = not self._path.exists()
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        if fresh or os.fstat(fd).st_size == 0:
            os.write(fd, _FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION))
            os.fsync(fd)
            checkpoint.fsync_dir(self._directory)
            return fd
        data = _read_all(fd)
        if len(data) < _FILE_HEADER.size:
            os.close(fd)
            raise CorruptionError(
                str(self._path), 0, f"journal of {len(data)} bytes is shorter than its header"
            )
        magic, version = _FILE_HEADER.unpack_from(data, 0)
        if magic != FILE_MAGIC or version != FILE_VERSION:
            os.close(fd)
            raise CorruptionError(str(self._path), 0, f"bad journal header {magic!r} v{version}")
        end = self._scan(data)
        if end < len(data):
            os.ftruncate(fd, end)
            os.fsync(fd)
        os.lseek(fd, end, os.SEEK_SET)
        return fd

    def _scan(self, data: bytes) -> int:
        """Load every valid record; return where valid data ends (torn tail cut there)."""
        position = _FILE_HEADER.size
        view = memoryview(data)
        while position < len(data):
            problem = self._check_record(view, position)
            if problem is not None:
                self._torn_or_corrupt(view, position, problem)
                return position
            _, length, idx, term = _RECORD_HEADER.unpack_from(view, position)
            start = position + _RECORD_HEADER.size
            self._append_entry(bytes(view[start : start + length]), idx, term, position)
            position = start + length
        return position

    def _check_record(self, view: memoryview, position: int) -> str | None:
        if position + _RECORD_HEADER.size > len(view):
            return "incomplete record header"
        crc, length, idx, _ = _RECORD_HEADER.unpack_from(view, position)
        start = position + _RECORD_HEADER.size
        if start + length > len(view):
            return f"record of {length} bytes runs past end of file"
        computed = zlib.crc32(view[start : start + length], zlib.crc32(view[position + 4 : start]))
        if computed != crc:
            return f"crc mismatch stored={crc:#x} computed={computed:#x}"
        if self._entries and idx != self._entries[-1][1] + 1:
            # A valid record that breaks the index chain is never a torn write.
            raise CorruptionError(
                str(self._path), position, f"index {idx} does not follow {self._entries[-1][1]}"
            )
        return None

    def _torn_or_corrupt(self, view: memoryview, position: int, problem: str) -> None:
        """A torn write is the last thing in the file: the failing record reaches the end of
        the file, or only zero bytes follow it, and it was never fdatasynced. Anything else is
        corruption."""
        synced_last = int(self._meta.get("synced_last_index", 0))
        if self._entries and self._entries[-1][1] + 1 <= synced_last:
            raise CorruptionError(
                str(self._path),
                position,
                f"{problem}; entry {self._entries[-1][1] + 1} was fdatasynced "
                f"(synced_last_index {synced_last} in raft.meta), so this is no torn write",
            )
        length = 0
        if position + _RECORD_HEADER.size <= len(view):
            _, length, _, _ = _RECORD_HEADER.unpack_from(view, position)
        record_end = position + _RECORD_HEADER.size + length
        if record_end < len(view) and any(view[record_end:]):
            raise CorruptionError(str(self._path), position, problem)
        log.warning(
            "truncated torn journal tail path=%s position=%d detail=%s",
            self._path,
            position,
            problem,
        )

    def _append_entry(self, command: bytes, idx: int, term: int, position: int) -> None:
        self._entries.append((command, idx, term))
        self._positions.append(position)
        self._bytes_total += len(command)

    # --- the pysyncobj Journal interface --------------------------------------------

    def add(self, command: bytes, idx: int, term: int) -> None:
        if not isinstance(command, bytes):
            command = bytes(command)
        assert len(command) < COMMAND_BYTES_MAX
        if self._entries:
            assert idx == self._entries[-1][1] + 1, (
                f"journal gap: {idx} after {self._entries[-1][1]}"
            )
        position = os.lseek(self._fd, 0, os.SEEK_CUR)
        header, body = _encode_record(command, idx, term)
        written = os.writev(self._fd, [header, body])
        assert written == len(header) + len(body), "short write to the journal"
        self._append_entry(command, idx, term, position)
        self._dirty = True

    def clear(self) -> None:
        self._truncate_to(0)

    def deleteEntriesFrom(self, entry_from: int) -> None:
        if entry_from < len(self._entries):
            self._truncate_to(entry_from)

    def deleteEntriesTo(self, entry_to: int) -> None:
        """Drop the first `entry_to` entries (after a checkpoint): rewrite the rest into a new
        file, fsync it, rename it over the old one, fsync the directory."""
        if entry_to <= 0:
            return
        kept = self._entries[entry_to:]
        tmp = self._path.with_suffix(".journal.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        positions: list[int] = []
        position = _FILE_HEADER.size
        os.write(fd, _FILE_HEADER.pack(FILE_MAGIC, FILE_VERSION))
        for command, idx, term in kept:
            header, body = _encode_record(command, idx, term)
            os.writev(fd, [header, body])
            positions.append(position)
            position += len(header) + len(body)
        os.fsync(fd)
        os.replace(tmp, self._path)
        checkpoint.fsync_dir(self._directory)
        os.close(self._fd)
        self._fd = fd
        self._entries = kept
        self._positions = positions
        self._bytes_total = sum(len(entry[0]) for entry in kept)
        self._dirty = False

    def __getitem__(self, item: int | slice) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.sync()
        self._store_meta_if_dirty()
        os.close(self._fd)
        self._fd = -1

    def setRaftCommitIndex(self, raft_commit_index: int) -> None:
        if self._meta.get("commit_index") != raft_commit_index:
            self._meta["commit_index"] = raft_commit_index
            self._meta_dirty = True

    def getRaftCommitIndex(self) -> int:
        return int(self._meta.get("commit_index", 1))

    def setCurrentTerm(self, term: int, voted_for_node_id: Any) -> None:
        # Raft: term and vote must be durable before any message reflecting them is sent.
        self._meta["term"] = term
        self._meta["voted_for"] = voted_for_node_id
        self._store_meta()

    def getCurrentTerm(self) -> int:
        return int(self._meta.get("term", 0))

    def getVotedForNodeId(self) -> Any:
        return self._meta.get("voted_for")

    def onOneSecondTimer(self) -> None:
        self._store_meta_if_dirty()

    def flush(self) -> None:
        self.sync()

    # --- ours ------------------------------------------------------------------------

    def sync(self) -> None:
        """Make every entry added so far durable (one fdatasync)."""
        if self._dirty:
            os.fdatasync(self._fd)
            self._dirty = False
            self.syncs += 1
            if self._entries and self._meta.get("synced_last_index") != self._entries[-1][1]:
                self._meta["synced_last_index"] = self._entries[-1][1]
                self._meta_dirty = True  # stored with the commit index (onOneSecondTimer)

    @property
    def dirty(self) -> bool:
        """Entries were written or truncated since the last fdatasync."""
        return self._dirty

    @property
    def bytes_total(self) -> int:
        return self._bytes_total

    @property
    def directory(self) -> Path:
        return self._directory

    def _truncate_to(self, count: int) -> None:
        kept_last = self._entries[count - 1][1] if count else 0
        if int(self._meta.get("synced_last_index", 0)) > kept_last:
            # Durably before the cut: entries written later at these indexes are not synced,
            # and a torn one must not be taken for corruption.
            self._meta["synced_last_index"] = kept_last
            self._store_meta()
        position = self._positions[count] if count < len(self._positions) else None
        if position is None:
            position = _FILE_HEADER.size if count == 0 else os.lseek(self._fd, 0, os.SEEK_END)
        for command, _, _ in self._entries[count:]:
            self._bytes_total -= len(command)
        del self._entries[count:]
        del self._positions[count:]
        os.ftruncate(self._fd, position)
        os.lseek(self._fd, position, os.SEEK_SET)
        self._dirty = True

    def _store_meta_if_dirty(self) -> None:
        if self._meta_dirty:
            self._store_meta()

    def _store_meta(self) -> None:
        body = json.dumps(self._meta, sort_keys=True).encode()
        checkpoint.write_atomic(self._meta_path, META_KIND, body)
        self._meta_dirty = False


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks = []
    position = 0
    while position < size:
        chunk = os.pread(fd, min(size - position, 64 << 20), position)
        if not chunk:
            break
        chunks.append(chunk)
        position += len(chunk)
    return b"".join(chunks)
