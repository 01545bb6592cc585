"""The replicated state of one Raft group, pure and deterministic.

`GroupStateMachine.apply(lsn, command)` decides; it performs no I/O. It returns the effects
the shell must perform, in order, before answering the client (create or drop a table's
files, append records), and a result that is the same on every replica. Operating errors
(unknown table, schema mismatch...) are results, never raised, so every replica takes the
same path. Everything apply needs travels in the command: the leader stamps the time.

State per group: tables (meta, row count, last LSN, key window), topic offsets, producer
window. `snapshot()` / `restore()` carry all of it except the key windows, which the shell
rebuilds after a restore from the table's last rows (`key_window_range`,
`rebuild_key_window`), so checkpoints stay small.

Threads: `apply`, `snapshot`, `rebuild_key_window` run on the group's apply thread (the
Raft tick thread). `validate_append` / `validate_create` and the read accessors may be called
from other threads: they only read immutable metadata through single dict lookups.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import pyarrow as pa

from hastream.errors import (
    BatchTooLarge,
    EmptyBatch,
    InvalidArgument,
    RaftStoreError,
    SchemaMismatch,
    SequenceGap,
    TableExists,
    TableNotFound,
    TopicNotFound,
)
from raftstore import checked_payload, limits
from raftstore.access import AccessControl
from raftstore.batch_memory import cached_bytes
from raftstore.check_memo import CheckMemo
from raftstore.commands import (
    Append,
    AppendItem,
    ClaimName,
    Command,
    CommitOffset,
    CreateTable,
    DeleteUser,
    DropTable,
    Noop,
    PutUser,
    ReleaseName,
    RemoveOffset,
    SetRule,
)
from raftstore.dedup import KeyWindow, ProducerRecord, ProducerWindow
from raftstore.values import entry_value

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT: Final = 1
_TABLE_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# What pyarrow raises on bytes that are not what they claim to be.
_ARROW_ERRORS: Final = (pa.ArrowException, ValueError, OSError)
_END_OF_STREAM: Final = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # continuation, length 0
# Consecutive small batches of one table in one entry are written as one data-file record
# (one IPC serialize, one CRC, one write instead of one per 1-row publish), up to this size.
_MERGE_BYTES_MAX: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class TableMeta:
    table: str
    schema: pa.Schema
    schema_ipc: bytes
    cache_limit: int
    key_column: str | None
    retention_minutes: int
    created_lsn: int
    # Indexes of the columns that must not hold nulls (checked on every publish: a walk over
    # the schema's fields costs ~1 us per column, which dominates a 1-row publish).
    non_nullable: tuple[int, ...]
    # The bytes an Arrow IPC stream of this schema starts with (its schema message) as this
    # pyarrow writes it; b"" for schemas with dictionary columns. A payload that starts with
    # them is read without decoding its schema again (`_read_stream`).
    stream_prefix: bytes


def _non_nullable(schema: pa.Schema) -> tuple[int, ...]:
    return tuple(index for index, field in enumerate(schema) if not field.nullable)


def _stream_prefix(schema: pa.Schema) -> bytes:
    if any(pa.types.is_dictionary(field.type) for field in schema):
        return b""  # dictionary batches would follow the schema: use the full reader
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema):
        pass
    stream: bytes = sink.getvalue().to_pybytes()
    assert stream.endswith(_END_OF_STREAM), "an empty IPC stream ends with the EOS marker"
    return stream[: -len(_END_OF_STREAM)]


# Effects: the shell performs them, in order, before answering the client.


@dataclass(frozen=True, slots=True)
class CreateTableFiles:
    meta: TableMeta


@dataclass(frozen=True, slots=True)
class DropTableFiles:
    table: str
    created_lsn: int  # the incarnation: a re-created table of the same name has its own files


@entry_value
class AppendRecords:
    """Rows `[first_offset, first_offset + batch.num_rows)` of `table`, carried by entry
    `lsn`. `batch` has exactly the table's schema; it may be a zero-copy view into the
    entry's bytes, so the shell keeps the entry alive (or copies) while it holds the batch.
    One entry can yield several AppendRecords for one table (same lsn, contiguous
    offsets): a replay should skip by offset, not by LSN alone. Consecutive small batches
    of one table in one entry are joined into one (`_merged`)."""

    table: str
    lsn: int
    first_offset: int
    batch: pa.RecordBatch | None
    timestamp_ms: int
    # The batch as an encapsulated IPC message, when the publish carried it so (a view of
    # the entry's bytes): the data file writes it instead of serializing the batch again.
    encoded: memoryview | None = None
    # The rows of a sealed publish taken unread (checked_payload.py): then `batch` is None,
    # `encoded` holds them, and whoever needs the batch decodes `encoded` (the row cache, on
    # a subscriber's first read of it).
    unread_rows: int = 0

    @property
    def row_count(self) -> int:
        return self.batch.num_rows if self.batch is not None else self.unread_rows


Effect = CreateTableFiles | DropTableFiles | AppendRecords


# Results: returned, never raised; the same on every replica.


@entry_value
class ItemResult:
    """One AppendItem's outcome. With `error` set, the offsets are meaningless
    (first_offset -1, counts 0). `duplicate_batch`: a producer retry, answered with the
    stored result of the producer's last item and not applied again (a contiguous retry of
    an older sequence than the last: first_offset -1, counts 0, as its result is not kept)."""

    table: str
    first_offset: int
    row_count: int  # Rows kept (appended), at [first_offset, first_offset + row_count).
    duplicates: int  # Rows dropped by key dedup.
    duplicate_batch: bool
    error: RaftStoreError | None


@entry_value
class AppendResult:
    lsn: int
    items: tuple[ItemResult, ...]


@dataclass(frozen=True, slots=True)
class CommandResult:
    """Outcome of every command but Append. `offset`: the committed offset (CommitOffset)
    or the removed one (RemoveOffset)."""

    lsn: int
    error: RaftStoreError | None
    offset: int | None = None


class Validated(NamedTuple):
    """A publish checked by its leader: its rows, and the seal to propose after it."""

    rows: int
    seal: bytes


@dataclass(frozen=True, slots=True)
class TableView:
    meta: TableMeta
    row_count: int
    lsn_last: int  # LSN of the table's last appended rows (created_lsn before any).


@dataclass(slots=True)
class _Table:
    meta: TableMeta
    row_count: int
    lsn_last: int
    key_window: KeyWindow | None  # None: the table has no key column.
    # After a restore, a keyed table's window is empty until the shell rebuilds it.
    key_window_pending: bool


# ---------------------------------------------------------------------------------------
# Pure helpers: schema and payload checks.


def _read_schema(schema_ipc: bytes) -> pa.Schema:
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(schema_ipc))
    except _ARROW_ERRORS as error:
        raise InvalidArgument("schema", f"not an Arrow IPC schema: {error}") from None
    assert isinstance(schema, pa.Schema)
    return schema


def _key_type_supported(key_type: pa.DataType) -> bool:
    """Key columns need hashable Python values: scalars, not nested types."""
    if pa.types.is_dictionary(key_type):
        key_type = key_type.value_type
    checks = (
        pa.types.is_integer,
        pa.types.is_floating,
        pa.types.is_boolean,
        pa.types.is_string,
        pa.types.is_large_string,
        pa.types.is_string_view,
        pa.types.is_binary,
        pa.types.is_large_binary,
        pa.types.is_binary_view,
        pa.types.is_fixed_size_binary,
        pa.types.is_temporal,
        pa.types.is_decimal,
    )
    return any(check(key_type) for check in checks)


def _check_schema_shape(schema: pa.Schema, key_column: str | None) -> None:
    if len(schema) == 0:
        raise InvalidArgument("schema", "no columns")
    if len(schema) > limits.COLUMNS_MAX:
        raise InvalidArgument("schema", f"{len(schema)} columns > {limits.COLUMNS_MAX}")
    names = schema.names
    if "" in names:
        raise InvalidArgument("schema", f"column {names.index('')} has an empty name")
    if len(set(names)) != len(names):
        duplicated = sorted({name for name in names if names.count(name) > 1})
        raise InvalidArgument("schema", f"duplicate column names {duplicated}")
    if key_column is None:
        return
    if key_column not in names:
        raise InvalidArgument("key_column", f"{key_column!r} is not a column of {names}")
    key_type = schema.field(key_column).type
    if not _key_type_supported(key_type):
        raise InvalidArgument("key_column", f"{key_column!r} has unsupported type {key_type}")


def _check_create(command: CreateTable, *, exists: bool) -> pa.Schema:
    table = command.table
    if not _TABLE_NAME.fullmatch(table) or len(table) > limits.TABLE_NAME_BYTES_MAX:
        raise InvalidArgument(
            "table",
            f"{table!r}: want 1..{limits.TABLE_NAME_BYTES_MAX} characters of [A-Za-z0-9_] "
            "starting with a letter",
        )
    if exists:
        raise TableExists(table)
    if command.cache_limit < 1:
        raise InvalidArgument("cache_limit", f"{command.cache_limit} < 1")
    if command.retention_minutes < 1:
        raise InvalidArgument("retention_minutes", f"{command.retention_minutes} < 1")
    schema = _read_schema(command.schema_ipc)
    _check_schema_shape(schema, command.key_column)
    return schema


@entry_value
class _Checked:
    """A payload's non-empty batches and, when there is one, read message by message with
    the table's schema, its encapsulated IPC message as the publisher encoded it (a view of
    the payload, stored byte for byte: a pyarrow publisher's message is the bytes
    `batch.serialize()` would make again); None when apply must build the batch's bytes."""

    batches: list[pa.RecordBatch]
    sent: memoryview | None = None
    sent_at: int = 0  # where `sent` starts in the payload


# An encapsulated IPC message of the current format starts with this (the legacy format,
# without it, is read too but not stored as sent).
_CONTINUATION: Final = b"\xff\xff\xff\xff"
# Payloads up to this size are kept for apply (check_memo.py) whatever their layout; above
# it, only those that are mostly rows (see validate_publish).
_MEMO_ANY_PAYLOAD_BYTES_MAX: Final = 16 * 1024


def _metadata_bytes(meta: TableMeta) -> int:
    """About what a one-batch payload of `meta`'s table holds besides its rows' buffers: the
    schema message, and the batch message's field nodes and buffer entries (16 bytes each,
    up to three buffers a column), headers and padding."""
    return len(meta.stream_prefix) + 64 * len(meta.schema) + 64


def _read_known_stream(meta: TableMeta, payload: bytes | memoryview) -> _Checked:
    """The non-empty, fully validated batches of an IPC stream whose schema message is
    `meta.stream_prefix`: the record batch messages after it are read with the table's
    schema (4 us instead of 13 us for a 1-row payload; zero-copy like `_read_stream`)."""
    prefix = len(meta.stream_prefix)
    view = memoryview(payload)[prefix:]
    reader = pa.BufferReader(pa.py_buffer(view))
    batches: list[pa.RecordBatch] = []
    sent: memoryview | None = None
    sent_at = 0
    try:
        while reader.tell() < reader.size():  # bounded: every message advances the reader
            start = reader.tell()
            try:
                message = pa.ipc.read_message(reader)
            except EOFError:
                break  # the end-of-stream marker
            if message.type != "record batch":
                raise InvalidArgument("payload", f"unexpected {message.type} message")
            batch = pa.ipc.read_record_batch(message, meta.schema)
            if batch.num_rows > 0:
                batch.validate(full=True)  # see _read_stream
                batches.append(batch)
                sent = view[start : reader.tell()]
                sent_at = prefix + start
    except _ARROW_ERRORS as error:
        raise InvalidArgument("payload", f"not a valid Arrow IPC stream: {error}") from None
    if len(batches) != 1 or sent is None or bytes(sent[:4]) != _CONTINUATION:
        sent = None  # several batches are combined on apply; a legacy-format message is rebuilt
    return _Checked(batches, sent, sent_at)


def _read_stream(payload: bytes | memoryview) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The schema and non-empty, fully validated batches of an Arrow IPC stream
    (zero-copy: the batches view `payload`)."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
        batches = [batch for batch in reader if batch.num_rows > 0]
        for batch in batches:
            # Full validation (offsets, UTF-8...) costs ~0.1 ms/MB; it keeps a crafted
            # payload from crashing a later kernel on every replica.
            batch.validate(full=True)
    except _ARROW_ERRORS as error:
        raise InvalidArgument("payload", f"not a valid Arrow IPC stream: {error}") from None
    schema = reader.schema
    assert isinstance(schema, pa.Schema)
    return schema, batches


def _schema_difference(table_schema: pa.Schema, schema: pa.Schema) -> str | None:
    """What differs, naming the column; None if the schemas match (metadata ignored)."""
    if len(schema) != len(table_schema):
        return (
            f"{len(schema)} columns {schema.names}, table has {len(table_schema)} "
            f"columns {table_schema.names}"
        )
    for index, (table_field, field) in enumerate(zip(table_schema, schema, strict=True)):
        if field.name != table_field.name:
            return f"column {index} is named {field.name!r}, table has {table_field.name!r}"
        if not field.type.equals(table_field.type):
            return f"column {field.name!r} has type {field.type}, table has {table_field.type}"
    return None


def _check_payload(meta: TableMeta, payload: bytes | memoryview) -> _Checked:
    """The payload's non-empty batches, conforming to the table's schema. Raises
    InvalidArgument("payload", ...) or SchemaMismatch."""
    prefix = meta.stream_prefix
    size = len(prefix)
    if prefix and bytes(memoryview(payload)[:size]) == prefix:
        return _check_nulls(meta, _read_known_stream(meta, payload))
    schema, batches = _read_stream(payload)
    if not schema.equals(meta.schema):  # The walk below only words the error.
        difference = _schema_difference(meta.schema, schema)
        if difference is not None:
            raise SchemaMismatch(meta.table, difference)
    return _check_nulls(meta, _Checked(batches))


def _check_nulls(meta: TableMeta, checked: _Checked) -> _Checked:
    for index in meta.non_nullable:
        if any(batch.column(index).null_count for batch in checked.batches):
            name = meta.schema.field(index).name
            raise SchemaMismatch(meta.table, f"column {name!r} has nulls but is not nullable")
    return checked


def _combine(meta: TableMeta, batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One RecordBatch with exactly the table's schema; no copy when there is one batch."""
    assert batches, "combine needs rows"
    if len(batches) == 1:
        batch = batches[0]
    else:
        try:
            table = pa.Table.from_batches(batches).combine_chunks()
        except _ARROW_ERRORS as error:
            raise InvalidArgument("payload", f"batches do not combine: {error}") from None
        (batch,) = table.to_batches()
    if batch.schema.equals(meta.schema, check_metadata=True):
        return batch
    return pa.RecordBatch.from_arrays(batch.columns, schema=meta.schema)


def validate_payload(meta: TableMeta, payload: bytes | memoryview) -> int:
    """Row count of a publish to the table of `meta`, checked before it is proposed (any
    thread: `meta` is immutable). Raises BatchTooLarge (bytes, then rows),
    InvalidArgument("payload", ...) for bytes that are not a valid Arrow IPC stream,
    SchemaMismatch naming the column, EmptyBatch. apply() applies the same checks."""
    return _validated(meta, payload)[0]


def _validated(meta: TableMeta, payload: bytes | memoryview) -> tuple[int, _Checked]:
    """`validate_payload`'s row count and the check it made (what apply's would be)."""
    size = memoryview(payload).nbytes
    if size > limits.BATCH_BYTES_MAX:
        raise BatchTooLarge(size, limits.BATCH_BYTES_MAX)
    checked = _check_payload(meta, payload)
    rows: int = sum(batch.num_rows for batch in checked.batches)
    if rows == 0:
        raise EmptyBatch(meta.table)
    if rows > limits.BATCH_ROWS_MAX:
        raise BatchTooLarge(rows, limits.BATCH_ROWS_MAX, "rows")
    return rows, checked


def _merged(
    appends: list[tuple[AppendRecords, int]], tables: dict[str, _Table]
) -> list[AppendRecords]:
    """The appends of one entry (each with a bound on its bytes) with each table's
    consecutive small batches joined into one (offsets of one table are contiguous within an
    entry), up to _MERGE_BYTES_MAX each: one data-file record instead of one per 1-row
    publish. Order per table is kept. A sealed batch taken unread is read (with its table's
    schema, from `tables`) to be joined: records are the same on every replica (digest.py),
    whether it read the payload or not."""
    runs: dict[str, list[tuple[list[AppendRecords], int]]] = {}
    for append, size in appends:
        table_runs = runs.setdefault(append.table, [])
        if table_runs:
            run, run_size = table_runs[-1]
            last = run[-1]
            assert append.first_offset == last.first_offset + last.row_count, "contiguous"
            if run_size + size <= _MERGE_BYTES_MAX:
                run.append(append)
                table_runs[-1] = (run, run_size + size)
                continue
        table_runs.append(([append], size))
    merged: list[AppendRecords] = []
    for table_runs in runs.values():
        for run, _ in table_runs:
            first = run[0]
            if len(run) == 1:
                merged.append(first)
                continue
            batch = pa.concat_batches([_batch_of(part, tables) for part in run])
            merged.append(
                AppendRecords(first.table, first.lsn, first.first_offset, batch, first.timestamp_ms)
            )
    return merged


def _batch_of(append: AppendRecords, tables: dict[str, _Table]) -> pa.RecordBatch:
    if append.batch is not None:
        return append.batch
    assert append.encoded is not None, "an unread batch is its message"
    # No validation: the payload passed the leader's, sealed (checked_payload.py).
    schema = tables[append.table].meta.schema
    batch = pa.ipc.read_record_batch(pa.py_buffer(append.encoded), schema)
    assert isinstance(batch, pa.RecordBatch)
    return batch


def _item_error(table: str, error: RaftStoreError) -> ItemResult:
    return ItemResult(table, -1, 0, 0, False, error)


def _topic_table(topic: str) -> str | None:
    """The table of topic `table/action` (table names never contain "/")."""
    table, separator, _ = topic.partition("/")
    return table if separator else None


# ---------------------------------------------------------------------------------------


class GroupStateMachine:
    """The replicated state of one Raft group. See the module docstring for threads."""

    def __init__(
        self,
        group_id: int,
        *,
        dedup_window_rows: int = limits.DEDUP_WINDOW_ROWS,
        producers_max: int = limits.PRODUCERS_MAX,
        seal_key: bytes | None = None,
    ) -> None:
        """`seal_key`: the key of the seals on checked payloads (checked_payload.py); None
        seals nothing and reads every payload (the result is the same)."""
        assert dedup_window_rows >= 1, dedup_window_rows
        assert producers_max >= 1, producers_max
        self._group_id = group_id
        self._dedup_window_rows = dedup_window_rows
        self._producers_max = producers_max
        self._seal_key = seal_key
        self.seals_taken = 0  # sealed payloads applied without reading them
        self._lsn_applied = 0
        self._tables: dict[str, _Table] = {}
        self._topics: dict[str, int] = {}
        self._producers = ProducerWindow(producers_max)
        # The catalog (used in the catalog group only): table name -> (owning group, nonce
        # of the claim).
        self._names: dict[str, tuple[int, bytes]] = {}
        # Users and grants (the catalog group only; access.py).
        self.access = AccessControl()
        # The leader's checks of small publishes, taken back by their apply (check_memo.py).
        self.check_memo: CheckMemo[TableMeta, _Checked] = CheckMemo(
            entries_max=limits.CHECK_MEMO_ENTRIES_MAX,
            bytes_max=limits.CHECK_MEMO_BYTES_MAX,
            payload_bytes_max=limits.CHECK_MEMO_PAYLOAD_BYTES_MAX,
        )

    @property
    def group_id(self) -> int:
        return self._group_id

    @property
    def lsn_applied(self) -> int:
        """LSN of the last applied command (0 before any)."""
        return self._lsn_applied

    @property
    def dedup_window_rows(self) -> int:
        return self._dedup_window_rows

    # -- reads -----------------------------------------------------------------------

    def _state(self, name: str) -> _Table:
        state = self._tables.get(name)
        if state is None:
            raise TableNotFound(name)
        return state

    def has_table(self, name: str) -> bool:
        """Without building a TableNotFound: routing asks every group of the node on every
        request, and all but one answer no."""
        return name in self._tables

    def table(self, name: str) -> TableView:
        """Raises TableNotFound."""
        state = self._state(name)
        return TableView(state.meta, state.row_count, state.lsn_last)

    def tables(self) -> list[TableView]:
        """Every table, sorted by name."""
        states = sorted(self._tables.items())  # One atomic copy: apply may run meanwhile.
        return [TableView(state.meta, state.row_count, state.lsn_last) for _, state in states]

    def key_window_rows(self) -> dict[str, int]:
        """Keys held in each keyed table's dedup window (for metrics)."""
        states = sorted(self._tables.items())  # One atomic copy: apply may run meanwhile.
        return {
            name: len(state.key_window) for name, state in states if state.key_window is not None
        }

    def topic_offset(self, topic: str) -> int | None:
        return self._topics.get(topic)

    def name_claim(self, table: str) -> tuple[int, bytes] | None:
        """(owning group, claim nonce) of a table name in the catalog; None if free."""
        return self._names.get(table)

    def name_claims(self) -> dict[str, tuple[int, bytes]]:
        return dict(self._names)

    def topics(self) -> dict[str, int]:
        return dict(self._topics)

    def topic_count(self) -> int:
        return len(self._topics)

    # -- leader-side validation (nothing is proposed on error) -------------------------

    def validate_create(self, command: CreateTable) -> pa.Schema:
        """The table's schema. Raises InvalidArgument (bad name, schema, key column,
        cache_limit, retention_minutes) or TableExists. apply() applies the same rules."""
        return _check_create(command, exists=command.table in self._tables)

    def validate_append(self, table: str, payload: bytes | memoryview) -> int:
        """Row count of a publish, checked before it is proposed. Raises TableNotFound, or
        what `validate_payload` raises."""
        return self.validate_publish(self._state(table).meta, payload).rows

    def table_meta(self, table: str) -> TableMeta:
        """Raises TableNotFound."""
        return self._state(table).meta

    def validate_publish(self, meta: TableMeta, payload: bytes | memoryview) -> Validated:
        """`validate_payload(meta, payload)`'s rows, and the seal to propose after the
        payload (checked_payload.py; b"" when it cannot be sealed). The check of a payload up
        to the memo's size is kept for the apply of the entry that carries it
        (check_memo.py): the leader reads it once. Not above 16 KiB for a payload that is
        mostly Arrow metadata."""
        memo = self.check_memo
        size = memoryview(payload).nbytes
        if size > memo.payload_bytes_max or (
            # Mostly Arrow metadata (a wide table's few rows: 22 KB for one row of 211
            # columns): the row cache, which counts a batch by its buffers, would keep
            # this copy alive instead of a view of the Raft log's copy of the entry. Kept
            # for apply, such publishes raised the peak node RSS of bench.throughput's
            # 211-column cells from 540 to 790-830 MiB (docs/benchmark.md).
            size > _MEMO_ANY_PAYLOAD_BYTES_MAX and 2 * _metadata_bytes(meta) > size
        ):
            rows, checked = _validated(meta, payload)
            return Validated(rows, self._seal(meta, payload, rows, checked))
        # Immutable bytes (no copy of bytes): the kept batches view them, and a caller's
        # buffer may be reused once the publish is copied into its entry.
        kept = bytes(payload)
        rows, checked = _validated(meta, kept)
        seal = self._seal(meta, kept, rows, checked)
        cost = len(kept) + sum(cached_bytes(batch) for batch in checked.batches)
        memo.remember(meta.table, kept, meta, checked, cost, seal)  # the entry's blob: both
        return Validated(rows, seal)

    def _seal(
        self, meta: TableMeta, payload: bytes | memoryview, rows: int, checked: _Checked
    ) -> bytes:
        """The seal of a checked payload, or b"" where a replica must read it: no key; a
        keyed table (apply needs the keys); a payload not of one current-format record batch
        message (apply combines batches, or rebuilds a legacy message); one that does not end
        with the end-of-stream marker (a node that does not know seals would read the seal
        as the next message)."""
        key = self._seal_key
        sent = checked.sent
        if key is None or meta.key_column is not None or sent is None:
            return b""
        if bytes(memoryview(payload)[-len(_END_OF_STREAM) :]) != _END_OF_STREAM:
            return b""
        found = checked_payload.Seal(rows, checked.sent_at, checked.sent_at + sent.nbytes)
        return checked_payload.seal(
            key, self._group_id, meta.table, meta.created_lsn, payload, found
        )

    # -- apply -----------------------------------------------------------------------

    def apply(
        self, lsn: int, command: Command
    ) -> tuple[list[Effect], AppendResult | CommandResult]:
        """Apply the committed `command` of entry `lsn`. LSNs strictly increase (they may skip
        numbers: pysyncobj's own entries are not ours). Returns (effects, result)."""
        assert lsn > self._lsn_applied, (lsn, self._lsn_applied)
        effects: list[Effect] = []
        result: AppendResult | CommandResult
        match command:
            case Append():
                result = self._apply_append(lsn, command, effects)
            case CreateTable():
                result = self._apply_create(lsn, command, effects)
            case DropTable(table=table):
                result = self._apply_drop(lsn, table, effects)
            case CommitOffset(topic=topic, offset=offset):
                result = self._apply_commit_offset(lsn, topic, offset)
            case RemoveOffset(topic=topic):
                result = self._apply_remove_offset(lsn, topic)
            case Noop():
                result = CommandResult(lsn, None)
            case ClaimName():
                result = self._apply_claim(lsn, command)
            case ReleaseName():
                result = self._apply_release(lsn, command)
            case PutUser():
                result = CommandResult(lsn, self.access.apply_put_user(lsn, command))
            case DeleteUser():
                result = CommandResult(lsn, self.access.apply_delete_user(command))
            case SetRule():
                result = CommandResult(lsn, self.access.apply_set_rule(command))
            case _:
                raise AssertionError(f"not a command: {type(command).__name__}")
        self._lsn_applied = lsn
        return effects, result

    def _apply_create(self, lsn: int, command: CreateTable, effects: list[Effect]) -> CommandResult:
        try:
            schema = self.validate_create(command)
        except (InvalidArgument, TableExists) as error:
            return CommandResult(lsn, error)
        meta = TableMeta(
            table=command.table,
            schema=schema,
            schema_ipc=command.schema_ipc,
            cache_limit=command.cache_limit,
            key_column=command.key_column,
            retention_minutes=command.retention_minutes,
            created_lsn=lsn,
            non_nullable=_non_nullable(schema),
            stream_prefix=_stream_prefix(schema),
        )
        key_window = None if meta.key_column is None else KeyWindow(self._dedup_window_rows)
        self._tables[meta.table] = _Table(meta, 0, lsn, key_window, key_window_pending=False)
        effects.append(CreateTableFiles(meta))
        log.info("table created group=%d table=%s lsn=%d", self._group_id, meta.table, lsn)
        return CommandResult(lsn, None)

    def _apply_drop(self, lsn: int, table: str, effects: list[Effect]) -> CommandResult:
        state = self._tables.pop(table, None)
        if state is None:
            return CommandResult(lsn, TableNotFound(table))
        prefix = f"{table}/"
        for topic in [topic for topic in self._topics if topic.startswith(prefix)]:
            del self._topics[topic]
        effects.append(DropTableFiles(table, state.meta.created_lsn))
        log.info("table dropped group=%d table=%s lsn=%d", self._group_id, table, lsn)
        return CommandResult(lsn, None)

    def _apply_claim(self, lsn: int, command: ClaimName) -> CommandResult:
        table = command.table
        if not _TABLE_NAME.fullmatch(table) or len(table) > limits.TABLE_NAME_BYTES_MAX:
            return CommandResult(lsn, InvalidArgument("table", f"{table!r} is not a table name"))
        claim = self._names.get(table)
        if claim is not None and claim[0] != command.group_id:
            return CommandResult(lsn, TableExists(table, claim[0]))
        # Free, or already this group's (a retried create): the newest claim's nonce wins.
        self._names[table] = (command.group_id, command.nonce)
        return CommandResult(lsn, None)

    def _apply_release(self, lsn: int, command: ReleaseName) -> CommandResult:
        if self._names.get(command.table) == (command.group_id, command.nonce):
            del self._names[command.table]
        return CommandResult(lsn, None)

    def _apply_commit_offset(self, lsn: int, topic: str, offset: int) -> CommandResult:
        table = _topic_table(topic)
        if table is None:
            return CommandResult(lsn, InvalidArgument("topic", f"{topic!r}: want table/action"))
        if table not in self._tables:
            return CommandResult(lsn, TableNotFound(table))
        # Stored as given, even backwards: the subscriber owns its offset.
        self._topics[topic] = offset
        return CommandResult(lsn, None, offset)

    def _apply_remove_offset(self, lsn: int, topic: str) -> CommandResult:
        offset = self._topics.pop(topic, None)
        if offset is None:
            return CommandResult(lsn, TopicNotFound(topic))
        return CommandResult(lsn, None, offset)

    def _apply_append(self, lsn: int, command: Append, effects: list[Effect]) -> AppendResult:
        appends: list[tuple[AppendRecords, int]] = []
        items = tuple(
            self._apply_item(lsn, command.timestamp_ms, item, appends) for item in command.items
        )
        effects += _merged(appends, self._tables)
        return AppendResult(lsn, items)

    def _apply_item(
        self,
        lsn: int,
        timestamp_ms: int,
        item: AppendItem,
        effects: list[tuple[AppendRecords, int]],
    ) -> ItemResult:
        """Apply one item; its rows go to `effects` with the payload's size (a bound on the
        batch's bytes that costs nothing: `RecordBatch.nbytes` costs ~20 us)."""
        state = self._tables.get(item.table)
        if state is None:
            return _item_error(item.table, TableNotFound(item.table))
        # The leader's own check of these bytes (seal included) first: it holds the batch
        # for the row cache, which an unread seal does not.
        checked = self.check_memo.take(item.table, item.payload, state.meta)
        sealed = None
        if checked is None:
            if self._seal_key is not None and state.meta.key_column is None:
                sealed = checked_payload.opened(
                    self._seal_key, self._group_id, item.table, state.meta.created_lsn, item.payload
                )
            if sealed is None:  # not checked here before, nor sealed
                try:
                    # The whole blob, whatever its end holds: as a node that knows no seals.
                    checked = _check_payload(state.meta, item.payload)
                except (InvalidArgument, SchemaMismatch) as error:
                    return _item_error(item.table, error)
        if item.producer_id:
            answer = self._producer_answer(item)
            if answer is not None:
                return answer
        first_offset = state.row_count
        kept = 0
        duplicates = 0
        if checked is None:
            assert sealed is not None
            # Checked by the leader against this incarnation, and no dedup key: the rows
            # and the message are the seal's, the same as a read would find.
            payload, found = sealed
            self.seals_taken += 1
            kept = found.rows
            message = payload[found.start : found.end]
            append = AppendRecords(
                item.table, lsn, first_offset, None, timestamp_ms, message, unread_rows=kept
            )
            effects.append((append, memoryview(item.payload).nbytes))
            self._advance(state, lsn, kept)
        elif checked.batches:
            try:
                batch = _combine(state.meta, checked.batches)
            except InvalidArgument as error:
                return _item_error(item.table, error)
            batch, duplicates = self._deduplicate(state, batch)
            kept = batch.num_rows
            if kept:
                encoded = checked.sent if duplicates == 0 else None
                append = AppendRecords(item.table, lsn, first_offset, batch, timestamp_ms, encoded)
                effects.append((append, memoryview(item.payload).nbytes))
                self._advance(state, lsn, kept)
        if item.producer_id:
            self._producers.record(
                item.producer_id, ProducerRecord(item.sequence, first_offset, kept, duplicates)
            )
        return ItemResult(item.table, first_offset, kept, duplicates, False, None)

    def _producer_answer(self, item: AppendItem) -> ItemResult | None:
        """The answer to an item its producer window decides (a retry, or a gap in a
        contiguous producer's sequences); None: apply the item.

        A retry (sequence <= the producer's last applied one, L) is answered, not applied: with
        the stored result when it is the last item. A contiguous (pipelined) retry of an older
        sequence gets `duplicate_batch` with unknown offsets (first_offset -1, counts 0): only
        the last result is stored, and another item's offsets would be wrong. A contiguous
        item with sequence > L + 1 is refused (SequenceGap) and changes nothing, so the resend
        of a failed request can never land after a later one. An unknown producer (never
        seen, or forgotten beyond PRODUCERS_MAX) is not checked for gaps."""
        record = self._producers.last(item.producer_id)
        if record is None:
            return None
        if item.sequence == record.sequence or (
            item.sequence < record.sequence and not item.contiguous
        ):
            return ItemResult(
                item.table, record.first_offset, record.row_count, record.duplicates, True, None
            )
        if item.sequence < record.sequence:
            return ItemResult(item.table, -1, 0, 0, True, None)
        if item.contiguous and item.sequence > record.sequence + 1:
            gap = SequenceGap(item.producer_id.hex(), record.sequence + 1, item.sequence)
            return _item_error(item.table, gap)
        return None

    def _deduplicate(self, state: _Table, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, int]:
        """The rows of `batch` to append and the number dropped by the key window, which
        learns the kept keys."""
        window = state.key_window
        key_column = state.meta.key_column
        if window is None or key_column is None:
            return batch, 0
        assert not state.key_window_pending, f"key window of {state.meta.table} not rebuilt"
        mask = window.admit(batch.column(key_column), state.row_count)
        if mask is None:
            return batch, 0
        kept = mask.true_count
        return batch.filter(mask), len(mask) - kept

    @staticmethod
    def _advance(state: _Table, lsn: int, rows: int) -> None:
        assert rows > 0, rows
        assert lsn >= state.lsn_last, (lsn, state.lsn_last)
        row_count = state.row_count + rows
        assert row_count > state.row_count, (row_count, state.row_count)
        state.row_count = row_count
        state.lsn_last = lsn
        if state.key_window is not None:
            assert state.key_window.offset_to == row_count, (state.key_window.offset_to, row_count)

    # -- checkpoint ------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Deterministic JSON of everything but the rows and the key windows."""
        tables = [
            {
                "table": state.meta.table,
                "schema_ipc": base64.b64encode(state.meta.schema_ipc).decode("ascii"),
                "cache_limit": state.meta.cache_limit,
                "key_column": state.meta.key_column,
                "retention_minutes": state.meta.retention_minutes,
                "created_lsn": state.meta.created_lsn,
                "row_count": state.row_count,
                "lsn_last": state.lsn_last,
            }
            for _, state in sorted(self._tables.items())
        ]
        document = {
            "format": SNAPSHOT_FORMAT,
            "group_id": self._group_id,
            "lsn_applied": self._lsn_applied,
            "tables": tables,
            "topics": self._topics,
            "producers": self._producers.to_json(),
            "names": {
                table: [group_id, nonce.hex()]
                for table, (group_id, nonce) in sorted(self._names.items())
            },
            "users": self.access.to_json(),
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def restore(
        cls,
        group_id: int,
        data: bytes,
        *,
        dedup_window_rows: int = limits.DEDUP_WINDOW_ROWS,
        producers_max: int = limits.PRODUCERS_MAX,
        seal_key: bytes | None = None,
    ) -> GroupStateMachine:
        """The state machine `snapshot()` wrote. Keyed tables with rows then wait for
        `rebuild_key_window` before their next append. Raises InvalidArgument("snapshot",
        ...) on anything malformed."""
        machine = cls(
            group_id,
            dedup_window_rows=dedup_window_rows,
            producers_max=producers_max,
            seal_key=seal_key,
        )
        try:
            document = json.loads(data)
            machine._load(document)
        except (ValueError, TypeError, KeyError, InvalidArgument) as error:
            raise InvalidArgument("snapshot", f"{type(error).__name__}: {error}") from None
        return machine

    def _load(self, document: dict[str, Any]) -> None:
        if document["format"] != SNAPSHOT_FORMAT:
            raise ValueError(f"format {document['format']!r}; this node reads {SNAPSHOT_FORMAT}")
        if document["group_id"] != self._group_id:
            raise ValueError(f"snapshot of group {document['group_id']}, not {self._group_id}")
        self._lsn_applied = _integer(document["lsn_applied"])
        for entry in document["tables"]:
            self._load_table(entry)
        self._topics = {
            str(topic): _integer(offset) for topic, offset in document["topics"].items()
        }
        self._producers = ProducerWindow.from_json(document["producers"], self._producers_max)
        self._names = {
            str(table): (_integer(group_id), bytes.fromhex(nonce))
            for table, (group_id, nonce) in document.get("names", {}).items()
        }
        self.access = AccessControl.from_json(document.get("users", []))

    def _load_table(self, entry: dict[str, Any]) -> None:
        schema_ipc = base64.b64decode(entry["schema_ipc"], validate=True)
        key_column = entry["key_column"]
        schema = _read_schema(schema_ipc)
        meta = TableMeta(
            table=str(entry["table"]),
            schema=schema,
            schema_ipc=schema_ipc,
            cache_limit=_integer(entry["cache_limit"]),
            key_column=None if key_column is None else str(key_column),
            retention_minutes=_integer(entry["retention_minutes"]),
            created_lsn=_integer(entry["created_lsn"]),
            non_nullable=_non_nullable(schema),
            stream_prefix=_stream_prefix(schema),
        )
        row_count = _integer(entry["row_count"])
        if row_count < 0:
            raise ValueError(f"table {meta.table}: row_count {row_count} < 0")
        if meta.table in self._tables:
            raise ValueError(f"table {meta.table} appears twice")
        key_window = None if meta.key_column is None else KeyWindow(self._dedup_window_rows)
        pending = key_window is not None and row_count > 0
        self._tables[meta.table] = _Table(
            meta, row_count, _integer(entry["lsn_last"]), key_window, pending
        )

    def key_window_range(self, table: str) -> tuple[int, int] | None:
        """Rows `[offset_from, offset_to)` whose key column rebuilds the table's key window
        after a restore; None for a table without a key column. Raises TableNotFound."""
        state = self._state(table)
        if state.key_window is None:
            return None
        return max(0, state.row_count - self._dedup_window_rows), state.row_count

    def key_windows_pending(self) -> list[str]:
        """Keyed tables restored with rows whose key window is not rebuilt yet (sorted)."""
        return sorted(name for name, state in self._tables.items() if state.key_window_pending)

    def rebuild_key_window(self, table: str, keys: pa.Array, first_offset: int) -> None:
        """Rebuild the key window from the key column of rows
        `[first_offset, first_offset + len(keys))`, which must end at the table's row count.
        A later first_offset than `key_window_range` gives (rows lost to retention) gives a
        smaller window. Raises TableNotFound."""
        state = self._state(table)
        assert state.key_window is not None, f"table {table} has no key column"
        assert first_offset >= 0, first_offset
        assert first_offset + len(keys) == state.row_count, (first_offset, len(keys))
        state.key_window.rebuild(keys, first_offset)
        state.key_window_pending = False


def _integer(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value
