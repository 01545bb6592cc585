"""One table on one node: its data files, its in-memory cache, and wakeups for subscribers.

Written by the apply path (tick thread), read by gRPC threads. The cache holds the newest
`cacheLimit` rows as Arrow record batches; older rows are read back from the data files.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raftstore.state_machine import TableMeta
from raftstore.storage.segments import DataRecord, TableLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RowSlice:
    """Rows [first_offset, first_offset + batch.num_rows) of a table."""

    first_offset: int
    batch: pa.RecordBatch


class TableStore:
    def __init__(self, meta: TableMeta, directory: Path) -> None:
        self.meta = meta
        self.directory = directory
        self.log = TableLog(directory)
        self._cache: collections.deque[RowSlice] = collections.deque()
        self._cache_rows = 0
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self.closed = False

    # --- writes (tick thread) ---

    def append(self, lsn: int, first_offset: int, batch: pa.RecordBatch, timestamp_ms: int) -> bool:
        """Append unless the data files already hold these rows (a replay after restart).
        Returns whether it wrote.

        Replays are recognised by offset, not LSN alone: one Raft entry (group commit) can
        carry several batches for the same table, all with the entry's LSN."""
        if first_offset < self.log.row_count:
            assert lsn <= self.log.lsn_last, (
                f"rows at offset {first_offset} already on disk but lsn {lsn} is new"
            )
            assert first_offset + batch.num_rows <= self.log.row_count, (
                f"replayed rows [{first_offset}, {first_offset + batch.num_rows}) straddle "
                f"the end of the data files ({self.log.row_count} rows)"
            )
            return False
        assert first_offset == self.log.row_count, (
            f"offset gap in {self.meta.table}: {first_offset} != {self.log.row_count}"
        )
        payload = batch.serialize()
        self.log.append(
            DataRecord(
                lsn=lsn,
                first_offset=first_offset,
                row_count=batch.num_rows,
                timestamp_ms=timestamp_ms,
                payload=memoryview(payload),
            )
        )
        with self._lock:
            self._cache_add(RowSlice(first_offset, batch))
            self.changed.notify_all()
        return True

    def append_record(self, record: DataRecord) -> None:
        """Append a record fetched from a peer (catch-up), byte for byte."""
        self.log.append(record)
        with self._lock:
            # The cache must stay contiguous: drop it rather than leave a hole before `record`.
            self._cache.clear()
            self._cache_rows = 0
            self.changed.notify_all()

    def start_at(self, offset: int) -> None:
        """Continue an empty table at `offset` (catch-up when the peers' retention already
        removed the rows before it; see TableLog.start_at)."""
        self.log.start_at(offset)
        with self._lock:
            self._cache.clear()
            self._cache_rows = 0
            self.changed.notify_all()

    def _cache_add(self, rows: RowSlice) -> None:
        self._cache.append(rows)
        self._cache_rows += rows.batch.num_rows
        while (
            self._cache
            and self._cache_rows - self._cache[0].batch.num_rows >= self.meta.cache_limit
        ):
            evicted = self._cache.popleft()
            self._cache_rows -= evicted.batch.num_rows

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.changed.notify_all()
        self.log.close()

    def destroy(self) -> None:
        with self._lock:
            self.closed = True
            self.changed.notify_all()
        self.log.destroy()

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

    def read(self, offset_from: int, offset_to: int, rows_max: int) -> list[RowSlice]:
        """Rows in [offset_from, min(offset_to, offset_from + rows_max)), from the cache when
        it covers them, else from the data files."""
        offset_to = min(offset_to, offset_from + rows_max, self.log.row_count)
        if offset_to <= offset_from:
            return []
        with self._lock:
            cached = list(self._cache)
        if cached and cached[0].first_offset <= offset_from:
            return _slice(cached, offset_from, offset_to)
        return _slice(list(self._read_disk(offset_from, offset_to)), offset_from, offset_to)

    def _read_disk(self, offset_from: int, offset_to: int) -> Iterator[RowSlice]:
        schema = self.meta.schema
        for record in self.log.read(offset_from, offset_to):
            batch = pa.ipc.read_record_batch(pa.py_buffer(record.payload), schema)
            yield RowSlice(record.first_offset, batch)

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
        return self.log.read(offset_from, offset_to)


def _slice(slices: list[RowSlice], offset_from: int, offset_to: int) -> list[RowSlice]:
    result = []
    for rows in slices:
        start = rows.first_offset
        end = start + rows.batch.num_rows
        if end <= offset_from or start >= offset_to:
            continue
        lo = max(offset_from, start) - start
        hi = min(offset_to, end) - start
        batch = (
            rows.batch if (lo, hi) == (0, rows.batch.num_rows) else rows.batch.slice(lo, hi - lo)
        )
        result.append(RowSlice(start + lo, batch))
    return result
