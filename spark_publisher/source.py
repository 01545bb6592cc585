"""Reading an HA stream table from Spark: batch reads and a structured-streaming source.

Offsets are `{"table": T, "offset": N}`, N a table row offset; a micro-batch (or a batch
read) covers the half-open range `[start, end)`. Rows of a range are immutable once
committed, so any replica can serve them and a replayed micro-batch reads exactly the same
rows.

Which object runs where (pyspark 4.3, as measured):
- `HAStreamStreamReader` instance 1 lives in the driver's streaming source runner for the
  whole query: `initialOffset`, `latestOffset`, `partitions`, `commit`, `stop`.
- instance 2 is pickled to the executors, which only call `read(partition)`.
Neither keeps a connection: `clients.session()` is looked up inside each call.

Delivery: Spark's checkpoint is the source of truth. `commit(end)` persists `end - 1` in the
cluster as the action's processed offset (for lag monitoring and for `startingOffsets=
persisted` on a fresh checkpoint); Spark delivers it one micro-batch late, which
`listener.HAStreamOffsetListener` closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from api_clients import (
    OffsetOutOfRange,
    RaftStoreError,
    Session,
    TableInfo,
    TableNotFound,
    TopicNotFound,
)
from api_clients.times import METADATA_FIELDS
from spark_publisher import clients, schema
from spark_publisher.cluster import (
    PLANNING_TIMEOUT_S,
    TABLE_NOT_FOUND_RETRY_S,
    commit_offset,
    offset_for_time,
    table_info,
)
from spark_publisher.options import (
    HAStreamOptions,
    OptionError,
    Position,
    TimestampStrategy,
    offset_dict,
    offset_number,
    parse,
    split_range,
)
from spark_publisher.sink import HAStreamStreamWriter, HAStreamWriter

log = logging.getLogger(__name__)

NAME: Final = "hastream"
# A partition is read in ranges of at most this many rows, so a worker holds a bounded
# slice of the table in memory however large the micro-batch.
READ_CHUNK_ROWS: Final = 200_000


class DataLossError(RuntimeError):
    """Rows the query has not read yet are no longer retained by the cluster. Like Kafka's
    failOnDataLoss (true by default), the query fails instead of skipping them."""

    def __init__(self, table: str, offset: int, earliest: int) -> None:
        self.table = table
        self.offset = offset
        self.earliest = earliest
        super().__init__(
            f"hastream: table {table!r} no longer retains rows [{offset}, {earliest}) that this "
            f"query has not read (the earliest retained row is {earliest}). Refusing to skip "
            "them silently; to skip them knowingly, set failOnDataLoss=false or start a new "
            "checkpoint with startingOffsets=earliest."
        )


class RangePartition(InputPartition):
    """The rows `[start, end)` of the table; picklable, small."""

    def __init__(self, start: int, end: int) -> None:
        assert 0 <= start <= end, (start, end)
        super().__init__((start, end))
        self.start = start
        self.end = end


class HAStreamDataSource(DataSource):
    """`format("hastream")`: read, write, readStream and writeStream of an HA stream table.

    Options are parsed (and refused with OptionError) when Spark creates the source on the
    driver; the table's schema comes from the cluster.
    """

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.parsed = parse(options)

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        columns = table_info(self.parsed).schema
        if self.parsed.include_metadata:
            columns = pa.schema([*columns, *METADATA_FIELDS], metadata=columns.metadata)
        return schema.spark_schema(self.parsed.table, columns)

    def reader(self, schema: StructType) -> DataSourceReader:
        return HAStreamReader(self.parsed, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return HAStreamStreamReader(self.parsed, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return HAStreamWriter.create(self.parsed, schema, overwrite=overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return HAStreamStreamWriter.create(self.parsed, schema, overwrite=overwrite)


# --- what the readers share -----------------------------------------------------------------


def resolve_start(options: HAStreamOptions, info: TableInfo, default: Position) -> int:
    """The first row to read for `startingOffsets` (or `default`). Raises DataLossError for
    a start below the earliest retained row."""
    if options.starting_timestamp is not None:
        return _start_by_time(options, options.starting_timestamp)
    wanted = options.starting_offsets if options.starting_offsets is not None else default
    if wanted is Position.EARLIEST:
        return info.earliest_offset
    if wanted is Position.LATEST:
        return info.row_count
    if wanted is Position.PERSISTED:
        start = _persisted_start(options, info)
    else:
        assert isinstance(wanted, int), wanted
        start = wanted
    if start < info.earliest_offset:
        return data_lost(options, start, info.earliest_offset)
    return start


def data_lost(options: HAStreamOptions, offset: int, earliest: int) -> int:
    """Rows `[offset, earliest)` are no longer retained: DataLossError, or with
    `failOnDataLoss=false` a warning and `earliest`, where reading goes on."""
    if options.fail_on_data_loss:
        raise DataLossError(options.table, offset, earliest)
    log.warning(
        "failOnDataLoss=false: skipping rows no longer retained table=%s rows=[%d, %d) count=%d",
        options.table,
        offset,
        earliest,
        earliest - offset,
    )
    return earliest


def _start_by_time(options: HAStreamOptions, timestamp_ms: int) -> int:
    """The first row stamped at or after `timestamp_ms`; when every retained row is older,
    the next row (strategy latest) or an OptionError (error, Kafka's default)."""
    answer = offset_for_time(options, timestamp_ms)
    if not answer.found and options.timestamp_strategy is TimestampStrategy.ERROR:
        raise OptionError(
            "startingTimestamp",
            str(timestamp_ms),
            f"no row of {options.table!r} is stamped at or after it; "
            "startingOffsetsByTimestampStrategy=latest starts with the next row instead",
        )
    log.info(
        "start by time topic=%s timestamp_ms=%d offset=%d found=%s",
        options.topic,
        timestamp_ms,
        answer.offset,
        answer.found,
    )
    return answer.offset


def _persisted_start(options: HAStreamOptions, info: TableInfo) -> int:
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    try:
        return client.getTopicProcessedOffset(options.topic) + 1
    except TopicNotFound:
        log.info("no persisted offset topic=%s: starting at the earliest row", options.topic)
        return info.earliest_offset


def read_rows(
    options: HAStreamOptions, target: pa.Schema, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    """The rows `[start, end)` as RecordBatches of exactly `target`, read from any replica
    (the client fails over and resumes a broken stream). Raises DataLossError when rows of
    the range are no longer retained."""
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    position = start
    while position < end:  # Bounded: every turn advances by a chunk or raises.
        stop = min(end, position + READ_CHUNK_ROWS)
        try:
            rows = _read_chunk(client, options, position, stop)
        except DataLossError as lost:  # retention removed them since the batch was planned
            position = data_lost(options, position, lost.earliest)
            continue
        if rows.num_rows != stop - position:  # The client promises a complete range.
            raise RuntimeError(f"read [{position}, {stop}) returned {rows.num_rows} rows")
        yield from schema.to_spark_batches(rows, target)
        position = stop


def _read_chunk(client: Session, options: HAStreamOptions, start: int, end: int) -> pa.Table:
    # A node that has not applied the table's creation yet answers TableNotFound: the rows
    # were committed, so some node has them; ask again (bounded) before believing it.
    backoff = client.new_backoff(min(options.timeout_s, TABLE_NOT_FOUND_RETRY_S))
    while True:  # Bounded by `backoff`.
        try:
            return client.read(options.table, start, end, includeMetadata=options.include_metadata)
        except OffsetOutOfRange as error:
            if start < error.earliest:
                raise DataLossError(options.table, start, error.earliest) from error
            raise
        except TableNotFound:
            if not backoff.wait():
                raise
            client.getTableInfo(options.table)  # Asks every site; learns the table's group.


def _partitions(options: HAStreamOptions, start: int, end: int) -> list[RangePartition]:
    return [
        RangePartition(low, high) for low, high in split_range(start, end, options.num_partitions)
    ]


# --- batch read -----------------------------------------------------------------------------


class HAStreamReader(DataSourceReader):
    """`spark.read.format("hastream")`: the rows `[startingOffsets, endingOffsets)`, by
    default every retained row up to the row count when the read is planned."""

    def __init__(self, options: HAStreamOptions, schema_: StructType) -> None:
        self._options = options
        self._target = schema.read_target(schema_)

    def partitions(self) -> Sequence[InputPartition]:
        options = self._options
        info = table_info(options, fresh=True)
        start = resolve_start(options, info, default=Position.EARLIEST)
        if options.ending_timestamp is not None:  # the rows stamped before it (Kafka's rank)
            end = offset_for_time(options, options.ending_timestamp).offset
        elif options.ending_offsets is Position.LATEST:
            end = info.row_count
        else:
            assert isinstance(options.ending_offsets, int)
            end = options.ending_offsets
            if end > info.row_count:
                raise OptionError(
                    "endingOffsets", str(end), f"beyond the table's row count {info.row_count}"
                )
        if end < start:
            raise OptionError(
                "endingOffsets", str(options.ending_offsets), f"before the start offset {start}"
            )
        return _partitions(options, start, end) or [RangePartition(start, start)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition), type(partition)
        yield from read_rows(self._options, self._target, partition.start, partition.end)


# --- streaming read -------------------------------------------------------------------------


class HAStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("hastream")`. See the module docstring for where each
    method runs. `__init__` does no I/O: it also runs in the planner before pickling."""

    def __init__(self, options: HAStreamOptions, schema_: StructType) -> None:
        self._options = options
        self._target = schema.read_target(schema_)
        self._initial: int | None = None  # initialOffset is called twice: answer the same.
        self._available_now_end: int | None = None
        self._row_count_seen: int | None = None
        self._committed: int | None = None
        self._last_batch_at: float | None = None  # minRowsPerTrigger's clock (monotonic)

    def initialOffset(self) -> dict[str, int]:
        if self._initial is None:
            info = table_info(self._options, fresh=True)
            self._initial = resolve_start(self._options, info, default=Position.LATEST)
            log.info("initial offset topic=%s offset=%d", self._options.topic, self._initial)
        return offset_dict(self._options.table, self._initial)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self._options.min_rows_per_trigger is not None:
            # Spark has no composite limit for Python sources: the maximum, if any, comes
            # from the options in latestOffset.
            return ReadMinRows(self._options.min_rows_per_trigger)
        if self._options.max_rows_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self._options.max_rows_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._available_now_end = table_info(self._options, fresh=True).row_count
        log.info(
            "availableNow target table=%s end=%d", self._options.table, self._available_now_end
        )

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        begin = offset_number(start, self._options.table)
        try:
            info = table_info(self._options)
        except RaftStoreError as error:
            if not error.retryable:
                raise
            # An exception here would kill the query; an election or an outage is not a
            # reason to. "No new data" keeps it alive until the cluster answers again.
            log.warning("latestOffset: cluster unavailable, no new data: %s", error)
            return offset_dict(self._options.table, begin)
        if begin < info.earliest_offset:  # raises, or the batch's read skips the lost rows
            data_lost(self._options, begin, info.earliest_offset)
        self._row_count_seen = info.row_count
        # A lagging follower may answer a row count below `begin`: no new data then.
        end = max(begin, info.row_count)
        if isinstance(limit, ReadMaxRows):
            end = min(end, begin + limit.max_rows)
        if isinstance(limit, ReadMinRows):  # our default: the options' maximum applies too
            if self._options.max_rows_per_trigger is not None:
                end = min(end, begin + self._options.max_rows_per_trigger)
            end = self._wait_for_rows(begin, end, limit.min_rows)
        if self._available_now_end is not None:
            end = min(end, max(begin, self._available_now_end))
        return offset_dict(self._options.table, end)

    def _wait_for_rows(self, begin: int, end: int, min_rows: int) -> int:
        """Kafka's minOffsetsPerTrigger: no micro-batch (`begin`) while fewer than `min_rows`
        rows wait, until maxTriggerDelay has passed since the last batch (or the query's
        start); then the rows there are."""
        now = time.monotonic()
        if self._last_batch_at is None:
            self._last_batch_at = now
        waited_s = now - self._last_batch_at
        if end - begin < min_rows and waited_s < self._options.max_trigger_delay_s:
            return begin
        if end > begin:
            self._last_batch_at = now
        return end

    def reportLatestOffset(self) -> dict[str, int] | None:
        if self._row_count_seen is None:
            return None
        return offset_dict(self._options.table, self._row_count_seen)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return _partitions(
            self._options,
            offset_number(start, self._options.table),
            offset_number(end, self._options.table),
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition), type(partition)
        yield from read_rows(self._options, self._target, partition.start, partition.end)

    def commit(self, end: dict[str, Any]) -> None:
        """Persists `end - 1`, the last row of the committed micro-batch. Best effort: a
        failure is logged, not raised (it would kill the query, and the checkpoint, not this
        offset, is what a restart resumes from)."""
        last = offset_number(end, self._options.table) - 1
        if last < 0 or last == self._committed:
            return
        try:
            if self._committed is None:
                # Route CommitOffset straight to the leader (after a restart from a
                # checkpoint, initialOffset, which learns it, is never called).
                table_info(self._options, fresh=True)
            commit_offset(self._options, last, min(PLANNING_TIMEOUT_S, self._options.timeout_s))
        except RaftStoreError as error:
            log.warning(
                "commit: offset %d of %s not persisted: %s", last, self._options.topic, error
            )
            return
        self._committed = last

    def stop(self) -> None:
        log.info("stream reader stopped topic=%s", self._options.topic)
