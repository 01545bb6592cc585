"""A leader's seal on a publish payload it checked, so that replicas apply it unread.

Every replica must decide an entry from the entry alone, so each one reads and validates
every publish's Arrow IPC payload in its apply. On a follower that read was the largest
part of a one-row append's apply (~34 us of ~140 in a node, pyarrow's code and data cold
between appends; docs/benchmark.md), for a decision the leader had already made on the same
bytes before proposing them.

The leader now says so in the entry: after a payload it checked it writes a seal (below),
inside the same blob, naming the table incarnation it checked the payload against (the
table's `created_lsn`), the rows, and where the one record batch message lies in the
payload. A replica takes a sealed payload as checked, without reading it, only when the
seal's tag verifies and names the incarnation the table has at that entry, so the decision
is still made from the entry and the replica's state alone, the same on every replica: a
table dropped and created again between the check and the apply reads the payload, as
does a seal that does not verify (bytes a client sent, a node of another secret).

Why a seal after the payload, and not a new item flag: a node of the version before this one
refuses unknown item flags (it would record a no-op where a newer replica applies the rows:
the replicas would diverge during a rolling upgrade), while it reads a payload only up to
the Arrow end-of-stream marker and ignores what follows. So the leader seals only payloads
that end with that marker, and an older node reads a sealed payload exactly as it read the
unsealed one: same rows, same error (none: a sealed payload passed the leader's check),
same data-file record (the message's bytes as sent).

The tag: keyed BLAKE2b (a MAC as it is, RFC 7693), 16 bytes, keyed by a key derived from
the cluster secret, over the group, the table, the seal's fields and the length and CRC-32
of the payload before it. A client does not know the key, so it cannot make a seal that
verifies; a node that cannot verify one reads the payload. HMAC-SHA256 (OpenSSL's) cost
12-15 us per seal made or opened in a node against ~1.3 us in a loop (its code cold between
appends); keyed BLAKE2b is CPython's own, 0.5 us in a loop. The CRC grows with the payload:
~1.3 us for 64 KiB.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final, NamedTuple

from hastream.checksum import crc32

_MAGIC: Final = b"HSSEAL01"
# The checked table incarnation (created_lsn), the rows, and the record batch message's
# [start, end) in the payload.
_FIELDS: Final = struct.Struct("<QIII")
_SIGNED: Final = struct.Struct("<IQI")  # group, payload length, payload CRC-32
_TAG_BYTES: Final = 16
SEAL_BYTES: Final = len(_MAGIC) + _FIELDS.size + _TAG_BYTES
_FIELDS_AT: Final = len(_MAGIC)
_TAG_AT: Final = _FIELDS_AT + _FIELDS.size
_KEY_SALT: Final = b"hastream-payload-seal-v1"


class Seal(NamedTuple):
    rows: int
    start: int  # the record batch message, an encapsulated IPC message, at [start, end)
    end: int


def seal_key(peer_key: bytes) -> bytes:
    """The seals' HMAC key, derived from the key of peer RPCs (peer_auth.peer_key): a key of
    its own, as each use of the secret has."""
    return hmac.digest(peer_key, _KEY_SALT, "sha256")


def _tag(key: bytes, group_id: int, table: str, fields: bytes, payload: memoryview) -> bytes:
    signed = _SIGNED.pack(group_id, payload.nbytes, crc32(payload))
    message = b"".join((table.encode(), b"\0", fields, signed))
    return hashlib.blake2b(message, key=key, digest_size=_TAG_BYTES).digest()


def seal(
    key: bytes,
    group_id: int,
    table: str,
    created_lsn: int,
    payload: bytes | memoryview,
    found: Seal,
) -> bytes:
    """The seal to write after `payload`, which the leader found valid for the table
    incarnation `created_lsn` of `table`, holding `found`."""
    view = memoryview(payload)
    assert found.rows > 0, found
    assert 0 <= found.start < found.end <= view.nbytes, found
    fields = _FIELDS.pack(created_lsn, *found)
    return b"".join((_MAGIC, fields, _tag(key, group_id, table, fields, view)))


def opened(
    key: bytes, group_id: int, table: str, created_lsn: int, blob: bytes | memoryview
) -> tuple[memoryview, Seal] | None:
    """(the payload, what its seal says) when `blob` ends with a seal that verifies and names
    the table incarnation `created_lsn`; else None (read the whole blob, as an older node does)."""
    view = memoryview(blob)
    size = view.nbytes - SEAL_BYTES
    if size <= 0:
        return None
    trailer = bytes(view[size:])
    if not trailer.startswith(_MAGIC):
        return None
    fields = trailer[_FIELDS_AT:_TAG_AT]
    checked_lsn, rows, start, end = _FIELDS.unpack(fields)
    if checked_lsn != created_lsn or not (rows > 0 and 0 <= start < end <= size):
        return None
    payload = view[:size]
    if not hmac.compare_digest(_tag(key, group_id, table, fields, payload), trailer[_TAG_AT:]):
        return None
    return payload, Seal(rows, start, end)
