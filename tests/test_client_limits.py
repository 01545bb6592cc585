"""Every bound the client declares is enforced before anything is sent, with a typed error
(the wire's bounds in hastream/wire.py, and the client's own). No network: the sessions
here are never dialled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import MultithreadedTableWriter, Publisher, Session, batches
from api_clients.admin import create_table_request
from api_clients.buffer import DurableBuffer, MemoryBuffer
from api_clients.connection import SITES_MAX
from api_clients.subscriber import BATCH_SIZE_MAX, Subscription
from api_clients.writer import THREADS_MAX
from hastream import wire
from hastream.errors import BatchTooLarge, InvalidArgument, RaftStoreError

pytestmark = pytest.mark.unit

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.fixture
def session() -> Session:
    return Session(["127.0.0.1:1"])  # never dialled


def create(table: str = "t", schema: pa.Schema = SCHEMA) -> object:
    return create_table_request(
        raft_group=2,
        schema=schema,
        table=table,
        cache_limit=10,
        key_column=None,
        retention_minutes=60,
    )


def subscribe(session: Session, **kwargs: object) -> Callable[[], object]:
    return lambda: Subscription(session, "t", lambda *_: None, **kwargs)  # type: ignore[arg-type]


def test_a_table_name_the_nodes_would_refuse_is_refused_locally() -> None:
    create("ticks_2")
    for bad in ["", "2ticks", "ti-cks", "a" * (wire.TABLE_NAME_BYTES_MAX + 1)]:
        with pytest.raises(InvalidArgument, match="tableName"):
            create(bad)


def test_a_schema_with_too_many_columns_is_refused_locally() -> None:
    wide = pa.schema([(f"c{i}", pa.int8()) for i in range(wire.COLUMNS_MAX + 1)])
    with pytest.raises(InvalidArgument, match="columns"):
        create(schema=wide)
    with pytest.raises(InvalidArgument, match="columns"):
        create(schema=pa.schema([]))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"action_name": ""}, "actionName"),
        ({"action_name": "a" * (wire.ACTION_NAME_BYTES_MAX + 1)}, "actionName"),
        ({"batch_size": BATCH_SIZE_MAX + 1}, "batchSize"),
        ({"batch_rows": wire.SUBSCRIBE_BATCH_ROWS_MAX + 1}, "batch_rows"),
        ({"offset": -4}, "offset"),
        ({"throttle_s": -1.0}, "throttle"),
        ({"reconnect_deadline_s": 0.0}, "reconnect_deadline_s"),
    ],
)
def test_subscription_bounds(session: Session, kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        subscribe(session, **kwargs)()
    assert raised.value.argument == argument


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"producer_id": b"short"}, "producer_id"),
        ({"first_sequence": 0}, "first_sequence"),
        ({"batch_bytes_max": wire.BATCH_BYTES_MAX + 1}, "batch_bytes_max"),
        ({"max_in_flight": wire.PIPELINE_IN_FLIGHT_MAX + 1}, "max_in_flight"),
        ({"deadline_s": 0.0}, "deadline_s"),
    ],
)
def test_publisher_bounds(session: Session, kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        Publisher(session, "t", **kwargs)  # type: ignore[arg-type]
    assert raised.value.argument == argument


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"batchSize": wire.BATCH_ROWS_MAX + 1}, "batchSize"),
        ({"batchBytesMax": wire.BATCH_BYTES_MAX + 1}, "batchBytesMax"),
        ({"threadCount": THREADS_MAX + 1}, "threadCount"),
        ({"throttle": 0.0}, "throttle"),
        ({"insertTimeout": -1.0}, "insertTimeout"),
    ],
)
def test_writer_bounds(session: Session, kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        MultithreadedTableWriter(session, "t", durableBufferDir=None, schema=SCHEMA, **kwargs)  # type: ignore[arg-type]
    assert raised.value.argument == argument


def test_session_bounds() -> None:
    with pytest.raises(InvalidArgument, match="sites"):
        Session([f"h{i}:1" for i in range(SITES_MAX + 1)])
    with pytest.raises(InvalidArgument, match="backoff"):
        Session(["h:1"], backoff_initial_s=0.5, backoff_max_s=0.1)
    with pytest.raises(InvalidArgument, match="deadline"):
        Session(["h:1"], deadline_s=0.0)


def test_encoding_bounds() -> None:
    table = pa.table({"id": [1, 2]}, schema=SCHEMA)
    with pytest.raises(InvalidArgument, match="rows_max"):
        batches.encode_chunks(table, rows_max=wire.BATCH_ROWS_MAX + 1)
    with pytest.raises(InvalidArgument, match="bytes_max"):
        batches.encode_chunks(table, bytes_max=wire.BATCH_BYTES_MAX + 1)
    assert [chunk.row_count for chunk in batches.encode_chunks(table, rows_max=1)] == [1, 1]


@pytest.mark.parametrize(
    ("payload_bytes", "rows", "error"),
    [
        (wire.BATCH_BYTES_MAX + 1, 1, BatchTooLarge),
        (10, wire.BATCH_ROWS_MAX + 1, BatchTooLarge),
        (10, 0, InvalidArgument),
        (0, 1, InvalidArgument),
    ],
)
def test_a_buffer_takes_only_records_one_request_can_carry(
    tmp_path: Path, payload_bytes: int, rows: int, error: type[RaftStoreError]
) -> None:
    payload = b"x" * payload_bytes
    with DurableBuffer(tmp_path / "buffer", table="t") as durable, pytest.raises(error):
        durable.append(payload, rows)
    with pytest.raises(error):
        MemoryBuffer(bytes_max=1 << 30).append(payload, rows)
