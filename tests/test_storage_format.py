"""storage/format.py: record and frame encoding, and that every corruption is detected."""

from __future__ import annotations

import struct
import zlib

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from raftstore import limits
from raftstore.storage import format as storage_format
from raftstore.storage.format import (
    FRAME_HEADER_SIZE,
    HEADER_SIZE,
    BadChecksum,
    BadMagic,
    BadVersion,
    FormatError,
    RecordHeader,
    TruncatedRecord,
)

pytestmark = pytest.mark.unit


def _record_bytes(
    payload: bytes, *, lsn: int = 7, first_offset: int = 100, row_count: int = 3
) -> bytes:
    return b"".join(
        bytes(part)
        for part in storage_format.encode_record(lsn, first_offset, row_count, 1_700_000, payload)
    )


def _arrow_payload() -> bytes:
    batch = pa.record_batch({"id": pa.array([1, 2, 3], pa.int64()), "name": ["a", "b", "c"]})
    return bytes(batch.serialize().to_pybytes())


def _decode_header_then_check_payload(data: bytes) -> None:
    """What a reader does: header first (it gives the length), then the payload."""
    header = storage_format.decode_header(data)
    storage_format.check_payload(header, data[HEADER_SIZE : header.record_size])


def _flip_bit(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


def test_record_round_trip_with_arrow_payload() -> None:
    payload = _arrow_payload()
    data = _record_bytes(payload)
    header, view = storage_format.decode_record(data)
    assert header == RecordHeader(
        lsn=7,
        first_offset=100,
        row_count=3,
        timestamp_ms=1_700_000,
        payload_len=len(payload),
        payload_crc=header.payload_crc,
    )
    assert bytes(view) == payload
    assert header.record_size == len(data) == HEADER_SIZE + len(payload)


def test_encode_record_returns_payload_uncopied_for_writev() -> None:
    payload = memoryview(b"x" * 1000)
    header, payload_part = storage_format.encode_record(1, 0, 1, 0, payload)
    assert len(header) == HEADER_SIZE
    assert payload_part is payload


def test_negative_timestamp_and_empty_payload_round_trip() -> None:
    header, view = storage_format.decode_record(
        b"".join(bytes(p) for p in storage_format.encode_record(1, 0, 1, -5, b""))
    )
    assert header.timestamp_ms == -5
    assert bytes(view) == b""


def test_decode_header_ignores_bytes_after_the_header() -> None:
    data = _record_bytes(b"payload")
    assert storage_format.decode_header(data[:HEADER_SIZE]) == storage_format.decode_header(data)


def test_bad_magic_raises_bad_magic() -> None:
    data = b"XXXX" + _record_bytes(b"p")[4:]
    with pytest.raises(BadMagic):
        storage_format.decode_header(data)


def test_unknown_version_raises_bad_version() -> None:
    data = bytearray(_record_bytes(b"p"))
    data[4] = 2
    with pytest.raises(BadVersion):
        storage_format.decode_header(bytes(data))


def test_encode_record_asserts_field_ranges() -> None:
    with pytest.raises(AssertionError):
        storage_format.encode_record(0, 0, 1, 0, b"p")
    with pytest.raises(AssertionError):
        storage_format.encode_record(1, 0, 0, 0, b"p")
    with pytest.raises(AssertionError):
        storage_format.encode_record(1, -1, 1, 0, b"p")


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1])
def test_short_header_raises_truncated_record(size: int) -> None:
    with pytest.raises(TruncatedRecord):
        storage_format.decode_header(_record_bytes(b"payload")[:size])


def test_short_payload_raises_truncated_record() -> None:
    data = _record_bytes(b"0123456789")
    with pytest.raises(TruncatedRecord):
        storage_format.decode_record(data[:-1])
    header = storage_format.decode_header(data)
    with pytest.raises(TruncatedRecord):
        storage_format.check_payload(header, data[HEADER_SIZE:-1])


@pytest.mark.property
@given(payload=st.binary(max_size=300), cut=st.integers(min_value=0))
def test_any_truncated_record_raises_truncated_record(payload: bytes, cut: int) -> None:
    data = _record_bytes(payload)
    with pytest.raises(TruncatedRecord):
        storage_format.decode_record(data[: cut % len(data)])


@pytest.mark.property
@given(
    payload=st.binary(max_size=300),
    lsn=st.integers(min_value=1, max_value=2**64 - 1),
    first_offset=st.integers(min_value=0, max_value=2**64 - 1),
    row_count=st.integers(min_value=1, max_value=2**32 - 1),
    timestamp_ms=st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
def test_record_round_trip_property(
    payload: bytes, lsn: int, first_offset: int, row_count: int, timestamp_ms: int
) -> None:
    parts = storage_format.encode_record(lsn, first_offset, row_count, timestamp_ms, payload)
    header, view = storage_format.decode_record(b"".join(bytes(p) for p in parts))
    assert (header.lsn, header.first_offset, header.row_count, header.timestamp_ms) == (
        lsn,
        first_offset,
        row_count,
        timestamp_ms,
    )
    assert bytes(view) == payload


@pytest.mark.property
@given(payload=st.binary(min_size=1, max_size=300), data=st.data())
def test_any_flipped_bit_is_detected(payload: bytes, data: st.DataObject) -> None:
    record = _record_bytes(payload)
    bit = data.draw(st.integers(min_value=0, max_value=len(record) * 8 - 1), label="bit")
    corrupt = _flip_bit(record, bit)
    with pytest.raises(FormatError):
        _decode_header_then_check_payload(corrupt)


def test_flipped_payload_bit_raises_bad_checksum_from_check_payload() -> None:
    record = _record_bytes(b"some payload bytes")
    corrupt = _flip_bit(record, (HEADER_SIZE + 3) * 8)
    header = storage_format.decode_header(corrupt)
    with pytest.raises(BadChecksum):
        storage_format.check_payload(header, corrupt[HEADER_SIZE:])


def test_every_flipped_header_bit_is_caught_by_decode_header() -> None:
    record = _record_bytes(b"payload")
    for bit in range(HEADER_SIZE * 8):
        with pytest.raises(FormatError):
            storage_format.decode_header(_flip_bit(record, bit))


def _handmade_header(payload_len: int, lsn: int, first_offset: int, row_count: int) -> bytes:
    """A header built from the documented layout, independently of format.py."""
    fields = struct.pack(
        "<4sBBHIQQIqI", b"HSDR", 1, 0, 0, payload_len, lsn, first_offset, row_count, -1, 0
    )
    return fields + struct.pack("<I", zlib.crc32(fields))


def test_layout_matches_the_documented_diagram() -> None:
    header = storage_format.decode_header(_handmade_header(0, 9, 42, 5))
    assert header == RecordHeader(9, 42, 5, -1, 0, 0)
    assert _handmade_header(0, 9, 42, 5) == bytes(
        storage_format.encode_record(9, 42, 5, -1, b"")[0]
    )


def test_valid_crc_over_out_of_range_payload_len_raises_format_error() -> None:
    # A header with a valid CRC but a payload_len beyond the limit: a writer bug, refused.
    with pytest.raises(FormatError, match="payload_len"):
        storage_format.decode_header(_handmade_header(limits.RECORD_BYTES_MAX + 1, 1, 0, 1))


def test_valid_crc_over_zero_lsn_raises_format_error() -> None:
    with pytest.raises(FormatError, match="lsn"):
        storage_format.decode_header(_handmade_header(0, 0, 0, 1))


@pytest.mark.property
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_a_frame_header_over_parts_is_the_header_of_their_joined_body(parts: list[bytes]) -> None:
    # A checkpoint writes its body in parts, never joined (checkpoint.write_atomic): the
    # header plus the parts must be byte for byte the frame of the joined body.
    views = [memoryview(part) if number % 2 else part for number, part in enumerate(parts)]
    body = b"".join(parts)
    frame = storage_format.frame_header(b"CKPT", views) + body
    assert frame == storage_format.encode_frame(b"CKPT", body)
    assert storage_format.decode_frame(frame, b"CKPT") == body


def test_frame_round_trip() -> None:
    body = _arrow_payload()
    frame = storage_format.encode_frame(b"CKPT", body)
    assert len(frame) == FRAME_HEADER_SIZE + len(body)
    assert storage_format.decode_frame(frame, b"CKPT") == body


def test_frame_of_another_kind_is_refused() -> None:
    frame = storage_format.encode_frame(b"CKPT", b"body")
    with pytest.raises(FormatError, match="kind"):
        storage_format.decode_frame(frame, b"META")


def test_frame_with_trailing_bytes_is_refused() -> None:
    frame = storage_format.encode_frame(b"CKPT", b"body")
    with pytest.raises(FormatError, match="after the frame body"):
        storage_format.decode_frame(frame + b"\0", b"CKPT")


@pytest.mark.property
@given(body=st.binary(max_size=200), cut=st.integers(min_value=0))
def test_truncated_frame_raises_truncated_record(body: bytes, cut: int) -> None:
    frame = storage_format.encode_frame(b"CKPT", body)
    with pytest.raises(TruncatedRecord):
        storage_format.decode_frame(frame[: cut % len(frame)], b"CKPT")


@pytest.mark.property
@given(body=st.binary(max_size=200), data=st.data())
def test_any_flipped_frame_bit_is_detected(body: bytes, data: st.DataObject) -> None:
    frame = storage_format.encode_frame(b"CKPT", body)
    bit = data.draw(st.integers(min_value=0, max_value=len(frame) * 8 - 1), label="bit")
    with pytest.raises(FormatError):
        storage_format.decode_frame(_flip_bit(frame, bit), b"CKPT")
