"""The hastream data source's pure parts: options, ranges, producer ids, Arrow conversion.
No SparkSession, no cluster."""

from __future__ import annotations

import itertools
import pickle

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from api_clients import SchemaMismatch
from spark_publisher import clients, schema
from spark_publisher.options import (
    PARTITION_ROWS_MIN,
    OptionError,
    Position,
    TimestampStrategy,
    parse,
    split_range,
)
from spark_publisher.source import RangePartition

pytestmark = pytest.mark.unit

SITES = "127.0.0.1:8901,127.0.0.1:8902:node2"


def test_options_parse_kafka_style_names_in_any_case() -> None:
    options = parse(
        {
            "sites": SITES,
            "table": "t",
            "STARTINGOFFSETS": "Persisted",
            "endingoffsets": "500",
            "maxRowsPerTrigger": "1000",
            "batchRows": "50000",
            "numPartitions": "4",
            "timeoutSec": "12.5",
        }
    )
    assert options.sites == ("127.0.0.1:8901", "127.0.0.1:8902:node2")
    assert options.action == "spark"
    assert options.topic == "t/spark"
    assert options.starting_offsets is Position.PERSISTED
    assert options.ending_offsets == 500
    assert (options.max_rows_per_trigger, options.batch_rows, options.num_partitions) == (
        1000,
        50000,
        4,
    )
    assert options.timeout_s == 12.5
    assert pickle.loads(pickle.dumps(options)) == options


def test_kafka_connector_names_are_accepted_where_they_mean_the_same() -> None:
    options = parse(
        {
            "kafka.bootstrap.servers": SITES,
            "subscribe": "t",
            "maxOffsetsPerTrigger": "1000",
            "failOnDataLoss": "true",
        }
    )
    assert (options.sites[0], options.table, options.max_rows_per_trigger) == (
        "127.0.0.1:8901",
        "t",
        1000,
    )
    assert parse({"bootstrap.servers": SITES, "topic": "t", "table": "t"}).table == "t"
    assert parse({"sites": SITES, "table": "t"}).fail_on_data_loss, "Kafka's default"
    assert not parse({"sites": SITES, "table": "t", "failOnDataLoss": "false"}).fail_on_data_loss


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"assign": '{"t": [0]}'}, "no partitions to assign"),
        ({"minPartitions": "4"}, "numPartitions caps"),
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss='maybe': expected true or false"),
        ({"subscribe": "other"}, "contradicts table='t'"),
    ],
)
def test_kafka_options_that_would_change_results_are_refused(
    given: dict[str, str], message: str
) -> None:
    with pytest.raises(OptionError, match=message):
        parse({"sites": SITES, "table": "t", **given})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"table": "t"}, "sites=missing: required"),
        ({"sites": SITES}, "table=missing: required"),
        ({"sites": "host", "table": "t"}, "'host' is not host:port"),
        ({"sites": "h:70000", "table": "t"}, "port outside"),
        ({"sites": SITES, "table": "t", "startingOffsets": "yesterday"}, "expected earliest"),
        ({"sites": SITES, "table": "t", "startingOffsets": "-2"}, "must be >= 0"),
        ({"sites": SITES, "table": "t", "endingOffsets": "earliest"}, "expected latest"),
        ({"sites": SITES, "table": "t", "batchRows": "0"}, r"must be in \[1, 1000000\]"),
        ({"sites": SITES, "table": "t", "maxRowsPerTrigger": "ten"}, "not an integer"),
        ({"sites": SITES, "table": "t", "timeoutSec": "0"}, "must be in"),
        ({"sites": SITES, "table": "t", "action": "a/b"}, "must not contain '/'"),
        ({"sites": SITES, "table": "t", "startingOffset": "0"}, "did you mean startingOffsets"),
    ],
)
def test_bad_options_are_refused_with_the_option_and_value(
    given: dict[str, str], message: str
) -> None:
    with pytest.raises(OptionError, match=message):
        parse(given)


def test_start_and_end_by_timestamp_take_kafkas_forms_and_rank() -> None:
    base = {"sites": SITES, "table": "t"}
    assert parse({**base, "startingTimestamp": "1700000000000"}).starting_timestamp == (
        1_700_000_000_000
    )
    options = parse(
        {
            **base,
            "startingTimestamp": "5",
            "startingOffsetsByTimestamp": '{"t": {"0": 7}}',  # Kafka: this one wins
            "startingOffsetsByTimestampStrategy": "LATEST",
            "endingOffsetsByTimestamp": '{"t": {"0": 9}}',
            "includeMetadata": "true",
        }
    )
    assert (options.starting_timestamp, options.ending_timestamp) == (7, 9)
    assert options.timestamp_strategy is TimestampStrategy.LATEST
    assert options.include_metadata
    defaults = parse(base)
    assert (defaults.starting_timestamp, defaults.include_metadata) == (None, False)
    assert defaults.timestamp_strategy is TimestampStrategy.ERROR


def test_min_rows_per_trigger_takes_kafkas_names_and_durations() -> None:
    base = {"sites": SITES, "table": "t"}
    options = parse({**base, "minOffsetsPerTrigger": "500", "maxTriggerDelay": "1.5s"})
    assert (options.min_rows_per_trigger, options.max_trigger_delay_s) == (500, 1.5)
    assert parse({**base, "maxTriggerDelay": "250ms"}).max_trigger_delay_s == 0.25
    assert parse(base).max_trigger_delay_s == 15 * 60.0, "Kafka's default"
    for bad, message in [
        ({"maxTriggerDelay": "soon"}, "expected a duration"),
        ({"maxTriggerDelay": "0s"}, "must be > 0"),
        ({"minRowsPerTrigger": "10", "maxRowsPerTrigger": "5"}, "above maxRowsPerTrigger=5"),
    ]:
        with pytest.raises(OptionError, match=message):
            parse({**base, **bad})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"startingTimestamp": "yesterday"}, "startingTimestamp=.*ms since the epoch"),
        ({"endingTimestamp": "-1"}, "must be >= 0"),
        ({"startingOffsetsByTimestamp": "{"}, "not JSON"),
        ({"startingOffsetsByTimestamp": '{"other": {"0": 1}}'}, 'expected {"t"'),
        ({"startingOffsetsByTimestamp": '{"t": {"1": 1}}'}, "one partition, 0"),
        ({"startingOffsetsByTimestampStrategy": "skip"}, "expected error or latest"),
        ({"includeMetadata": "yes"}, "expected true or false"),
    ],
)
def test_bad_timestamp_options_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        parse({"sites": SITES, "table": "t", **given})


def test_unknown_options_far_from_known_ones_are_ignored() -> None:
    options = parse({"sites": SITES, "table": "t", "checkpointLocation": "/x", "foo": "1"})
    assert options.table == "t"


def test_split_range_covers_the_range_contiguously() -> None:
    assert split_range(5, 5, 4) == []
    assert split_range(0, 10, 4) == [(0, 10)]  # Below PARTITION_ROWS_MIN: one partition.
    rows = 10 * PARTITION_ROWS_MIN + 3
    ranges = split_range(100, 100 + rows, 4)
    assert len(ranges) == 4
    assert ranges[0][0] == 100
    assert ranges[-1][1] == 100 + rows
    assert all(left[1] == right[0] for left, right in itertools.pairwise(ranges))
    assert max(high - low for low, high in ranges) - min(high - low for low, high in ranges) <= 1


def test_range_partition_pickles_small() -> None:
    partition = pickle.loads(pickle.dumps(RangePartition(10, 20)))
    assert (partition.start, partition.end) == (10, 20)


def test_producer_ids_are_deterministic_and_distinct_per_token() -> None:
    first = clients.producer_id("stream", "t", "query", "7", 0)
    assert first == clients.producer_id("stream", "t", "query", "7", 0)
    assert len(first) == 16
    assert first != clients.producer_id("stream", "t", "query", "7", 1)
    assert first != clients.producer_id("stream", "t", "query", "8", 0)
    assert first != clients.producer_id("stream", "u", "query", "7", 0)


TABLE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        ("qty", pa.int32()),
        ("ts", pa.timestamp("ms")),
        ("day", pa.date32()),
        ("sym", pa.string()),
    ]
)


def test_spark_schema_shows_naive_timestamps_as_utc_instants() -> None:
    spark_schema = schema.spark_schema("t", TABLE_SCHEMA)
    assert spark_schema == StructType(
        [
            StructField("id", LongType(), False),
            StructField("qty", IntegerType(), True),
            StructField("ts", TimestampType(), True),
            StructField("day", DateType(), True),
            StructField("sym", StringType(), True),
        ]
    )


def test_read_batches_equal_sparks_arrow_schema_exactly() -> None:
    rows = pa.table(
        {
            "id": [1, 2],
            "qty": pa.array([3, 4], pa.int32()),
            "ts": pa.array([1_700_000_000_123, 1_700_000_000_456], pa.timestamp("ms")),
            "day": pa.array([19000, 19001], pa.date32()),
            "sym": ["a", "b"],
        },
        schema=TABLE_SCHEMA,
    )
    target = schema.read_target(schema.spark_schema("t", TABLE_SCHEMA))
    batches = list(schema.to_spark_batches(rows, target))
    assert all(batch.schema.equals(target) for batch in batches)
    assert target.field("ts").type == pa.timestamp("us", tz="UTC")
    ts = pa.Table.from_batches(batches).column("ts").cast(pa.int64()).to_pylist()
    assert ts == [1_700_000_000_123_000, 1_700_000_000_456_000]


def test_written_batches_are_picked_by_name_and_cast_to_the_table_schema() -> None:
    incoming = pa.record_batch(
        {
            "sym": ["a"],
            "ts": pa.array([1_700_000_000_123_999], pa.timestamp("us", tz="UTC")),
            "day": pa.array([19000], pa.date32()),
            "qty": pa.array([7], pa.int32()),
            "id": pa.array([1], pa.int64()),
        }
    )
    rows = schema.to_table_rows("t", TABLE_SCHEMA, [incoming])
    assert rows.schema.equals(TABLE_SCHEMA)
    assert rows.column("ts").cast(pa.int64()).to_pylist() == [1_700_000_000_123]


def test_written_values_that_do_not_fit_are_refused() -> None:
    wide_qty = pa.record_batch(
        {
            "id": pa.array([1], pa.int64()),
            "qty": pa.array([2**40], pa.int64()),
            "ts": pa.array([0], pa.timestamp("us", tz="UTC")),
            "day": pa.array([0], pa.date32()),
            "sym": ["a"],
        }
    )
    with pytest.raises(SchemaMismatch, match="column 'qty'"):
        schema.to_table_rows("t", TABLE_SCHEMA, [wide_qty])
    null_id = wide_qty.set_column(0, "id", pa.array([None], pa.int64())).set_column(
        1, "qty", pa.array([1], pa.int32())
    )
    with pytest.raises(SchemaMismatch, match="'id' is not nullable"):
        schema.to_table_rows("t", TABLE_SCHEMA, [null_id])


def test_check_writable_names_missing_and_extra_columns() -> None:
    frame_schema = StructType([StructField("id", LongType()), StructField("price", DoubleType())])
    with pytest.raises(SchemaMismatch, match=r"missing \['qty', 'ts', 'day', 'sym'\], extra"):
        schema.check_writable("t", TABLE_SCHEMA, frame_schema)
