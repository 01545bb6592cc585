"""Coalescing of pipelined appends: Kafka's record accumulator, with `linger.ms=0`.

`Publisher.append_async` validates its rows on the caller's thread and hands the Arrow table
(or a few row tuples it checked, converted here together with those queued beside them:
row_path.py) to a `Coalescer`. The coalescer's sender thread takes everything that has queued up and
sends it as one request through the `PublishPipeline`. It hands the pipeline its next
request only once fewer than SEND_AHEAD_REQUESTS (4) are in flight, whatever the window
(and, past that, while the window is full, it waits in `submit`): the appends made
meanwhile queue up for the next request. A lone append goes out at once (nothing lingers);
appends merge only while earlier requests are in flight. The cluster's cost is per request,
so a window of one-row appends becomes one request of many rows: the single-row shapes are
bound by the caller, not the server; and 100- or 1,000-row appends made faster than the
node answers go out a few hundred or thousand rows at a time (x1.05-1.17 rows/s, node CPU
per row x0.78-0.85, against sending each as soon as the 64-request window had room:
docs/benchmark.md, twenty-third session).

An append's rows are contiguous in its request, so its offsets are the request's first
offset plus the rows queued before it. With a key column (dedup) appends are never merged:
the answer says how many rows were dropped, not from which append; each append is then one
request (or several, when it is larger than a request may be), as before.

Bounded: at most `PENDING_BYTES_MAX` bytes and `PENDING_APPENDS_MAX` appends wait for the
sender; `add` blocks beyond that (as `submit` blocks on a full window).

Threads: `add`, `flush`, `close` from any thread (one lock); the sender thread encodes and
submits; futures are completed on the pipeline's driver thread.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import pyarrow as pa

from api_clients import batches, row_path
from api_clients.futures import AppendFuture
from api_clients.pipeline import PipelineClosed, PublishPipeline
from api_clients.types import AppendResult
from hastream import wire
from hastream.errors import InvalidArgument, SchemaMismatch

# What may wait for the sender: a request's worth of bytes twice over (one being built while
# one waits for the window), and no more appends than a window of requests would carry.
PENDING_BYTES_MAX: Final = 2 * wire.BATCH_BYTES_MAX
PENDING_APPENDS_MAX: Final = 65_536
# One merged request holds at most this share of the byte limit (by Arrow's in-memory size):
# the IPC encoding adds a little, and a request that still comes out too large is split.
_MERGE_BYTES_FRACTION: Final = 0.5
_POLL_S: Final = 0.5
_SMALL_CHUNK_ROWS: Final = 1024  # merged appends below this many rows each are combined
# With merging, the sender hands the pipeline its next request only once fewer than this
# many are in flight: the node takes them in order, so a few keep it busy, and the appends
# made meanwhile queue here and go out merged, as one request. Each request costs the
# cluster more than its rows do (its own Raft proposal share, validation, answer), so while
# the node is behind, fewer and larger requests carry more rows for the same CPU.
SEND_AHEAD_REQUESTS: Final = 4
_CONVERSION_ERRORS: Final = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    OverflowError,
    TypeError,
    ValueError,
)


@dataclass(slots=True)
class _Append:
    """One append: a validated table, or rows `row_path.quick_rows` vouched for under
    `schema` (converted by the sender, together with the rows queued beside them)."""

    schema: pa.Schema
    table: pa.Table | None = None
    rows: Sequence[Sequence[Any]] | None = None
    # One object until something waits on it (futures.py): tens of thousands are in flight.
    future: Future[AppendResult] = field(default_factory=AppendFuture)
    num_rows: int = 0
    nbytes: int = 0
    start: int = 0  # its first row's place in the request it was merged into

    def __post_init__(self) -> None:
        if self.table is not None:
            self.num_rows, self.nbytes = self.table.num_rows, batches.nbytes(self.table)
        else:
            assert self.rows, "an append holds rows"
            self.num_rows, self.nbytes = len(self.rows), row_path.size_estimate(self.rows)


@dataclass(frozen=True, slots=True)
class _Segment:
    """Rows `[start, start + count)` of one request (chunk) of a sent batch."""

    chunk: int
    start: int
    count: int


class Coalescer:
    """Sends the appends given to `add` through `pipeline`, merging those that queue up
    while earlier requests are in flight (see the module docstring). `merge=False` keeps
    one request per append (a table with a key column); it is called once, by the sender
    thread before its first request (it may ask the cluster)."""

    def __init__(
        self,
        pipeline: PublishPipeline,
        *,
        merge: Callable[[], bool],
        bytes_max: int = wire.BATCH_BYTES_MAX,
    ) -> None:
        self._pipeline = pipeline
        self._decide_merge = merge
        self._merge = False
        self._bytes_max = bytes_max
        self._condition = threading.Condition()
        self._pending: collections.deque[_Append] = collections.deque()
        self._pending_bytes = 0
        self._sending = 0  # rows taken by the sender and not yet submitted
        self._closed = False
        self._sender: threading.Thread | None = None
        self.merged_appends = 0  # appends that shared a request with an earlier one

    def add(self, table: pa.Table) -> Future[AppendResult]:
        """Queue one validated, non-empty table; its future gives its committed offsets."""
        return self._queue(_Append(table.schema, table=table))

    def add_rows(self, rows: Sequence[Sequence[Any]], schema: pa.Schema) -> Future[AppendResult]:
        """Queue rows `row_path.quick_rows` vouched for under `schema` (converted by the
        sender); the future gives their committed offsets."""
        return self._queue(_Append(schema, rows=rows))

    def _queue(self, append: _Append) -> Future[AppendResult]:
        size = append.nbytes
        with self._condition:
            # Bounded: the sender drains the queue, or close() ends the wait.
            while not self._closed and self._pending and self._full(size):
                self._condition.wait(timeout=_POLL_S)
            if self._closed:
                raise InvalidArgument("publisher", "the pipeline is closed")
            self._pending.append(append)
            self._pending_bytes += size
            self._condition.notify_all()
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_until_closed,
                    name=f"publish-coalescer-{self._pipeline.table}",
                    daemon=True,
                )
                self._sender.start()
        return append.future

    def _full(self, size: int) -> bool:
        return (
            len(self._pending) >= PENDING_APPENDS_MAX
            or self._pending_bytes + size > PENDING_BYTES_MAX
        )

    def pending_rows(self) -> int:
        """Rows queued here, not yet handed to the pipeline."""
        with self._condition:
            return self._sending + sum(append.num_rows for append in self._pending)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued append was handed to the pipeline; False if `timeout_s`
        passed first. (The pipeline's own flush then waits for the answers.)"""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._pending or self._sending:  # bounded: the sender drains or fails them
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self._condition.wait(timeout=_POLL_S)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Hand over what is queued (up to `timeout_s`), then stop the sender; appends still
        queued after that fail with PipelineClosed."""
        self.flush(timeout_s)
        with self._condition:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            self._condition.notify_all()
            sender = self._sender
        for append in left:
            append.future.set_exception(PipelineClosed(self._pipeline.table, len(left)))
        if sender is not None and sender is not threading.current_thread():
            sender.join()

    # -- the sender thread ------------------------------------------------------------------

    def _send_until_closed(self) -> None:  # the sender's loop: runs until close()
        self._merge = self._decide_merge()
        while True:
            with self._condition:
                while not self._pending and not self._closed:  # woken by add and close
                    self._condition.wait(timeout=_POLL_S)
                if not self._pending:
                    return
            if self._merge:
                # Appends queue meanwhile. At most _POLL_S: past it (a node that answers
                # slowly) the pipeline's own window holds the request back, as before.
                self._pipeline.wait_in_flight_below(SEND_AHEAD_REQUESTS, _POLL_S)
            with self._condition:
                if not self._pending:
                    continue  # close() took them
                batch = self._take()
                self._condition.notify_all()
            try:
                self._send(batch)
            finally:
                with self._condition:
                    self._sending = 0
                    self._condition.notify_all()

    def _take(self) -> list[_Append]:
        """The appends of the next request (caller holds the lock): the head, and with
        merging as many after it as fit in a request's share of bytes and rows."""
        batch = [self._pending.popleft()]
        size = batch[0].nbytes
        rows = batch[0].num_rows
        budget = self._bytes_max * _MERGE_BYTES_FRACTION
        while self._merge and self._pending:
            head = self._pending[0]
            if (
                size + head.nbytes > budget
                or rows + head.num_rows > wire.BATCH_ROWS_MAX
                or not head.schema.equals(batch[0].schema, check_metadata=True)
            ):
                break
            batch.append(self._pending.popleft())
            size += head.nbytes
            rows += head.num_rows
        self._pending_bytes -= size
        self._sending = rows
        self.merged_appends += len(batch) - 1
        return batch

    def _send(self, batch: list[_Append]) -> None:
        """Encode and submit `batch` as one request (or several, if it comes out larger
        than a request may be); each append's future follows the requests it lies in."""
        batch, parts = _converted(batch, self._pipeline.table)
        if not batch:
            return
        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        chunks = table.column(0).num_chunks if table.num_columns else 1
        if chunks > 1 and table.num_rows < _SMALL_CHUNK_ROWS * chunks:
            # Many small appends: one record batch, not one per append, for the nodes to
            # decode and store.
            table = table.combine_chunks()
        chunk_futures: list[Future[AppendResult]] = []
        chunk_starts: list[int] = []
        start = 0
        try:
            for chunk in batches.encode_chunks(table, bytes_max=self._bytes_max):
                chunk_futures.append(self._pipeline.submit(chunk.payload, chunk.row_count))
                chunk_starts.append(start)
                start += chunk.row_count
        except BaseException as error:  # a closed pipeline: the rows from `start` on fail
            failed: Future[AppendResult] = Future()
            failed.set_exception(error)
            chunk_futures.append(failed)
            chunk_starts.append(start)
        if len(batch) == 1:
            segments = _segments(0, batch[0].num_rows, chunk_starts)
            _settle_when_done(batch[0].future, segments, chunk_futures, whole=True)
            return
        # Merged appends: those that lie in one request are settled together, by one
        # callback on it (one per append cost more than the row did to send).
        within: dict[int, list[_Append]] = {}
        first = 0
        for append in batch:
            if len(chunk_starts) == 1:  # one request holds them all
                append.start = first
                within.setdefault(0, []).append(append)
            else:
                segments = _segments(first, append.num_rows, chunk_starts)
                if len(segments) == 1:
                    append.start = segments[0].start
                    within.setdefault(segments[0].chunk, []).append(append)
                else:
                    _settle_when_done(append.future, segments, chunk_futures, whole=False)
            first += append.num_rows
        for index, appends in within.items():
            chunk_futures[index].add_done_callback(functools.partial(_settle_merged, appends))


def _converted(batch: list[_Append], table: str) -> tuple[list[_Append], list[pa.Table]]:
    """`batch` with every run of queued rows converted to one table (its appends each still
    count their own rows), and the tables that hold the batch's rows in order. Should a run
    not convert after all, each of its appends is converted alone, and one that fails is
    failed by itself (SchemaMismatch, naming the column), never its neighbours."""
    appends: list[_Append] = []
    parts: list[pa.Table] = []
    run: list[_Append] = []
    for append in [*batch, None]:
        if append is not None and append.rows is not None:
            run.append(append)
            continue
        if run:
            converted, run_parts = _converted_run(run, table)
            appends += converted
            parts += run_parts
            run = []
        if append is not None and append.table is not None:
            appends.append(append)
            parts.append(append.table)
    return appends, parts


def _converted_run(run: list[_Append], table: str) -> tuple[list[_Append], list[pa.Table]]:
    try:
        rows = row_path.rows_table([row for a in run for row in a.rows or ()], run[0].schema)
    except _CONVERSION_ERRORS:
        alone = [converted for append in run if (converted := _converted_alone(append, table))]
        return alone, [append.table for append in alone if append.table is not None]
    for append in run:
        append.rows = None  # converted: the caller's rows need not live until the answer
    return run, [rows]


def _converted_alone(append: _Append, table: str) -> _Append | None:
    try:
        append.table = batches.to_table(list(append.rows or ()), append.schema, table)
    except SchemaMismatch as error:
        append.future.set_exception(error)
        return None
    return append


def _segments(first: int, count: int, chunk_starts: list[int]) -> list[_Segment]:
    """The parts of rows `[first, first + count)` per chunk, given where each chunk starts
    (a row past the last start belongs to the last chunk)."""
    segments = []
    end = first + count
    for index, start in enumerate(chunk_starts):
        stop = chunk_starts[index + 1] if index + 1 < len(chunk_starts) else end
        low, high = max(first, start), min(end, stop)
        if low < high:
            segments.append(_Segment(index, low - start, high - low))
    return segments


def _settle_when_done(
    future: Future[AppendResult],
    segments: list[_Segment],
    chunk_futures: list[Future[AppendResult]],
    *,
    whole: bool,
) -> None:
    """Complete `future` once the chunks its segments lie in are answered: the first error,
    or the segments' offsets. `whole`: the append was the batch's only one, so its result is
    the chunks' results as they are."""
    remaining = [len(segments)]
    lock = threading.Lock()

    def done(_: Future[AppendResult]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        futures = [chunk_futures[segment.chunk] for segment in segments]
        for chunk_future in futures:
            error = chunk_future.exception()
            if error is not None:
                future.set_exception(error)
                return
        if whole:
            future.set_result(AppendResult.merge([f.result() for f in futures]))
            return
        parts = [_part(chunk_futures[s.chunk].result(), s) for s in segments]
        future.set_result(AppendResult.merge(parts))

    for segment in segments:
        chunk_futures[segment.chunk].add_done_callback(done)


def _settle_merged(appends: list[_Append], request: Future[AppendResult]) -> None:
    """Complete the futures of `appends`, which all lie in the one request `request`
    answered: its error, or each one's part of its offsets."""
    error = request.exception()
    if error is not None:
        for append in appends:
            append.future.set_exception(error)
        return
    result = request.result()
    for append in appends:
        append.future.set_result(_part(result, _Segment(0, append.start, append.num_rows)))


def _part(result: AppendResult, segment: _Segment) -> AppendResult:
    """The result of `segment`'s rows within the request that answered `result`. Without a
    key column nothing is dropped, so the rows before it fix its offsets; a request that
    dropped rows (the table was re-created with a key column since) can only be answered
    as a whole."""
    if result.duplicates:
        return result
    return AppendResult(
        first_offset=result.first_offset + segment.start,
        row_count=segment.count,
        duplicates=0,
        lsn=result.lsn,
        duplicate_batch=result.duplicate_batch,
    )
