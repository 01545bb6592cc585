"""One table's data files: segmented, append-only, indexed by row offset.

Layout: `<directory>/seg-<first_offset:020d>.dat`, each a sequence of records in the format of
`storage/format.py`. A segment is named after the offset of its first row, so the segments
chain: a segment starts where the previous one ends. Only the last segment (the active one)
is written; the others are sealed. A new segment starts when a record would push the active
one past `segment_bytes_max` (a record larger than that gets a segment of its own).

Durability: `append` writes with one `writev` and no fsync (the Raft log can redo
anything lost); `sync` makes everything appended so far durable (the checkpoint path calls
it before the Raft log is truncated). Opening makes what it finds durable (each segment and
the directory are fsynced): a process killed before its `sync` leaves records in the page
cache that the next run must not take for durable. Every file operation goes through the
`files` interface (storage/files.py), the real file system by default.

Open files: a segment's fd lives in a process-wide `OpenFiles`, which closes the least
recently used data files beyond its bound; a segment is reopened when next written, read
or synced (fsync of a reopened fd flushes the file's dirty pages: they belong to the file,
not the fd). So a thousand tables hold at most that bound of fds, not one or more each.

Recovery at open: sealed segments have every header checked (header CRC, offset and LSN
chain); the last segment also has every payload CRC checked. A failing record that is the
last thing in the last segment is a torn write: it is truncated with a WARNING. Any other
failure raises CorruptionError; nothing is ever skipped.

Index: in memory, per segment, three parallel arrays (first offset, file position, LSN) of
its records, rebuilt at open by reading headers only. 24 bytes per record; no per-row work.

Threads: one writer thread calls `append`, `sync`, `truncate_from`, `close` and `destroy`.
Any number of reader threads call `read` and `record_at`; `remove_segments_before` may run on
any thread (it never touches the active segment). The index is guarded by a lock, and an
index entry is published only after its record is completely written, so readers (who
`pread` on the segment's handle, held for one batch of records) never see half a record.
"""

from __future__ import annotations

import bisect
import enum
import logging
import os
import re
import threading
import weakref
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from hastream.errors import CorruptionError, NodeUnavailable, OffsetOutOfRange
from raftstore import limits
from raftstore.storage import format as storage_format
from raftstore.storage.files import (
    DATA_WRITEBACK,
    FILE_MODE,
    OPEN_DATA_FILES,
    REAL_FILES,
    FileHandle,
    Files,
    OpenFiles,
    Writeback,
    allocate_for_append,
    ensure_dir,
)
from raftstore.storage.format import HEADER_SIZE, FormatError, RecordHeader

log = logging.getLogger(__name__)

SEGMENT_NAME_PATTERN: Final = re.compile(r"seg-(\d{20})\.dat")
# Records handed to a reader per lock acquisition: bounds how long a reader holds the lock.
_SNAPSHOT_RECORDS_MAX: Final = 1024
_ZERO_CHECK_CHUNK_BYTES: Final = 1024 * 1024
# Sealed segments whose fsync waits for the next `sync`; beyond it a roll fsyncs the oldest
# (bounds the work, and the latency, of the checkpoint's `sync`).
_UNSYNCED_SEGMENTS_MAX: Final = 8
# Every data-file handle: readers pread, the writer appends (O_APPEND), truncate_from cuts.
_DATA_FILE_FLAGS: Final = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC


def segment_name(first_offset: int) -> str:
    return f"seg-{first_offset:020d}.dat"


@dataclass(frozen=True, slots=True)
class DataRecord:
    """One record: a batch of `row_count` rows at offsets [first_offset, first_offset +
    row_count), carried by Raft entry `lsn`. `payload` is an Arrow IPC record-batch message,
    opaque here; records returned by `read` hold a memoryview into their own buffer."""

    lsn: int
    first_offset: int
    row_count: int
    timestamp_ms: int
    payload: bytes | memoryview


class _Entry(NamedTuple):
    """A reader's copy of one index entry: byte range [position, position + length)."""

    first_offset: int
    row_count: int
    position: int
    length: int
    lsn: int


class _Segment:
    """One segment file and the index of its records. Mutated under the log's lock."""

    __slots__ = (
        "end_offset",
        "first_offset",
        "handle",
        "lsns",
        "offsets",
        "path",
        "positions",
        "removed",
        "size",
        "times",
        "timestamp_ms_max",
    )

    def __init__(self, path: Path, first_offset: int) -> None:
        self.path = path
        self.first_offset = first_offset
        self.end_offset = first_offset  # Offset after the last row: [first_offset, end_offset).
        self.size = 0  # Bytes of complete, indexed records.
        self.timestamp_ms_max: int | None = None
        self.offsets = array("Q")
        self.positions = array("Q")
        self.lsns = array("Q")
        # Per record, the newest timestamp up to it in this segment (a running maximum, so
        # that it can be bisected even when leaders' clocks disagree): the first record
        # whose entry is >= t is the first record stamped >= t (`TableLog.offset_for_time`).
        self.times = array("q")
        # Weak: OpenFiles holds the handle and may drop it (closing the fd once nobody uses
        # it); whoever uses the segment takes a strong reference for one operation.
        self.handle: weakref.ref[FileHandle] | None = None
        self.removed = False  # Deleted (retention, truncation): never reopened.

    @property
    def lsn_last(self) -> int:
        return self.lsns[-1] if self.lsns else 0

    @property
    def row_count(self) -> int:
        return self.end_offset - self.first_offset

    def add(self, header: RecordHeader, position: int) -> None:
        assert position == self.size, (position, self.size)
        assert header.first_offset == self.end_offset, (header.first_offset, self.end_offset)
        assert header.lsn >= self.lsn_last, (header.lsn, self.lsn_last)
        self.offsets.append(header.first_offset)
        self.positions.append(position)
        self.lsns.append(header.lsn)
        self.times.append(
            max(header.timestamp_ms, self.times[-1]) if self.times else header.timestamp_ms
        )
        self.end_offset += header.row_count
        self.size = position + header.record_size
        if self.timestamp_ms_max is None or header.timestamp_ms > self.timestamp_ms_max:
            self.timestamp_ms_max = header.timestamp_ms

    def cut(self, index: int) -> None:
        """Forget records [index, ...). timestamp_ms_max is kept: an overestimate only
        delays retention."""
        assert 0 <= index < len(self.offsets), index
        self.end_offset = self.offsets[index]
        self.size = self.positions[index]
        del self.offsets[index:]
        del self.positions[index:]
        del self.lsns[index:]
        del self.times[index:]

    def entries(self, offset_from: int, offset_to: int) -> list[_Entry]:
        """Up to _SNAPSHOT_RECORDS_MAX records overlapping [offset_from, offset_to)."""
        offsets, positions, lsns = self.offsets, self.positions, self.lsns
        count = len(offsets)
        first = max(bisect.bisect_right(offsets, offset_from) - 1, 0)
        last = min(bisect.bisect_left(offsets, offset_to, first), first + _SNAPSHOT_RECORDS_MAX)
        result = []
        for i in range(first, last):
            offset_next = offsets[i + 1] if i + 1 < count else self.end_offset
            position_next = positions[i + 1] if i + 1 < count else self.size
            result.append(
                _Entry(
                    offsets[i],
                    offset_next - offsets[i],
                    positions[i],
                    position_next - positions[i],
                    lsns[i],
                )
            )
        return result


class _Failure(enum.Enum):
    HEADER = "header"  # The header is short or fails its checks: its length is unknown.
    PAST_EOF = "past_eof"  # A valid header whose payload runs past the end of the file.
    PAYLOAD = "payload"  # A valid header whose payload fails its CRC.
    CHAIN = "chain"  # A fully valid record whose offset or LSN breaks the chain.


@dataclass(frozen=True, slots=True)
class _ScanFailure:
    kind: _Failure
    position: int
    detail: str
    record_end: int = 0  # Declared end of the record (PAST_EOF, PAYLOAD).


class TableLog:
    """The segmented data files of one table. See the module docstring for threads."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes_max: int = limits.SEGMENT_BYTES_MAX,
        writeback_bytes: int = limits.DATA_WRITEBACK_BYTES,
        files: Files = REAL_FILES,
        open_files: OpenFiles = OPEN_DATA_FILES,
        writeback: Writeback = DATA_WRITEBACK,
    ) -> None:
        """Open (creating if missing, durably: `ensure_dir`) and recover the table's data
        files; what is found is fsynced. Raises CorruptionError on a failing record other
        than a torn tail, OSError from the disk. `open_files` bounds the fds held (the
        process-wide one by default)."""
        assert segment_bytes_max > HEADER_SIZE, segment_bytes_max
        self._directory = directory
        self._segment_bytes_max = segment_bytes_max
        self._writeback_bytes = writeback_bytes
        self._writeback = writeback
        self._files = files
        self._open_files = open_files
        self._lock = threading.Lock()
        self._segments: list[_Segment] = []  # Oldest first; the last is the active one.
        self._row_count = 0
        self._lsn_last = 0
        self._bytes_total = 0
        self._truncations = 0  # Bumped by truncate_from: readers' snapshots are stale.
        self._unsynced: list[_Segment] = []  # Sealed since the last sync, written before it.
        self._dirty = False  # The active segment was created or appended to since the last sync.
        self._bytes_since_writeback = 0  # Appended to the active segment since its last one.
        self._directory_dirty = False  # Segment created since the last sync.
        self._closed = False
        # A failed write that left garbage, or a failed fsync (whose retry could succeed with
        # the data lost: Linux marks the pages clean after a writeback error).
        self._write_error: CorruptionError | None = None
        ensure_dir(files, directory, root=directory)
        self._recover()

    # --- properties (any thread) ---------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def lsn_last(self) -> int:
        """LSN of the last record on disk (written, maybe not yet synced); 0 if none."""
        return self._lsn_last

    @property
    def row_count(self) -> int:
        """The next row's offset: rows [0, row_count) were appended over the table's life."""
        return self._row_count

    @property
    def earliest_offset(self) -> int:
        """The first offset still retained (== row_count when no rows are retained)."""
        with self._lock:
            return self._earliest_offset_locked()

    @property
    def bytes_total(self) -> int:
        return self._bytes_total

    @property
    def failed(self) -> CorruptionError | None:
        """Why the table refuses writes (reopen it to go on), or None."""
        return self._write_error

    # --- writer thread ---------------------------------------------------------------------

    def append(self, record: DataRecord) -> None:
        """Write one record after the last (no fsync; see `sync`). Writer thread only.
        Raises OSError from the disk; the file is then cut back to the last whole record (if
        that fails too, CorruptionError, and the table refuses writes: `failed`)."""
        assert not self._closed
        if self._write_error is not None:
            raise self._write_error
        assert record.lsn >= self._lsn_last, (record.lsn, self._lsn_last)
        assert record.first_offset == self._row_count, (record.first_offset, self._row_count)
        assert record.row_count >= 1, record.row_count
        parts = storage_format.encode_record(
            record.lsn, record.first_offset, record.row_count, record.timestamp_ms, record.payload
        )
        header = storage_format.decode_header(parts[0])
        active = self._segments[-1] if self._segments else None
        if active is None or (
            active.size > 0 and active.size + header.record_size > self._segment_bytes_max
        ):
            active = self._roll(record.first_offset)
        ref = active.handle  # _handle(active), inlined: this is the hot path.
        handle = ref() if ref is not None else None
        if handle is None:
            handle = self._handle(active)
        handle.used = True
        allocate_for_append(self._files, handle.fd, active.size, header.record_size)
        try:
            _write_all(self._files, handle.fd, parts, header.record_size)
        except OSError:
            self._undo_partial_write(active, handle)
            raise
        with self._lock:
            active.add(header, active.size)
            self._row_count = active.end_offset
            self._lsn_last = header.lsn
            self._bytes_total += header.record_size
        self._dirty = True
        self._bytes_since_writeback += header.record_size
        if self._bytes_since_writeback >= self._writeback_bytes:
            # Let the disk start on it now, so that the checkpoint's fsync of every table
            # (on the Raft thread: a long one holds heartbeats back and can cost an
            # election) finds little left to write.
            self._bytes_since_writeback = 0
            self._writeback.request(handle)

    def sync(self) -> None:
        """Make every record appended so far durable: fsync the segments written since the last
        sync, then the directory if a segment was created or removed. Writer thread only.
        Raises OSError the first time an fsync fails, CorruptionError from then on
        (`_write_error`).

        The order matters: the directory is fsynced only after every segment's data, so a
        segment's name is never durable while an older segment may still lose its tail (a
        power loss would leave a gap in the chain, which recovery must call corruption)."""
        assert not self._closed
        if self._write_error is not None:
            raise self._write_error
        while self._unsynced:
            self._sync_oldest_sealed()
        if self._dirty:
            active = self._segments[-1]
            self._fsync(active, self._handle(active))
            self._dirty = False
        if self._directory_dirty:
            # Cleared first: retention (any thread) may set it again meanwhile, and then the
            # next sync fsyncs again rather than miss its removal.
            self._directory_dirty = False
            try:
                self._files.fsync_dir(self._directory)
            except OSError as error:
                self._write_error = CorruptionError(
                    str(self._directory), 0, f"directory fsync failed: {error}"
                )
                raise

    def start_at(self, offset: int) -> None:
        """Make an empty log continue at `offset`: the table's rows before it are gone from
        every replica (retention), so a replica rebuilt from scratch starts where its peers'
        data begins. Durable (an empty segment named after `offset`, as `truncate_from`
        leaves when it removes everything). Writer thread only."""
        assert not self._closed
        with self._lock:
            retained = self._row_count - self._earliest_offset_locked()
        if retained:
            raise AssertionError(f"start_at({offset}) on a log holding {retained} rows")
        if offset <= self._row_count:
            return
        self.sync()
        with self._lock:
            stale, self._segments = self._segments, []
            for segment in stale:
                segment.removed = True
        try:
            for segment in stale:
                self._forget_handle(segment)
                self._files.unlink(segment.path)
            self._roll(offset)
        except OSError as error:
            self._fail_midway("start_at", error)
            raise
        with self._lock:
            self._refresh_totals_locked()
        self.sync()
        log.warning(
            "table log starts at offset %d (the rows before it are elsewhere or gone) directory=%s",
            offset,
            self._directory,
        )

    def truncate_from(self, offset: int) -> None:
        """Drop every record whose first_offset >= offset (repair), durably: later segments are
        deleted newest first, then the segment holding the cut is truncated and fsynced, so a
        crash midway leaves a consistent (longer) prefix. Writer thread only. Readers running
        at the same time stop early. An OSError midway leaves the files a longer prefix than
        the index: the table then refuses writes (CorruptionError) until it is reopened."""
        assert not self._closed
        assert offset >= 0, offset
        self.sync()
        with self._lock:
            removed, cut = self._cut_index(offset)
            if not removed and cut is None:
                return
            for segment in removed:
                segment.removed = True
            self._truncations += 1
            self._refresh_totals_locked()
        try:
            for segment in reversed(removed):
                self._forget_handle(segment)
                self._files.unlink(segment.path)
            if removed:
                self._files.fsync_dir(self._directory)
            if cut is not None:
                handle = self._handle(cut)
                self._files.ftruncate(handle.fd, cut.size)
                self._fsync(cut, handle)
        except OSError as error:
            self._fail_midway("truncate_from", error)
            raise
        log.warning(
            "truncated table log directory=%s offset=%d row_count=%d lsn_last=%d",
            self._directory,
            offset,
            self._row_count,
            self._lsn_last,
        )

    def close(self) -> None:
        """Close the table's files (no fsync: call `sync` first to keep unsynced appends).
        Readers already iterating finish their current batch of records on the handle they
        hold; later reads raise NodeUnavailable. Writer thread only. Idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            segments = list(self._segments)
        self._unsynced.clear()
        for segment in segments:
            self._forget_handle(segment)  # Closed when the last reader lets go.

    def destroy(self) -> None:
        """Close and delete the table's directory (durably)."""
        self.close()
        self._files.rmtree(self._directory)
        self._files.fsync_dir(self._directory.parent)

    # --- any thread ------------------------------------------------------------------------

    def read(self, offset_from: int, offset_to: int | None = None) -> Iterator[DataRecord]:
        """The records overlapping [offset_from, offset_to), in order; offset_to None means up
        to row_count as of this call. The first record may start before offset_from (callers
        slice rows). Any thread.

        Raises OffsetOutOfRange now if offset_from is outside [earliest_offset, row_count].
        While iterating, raises CorruptionError(path, position, detail) for a record failing
        its checks, and OffsetOutOfRange if retention removes the rows before they are read.
        A concurrent `truncate_from` ends the iteration early.
        """
        with self._lock:
            earliest = self._earliest_offset_locked()
            latest = self._row_count
            truncations = self._truncations
        if offset_from < earliest or offset_from > latest:
            raise OffsetOutOfRange(self._directory.name, offset_from, earliest, latest)
        offset_end = latest if offset_to is None else min(offset_to, latest)
        return self._iter_records(offset_from, offset_end, truncations)

    def record_at(self, offset: int) -> DataRecord:
        """The record holding row `offset`. Raises OffsetOutOfRange, CorruptionError."""
        for record in self.read(offset, offset + 1):
            return record
        raise OffsetOutOfRange(self._directory.name, offset, self.earliest_offset, self._row_count)

    def offset_for_time(self, timestamp_ms: int) -> tuple[int, int] | None:
        """The first retained record stamped at or after `timestamp_ms` (Kafka's
        offsetsForTimes): its first offset and its timestamp; None when every retained
        record is older. Records share their entry's timestamp, stamped by the leader that
        proposed it; when leaders' clocks disagree, the first record stamped >= t wins even
        if an older stamp follows it. Any thread; answered from the in-memory index (built
        from the record headers when the files are opened)."""
        with self._lock:
            for segment in self._segments:
                times = segment.times
                if not times or times[-1] < timestamp_ms:
                    continue
                index = bisect.bisect_left(times, timestamp_ms)
                # The running maximum rises at `index`: this is the record's own stamp.
                return segment.offsets[index], times[index]
        return None

    def newest_records_offset(self, count: int) -> int:
        """The first offset of the `count`-th newest retained record (the earliest retained
        offset when fewer are retained): the rows from there on fill at most `count`
        records. Any thread; answered from the in-memory index."""
        assert count >= 1, count
        with self._lock:
            for segment in reversed(self._segments):
                if count <= len(segment.offsets):
                    return int(segment.offsets[-count])
                count -= len(segment.offsets)
            return self._earliest_offset_locked()

    def remove_segments_before(self, timestamp_ms: int, *, keep_rows: int) -> int:
        """Retention: delete sealed segments, oldest first, while the segment's newest record
        is older than timestamp_ms and it holds none of the last keep_rows rows (nor the last
        record). Returns the number of rows removed; earliest_offset moves up by that much.

        The removal is made durable by the next `sync`, not here: a directory fsync now
        would also make durable the names of newer segments whose older neighbours may not
        be synced yet (see `sync`). A power loss before that sync brings the segments back,
        and the next retention removes them again. So does a restart after an unlink failed
        (OSError; the segments are forgotten in memory, oldest first, either way)."""
        assert keep_rows >= 0, keep_rows
        removed: list[_Segment] = []
        with self._lock:
            keep_from = self._row_count - keep_rows
            while len(self._segments) > 1:
                segment = self._segments[0]
                if (
                    segment.timestamp_ms_max is None
                    or segment.timestamp_ms_max >= timestamp_ms
                    or segment.end_offset > keep_from
                    or segment.end_offset >= self._row_count
                ):
                    break
                self._segments.pop(0)
                self._bytes_total -= segment.size
                segment.removed = True
                removed.append(segment)
        if not removed:
            return 0
        for segment in removed:
            self._forget_handle(segment)
            self._files.unlink(segment.path)
        self._directory_dirty = True
        rows_removed = sum(segment.row_count for segment in removed)
        log.info(
            "removed segments directory=%s segments=%d rows=%d earliest_offset=%d",
            self._directory,
            len(removed),
            rows_removed,
            removed[-1].end_offset,
        )
        return rows_removed

    # --- internals -----------------------------------------------------------------------

    def _earliest_offset_locked(self) -> int:
        return self._segments[0].first_offset if self._segments else self._row_count

    def _refresh_totals_locked(self) -> None:
        self._bytes_total = sum(segment.size for segment in self._segments)
        self._row_count = self._segments[-1].end_offset if self._segments else 0
        self._lsn_last = max((segment.lsn_last for segment in self._segments), default=0)

    def _roll(self, first_offset: int) -> _Segment:
        """Start a new active segment whose first record will be at first_offset."""
        if len(self._unsynced) >= _UNSYNCED_SEGMENTS_MAX:
            self._sync_oldest_sealed()
        path = self._directory / segment_name(first_offset)
        segment = _Segment(path, first_offset)
        self._bytes_since_writeback = 0  # The sealed segment's rest is left to its fsync.
        flags = _DATA_FILE_FLAGS | os.O_CREAT | os.O_EXCL
        handle = self._open_files.open(self._files, path, flags)  # Nothing changed if it fails.
        segment.handle = weakref.ref(handle)
        if self._dirty and self._segments:
            self._unsynced.append(self._segments[-1])
        self._dirty = True  # The new file itself, even before its first record.
        self._directory_dirty = True
        with self._lock:
            self._segments.append(segment)
        log.debug("new segment path=%s", path)
        return segment

    def _handle(self, segment: _Segment) -> FileHandle:
        """The segment's open handle (reopened if OpenFiles dropped it), marked used. The
        caller holds it for one operation only. Writer thread (readers: `_handle_locked`)."""
        ref = segment.handle
        handle = ref() if ref is not None else None
        if handle is None:
            with self._lock:
                return self._handle_locked(segment)
        handle.used = True
        return handle

    def _handle_locked(self, segment: _Segment) -> FileHandle:
        assert not segment.removed, segment.path
        ref = segment.handle
        handle = ref() if ref is not None else None
        if handle is None:
            handle = self._open_files.open(self._files, segment.path, _DATA_FILE_FLAGS)
            segment.handle = weakref.ref(handle)
        handle.used = True
        return handle

    def _forget_handle(self, segment: _Segment) -> None:
        """Stop holding the segment's fd: it closes once no reader uses it."""
        ref, segment.handle = segment.handle, None
        handle = ref() if ref is not None else None
        if handle is not None:
            self._open_files.forget(handle)

    def _fsync(self, segment: _Segment, handle: FileHandle) -> None:
        try:
            self._files.fsync(handle.fd)
        except OSError as error:
            self._write_error = CorruptionError(
                str(segment.path), segment.size, f"fsync failed: {error}"
            )
            raise

    def _sync_oldest_sealed(self) -> None:
        segment = self._unsynced[0]
        with self._lock:
            # Retention may have deleted it meanwhile: nothing left to make durable.
            handle = None if segment.removed else self._handle_locked(segment)
        if handle is not None:
            self._fsync(segment, handle)
        self._unsynced.pop(0)

    def _fail_midway(self, what: str, error: OSError) -> None:
        """The files no longer match the index: refuse writes until the table is reopened
        (recovery then reads what the files hold)."""
        if self._write_error is None:
            self._write_error = CorruptionError(
                str(self._directory), 0, f"{what} failed midway: {error}"
            )

    def _undo_partial_write(self, active: _Segment, handle: FileHandle) -> None:
        """Cut a failed write back to the last whole record, so later appends cannot land
        after garbage. If even that fails the table cannot be written any more."""
        try:
            self._files.ftruncate(handle.fd, active.size)
        except OSError as error:
            self._write_error = CorruptionError(
                str(active.path), active.size, f"cannot remove a partial write: {error}"
            )
            raise self._write_error from error

    def _cut_index(self, offset: int) -> tuple[list[_Segment], _Segment | None]:
        """Drop index entries with first_offset >= offset: (segments removed entirely, the
        segment cut inside or None). Keeps the invariant that only a sole segment is empty."""
        segments = self._segments
        index = max(bisect.bisect_right(segments, offset, key=_first_offset) - 1, 0)
        while index < len(segments):
            record_index = bisect.bisect_left(segments[index].offsets, offset)
            if record_index < len(segments[index].offsets):
                break
            index += 1
        else:
            return [], None
        cut: _Segment | None = segments[index]
        assert cut is not None
        cut.cut(record_index)
        removed = segments[index + 1 :]
        del segments[index + 1 :]
        if cut.size == 0 and index > 0:
            removed.insert(0, segments.pop())
            cut = None
        return removed, cut

    def _iter_records(self, offset: int, offset_end: int, truncations: int) -> Iterator[DataRecord]:
        while offset < offset_end:
            snapshot = self._snapshot(offset, offset_end, truncations)
            if snapshot is None:
                return
            segment, handle, entries = snapshot
            for entry in entries:
                record = self._read_entry(segment, handle, entry, truncations)
                if record is None:
                    return
                yield record
            del handle, snapshot  # Let OpenFiles close it between batches.
            offset = entries[-1].first_offset + entries[-1].row_count

    def _snapshot(
        self, offset: int, offset_end: int, truncations: int
    ) -> tuple[_Segment, FileHandle, list[_Entry]] | None:
        """The next index entries to read from `offset`, or None if the log was truncated."""
        with self._lock:
            if self._closed:
                raise NodeUnavailable(f"data files of table {self._directory.name} are closed")
            if self._truncations != truncations:
                return None
            earliest = self._earliest_offset_locked()
            if offset < earliest:
                raise OffsetOutOfRange(self._directory.name, offset, earliest, self._row_count)
            index = bisect.bisect_right(self._segments, offset, key=_first_offset) - 1
            segment = self._segments[index]
            entries = segment.entries(offset, offset_end)
            assert entries, (offset, offset_end, segment.path)
            return segment, self._handle_locked(segment), entries

    def _read_entry(
        self, segment: _Segment, handle: FileHandle, entry: _Entry, truncations: int
    ) -> DataRecord | None:
        """Read and check one record (pair assertion: it must match its index entry)."""
        data = self._files.pread(handle.fd, entry.length, entry.position)
        view = memoryview(data)
        try:
            header = storage_format.decode_header(view)
            if (header.first_offset, header.row_count, header.lsn, header.record_size) != (
                entry.first_offset,
                entry.row_count,
                entry.lsn,
                entry.length,
            ):
                raise FormatError(f"header {header} does not match the index entry {entry}")
            storage_format.check_payload(header, view[HEADER_SIZE:])
        except FormatError as error:
            with self._lock:
                if self._truncations != truncations:
                    return None
            raise CorruptionError(str(segment.path), entry.position, error.detail) from error
        return DataRecord(
            header.lsn,
            header.first_offset,
            header.row_count,
            header.timestamp_ms,
            view[HEADER_SIZE:],
        )

    # --- recovery ------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from the files; cut a torn tail; raise on anything else. Every
        segment found is fsynced, and then the directory: what an earlier run wrote (and was
        killed before syncing) is durable before anything relies on it."""
        files = self._files
        found = sorted(
            (int(match.group(1)), self._directory / name)
            for name in files.listdir(self._directory)
            if (match := SEGMENT_NAME_PATTERN.fullmatch(name))
        )
        lsn_prev = 0
        for i, (first_offset, path) in enumerate(found):
            if self._segments and first_offset != self._segments[-1].end_offset:
                raise CorruptionError(
                    str(path),
                    0,
                    f"segment starts at offset {first_offset} but the previous one ends at "
                    f"{self._segments[-1].end_offset}",
                )
            segment = _Segment(path, first_offset)
            if i == len(found) - 1:
                _recover_last(files, segment, lsn_prev)
            else:
                _recover_sealed(files, segment, lsn_prev)
            lsn_prev = segment.lsn_last or lsn_prev
            self._segments.append(segment)
        if len(self._segments) > 1 and self._segments[-1].size == 0:
            # A roll that crashed before its first record: the previous segment is the active
            # one again, so that the last segment always holds the last record.
            empty = self._segments.pop()
            files.unlink(empty.path)
            log.info("removed empty last segment path=%s", empty.path)
        if found:
            files.fsync_dir(self._directory)
        if self._segments:
            self._refresh_totals_locked()


def _first_offset(segment: _Segment) -> int:
    return segment.first_offset


def _recover_sealed(files: Files, segment: _Segment, lsn_prev: int) -> None:
    fd = files.open(segment.path, os.O_RDONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        file_size = files.size(fd)
        failure = _scan(files, segment, fd, file_size, lsn_prev, verify_payloads=False)
        if failure is None and file_size > 0:
            files.fsync(fd)
    finally:
        files.close(fd)
    if failure is not None:
        raise CorruptionError(str(segment.path), failure.position, failure.detail)
    if file_size == 0:
        raise CorruptionError(str(segment.path), 0, "sealed segment is empty")


def _recover_last(files: Files, segment: _Segment, lsn_prev: int) -> None:
    fd = files.open(segment.path, os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
    try:
        file_size = files.size(fd)
        failure = _scan(files, segment, fd, file_size, lsn_prev, verify_payloads=True)
        if failure is not None:
            if not _is_torn_tail(files, fd, file_size, failure):
                raise CorruptionError(str(segment.path), failure.position, failure.detail)
            log.warning(
                "truncated torn tail path=%s position=%d detail=%s",
                segment.path,
                failure.position,
                failure.detail,
            )
            files.ftruncate(fd, failure.position)
        files.fsync(fd)
    finally:
        files.close(fd)


def _scan(
    files: Files,
    segment: _Segment,
    fd: int,
    file_size: int,
    lsn_prev: int,
    *,
    verify_payloads: bool,
) -> _ScanFailure | None:
    """Index every valid record of the file, in order; the first failure stops the scan."""
    position = 0
    while position < file_size:
        try:
            header = storage_format.decode_header(files.pread(fd, HEADER_SIZE, position))
        except FormatError as error:
            return _ScanFailure(_Failure.HEADER, position, error.detail)
        record_end = position + header.record_size
        if record_end > file_size:
            detail = f"record of {header.record_size} bytes runs past the end ({file_size})"
            return _ScanFailure(_Failure.PAST_EOF, position, detail, record_end)
        if verify_payloads:
            payload = files.pread(fd, header.payload_len, position + HEADER_SIZE)
            try:
                storage_format.check_payload(header, payload)
            except FormatError as error:
                return _ScanFailure(_Failure.PAYLOAD, position, error.detail, record_end)
        if header.first_offset != segment.end_offset:
            detail = f"record first_offset {header.first_offset} != {segment.end_offset}"
            return _ScanFailure(_Failure.CHAIN, position, detail)
        if header.lsn < max(lsn_prev, segment.lsn_last):
            detail = f"record lsn {header.lsn} < previous {max(lsn_prev, segment.lsn_last)}"
            return _ScanFailure(_Failure.CHAIN, position, detail)
        segment.add(header, position)
        position = record_end
    return None


def _is_torn_tail(files: Files, fd: int, file_size: int, failure: _ScanFailure) -> bool:
    """Whether a failing record can only be an interrupted append: nothing that could be a
    record follows it. A record that checks out but breaks the chain never is."""
    if failure.kind is _Failure.PAST_EOF:
        return True
    if failure.kind is _Failure.HEADER:
        # The length is untrusted; torn only if every byte after the header slot is zero.
        return _all_zero(files, fd, failure.position + HEADER_SIZE, file_size)
    if failure.kind is _Failure.PAYLOAD:
        return file_size - failure.record_end < HEADER_SIZE or _all_zero(
            files, fd, failure.record_end, file_size
        )
    return False


def _all_zero(files: Files, fd: int, start: int, end: int) -> bool:
    position = start
    while position < end:
        chunk = files.pread(fd, min(_ZERO_CHECK_CHUNK_BYTES, end - position), position)
        if not chunk or chunk.count(0) != len(chunk):
            return False
        position += len(chunk)
    return True


def _write_all(files: Files, fd: int, parts: list[bytes | memoryview], size: int) -> None:
    """One writev; a short write (a disk filling up) is finished with plain writes."""
    written = files.writev(fd, parts)
    if written == size:
        return
    rest = memoryview(b"".join(parts))[written:]
    while rest:
        rest = rest[files.write(fd, rest) :]
