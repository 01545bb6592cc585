"""Publish requests read straight from the bytes gRPC received, the payload as a view of them.

`PublishRequest.FromString` copies a request's Arrow payload into the parsed message, and
reading `.payload` copies it again into a new bytes object: two passes over every published
byte, and two more live copies of a 12.7 MB request per request in flight, before group
commit copies it once into its Raft entry. Here the four fields of `PublishRequest` (and the
requests of a `PublishBatch`) are read from the protobuf wire format directly and the payload
is a memoryview into the received message, which it keeps alive until the entry is built.

The reader accepts what protobuf's parser accepts for these messages: fields in any order, a
repeated scalar field's last occurrence wins, unknown fields (and a known field number with
another wire type) are skipped. What it refuses (a truncated field, a varint past 10 bytes,
a key or a length past 5 bytes, a key past 32 bits, a group, field number 0, a table name
that is not UTF-8) raises `WireError`; gRPC then answers the call INTERNAL ("Exception
deserializing request!") and nothing is published, as for protobuf's own DecodeError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

_VARINT: Final = 0
_FIXED64: Final = 1
_LENGTH_DELIMITED: Final = 2
_FIXED32: Final = 5
_VARINT_BYTES_MAX: Final = 10
# upb reads a field's key and a length as at most 5 bytes (32 bits) and refuses longer ones,
# even when the value is small (an overlong encoding); a key past 32 bits is refused too.
_SHORT_VARINT_BYTES_MAX: Final = 5
_KEY_MAX: Final = 0xFFFF_FFFF
_FIXED_WIDTHS: Final = {_FIXED64: 8, _FIXED32: 4}

# PublishRequest (proto/hastream.proto): field number -> wire type.
_TABLE: Final = 1
_PAYLOAD: Final = 2
_PRODUCER_ID: Final = 3
_SEQUENCE: Final = 4
_REQUEST_WIRE_TYPES: Final = {
    _TABLE: _LENGTH_DELIMITED,
    _PAYLOAD: _LENGTH_DELIMITED,
    _PRODUCER_ID: _LENGTH_DELIMITED,
    _SEQUENCE: _VARINT,
}
# PublishBatch: repeated PublishRequest requests = 1.
_REQUESTS: Final = 1


class WireError(ValueError):
    """A publish request that is not a well-formed protobuf message of its type."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"malformed publish request: {detail}")
        self.detail = detail


@dataclass(frozen=True, slots=True)
class PublishView:
    """The fields of one PublishRequest; `payload` is a view of the received bytes."""

    table: str
    payload: memoryview
    producer_id: bytes
    sequence: int


def parse_publish(data: bytes | memoryview) -> PublishView:
    """One serialized PublishRequest (a unary Publish call's request)."""
    view = memoryview(data)
    return _request(view, 0, len(view))


def parse_publish_batch(data: bytes) -> list[PublishView]:
    """One serialized PublishBatch (a PublishStream message): its requests, in order."""
    view = memoryview(data)
    requests: list[PublishView] = []
    at, end = 0, len(view)
    while at < end:
        field, wire_type, at = _key(view, at, end)
        if field == _REQUESTS and wire_type == _LENGTH_DELIMITED:
            start, at = _length_delimited(view, at, end)
            requests.append(_request(view, start, at))
        else:
            at = _skip(view, wire_type, at, end)
    return requests


def _request(view: memoryview, at: int, end: int) -> PublishView:
    table = b""
    payload = view[0:0]
    producer_id = b""
    sequence = 0
    while at < end:
        field, wire_type, at = _key(view, at, end)
        if _REQUEST_WIRE_TYPES.get(field) != wire_type:  # unknown, as protobuf's parser
            at = _skip(view, wire_type, at, end)
            continue
        if field == _SEQUENCE:
            sequence, at = _varint(view, at, end)
            sequence &= 0xFFFF_FFFF_FFFF_FFFF  # uint64, as protobuf truncates
            continue
        start, at = _length_delimited(view, at, end)
        if field == _PAYLOAD:
            payload = view[start:at]
        elif field == _TABLE:
            table = bytes(view[start:at])
        else:
            producer_id = bytes(view[start:at])
    try:
        name = table.decode("utf-8")
    except UnicodeDecodeError as error:
        raise WireError("table is not UTF-8") from error
    return PublishView(name, payload, producer_id, sequence)


def _varint(
    view: memoryview, at: int, end: int, bytes_max: int = _VARINT_BYTES_MAX
) -> tuple[int, int]:
    value = shift = 0
    for position in range(at, min(end, at + bytes_max)):
        byte = view[position]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position + 1
        shift += 7
    raise WireError("truncated or overlong varint")


def _key(view: memoryview, at: int, end: int) -> tuple[int, int, int]:
    key, at = _varint(view, at, end, _SHORT_VARINT_BYTES_MAX)
    if key > _KEY_MAX:
        raise WireError("field key past 32 bits")
    field, wire_type = key >> 3, key & 7
    if field == 0:
        raise WireError("field number 0")
    return field, wire_type, at


def _length_delimited(view: memoryview, at: int, end: int) -> tuple[int, int]:
    """(start, end) of a length-delimited field's bytes, whose length starts at `at`."""
    length, start = _varint(view, at, end, _SHORT_VARINT_BYTES_MAX)
    if length > end - start:
        raise WireError("field runs past the message")
    return start, start + length


def _skip(view: memoryview, wire_type: int, at: int, end: int) -> int:
    if wire_type == _VARINT:
        return _varint(view, at, end)[1]
    if wire_type == _LENGTH_DELIMITED:
        return _length_delimited(view, at, end)[1]
    width = _FIXED_WIDTHS.get(wire_type)
    if width is None:
        raise WireError(f"wire type {wire_type}")
    if at + width > end:
        raise WireError("field runs past the message")
    return at + width
