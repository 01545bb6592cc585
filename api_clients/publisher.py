"""Publishing rows to a stream table, safely retried.

Every request carries an idempotency token: the Publisher's random 16-byte `producer_id`
and a `sequence` that grows by one per request. A retry resends the *same* request, so if
the first attempt was committed but its answer lost, the leader answers the retry from its
producer window (`duplicate_batch=True`) instead of appending the rows twice.

With `durable_buffer_dir`, every request is first written (and fsynced) to a local
`DurableBuffer` under its producer id and sequence, then sent; the buffer keeps what the
cluster has not acknowledged across outages and process crashes, and resends it, oldest
first and deduplicated by the same token, on the next append, `flush()` or run.

`append_async` pipelines: up to `max_in_flight` requests in flight on one PublishStream,
answered in order through futures (api_clients/pipeline.py). Not with a durable buffer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa

from api_clients import batches, row_path
from api_clients.buffer import (
    BUFFER_BYTES_MAX_DEFAULT,
    REJECTED_DIR,
    BufferStats,
    DurableBuffer,
)
from api_clients.coalescer import Coalescer
from api_clients.pipeline import MAX_IN_FLIGHT_DEFAULT, PublishPipeline, append_result
from api_clients.types import AppendResult
from hastream import wire
from hastream.errors import InvalidArgument, RaftStoreError, SchemaMismatch
from proto import hastream_pb2

if TYPE_CHECKING:
    from api_clients.connection import Session

log = logging.getLogger(__name__)

# How long a publisher waits for the cluster when rows do not match the schema it has: it
# asks once more (the table may have been re-created), but not for a whole call deadline.
SCHEMA_RECHECK_S: Final = 2.0


class Publisher:
    """Appends rows to `tableName` through `session`, following its leader.

    `producer_id` (16 bytes) defaults to a random one. Pass a stable id derived from, for
    example, a Spark query, partition and epoch, to make a *re-run* of the same appends in
    the same order deduplicated too: the sequence restarts at `first_sequence`.

    With `durable_buffer_dir` (opt-in), each request is made durable in a `DurableBuffer`
    in that directory before it is sent; the buffer's own producer id and sequences are
    used (a `producer_id` or `first_sequence` argument is refused). `append` then returns
    once the rows are durable locally and either acknowledged or the cluster stayed
    unreachable until the deadline (`AppendResult.buffered_rows` > 0): do not append those
    rows again, they are resent in order by the next `append`/`flush` or by the next
    Publisher opened on the directory. `buffer_bytes_max` bounds the buffer: beyond it the
    oldest records are dropped (counted in `buffer_stats()`). Call `close()` when done.

    Pipelining (no durable buffer): `append_async` returns a Future at once and keeps up
    to `max_in_flight` (default 64) requests in flight on one stream; `flush()` waits for
    them. Once `append_async` was called, `append` goes through the pipeline too (ordered
    after the pending requests). A Publisher that made unary appends before its first
    `append_async` pipelines under a fresh random producer id. After a failed pipelined
    request, a random producer goes on under a new id; a caller-given `producer_id` does
    not: later appends raise PublishAborted (use a new Publisher, or re-run the job under
    the same id to have the cluster drop what it already holds). See docs/client.md.

    Threads: appends through one Publisher are serialized (sequences must reach the leader
    in order); use one Publisher per thread for parallel publishing.
    """

    def __init__(
        self,
        session: Session,
        tableName: str,
        *,
        producer_id: bytes | None = None,
        first_sequence: int = 1,
        batch_bytes_max: int = wire.BATCH_BYTES_MAX,
        deadline_s: float | None = None,
        durable_buffer_dir: str | os.PathLike[str] | None = None,
        buffer_bytes_max: int = BUFFER_BYTES_MAX_DEFAULT,
        schema: pa.Schema | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if producer_id is not None and len(producer_id) != wire.PRODUCER_ID_BYTES:
            raise InvalidArgument("producer_id", f"must be {wire.PRODUCER_ID_BYTES} bytes")
        if first_sequence < 1:
            raise InvalidArgument("first_sequence", f"must be >= 1, got {first_sequence}")
        if not 0 < batch_bytes_max <= wire.BATCH_BYTES_MAX:
            raise InvalidArgument("batch_bytes_max", f"must be in (0, {wire.BATCH_BYTES_MAX}]")
        if durable_buffer_dir is not None and (producer_id is not None or first_sequence != 1):
            raise InvalidArgument(
                "producer_id", "a durable buffer brings its own producer id and sequences"
            )
        if durable_buffer_dir is not None and max_in_flight is not None:
            raise InvalidArgument("max_in_flight", _NO_PIPELINE_WITH_BUFFER)
        if max_in_flight is not None and not 1 <= max_in_flight <= wire.PIPELINE_IN_FLIGHT_MAX:
            raise InvalidArgument("max_in_flight", f"must be in [1, {wire.PIPELINE_IN_FLIGHT_MAX}]")
        if deadline_s is not None and deadline_s <= 0:
            raise InvalidArgument("deadline_s", f"must be > 0, got {deadline_s}")
        self._session = session
        self._table = tableName
        self._buffer: DurableBuffer | None = None
        if durable_buffer_dir is not None:
            self._buffer = DurableBuffer(
                durable_buffer_dir, table=tableName, bytes_max=buffer_bytes_max
            )
            producer_id = self._buffer.producer_id
        # A caller's producer id promises that a re-run of the same appends maps to the same
        # sequences: merging appends (which depends on timing) would break that.
        self._stable_producer = producer_id is not None
        self._producer_id = producer_id or secrets.token_bytes(wire.PRODUCER_ID_BYTES)
        self._first_sequence = first_sequence
        self._next_sequence = first_sequence
        self._max_in_flight = MAX_IN_FLIGHT_DEFAULT if max_in_flight is None else max_in_flight
        self._pipeline: PublishPipeline | None = None
        self._coalescer: Coalescer | None = None
        self._key_column: str | None = None  # as getTableInfo said; None before it was asked
        self._checks: tuple[row_path.Check, ...] | None = None
        self._checks_schema: pa.Schema | None = None
        self._batch_bytes_max = batch_bytes_max
        self._deadline_s = deadline_s
        self._schema: pa.Schema | None = schema
        self._lock = threading.Lock()
        self._refused: str | None = None  # why the buffered head record was refused

    @property
    def table_name(self) -> str:
        return self._table

    @property
    def producer_id(self) -> bytes:
        """The producer id of the next request (a pipeline that failed requests goes on
        under a new one)."""
        if self._pipeline is not None:
            return self._pipeline.producer_id
        return self._producer_id

    @property
    def next_sequence(self) -> int:
        """The sequence the next request will carry."""
        with self._lock:
            if self._buffer is not None:
                return self._buffer.stats().next_sequence
            if self._pipeline is not None:
                return self._pipeline.next_sequence
            return self._next_sequence

    def schema(self) -> pa.Schema:
        """The table's schema, fetched once from the cluster."""
        with self._lock:
            return self._table_schema()

    def _table_schema(self, deadline_s: float | None = None) -> pa.Schema:
        if self._schema is not None:
            return self._schema
        try:
            info = self._session.getTableInfo(self._table, deadline_s=deadline_s)
            self._schema, self._key_column = info.schema, info.key_column or ""
        except RaftStoreError as error:
            stored = self._buffer.schema() if self._buffer is not None else None
            if not error.retryable or stored is None:
                raise
            # The cluster is unreachable: the buffer remembers the schema, so rows can
            # still be validated and buffered during the outage.
            log.warning("table schema from the buffer table=%s error=%s", self._table, error)
            self._schema = stored
            return stored
        if self._buffer is not None:
            self._buffer.set_schema(self._schema)
        return self._schema

    def _to_table(self, data: object) -> pa.Table:
        """`data` as a table with the table's schema (caller holds the lock). A mismatch
        with a schema fetched earlier is checked once more against a fresh one: the table
        may have been re-created with another schema since."""
        cached = self._schema
        schema = self._table_schema()
        try:
            return batches.to_table(data, schema, self._table)
        except SchemaMismatch as mismatch:
            if cached is None:
                raise
            self._schema = None
            try:
                # Briefly: rows that do not match are refused either way; the cluster can
                # only tell that the table changed, not make a wrong row right.
                fresh = self._table_schema(SCHEMA_RECHECK_S)
            except RaftStoreError:
                self._schema = cached  # the cluster cannot say: keep what we knew
                raise mismatch from None
            if fresh.equals(cached):
                raise
            return batches.to_table(data, fresh, self._table)

    def append(self, data: object) -> AppendResult:
        """Appends `data` (a pandas DataFrame, a pyarrow Table or RecordBatch, or a list of
        row tuples or dicts) and returns the committed offsets.

        All validation happens before any row is sent: SchemaMismatch (column count, names,
        types, nulls in non-nullable columns), EmptyBatch, BatchTooLarge (one row alone over
        the batch byte limit). Data over the limit is split into several requests. Errors
        of the cluster are raised typed (see `Session.call`); if a split append fails
        part-way, the parts before the failed one are committed. With a durable buffer a
        cluster that stays unreachable is not an error: the rows are buffered and counted
        in `buffered_rows` (see the class docstring).
        """
        if self._pipeline is not None:
            return self.append_async(data).result()
        with self._lock:
            schema = self._table_schema()
            rows = self._quick_rows(data, schema)
            if rows is None:
                chunks = batches.encode_chunks(
                    self._to_table(data), bytes_max=self._batch_bytes_max
                )
            else:
                chunks = self._row_chunks(rows, schema)
            if self._buffer is not None:
                return self._append_buffered(chunks)
            results = [self._publish(chunk) for chunk in chunks]
        return AppendResult.merge(results)

    def _row_chunks(
        self, rows: list[Sequence[Any]], schema: pa.Schema
    ) -> list[batches.EncodedChunk]:
        """A few plain rows as requests: packed with struct into pyarrow's bytes
        (row_path.rows_payload, row_ipc.py), else one struct conversion (row_path.py), a
        sixth of the general path's cost for one row, encoded as one record batch (no table
        to build, measure and cut: a waited one-row append pays every object made on its
        round trip)."""
        payload = row_path.rows_payload(rows, schema)
        if payload is not None and len(payload) <= self._batch_bytes_max:
            return [batches.EncodedChunk(payload=payload, row_count=len(rows))]
        batch = row_path.rows_batch(rows, schema)
        payload = batches.encode_batch(batch, schema)
        if payload is not None and len(payload) <= self._batch_bytes_max:
            return [batches.EncodedChunk(payload=payload, row_count=batch.num_rows)]
        table = row_path.batch_table(batch, schema)
        return batches.encode_chunks(table, bytes_max=self._batch_bytes_max)

    def append_async(self, data: object) -> Future[AppendResult]:
        """Pipelined `append`: validates `data` on the calling thread (raising as `append`
        does, with nothing sent), queues it and returns a Future of its committed offsets.
        Appends queued while earlier requests are in flight go out together as one request
        (api_clients/coalescer.py), unless the table has a key column or the caller gave
        the producer id. Blocks only while the queue holds `coalescer.PENDING_BYTES_MAX`.

        Requests reach the table in call order, each exactly once, across leader changes
        (resent with the same producer id and sequence). The future raises the request's
        error: typed as for `append`; `PublishAborted` when an earlier request of this
        Publisher failed first (api_clients/pipeline.py). Refused (InvalidArgument) with a
        durable buffer."""
        if self._buffer is not None:
            raise InvalidArgument("durable_buffer_dir", _NO_PIPELINE_WITH_BUFFER)
        with self._lock:
            schema = self._table_schema()
            rows = self._quick_rows(data, schema)
            if rows is not None:  # converted by the coalescer, with the rows queued beside
                return self._pipeline_started().add_rows(rows, schema)
            table = self._to_table(data)
            return self._pipeline_started().add(table)

    def _quick_rows(self, data: object, schema: pa.Schema) -> list[Sequence[Any]] | None:
        """`data` as rows of the fast path (row_path.quick_rows), None for the general one.
        The checks are made once per schema."""
        if self._checks_schema is not schema:
            self._checks = row_path.checks_for(schema)
            self._checks_schema = schema
        return None if self._checks is None else row_path.quick_rows(data, self._checks)

    def _pipeline_started(self) -> Coalescer:
        """The pipeline and its coalescer, started on first use (caller holds the lock)."""
        if self._coalescer is None:
            # After unary appends the group may hold a gap this producer cannot see (a
            # failed request): pipeline under a fresh producer rather than hit SequenceGap.
            fresh = self._next_sequence != self._first_sequence
            self._pipeline = PublishPipeline(
                self._session,
                self._table,
                producer_id=None if fresh else self._producer_id,
                first_sequence=1 if fresh else self._next_sequence,
                max_in_flight=self._max_in_flight,
                deadline_s=self._deadline_s,
                # The caller's id promises re-runs the same sequences: after a failure, stop
                # rather than commit later appends under an id a re-run would not repeat.
                renew=fresh or not self._stable_producer,
            )
            self._coalescer = Coalescer(
                self._pipeline,
                merge=self._mergeable,
                bytes_max=self._batch_bytes_max,
            )
        return self._coalescer

    def _mergeable(self) -> bool:
        """Whether appends may share a request: a random producer id and a table known to
        have no key column. Called once, on the coalescer's thread (without the lock: the
        caller may be waiting in `add` for that thread); asks the cluster once when the
        schema came from the caller, and an unknown key column counts as one."""
        if self._stable_producer:
            return False
        if self._key_column is None:
            try:
                self._key_column = self._session.getTableInfo(self._table).key_column or ""
            except RaftStoreError as error:
                log.warning("appends not merged table=%s error=%s", self._table, error)
                return False
        return self._key_column == ""

    def _publish(self, chunk: batches.EncodedChunk) -> AppendResult:
        sequence = self._next_sequence
        self._next_sequence += 1
        return self._send(chunk.payload, sequence, self._deadline_s)

    def publish_payload(
        self, payload: bytes, sequence: int, *, deadline_s: float | None = None
    ) -> AppendResult:
        """Sends one already encoded and validated request (an Arrow IPC stream with the
        table's schema) under this Publisher's producer id and the given `sequence`, which
        must be above every sequence this producer sent before. For callers that persist
        their own sequences (a `DurableBuffer`'s sender); retries follow `Session.call`."""
        if sequence < 1:
            raise InvalidArgument("sequence", f"must be >= 1, got {sequence}")
        return self._send(payload, sequence, self._deadline_s if deadline_s is None else deadline_s)

    def _send(self, payload: bytes, sequence: int, deadline_s: float | None) -> AppendResult:
        request = hastream_pb2.PublishRequest(
            table=self._table,
            payload=payload,
            producer_id=self._producer_id,
            sequence=sequence,
        )
        response = self._session.call("Publish", request, table=self._table, deadline_s=deadline_s)
        log.debug(
            "published table=%s sequence=%d rows=%d first_offset=%d",
            self._table,
            sequence,
            response.row_count,
            response.first_offset,
        )
        return append_result(response)

    # -- the durable buffer ------------------------------------------------------------

    def _append_buffered(self, chunks: list[batches.EncodedChunk]) -> AppendResult:
        assert self._buffer is not None
        sequences = [self._buffer.append(chunk.payload, chunk.row_count) for chunk in chunks]
        acknowledged = self._drain(self._deadline_s)
        results = [acknowledged[sequence] for sequence in sequences if sequence in acknowledged]
        buffered_rows = sum(
            chunk.row_count
            for chunk, sequence in zip(chunks, sequences, strict=True)
            if sequence not in acknowledged
        )
        if not results:
            return AppendResult(
                first_offset=-1, row_count=0, duplicates=0, lsn=-1, buffered_rows=buffered_rows
            )
        return dataclasses.replace(AppendResult.merge(results), buffered_rows=buffered_rows)

    def _drain(self, deadline_s: float | None) -> dict[int, AppendResult]:
        """Sends the buffered records oldest first until none is left or the cluster stays
        unreachable past the deadline. Returns the results by sequence. A non-retryable
        error is raised; its record stays buffered."""
        assert self._buffer is not None
        deadline = time.monotonic() + (
            self._session.deadline_s if deadline_s is None else deadline_s
        )
        results: dict[int, AppendResult] = {}
        while (remaining_s := deadline - time.monotonic()) > 0:  # Bounded by the deadline.
            record = self._buffer.head(0)
            if record is None:
                break
            try:
                result = self._send(record.payload, record.sequence, remaining_s)
            except RaftStoreError as error:
                if not error.retryable:
                    log.error(
                        "the cluster refused buffered record sequence=%d rows=%d for good: %s; "
                        "it stays buffered and blocks the records after it until "
                        "reject_buffered_head() moves it to %s",
                        record.sequence,
                        record.row_count,
                        error,
                        self._buffer.directory / REJECTED_DIR,
                    )
                    self._refused = f"{type(error).__name__}: {error}"
                    raise
                log.warning(
                    "cluster unreachable, rows stay buffered table=%s pending_rows=%d error=%s",
                    self._table,
                    self._buffer.stats().pending_rows,
                    error,
                )
                break
            self._buffer.commit(record.sequence)
            results[record.sequence] = result
        self._buffer.flush_commit()
        return results

    def reject_buffered_head(self) -> Path | None:
        """After `append`/`flush` raised a non-retryable error for a buffered record (the
        table was dropped, or re-created with another schema): move that record out of the
        queue into `<durable_buffer_dir>/rejected/` (its Arrow IPC payload and a JSON note
        with the error), durably, so the records after it are sent. Nothing is dropped
        silently: this is the caller's decision. Returns the payload's path; None without a
        durable buffer or with nothing pending."""
        with self._lock:
            if self._buffer is None:
                return None
            reason = self._refused or "rejected by the caller"
            self._refused = None
            return self._buffer.reject_head(reason)

    def flush(self, deadline_s: float | None = None) -> int:
        """Sends what the durable buffer holds (oldest first) until it is empty or the
        deadline passes; returns the rows still buffered. Pipelined: waits until every
        `append_async` request is acknowledged or failed (at most `deadline_s`); returns
        the rows still in flight. 0 otherwise."""
        if self._pipeline is not None and self._coalescer is not None:
            deadline = None if deadline_s is None else time.monotonic() + deadline_s
            self._coalescer.flush(deadline_s)
            self._pipeline.flush(
                None if deadline is None else max(0.0, deadline - time.monotonic())
            )
            return self._coalescer.pending_rows() + self._pipeline.rows_in_flight()
        with self._lock:
            if self._buffer is None:
                return 0
            self._drain(deadline_s)
            return self._buffer.stats().pending_rows

    def pipeline_stats(self) -> dict[str, int] | None:
        """The pipeline's counters (requests in flight, streams reopened, requests resent);
        None before the first `append_async`."""
        if self._pipeline is None or self._coalescer is None:
            return None
        return {**self._pipeline.stats(), "merged_appends": self._coalescer.merged_appends}

    def buffer_stats(self) -> BufferStats | None:
        """The durable buffer's counters (pending, dropped, truncated...); None without one."""
        return None if self._buffer is None else self._buffer.stats()

    def close(self) -> None:
        """Closes the durable buffer (writing its COMMIT marker); rows still in it are sent by
        the next Publisher opened on the directory. Pipelined: waits for the requests in
        flight (up to the session deadline; the rest fail), then ends the stream."""
        if self._pipeline is not None and self._coalescer is not None:
            deadline = time.monotonic() + self._session.deadline_s
            self._coalescer.close(self._session.deadline_s)
            self._pipeline.close(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._buffer is not None:
                self._buffer.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


_NO_PIPELINE_WITH_BUFFER: Final = (
    "pipelined publishing (append_async, max_in_flight) is not available with a durable "
    "buffer; use append, or MultithreadedTableWriter for buffered parallel sending"
)
