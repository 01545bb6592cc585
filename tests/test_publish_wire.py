"""publish_wire reads PublishRequest and PublishBatch as protobuf's parser does, with the
payload a view of the received bytes (no copy)."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import hastream_pb2 as pb
from raftstore.publish_wire import WireError, parse_publish, parse_publish_batch

pytestmark = pytest.mark.unit

requests = st.builds(
    pb.PublishRequest,
    table=st.text(max_size=40),
    payload=st.binary(max_size=300),
    producer_id=st.sampled_from([b"", bytes(range(16))]),
    sequence=st.integers(min_value=0, max_value=2**64 - 1),
)


def _fields(request: object) -> tuple[object, ...]:
    return (
        request.table,  # type: ignore[attr-defined]
        bytes(request.payload),  # type: ignore[attr-defined]
        request.producer_id,  # type: ignore[attr-defined]
        request.sequence,  # type: ignore[attr-defined]
    )


@settings(max_examples=200, deadline=None)
@given(request=requests)
def test_a_request_reads_as_protobuf_reads_it(request: pb.PublishRequest) -> None:
    data = request.SerializeToString()
    assert _fields(parse_publish(data)) == _fields(pb.PublishRequest.FromString(data))


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(requests, max_size=5))
def test_a_batch_reads_as_protobuf_reads_it(batch: list[pb.PublishRequest]) -> None:
    data = pb.PublishBatch(requests=batch).SerializeToString()
    parsed = pb.PublishBatch.FromString(data).requests
    assert [_fields(r) for r in parse_publish_batch(data)] == [_fields(r) for r in parsed]


def test_the_payload_is_a_view_of_the_received_bytes() -> None:
    data = pb.PublishRequest(table="t", payload=b"p" * 1000, sequence=3).SerializeToString()
    payload = parse_publish(data).payload
    assert isinstance(payload, memoryview)
    assert payload.obj is data
    assert len(payload) == 1000


def test_unknown_fields_are_skipped_and_the_last_occurrence_wins() -> None:
    first = pb.PublishRequest(table="old", payload=b"a", sequence=1).SerializeToString()
    second = pb.PublishRequest(table="new", payload=b"bb", sequence=2).SerializeToString()
    unknown = bytes([9 << 3 | 0, 150, 1, 10 << 3 | 2, 2, 0, 0, 11 << 3 | 5, 1, 2, 3, 4])
    unknown += bytes([12 << 3 | 1]) + bytes(8)
    data = first + unknown + second
    assert _fields(parse_publish(data)) == _fields(pb.PublishRequest.FromString(data))
    assert parse_publish(data).table == "new"


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        (bytes([1 << 3 | 2, 5, ord("t")]), "past the message"),  # table longer than the rest
        (bytes([2 << 3 | 2]), "varint"),  # payload length missing
        (bytes([4 << 3 | 0]) + b"\xff" * 11, "varint"),  # sequence varint never ends
        (bytes([1 << 3 | 2, 2, 0xC3, 0x28]), "UTF-8"),  # table not UTF-8
        (bytes([5 << 3 | 3]), "wire type 3"),  # a group
        (bytes([0 << 3 | 0, 1]), "field number 0"),
        (bytes([7 << 3 | 5, 1, 2]), "past the message"),  # fixed32 cut short
        (b"\x80\x80\x80\x80\x10\x00", "past 32 bits"),  # key 2**32 (found by hypothesis)
        (b"\xa8\x80\x80\x80\x80\x00\x05", "varint"),  # key 21 in 6 bytes
        (b"\x12\x81\x80\x80\x80\x80\x00x", "varint"),  # payload length 1 in 6 bytes
    ],
)
def test_malformed_requests_raise_wire_error_as_protobuf_raises(data: bytes, detail: str) -> None:
    with pytest.raises(WireError, match=detail):
        parse_publish(data)
    with pytest.raises(DecodeError):
        pb.PublishRequest.FromString(data)


def test_a_malformed_request_inside_a_batch_fails_the_batch() -> None:
    good = pb.PublishRequest(table="t", payload=b"x").SerializeToString()
    bad = bytes([1 << 3 | 2, 9, ord("t")])
    data = bytes([1 << 3 | 2, len(good)]) + good + bytes([1 << 3 | 2, len(bad)]) + bad
    with pytest.raises(WireError):
        parse_publish_batch(data)


def test_a_known_field_with_another_wire_type_is_skipped_as_protobuf_skips_it() -> None:
    data = bytes([4 << 3 | 2, 1, 7, 1 << 3 | 2, 1, ord("t")])  # sequence as bytes, table
    assert _fields(parse_publish(data)) == _fields(pb.PublishRequest.FromString(data))
    assert parse_publish_batch(bytes([1 << 3 | 0, 1])) == []
    assert len(pb.PublishBatch.FromString(bytes([1 << 3 | 0, 1])).requests) == 0


@pytest.mark.parametrize(
    "data",
    [
        b"\xa8\x80\x80\x80\x00\x05",  # key 21 in 5 bytes
        b"\x12\x81\x80\x80\x80\x00x",  # payload length 1 in 5 bytes
        b"\xf8\xff\xff\xff\x0f\x00",  # the largest field number
        b"\x20\x85" + b"\x80" * 8 + b"\x7f",  # a 10-byte sequence past 64 bits, truncated
    ],
)
def test_long_but_valid_encodings_read_as_protobuf_reads_them(data: bytes) -> None:
    assert _fields(parse_publish(data)) == _fields(pb.PublishRequest.FromString(data))


def _varint_bytes(value: int, padding: int) -> bytes:
    """`value` as a varint, made `padding` bytes longer by overlong encoding."""
    out = bytearray()
    while True:
        out.append(value & 0x7F | 0x80)
        value >>= 7
        if not value:
            break
    out.extend(b"\x80" * padding)
    out[-1] &= 0x7F
    return bytes(out)


# Wire-shaped bytes: keys and lengths near the limits, overlong varints, small fields.
wire_pieces = st.one_of(
    st.builds(
        _varint_bytes,
        st.one_of(
            st.integers(0, 2**64 - 1),
            st.integers(0, 40),
            st.integers(2**32 - 8, 2**32 + 8),
            st.builds(lambda field, kind: field << 3 | kind, st.integers(0, 12), st.integers(0, 7)),
        ),
        st.integers(0, 6),
    ),
    st.binary(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(wire_pieces, max_size=8))
def test_any_wire_shaped_bytes_either_read_as_protobuf_reads_them_or_raise_wire_error(
    pieces: list[bytes],
) -> None:
    _reads_as_protobuf_or_raises_wire_error(b"".join(pieces))


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=64))
def test_any_bytes_either_read_as_protobuf_reads_them_or_raise_wire_error(data: bytes) -> None:
    _reads_as_protobuf_or_raises_wire_error(data)


def _reads_as_protobuf_or_raises_wire_error(data: bytes, *, batch: bool = False) -> None:
    try:
        ours = parse_publish_batch(data) if batch else [parse_publish(data)]
    except WireError:
        return
    # What we accept, protobuf accepts and reads the same.
    theirs = (
        pb.PublishBatch.FromString(data).requests if batch else [pb.PublishRequest.FromString(data)]
    )
    assert [_fields(r) for r in ours] == [_fields(r) for r in theirs]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(wire_pieces, max_size=8), framed=st.booleans())
def test_any_wire_shaped_batch_either_reads_as_protobuf_reads_it_or_raises_wire_error(
    pieces: list[bytes], framed: bool
) -> None:
    data = b"".join(pieces)
    if framed:  # the pieces as one request of the batch
        data = b"\x0a" + _varint_bytes(len(data), 0) + data
    _reads_as_protobuf_or_raises_wire_error(data, batch=True)
