"""One table on one node: its data files, its in-memory cache, and wakeups for subscribers.

Written by the applier (the replica's apply thread), read by gRPC threads. The cache holds
the newest `cacheLimit` rows as Arrow record batches, within the node's one memory bound for
every table's cache (cache_budget.py); older rows are read back from the data files.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from raftstore.batch_memory import cached_bytes, encoded_cached_bytes
from raftstore.cache_budget import CacheBudget, CacheEntry
from raftstore.state_machine import TableMeta
from raftstore.storage.files import REAL_FILES, Files
from raftstore.storage.segments import DataRecord, TableLog

log = logging.getLogger(__name__)


class RowSlice:
    """Rows [first_offset, first_offset + row_count) of a table, stamped together
    (`timestamp_ms`: when the leader proposed them, ms since the epoch).

    `batch` is the rows; a slice cached from a sealed publish that apply took unread
    (checked_payload.py) holds only their IPC message and decodes it on the first read
    (any thread; two racing first reads decode it twice, and either result is the same)."""

    __slots__ = ("_batch", "_message", "_schema", "first_offset", "row_count", "timestamp_ms")

    def __init__(self, first_offset: int, batch: pa.RecordBatch, timestamp_ms: int) -> None:
        self.first_offset = first_offset
        self.row_count: int = batch.num_rows
        self.timestamp_ms = timestamp_ms
        self._batch: pa.RecordBatch | None = batch
        self._message: memoryview | None = None
        self._schema: pa.Schema | None = None

    @classmethod
    def unread(
        cls,
        first_offset: int,
        row_count: int,
        message: memoryview,
        schema: pa.Schema,
        timestamp_ms: int,
    ) -> RowSlice:
        rows = cls.__new__(cls)
        rows.first_offset = first_offset
        rows.row_count = row_count
        rows.timestamp_ms = timestamp_ms
        rows._batch = None
        rows._message = message
        rows._schema = schema
        return rows

    @property
    def batch(self) -> pa.RecordBatch:
        batch = self._batch
        if batch is None:
            assert self._message is not None
            assert self._schema is not None
            # Not validated again: the leader validated the payload before sealing it.
            batch = pa.ipc.read_record_batch(pa.py_buffer(self._message), self._schema)
            assert batch.num_rows == self.row_count, (batch.num_rows, self.row_count)
            self._batch = batch
        return batch

    def __repr__(self) -> str:
        return f"RowSlice(first_offset={self.first_offset}, rows={self.row_count})"


class TableStore:
    def __init__(
        self,
        meta: TableMeta,
        directory: Path,
        *,
        files: Files = REAL_FILES,
        budget: CacheBudget | None = None,
    ) -> None:
        """`budget`: the node's bound on every table's cache (a private one by default)."""
        self.meta = meta
        self.directory = directory
        self.log = TableLog(directory, files=files)
        self._budget = budget if budget is not None else CacheBudget()
        self._cache: collections.deque[CacheEntry] = collections.deque()  # rows set
        self._cache_rows = 0
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self.closed = False

    # --- writes (the applier's thread) ---

    def append(
        self,
        lsn: int,
        first_offset: int,
        batch: pa.RecordBatch,
        timestamp_ms: int,
        encoded: memoryview | None = None,
    ) -> None:
        """Write rows [first_offset, first_offset + num_rows), which must follow the last
        (the applier decides what a replay skips); `encoded`, when given, is `batch` as an
        encapsulated IPC message, written instead of serializing it again (no copy of the
        rows). Raises OSError from the disk (nothing written), CorruptionError if an earlier
        failed write could not be undone."""
        payload = memoryview(batch.serialize()) if encoded is None else encoded
        self._write(lsn, first_offset, batch.num_rows, payload, timestamp_ms)
        self._cache_rows_of(RowSlice(first_offset, batch, timestamp_ms), cached_bytes(batch))

    def append_unread(
        self,
        lsn: int,
        first_offset: int,
        row_count: int,
        encoded: memoryview,
        timestamp_ms: int,
    ) -> None:
        """`append` for rows given only as their encapsulated IPC message (a sealed publish
        that apply took unread): written as they are, cached undecoded."""
        self._write(lsn, first_offset, row_count, encoded, timestamp_ms)
        rows = RowSlice.unread(first_offset, row_count, encoded, self.meta.schema, timestamp_ms)
        self._cache_rows_of(rows, encoded_cached_bytes(encoded.nbytes, len(self.meta.schema)))

    def _write(
        self, lsn: int, first_offset: int, row_count: int, payload: memoryview, timestamp_ms: int
    ) -> None:
        record = DataRecord(
            lsn=lsn,
            first_offset=first_offset,
            row_count=row_count,
            timestamp_ms=timestamp_ms,
            payload=payload,
        )
        self.log.append(record)

    def _cache_rows_of(self, rows: RowSlice, cost: int) -> None:
        entry = CacheEntry(rows, cost, self._evict)
        with self._lock:
            released = self._cache_add(entry)
            self.changed.notify_all()
        for old in released:  # outside the store's lock: the budget may evict from others
            self._budget.released(old)
        self._budget.added(entry)

    def sync(self) -> None:
        """Make every appended row durable (before a checkpoint lets the Raft log go)."""
        self.log.sync()

    def remove_segments_before(self, timestamp_ms: int, *, keep_rows: int) -> int:
        """Retention (see TableLog.remove_segments_before)."""
        return self.log.remove_segments_before(timestamp_ms, keep_rows=keep_rows)

    def _cache_add(self, entry: CacheEntry) -> list[CacheEntry]:
        """Cache `entry`, letting go of the oldest beyond cacheLimit (returned; caller holds
        the lock)."""
        self._cache.append(entry)
        self._cache_rows += entry.rows.row_count
        released = []
        while (
            self._cache
            and self._cache_rows - self._cache[0].rows.row_count >= self.meta.cache_limit
        ):
            evicted = self._cache.popleft()
            self._cache_rows -= evicted.rows.row_count
            released.append(evicted)
        return released

    def _evict(self, entry: CacheEntry) -> bool:
        """The budget drops `entry` (the oldest cached batch on the node); False if this
        table let it go already."""
        with self._lock:
            if self._cache and self._cache[0] is entry:
                self._cache.popleft()
            elif entry in self._cache:  # not expected: the budget's order is each table's
                self._cache.remove(entry)
            else:
                return False
            self._cache_rows -= entry.rows.row_count
            entry.rows = None
            return True

    def close(self) -> None:
        """Close the files (no sync: call `sync` first). Subscribers waiting on this table
        wake up and see `closed`."""
        with self._lock:
            self.closed = True
            self.changed.notify_all()
            cached = list(self._cache)
            self._cache.clear()
            self._cache_rows = 0
        for entry in cached:  # a dropped or closed table's cache leaves the node's budget
            self._budget.released(entry)
        self.log.close()

    def wake(self) -> None:
        with self._lock:
            self.changed.notify_all()

    # --- reads (any thread) ---

    @property
    def row_count(self) -> int:
        return self.log.row_count

    @property
    def earliest_offset(self) -> int:
        return self.log.earliest_offset

    @property
    def lsn_last(self) -> int:
        """LSN of the entry that wrote the last rows on disk (0 if none)."""
        return self.log.lsn_last

    def read(self, offset_from: int, offset_to: int, rows_max: int) -> list[RowSlice]:
        """Rows in [offset_from, min(offset_to, offset_from + rows_max)), from the cache when
        it covers them, else from the data files."""
        offset_to = min(offset_to, offset_from + rows_max, self.log.row_count)
        if offset_to <= offset_from:
            return []
        with self._lock:
            cached = [entry.rows for entry in self._cache]
        if cached and cached[0].first_offset <= offset_from:
            return _slice(cached, offset_from, offset_to)
        return _slice(list(self._read_disk(offset_from, offset_to)), offset_from, offset_to)

    def _read_disk(self, offset_from: int, offset_to: int) -> Iterator[RowSlice]:
        schema = self.meta.schema
        for record in self.log.read(offset_from, offset_to):
            batch = pa.ipc.read_record_batch(pa.py_buffer(record.payload), schema)
            yield RowSlice(record.first_offset, batch, record.timestamp_ms)

    def newest_records_offset(self, count: int) -> int:
        """See TableLog.newest_records_offset."""
        return self.log.newest_records_offset(count)

    def offset_for_time(self, timestamp_ms: int) -> tuple[int, int] | None:
        """The first retained row stamped at or after `timestamp_ms` and its stamp; None when
        every retained row is older (see TableLog.offset_for_time)."""
        return self.log.offset_for_time(timestamp_ms)

    def read_keys(self, offset_from: int, offset_to: int, column: str) -> pa.Array:
        """The key column of rows [offset_from, offset_to) (rebuilding a dedup window)."""
        chunks = [
            rows.batch.column(column)
            for rows in _slice(
                list(self._read_disk(offset_from, offset_to)), offset_from, offset_to
            )
        ]
        if not chunks:
            return pa.array([], type=self.meta.schema.field(column).type)
        return pa.concat_arrays(chunks)

    def records(self, offset_from: int, offset_to: int) -> Iterator[DataRecord]:
        """The records holding rows [offset_from, offset_to), the first cut to begin exactly
        at offset_from: a replica repairing from here asks from its own row count, which
        need not fall on one of this replica's record boundaries (e.g. after a repair that
        restarted at a peer's retention point). Rows are the same at the same offsets on
        every replica; record boundaries are an accident of each replica's history."""
        for record in self.log.read(offset_from, offset_to):
            if record.first_offset < offset_from:
                record = self._cut(record, offset_from)
            yield record

    def _cut(self, record: DataRecord, offset_from: int) -> DataRecord:
        batch = pa.ipc.read_record_batch(pa.py_buffer(record.payload), self.meta.schema)
        rest = batch.slice(offset_from - record.first_offset)
        return DataRecord(
            lsn=record.lsn,
            first_offset=offset_from,
            row_count=rest.num_rows,
            timestamp_ms=record.timestamp_ms,
            payload=memoryview(rest.serialize()),
        )


def _slice(slices: list[RowSlice], offset_from: int, offset_to: int) -> list[RowSlice]:
    result = []
    for rows in slices:
        start = rows.first_offset
        end = start + rows.row_count
        if end <= offset_from or start >= offset_to:
            continue
        lo = max(offset_from, start) - start
        hi = min(offset_to, end) - start
        batch = rows.batch if (lo, hi) == (0, rows.row_count) else rows.batch.slice(lo, hi - lo)
        result.append(RowSlice(start + lo, batch, rows.timestamp_ms))
    return result
