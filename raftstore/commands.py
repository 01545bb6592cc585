"""The commands of a Raft group and their binary encoding: the only bytes in the Raft log.

Every entry is a versioned, explicit encoding (never pickle), so an old log means the same
thing to a newer node:

    entry        = version:u8 (=1) | kind:u8 | body
    string       = length:u16 | UTF-8 bytes
    blob         = length:u32 | bytes
    int fields   = little-endian, fixed width (i64 unless noted)

    CreateTable  = table:string | schema_ipc:blob | cache_limit:i64 |
                   has_key:u8 (0|1) | [key_column:string] | retention_minutes:i64
    DropTable    = table:string | force:u8 (0|1)
    Append       = timestamp_ms:i64 | item_count:u32 | item * item_count
      item       = table:string | producer_id_length:u8 (0|16) | producer_id |
                   sequence:u64 | payload:blob (an Arrow IPC *stream*)
    AppendFlagged = timestamp_ms:i64 | item_count:u32 | flagged_item * item_count
      flagged_item = table:string | producer_id_length:u8 (0|16) | producer_id |
                   sequence:u64 | flags:u8 | payload:blob
      flags      = bit 0: contiguous (a pipelined publish); bits 1-7: zero
    CommitOffset = topic:string | offset:i64
    RemoveOffset = topic:string
    Noop         = (empty)
    ClaimName    = table:string | group_id:u32 | nonce:16 bytes
    ReleaseName  = table:string | group_id:u32 | nonce:16 bytes
    PutUser      = user:string | password_hash:blob | admin:u8 (0|1) | mode:u8 (0|1|2)
    DeleteUser   = user:string
    SetRule      = user:string | privilege:u8 (1|2) | table:string | effect:u8 (0|1|2)

ClaimName and ReleaseName are proposed only in the catalog group (the lowest configured
group id), whose state machine holds which group owns each table name (catalog.py); so are
PutUser, DeleteUser and SetRule, the users and grants (access.py). A PutUser carries a
salted scrypt hash computed by the proposing leader, never the password.

An Append is written as kind APPEND (3) when no item carries a flag, byte for byte as before
flags existed, and as kind APPEND_FLAGGED (7) otherwise: entries written before the flag
decode unchanged, and unary publishes still write entries an older node reads. A node that
does not know kind 7 cannot apply it: upgrade every node before clients publish pipelined.

The encoding is canonical: `encode(decode(data)) == data` for every `data` that decodes
(so an APPEND_FLAGGED entry without any flagged item is refused).

A payload blob may end with the proposing leader's seal (an item's `seal`, written after its
payload inside the blob; checked_payload.py): not a field of the encoding, a decoded item's
payload holds it, and a node that does not know seals reads the payload only up to its
Arrow end-of-stream marker, which a sealed payload ends with.
Pure: no I/O; safe on any thread.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Final, TypeVar

from hastream.errors import InvalidArgument
from raftstore.values import entry_value

VERSION: Final = 1
PRODUCER_ID_BYTES: Final = 16

_HEADER: Final = struct.Struct("<BB")
_U8: Final = struct.Struct("<B")
_U16: Final = struct.Struct("<H")
_U32: Final = struct.Struct("<I")
_I64: Final = struct.Struct("<q")
_U64: Final = struct.Struct("<Q")

# Fixed runs of an Append, each read with one unpack: timestamp_ms and item_count; an item's
# sequence and payload length, with its flags between them in an APPEND_FLAGGED entry.
_TIMESTAMP_COUNT: Final = struct.Struct("<qI")
_SEQUENCE_LENGTH: Final = struct.Struct("<QI")
_SEQUENCE_FLAGS_LENGTH: Final = struct.Struct("<QBI")

_STRING_BYTES_MAX: Final = 0xFFFF
_BLOB_BYTES_MAX: Final = 0xFFFF_FFFF
_FLAG_CONTIGUOUS: Final = 0x01
_FLAGS_KNOWN: Final = _FLAG_CONTIGUOUS

# Bytes of an Append entry besides its items: header, timestamp_ms, item_count.
APPEND_OVERHEAD_BYTES: Final = _HEADER.size + _I64.size + _U32.size


class Kind(enum.IntEnum):
    """The kind byte. Values are part of the log format: never renumber, only add."""

    CREATE_TABLE = 1
    DROP_TABLE = 2
    APPEND = 3
    COMMIT_OFFSET = 4
    REMOVE_OFFSET = 5
    NOOP = 6
    APPEND_FLAGGED = 7
    CLAIM_NAME = 8
    RELEASE_NAME = 9
    PUT_USER = 10
    DELETE_USER = 11
    SET_RULE = 12


_APPEND_KINDS: Final = frozenset((Kind.APPEND, Kind.APPEND_FLAGGED))


class UserMode(enum.IntEnum):
    """What a PutUser does (part of the log format)."""

    CREATE = 0  # a new user; UserExists if the name is taken
    RESET = 1  # a new password for an existing user; UserNotFound otherwise
    BOOTSTRAP = 2  # the first admin: a no-op once any user exists


class Privilege(enum.IntEnum):
    """A per-table privilege (part of the log format)."""

    TABLE_READ = 1  # subscribe, read, table info, commit and read own offsets
    TABLE_WRITE = 2  # publish


class RuleEffect(enum.IntEnum):
    """What a SetRule does to (user, privilege, table) (part of the log format)."""

    REVOKE = 0  # remove the grant or denial
    GRANT = 1
    DENY = 2  # beats any grant, including one on "*"


@dataclass(frozen=True, slots=True)
class CreateTable:
    table: str
    schema_ipc: bytes  # pyarrow `Schema.serialize()` (an IPC stream's schema is accepted too)
    cache_limit: int
    key_column: str | None
    retention_minutes: int


@dataclass(frozen=True, slots=True)
class DropTable:
    table: str
    force: bool


@entry_value
class AppendItem:
    table: str
    producer_id: bytes  # b"" (no producer dedup) or exactly PRODUCER_ID_BYTES bytes.
    sequence: int  # 0 <= sequence < 2**64; meaningful only with a producer_id.
    # Arrow IPC stream bytes. After decode(): a zero-copy slice of the entry's buffer.
    payload: bytes | memoryview
    # Set by pipelined publishes: a sequence above the producer's last applied one + 1 is
    # refused (SequenceGap) instead of applied, so a resend of a failed request can never
    # land after a later one (state_machine.py). Ignored without a producer_id.
    contiguous: bool = False
    # The leader's seal on the payload it checked (checked_payload.py), written right after
    # it inside the same blob: a decoded item's `payload` holds both, and this is b"".
    seal: bytes = b""


@entry_value
class Append:
    timestamp_ms: int  # Stamped by the leader before proposing; apply never reads a clock.
    items: tuple[AppendItem, ...]


@dataclass(frozen=True, slots=True)
class CommitOffset:
    topic: str
    offset: int


@dataclass(frozen=True, slots=True)
class RemoveOffset:
    topic: str


@dataclass(frozen=True, slots=True)
class Noop:
    pass


NONCE_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class ClaimName:
    """Reserve `table` cluster-wide for raft group `group_id` (catalog group only).
    `nonce` names this claim, so that only its own release can undo it."""

    table: str
    group_id: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class ReleaseName:
    """Undo the claim of `table` by `group_id` if it still carries `nonce`."""

    table: str
    group_id: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class PutUser:
    user: str
    password_hash: bytes  # passwords.hash_password's encoding
    admin: bool
    mode: UserMode


@dataclass(frozen=True, slots=True)
class DeleteUser:
    user: str


@dataclass(frozen=True, slots=True)
class SetRule:
    """Grant, deny or revoke `privilege` on `table` ("*": every table) for `user`."""

    user: str
    privilege: Privilege
    table: str
    effect: RuleEffect


Command = (
    CreateTable
    | DropTable
    | Append
    | CommitOffset
    | RemoveOffset
    | Noop
    | ClaimName
    | ReleaseName
    | PutUser
    | DeleteUser
    | SetRule
)


# ---------------------------------------------------------------------------------------
# encode


def _invalid(detail: str) -> InvalidArgument:
    return InvalidArgument("command", detail)


def _string(text: str) -> bytes:
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _invalid(f"string {text!r} is not encodable as UTF-8: {error}") from None
    if len(data) > _STRING_BYTES_MAX:
        raise _invalid(f"string of {len(data)} bytes > {_STRING_BYTES_MAX}")
    return _U16.pack(len(data)) + data


def _blob_length(blob: bytes | memoryview) -> bytes:
    return _blob_length_of(memoryview(blob).nbytes)


def _blob_length_of(size: int) -> bytes:
    if size > _BLOB_BYTES_MAX:
        raise _invalid(f"blob of {size} bytes > {_BLOB_BYTES_MAX}")
    return _U32.pack(size)


def _pack(packer: struct.Struct, value: int, field: str) -> bytes:
    try:
        return packer.pack(value)
    except struct.error:
        raise _invalid(f"{field}={value!r} does not fit {packer.format}") from None


def _header(kind: Kind) -> bytes:
    return _HEADER.pack(VERSION, kind)


def _encode_item(item: AppendItem, parts: list[bytes | memoryview], *, flagged: bool) -> None:
    if len(item.producer_id) not in (0, PRODUCER_ID_BYTES):
        raise _invalid(f"producer_id of {len(item.producer_id)} bytes; want 0 or 16")
    parts.append(_string(item.table))
    parts.append(_U8.pack(len(item.producer_id)))
    parts.append(item.producer_id)
    parts.append(_pack(_U64, item.sequence, "sequence"))
    if flagged:
        parts.append(_U8.pack(_FLAG_CONTIGUOUS if item.contiguous else 0))
    if item.seal:
        parts.append(_blob_length_of(memoryview(item.payload).nbytes + len(item.seal)))
        parts.append(item.payload)
        parts.append(item.seal)
        return
    parts.append(_blob_length(item.payload))
    parts.append(item.payload)


def encoded_item_bytes(item: AppendItem, *, flagged: bool | None = None) -> int:
    """Exact bytes `item` adds to an Append entry (for packing entries up to a size).
    `flagged`: whether the entry has any contiguous item (then every item spends one more
    byte, its flags); by default, whether `item` is contiguous."""
    flagged = item.contiguous if flagged is None else flagged
    return (
        len(_string(item.table))
        + _U8.size
        + len(item.producer_id)
        + _U64.size
        + (_U8.size if flagged else 0)
        + _U32.size
        + memoryview(item.payload).nbytes
        + len(item.seal)
    )


def append_parts(command: Append) -> list[bytes | memoryview]:
    """`encode(command)` as the parts it joins, the payloads among them as given: a replica
    that frames the command its own way joins them once, with its framing (replica.py)."""
    flagged = any(item.contiguous for item in command.items)
    parts: list[bytes | memoryview] = [
        _header(Kind.APPEND_FLAGGED if flagged else Kind.APPEND),
        _pack(_I64, command.timestamp_ms, "timestamp_ms"),
        _pack(_U32, len(command.items), "item_count"),
    ]
    for item in command.items:
        _encode_item(item, parts, flagged=flagged)
    return parts


def encode(command: Command) -> bytes:
    """The entry bytes of `command`. Raises InvalidArgument("command", ...) for a value the
    format cannot hold (string > 65535 bytes, int out of range, bad producer_id length).
    Payloads are copied exactly once (one b"".join)."""
    match command:
        case Append():
            return b"".join(append_parts(command))
        case CreateTable():
            key = (
                _U8.pack(0)
                if command.key_column is None
                else _U8.pack(1) + _string(command.key_column)
            )
            return b"".join(
                (
                    _header(Kind.CREATE_TABLE),
                    _string(command.table),
                    _blob_length(command.schema_ipc),
                    command.schema_ipc,
                    _pack(_I64, command.cache_limit, "cache_limit"),
                    key,
                    _pack(_I64, command.retention_minutes, "retention_minutes"),
                )
            )
        case DropTable(table=table, force=force):
            return _header(Kind.DROP_TABLE) + _string(table) + _U8.pack(1 if force else 0)
        case CommitOffset(topic=topic, offset=offset):
            return _header(Kind.COMMIT_OFFSET) + _string(topic) + _pack(_I64, offset, "offset")
        case RemoveOffset(topic=topic):
            return _header(Kind.REMOVE_OFFSET) + _string(topic)
        case Noop():
            return _header(Kind.NOOP)
        case ClaimName(table=table, group_id=group_id, nonce=nonce):
            return _encode_name(Kind.CLAIM_NAME, table, group_id, nonce)
        case ReleaseName(table=table, group_id=group_id, nonce=nonce):
            return _encode_name(Kind.RELEASE_NAME, table, group_id, nonce)
        case PutUser():
            return b"".join(
                (
                    _header(Kind.PUT_USER),
                    _string(command.user),
                    _blob_length(command.password_hash),
                    command.password_hash,
                    _U8.pack(1 if command.admin else 0),
                    _U8.pack(UserMode(command.mode)),
                )
            )
        case DeleteUser(user=user):
            return _header(Kind.DELETE_USER) + _string(user)
        case SetRule():
            return b"".join(
                (
                    _header(Kind.SET_RULE),
                    _string(command.user),
                    _U8.pack(Privilege(command.privilege)),
                    _string(command.table),
                    _U8.pack(RuleEffect(command.effect)),
                )
            )
    raise AssertionError(f"not a command: {type(command).__name__}")


def _encode_name(kind: Kind, table: str, group_id: int, nonce: bytes) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise _invalid(f"nonce of {len(nonce)} bytes; want {NONCE_BYTES}")
    return _header(kind) + _string(table) + _pack(_U32, group_id, "group_id") + nonce


# ---------------------------------------------------------------------------------------
# decode


class _Reader:
    """A cursor over the entry. Every read checks bounds first, so a short buffer raises
    InvalidArgument, never struct.error or IndexError."""

    __slots__ = ("_position", "_view")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._position = 0

    def take(self, size: int) -> memoryview:
        start = self._position
        end = start + size
        if end > len(self._view):
            raise _invalid(
                f"truncated at byte {start}: need {size} bytes, have {len(self._view) - start}"
            )
        self._position = end
        return self._view[start:end]

    def integer(self, unpacker: struct.Struct) -> int:
        return self.fields(unpacker)[0]

    def fields(self, unpacker: struct.Struct) -> tuple[int, ...]:
        values: tuple[int, ...] = unpacker.unpack(self.take(unpacker.size))
        return values

    def flag(self, field: str) -> bool:
        value = self.integer(_U8)
        if value > 1:
            raise _invalid(f"{field} flag is {value}; want 0 or 1")
        return value == 1

    def string(self, field: str) -> str:
        data = self.take(self.integer(_U16))
        try:
            return str(data, "utf-8")
        except UnicodeDecodeError as error:
            raise _invalid(f"{field} is not valid UTF-8: {error}") from None

    def blob(self) -> memoryview:
        return self.take(self.integer(_U32))

    def finish(self) -> None:
        trailing = len(self._view) - self._position
        if trailing:
            raise _invalid(f"{trailing} trailing bytes after the command")


def _decode_item(reader: _Reader, *, flagged: bool) -> AppendItem:
    table = reader.string("table")
    producer_id_bytes = reader.integer(_U8)
    if producer_id_bytes not in (0, PRODUCER_ID_BYTES):
        raise _invalid(f"producer_id of {producer_id_bytes} bytes; want 0 or 16")
    producer_id = bytes(reader.take(producer_id_bytes)) if producer_id_bytes else b""
    contiguous = False
    if flagged:
        sequence, flags, size = reader.fields(_SEQUENCE_FLAGS_LENGTH)
        if flags & ~_FLAGS_KNOWN:
            raise _invalid(f"item flags 0x{flags:02x} has unknown bits")
        contiguous = bool(flags & _FLAG_CONTIGUOUS)
    else:
        sequence, size = reader.fields(_SEQUENCE_LENGTH)
    return AppendItem(table, producer_id, sequence, reader.take(size), contiguous)


def _decode_append(reader: _Reader, *, flagged: bool) -> Append:
    timestamp_ms, count = reader.fields(_TIMESTAMP_COUNT)
    items = tuple(_decode_item(reader, flagged=flagged) for _ in range(count))
    if flagged and not any(item.contiguous for item in items):
        raise _invalid("APPEND_FLAGGED entry without a flagged item (not canonical)")
    return Append(timestamp_ms, items)


def _decode_body(kind: int, reader: _Reader) -> Command:
    if kind in _APPEND_KINDS:
        return _decode_append(reader, flagged=kind == Kind.APPEND_FLAGGED)
    if kind == Kind.CREATE_TABLE:
        table = reader.string("table")
        schema_ipc = bytes(reader.blob())
        cache_limit = reader.integer(_I64)
        key_column = reader.string("key_column") if reader.flag("key_column") else None
        return CreateTable(table, schema_ipc, cache_limit, key_column, reader.integer(_I64))
    if kind == Kind.DROP_TABLE:
        return DropTable(reader.string("table"), reader.flag("force"))
    if kind == Kind.COMMIT_OFFSET:
        return CommitOffset(reader.string("topic"), reader.integer(_I64))
    if kind == Kind.REMOVE_OFFSET:
        return RemoveOffset(reader.string("topic"))
    if kind == Kind.NOOP:
        return Noop()
    if kind in (Kind.CLAIM_NAME, Kind.RELEASE_NAME):
        table = reader.string("table")
        group_id = reader.integer(_U32)
        nonce = bytes(reader.take(NONCE_BYTES))
        if kind == Kind.CLAIM_NAME:
            return ClaimName(table, group_id, nonce)
        return ReleaseName(table, group_id, nonce)
    if kind == Kind.PUT_USER:
        user = reader.string("user")
        password_hash = bytes(reader.blob())
        admin = reader.flag("admin")
        return PutUser(user, password_hash, admin, _enum(UserMode, reader.integer(_U8), "mode"))
    if kind == Kind.DELETE_USER:
        return DeleteUser(reader.string("user"))
    if kind == Kind.SET_RULE:
        user = reader.string("user")
        privilege = _enum(Privilege, reader.integer(_U8), "privilege")
        table = reader.string("table")
        return SetRule(user, privilege, table, _enum(RuleEffect, reader.integer(_U8), "effect"))
    raise _invalid(f"unknown kind {kind}")


E = TypeVar("E", bound=enum.IntEnum)


def _enum(cls: type[E], value: int, field: str) -> E:
    try:
        return cls(value)
    except ValueError:
        raise _invalid(f"{field} {value} is not one of {[int(v) for v in cls]}") from None


def is_append(data: bytes | memoryview, start: int = 0) -> bool:
    """Whether the entry bytes at `data[start:]` hold an Append (either kind), read from
    the kind byte after the version byte alone, without decoding the entry (replication's
    commit notices ask it of every applied entry)."""
    index = start + _U8.size  # the kind byte follows the version byte (_HEADER)
    return len(data) > index and data[index] in _APPEND_KINDS


def decode(data: bytes | memoryview) -> Command:
    """The command in entry bytes `data`. Payloads are zero-copy memoryviews into `data`
    (the caller keeps `data` alive and unchanged while they are used). Any malformed input
    raises InvalidArgument("command", detail) and nothing else."""
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    reader = _Reader(view)
    version, kind = reader.fields(_HEADER)
    if version != VERSION:
        raise _invalid(f"unknown version {version}; this node reads version {VERSION}")
    command = _decode_body(kind, reader)
    reader.finish()
    return command
