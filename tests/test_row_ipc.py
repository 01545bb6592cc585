"""row_ipc.py: quick rows packed with struct into pyarrow's own record batch bytes."""

from __future__ import annotations

import datetime
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api_clients import batches, row_path
from api_clients.row_ipc import RowMessages
from hastream.errors import SchemaMismatch

pytestmark = pytest.mark.unit

_INTS = {
    pa.int8(): 8,
    pa.int16(): 16,
    pa.int32(): 32,
    pa.int64(): 64,
}
_UINTS = {pa.uint8(): 8, pa.uint16(): 16, pa.uint32(): 32, pa.uint64(): 64}
_TIMESTAMP_UNITS = ("s", "ms", "us", "ns")

# Every type the quick checks accept, each nullable and not.
ALL_TYPES = pa.schema(
    [
        *[pa.field(f"i{bits}", kind) for kind, bits in _INTS.items()],
        *[pa.field(f"u{bits}", kind, nullable=False) for kind, bits in _UINTS.items()],
        pa.field("f32", pa.float32()),
        pa.field("f64", pa.float64(), nullable=False),
        pa.field("s", pa.string()),
        pa.field("ls", pa.large_string(), nullable=False),
        pa.field("b", pa.binary()),
        pa.field("lb", pa.large_binary()),
        pa.field("flag", pa.bool_()),
        pa.field("flag_required", pa.bool_(), nullable=False),
        *[pa.field(f"at_{unit}", pa.timestamp(unit)) for unit in _TIMESTAMP_UNITS],
    ]
)


def _value(field: pa.Field) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INTS:
        bits = _INTS[kind]
        values: st.SearchStrategy[Any] = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    elif kind in _UINTS:
        values = st.integers(0, 2 ** _UINTS[kind] - 1)
    elif kind == pa.float32():
        values = st.floats(width=32) | st.integers(-(2**24), 2**24)
    elif kind == pa.float64():
        values = st.floats() | st.integers(-(2**53), 2**53)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        values = st.text(max_size=12)
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        values = st.binary(max_size=12)
    elif pa.types.is_boolean(kind):
        values = st.booleans()
    else:  # a timestamp: ns holds the years 1678-2261
        low, high = (
            (datetime.datetime(1678, 1, 1), datetime.datetime(2261, 12, 31))
            if kind.unit == "ns"
            else (datetime.datetime.min, datetime.datetime.max)
        )
        values = st.datetimes(min_value=low, max_value=high, timezones=st.none())
    return values | st.none() if field.nullable else values


_ROW = st.tuples(*[_value(field) for field in ALL_TYPES])


def _pyarrow(rows: list[Any], schema: pa.Schema) -> bytes:
    return bytes(row_path.rows_batch(rows, schema).serialize().to_pybytes())


@given(rows=st.lists(_ROW, min_size=1, max_size=row_path.ROWS_MAX), as_lists=st.booleans())
def test_rows_of_every_quick_type_pack_to_pyarrows_bytes(
    rows: list[tuple[Any, ...]], as_lists: bool
) -> None:
    """NaN, infinities, empty and multi-byte strings, nulls anywhere, timestamps before
    1970 and at the ends of their range, row tuples or lists: the packed message is the
    one pyarrow serializes, and the request payload the one encode_batch makes."""
    data: list[Any] = [list(row) for row in rows] if as_lists else rows
    checks = row_path.checks_for(ALL_TYPES)
    assert checks is not None
    assert row_path.quick_rows(data, checks) is data
    encoder = RowMessages.for_schema(ALL_TYPES, lambda sample: _pyarrow(list(sample), ALL_TYPES))
    assert encoder is not None
    assert encoder.encode(data) == _pyarrow(data, ALL_TYPES)
    assert row_path.rows_payload(data, ALL_TYPES) == batches.encode_batch(
        row_path.rows_batch(data, ALL_TYPES), ALL_TYPES
    )


@pytest.mark.parametrize(
    "kind",
    [
        pa.decimal128(10, 2),
        pa.dictionary(pa.int32(), pa.string()),
        pa.list_(pa.int32()),
        pa.timestamp("us", tz="UTC"),
        pa.date32(),
        pa.float16(),
    ],
    ids=str,
)
def test_a_type_without_a_packer_leaves_the_schema_to_pyarrow(kind: pa.DataType) -> None:
    schema = pa.schema([("id", pa.int64()), ("x", kind)])
    assert RowMessages.for_schema(schema, lambda rows: _pyarrow(list(rows), schema)) is None
    assert row_path.rows_payload([(1, None)], schema) is None


def test_a_schema_whose_packed_bytes_differ_from_pyarrows_is_not_packed() -> None:
    """The self-check: the encoder is taken only if its bytes are the reference's. The
    reference here is pyarrow's real message of the same rows under a schema whose strings
    have 64-bit offsets: a layout with as many buffers, other bytes."""
    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])
    wide_offsets = pa.schema([("id", pa.int64()), ("name", pa.large_string())])
    assert RowMessages.for_schema(schema, lambda rows: _pyarrow(list(rows), schema)) is not None
    assert RowMessages.for_schema(schema, lambda rows: _pyarrow(list(rows), wide_offsets)) is None


def test_an_int_not_exact_in_float32_takes_the_general_path() -> None:
    """pyarrow refuses an int beyond 2**24 for a float32 column, so the quick checks do
    too: such a row never reaches the packer or the struct conversion, and the general
    path refuses it with a SchemaMismatch. 2**24 itself packs as pyarrow converts it."""
    schema = pa.schema([("id", pa.int64()), ("x", pa.float32())])
    checks = row_path.checks_for(schema)
    assert checks is not None
    assert row_path.quick_rows([(1, 2**24 + 1)], checks) is None
    assert row_path.quick_rows([(1, -(2**24) - 1)], checks) is None
    with pytest.raises(SchemaMismatch):
        batches.to_table([(1, 2**24 + 1)], schema, "t")
    exact = [(1, 2**24)]
    assert row_path.quick_rows(exact, checks) is exact
    assert row_path.rows_payload(exact, schema) == batches.encode_batch(
        row_path.rows_batch(exact, schema), schema
    )


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (pa.float32(), 1e300),  # pyarrow makes it inf; struct refuses
        (pa.string(), "\ud800"),  # not encodable as UTF-8: pyarrow raises its own error
        (pa.timestamp("ns"), datetime.datetime(9999, 1, 1)),  # past int64 nanoseconds
    ],
    ids=["float32-overflow", "surrogate", "ns-overflow"],
)
def test_a_value_the_packer_cannot_match_goes_to_pyarrow(kind: pa.DataType, value: Any) -> None:
    """None from the packer, so the caller converts the rows with pyarrow, whose result
    or error is the one it always gave."""
    schema = pa.schema([("id", pa.int64()), ("x", kind)])
    rows = [(1, value)]
    checks = row_path.checks_for(schema)
    assert checks is not None
    assert row_path.quick_rows(rows, checks) is rows
    assert row_path.rows_payload(rows, schema) is None
    assert row_path.rows_payload([(1, None)], schema) is not None  # the schema itself packs


def test_the_packed_one_row_payload_is_what_the_node_reads() -> None:
    """The bytes a waited one-row append sends read back as the row, under the schema."""
    schema = pa.schema(
        [("id", pa.string()), ("price", pa.float64()), ("at", pa.timestamp("ms"))],
        metadata={b"table": b"ticks"},
    )
    at = datetime.datetime(2026, 12, 2, 17, 30, 0, 250_000)
    payload = row_path.rows_payload([("AAPL", 191.25, at)], schema)
    assert payload is not None
    table = pa.ipc.open_stream(payload).read_all()
    assert table.schema.equals(schema, check_metadata=True)
    assert table.to_pylist() == [{"id": "AAPL", "price": 191.25, "at": at}]
