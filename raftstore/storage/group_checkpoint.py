"""The layout of a group checkpoint file. Pure: bytes in, bytes out.

A checkpoint is one checksummed frame (kind `GCKP`, `format.encode_frame`; written and read
atomically by `storage/checkpoint.py`) whose body is, little-endian:

    0  version      u32 = 2
    4  lsn          u64: the last entry the state includes
    12 state_len    u32
    16 state        the applier's snapshot (state_machine.snapshot(): JSON)
       trailer_len  u32
       trailer      the replica's own bytes, opaque here: what its log library needs to
                    resume after the checkpoint (pysyncobj: its last two entries;
                    the local replica: nothing)

The trailer keeps the replica's needs out of the applier: the applier writes and reads
only `lsn` and `state`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from raftstore.storage.format import FormatError, parts_nbytes

KIND: Final = b"GCKP"
VERSION: Final = 2
_HEADER: Final = struct.Struct("<IQI")  # version, lsn, state length
_LENGTH: Final = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class GroupCheckpoint:
    lsn: int
    state: bytes
    trailer: bytes


def encode(checkpoint: GroupCheckpoint) -> bytes:
    return b"".join(encode_parts(checkpoint.lsn, checkpoint.state, (checkpoint.trailer,)))


def encode_parts(
    lsn: int, state: bytes, trailer: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """The body of a checkpoint whose trailer is the concatenation of `trailer`'s parts, as
    parts to write one after the other (storage/checkpoint.write_atomic), not joined: a
    Raft replica's trailer holds an entry of up to ENTRY_BYTES_MAX."""
    trailer_length = parts_nbytes(trailer)
    return [
        _HEADER.pack(VERSION, lsn, len(state)),
        state,
        _LENGTH.pack(trailer_length),
        *trailer,
    ]


def decode(body: bytes) -> GroupCheckpoint:
    """Raises FormatError on anything but what `encode` wrote (the frame's CRC already
    vouches for the bytes; this guards against a layout from another version)."""
    if len(body) < _HEADER.size:
        raise FormatError(f"checkpoint body of {len(body)} bytes is shorter than its header")
    version, lsn, state_length = _HEADER.unpack_from(body, 0)
    if version != VERSION:
        raise FormatError(f"checkpoint layout version {version}; this node reads {VERSION}")
    position = _HEADER.size
    state = body[position : position + state_length]
    position += state_length
    if len(state) != state_length or position + _LENGTH.size > len(body):
        raise FormatError("checkpoint state runs past the end of the body", position)
    (trailer_length,) = _LENGTH.unpack_from(body, position)
    position += _LENGTH.size
    trailer = body[position : position + trailer_length]
    if len(trailer) != trailer_length or position + trailer_length != len(body):
        raise FormatError("checkpoint trailer length does not match the body", position)
    return GroupCheckpoint(lsn=lsn, state=state, trailer=trailer)
