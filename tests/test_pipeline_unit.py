"""Pipelined publishing without a cluster: the SequenceGap error on the wire, the client's
refusals before any network call, the window's byte bound (against a fake StreamOpener)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api_clients import (
    PipelineClosed,
    PublishAborted,
    Publisher,
    PublishPipeline,
    Session,
    batches,
    coalescer,
    row_path,
)
from api_clients.retry import Backoff
from api_clients.transport import Stream
from hastream import errors, wire
from hastream.errors import InvalidArgument, SequenceGap

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.mark.unit
def test_sequence_gap_round_trips_the_wire_with_its_fields() -> None:
    error = SequenceGap("ab" * 16, 7, 9)
    rebuilt = errors.from_wire(dict(errors.to_wire(error)))
    assert isinstance(rebuilt, SequenceGap)
    assert (rebuilt.producer, rebuilt.expected, rebuilt.got) == ("ab" * 16, 7, 9)
    assert str(rebuilt) == str(error)
    assert not rebuilt.retryable
    assert rebuilt.grpc_code == "FAILED_PRECONDITION"


@pytest.fixture
def session() -> Session:
    return Session(["127.0.0.1:1"])  # never dialled: everything here fails before


@pytest.mark.unit
def test_pipelining_is_refused_with_a_durable_buffer(session: Session, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="durable buffer"):
        Publisher(session, "t", durable_buffer_dir=tmp_path / "a", max_in_flight=8)
    publisher = Publisher(session, "t", durable_buffer_dir=tmp_path / "b", schema=SCHEMA)
    try:
        with pytest.raises(InvalidArgument, match="durable buffer"):
            publisher.append_async(pa.table({"id": [1]}, schema=SCHEMA))
    finally:
        publisher.close()


@pytest.mark.unit
@pytest.mark.parametrize("window", [0, wire.PIPELINE_IN_FLIGHT_MAX + 1])
def test_window_outside_the_servers_bound_is_refused(session: Session, window: int) -> None:
    with pytest.raises(InvalidArgument, match="max_in_flight"):
        PublishPipeline(session, "t", max_in_flight=window)
    with pytest.raises(InvalidArgument, match="max_in_flight"):
        Publisher(session, "t", max_in_flight=window)


@pytest.mark.unit
def test_a_request_over_the_wire_bounds_is_refused_before_it_is_queued(
    session: Session,
) -> None:
    pipeline = PublishPipeline(session, "t")
    with pytest.raises(errors.BatchTooLarge):
        pipeline.submit(b"x" * (wire.BATCH_BYTES_MAX + 1), 1)
    with pytest.raises(InvalidArgument, match="row_count"):
        pipeline.submit(b"x", 0)
    assert pipeline.in_flight() == 0


class SilentNode:
    """A StreamOpener whose PublishStream never answers until `release` is set; then the
    stream ends. Everything else the pipeline asks of a session, answered locally."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sites = ["a:1"]
        self.deadline_s = 5.0

    def new_backoff(self, deadline_s: float | None = None, *, sleep: Any = None) -> Backoff:
        return Backoff(0.01, 0.01, self.deadline_s if deadline_s is None else deadline_s)

    def route(self, *, table: str | None = None, group: int | None = None) -> str:
        return "a:1"

    def next_site(self, site: str) -> str:
        return "a:1"

    def redirect_target(self, error: object, site: str) -> None:
        return None

    def remember_leader(self, site: str, *, table: str | None, group: int | None) -> None:
        pass

    def forget_leader(self, site: str, *, table: str | None, group: int | None) -> None:
        pass

    def leader_watch(self, site: str, **_: Any) -> None:
        return None  # no other site to ask

    def open_stream(self, site: str, method_name: str, request: Any, **_: Any) -> Stream:
        release = self.release

        class Call:
            def __iter__(self) -> Iterator[Any]:
                release.wait(timeout=30.0)
                return iter(())

            def cancel(self) -> None:
                release.set()

        return Stream(Call(), site, None)


@pytest.mark.unit
def test_the_window_also_holds_at_the_servers_in_flight_bytes() -> None:
    node = SilentNode()
    pipeline = PublishPipeline(node, "t", max_in_flight=wire.PIPELINE_IN_FLIGHT_MAX)  # type: ignore[arg-type]
    payload = b"x" * wire.BATCH_BYTES_MAX
    fitting = wire.PIPELINE_IN_FLIGHT_BYTES_MAX // wire.BATCH_BYTES_MAX
    futures = [pipeline.submit(payload, 1) for _ in range(fitting)]
    outcome: list[object] = []

    def submit_one_more() -> None:
        try:
            outcome.append(pipeline.submit(payload, 1))
        except InvalidArgument as error:  # the pipeline closed while it waited
            outcome.append(error)

    blocked = threading.Thread(target=submit_one_more, daemon=True)
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive(), "one request past the byte window must wait"
    assert pipeline.in_flight() == fitting
    node.release.set()
    pipeline.close(timeout_s=0.0)
    blocked.join(timeout=10.0)
    assert not blocked.is_alive()
    assert isinstance(outcome[0], InvalidArgument)
    assert isinstance(futures[0].exception(timeout=10.0), PipelineClosed)
    assert isinstance(futures[-1].exception(timeout=10.0), PublishAborted)


@pytest.mark.unit
def test_bad_rows_are_refused_by_append_async_before_anything_is_queued(
    session: Session,
) -> None:
    publisher = Publisher(session, "t", schema=SCHEMA)
    with pytest.raises(errors.SchemaMismatch):
        publisher.append_async(pa.table({"id": pa.array([1], pa.int32())}))
    with pytest.raises(errors.EmptyBatch):
        publisher.append_async(SCHEMA.empty_table())
    assert publisher.pipeline_stats() is None


@pytest.mark.unit
def test_requests_after_a_give_up_get_a_retry_budget_of_their_own() -> None:
    """A pipeline that gave up on a dead site fails the next request only after its own
    budget: a spent budget kept across the give-up failed every later request at once,
    thousands a second."""
    deadline_s = 0.5
    session = Session(["127.0.0.1:1"], deadline_s=deadline_s)  # nothing listens there
    pipeline = PublishPipeline(session, "t", max_in_flight=2)
    try:
        pipeline.submit(b"x", 1).exception(timeout=10.0)
        started = time.monotonic()
        assert pipeline.submit(b"y", 1).exception(timeout=10.0) is not None
        assert time.monotonic() - started >= deadline_s / 2
    finally:
        pipeline.close(timeout_s=0.0)
        session.close()


@pytest.mark.unit
@given(
    appends=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    cuts=st.lists(st.integers(1, 60), min_size=1, max_size=30),
)
def test_each_merged_append_maps_to_its_own_rows_of_the_requests(
    appends: list[int], cuts: list[int]
) -> None:
    """The coalescer's map from an append's rows to the requests (chunks) they were sent in:
    every row of every append lands in exactly one chunk, at its own position."""
    total = sum(appends)
    chunk_starts = sorted({0} | {sum(cuts[: i + 1]) for i in range(len(cuts))} - {total})
    chunk_starts = [start for start in chunk_starts if start < total]
    first = 0
    for count in appends:
        covered = [
            chunk_starts[segment.chunk] + segment.start + row
            for segment in coalescer._segments(first, count, chunk_starts)
            for row in range(segment.count)
        ]
        assert covered == list(range(first, first + count))
        first += count


ROW_SCHEMA = pa.schema(
    [
        ("i", pa.int32()),
        ("u", pa.uint8()),
        ("f", pa.float64()),
        ("s", pa.string()),
        ("b", pa.bool_()),
        pa.field("n", pa.int64(), nullable=False),
    ]
)
_VALUES = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.binary(max_size=3),
)


_VALID = (
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 255),
    st.floats(allow_nan=False) | st.integers(-(2**53), 2**53),
    st.text(max_size=5),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
)
# Rows of valid values (nulls where the column allows them), and rows of anything.
_VALID_ROW = st.tuples(*[valid | st.none() for valid in _VALID[:-1]], _VALID[-1])
_ANY_ROW = st.tuples(*[st.one_of(valid, _VALUES) for valid in _VALID])


@pytest.mark.unit
@given(rows=st.lists(_VALID_ROW, min_size=1, max_size=16) | st.lists(_ANY_ROW, max_size=20))
def test_the_quick_row_path_accepts_only_rows_the_general_path_converts_the_same(
    rows: list[tuple[object, ...]],
) -> None:
    """Rows the quick checks vouch for convert, in bulk, to exactly what the general path
    gives; every other input is left to the general path (None)."""
    checks = row_path.checks_for(ROW_SCHEMA)
    assert checks is not None
    quick = row_path.quick_rows(rows, checks)
    if quick is None:
        return
    assert 0 < len(rows) <= row_path.ROWS_MAX
    expected = batches.to_table(rows, ROW_SCHEMA, "t")
    assert row_path.rows_table(quick, ROW_SCHEMA).equals(expected)
    # The payload packed without pyarrow (row_ipc.py) is pyarrow's, byte for byte.
    payload = row_path.rows_payload(quick, ROW_SCHEMA)
    assert payload == batches.encode_batch(row_path.rows_batch(quick, ROW_SCHEMA), ROW_SCHEMA)


# Every type with a quick check, field and schema metadata, a non-nullable column.
WIDE_SCHEMA = pa.schema(
    [
        pa.field("i8", pa.int8(), metadata={b"unit": b"count"}),
        ("u64", pa.uint64()),
        ("f32", pa.float32()),
        ("s", pa.large_string()),
        ("raw", pa.binary()),
        ("at", pa.timestamp("ms")),
        pa.field("id", pa.int64(), nullable=False),
    ],
    metadata={b"table": b"wide"},
)
_WIDE_ROW = st.tuples(
    st.integers(-128, 127) | st.none(),
    st.integers(0, 2**64 - 1) | st.none(),
    st.floats(allow_nan=False, width=32) | st.none(),
    st.text(max_size=8) | st.none(),
    st.binary(max_size=8) | st.none(),
    st.datetimes(timezones=st.none()) | st.none(),
    st.integers(-(2**63), 2**63 - 1),
)


def _stream_writer_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


@pytest.mark.unit
@given(rows=st.lists(_WIDE_ROW, min_size=1, max_size=16), as_lists=st.booleans())
def test_quick_rows_encode_byte_for_byte_as_the_general_path(
    rows: list[tuple[object, ...]], as_lists: bool
) -> None:
    """The struct conversion of quick rows (tuples or lists) gives the general path's
    table, schema metadata included, and the same request payload, which is what
    pyarrow's stream writer writes."""
    data: list[Any] = [list(row) for row in rows] if as_lists else rows
    checks = row_path.checks_for(WIDE_SCHEMA)
    assert checks is not None
    quick = row_path.quick_rows(data, checks)
    assert quick is not None
    expected = batches.to_table(data, WIDE_SCHEMA, "t")
    table = row_path.rows_table(quick, WIDE_SCHEMA)
    assert table.schema.equals(WIDE_SCHEMA, check_metadata=True)
    assert table.equals(expected)
    payload = batches.encode(table)
    assert payload == batches.encode(expected) == _stream_writer_bytes(expected)
    # What a waited append of quick rows sends: the batch alone, under the schema's message.
    assert batches.encode_batch(row_path.rows_batch(quick, WIDE_SCHEMA), WIDE_SCHEMA) == payload
    # And what it sends, packed without pyarrow (row_ipc.py): the same bytes.
    assert row_path.rows_payload(quick, WIDE_SCHEMA) == payload


@pytest.mark.unit
def test_encode_writes_what_the_stream_writer_writes() -> None:
    """batches.encode builds the stream from the schema's and each batch's messages; the
    bytes are the stream writer's for slices, several chunks, no rows, metadata, and the
    types it leaves to the writer (dictionaries, nested)."""
    base = pa.table(
        {"id": pa.array(range(100), pa.int64()), "s": pa.array([f"r{n}" for n in range(100)])}
    )
    with_metadata = base.replace_schema_metadata({b"k": b"v"})
    cases = {
        "plain": base,
        "a slice": base.slice(7, 30),
        "two chunks": pa.concat_tables([base.slice(0, 10), base.slice(50, 5)]),
        "many chunks": pa.concat_tables([base.slice(start, 3) for start in range(0, 30, 3)]),
        "no rows": base.slice(0, 0),
        "metadata": with_metadata,
        "the same schema but its metadata": base,  # not the cached message of the one above
        "dictionary": pa.table({"d": pa.array(["a", "b", "a"]).dictionary_encode()}),
        "nested": pa.table({"l": pa.array([[1, 2], [], None])}),
    }
    for name, table in cases.items():
        assert batches.encode(table) == _stream_writer_bytes(table), name
        assert pa.ipc.open_stream(batches.encode(table)).read_all().equals(table), name
        if name in ("dictionary", "nested"):  # left to the writer: no batch encoding
            assert batches.encode_batch(table.to_batches()[0], table.schema) is None, name


@pytest.mark.unit
def test_the_quick_row_path_refuses_what_it_cannot_vouch_for() -> None:
    checks = row_path.checks_for(ROW_SCHEMA)
    assert checks is not None
    good = (1, 2, 0.5, "x", True, 7)
    assert row_path.quick_rows([good], checks) == [good]
    for bad in (
        (True, 2, 0.5, "x", True, 7),  # a bool is not an int here
        (2**31, 2, 0.5, "x", True, 7),  # out of int32's range
        (1, -1, 0.5, "x", True, 7),  # out of uint8's range
        (1, 2, 0.5, b"x", True, 7),  # bytes for a string
        (1, 2, 0.5, "x", True, None),  # null in a non-nullable column
        (1, 2, 0.5, "x"),  # short
    ):
        assert row_path.quick_rows([bad], checks) is None, bad
    assert row_path.quick_rows((good,), checks) is None, "a tuple of rows: the general path"
    assert row_path.quick_rows([good] * (row_path.ROWS_MAX + 1), checks) is None
    assert row_path.checks_for(pa.schema([("d", pa.decimal128(5, 2))])) is None
