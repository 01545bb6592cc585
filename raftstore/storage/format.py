"""On-disk layout of data-file records and of small checksummed files. Pure: bytes in, bytes out.

This is the only module that calls `struct` for data files and checkpoints. Every field is
fixed-width little-endian, packed by a precompiled `struct.Struct`.

Data-file record (`encode_record` / `decode_header` / `check_payload`), HEADER_SIZE = 48:

    offset size  field
    ------ ----  ---------------------------------------------------------------------
         0    4  magic         b"HSDR"
         4    1  version       u8 = 1
         5    1  flags         u8 = 0 (reserved for compression etc.; nonzero is refused)
         6    2  reserved      u16 = 0
         8    4  payload_len   u32, <= limits.RECORD_BYTES_MAX
        12    8  lsn           u64, >= 1: Raft log index of the entry that carried the batch
        20    8  first_offset  u64: offset (row number since table creation) of the first row
        28    4  row_count     u32, >= 1
        32    8  timestamp_ms  i64: stamped by the leader
        40    4  payload_crc   u32 = zlib.crc32(payload)
        44    4  header_crc    u32 = zlib.crc32(bytes 0..43), so a header is validated
                               without reading its payload (index rebuild seeks past payloads)
        48    payload_len bytes: the payload (an Arrow IPC record-batch message, opaque here)

Checksummed file frame (`encode_frame` / `decode_frame`), FRAME_HEADER_SIZE = 25:

    offset size  field
    ------ ----  ---------------------------------------------------------------------
         0    4  magic         b"HSCK"
         4    4  kind          4 bytes naming the file's role (e.g. b"CKPT", b"META")
         8    1  version       u8 = 1
         9    8  body_len      u64
        17    4  body_crc      u32 = zlib.crc32(body)
        21    4  header_crc    u32 = zlib.crc32(bytes 0..20)
        25    body_len bytes: the body; nothing may follow it

Errors: every decoding failure raises a `FormatError` subclass carrying `detail` and
`position` (the byte offset, relative to the start of the given buffer, of the field that
failed). Callers that know the file add the file and the record's position
(`CorruptionError`). Encoding bad values is a programmer error (`assert`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final

from hastream.checksum import crc32
from raftstore import limits
from raftstore.values import entry_value

RECORD_MAGIC: Final = b"HSDR"
RECORD_VERSION: Final = 1
FRAME_MAGIC: Final = b"HSCK"
FRAME_VERSION: Final = 1

_U32_MAX: Final = 2**32 - 1
_U64_MAX: Final = 2**64 - 1
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1

# Everything the header CRC covers, then the CRC itself.
_RECORD_FIELDS: Final = struct.Struct("<4sBBHIQQIqI")
_CRC: Final = struct.Struct("<I")
HEADER_SIZE: Final[int] = _RECORD_FIELDS.size + _CRC.size

_FRAME_FIELDS: Final = struct.Struct("<4s4sBQI")
FRAME_HEADER_SIZE: Final[int] = _FRAME_FIELDS.size + _CRC.size

assert HEADER_SIZE == 48
assert FRAME_HEADER_SIZE == 25
assert limits.RECORD_BYTES_MAX <= _U32_MAX


class FormatError(Exception):
    """Bytes that are not a valid record or frame. `position` is relative to the buffer."""

    def __init__(self, detail: str, position: int = 0) -> None:
        self.detail = detail
        self.position = position
        super().__init__(f"{detail} (at byte {position})")


class TruncatedRecord(FormatError):
    """The buffer ends before the header or payload does (a torn write, or a short read)."""


class BadMagic(FormatError):
    """The first bytes are not the magic: not a record, or an overwritten one."""


class BadVersion(FormatError):
    """A version (or flags) this code does not understand."""


class BadChecksum(FormatError):
    """A CRC does not match the bytes it covers."""


@entry_value
class RecordHeader:
    lsn: int
    first_offset: int
    row_count: int
    timestamp_ms: int
    payload_len: int
    payload_crc: int

    @property
    def record_size(self) -> int:
        """Header plus payload, in bytes."""
        return HEADER_SIZE + self.payload_len


def _nbytes(data: bytes | memoryview) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


def parts_nbytes(parts: Sequence[bytes | memoryview]) -> int:
    """The length of the concatenation of `parts` (a body written without joining them)."""
    return sum(_nbytes(part) for part in parts)


def encode_record(
    lsn: int,
    first_offset: int,
    row_count: int,
    timestamp_ms: int,
    payload: bytes | memoryview,
) -> list[bytes | memoryview]:
    """[header, payload] for one record, ready for `os.writev` (the payload is not copied)."""
    return encode_record_with_header(lsn, first_offset, row_count, timestamp_ms, payload)[1]


def encode_record_with_header(
    lsn: int,
    first_offset: int,
    row_count: int,
    timestamp_ms: int,
    payload: bytes | memoryview,
) -> tuple[RecordHeader, list[bytes | memoryview]]:
    """`encode_record`'s parts and the header they hold (the writer indexes it without
    decoding it again)."""
    payload_len = _nbytes(payload)
    assert lsn >= 1, lsn
    assert lsn <= _U64_MAX, lsn
    assert first_offset >= 0, first_offset
    assert first_offset <= _U64_MAX, first_offset
    assert row_count >= 1, row_count
    assert row_count <= _U32_MAX, row_count
    assert timestamp_ms >= _I64_MIN, timestamp_ms
    assert timestamp_ms <= _I64_MAX, timestamp_ms
    assert payload_len <= limits.RECORD_BYTES_MAX, payload_len
    assert not isinstance(payload, memoryview) or payload.contiguous
    payload_crc = crc32(payload)
    fields = _RECORD_FIELDS.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        0,
        0,
        payload_len,
        lsn,
        first_offset,
        row_count,
        timestamp_ms,
        payload_crc,
    )
    header = fields + _CRC.pack(crc32(fields))
    meant = RecordHeader(lsn, first_offset, row_count, timestamp_ms, payload_len, payload_crc)
    # Pair assertion: what we write must read back as what we meant.
    assert decode_header(header) == meant
    return meant, [header, payload]


def decode_header(data: bytes | memoryview) -> RecordHeader:
    """Decode and validate the header at the start of `data` (extra bytes are ignored).

    Raises TruncatedRecord (fewer than HEADER_SIZE bytes), BadMagic, BadVersion, BadChecksum
    (header_crc), or FormatError (a field out of range under a valid CRC).
    """
    if _nbytes(data) < HEADER_SIZE:
        raise TruncatedRecord(f"header needs {HEADER_SIZE} bytes, have {_nbytes(data)}")
    (
        magic,
        version,
        flags,
        reserved,
        payload_len,
        lsn,
        first_offset,
        row_count,
        timestamp_ms,
        payload_crc,
    ) = _RECORD_FIELDS.unpack_from(data, 0)
    if magic != RECORD_MAGIC:
        raise BadMagic(f"bad record magic {bytes(magic)!r}")
    # Version before CRC: a future version may place its CRC elsewhere.
    if version != RECORD_VERSION:
        raise BadVersion(f"unsupported record version {version}", 4)
    (header_crc,) = _CRC.unpack_from(data, _RECORD_FIELDS.size)
    header_crc_actual = crc32(memoryview(data)[: _RECORD_FIELDS.size])
    if header_crc != header_crc_actual:
        raise BadChecksum(
            f"header crc {header_crc:#010x} != computed {header_crc_actual:#010x}",
            _RECORD_FIELDS.size,
        )
    if flags != 0 or reserved != 0:
        raise BadVersion(f"unsupported record flags={flags} reserved={reserved}", 5)
    if payload_len > limits.RECORD_BYTES_MAX:
        raise FormatError(f"payload_len {payload_len} > {limits.RECORD_BYTES_MAX}", 8)
    if lsn < 1:
        raise FormatError(f"lsn {lsn} < 1", 12)
    if row_count < 1:
        raise FormatError(f"row_count {row_count} < 1", 28)
    return RecordHeader(lsn, first_offset, row_count, timestamp_ms, payload_len, payload_crc)


def check_payload(header: RecordHeader, payload: bytes | memoryview) -> None:
    """Raise TruncatedRecord if `payload` is not exactly header.payload_len bytes, BadChecksum
    if its CRC differs. Positions are relative to the record start."""
    size = _nbytes(payload)
    if size != header.payload_len:
        raise TruncatedRecord(f"payload has {size} bytes, header says {header.payload_len}")
    payload_crc = crc32(payload)
    if payload_crc != header.payload_crc:
        raise BadChecksum(
            f"payload crc {payload_crc:#010x} != header {header.payload_crc:#010x}", HEADER_SIZE
        )


def decode_record(data: bytes | memoryview) -> tuple[RecordHeader, memoryview]:
    """Decode and fully check the record at the start of `data`: (header, payload view).
    Bytes after the record are ignored. Raises the FormatError subclasses above."""
    header = decode_header(data)
    view = memoryview(data)
    if view.nbytes < header.record_size:
        raise TruncatedRecord(f"record needs {header.record_size} bytes, have {view.nbytes}")
    payload = view[HEADER_SIZE : header.record_size]
    check_payload(header, payload)
    return header, payload


def encode_frame(kind: bytes, body: bytes) -> bytes:
    """A self-checking file image: frame header (with `kind`) followed by `body`."""
    frame = frame_header(kind, (body,)) + body
    assert decode_frame(frame, kind) == body  # Pair assertion.
    return frame


def frame_header(kind: bytes, body: Sequence[bytes | memoryview]) -> bytes:
    """The header of the frame whose body is the concatenation of `body`'s parts: written
    before them, it makes the frame `encode_frame` would, without joining the parts (a
    checkpoint's body holds a Raft entry of up to ENTRY_BYTES_MAX)."""
    assert len(kind) == 4, kind
    body_crc = 0
    for part in body:
        body_crc = crc32(part, body_crc)
    body_len = parts_nbytes(body)
    assert body_len <= _U64_MAX
    fields = _FRAME_FIELDS.pack(FRAME_MAGIC, kind, FRAME_VERSION, body_len, body_crc)
    return fields + _CRC.pack(crc32(fields))


def decode_frame(data: bytes | memoryview, kind: bytes) -> bytes:
    """The body of a frame written by `encode_frame(kind, body)`. Raises TruncatedRecord,
    BadMagic, BadVersion, BadChecksum or FormatError (wrong kind, trailing bytes)."""
    assert len(kind) == 4, kind
    size = _nbytes(data)
    if size < FRAME_HEADER_SIZE:
        raise TruncatedRecord(f"frame header needs {FRAME_HEADER_SIZE} bytes, have {size}")
    magic, kind_actual, version, body_len, body_crc = _FRAME_FIELDS.unpack_from(data, 0)
    if magic != FRAME_MAGIC:
        raise BadMagic(f"bad frame magic {bytes(magic)!r}")
    if version != FRAME_VERSION:
        raise BadVersion(f"unsupported frame version {version}", 8)
    view = memoryview(data)
    (header_crc,) = _CRC.unpack_from(data, _FRAME_FIELDS.size)
    header_crc_actual = crc32(view[: _FRAME_FIELDS.size])
    if header_crc != header_crc_actual:
        raise BadChecksum(
            f"frame header crc {header_crc:#010x} != computed {header_crc_actual:#010x}",
            _FRAME_FIELDS.size,
        )
    if kind_actual != kind:
        raise FormatError(f"frame kind {bytes(kind_actual)!r}, expected {kind!r}", 4)
    if size - FRAME_HEADER_SIZE < body_len:
        raise TruncatedRecord(f"frame body needs {body_len} bytes, have {size - FRAME_HEADER_SIZE}")
    if size - FRAME_HEADER_SIZE > body_len:
        raise FormatError(
            f"{size - FRAME_HEADER_SIZE - body_len} bytes after the frame body",
            FRAME_HEADER_SIZE + body_len,
        )
    body = view[FRAME_HEADER_SIZE:]
    body_crc_actual = crc32(body)
    if body_crc != body_crc_actual:
        raise BadChecksum(
            f"frame body crc {body_crc_actual:#010x} != header {body_crc:#010x}",
            FRAME_HEADER_SIZE,
        )
    return bytes(body)
