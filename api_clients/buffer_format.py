"""On-disk layout of the client's durable buffer: bytes in, bytes out, no I/O.

A buffer directory holds segment files of records, one COMMIT marker and one META file
(`api_clients/buffer.py` does the I/O). Every field is fixed-width little-endian.

Segment record (segment `seg-<first sequence:020d>.buf` is a run of these):

    offset size field
    0      4    magic          b"HSBR"
    4      1    version        1
    5      1    flags          0 (reserved)
    6      2    header_len     52
    8      4    payload_len    bytes of the payload
    12     4    row_count      rows in the payload
    16     8    sequence       the publish sequence of this record (> every earlier one)
    24     16   producer_id    the buffer's producer id (the cluster's idempotency token)
    40     8    created_ms     wall clock when buffered (diagnostics only)
    48     4    crc32          zlib.crc32 over bytes [0, 48) and the payload
    52     n    payload        one Arrow IPC stream: exactly the bytes a PublishRequest sends

COMMIT (written whole and atomically; the last acknowledged-or-dropped sequence):

    0      4    magic          b"HSBC"
    4      1    version        1
    5      3    reserved       0
    8      8    sequence       every record with a sequence <= this one is done
    16     16   producer_id
    32     4    crc32          over bytes [0, 32)

META (written once atomically; names the buffer's producer, table and table schema):

    0      4    magic          b"HSBM"
    4      1    version        1
    5      3    reserved       0
    8      16   producer_id
    24     2    table_len      then the table name, UTF-8
    ..     4    schema_len     then the Arrow IPC schema ("" while unknown)
    ..     4    crc32          over everything before it
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from hastream import wire
from hastream.checksum import crc32

RECORD_MAGIC: Final = b"HSBR"
COMMIT_MAGIC: Final = b"HSBC"
META_MAGIC: Final = b"HSBM"
VERSION: Final = 1
PRODUCER_ID_BYTES: Final = 16
assert PRODUCER_ID_BYTES == wire.PRODUCER_ID_BYTES, "records carry the wire's producer ids"

_RECORD_HEADER: Final = struct.Struct("<4sBBHIIQ16sQ")  # everything before the crc
_CRC: Final = struct.Struct("<I")
RECORD_HEADER_BYTES: Final = _RECORD_HEADER.size + _CRC.size
assert RECORD_HEADER_BYTES == 52, RECORD_HEADER_BYTES
# A record's payload is one publish request's payload; anything bigger is not ours. (The
# buffers refuse a payload over the wire's BATCH_BYTES_MAX; the format allows room to grow.)
PAYLOAD_BYTES_MAX: Final = 64 * 1024 * 1024
assert PAYLOAD_BYTES_MAX >= wire.BATCH_BYTES_MAX

_COMMIT_BODY: Final = struct.Struct("<4sB3xQ16s")
COMMIT_BYTES: Final = _COMMIT_BODY.size + _CRC.size
_META_HEAD: Final = struct.Struct("<4sB3x16sH")
_U32: Final = struct.Struct("<I")


class FormatError(Exception):
    """Bytes that are not a valid record/marker. `detail` says which check failed."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    payload_len: int
    row_count: int
    sequence: int
    producer_id: bytes
    created_ms: int

    @property
    def record_bytes(self) -> int:
        return RECORD_HEADER_BYTES + self.payload_len


def encode_record(
    *, sequence: int, producer_id: bytes, row_count: int, created_ms: int, payload: bytes
) -> bytes:
    """One record, header + payload, ready to append to a segment."""
    if len(producer_id) != PRODUCER_ID_BYTES:
        raise ValueError(f"producer_id must be {PRODUCER_ID_BYTES} bytes")
    if not 0 < len(payload) <= PAYLOAD_BYTES_MAX:
        raise ValueError(f"payload of {len(payload)} bytes outside (0, {PAYLOAD_BYTES_MAX}]")
    if sequence < 1 or row_count < 1:
        raise ValueError(f"need sequence >= 1 and row_count >= 1, got {sequence}, {row_count}")
    head = _RECORD_HEADER.pack(
        RECORD_MAGIC,
        VERSION,
        0,
        RECORD_HEADER_BYTES,
        len(payload),
        row_count,
        sequence,
        producer_id,
        created_ms,
    )
    crc = crc32(payload, crc32(head))
    record = b"".join((head, _CRC.pack(crc), payload))
    # Pair assertion: what we are about to write reads back as itself.
    assert decode_header(record[:RECORD_HEADER_BYTES]).sequence == sequence
    return record


def decode_header(data: bytes | memoryview) -> RecordHeader:
    """The header of the record starting at `data[0]` (at least RECORD_HEADER_BYTES long).
    Checks magic, version, header length and the payload bound, not the CRC."""
    if len(data) < RECORD_HEADER_BYTES:
        raise FormatError(f"short header: {len(data)} < {RECORD_HEADER_BYTES} bytes")
    fields = _RECORD_HEADER.unpack_from(data)
    magic, version, _flags, header_len, payload_len, row_count, sequence, producer_id, created = (
        fields
    )
    if magic != RECORD_MAGIC:
        raise FormatError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FormatError(f"unknown version {version}")
    if header_len != RECORD_HEADER_BYTES:
        raise FormatError(f"header_len {header_len} != {RECORD_HEADER_BYTES}")
    if not 0 < payload_len <= PAYLOAD_BYTES_MAX:
        raise FormatError(f"payload_len {payload_len} outside (0, {PAYLOAD_BYTES_MAX}]")
    if sequence < 1 or row_count < 1:
        raise FormatError(f"sequence {sequence} or row_count {row_count} < 1")
    return RecordHeader(payload_len, row_count, sequence, bytes(producer_id), created)


def check_record(header_bytes: bytes | memoryview, payload: bytes | memoryview) -> None:
    """Raises FormatError unless the CRC over header and payload matches."""
    expected = _CRC.unpack_from(header_bytes, _RECORD_HEADER.size)[0]
    actual = crc32(payload, crc32(header_bytes[: _RECORD_HEADER.size]))
    if actual != expected:
        raise FormatError(f"crc32 mismatch: stored {expected:#010x}, computed {actual:#010x}")


def encode_commit(sequence: int, producer_id: bytes) -> bytes:
    if sequence < 0:
        raise ValueError(f"sequence must be >= 0, got {sequence}")
    body = _COMMIT_BODY.pack(COMMIT_MAGIC, VERSION, sequence, producer_id)
    return body + _CRC.pack(crc32(body))


def decode_commit(data: bytes) -> tuple[int, bytes]:
    """(sequence, producer_id) of a COMMIT file's bytes."""
    if len(data) != COMMIT_BYTES:
        raise FormatError(f"COMMIT is {len(data)} bytes, expected {COMMIT_BYTES}")
    body = data[: _COMMIT_BODY.size]
    if crc32(body) != _CRC.unpack_from(data, _COMMIT_BODY.size)[0]:
        raise FormatError("COMMIT crc32 mismatch")
    magic, version, sequence, producer_id = _COMMIT_BODY.unpack(body)
    if magic != COMMIT_MAGIC or version != VERSION:
        raise FormatError(f"COMMIT has magic {magic!r} version {version}")
    return sequence, producer_id


def encode_meta(producer_id: bytes, table: str, schema_ipc: bytes) -> bytes:
    name = table.encode()
    body = b"".join(
        (
            _META_HEAD.pack(META_MAGIC, VERSION, producer_id, len(name)),
            name,
            _U32.pack(len(schema_ipc)),
            schema_ipc,
        )
    )
    return body + _CRC.pack(crc32(body))


def decode_meta(data: bytes) -> tuple[bytes, str, bytes]:
    """(producer_id, table, schema_ipc) of a META file's bytes."""
    if len(data) < _META_HEAD.size + _U32.size + _CRC.size:
        raise FormatError(f"META is too short ({len(data)} bytes)")
    body = data[: -_CRC.size]
    if crc32(body) != _CRC.unpack_from(data, len(body))[0]:
        raise FormatError("META crc32 mismatch")
    magic, version, producer_id, name_len = _META_HEAD.unpack_from(body)
    if magic != META_MAGIC or version != VERSION:
        raise FormatError(f"META has magic {magic!r} version {version}")
    position = _META_HEAD.size
    table = body[position : position + name_len].decode()
    position += name_len
    (schema_len,) = _U32.unpack_from(body, position)
    position += _U32.size
    if position + schema_len != len(body):
        raise FormatError("META lengths do not add up")
    return producer_id, table, bytes(body[position:])


def segment_name(first_sequence: int) -> str:
    return f"seg-{first_sequence:020d}.buf"


def segment_first_sequence(name: str) -> int | None:
    """The first sequence a segment file name announces; None if it is not a segment."""
    if not (name.startswith("seg-") and name.endswith(".buf")):
        return None
    digits = name[4:-4]
    return int(digits) if len(digits) == 20 and digits.isdigit() else None
