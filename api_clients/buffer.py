"""Record queues between a producer and the cluster: the durable one on disk and a bounded
one in memory, with the same interface.

`DurableBuffer` follows ReplayQ and eKuiper's sink cache: records are appended to segment
files in a directory (magic + length + CRC32 per record, see `buffer_format`), a COMMIT
marker names the last record the cluster acknowledged, a corrupt tail is truncated on reopen
(logged at WARNING and counted), a byte limit drops the oldest records (counted), and the
records not yet acknowledged are handed out again, in order, after a restart.

Every record carries the buffer's stable `producer_id` and its own `sequence`; they are the
cluster's idempotency token. A record that was applied but whose acknowledgement (or COMMIT
write) was lost is answered from the cluster's producer window when it is resent, not
appended twice. So the COMMIT marker may lag (it is written at most every
`commit_interval_s`) and a corrupt COMMIT falls back to "resend everything": both cost
resends, never duplicates (while the cluster still remembers the producer; see
docs/client.md).

Durability: `append` returns after the record is written and fdatasynced, so it survives a
crash of the process (kill -9) and of the machine. Segments are only deleted once a durable
COMMIT covers all their records.

Threads: any number of producers may `append`; exactly one consumer (a sender thread)
calls `head`/`commit`. One lock guards the in-memory index; appends write and sync outside it.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import enum
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import pyarrow as pa

from api_clients import buffer_format as fmt
from hastream import wire
from hastream.errors import BatchTooLarge, CorruptionError, InvalidArgument, Overloaded
from hastream.files import fsync_dir, write_all, write_atomic

log = logging.getLogger(__name__)

BUFFER_BYTES_MAX_DEFAULT: Final = 1024 * 1024 * 1024
SEGMENT_BYTES_MAX_DEFAULT: Final = 16 * 1024 * 1024
COMMIT_INTERVAL_S_DEFAULT: Final = 0.2
# Payloads appended by this process are kept in memory up to this many bytes, so the sender
# does not read back (and CRC-check) what it has just written; older ones come from disk.
PAYLOAD_CACHE_BYTES_MAX: Final = 32 * 1024 * 1024
META_NAME: Final = "META"
COMMIT_NAME: Final = "COMMIT"
LOCK_NAME: Final = "LOCK"
# Records the cluster refused for good, moved out of the queue by `reject_head`.
REJECTED_DIR: Final = "rejected"


@dataclass(frozen=True, slots=True)
class BufferedRecord:
    """One publish request waiting for the cluster: `payload` is its Arrow IPC stream."""

    sequence: int
    row_count: int
    payload: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferStats:
    """Counters of one buffer. `pending_*` are records not yet acknowledged (nor dropped);
    `reopened_*` were found pending when the buffer was opened (left by an earlier run)."""

    pending_records: int
    pending_rows: int
    pending_bytes: int
    committed_sequence: int
    next_sequence: int
    acknowledged_records: int
    acknowledged_rows: int
    dropped_records: int  # By the byte limit, oldest first.
    dropped_rows: int
    # The rest only a DurableBuffer has.
    truncated_tails: int = 0  # Corrupt tails cut off on reopen.
    truncated_bytes: int = 0
    reopened_records: int = 0
    reopened_rows: int = 0
    segments: int = 0
    rejected_records: int = 0  # Moved to rejected/ by reject_head (this run and earlier ones).
    rejected_rows: int = 0


class RecordQueue(Protocol):
    """What a sender needs from a buffer; `DurableBuffer` and `MemoryBuffer` implement it."""

    @property
    def producer_id(self) -> bytes: ...

    def append(self, payload: bytes, row_count: int) -> int: ...

    def wait_for_space(self, timeout_s: float) -> bool: ...

    def head(self, timeout_s: float) -> BufferedRecord | None: ...

    def commit(self, sequence: int) -> None: ...

    def flush_commit(self) -> None: ...

    def pending_records(self) -> list[BufferedRecord]: ...

    def stats(self) -> BufferStats: ...

    def close(self) -> None: ...


class _State(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"  # Handed out by head(), not yet committed.
    DROPPED = "dropped"  # Dropped by the byte limit before it was sent.


@dataclass(slots=True)
class _Entry:
    sequence: int
    row_count: int
    record_bytes: int
    segment: int  # First sequence of the segment (its key); -1 in memory.
    position: int  # Byte offset of the record in its segment.
    state: _State
    payload: bytes | None = None  # MemoryBuffer only.


@dataclass(slots=True)
class _Segment:
    path: Path
    read_fd: int
    size: int
    last_sequence: int  # 0 while empty.


def check_request(payload: bytes, row_count: int) -> None:
    """Refuses a record one publish request cannot carry: it would be refused for good."""
    if not payload or row_count < 1:
        raise InvalidArgument("record", f"{len(payload)} bytes, {row_count} rows: need both > 0")
    if len(payload) > wire.BATCH_BYTES_MAX:
        raise BatchTooLarge(len(payload), wire.BATCH_BYTES_MAX)
    if row_count > wire.BATCH_ROWS_MAX:
        raise BatchTooLarge(row_count, wire.BATCH_ROWS_MAX, "rows")


class _Index:
    """The records not yet done, oldest first, with the byte limit's drop-oldest rule and
    the counters. Pure bookkeeping, shared by both buffers; the caller holds the lock."""

    def __init__(self, bytes_max: int, committed: int) -> None:
        self.bytes_max = bytes_max
        self.entries: collections.deque[_Entry] = collections.deque()
        self.committed = committed
        self.pending_records = 0
        self.pending_bytes = 0
        self.pending_rows = 0
        self.acknowledged_records = 0
        self.acknowledged_rows = 0
        self.dropped_records = 0
        self.dropped_rows = 0

    def add(self, entry: _Entry) -> list[_Entry]:
        """Adds a new record; returns the records the byte limit dropped to make room."""
        assert not self.entries or entry.sequence > self.entries[-1].sequence
        assert entry.sequence > self.committed, (entry.sequence, self.committed)
        self.entries.append(entry)
        self.pending_records += 1
        self.pending_bytes += entry.record_bytes
        self.pending_rows += entry.row_count
        if self.pending_bytes <= self.bytes_max:
            return []
        return self._enforce_limit()

    def _enforce_limit(self) -> list[_Entry]:
        dropped: list[_Entry] = []
        # The newest record always stays, as in ReplayQ: the limit is checked after adding.
        for entry in list(self.entries)[:-1]:
            if self.pending_bytes <= self.bytes_max:
                break
            if entry.state is not _State.PENDING:
                continue  # Already dropped, or being sent right now.
            entry.state = _State.DROPPED
            entry.payload = None
            self.pending_records -= 1
            self.pending_bytes -= entry.record_bytes
            self.pending_rows -= entry.row_count
            self.dropped_records += 1
            self.dropped_rows += entry.row_count
            dropped.append(entry)
        self._advance()
        return dropped

    def stats(self, next_sequence: int, **durable: int) -> BufferStats:
        """The counters of this index; `durable` adds those only a DurableBuffer has."""
        return BufferStats(
            pending_records=self.pending_records,
            pending_rows=self.pending_rows,
            pending_bytes=self.pending_bytes,
            committed_sequence=self.committed,
            next_sequence=next_sequence,
            acknowledged_records=self.acknowledged_records,
            acknowledged_rows=self.acknowledged_rows,
            dropped_records=self.dropped_records,
            dropped_rows=self.dropped_rows,
            **durable,
        )

    def head(self) -> _Entry | None:
        for entry in self.entries:
            if entry.state is not _State.DROPPED:
                return entry
        return None

    def commit(self, sequence: int) -> None:
        """The cluster acknowledged every record up to `sequence` (the head, normally)."""
        while self.entries and self.entries[0].sequence <= sequence:
            entry = self.entries.popleft()
            if entry.state is not _State.DROPPED:
                self.pending_records -= 1
                self.pending_bytes -= entry.record_bytes
                self.pending_rows -= entry.row_count
                self.acknowledged_records += 1
                self.acknowledged_rows += entry.row_count
        self.committed = max(self.committed, sequence)
        self._advance()

    def _advance(self) -> None:
        while self.entries and self.entries[0].state is _State.DROPPED:
            self.committed = max(self.committed, self.entries.popleft().sequence)
        assert self.pending_bytes >= 0, self.pending_bytes
        assert self.pending_rows >= 0, self.pending_rows
        assert self.pending_records >= 0, self.pending_records


class DurableBuffer:
    """A directory of segment files holding records not yet acknowledged by the cluster.

    Opening it takes an exclusive lock on `<directory>/LOCK` (InvalidArgument if another
    process or writer holds it), scans every segment (CRC-checking each record), truncates
    a corrupt tail of the last segment (WARNING + `truncated_tails`), and queues every record
    after the COMMIT marker again. A bad record in an earlier (sealed) segment holding
    records not yet acknowledged raises CorruptionError: those rows were fsynced, so their
    loss is never silent. `table` must match the table the directory was created for.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        table: str,
        bytes_max: int = BUFFER_BYTES_MAX_DEFAULT,
        segment_bytes_max: int = SEGMENT_BYTES_MAX_DEFAULT,
        commit_interval_s: float = COMMIT_INTERVAL_S_DEFAULT,
    ) -> None:
        if bytes_max <= 0:
            raise InvalidArgument("bufferBytesMax", f"must be > 0, got {bytes_max}")
        if segment_bytes_max <= 0:
            raise InvalidArgument("segment_bytes_max", f"must be > 0, got {segment_bytes_max}")
        self._directory = Path(directory)
        self._table = table
        self._segment_bytes_max = segment_bytes_max
        self._commit_interval_s = commit_interval_s
        self._lock = threading.Condition()
        self._append_lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}  # first sequence -> segment, in order
        self._active: int | None = None  # key of the segment appends go to
        self._active_fd = -1
        self._commit_written = 0
        self._commit_written_at = 0.0
        self._truncated_tails = 0
        self._truncated_bytes = 0
        self._reopened_records = 0
        self._reopened_rows = 0
        self._rejected_records = 0
        self._rejected_rows = 0
        self._closed = False
        self._cache: dict[int, bytes] = {}  # sequence -> payload, see PAYLOAD_CACHE_BYTES_MAX
        self._cache_bytes = 0
        self._directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._take_lock()
        try:
            self._producer_id, self._schema_ipc = self._open_meta()
            committed = self._read_commit()
            self._index = _Index(bytes_max, committed)
            self._next_sequence = committed + 1
            self._scan_segments()
        except BaseException:
            self._release_files()
            raise
        log.info(
            "buffer opened dir=%s producer=%s pending_records=%d committed=%d",
            self._directory,
            self._producer_id.hex(),
            self._reopened_records,
            self._index.committed,
        )

    # -- opening ---------------------------------------------------------------------

    def _take_lock(self) -> int:
        fd = os.open(self._directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise InvalidArgument(
                "durableBufferDir",
                f"{self._directory} is in use by another writer (pid {holder or '?'})",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _open_meta(self) -> tuple[bytes, bytes]:
        path = self._directory / META_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            if any(fmt.segment_first_sequence(p.name) is not None for p in self._listing()):
                raise CorruptionError(str(path), 0, "META is missing next to segments") from None
            producer_id = secrets.token_bytes(fmt.PRODUCER_ID_BYTES)
            write_atomic(path, fmt.encode_meta(producer_id, self._table, b""))
            return producer_id, b""
        try:
            producer_id, table, schema_ipc = fmt.decode_meta(data)
        except (fmt.FormatError, UnicodeDecodeError) as error:
            raise CorruptionError(str(path), 0, str(error)) from error
        if table != self._table:
            raise InvalidArgument(
                "durableBufferDir",
                f"{self._directory} buffers table {table!r}, not {self._table!r}",
            )
        return producer_id, schema_ipc

    def _read_commit(self) -> int:
        path = self._directory / COMMIT_NAME
        try:
            sequence, producer_id = fmt.decode_commit(path.read_bytes())
        except FileNotFoundError:
            return 0
        except fmt.FormatError as error:
            # Safe fallback: every record is resent, and the cluster's producer window
            # answers the ones it already applied instead of appending them again.
            log.warning("buffer COMMIT unreadable, resending all path=%s error=%s", path, error)
            return 0
        if producer_id != self._producer_id:
            log.warning("buffer COMMIT of another producer ignored path=%s", path)
            return 0
        self._commit_written = sequence
        return sequence

    def _listing(self) -> list[Path]:
        return sorted(self._directory.iterdir())

    def _scan_segments(self) -> None:
        names = sorted(
            (first, path)
            for path in self._listing()
            if (first := fmt.segment_first_sequence(path.name)) is not None
        )
        for number, (first, path) in enumerate(names):
            is_last = number == len(names) - 1
            next_first = names[number + 1][0] if not is_last else None
            self._scan_segment(first, path, is_last=is_last, next_first=next_first)
        self._reopened_records = self._index.pending_records
        self._reopened_rows = self._index.pending_rows
        self._rejected_records, self._rejected_rows = self._count_rejected()
        self._delete_done_segments()

    def _scan_segment(
        self, first: int, path: Path, *, is_last: bool, next_first: int | None
    ) -> None:
        data = path.read_bytes()
        position = 0
        last_sequence = 0
        entries: list[_Entry] = []
        while position < len(data):
            try:
                header = self._check_record(data, position)
            except fmt.FormatError as error:
                done = next_first is not None and next_first - 1 <= self._index.committed
                if not is_last and not done:
                    raise CorruptionError(str(path), position, error.detail) from error
                self._truncate(path, position, len(data), error.detail)
                break
            entries.append(
                _Entry(
                    header.sequence,
                    header.row_count,
                    header.record_bytes,
                    first,
                    position,
                    _State.PENDING,
                )
            )
            last_sequence = header.sequence
            self._next_sequence = max(self._next_sequence, header.sequence + 1)
            position += header.record_bytes
        if position == 0:
            path.unlink()  # Empty (created, then the process died): nothing to keep.
            return
        read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._segments[first] = _Segment(path, read_fd, position, last_sequence)
        for entry in entries:
            if entry.sequence > self._index.committed:
                self._index.add(entry)

    def _check_record(self, data: bytes, position: int) -> fmt.RecordHeader:
        view = memoryview(data)[position:]
        header = fmt.decode_header(view)
        if header.record_bytes > len(view):
            raise fmt.FormatError(f"record of {header.record_bytes} bytes runs past the end")
        fmt.check_record(
            view[: fmt.RECORD_HEADER_BYTES], view[fmt.RECORD_HEADER_BYTES : header.record_bytes]
        )
        if header.producer_id != self._producer_id:
            raise fmt.FormatError("record of another producer")
        if header.sequence < self._next_sequence and header.sequence > self._index.committed:
            raise fmt.FormatError(f"sequence {header.sequence} does not increase")
        return header

    def _truncate(self, path: Path, position: int, size: int, detail: str) -> None:
        log.warning(
            "buffer segment tail truncated path=%s position=%d bytes=%d reason=%s",
            path,
            position,
            size - position,
            detail,
        )
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, position)
            os.fsync(fd)
        finally:
            os.close(fd)
        self._truncated_tails += 1
        self._truncated_bytes += size - position

    # -- properties ------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def producer_id(self) -> bytes:
        return self._producer_id

    @property
    def table(self) -> str:
        return self._table

    def schema(self) -> pa.Schema | None:
        """The table schema last stored with `set_schema`, None if never."""
        with self._lock:
            schema_ipc = self._schema_ipc
        if not schema_ipc:
            return None
        return pa.ipc.read_schema(pa.py_buffer(schema_ipc))

    def set_schema(self, schema: pa.Schema) -> None:
        """Stores the table's schema, so a writer can start while the cluster is down."""
        schema_ipc = bytes(schema.serialize().to_pybytes())
        with self._lock:
            if schema_ipc == self._schema_ipc:
                return
            self._schema_ipc = schema_ipc
        write_atomic(
            self._directory / META_NAME, fmt.encode_meta(self._producer_id, self._table, schema_ipc)
        )

    # -- producer side ---------------------------------------------------------------

    def wait_for_space(self, timeout_s: float) -> bool:
        """Always True: a durable buffer makes room by dropping its oldest records."""
        del timeout_s
        return True

    def append(self, payload: bytes, row_count: int) -> int:
        """Appends one record and returns its sequence once it is durable (fdatasync). May
        drop the oldest records to stay within the byte limit. Raises BatchTooLarge for a
        payload or row count one publish request cannot carry."""
        check_request(payload, row_count)
        with self._append_lock:
            with self._lock:
                if self._closed:
                    raise RuntimeError("buffer is closed")
                sequence = self._next_sequence
                self._next_sequence += 1
            record = fmt.encode_record(
                sequence=sequence,
                producer_id=self._producer_id,
                row_count=row_count,
                created_ms=int(time.time() * 1000),
                payload=payload,
            )
            segment = self._segment_for_append(sequence)
            position = self._segments[segment].size
            write_all(self._active_fd, record)
            os.fdatasync(self._active_fd)
            entry = _Entry(sequence, row_count, len(record), segment, position, _State.PENDING)
            with self._lock:
                self._segments[segment].size += len(record)
                self._segments[segment].last_sequence = sequence
                if self._cache_bytes + len(payload) <= PAYLOAD_CACHE_BYTES_MAX:
                    self._cache[sequence] = payload
                    self._cache_bytes += len(payload)
                dropped = self._index.add(entry)
                for gone in dropped:
                    self._uncache(gone.sequence)
                self._lock.notify_all()
        if dropped:
            log.warning(
                "buffer full, dropped oldest dir=%s records=%d rows=%d bytes_max=%d",
                self._directory,
                len(dropped),
                sum(entry.row_count for entry in dropped),
                self._index.bytes_max,
            )
        return sequence

    def _segment_for_append(self, sequence: int) -> int:
        """The active segment's key; rolls over to a new segment file when it is full (and
        always at the first append after opening: old segments are never appended to)."""
        if self._active is not None and self._segments[self._active].size < self._segment_bytes_max:
            return self._active
        path = self._directory / fmt.segment_name(sequence)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        fsync_dir(self._directory)
        read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            if self._active_fd >= 0:
                os.close(self._active_fd)
            self._active_fd = fd
            self._active = sequence
            self._segments[sequence] = _Segment(path, read_fd, 0, 0)
        return sequence

    # -- consumer side ---------------------------------------------------------------

    def head(self, timeout_s: float) -> BufferedRecord | None:
        """The oldest record not yet acknowledged, waiting up to `timeout_s` for one. The
        same record is returned until `commit` acknowledges it."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (entry := self._index.head()) is None:  # Bounded by the deadline.
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0 or self._closed:
                    return None
                self._lock.wait(remaining_s)
            entry.state = _State.IN_FLIGHT
            payload = self._cache.get(entry.sequence)
            if payload is None:
                payload = self._read_payload(entry)
            return BufferedRecord(entry.sequence, entry.row_count, payload)

    def _uncache(self, sequence: int) -> None:
        payload = self._cache.pop(sequence, None)
        if payload is not None:
            self._cache_bytes -= len(payload)

    def _read_payload(self, entry: _Entry) -> bytes:
        segment = self._segments[entry.segment]
        data = os.pread(segment.read_fd, entry.record_bytes, entry.position)
        if len(data) != entry.record_bytes:
            raise CorruptionError(str(segment.path), entry.position, "record shrank on disk")
        header = fmt.decode_header(data)
        payload = data[fmt.RECORD_HEADER_BYTES :]
        try:
            fmt.check_record(data[: fmt.RECORD_HEADER_BYTES], payload)
        except fmt.FormatError as error:
            raise CorruptionError(str(segment.path), entry.position, error.detail) from error
        assert header.sequence == entry.sequence, (header.sequence, entry.sequence)
        return payload

    def commit(self, sequence: int) -> None:
        """The cluster acknowledged the records up to `sequence`. The COMMIT marker is
        written at most every `commit_interval_s` (and by `flush_commit` and `close`)."""
        with self._lock:
            for entry in self._index.entries:
                if entry.sequence > sequence:
                    break
                self._uncache(entry.sequence)
            self._index.commit(sequence)
            due = time.monotonic() - self._commit_written_at >= self._commit_interval_s
            self._lock.notify_all()
        if due:
            self.flush_commit()

    def flush_commit(self) -> None:
        """Writes the COMMIT marker now (if it moved) and deletes the segments it covers."""
        with self._lock:
            committed = self._index.committed
            if committed == self._commit_written or self._closed:
                return
        write_atomic(self._directory / COMMIT_NAME, fmt.encode_commit(committed, self._producer_id))
        with self._lock:
            self._commit_written = max(self._commit_written, committed)
            self._commit_written_at = time.monotonic()
        self._delete_done_segments()

    def _delete_done_segments(self) -> None:
        """Deletes sealed segments whose records are all covered by the durable COMMIT."""
        with self._lock:
            done = [
                key
                for key, segment in self._segments.items()
                if key != self._active and segment.last_sequence <= self._commit_written
            ]
            removed = [self._segments.pop(key) for key in done]
        for segment in removed:
            os.close(segment.read_fd)
            segment.path.unlink()
        if removed:
            fsync_dir(self._directory)

    def reject_head(self, reason: str) -> Path | None:
        """Move the oldest unacknowledged record, which the cluster refused for good
        (`reason`, e.g. the table was dropped or re-created with another schema), out of the
        queue so the records after it can go: its payload (an Arrow IPC stream, readable with
        `pyarrow.ipc.open_stream`) and a JSON note go to `rejected/` in the buffer directory,
        durably, before it is committed, so it is neither sent again nor lost. Returns the
        payload's path; None when nothing is pending. Consumer side (the sender's thread)."""
        record = self.head(0)
        if record is None:
            return None
        directory = self._directory / REJECTED_DIR
        if not directory.exists():
            directory.mkdir()
            fsync_dir(self._directory)
        stem = f"{record.sequence:020d}"
        path = directory / f"{stem}.arrows"
        write_atomic(path, record.payload)
        note = {
            "table": self._table,
            "producer_id": self._producer_id.hex(),
            "sequence": record.sequence,
            "row_count": record.row_count,
            "reason": reason,
            "rejected_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        write_atomic(directory / f"{stem}.json", json.dumps(note, indent=1).encode())
        self.commit(record.sequence)
        self.flush_commit()
        with self._lock:
            self._rejected_records += 1
            self._rejected_rows += record.row_count
        log.error(
            "record refused by the cluster moved aside table=%s sequence=%d rows=%d path=%s "
            "reason=%s",
            self._table,
            record.sequence,
            record.row_count,
            path,
            reason,
        )
        return path

    def _count_rejected(self) -> tuple[int, int]:
        records = rows = 0
        directory = self._directory / REJECTED_DIR
        if directory.is_dir():
            for note in directory.glob("*.json"):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    rows += int(json.loads(note.read_bytes())["row_count"])
                    records += 1
        return records, rows

    # -- inspection ------------------------------------------------------------------

    def pending_records(self) -> list[BufferedRecord]:
        """Every record not yet acknowledged (nor dropped), oldest first, read from disk."""
        with self._lock:
            return [
                BufferedRecord(entry.sequence, entry.row_count, self._read_payload(entry))
                for entry in self._index.entries
                if entry.state is not _State.DROPPED
            ]

    def stats(self) -> BufferStats:
        with self._lock:
            return self._index.stats(
                self._next_sequence,
                truncated_tails=self._truncated_tails,
                truncated_bytes=self._truncated_bytes,
                reopened_records=self._reopened_records,
                reopened_rows=self._reopened_rows,
                segments=len(self._segments),
                rejected_records=self._rejected_records,
                rejected_rows=self._rejected_rows,
            )

    def close(self) -> None:
        """Writes the COMMIT marker and releases the directory. Idempotent."""
        with self._append_lock:
            if self._closed:
                return
            self.flush_commit()
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._release_files()
        log.info("buffer closed dir=%s", self._directory)

    def _release_files(self) -> None:
        for segment in self._segments.values():
            with contextlib.suppress(OSError):
                os.close(segment.read_fd)
        self._segments.clear()
        if self._active_fd >= 0:
            os.close(self._active_fd)
            self._active_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # Closing the descriptor releases the flock.
            self._lock_fd = -1

    def __enter__(self) -> DurableBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MemoryBuffer:
    """The in-memory twin of `DurableBuffer` for writers without a buffer directory: bounded
    by `bytes_max`; a producer waits for room (`wait_for_space`) instead of dropping rows.
    Nothing survives the process."""

    def __init__(self, *, bytes_max: int, producer_id: bytes | None = None) -> None:
        if bytes_max <= 0:
            raise InvalidArgument("bufferBytesMax", f"must be > 0, got {bytes_max}")
        self._producer_id = producer_id or secrets.token_bytes(fmt.PRODUCER_ID_BYTES)
        self._lock = threading.Condition()
        self._bytes_max = bytes_max
        # The index never drops here: producers wait for room instead (wait_for_space).
        self._index = _Index(1 << 62, 0)
        self._next_sequence = 1
        self._closed = False

    @property
    def producer_id(self) -> bytes:
        return self._producer_id

    def wait_for_space(self, timeout_s: float) -> bool:
        """True once the buffer holds less than its byte limit; False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._index.pending_bytes >= self._bytes_max:  # Bounded by the deadline.
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0 or self._closed:
                    return False
                self._lock.wait(remaining_s)
            return True

    def append(self, payload: bytes, row_count: int) -> int:
        """Queues one record. Raises Overloaded when full: call `wait_for_space` first;
        BatchTooLarge as `DurableBuffer.append`."""
        check_request(payload, row_count)
        with self._lock:
            if self._closed:
                raise RuntimeError("buffer is closed")
            if self._index.pending_bytes >= self._bytes_max:
                raise Overloaded("writer buffer", self._bytes_max)
            sequence = self._next_sequence
            self._next_sequence += 1
            entry = _Entry(sequence, row_count, len(payload), -1, 0, _State.PENDING, payload)
            dropped = self._index.add(entry)
            assert not dropped, "a MemoryBuffer never drops"
            self._lock.notify_all()
            return sequence

    def head(self, timeout_s: float) -> BufferedRecord | None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (entry := self._index.head()) is None:  # Bounded by the deadline.
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0 or self._closed:
                    return None
                self._lock.wait(remaining_s)
            entry.state = _State.IN_FLIGHT
            assert entry.payload is not None
            return BufferedRecord(entry.sequence, entry.row_count, entry.payload)

    def commit(self, sequence: int) -> None:
        with self._lock:
            self._index.commit(sequence)
            self._lock.notify_all()

    def flush_commit(self) -> None:
        """Nothing to write: kept for the RecordQueue interface."""

    def pending_records(self) -> list[BufferedRecord]:
        with self._lock:
            return [
                BufferedRecord(entry.sequence, entry.row_count, entry.payload)
                for entry in self._index.entries
                if entry.payload is not None
            ]

    def stats(self) -> BufferStats:
        with self._lock:
            return self._index.stats(self._next_sequence)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
