"""The fast path of a few Python rows: checked on the caller's thread, converted in bulk.

Converting one row to Arrow costs about as much as converting sixty (the per-call work
dominates either way), so an application that publishes row by row spends its time in
conversion. `Publisher.append_async` therefore takes a short list of row tuples whose
every value is plainly of its column's type (`quick_rows`): it checks them on the caller's
thread and queues the Python rows; the coalescer's sender converts everything queued
together, once per request (`rows_table`). A waited `Publisher.append` of such rows
packs them into the request's bytes without pyarrow (`rows_payload`, row_ipc.py), or
where the packer leaves them to pyarrow converts them the same way and sends the record
batch itself (`rows_batch`, `batches.encode_batch`). Anything else takes the general path
(`batches.to_table`), which is also what decides the errors: a row the quick checks do not
vouch for never takes this path, so both paths accept and refuse the same rows.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any, Final

import pyarrow as pa

from api_clients import batches
from api_clients.batches import PerSchema
from api_clients.row_ipc import RowMessages

Check = Callable[[Any], bool]
ROWS_MAX: Final = 16  # more rows per call amortise the conversion by themselves
# The ints pyarrow takes for a float column: those its type holds exactly (it refuses the
# rest, and the general path says SchemaMismatch); float16 it does not check.
_EXACT_FLOAT_INT: Final = {pa.float32(): 2**24}
_EXACT_DOUBLE_INT: Final = 2**53
_INT_BOUNDS: Final = {
    pa.int8(): (-(2**7), 2**7 - 1),
    pa.int16(): (-(2**15), 2**15 - 1),
    pa.int32(): (-(2**31), 2**31 - 1),
    pa.int64(): (-(2**63), 2**63 - 1),
    pa.uint8(): (0, 2**8 - 1),
    pa.uint16(): (0, 2**16 - 1),
    pa.uint32(): (0, 2**32 - 1),
    pa.uint64(): (0, 2**64 - 1),
}


def checks_for(schema: pa.Schema) -> tuple[Check, ...] | None:
    """One check per column that a value is plainly of the column's type (exact Python
    types: no bool for an int, no numpy scalars); None when a column's type has no quick
    check (those tables always take the general path)."""
    checks = []
    for field in schema:
        check = _check_for(field.type)
        if check is None:
            return None
        checks.append(_nullable(check) if field.nullable else check)
    return tuple(checks)


def _check_for(arrow_type: pa.DataType) -> Check | None:
    bounds = _INT_BOUNDS.get(arrow_type)
    if bounds is not None:
        low, high = bounds
        return lambda value: type(value) is int and low <= value <= high
    if pa.types.is_floating(arrow_type):
        exact = _EXACT_FLOAT_INT.get(arrow_type, _EXACT_DOUBLE_INT)
        return lambda value: (
            type(value) is float or (type(value) is int and -exact <= value <= exact)
        )
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return lambda value: type(value) is str
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return lambda value: type(value) is bytes
    if pa.types.is_boolean(arrow_type):
        return lambda value: type(value) is bool
    if pa.types.is_timestamp(arrow_type) and arrow_type.tz is None:
        return lambda value: type(value) is datetime.datetime and value.tzinfo is None
    return None


def _nullable(check: Check) -> Check:
    return lambda value: value is None or check(value)


def quick_rows(data: object, checks: tuple[Check, ...]) -> list[Sequence[Any]] | None:
    """`data` as rows for the fast path: a non-empty list of at most ROWS_MAX tuples or
    lists whose values all pass `checks`; None for anything else."""
    if type(data) is not list or not 0 < len(data) <= ROWS_MAX:
        return None
    width = len(checks)
    for row in data:
        if (type(row) is not tuple and type(row) is not list) or len(row) != width:
            return None
        for check, value in zip(checks, row, strict=True):
            if not check(value):
                return None
    return data


def rows_batch(rows: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.RecordBatch:
    """The rows (checked by `quick_rows` against `schema`) as one record batch of the
    schema's fields (not its own metadata). One conversion of them all as a struct array,
    whose children take their columns' converters (the same values): a quarter of the cost
    of a `pa.array` per column for a few rows (23 against 93 us for one 11-column row), and
    no more at a thousand. pyarrow reads a list as a struct's (key, value) pairs, so list
    rows become tuples first."""
    if any(type(row) is not tuple for row in rows):
        rows = [tuple(row) for row in rows]
    return pa.RecordBatch.from_struct_array(pa.array(rows, type=_struct_types.get(schema)))


def rows_payload(rows: Sequence[Sequence[Any]], schema: pa.Schema) -> bytes | None:
    """The request payload of the rows (checked by `quick_rows` against `schema`): the
    bytes `batches.encode_batch(rows_batch(rows, schema), schema)` gives, packed without
    pyarrow (row_ipc.py: half the time for one 11-column row); None when pyarrow must
    convert them (a type or value the packer leaves to it)."""
    encoder = _row_messages.get(schema)
    message = None if encoder is None else encoder.encode(rows)
    return None if message is None else batches.stream_of(message, schema)


def _pyarrow_message(rows: Sequence[Sequence[Any]], schema: pa.Schema) -> bytes:
    return bytes(rows_batch(rows, schema).serialize().to_pybytes())


def _row_messages_of(schema: pa.Schema) -> RowMessages | None:
    return RowMessages.for_schema(schema, lambda rows: _pyarrow_message(rows, schema))


def rows_table(rows: Sequence[Sequence[Any]], schema: pa.Schema) -> pa.Table:
    """The rows (checked by `quick_rows` against `schema`) as one table with the schema."""
    return batch_table(rows_batch(rows, schema), schema)


def batch_table(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """A `rows_batch` as a table with the schema: its fields carry the names, types,
    nullability and field metadata; only the schema's own metadata is left to put back."""
    table = pa.Table.from_batches([batch])
    return table.replace_schema_metadata(schema.metadata) if schema.metadata else table


_struct_types: PerSchema[pa.StructType] = PerSchema(pa.struct)
_row_messages: PerSchema[RowMessages | None] = PerSchema(_row_messages_of)


def size_estimate(rows: Sequence[Sequence[Any]]) -> int:
    """About the Arrow bytes of `rows` (8 a value, plus the bytes of strings): the
    coalescer's bound on what waits, and its share of a request."""
    total = 0
    for row in rows:
        total += 8 * len(row)
        for value in row:
            if type(value) is str or type(value) is bytes:
                total += len(value)
    return total
