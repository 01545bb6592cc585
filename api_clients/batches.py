"""Row batches on the client: user data -> an Arrow table with the stream table's exact
schema -> Arrow IPC stream payloads of at most `BATCH_BYTES_MAX` bytes, and back.

Pure functions, no I/O: everything here runs before a publish touches the network, so bad
input is refused with nothing sent. Arrow and pandas input is converted column-wise (no
per-row Python); only a list of row tuples or dicts is walked row by row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

from raftstore import limits
from raftstore.errors import BatchTooLarge, EmptyBatch, InvalidArgument, SchemaMismatch

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


def _check_names(names: list[str], schema: pa.Schema, table_name: str) -> None:
    if names == schema.names:
        return
    if len(names) != len(schema.names):
        detail = f"{len(names)} columns {names}, expected {len(schema.names)} {schema.names}"
    else:
        detail = f"columns {names}, expected {schema.names}"
    raise SchemaMismatch(table_name, detail)


def _from_pandas(frame: pd.DataFrame, schema: pa.Schema, table_name: str) -> pa.Table:
    _check_names([str(name) for name in frame.columns], schema, table_name)
    if len(frame) == 0:
        raise EmptyBatch(table_name)
    try:
        return pa.Table.from_pandas(frame, schema=schema, preserve_index=False, safe=True)
    except _CONVERSION_ERRORS as error:
        raise SchemaMismatch(table_name, _first_line(error)) from error


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
    """One Arrow IPC stream (schema + the table's record batches)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def encode_chunks(
    table: pa.Table,
    *,
    bytes_max: int = limits.BATCH_BYTES_MAX,
    rows_max: int = limits.BATCH_ROWS_MAX,
) -> list[EncodedChunk]:
    """Cuts `table` into consecutive row ranges whose IPC payloads are each <= `bytes_max`
    and hold <= `rows_max` rows, in row order. Raises BatchTooLarge if one row alone
    exceeds `bytes_max`."""
    assert table.num_rows > 0, "conform() refuses empty tables"
    if not 0 < bytes_max <= limits.BATCH_BYTES_MAX:
        raise InvalidArgument("bytes_max", f"must be in (0, {limits.BATCH_BYTES_MAX}]")
    rows_per_chunk = min(rows_max, table.num_rows)
    if table.nbytes > bytes_max * _CHUNK_TARGET_FRACTION:
        estimate = int(table.num_rows * bytes_max * _CHUNK_TARGET_FRACTION / table.nbytes)
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
