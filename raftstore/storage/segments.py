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

Index: in memory, per segment, four parallel arrays (first offset, file position, LSN,
running maximum of the timestamps) of every INDEX_STRIDE-th record, rebuilt at open by
reading headers only: 32 bytes per INDEX_STRIDE records (a day of one-row appends at 400/s,
35 million records, is 35 MB, not 1.1 GB). A read finds the indexed record at or before
its offset and reads the headers from there (at most INDEX_STRIDE - 1), then one pread per
record that also fetches the next header; no per-row work.

Threads: one writer thread calls `append`, `sync`, `truncate_from`, `close` and `destroy`.
Any number of reader threads call `read` and `record_at`; `remove_segments_before` may run on
any thread (it never touches the active segment). The index is guarded by a lock, and a
segment's size and end offset move past a record only after it is completely written;
readers plan each batch of records under the lock and read it without (`pread` on the
segment's handle, held for the batch), never past the size they saw, so they never see
half a record. A `truncate_from` bumps a count before it cuts a file, and a reader that
sees the count changed ends its read.
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
from collections.abc import Generator, Iterator
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
from raftstore.values import entry_value

log = logging.getLogger(__name__)

SEGMENT_NAME_PATTERN: Final = re.compile(r"seg-(\d{20})\.dat")
# The index keeps every INDEX_STRIDE-th record of a segment (see _Segment): 1 byte per
# record in memory instead of 32, and at most INDEX_STRIDE - 1 headers read to find a record.
INDEX_STRIDE: Final = 32
# Records a reader reads per look at the index: a truncation stops readers within this many.
_SNAPSHOT_RECORDS_MAX: Final = 1024
_ZERO_CHECK_CHUNK_BYTES: Final = 1024 * 1024
# Sealed segments whose fsync waits for the next `sync`; beyond it a roll fsyncs the oldest
# (bounds the work, and the latency, of the checkpoint's `sync`).
_UNSYNCED_SEGMENTS_MAX: Final = 8
# Every data-file handle: readers pread, the writer appends (O_APPEND), truncate_from cuts.
_DATA_FILE_FLAGS: Final = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC


def segment_name(first_offset: int) -> str:
    return f"seg-{first_offset:020d}.dat"


@entry_value
class DataRecord:
    """One record: a batch of `row_count` rows at offsets [first_offset, first_offset +
    row_count), carried by Raft entry `lsn`. `payload` is an Arrow IPC record-batch message,
    opaque here; records returned by `read` hold a memoryview into their own buffer."""

    lsn: int
    first_offset: int
    row_count: int
    timestamp_ms: int
    payload: bytes | memoryview


class _Start(NamedTuple):
    """Where a walk through a segment's records begins: an indexed record (the index keeps
    every `stride`-th one) and the segment's bounds when the walk was planned."""

    record_index: int
    position: int
    first_offset: int
    lsn: int
    end_position: int  # Bytes of complete records: the walk never reads past them.


class _Segment:
    """One segment file and its sparse index. Mutated under the log's lock.

    The index keeps every `stride`-th record (record 0, stride, 2 * stride, ...): its first
    offset, file position, LSN and the running maximum of the timestamps up to it. Any
    other record is found by reading the headers from the indexed one before it, at most
    stride - 1 of them. So the memory is 32 bytes per `stride` records, not per record."""

    __slots__ = (
        "count",
        "end_offset",
        "first_offset",
        "handle",
        "last_offset",
        "lsn_last",
        "lsns",
        "offsets",
        "path",
        "positions",
        "removed",
        "size",
        "stride",
        "times",
        "timestamp_ms_max",
    )

    def __init__(self, path: Path, first_offset: int, stride: int) -> None:
        self.path = path
        self.stride = stride
        self.first_offset = first_offset
        self.end_offset = first_offset  # Offset after the last row: [first_offset, end_offset).
        self.size = 0  # Bytes of complete, indexed records.
        self.count = 0  # Records.
        self.last_offset = first_offset  # First offset of the last record.
        self.lsn_last = 0  # LSN of the last record; 0 if none.
        # The newest timestamp of the segment (the running maximum at its last record; an
        # overestimate after a cut, which only delays retention and costs `offset_for_time`
        # a read of headers). None while no record was ever added.
        self.timestamp_ms_max: int | None = None
        self.offsets = array("Q")
        self.positions = array("Q")
        self.lsns = array("Q")
        # Per indexed record, the newest timestamp up to it in this segment (a running
        # maximum, so that it can be bisected even when leaders' clocks disagree): the first
        # record whose running maximum is >= t is the first record stamped >= t
        # (`TableLog.offset_for_time`). Records added after a cut may carry the cut ones'
        # newest stamp: an overestimate, never an underestimate, so an indexed record below
        # t still proves that no record up to it is stamped >= t.
        self.times = array("q")
        # Weak: OpenFiles holds the handle and may drop it (closing the fd once nobody uses
        # it); whoever uses the segment takes a strong reference for one operation.
        self.handle: weakref.ref[FileHandle] | None = None
        self.removed = False  # Deleted (retention, truncation): never reopened.

    @property
    def row_count(self) -> int:
        return self.end_offset - self.first_offset

    def add(self, header: RecordHeader, position: int) -> None:
        assert position == self.size, (position, self.size)
        assert header.first_offset == self.end_offset, (header.first_offset, self.end_offset)
        assert header.lsn >= self.lsn_last, (header.lsn, self.lsn_last)
        time = header.timestamp_ms
        if self.count and self.timestamp_ms_max is not None:
            time = max(time, self.timestamp_ms_max)
        if self.count % self.stride == 0:
            self.offsets.append(header.first_offset)
            self.positions.append(position)
            self.lsns.append(header.lsn)
            self.times.append(time)
        self.count += 1
        self.last_offset = header.first_offset
        self.lsn_last = header.lsn
        self.timestamp_ms_max = (
            time if self.timestamp_ms_max is None else max(time, self.timestamp_ms_max)
        )
        self.end_offset += header.row_count
        self.size = position + header.record_size

    def cut(self, record_index: int, position: int, before: RecordHeader | None) -> None:
        """Forget records [record_index, ...): the first of them starts at `position`, and
        `before` is the header of the record before it (None: record_index is 0).
        timestamp_ms_max is kept (see __init__)."""
        assert 0 <= record_index < self.count, (record_index, self.count)
        assert (before is None) == (record_index == 0), (record_index, before)
        kept = -(-record_index // self.stride)  # Indexed records before the cut.
        self.end_offset = (
            self.first_offset if before is None else before.first_offset + before.row_count
        )
        self.size = position
        self.count = record_index
        self.last_offset = self.first_offset if before is None else before.first_offset
        self.lsn_last = 0 if before is None else before.lsn
        del self.offsets[kept:]
        del self.positions[kept:]
        del self.lsns[kept:]
        del self.times[kept:]

    def start(self, offset: int) -> _Start:
        """Where to begin reading to reach the record holding `offset` (or the first one
        after it): the indexed record at or before it."""
        index = max(bisect.bisect_right(self.offsets, offset) - 1, 0)
        return self.start_at_index(index)

    def start_at_index(self, index: int) -> _Start:
        """The walk from the `index`-th indexed record."""
        return _Start(
            index * self.stride,
            self.positions[index],
            self.offsets[index],
            self.lsns[index],
            self.size,
        )


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
        index_stride: int = INDEX_STRIDE,
    ) -> None:
        """Open (creating if missing, durably: `ensure_dir`) and recover the table's data
        files; what is found is fsynced. Raises CorruptionError on a failing record other
        than a torn tail, OSError from the disk. `open_files` bounds the fds held (the
        process-wide one by default). `index_stride`: see INDEX_STRIDE."""
        assert segment_bytes_max > HEADER_SIZE, segment_bytes_max
        assert index_stride >= 1, index_stride
        self._stride = index_stride
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
        header, parts = storage_format.encode_record_with_header(
            record.lsn, record.first_offset, record.row_count, record.timestamp_ms, record.payload
        )
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
        if an older stamp follows it. Any thread; answered from the index, reading at most
        INDEX_STRIDE headers. Raises CorruptionError for a header failing its checks."""
        with self._lock:
            for segment in self._segments:
                newest = segment.timestamp_ms_max
                if not segment.count or newest is None or newest < timestamp_ms:
                    continue
                index = bisect.bisect_left(segment.times, timestamp_ms)
                if index == 0:
                    return segment.offsets[0], segment.times[0]
                # The running maximum rises between indexed records index - 1 and index (or
                # after the last one): the record where it does is the one.
                time = segment.times[index - 1]
                for _, _, header in self._headers_locked(segment, index - 1):
                    time = max(time, header.timestamp_ms)
                    if time >= timestamp_ms:
                        return header.first_offset, header.timestamp_ms
        return None

    def newest_records_offset(self, count: int) -> int:
        """The first offset of the `count`-th newest retained record (the earliest retained
        offset when fewer are retained): the rows from there on fill at most `count`
        records. Any thread; answered from the index, reading at most INDEX_STRIDE headers.
        Raises CorruptionError for a header failing its checks."""
        assert count >= 1, count
        with self._lock:
            for segment in reversed(self._segments):
                if count <= segment.count:
                    wanted = segment.count - count
                    for record_index, _, header in self._headers_locked(
                        segment, wanted // segment.stride
                    ):
                        if record_index == wanted:
                            return header.first_offset
                    raise AssertionError((wanted, segment.count, segment.path))
                count -= segment.count
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
        segment = _Segment(path, first_offset, self._stride)
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
        segment cut inside or None). Keeps the invariant that only a sole segment is empty.
        Reads the cut segment's headers from the indexed record before `offset`."""
        segments = self._segments
        index = max(bisect.bisect_right(segments, offset, key=_first_offset) - 1, 0)
        while index < len(segments):
            if segments[index].count and segments[index].last_offset >= offset:
                break
            index += 1
        else:
            return [], None
        cut: _Segment | None = segments[index]
        assert cut is not None
        stride_index = max(bisect.bisect_left(cut.offsets, offset) - 1, 0)
        before: RecordHeader | None = None
        for record_index, position, header in self._headers_locked(cut, stride_index):
            if header.first_offset >= offset:
                cut.cut(record_index, position, before)
                break
            before = header
        else:
            raise AssertionError((offset, cut.last_offset, cut.path))
        removed = segments[index + 1 :]
        del segments[index + 1 :]
        if cut.size == 0 and index > 0:
            removed.insert(0, segments.pop())
            cut = None
        return removed, cut

    def _headers_locked(
        self, segment: _Segment, stride_index: int
    ) -> Iterator[tuple[int, int, RecordHeader]]:
        """(record index, position, header) of the segment's records from its
        `stride_index`-th indexed one to its end, each checked against the offset chain.
        Raises CorruptionError. The log's lock is held: the segment does not change."""
        handle = self._handle_locked(segment)
        start = segment.start_at_index(stride_index)
        record_index, position = start.record_index, start.position
        offset, lsn = start.first_offset, start.lsn
        while position < segment.size:
            try:
                header = storage_format.decode_header(
                    self._files.pread(handle.fd, HEADER_SIZE, position)
                )
                _check_chain(header, offset, lsn, exact=position == start.position)
            except FormatError as error:
                raise CorruptionError(str(segment.path), position, error.detail) from error
            yield record_index, position, header
            record_index += 1
            position += header.record_size
            offset, lsn = offset + header.row_count, header.lsn

    def _iter_records(self, offset: int, offset_end: int, truncations: int) -> Iterator[DataRecord]:
        while offset < offset_end:
            snapshot = self._snapshot(offset, truncations)
            if snapshot is None:
                return
            segment, handle, start = snapshot
            del snapshot
            going_on = yield from self._walk(
                segment, handle, start, offset, offset_end, truncations
            )
            del handle  # Let OpenFiles close it between batches.
            if going_on is None:
                return
            offset = going_on

    def _snapshot(
        self, offset: int, truncations: int
    ) -> tuple[_Segment, FileHandle, _Start] | None:
        """Where to read on from `offset`, or None if the log was truncated."""
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
            assert offset < segment.end_offset, (offset, segment.path)
            return segment, self._handle_locked(segment), segment.start(offset)

    def _walk(
        self,
        segment: _Segment,
        handle: FileHandle,
        start: _Start,
        offset_from: int,
        offset_end: int,
        truncations: int,
    ) -> Generator[DataRecord, None, int | None]:
        """Read and check the segment's records from `start` (headers only while they end
        at or before `offset_from`), yielding those overlapping [offset_from, offset_end),
        up to _SNAPSHOT_RECORDS_MAX of them and never past the segment's end as `start`
        saw it (only whole records are indexed, so only whole records are read). Returns
        the offset to read on from, or None when a truncation stopped the read.

        One pread per record: each reads its record and the next one's header. A record
        must continue the chain from the indexed one (offset, LSN). No lock is held: the
        bytes before `start.end_position` change only through `truncate_from`, which bumps
        the truncation count before it cuts a file, so a record read and then found with
        the count unchanged was read before any cut."""
        files, fd, end_position = self._files, handle.fd, start.end_position
        position, offset, lsn = start.position, start.first_offset, start.lsn
        head: bytes | memoryview = files.pread(fd, HEADER_SIZE, position)
        yielded = 0
        while position < end_position and offset < offset_end and yielded < _SNAPSHOT_RECORDS_MAX:
            try:
                header = storage_format.decode_header(head)
                _check_chain(header, offset, lsn, exact=position == start.position)
                record_end = position + header.record_size
                if record_end > end_position:
                    raise FormatError(f"record runs past the segment's end ({end_position})")
                next_head = HEADER_SIZE if record_end < end_position else 0
                payload: memoryview | None = None
                if offset + header.row_count <= offset_from:
                    head = files.pread(fd, next_head, record_end) if next_head else b""
                else:
                    data = memoryview(files.pread(fd, header.record_size + next_head, position))
                    if len(data) != header.record_size + next_head:
                        raise FormatError(f"short read of {len(data)} bytes")
                    payload = data[HEADER_SIZE : header.record_size]
                    storage_format.check_payload(header, payload)
                    head = data[header.record_size :]
            except FormatError as error:
                if self._truncated_since(truncations):
                    return None
                raise CorruptionError(str(segment.path), position, error.detail) from error
            if payload is not None:
                # Unlocked read of an int: see the docstring for why it is enough.
                if self._truncations != truncations:
                    return None
                yield DataRecord(
                    header.lsn, header.first_offset, header.row_count, header.timestamp_ms, payload
                )
                yielded += 1
            position, offset, lsn = record_end, offset + header.row_count, header.lsn
        return offset

    def _truncated_since(self, truncations: int) -> bool:
        with self._lock:
            return self._truncations != truncations

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
            segment = _Segment(path, first_offset, self._stride)
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


def _check_chain(header: RecordHeader, offset: int, lsn: int, *, exact: bool) -> None:
    """A record read by walking from an indexed one must start at `offset` and carry an LSN
    at or after `lsn` (exactly `lsn`, and so the indexed record itself, when `exact`)."""
    if header.first_offset != offset:
        raise FormatError(f"record first_offset {header.first_offset} != {offset}")
    if header.lsn < lsn or (exact and header.lsn != lsn):
        raise FormatError(f"record lsn {header.lsn} does not follow the index's {lsn}")


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
