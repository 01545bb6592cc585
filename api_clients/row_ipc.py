"""Quick rows as an Arrow IPC record batch message, packed with `struct`: pyarrow's bytes.

A waited one-row `Publisher.append` spent about 40% of its client's Python time (py-spy)
converting the row (`row_path.rows_batch`: a struct array, then `RecordBatch.serialize`):
22 us in a loop and 35-49 us between waited appends for an 11-column row, against 11-12 and
~20 us packed here; in a waited loop on a local cluster the client's CPU per append went
from 247 to 173 us (docs/benchmark.md). For the flat types the quick checks accept, the
message's layout is fixed by the schema: a flatbuffer whose only varying parts are numbers
(the row count, each column's length and null count, each buffer's offset and length, the
body's length), then the buffers, each padded to 8 bytes. `RowMessages` takes that
flatbuffer from pyarrow once per schema, finds where those numbers sit, and for each call
packs the buffers itself and writes the numbers into a copy.

The bytes are pyarrow's own, not merely readable ones: what the nodes store and serve is
the same whichever path converted the rows, and the check can compare bytes rather than
trust a reading. So a schema is taken only after the encoder's output equals pyarrow's for
sample rows with and without nulls (`for_schema`), and any value the encoder cannot pack
the way pyarrow converts it (a float too large for float32, a string that is not valid
UTF-8, an out-of-range timestamp) makes `encode` return None: the caller converts those
rows with pyarrow, which gives its usual result or error.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa

_ALIGNMENT: Final = 8
_ZEROS: Final = bytes(_ALIGNMENT)
_EPOCH: Final = datetime.datetime(1970, 1, 1)
_ONE_US: Final = datetime.timedelta(microseconds=1)
# Microseconds per unit, for the floor division pyarrow applies to a naive datetime.
_US_PER_UNIT: Final = {"s": 1_000_000, "ms": 1_000, "us": 1}
_FIXED: Final = {
    pa.int8(): "b",
    pa.int16(): "h",
    pa.int32(): "i",
    pa.int64(): "q",
    pa.uint8(): "B",
    pa.uint16(): "H",
    pa.uint32(): "I",
    pa.uint64(): "Q",
    pa.float32(): "f",
    pa.float64(): "d",
}
# Errors of a value the encoder packs differently from pyarrow, or not at all: pyarrow
# converts those rows (struct.error for out-of-range integers and offsets, OverflowError
# for a float32 overflow or a timestamp out of range, UnicodeEncodeError for surrogates).
_LEFT_TO_PYARROW: Final = (struct.error, OverflowError, UnicodeEncodeError)

Buffers = list[bytes]
ColumnPacker = Callable[[tuple[Any, ...]], tuple[int, Buffers]]
Reference = Callable[[Sequence[Sequence[Any]]], bytes]


class _Layout:
    """Where the varying numbers sit in one schema's record batch flatbuffer."""

    def __init__(self, meta: bytes, fields: int, buffers: int) -> None:
        self.meta = meta  # continuation, length and the flatbuffer, as pyarrow wrote them
        base = 8  # the flatbuffer starts after the continuation and its length
        message = base + _u32(meta, base)
        body_length_at = _field(meta, message, 3)
        header = _field(meta, message, 2)
        if _field(meta, message, 1) is None or header is None or body_length_at is None:
            raise _Unsupported("message fields")
        self.body_length_at = body_length_at
        batch = header + _u32(meta, header)
        length_at = _field(meta, batch, 0)
        nodes = _vector(meta, _field(meta, batch, 1))
        buffer_list = _vector(meta, _field(meta, batch, 2))
        if length_at is None or nodes is None or buffer_list is None:
            raise _Unsupported("record batch fields")
        if _field(meta, batch, 3) is not None or _field(meta, batch, 4) is not None:
            raise _Unsupported("compression or variadic buffers")
        if nodes[1] != fields or buffer_list[1] != buffers:
            raise _Unsupported("node or buffer count")
        self.length_at = length_at
        self.nodes_at = nodes[0]
        self.buffers_at = buffer_list[0]
        self.nodes = struct.Struct(f"<{2 * fields}q")
        self.buffers = struct.Struct(f"<{2 * buffers}q")


class _Unsupported(Exception):
    """The flatbuffer pyarrow wrote is not the layout this module patches."""


def _u32(data: bytes, at: int) -> int:
    value: int = struct.unpack_from("<I", data, at)[0]
    return value


def _field(data: bytes, table: int, index: int) -> int | None:
    """Where field `index` of the flatbuffer table at `table` sits; None if absent."""
    vtable = table - struct.unpack_from("<i", data, table)[0]
    vtable_size = struct.unpack_from("<H", data, vtable)[0]
    entry = vtable + 4 + 2 * index
    if entry + 2 > vtable + vtable_size:
        return None
    offset = struct.unpack_from("<H", data, entry)[0]
    return table + offset if offset else None


def _vector(data: bytes, at: int | None) -> tuple[int, int] | None:
    """(where the elements start, how many) of the vector referenced at `at`."""
    if at is None:
        return None
    start = at + _u32(data, at)
    return start + 4, _u32(data, start)


@dataclass(frozen=True, slots=True)
class RowMessages:
    """Encodes rows the quick checks vouched for under one schema."""

    layout: _Layout
    packers: tuple[ColumnPacker, ...]

    @classmethod
    def for_schema(cls, schema: pa.Schema, reference: Reference) -> RowMessages | None:
        """The encoder of `schema`'s rows, or None when a type has no packer here or the
        packed bytes are not `reference`'s (pyarrow's message of the same rows) for the
        sample rows."""
        packers = [_packer(field) for field in schema]
        if any(packer is None for packer in packers):
            return None
        samples = [_sample_rows(schema, count, nulls) for count, nulls in _SAMPLES]
        try:
            first = reference(samples[0])
            meta_length = struct.unpack_from("<i", first, 4)[0]
            buffers = sum(_BUFFERS[_kind(field.type)] for field in schema)
            layout = _Layout(first[: 8 + meta_length], len(schema), buffers)
        except (_Unsupported, struct.error, pa.ArrowException):
            return None
        encoder = cls(layout, tuple(packer for packer in packers if packer is not None))
        try:
            if any(encoder.encode(rows) != reference(rows) for rows in samples):
                return None
        except pa.ArrowException:
            return None
        return encoder

    def encode(self, rows: Sequence[Sequence[Any]]) -> bytes | None:
        """The record batch message of `rows` (pyarrow's `RecordBatch.serialize()`
        bytes), or None when a value is left to pyarrow."""
        layout = self.layout
        count = len(rows)
        nodes: list[int] = []
        offsets: list[int] = []
        body: list[bytes] = []
        position = 0
        try:
            for pack, values in zip(self.packers, zip(*rows, strict=True), strict=True):
                nulls, buffers = pack(values)
                nodes += (count, nulls)
                for buffer in buffers:
                    size = len(buffer)
                    offsets += (position, size)
                    padding = -size % _ALIGNMENT
                    body.append(buffer + _ZEROS[:padding] if padding else buffer)
                    position += size + padding
        except _LEFT_TO_PYARROW:
            return None
        meta = bytearray(layout.meta)
        struct.pack_into("<q", meta, layout.length_at, count)
        struct.pack_into("<q", meta, layout.body_length_at, position)
        layout.nodes.pack_into(meta, layout.nodes_at, *nodes)
        layout.buffers.pack_into(meta, layout.buffers_at, *offsets)
        return b"".join((meta, *body))


# --- column packers -----------------------------------------------------------------------


def _kind(arrow_type: pa.DataType) -> str:
    if arrow_type in _FIXED:
        return "fixed"
    if pa.types.is_timestamp(arrow_type) and arrow_type.tz is None:
        return "timestamp"
    if pa.types.is_boolean(arrow_type):
        return "bool"
    if pa.types.is_string(arrow_type) or pa.types.is_binary(arrow_type):
        return "binary"
    if pa.types.is_large_string(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "large_binary"
    return "other"


_BUFFERS: Final = {"fixed": 2, "timestamp": 2, "bool": 2, "binary": 3, "large_binary": 3}


def _packer(field: pa.Field) -> ColumnPacker | None:
    arrow_type = field.type
    kind = _kind(arrow_type)
    if kind == "fixed":
        return _fixed(_FIXED[arrow_type], None)
    if kind == "timestamp":
        unit = arrow_type.unit
        if unit == "ns":
            return _fixed("q", lambda value: (value - _EPOCH) // _ONE_US * 1000)
        per_unit = _US_PER_UNIT[unit]
        return _fixed("q", lambda value: (value - _EPOCH) // _ONE_US // per_unit)
    if kind == "bool":
        return _booleans
    if kind in ("binary", "large_binary"):
        offset = "i" if kind == "binary" else "q"
        text = pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
        return _variable(offset, text)
    return None


def _validity(values: tuple[Any, ...]) -> tuple[int, bytes]:
    """(null count, validity bitmap): no bitmap (an empty buffer) without nulls."""
    if None not in values:
        return 0, b""
    return values.count(None), _bitmap([value is not None for value in values])


def _bitmap(bits: list[bool]) -> bytes:
    packed = bytearray((len(bits) + 7) // 8)
    for index, bit in enumerate(bits):
        if bit:
            packed[index >> 3] |= 1 << (index & 7)
    return bytes(packed)


def _fixed(code: str, convert: Callable[[Any], int] | None) -> ColumnPacker:
    # struct keeps the formats it compiled (its own bounded cache): none is kept here.
    def pack(values: tuple[Any, ...]) -> tuple[int, Buffers]:
        layout = f"<{len(values)}{code}"
        if None not in values:
            if convert is not None:
                values = tuple(map(convert, values))
            return 0, [b"", struct.pack(layout, *values)]
        nulls, validity = _validity(values)
        if convert is not None:
            values = tuple(0 if value is None else convert(value) for value in values)
        else:
            values = tuple(0 if value is None else value for value in values)  # pyarrow's
        return nulls, [validity, struct.pack(layout, *values)]

    return pack


def _booleans(values: tuple[Any, ...]) -> tuple[int, Buffers]:
    nulls, validity = _validity(values)
    return nulls, [validity, _bitmap([value is True for value in values])]


def _variable(offset_code: str, text: bool) -> ColumnPacker:
    def pack(values: tuple[Any, ...]) -> tuple[int, Buffers]:
        nulls, validity = _validity(values)
        parts = [
            b"" if value is None else value.encode("utf-8") if text else value for value in values
        ]
        ends = [0]
        for part in parts:
            ends.append(ends[-1] + len(part))
        return nulls, [validity, struct.pack(f"<{len(ends)}{offset_code}", *ends), b"".join(parts)]

    return pack


# --- the self-check's rows ----------------------------------------------------------------

# (row count, with nulls in every nullable column's second row): one row without nulls, as
# a waited one-row append sends; three with nulls and values of other lengths.
_SAMPLES: Final = ((1, False), (3, True), (9, True))


def _sample_rows(schema: pa.Schema, count: int, nulls: bool) -> list[tuple[Any, ...]]:
    rows = []
    for number in range(count):
        rows.append(
            tuple(
                None if nulls and number == 1 and field.nullable else _sample(field.type, number)
                for field in schema
            )
        )
    return rows


def _sample(arrow_type: pa.DataType, number: int) -> Any:
    kind = _kind(arrow_type)
    if kind == "fixed":
        return float(number) + 0.5 if _FIXED[arrow_type] in "fd" else number
    if kind == "timestamp":
        return _EPOCH + datetime.timedelta(days=number - 1, microseconds=1_500 * number + 1)
    if kind == "bool":
        return number % 2 == 0
    text = "é" * number
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return text
    return text.encode("utf-8")
