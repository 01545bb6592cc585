"""MultithreadedTableWriter: DolphinDB's batching writer, over N publisher threads that
follow the leader, with a durable local buffer by default.

    writer = MultithreadedTableWriter(session, "ticks", batchSize=10_000, throttle=1.0,
                                      threadCount=2, partitionCol="sym")
    writer.insert(1, ts, "AAPL", 10.5)         # one row, checked at once
    writer.insertDataFrame(frame)              # pandas; insertArrow(table) for Arrow
    writer.waitForThreadCompletion()           # everything sent (or TimeoutError)
    writer.getStatus().sentRows

Data path, per writer thread ("lane"): rows are checked against the table's schema when
they are inserted (SchemaMismatch at once, before anything is queued or sent), wait in
memory until `batchSize` rows or `throttle` seconds, then become one record of the lane's
buffer (an Arrow IPC stream), which the lane's sender thread publishes, in order, with the
buffer's producer id and the record's sequence. Rows go to lanes by a stable hash of
`partitionCol` (rows of one key stay in order), or round robin without it.

Buffers: by default each lane writes its records to a `DurableBuffer` under
`durableBufferDir` (default `./.hastream_buffer/<tableName>` under the current directory),
fsynced before the rows count as buffered; records survive a crash of this process and any
cluster outage, are resent after a restart on the same directory, and are deduplicated by
the cluster's producer window. Beyond `bufferBytesMax` the oldest records are dropped and
counted. With `durableBufferDir=None` the buffer is in memory and bounded the same way, but
a full buffer blocks `insert` for up to `insertTimeout` seconds and then raises Overloaded
(nothing is dropped).

Threads: insert* may be called from any thread. Each lane owns one sender thread; one
flusher thread turns rows older than `throttle` into records. A batch that fills up is
turned into a record on the inserting thread (so a large `insertDataFrame` is durable when
it returns).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa

from api_clients import batches
from api_clients.buffer import (
    BUFFER_BYTES_MAX_DEFAULT,
    BufferStats,
    DurableBuffer,
    MemoryBuffer,
    RecordQueue,
)
from api_clients.connection import Session, parse_site
from api_clients.publisher import Publisher
from hastream import wire
from hastream.errors import InvalidArgument, Overloaded, RaftStoreError

log = logging.getLogger(__name__)

DEFAULT_BUFFER_ROOT: Final = ".hastream_buffer"
BATCH_SIZE_DEFAULT: Final = 10_000
THROTTLE_S_DEFAULT: Final = 1.0
THREADS_MAX: Final = 64
INSERT_TIMEOUT_S_DEFAULT: Final = 30.0
WAIT_TIMEOUT_S_DEFAULT: Final = 600.0
# How often idle threads look at their stop flags and timers.
POLL_S: Final = 0.05
# One send (with the session's own retries) is bounded by this, so a stop or a status is
# never far behind; then the sender waits and sends the same record again.
SEND_DEADLINE_S: Final = wire.PROPOSAL_TIMEOUT_S + 5.0
# The sender's wait between two failed sends (each send already retried for a while).
RETRY_WAIT_S_MIN: Final = 0.1
RETRY_WAIT_S_MAX: Final = 2.0
JOIN_TIMEOUT_S: Final = 30.0


class _Default:
    """The marker of "durableBufferDir not given": a directory under the CWD."""

    def __repr__(self) -> str:
        return f"<./{DEFAULT_BUFFER_ROOT}/<tableName>>"


DEFAULT: Final = _Default()


class WriterStopped(RaftStoreError):
    """The writer no longer takes rows: it was stopped, or a thread hit an error the
    cluster will keep refusing (the rows stay unwritten; see getUnwrittenData)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"writer stopped: {reason}")

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadStatus:
    """One writer thread, DolphinDB's names. Rows: sent = acknowledged by the cluster;
    unsent = waiting in memory or in the buffer; sendFailed = refused for good."""

    threadId: int
    sentRows: int
    unsentRows: int
    sendFailedRows: int
    droppedRows: int  # By the byte limit of the durable buffer.
    resentRows: int  # Found unacknowledged in the buffer at start (an earlier run's).
    truncatedTails: int  # Corrupt tails cut off the buffer's segments at start.
    retries: int  # Sends that failed with a retryable error and were tried again.
    duplicateBatches: int  # Resends the cluster answered as already applied (not re-added).
    errorInfo: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterStatus:
    """`getStatus()`: totals over the threads plus each thread's status."""

    isExiting: bool
    errorCode: str  # "" or the error's class name
    errorInfo: str
    sentRows: int
    unsentRows: int
    sendFailedRows: int
    droppedRows: int
    resentRows: int
    truncatedTails: int
    retries: int
    duplicateBatches: int
    threadStatus: tuple[ThreadStatus, ...]
    # Where unacknowledged rows are kept: the durable buffer's directory, or "memory".
    bufferDir: str = "memory"

    def hasError(self) -> bool:
        return bool(self.errorCode)

    def succeed(self) -> bool:
        return not self.errorCode


class _Lane:
    """One writer thread: its pending rows, its buffer(s) and its sender thread."""

    def __init__(
        self,
        number: int,
        queues: list[tuple[RecordQueue, Publisher]],
        *,
        schema: pa.Schema,
        table: str,
        batch_size: int,
        batch_bytes_max: int,
        buffer_bytes_max: int,
        send_deadline_s: float,
    ) -> None:
        self.number = number
        self._buffer_bytes_max = buffer_bytes_max
        self._send_deadline_s = send_deadline_s
        self._queues = queues  # Orphaned buffers first, this lane's own last.
        self._buffer, self._publisher = queues[-1]
        self._schema = schema
        self._table = table
        self._batch_size = batch_size
        self._batch_bytes_max = batch_bytes_max
        self._lock = threading.Lock()  # Guards the pending rows.
        self._parts: list[pa.Table | list[tuple[Any, ...]]] = []
        self._pending_rows = 0
        self._pending_since = 0.0
        self._stats_lock = threading.Lock()
        self._sent_rows = 0
        self._failed_rows = 0
        self._retries = 0
        self._duplicate_batches = 0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._finishing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"writer-{table}-{number}")
        self._thread.daemon = True

    # -- producer side (inserting threads and the flusher) ---------------------------

    def add(self, part: pa.Table | tuple[Any, ...], rows: int, timeout_s: float) -> None:
        """Queues one row (a checked tuple) or a conformed table; turns the pending rows into
        a record once they reach the batch size. Raises Overloaded if the buffer stays full
        for `timeout_s` (memory buffers only); nothing is queued then."""
        with self._lock:
            full = self._pending_rows + rows >= self._batch_size
            if full and not self._buffer.wait_for_space(timeout_s):
                raise Overloaded(f"writer thread {self.number} buffer", self._buffer_bytes_max)
            if isinstance(part, tuple):
                if self._parts and isinstance(self._parts[-1], list):
                    self._parts[-1].append(part)
                else:
                    self._parts.append([part])
            else:
                self._parts.append(part)
            if self._pending_rows == 0:
                self._pending_since = time.monotonic()
            self._pending_rows += rows
            if full:
                self._flush_locked()

    def flush_if_due(self, throttle_s: float, *, space_timeout_s: float = 0.0) -> None:
        """Turns the pending rows into a record if they waited `throttle_s`, unless a memory
        buffer stays full for `space_timeout_s` (then the flusher tries again later)."""
        with self._lock:
            if not self._pending_rows:
                return
            if time.monotonic() - self._pending_since < throttle_s:
                return
            if not self._buffer.wait_for_space(space_timeout_s):
                return
            self._flush_locked()

    def _flush_locked(self) -> None:
        """Pending rows -> records (one, unless over the byte limit). If appending fails
        (a full disk), the rows not yet appended stay pending and the error is raised."""
        table = self._pending_table()
        chunks = batches.encode_chunks(table, bytes_max=self._batch_bytes_max)
        appended = 0
        try:
            for chunk in chunks:
                self._buffer.append(chunk.payload, chunk.row_count)
                appended += chunk.row_count
        finally:
            rest = table.num_rows - appended
            self._parts = [table.slice(appended)] if rest else []
            self._pending_rows = rest

    def _pending_table(self) -> pa.Table:
        tables = [
            part
            if isinstance(part, pa.Table)
            else batches.rows_to_table(part, self._schema, self._table)
            for part in self._parts
        ]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    @property
    def pending_rows(self) -> int:
        with self._lock:
            return self._pending_rows

    # -- sender thread ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        """No more rows will come: the sender ends once its buffers are empty."""
        self._finishing.set()

    def stop(self) -> None:
        """Ends the sender now; what is unsent stays in the buffer."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            for queue, publisher in self._queues:
                self._drain(queue, publisher, own=queue is self._buffer)
                if self._stop.is_set() or self.error is not None:
                    break
        except Exception as error:  # Kept for getStatus; the lane ends.
            self._fail(error)
        finally:
            for queue, _ in self._queues:
                queue.flush_commit()

    def _drain(self, queue: RecordQueue, publisher: Publisher, *, own: bool) -> None:
        wait_s = RETRY_WAIT_S_MIN
        # The sender's event loop: one record per turn; ends on stop(), after finish() once
        # the buffer is empty, or on an error the cluster will keep answering.
        while not self._stop.is_set():
            record = queue.head(POLL_S)
            if record is None:
                queue.flush_commit()
                if not own:
                    return  # An orphaned buffer gets no new records: it is done.
                # Pending rows first, then the buffer: a flush moves rows from one to the other.
                finished = self._finishing.is_set() and not self.pending_rows
                if finished and queue.stats().pending_records == 0:
                    return
                continue
            try:
                result = publisher.publish_payload(
                    record.payload, record.sequence, deadline_s=self._send_deadline_s
                )
            except RaftStoreError as error:
                if not error.retryable:
                    self._fail(error, failed_rows=record.row_count)
                    return
                with self._stats_lock:
                    self._retries += 1
                log.info(
                    "writer send failed, retrying table=%s thread=%d sequence=%d error=%s",
                    self._table,
                    self.number,
                    record.sequence,
                    error,
                )
                self._stop.wait(wait_s)
                wait_s = min(RETRY_WAIT_S_MAX, wait_s * 2)
                continue
            queue.commit(record.sequence)
            wait_s = RETRY_WAIT_S_MIN
            with self._stats_lock:
                self._sent_rows += record.row_count
                self._duplicate_batches += int(result.duplicate_batch)
            log.debug(
                "writer sent table=%s thread=%d sequence=%d rows=%d duplicate_batch=%s",
                self._table,
                self.number,
                record.sequence,
                result.row_count,
                result.duplicate_batch,
            )

    def _fail(self, error: BaseException, *, failed_rows: int = 0) -> None:
        log.error(
            "writer thread failed table=%s thread=%d error=%s", self._table, self.number, error
        )
        with self._stats_lock:
            if self._error is None:
                self._error = error
            self._failed_rows += failed_rows

    @property
    def error(self) -> BaseException | None:
        with self._stats_lock:
            return self._error

    # -- inspection ------------------------------------------------------------------

    def buffer_stats(self) -> list[BufferStats]:
        return [queue.stats() for queue, _ in self._queues]

    def status(self) -> ThreadStatus:
        pending_rows = self.pending_rows
        stats = self.buffer_stats()
        with self._stats_lock:
            return ThreadStatus(
                threadId=self.number,
                sentRows=self._sent_rows,
                unsentRows=pending_rows + sum(s.pending_rows for s in stats),
                sendFailedRows=self._failed_rows,
                droppedRows=sum(s.dropped_rows for s in stats),
                resentRows=sum(s.reopened_rows for s in stats),
                truncatedTails=sum(s.truncated_tails for s in stats),
                retries=self._retries,
                duplicateBatches=self._duplicate_batches,
                errorInfo="" if self._error is None else str(self._error),
            )

    def unwritten(self) -> list[pa.Table]:
        """Rows not yet acknowledged, oldest first: the buffers' records, then the pending rows."""
        tables = [
            batches.decode(record.payload)
            for queue, _ in self._queues
            for record in queue.pending_records()
        ]
        with self._lock:
            if self._parts:
                tables.append(self._pending_table())
        return tables

    def close(self) -> None:
        for queue, _ in self._queues:
            queue.close()


class MultithreadedTableWriter:
    """Batches rows into `tableName` through `threadCount` publisher threads; see the module
    docstring for the data path and the buffers.

    `session_or_sites`: a Session (not closed by the writer), or `host:port` sites (one
    string or a list) for a session the writer owns. The table's schema is fetched from the
    cluster (or taken from `schema`, or from a durable buffer that remembers it, so a writer
    can start while the cluster is down).

    `batchSize` rows (or `throttle` seconds, whichever comes first) make one record;
    `partitionCol` picks the thread by a stable hash of that column (round robin without
    it); `durableBufferDir` is where the durable buffers live (`None`: in memory);
    `bufferBytesMax` bounds the buffers of all threads together; `insertTimeout` bounds how
    long an insert waits for room in a memory buffer before raising Overloaded.
    """

    def __init__(
        self,
        session_or_sites: Session | str | Sequence[str],
        tableName: str,
        batchSize: int = BATCH_SIZE_DEFAULT,
        throttle: float = THROTTLE_S_DEFAULT,
        threadCount: int = 1,
        partitionCol: str | None = None,
        durableBufferDir: str | os.PathLike[str] | _Default | None = DEFAULT,
        bufferBytesMax: int = BUFFER_BYTES_MAX_DEFAULT,
        *,
        insertTimeout: float = INSERT_TIMEOUT_S_DEFAULT,
        schema: pa.Schema | None = None,
        batchBytesMax: int = wire.BATCH_BYTES_MAX,
    ) -> None:
        _check_settings(
            batchSize, throttle, threadCount, bufferBytesMax, insertTimeout, batchBytesMax
        )
        self._table = tableName
        self._batch_size = batchSize
        self._throttle_s = throttle
        self._insert_timeout_s = insertTimeout
        self._session, self._owns_session = _session_of(session_or_sites)
        self._buffer_dir = _buffer_dir(durableBufferDir, tableName)
        self._lock = threading.Lock()
        self._next_lane = 0
        self._exiting = False
        self._closed = False
        self._flusher_stop = threading.Event()
        # A construction that fails (unknown table, wrong partitionCol) leaves no buffer
        # directory behind that it created, e.g. ./.hastream_buffer/ in the caller's cwd.
        created = None if self._buffer_dir is None else _first_missing(self._buffer_dir)
        try:
            queues = self._open_queues(threadCount, bufferBytesMax)
        except BaseException:
            _remove_created(created)
            raise
        try:
            self._schema = self._resolve_schema(schema, queues)
            if partitionCol is not None and partitionCol not in self._schema.names:
                raise InvalidArgument(
                    "partitionCol", f"{partitionCol!r} is not a column of {self._schema.names}"
                )
        except BaseException:
            for lane_queues in queues:
                for queue, _ in lane_queues:
                    queue.close()
            _remove_created(created)
            raise
        self._partition_col = partitionCol
        self._partition_type = (
            None if partitionCol is None else self._schema.field(partitionCol).type
        )
        self._partition_index = (
            None if partitionCol is None else self._schema.get_field_index(partitionCol)
        )
        self._convert_row = batches.row_converter(self._schema, tableName)
        self._lanes = [
            _Lane(
                number,
                lane_queues,
                schema=self._schema,
                table=tableName,
                batch_size=batchSize,
                batch_bytes_max=batchBytesMax,
                buffer_bytes_max=max(1, bufferBytesMax // threadCount),
                send_deadline_s=min(SEND_DEADLINE_S, self._session.deadline_s),
            )
            for number, lane_queues in enumerate(queues)
        ]
        for lane in self._lanes:
            lane.start()
        self._flusher = threading.Thread(
            target=self._flush_loop, name=f"writer-{tableName}-flush", daemon=True
        )
        self._flusher.start()
        log.info(
            "writer started table=%s threads=%d batch_size=%d buffer=%s",
            tableName,
            threadCount,
            batchSize,
            self._buffer_dir or "memory",
        )

    # -- setup -----------------------------------------------------------------------

    def _open_queues(
        self, thread_count: int, bytes_max: int
    ) -> list[list[tuple[RecordQueue, Publisher]]]:
        """Per lane: its buffers (orphans of an earlier run with more threads first) and a
        Publisher for each, sending under the buffer's producer id."""
        lane_bytes_max = max(1, bytes_max // thread_count)
        lanes: list[list[tuple[RecordQueue, Publisher]]] = [[] for _ in range(thread_count)]
        opened: list[RecordQueue] = []
        try:
            if self._buffer_dir is None:
                for lane in lanes:
                    lane.append(self._with_publisher(MemoryBuffer(bytes_max=lane_bytes_max)))
                return lanes
            for number in self._orphan_numbers(thread_count):
                queue = self._durable(number, lane_bytes_max)
                opened.append(queue)
                lanes[number % thread_count].append(self._with_publisher(queue))
            for number, lane in enumerate(lanes):
                queue = self._durable(number, lane_bytes_max)
                opened.append(queue)
                lane.append(self._with_publisher(queue))
        except BaseException:
            for buffer in opened:
                buffer.close()
            raise
        return lanes

    def _orphan_numbers(self, thread_count: int) -> list[int]:
        assert self._buffer_dir is not None
        if not self._buffer_dir.is_dir():
            return []
        numbers = []
        for path in self._buffer_dir.iterdir():
            suffix = path.name.removeprefix("thread-")
            if path.is_dir() and suffix.isdigit() and int(suffix) >= thread_count:
                numbers.append(int(suffix))
        return sorted(numbers)

    def _durable(self, number: int, bytes_max: int) -> DurableBuffer:
        assert self._buffer_dir is not None
        return DurableBuffer(
            self._buffer_dir / f"thread-{number}", table=self._table, bytes_max=bytes_max
        )

    def _with_publisher(self, queue: RecordQueue) -> tuple[RecordQueue, Publisher]:
        return queue, Publisher(self._session, self._table, producer_id=queue.producer_id)

    def _resolve_schema(
        self, schema: pa.Schema | None, queues: list[list[tuple[RecordQueue, Publisher]]]
    ) -> pa.Schema:
        durable = [q for lane in queues for q, _ in lane if isinstance(q, DurableBuffer)]
        if schema is None:
            try:
                schema = self._session.getTableInfo(self._table).schema
            except RaftStoreError as error:
                stored = next((s for q in durable if (s := q.schema()) is not None), None)
                if not error.retryable or stored is None:
                    raise
                log.warning("writer uses the buffered schema table=%s error=%s", self._table, error)
                schema = stored
        for queue in durable:
            queue.set_schema(schema)
        return schema

    # -- inserting -------------------------------------------------------------------

    def insert(self, *row: Any) -> None:
        """Queues one row (values in column order). Raises SchemaMismatch for a wrong
        column count or a value of the wrong type, WriterStopped once the writer stopped,
        Overloaded if a memory buffer stays full for `insertTimeout`."""
        checked = self._convert_row(row)
        self._check_open()
        if self._partition_index is None:
            lane = self._lanes[self._round_robin()]
        else:
            assert self._partition_type is not None
            key = checked[self._partition_index]
            lane = self._lanes[batches.partition_of(key, self._partition_type, len(self._lanes))]
        lane.add(checked, 1, self._insert_timeout_s)

    def insertDataFrame(self, frame: Any) -> None:
        """Queues the rows of a pandas DataFrame (columns named and typed as the table's).
        Checked whole before any row is queued: SchemaMismatch on any mismatch."""
        self.insertArrow(frame)

    def insertArrow(self, data: Any) -> None:
        """Queues the rows of a pyarrow Table or RecordBatch (or anything `Publisher.append`
        takes). Checked whole before any row is queued. Empty input is a no-op."""
        if _is_empty(data):
            return
        table = batches.to_table(data, self._schema, self._table)
        self._check_open()
        for lane, part in self._split(table):
            lane.add(part, part.num_rows, self._insert_timeout_s)

    def insertUnwrittenData(self, data: pa.Table) -> None:
        """Queues rows returned by an earlier writer's `getUnwrittenData` (do not do this
        for a durable buffer's rows: reopening its directory resends them already)."""
        self.insertArrow(data)

    def _split(self, table: pa.Table) -> list[tuple[_Lane, pa.Table]]:
        lanes = len(self._lanes)
        if lanes == 1:
            return [(self._lanes[0], table)]
        if self._partition_col is None:
            step = -(-table.num_rows // lanes)
            return [
                (self._lanes[self._round_robin()], table.slice(start, step))
                for start in range(0, table.num_rows, step)
            ]
        indices = batches.partitions_of(table.column(self._partition_col), lanes)
        parts = []
        for number, lane in enumerate(self._lanes):
            mask = indices == number
            if np.any(mask):
                parts.append((lane, table.filter(pa.array(mask))))
        return parts

    def _round_robin(self) -> int:
        with self._lock:
            number = self._next_lane
            self._next_lane = (number + 1) % len(self._lanes)
            return number

    def _check_open(self) -> None:
        with self._lock:
            if self._exiting:
                raise WriterStopped("waitForThreadCompletion() or close() was called")
        for lane in self._lanes:
            error = lane.error
            if error is not None:
                raise WriterStopped(f"thread {lane.number} failed: {error}")

    # -- background flushing ---------------------------------------------------------

    def _flush_loop(self) -> None:
        interval_s = max(POLL_S, min(self._throttle_s / 4, 0.5))
        # The flusher's event loop: runs until the writer stops.
        while not self._flusher_stop.wait(interval_s):
            for lane in self._lanes:
                try:
                    lane.flush_if_due(self._throttle_s)
                except Exception as error:  # A conversion bug: surface it.
                    lane._fail(error)

    # -- status and the end ----------------------------------------------------------

    def getStatus(self) -> WriterStatus:
        threads = tuple(lane.status() for lane in self._lanes)
        error = next((lane.error for lane in self._lanes if lane.error is not None), None)
        with self._lock:
            exiting = self._exiting
        return WriterStatus(
            isExiting=exiting,
            errorCode="" if error is None else type(error).__name__,
            errorInfo="" if error is None else str(error),
            sentRows=sum(t.sentRows for t in threads),
            unsentRows=sum(t.unsentRows for t in threads),
            sendFailedRows=sum(t.sendFailedRows for t in threads),
            droppedRows=sum(t.droppedRows for t in threads),
            resentRows=sum(t.resentRows for t in threads),
            truncatedTails=sum(t.truncatedTails for t in threads),
            retries=sum(t.retries for t in threads),
            duplicateBatches=sum(t.duplicateBatches for t in threads),
            threadStatus=threads,
            bufferDir="memory" if self._buffer_dir is None else str(self._buffer_dir),
        )

    def getUnwrittenData(self) -> pa.Table:
        """The rows not yet acknowledged by the cluster, as one pyarrow Table: a snapshot
        of every thread's buffer and pending rows (per thread oldest first). After the
        writer closed, a durable buffer's rows are read back from its directory."""
        with self._lock:
            closed = self._closed
        if closed and self._buffer_dir is not None:
            tables = _read_directory(self._buffer_dir, self._table)
        else:
            tables = [table for lane in self._lanes for table in lane.unwritten()]
        if not tables:
            return self._schema.empty_table()
        return pa.concat_tables(tables)

    def waitForThreadCompletion(self, timeout_s: float = WAIT_TIMEOUT_S_DEFAULT) -> None:
        """Stops taking rows, sends everything queued, then ends the threads. If that takes
        longer than `timeout_s` the threads are ended anyway and TimeoutError is raised:
        the rows not sent stay in the durable buffer (resent by the next writer on its
        directory) or, in memory, in getUnwrittenData()."""
        deadline = time.monotonic() + timeout_s
        self._begin_exit()
        for lane in self._lanes:
            if lane.error is None:
                lane.flush_if_due(0.0, space_timeout_s=max(0.0, deadline - time.monotonic()))
            lane.finish()
        done = all(lane.join(deadline - time.monotonic()) for lane in self._lanes)
        unsent = sum(lane.status().unsentRows for lane in self._lanes)
        self._end()
        if not done:
            raise TimeoutError(
                f"writer of {self._table!r}: {unsent} rows not sent within {timeout_s}s"
            )

    def close(self) -> None:
        """Stops at once: rows queued in memory go to the durable buffer (resent by the next
        writer on its directory); without one they are only in getUnwrittenData()."""
        self._begin_exit()
        if self._buffer_dir is not None:
            for lane in self._lanes:
                lane.flush_if_due(0.0)
        self._end()

    def _begin_exit(self) -> None:
        with self._lock:
            self._exiting = True

    def _end(self) -> None:
        with self._lock:
            if self._closed:
                return
        self._flusher_stop.set()
        self._flusher.join(JOIN_TIMEOUT_S)
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            if not lane.join(JOIN_TIMEOUT_S):
                log.warning(
                    "writer thread did not stop table=%s thread=%d", self._table, lane.number
                )
        if self._buffer_dir is not None:
            for lane in self._lanes:
                lane.close()
        with self._lock:
            self._closed = True
        if self._owns_session:
            self._session.close()
        log.info("writer ended table=%s status=%s", self._table, self.getStatus())

    def __enter__(self) -> MultithreadedTableWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.waitForThreadCompletion()


def _check_settings(
    batch_size: int,
    throttle_s: float,
    thread_count: int,
    bytes_max: int,
    timeout_s: float,
    batch_bytes_max: int,
) -> None:
    if not 1 <= batch_size <= wire.BATCH_ROWS_MAX:
        raise InvalidArgument("batchSize", f"must be in [1, {wire.BATCH_ROWS_MAX}]")
    if not 0 < batch_bytes_max <= wire.BATCH_BYTES_MAX:
        raise InvalidArgument("batchBytesMax", f"must be in (0, {wire.BATCH_BYTES_MAX}]")
    if throttle_s <= 0:
        raise InvalidArgument("throttle", f"must be > 0 seconds, got {throttle_s}")
    if not 1 <= thread_count <= THREADS_MAX:
        raise InvalidArgument("threadCount", f"must be in [1, {THREADS_MAX}]")
    if bytes_max < thread_count:
        raise InvalidArgument("bufferBytesMax", f"must be >= threadCount, got {bytes_max}")
    if timeout_s < 0:
        raise InvalidArgument("insertTimeout", f"must be >= 0, got {timeout_s}")


def _session_of(session_or_sites: Session | str | Sequence[str]) -> tuple[Session, bool]:
    if isinstance(session_or_sites, Session):
        return session_or_sites, False
    sites = [session_or_sites] if isinstance(session_or_sites, str) else list(session_or_sites)
    return Session([parse_site(site) for site in sites]), True


def _buffer_dir(value: str | os.PathLike[str] | _Default | None, table: str) -> Path | None:
    if value is None:
        return None
    if isinstance(value, _Default):
        return Path.cwd() / DEFAULT_BUFFER_ROOT / table
    return Path(value)


def _is_empty(data: Any) -> bool:
    rows = getattr(data, "num_rows", None)
    if rows is None and hasattr(data, "shape"):
        rows = data.shape[0]
    if rows is None and isinstance(data, list | tuple):
        rows = len(data)
    return rows == 0


def _read_directory(directory: Path, table: str) -> list[pa.Table]:
    """The pending rows of every thread's durable buffer under `directory` (closed)."""
    tables: list[pa.Table] = []
    if not directory.is_dir():
        return tables
    for path in sorted(directory.iterdir()):
        if not (path.is_dir() and path.name.startswith("thread-")):
            continue
        with DurableBuffer(path, table=table) as buffer:
            tables.extend(batches.decode(record.payload) for record in buffer.pending_records())
    return tables


def _first_missing(directory: Path) -> Path | None:
    """The outermost of `directory` and its parents that does not exist yet (what creating
    `directory` would create first); None when `directory` exists."""
    missing = None
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _remove_created(created: Path | None) -> None:
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
