"""Arrow <-> Spark schemas and column-wise batch conversion (no per-row Python).

The table's Arrow schema, as the cluster stores it, is the source of truth:
- reading, Spark sees `spark_schema(table_schema)`, and every RecordBatch handed back to
  Spark must equal `to_arrow_schema(spark_schema, timezone="UTC")` exactly (Spark refuses a
  batch whose schema differs, even by time zone spelling), so read batches are cast to it;
- writing, Spark hands over RecordBatches in its own Arrow types (microsecond UTC
  timestamps, int32 for IntegerType...), which are selected by column name and cast to the
  table's exact schema before they are published.

Timestamps without a time zone in the table are shown to Spark as TimestampType (instants
in UTC), so a DataFrame written and read back keeps its type with the session time zone UTC.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from api_clients import SchemaMismatch

READ_BATCH_ROWS_MAX = 65_536  # Rows per RecordBatch handed to Spark.


def spark_schema(table: str, table_schema: pa.Schema) -> StructType:
    """The Spark schema a read of `table` produces. Raises SchemaMismatch for a column type
    Spark has no counterpart for."""
    try:
        return from_arrow_schema(table_schema, prefer_timestamp_ntz=False)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise SchemaMismatch(table, f"a column type has no Spark counterpart: {error}") from error


def read_target(schema: StructType) -> pa.Schema:
    """The exact Arrow schema Spark accepts from `read()` for `schema`."""
    return to_arrow_schema(schema, timezone="UTC")


def to_spark_batches(rows: pa.Table, target: pa.Schema) -> Iterator[pa.RecordBatch]:
    """`rows` (the table's own schema) as RecordBatches of exactly `target`: the target's
    columns selected by name (a user-given schema may pick a subset), then cast."""
    if rows.num_rows == 0:
        return
    selected = rows.select(target.names)
    columns = [_cast(selected.column(index), field) for index, field in enumerate(target)]
    converted = pa.Table.from_arrays(columns, schema=target)
    yield from converted.to_batches(max_chunksize=READ_BATCH_ROWS_MAX)


def check_writable(table: str, table_schema: pa.Schema, schema: StructType) -> None:
    """Refuses, before any task runs, a DataFrame whose columns cannot be written to the
    table: missing or extra column names, or a type Arrow cannot cast to the column's."""
    incoming = read_target(schema)
    _check_names(table, table_schema, incoming.names)
    for field in table_schema:
        source = incoming.field(field.name).type
        try:
            _cast(pa.array([], type=source), field)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
            raise SchemaMismatch(
                table, f"column {field.name!r}: cannot write {source} to {field.type}: {error}"
            ) from error


def to_table_rows(table: str, table_schema: pa.Schema, batches: list[pa.RecordBatch]) -> pa.Table:
    """Spark's RecordBatches as one Arrow table with exactly the table's schema: columns
    picked by name in the table's order and cast. A value that does not fit (an int64 into
    an int32 column, a null in a non-nullable column) raises SchemaMismatch; timestamps are
    truncated to the table's unit."""
    rows = pa.Table.from_batches(batches)
    _check_names(table, table_schema, rows.column_names)
    columns = []
    for field in table_schema:
        try:
            columns.append(_cast(rows.column(field.name), field))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as error:
            raise SchemaMismatch(table, f"column {field.name!r}: {error}") from error
        if not field.nullable and columns[-1].null_count:
            raise SchemaMismatch(table, f"column {field.name!r} is not nullable")
    return pa.Table.from_arrays(columns, schema=table_schema)


def _check_names(table: str, table_schema: pa.Schema, names: list[str]) -> None:
    missing = [name for name in table_schema.names if name not in names]
    extra = [name for name in names if name not in table_schema.names]
    if missing or extra:
        raise SchemaMismatch(
            table,
            f"DataFrame columns {names} do not match the table's {table_schema.names} "
            f"(missing {missing}, extra {extra})",
        )


def _cast(column: pa.Array | pa.ChunkedArray, field: pa.Field) -> pa.Array | pa.ChunkedArray:
    if column.type.equals(field.type):
        return column
    # The table's timestamp unit is the precision the user asked for: sub-unit digits are
    # dropped. Every other lossy cast (overflow, float -> int with a fraction) is refused.
    options = pc.CastOptions(field.type, allow_time_truncate=True)
    return pc.cast(column, options=options)
