"""Publishing DataFrames to an HA stream table: `df.write` and `df.writeStream`.

Each Spark task publishes its partition through one `api_clients.Publisher` whose
`producer_id` is derived from an idempotency token, with sequences 1..n in row order:
- batch writes: (table, job id, partition id); the job id is a uuid made once in
  `writer()` on the driver (or the `idempotencyToken` option, to make a re-run of the same
  job deduplicated too);
- streaming writes: (table, query id, batch id, partition id), from the task's local
  properties; the query id is stable across restarts on the same checkpoint.
A retried task, or a micro-batch replayed after a driver crash, derives the same producer
id and resends the same sequences, so the leader answers them from its producer window
instead of appending the rows twice (given a deterministic replay, as for any idempotent
Spark sink). The window holds the newest `PRODUCERS_MAX` producers per Raft group.

Rows are cut into requests of exactly `batchRows` rows (and the client further splits a
request over the byte limit), so a retry numbers the same rows with the same sequences
whatever RecordBatch sizes Spark hands over.

Requests are pipelined (`Publisher.append_async`): while the cluster replicates one
request, the task converts the next rows Spark hands over, instead of waiting for each
acknowledgement in turn. The first request is waited for, so a node that has not applied
the table's creation yet can be retried under the same sequences; after that, a failure
fails the task (Spark retries it under the same producer id, and the cluster drops what it
already holds), and the pipeline takes no request after it (a caller-given producer id).
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from api_clients import AppendResult, Publisher, TableNotFound
from spark_publisher import clients, schema
from spark_publisher.cluster import TABLE_NOT_FOUND_RETRY_S, publish_schema, table_info
from spark_publisher.options import HAStreamOptions, OptionError

log = logging.getLogger(__name__)

# Results a task keeps before it waits for the oldest: the pipeline's own window bounds the
# requests in flight; this bounds the futures held beside it.
_RESULTS_PENDING_MAX: Final = 64


@dataclass(frozen=True, slots=True)
class PublishReport(WriterCommitMessage):
    """What one task published. `replayed` rows were answered from the producer window (a
    retry or replay of rows already appended)."""

    partition_id: int
    rows: int
    appended: int
    duplicates: int  # Dropped by the table's key-column dedup.
    replayed: int
    first_offset: int  # -1 when nothing was appended.
    last_offset: int  # -1 when nothing was appended.


def _check_table(
    options: HAStreamOptions, schema_: StructType, *, overwrite: bool, streaming: bool = False
) -> None:
    """Runs on the driver before any task: refuse overwrite (a batch write's
    mode('overwrite'), a stream's outputMode('complete')), an unknown table, or columns that
    do not fit the table."""
    if overwrite and streaming:
        raise OptionError(
            "outputMode",
            "complete",
            "HA stream tables are append-only: use outputMode('append') (or 'update' without "
            "an aggregation); a complete result table would be appended again every trigger",
        )
    if overwrite:
        raise OptionError(
            "mode", "overwrite", "HA stream tables are append-only: use mode('append')"
        )
    info = table_info(options)
    schema.check_writable(options.table, info.schema, schema_)


def publish_partition(
    options: HAStreamOptions, producer_id: bytes, batches: Iterator[pa.RecordBatch], partition: int
) -> PublishReport:
    """Publishes a task's RecordBatches in requests of `batch_rows` rows, sequences 1..n."""
    task = _TaskPublisher(options, producer_id, partition)
    try:
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        for batch in batches:
            if batch.num_rows == 0:
                continue
            pending.append(batch)
            pending_rows += batch.num_rows
            if pending_rows < options.batch_rows:
                continue
            rows = pa.Table.from_batches(pending)
            whole = pending_rows - pending_rows % options.batch_rows
            for start in range(0, whole, options.batch_rows):
                task.send(rows.slice(start, options.batch_rows))
            pending = rows.slice(whole).to_batches()
            pending_rows -= whole
        if pending_rows:
            task.send(pa.Table.from_batches(pending))
        return task.report()
    finally:
        task.close()  # Python workers are reused: no pipeline thread may outlive the task


class _TaskPublisher:
    """One task's publisher and its totals. Runs in a Spark task (one thread)."""

    def __init__(self, options: HAStreamOptions, producer_id: bytes, partition: int) -> None:
        self._options = options
        self._producer_id = producer_id
        self._partition = partition
        self._table_schema = publish_schema(options)
        self._client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
        self._publisher = self._new_publisher(first_sequence=1)
        self._pending: collections.deque[Future[AppendResult]] = collections.deque()
        self._acknowledged_once = False
        self.rows = self.appended = self.duplicates = self.replayed = 0
        self.first_offset = self.last_offset = -1

    def _new_publisher(self, *, first_sequence: int) -> Publisher:
        return Publisher(
            self._client,
            self._options.table,
            producer_id=self._producer_id,
            first_sequence=first_sequence,
            deadline_s=self._options.timeout_s,
            schema=self._table_schema,  # conformed to it by `send`: no need to ask again
        )

    def send(self, rows: pa.Table) -> None:
        conformed = schema.to_table_rows(self._options.table, self._table_schema, rows.to_batches())
        self.rows += rows.num_rows
        if not self._acknowledged_once:
            self._count(self._append(conformed))
            self._acknowledged_once = True
            return
        self._pending.append(self._publisher.append_async(conformed))
        while len(self._pending) > _RESULTS_PENDING_MAX or (
            self._pending and self._pending[0].done()
        ):
            self._count(self._pending.popleft().result())

    def _count(self, result: AppendResult) -> None:
        """Adds one acknowledged request to the totals (called in request order)."""
        for part in result.parts or (result,):
            if part.duplicate_batch:
                self.replayed += part.row_count + part.duplicates
                continue
            self.appended += part.row_count
            self.duplicates += part.duplicates
            if part.row_count:
                if self.first_offset < 0:
                    self.first_offset = part.first_offset
                self.last_offset = part.first_offset + part.row_count - 1

    def _append(self, rows: pa.Table) -> AppendResult:
        """Appends `rows`, resending them under the *same* sequences when a node that has
        not applied the table's creation yet (a follower, or a leader elected a moment ago)
        answers TableNotFound: sequences must map to the same rows on every attempt, or a
        later retry of the task would be wrongly answered as a duplicate."""
        backoff = self._client.new_backoff(min(self._options.timeout_s, TABLE_NOT_FOUND_RETRY_S))
        while True:  # Bounded by `backoff`.
            first_sequence = self._publisher.next_sequence
            try:
                return self._publisher.append_async(rows).result()
            except TableNotFound:
                if not backoff.wait():
                    raise
                log.info("table %s not found at the node asked: retrying", self._options.table)
                self._table_schema = publish_schema(self._options)
                self._publisher.close()
                self._publisher = self._new_publisher(first_sequence=first_sequence)

    def close(self) -> None:
        """Ends the pipeline (waits for requests still in flight, up to the deadline)."""
        self._publisher.close()

    def report(self) -> PublishReport:
        """The task's totals, once every request is acknowledged (raises the first failure)."""
        while self._pending:
            self._count(self._pending.popleft().result())
        return PublishReport(
            partition_id=self._partition,
            rows=self.rows,
            appended=self.appended,
            duplicates=self.duplicates,
            replayed=self.replayed,
            first_offset=self.first_offset,
            last_offset=self.last_offset,
        )


def _log_commit(
    kind: str, options: HAStreamOptions, messages: list[WriterCommitMessage | None]
) -> None:
    reports = [message for message in messages if isinstance(message, PublishReport)]
    log.info(
        "%s committed table=%s tasks=%d rows=%d appended=%d key_duplicates=%d replayed=%d",
        kind,
        options.table,
        len(reports),
        sum(report.rows for report in reports),
        sum(report.appended for report in reports),
        sum(report.duplicates for report in reports),
        sum(report.replayed for report in reports),
    )


class HAStreamWriter(DataSourceArrowWriter):
    """`df.write.format("hastream").mode("append").save()`. Built on the driver, pickled to
    the tasks; `commit` runs on yet another copy. Holds only options and the job id."""

    def __init__(self, options: HAStreamOptions, job_id: str) -> None:
        self._options = options
        self._job_id = job_id

    @classmethod
    def create(
        cls, options: HAStreamOptions, schema_: StructType, *, overwrite: bool
    ) -> HAStreamWriter:
        _check_table(options, schema_, overwrite=overwrite)
        job_id = options.idempotency_token or uuid.uuid4().hex
        return cls(options, job_id)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        producer = clients.producer_id("batch", self._options.table, self._job_id, partition)
        return publish_partition(self._options, producer, iterator, partition)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        _log_commit("batch write", self._options, messages)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        # Rows already acknowledged stay: the table is append-only. Re-running the job with
        # the same idempotencyToken resends them deduplicated.
        log.warning(
            "batch write aborted table=%s job=%s: rows of finished tasks stay in the table",
            self._options.table,
            self._job_id,
        )


class HAStreamStreamWriter(DataSourceStreamArrowWriter):
    """`df.writeStream.format("hastream")`: a new instance per micro-batch."""

    def __init__(self, options: HAStreamOptions) -> None:
        self._options = options

    @classmethod
    def create(
        cls, options: HAStreamOptions, schema_: StructType, *, overwrite: bool
    ) -> HAStreamStreamWriter:
        _check_table(options, schema_, overwrite=overwrite, streaming=True)
        return cls(options)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PublishReport:
        context = TaskContext.get()
        assert context is not None, "write() runs in a Spark task"
        partition = context.partitionId()
        query_id = context.getLocalProperty("sql.streaming.queryId")
        batch_id = context.getLocalProperty("streaming.sql.batchId")
        if query_id is None or batch_id is None:
            # Not expected from Spark 4.x; without a token a replay cannot be recognised.
            log.warning("no streaming query/batch id in the task: publishing without idempotency")
            query_id, batch_id = uuid.uuid4().hex, "unknown"
        producer = clients.producer_id("stream", self._options.table, query_id, batch_id, partition)
        return publish_partition(self._options, producer, iterator, partition)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _log_commit(f"micro-batch {batchId}", self._options, messages)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "micro-batch %d aborted table=%s: Spark replays it with the same idempotency keys",
            batchId,
            self._options.table,
        )
