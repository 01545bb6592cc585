"""Row batches on the client: user data -> an Arrow table with the stream table's exact
schema -> Arrow IPC stream payloads of at most `BATCH_BYTES_MAX` bytes, and back.

Pure functions, no I/O: everything here runs before a publish touches the network, so bad
input is refused with nothing sent. Arrow and pandas input is converted column-wise (no
per-row Python); only a list of row tuples or dicts is walked row by row.
"""

from __future__ import annotations

import datetime
import decimal
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa

from api_clients.admin import schema_to_ipc
from hastream import wire
from hastream.errors import BatchTooLarge, EmptyBatch, InvalidArgument, SchemaMismatch

# Arrow's conversion errors; anything in this tuple means "these values do not fit the schema".
_CONVERSION_ERRORS = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    pa.ArrowNotImplementedError,
    TypeError,
    ValueError,
    OverflowError,
)
# Aim below the byte limit when cutting a large table, so most chunks encode small enough
# at the first try (IPC framing and padding add a little to `Table.nbytes`).
_CHUNK_TARGET_FRACTION = 0.8
_TRUST_BUFFERS_BYTES = 64 * 1024  # see nbytes()
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """One publish request's payload: an Arrow IPC stream of `row_count` rows."""

    payload: bytes
    row_count: int


def to_table(data: object, schema: pa.Schema, table_name: str) -> pa.Table:
    """Converts `data` to a table with exactly `schema` (names, order, types, nullability,
    schema metadata). Raises SchemaMismatch, EmptyBatch, or TypeError for an unsupported type.
    """
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    elif isinstance(data, pd.DataFrame):
        table = _from_pandas(data, schema, table_name)
    elif isinstance(data, list | tuple):
        table = _from_rows(data, schema, table_name)
    else:
        raise TypeError(
            "data must be a pandas DataFrame, a pyarrow Table or RecordBatch, or a list of "
            f"row tuples or dicts; got {type(data).__name__}"
        )
    return conform(table, schema, table_name)


def conform(table: pa.Table, schema: pa.Schema, table_name: str) -> pa.Table:
    """Checks `table` against `schema` and returns it carrying exactly `schema`."""
    if table.num_rows and table.schema.equals(schema, check_metadata=True):
        # The common case, in well under a microsecond (a one-row append is bound by what
        # is done per call): only the nulls are left to check.
        _check_not_null(table, schema, table_name)
        return table
    _check_names(list(table.column_names), schema, table_name)
    for index, field in enumerate(schema):
        actual = table.schema.field(index)
        if not actual.type.equals(field.type):
            raise SchemaMismatch(
                table_name, f"column {field.name!r} has type {actual.type}, expected {field.type}"
            )
        if not field.nullable and table.column(index).null_count > 0:
            raise SchemaMismatch(table_name, f"column {field.name!r} is not nullable")
    if table.num_rows == 0:
        raise EmptyBatch(table_name)
    return pa.Table.from_arrays(table.columns, schema=schema)


def _check_not_null(table: pa.Table, schema: pa.Schema, table_name: str) -> None:
    for index, name in _not_nullable.get(schema):
        if table.column(index).null_count > 0:
            raise SchemaMismatch(table_name, f"column {name!r} is not nullable")


def _not_nullable_fields(schema: pa.Schema) -> tuple[tuple[int, str], ...]:
    # Iterating a schema makes a Field object per column (~0.3 us each): once per schema.
    return tuple((index, field.name) for index, field in enumerate(schema) if not field.nullable)


def _check_names(names: list[str], schema: pa.Schema, table_name: str) -> None:
    if names == schema.names:
        return
    if len(names) != len(schema.names):
        detail = f"{len(names)} columns {names}, expected {len(schema.names)} {schema.names}"
    else:
        detail = f"columns {names}, expected {schema.names}"
    raise SchemaMismatch(table_name, detail)


def _from_pandas(frame: pd.DataFrame, schema: pa.Schema, table_name: str) -> pa.Table:
    """Column by column: no pandas metadata to build, and a conversion error names its
    column. (Measured on 10,000 x 11 columns: 0.36 ms, against 0.6-1.0 ms for
    `Table.from_pandas` with one thread and 2.2 ms with pyarrow's thread pool.)"""
    _check_names([str(name) for name in frame.columns], schema, table_name)
    if len(frame) == 0:
        raise EmptyBatch(table_name)
    arrays = []
    for field, (_, series) in zip(schema, frame.items(), strict=True):
        try:
            arrays.append(_pandas_column(series, field.type))
        except _CONVERSION_ERRORS as error:
            raise SchemaMismatch(
                table_name, f"column {field.name!r}: {_first_line(error)}"
            ) from error
    return pa.Table.from_arrays(arrays, names=schema.names)


def _pandas_column(series: pd.Series, arrow_type: pa.DataType) -> pa.Array:
    """One pandas column as `arrow_type`, with pandas' null conventions (NaN, None, NaT are
    nulls) and safe casts (no overflow, no truncation)."""
    dtype = series.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "biufM":
        # Plain numpy storage: skip the Series wrapper (timezone-aware columns are not
        # numpy dtypes and take the general path below).
        return pa.array(series.to_numpy(copy=False), type=arrow_type, from_pandas=True)
    return pa.array(series, type=arrow_type, from_pandas=True)


def _from_rows(rows: Sequence[Any], schema: pa.Schema, table_name: str) -> pa.Table:
    if not rows:
        raise EmptyBatch(table_name)
    if all(isinstance(row, Mapping) for row in rows):
        columns = _columns_from_dicts(rows, schema, table_name)
    elif all(isinstance(row, list | tuple) for row in rows):
        columns = _columns_from_tuples(rows, schema, table_name)
    else:
        raise SchemaMismatch(table_name, "rows must be all tuples/lists or all dicts")
    arrays = []
    for field, values in zip(schema, columns, strict=True):
        try:
            arrays.append(pa.array(values, type=field.type))
        except _CONVERSION_ERRORS as error:
            raise SchemaMismatch(
                table_name, f"column {field.name!r}: {_first_line(error)}"
            ) from error
    return pa.Table.from_arrays(arrays, names=schema.names)


def _columns_from_dicts(
    rows: Sequence[Mapping[str, Any]], schema: pa.Schema, table_name: str
) -> list[list[Any]]:
    names = set(schema.names)
    for position, row in enumerate(rows):
        if set(row) != names:
            raise SchemaMismatch(
                table_name, f"row {position} has keys {sorted(row)}, expected {schema.names}"
            )
    return [[row[name] for row in rows] for name in schema.names]


def _columns_from_tuples(
    rows: Sequence[Sequence[Any]], schema: pa.Schema, table_name: str
) -> list[list[Any]]:
    width = len(schema.names)
    for position, row in enumerate(rows):
        if len(row) != width:
            raise SchemaMismatch(
                table_name, f"row {position} has {len(row)} values, expected {width}"
            )
    return [list(column) for column in zip(*rows, strict=True)]


def encode(table: pa.Table) -> bytes:
    """One Arrow IPC stream (schema + the table's record batches), byte for byte what
    `pa.ipc.new_stream` writes: the schema's message (made once per schema), each batch's
    own message, the end-of-stream marker. Half the cost of a stream writer for a table
    of one record batch (10 against 21 us for one 11-column row; 80 against 205 us for
    10,000 rows), and a one-row publish is bound by per-call costs like this one. Each
    batch's message is its own allocation, so from `_SERIALIZED_BATCHES_MAX` batches on
    (appends merged by the coalescer) the writer is cheaper: 64 of 100 rows, 412 against
    592 us. A schema with dictionary or nested fields takes the writer too, which also
    writes dictionary batches."""
    head = _schema_messages.get(table.schema)
    record_batches = table.to_batches()
    if head is None or len(record_batches) > _SERIALIZED_BATCHES_MAX:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        return bytes(sink.getvalue().to_pybytes())
    return b"".join([head, *(batch.serialize() for batch in record_batches), _END_OF_STREAM])


def encode_batch(batch: pa.RecordBatch, schema: pa.Schema) -> bytes | None:
    """`batch` (of `schema`'s fields) as one IPC stream under `schema`'s message, which
    carries the schema's own metadata: the bytes `encode` makes of the table of that batch
    with that schema, without the table. None when the schema takes the stream writer."""
    return stream_of(batch.serialize(), schema)


def stream_of(message: bytes | pa.Buffer, schema: pa.Schema) -> bytes | None:
    """One record batch's IPC message (of `schema`'s fields) as one IPC stream under
    `schema`'s message; None when the schema takes the stream writer."""
    head = _schema_messages.get(schema)
    if head is None:
        return None
    return b"".join((head, message, _END_OF_STREAM))


class PerSchema(Generic[T]):
    """What `make` derives from a schema, kept for the newest `size` schemas. Compared with
    their metadata (pyarrow's `==` ignores it); a publisher uses one schema, so the lookup
    is one comparison (0.15 us). Threads may share one: its list is replaced, never changed
    in place."""

    def __init__(self, make: Callable[[pa.Schema], T], size: int = 8) -> None:
        self._make = make
        self._size = size
        self._known: list[tuple[pa.Schema, T]] = []

    def get(self, schema: pa.Schema) -> T:
        for known, value in self._known:
            if known.equals(schema, check_metadata=True):
                return value
        value = self._make(schema)
        self._known = [(schema, value), *self._known[: self._size - 1]]
        return value


def _flat_schema_message(schema: pa.Schema) -> bytes | None:
    """The schema's IPC message; None when a field is a dictionary (its dictionaries need
    their own batches), nested or an extension type: the stream writer encodes those."""
    for field in schema:
        kind = field.type
        if (
            pa.types.is_dictionary(kind)
            or pa.types.is_nested(kind)
            or isinstance(kind, pa.ExtensionType)
        ):
            return None
    return schema_to_ipc(schema)


_schema_messages: PerSchema[bytes | None] = PerSchema(_flat_schema_message)
_not_nullable: PerSchema[tuple[tuple[int, str], ...]] = PerSchema(_not_nullable_fields)
_SERIALIZED_BATCHES_MAX = 4  # the crossover: 4 batches of 100 rows, 36 against 39 us
# An IPC stream ends with a continuation marker and a zero length (Arrow's format spec).
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def nbytes(table: pa.Table) -> int:
    """`table.nbytes`, cheaply for small tables. The sum of its buffers is a sub-microsecond
    upper bound but counts whole buffers a slice only points into; Table.nbytes is exact and
    costs ~20 us, a quarter of a 100-row append's client CPU. Trusting the sum up to
    _TRUST_BUFFERS_BYTES over-counts by at most that much: a merged request ends early."""
    buffers: int = table.get_total_buffer_size()
    return buffers if buffers <= _TRUST_BUFFERS_BYTES else int(table.nbytes)


def encode_chunks(
    table: pa.Table,
    *,
    bytes_max: int = wire.BATCH_BYTES_MAX,
    rows_max: int = wire.BATCH_ROWS_MAX,
) -> list[EncodedChunk]:
    """Cuts `table` into consecutive row ranges whose IPC payloads are each <= `bytes_max`
    and hold <= `rows_max` rows, in row order. Raises BatchTooLarge if one row alone
    exceeds `bytes_max`."""
    assert table.num_rows > 0, "conform() refuses empty tables"
    if not 0 < bytes_max <= wire.BATCH_BYTES_MAX:
        raise InvalidArgument("bytes_max", f"must be in (0, {wire.BATCH_BYTES_MAX}]")
    if not 0 < rows_max <= wire.BATCH_ROWS_MAX:
        raise InvalidArgument("rows_max", f"must be in (0, {wire.BATCH_ROWS_MAX}]")
    rows_per_chunk = min(rows_max, table.num_rows)
    target = bytes_max * _CHUNK_TARGET_FRACTION
    # The sum of the buffers bounds the size from above in well under a microsecond; the
    # exact size (~20 us for 11 columns, on every merged request of a pipeline) is only
    # needed when that bound says the table may not fit.
    if table.get_total_buffer_size() > target and (size := int(table.nbytes)) > target:
        estimate = int(table.num_rows * target / size)
        rows_per_chunk = max(1, min(rows_per_chunk, estimate))
    # A stack of row ranges still to encode, next one on top. A range that encodes too
    # large is split in half, so the work is bounded by about 2 * num_rows encodings.
    pending = [
        table.slice(start, rows_per_chunk)
        for start in reversed(range(0, table.num_rows, rows_per_chunk))
    ]
    chunks: list[EncodedChunk] = []
    while pending:
        part = pending.pop()
        payload = encode(part)
        if len(payload) <= bytes_max:
            chunks.append(EncodedChunk(payload=payload, row_count=part.num_rows))
            continue
        if part.num_rows == 1:
            raise BatchTooLarge(len(payload), bytes_max)
        half = part.num_rows // 2
        pending.append(part.slice(half))
        pending.append(part.slice(0, half))
    return chunks


def decode(payload: bytes) -> pa.Table:
    """An Arrow IPC stream back into a table. Raises InvalidArgument on garbage bytes."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
    except (pa.ArrowInvalid, OSError) as error:
        raise InvalidArgument("payload", f"not an Arrow IPC stream: {error}") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- one row at a time (the writer's insert) --------------------------------------------

Convert = Callable[[Any], Any]


def row_converter(schema: pa.Schema, table_name: str) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function that checks one row (a sequence of Python values, in column order) against
    `schema` and returns it as a tuple Arrow converts without surprises (numpy scalars become
    Python values). Raises SchemaMismatch naming the column, value and expected type. Cheap
    (a type test per value): it runs on every `insert` before the row is queued."""
    fields = list(schema)
    converts = [_value_converter(field) for field in fields]
    width = len(fields)

    def convert(row: Sequence[Any]) -> tuple[Any, ...]:
        if len(row) != width:
            raise SchemaMismatch(
                table_name, f"row has {len(row)} values, expected {width} {schema.names}"
            )
        try:
            return tuple(
                convert_value(value) for convert_value, value in zip(converts, row, strict=True)
            )
        except (TypeError, ValueError, OverflowError):
            pass
        for field, convert_value, value in zip(fields, converts, row, strict=True):
            try:
                convert_value(value)
            except (TypeError, ValueError, OverflowError) as error:
                raise SchemaMismatch(
                    table_name,
                    f"column {field.name!r}: {value!r} ({type(value).__name__}) is not "
                    f"{field.type}: {_first_line(error)}",
                ) from error
        raise AssertionError("unreachable: one value failed above")

    return convert


def _value_converter(field: pa.Field) -> Convert:
    arrow_type = field.type
    convert = _typed_converter(arrow_type)
    nullable = field.nullable

    def convert_or_null(value: Any) -> Any:
        if value is None:
            if not nullable:
                raise ValueError("column is not nullable")
            return None
        return convert(value)

    return convert_or_null


def _typed_converter(arrow_type: pa.DataType) -> Convert:
    if pa.types.is_integer(arrow_type):
        info = np.iinfo(arrow_type.to_pandas_dtype())
        low, high = int(info.min), int(info.max)

        def to_int(value: Any) -> int:
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
                raise TypeError("expected an integer")
            number = int(value)
            if not low <= number <= high:
                raise OverflowError(f"{number} outside [{low}, {high}]")
            return number

        return to_int
    if pa.types.is_floating(arrow_type):
        return _float
    if pa.types.is_boolean(arrow_type):
        return _bool
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return _string
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return _binary
    if pa.types.is_timestamp(arrow_type):
        return _timestamp
    if pa.types.is_date(arrow_type):
        return _date
    if pa.types.is_decimal(arrow_type):
        return _decimal
    return _by_arrow(arrow_type)


def _float(value: Any) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, float | int | np.floating | np.integer
    ):
        raise TypeError("expected a number")
    return float(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError("expected a bool")
    return bool(value)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a str")
    return value


def _binary(value: Any) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError("expected bytes")
    return bytes(value)


def _timestamp(value: Any) -> Any:
    if isinstance(value, datetime.datetime):  # pandas.Timestamp is one too.
        return value
    if isinstance(value, np.datetime64):
        return pd.Timestamp(value)
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        return int(value)  # Ticks of the column's unit since the epoch.
    raise TypeError("expected a datetime, numpy.datetime64 or int")


def _date(value: Any) -> Any:
    if isinstance(value, datetime.datetime):
        return value.date()
    if isinstance(value, datetime.date):
        return value
    if isinstance(value, np.datetime64):
        return pd.Timestamp(value).date()
    raise TypeError("expected a date")


def _decimal(value: Any) -> decimal.Decimal:
    if isinstance(value, decimal.Decimal):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return decimal.Decimal(value)
    raise TypeError("expected a decimal.Decimal or int")


def _by_arrow(arrow_type: pa.DataType) -> Convert:
    """Any other type: ask Arrow (slower, but exact)."""

    def convert(value: Any) -> Any:
        try:
            pa.scalar(value, type=arrow_type)
        except _CONVERSION_ERRORS as error:
            raise TypeError(_first_line(error)) from error
        return value

    return convert


def rows_to_table(rows: Sequence[tuple[Any, ...]], schema: pa.Schema, table_name: str) -> pa.Table:
    """Rows already checked by `row_converter` -> a table with exactly `schema`."""
    return conform(_from_rows(rows, schema, table_name), schema, table_name)


# -- partitioning (the writer's threads) ------------------------------------------------

_DOUBLE = struct.Struct("<d")


def partition_of(value: Any, arrow_type: pa.DataType, partitions: int) -> int:
    """The partition (in [0, partitions)) of one value of a column of `arrow_type`: stable
    across processes and equal to `partitions_of` for the same value, so rows of one key
    always go to the same writer thread, row by row or frame by frame."""
    if value is None:
        return 0
    if _hashes_as_integer(arrow_type):
        return _signed64(_integer_value(value, arrow_type)) % partitions
    if pa.types.is_floating(arrow_type):
        return int.from_bytes(_DOUBLE.pack(float(value)), "little", signed=True) % partitions
    if isinstance(value, str):
        return zlib.crc32(value.encode()) % partitions
    if isinstance(value, bytes | bytearray | memoryview):
        return zlib.crc32(value) % partitions
    return zlib.crc32(repr(pa.scalar(value, type=arrow_type).as_py()).encode()) % partitions


def partitions_of(column: pa.Array | pa.ChunkedArray, partitions: int) -> np.ndarray[Any, Any]:
    """`partition_of` for every value of a column, vectorized: an int64 numpy array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    arrow_type = column.type
    if pa.types.is_dictionary(arrow_type):
        column = column.dictionary_decode()
        arrow_type = column.type
    if _hashes_as_integer(arrow_type):
        values = column.cast(_storage_type(arrow_type)).cast(pa.int64(), safe=False)
        return np.asarray(values.fill_null(0).to_numpy(zero_copy_only=False)) % partitions
    if pa.types.is_floating(arrow_type):
        doubles = column.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        result: np.ndarray[Any, Any] = np.ascontiguousarray(doubles).view(np.int64) % partitions
        nulls = column.is_null().to_numpy(zero_copy_only=False)
        result[nulls] = 0
        return result
    encoded = column.dictionary_encode()
    lookup = np.array(
        [partition_of(value, arrow_type, partitions) for value in encoded.dictionary.to_pylist()],
        dtype=np.int64,
    )
    indices = encoded.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.where(indices < 0, 0, lookup[np.maximum(indices, 0)] if len(lookup) else 0)


def _hashes_as_integer(arrow_type: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(arrow_type)
        or pa.types.is_boolean(arrow_type)
        or pa.types.is_temporal(arrow_type)
    )


def _storage_type(arrow_type: pa.DataType) -> pa.DataType:
    if pa.types.is_boolean(arrow_type) or pa.types.is_integer(arrow_type):
        return arrow_type
    return pa.int32() if arrow_type.bit_width == 32 else pa.int64()


def _integer_value(value: Any, arrow_type: pa.DataType) -> int:
    if pa.types.is_boolean(arrow_type) or pa.types.is_integer(arrow_type):
        return int(value)
    scalar = pa.scalar(value, type=arrow_type)
    return int(scalar.cast(_storage_type(arrow_type)).as_py())


def _signed64(number: int) -> int:
    """Wraps like a cast to int64 (uint64 values above 2**63 become negative)."""
    number &= (1 << 64) - 1
    return number - (1 << 64) if number >= 1 << 63 else number
