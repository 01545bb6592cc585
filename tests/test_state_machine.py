"""state_machine.py: the pure, deterministic replicated state of a Raft group."""

from __future__ import annotations

import ast
import contextlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

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
from raftstore import commands, limits
from raftstore.commands import (
    Append,
    AppendItem,
    Command,
    CommitOffset,
    CreateTable,
    DropTable,
    Noop,
    RemoveOffset,
)
from raftstore.state_machine import (
    AppendRecords,
    AppendResult,
    CommandResult,
    CreateTableFiles,
    DropTableFiles,
    Effect,
    GroupStateMachine,
    ItemResult,
)

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("ts", pa.timestamp("ms")),
        ("price", pa.float64()),
        ("sym", pa.string()),
    ]
)
SCHEMA_IPC = SCHEMA.serialize().to_pybytes()
P1, P2 = bytes([1]) * 16, bytes([2]) * 16
TS = 1_700_000_000_000


def _batch(ids: list[int | None], schema: pa.Schema = SCHEMA) -> pa.RecordBatch:
    """Rows with the given ids; columns by position (id, ts, price, sym), cast to `schema`."""
    count = len(ids)
    columns = [
        pa.array(ids, type=pa.int64()),
        pa.array([TS + i for i in range(count)], type=pa.timestamp("ms")),
        pa.array([float(i) / 4 for i in range(count)], type=pa.float64()),
        pa.array([f"S{i % 3}" for i in range(count)], type=pa.string()),
    ]
    return pa.record_batch(
        [column.cast(field.type) for column, field in zip(columns, schema, strict=False)],
        schema=schema,
    )


def _payload(*batches_ids: list[int | None], schema: pa.Schema = SCHEMA) -> bytes:
    """An Arrow IPC stream with one batch per list of ids."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for ids in batches_ids:
            writer.write_batch(_batch(ids, schema))
    result: bytes = sink.getvalue().to_pybytes()
    return result


def _create(table: str, key_column: str | None = "id", schema_ipc: bytes = SCHEMA_IPC) -> Command:
    return CreateTable(table, schema_ipc, 100, key_column, 1440)


def _item(
    table: str,
    *batches_ids: list[int | None],
    producer: bytes = b"",
    sequence: int = 0,
    contiguous: bool = False,
) -> AppendItem:
    return AppendItem(table, producer, sequence, _payload(*batches_ids), contiguous)


class Driver:
    """Applies commands at increasing LSNs; keeps every effect."""

    def __init__(self, machine: GroupStateMachine) -> None:
        self.machine = machine
        self.effects: list[Effect] = []

    def run(self, command: Command) -> Any:
        # Through the real encoding, as the shell does.
        decoded = commands.decode(commands.encode(command))
        effects, result = self.machine.apply(self.machine.lsn_applied + 1, decoded)
        self.effects.extend(effects)
        return result

    def append(self, *items: AppendItem, timestamp_ms: int = TS) -> tuple[ItemResult, ...]:
        result = self.run(Append(timestamp_ms, items))
        assert isinstance(result, AppendResult)
        return result.items


def _driver(*tables: Command, window: int = 1000, producers: int = 100) -> Driver:
    driver = Driver(GroupStateMachine(2, dedup_window_rows=window, producers_max=producers))
    for command in tables:
        assert driver.run(command).error is None
    driver.effects.clear()
    return driver


def _ids(effect: Effect) -> list[int | None]:
    assert isinstance(effect, AppendRecords)
    ids: list[int | None] = effect.batch.column("id").to_pylist()
    return ids


def _error_form(error: RaftStoreError | None) -> tuple[str, dict[str, Any]] | None:
    return None if error is None else (type(error).__name__, error.fields())


def _result_form(result: AppendResult | CommandResult) -> Any:
    if isinstance(result, CommandResult):
        return ("command", result.lsn, _error_form(result.error), result.offset)
    return (
        "append",
        result.lsn,
        [
            (
                i.table,
                i.first_offset,
                i.row_count,
                i.duplicates,
                i.duplicate_batch,
                _error_form(i.error),
            )
            for i in result.items
        ],
    )


def _effect_form(effect: Effect) -> Any:
    if isinstance(effect, AppendRecords):
        return (effect.table, effect.lsn, effect.first_offset, effect.batch.to_pydict())
    if isinstance(effect, CreateTableFiles):
        return ("create", effect.meta)
    return ("drop", effect.table)


# --- CreateTable -------------------------------------------------------------------------


@pytest.mark.unit
def test_create_table_registers_it_and_asks_for_its_files() -> None:
    driver = _driver()
    result = driver.run(_create("trades"))
    assert result == CommandResult(1, None)
    (effect,) = driver.effects
    assert isinstance(effect, CreateTableFiles)
    meta = effect.meta
    assert (meta.table, meta.key_column, meta.cache_limit, meta.retention_minutes) == (
        "trades",
        "id",
        100,
        1440,
    )
    assert meta.schema.equals(SCHEMA)
    assert meta.created_lsn == 1
    view = driver.machine.table("trades")
    assert (view.row_count, view.lsn_last, view.meta) == (0, 1, meta)


@pytest.mark.unit
def test_create_existing_table_is_a_table_exists_result() -> None:
    driver = _driver(_create("trades"))
    result = driver.run(_create("trades", key_column=None))
    assert isinstance(result.error, TableExists)
    assert driver.effects == []
    assert driver.machine.table("trades").meta.key_column == "id"


def _schema_ipc(schema: pa.Schema) -> bytes:
    data: bytes = schema.serialize().to_pybytes()
    return data


@pytest.mark.unit
@pytest.mark.parametrize(
    ("command", "argument"),
    [
        (CreateTable("", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("1abc", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("a-b", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("a/b", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("caf\u00e9", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("a" * (limits.TABLE_NAME_BYTES_MAX + 1), SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("t\n", SCHEMA_IPC, 1, None, 1), "table"),
        (CreateTable("t", b"garbage", 1, None, 1), "schema"),
        (CreateTable("t", b"", 1, None, 1), "schema"),
        (CreateTable("t", _schema_ipc(pa.schema([])), 1, None, 1), "schema"),
        (
            CreateTable(
                "t",
                _schema_ipc(pa.schema([(f"c{i}", pa.int8()) for i in range(4097)])),
                1,
                None,
                1,
            ),
            "schema",
        ),
        (
            CreateTable(
                "t", _schema_ipc(pa.schema([("a", pa.int8()), ("a", pa.int8())])), 1, None, 1
            ),
            "schema",
        ),
        (CreateTable("t", SCHEMA_IPC, 1, "missing", 1), "key_column"),
        (
            CreateTable("t", _schema_ipc(pa.schema([("k", pa.list_(pa.int8()))])), 1, "k", 1),
            "key_column",
        ),
        (CreateTable("t", SCHEMA_IPC, 0, None, 1), "cache_limit"),
        (CreateTable("t", SCHEMA_IPC, 1, None, 0), "retention_minutes"),
    ],
    ids=[
        "empty-name",
        "digit-first",
        "dash",
        "slash",
        "non-ascii",
        "long-name",
        "newline",
        "garbage-schema",
        "empty-schema-bytes",
        "no-columns",
        "too-many-columns",
        "duplicate-columns",
        "missing-key",
        "nested-key",
        "cache-limit",
        "retention",
    ],
)
def test_invalid_create_is_an_invalid_argument_result(command: CreateTable, argument: str) -> None:
    driver = _driver()
    with pytest.raises(InvalidArgument) as raised:
        driver.machine.validate_create(command)
    assert raised.value.argument == argument
    result = driver.run(command)
    assert isinstance(result.error, InvalidArgument)
    assert result.error.argument == argument
    assert driver.effects == []
    assert driver.machine.tables() == []


@pytest.mark.unit
def test_longest_table_name_and_stream_schema_bytes_are_accepted() -> None:
    driver = _driver()
    name = "T" + "_9" * ((limits.TABLE_NAME_BYTES_MAX - 2) // 2) + "x"
    assert len(name) == limits.TABLE_NAME_BYTES_MAX
    schema = driver.machine.validate_create(CreateTable(name, SCHEMA_IPC, 1, None, 1))
    assert schema.equals(SCHEMA)
    stream_schema = _payload(schema=SCHEMA)  # an IPC stream with no batches
    assert driver.run(CreateTable(name, stream_schema, 1, None, 1)).error is None


# --- Append ------------------------------------------------------------------------------


@pytest.mark.unit
def test_append_assigns_contiguous_offsets_and_emits_records() -> None:
    driver = _driver(_create("trades", key_column=None))
    first = driver.append(_item("trades", [1, 2, 3]), timestamp_ms=TS)
    second = driver.append(_item("trades", [4, 5]), timestamp_ms=TS + 9)
    assert first == (ItemResult("trades", 0, 3, 0, False, None),)
    assert second == (ItemResult("trades", 3, 2, 0, False, None),)
    effects = driver.effects
    assert [type(effect) for effect in effects] == [AppendRecords, AppendRecords]
    assert [(e.table, e.lsn, e.first_offset, e.timestamp_ms) for e in effects] == [  # type: ignore[union-attr]
        ("trades", 2, 0, TS),
        ("trades", 3, 3, TS + 9),
    ]
    assert _ids(effects[0]) + _ids(effects[1]) == [1, 2, 3, 4, 5]
    view = driver.machine.table("trades")
    assert (view.row_count, view.lsn_last) == (5, 3)


@pytest.mark.unit
def test_several_items_of_one_entry_apply_in_order() -> None:
    driver = _driver(_create("a", key_column=None), _create("b", key_column=None))
    results = driver.append(_item("a", [1]), _item("b", [2, 3]), _item("a", [4, 5]))
    assert [(r.table, r.first_offset, r.row_count) for r in results] == [
        ("a", 0, 1),
        ("b", 0, 2),
        ("a", 1, 2),
    ]
    assert {e.lsn for e in driver.effects if isinstance(e, AppendRecords)} == {
        driver.machine.lsn_applied
    }


@pytest.mark.unit
def test_stream_batches_are_combined_into_one_record_batch() -> None:
    driver = _driver(_create("trades", key_column=None))
    driver.append(_item("trades", [1, 2], [], [3]))
    (effect,) = driver.effects
    assert isinstance(effect, AppendRecords)
    assert effect.batch.num_rows == 3
    assert _ids(effect) == [1, 2, 3]
    assert effect.batch.schema.equals(SCHEMA, check_metadata=True)


@pytest.mark.unit
def test_single_batch_is_not_copied() -> None:
    driver = _driver(_create("trades", key_column=None))
    entry = commands.encode(Append(TS, (_item("trades", list(range(50))),)))
    decoded = commands.decode(entry)
    effects, _ = driver.machine.apply(driver.machine.lsn_applied + 1, decoded)
    (effect,) = effects
    assert isinstance(effect, AppendRecords)
    entry_buffer = pa.py_buffer(entry)
    data_address = effect.batch.column("id").buffers()[1].address
    assert entry_buffer.address <= data_address < entry_buffer.address + entry_buffer.size


@pytest.mark.unit
def test_a_batch_published_as_one_message_is_stored_as_sent() -> None:
    """The data file writes the publisher's message (a view of the entry), not a new
    serialization; for a pyarrow publisher these are the same bytes."""
    driver = _driver(_create("trades", key_column=None))
    entry = commands.encode(Append(TS, (_item("trades", list(range(50))),)))
    effects, _ = driver.machine.apply(driver.machine.lsn_applied + 1, commands.decode(entry))
    (effect,) = effects
    assert isinstance(effect, AppendRecords)
    assert effect.encoded is not None
    assert bytes(effect.encoded) == effect.batch.serialize().to_pybytes()
    entry_buffer, encoded = pa.py_buffer(entry), pa.py_buffer(effect.encoded)
    assert entry_buffer.address <= encoded.address < entry_buffer.address + entry_buffer.size


@pytest.mark.unit
def test_a_batch_built_on_apply_is_serialized_again() -> None:
    keyed = _driver(_create("trades"))
    keyed.append(_item("trades", [1, 2]))  # stored as sent
    keyed.append(_item("trades", [2, 3]))  # one duplicate dropped: a new batch
    keyed.append(_item("trades", [4], [5]))  # two batches combined
    stored_as_sent = [isinstance(e, AppendRecords) and e.encoded is not None for e in keyed.effects]
    assert stored_as_sent == [True, False, False]
    other = _driver(_create("trades", key_column=None))
    tagged = SCHEMA.with_metadata({b"pandas": b"{}"})  # read from a stream of another schema
    other.append(AppendItem("trades", b"", 0, _payload([1], schema=tagged)))
    (effect,) = other.effects
    assert isinstance(effect, AppendRecords)
    assert effect.encoded is None


@pytest.mark.unit
def test_a_compressed_message_is_stored_as_sent_and_reads_back_the_same_rows() -> None:
    driver = _driver(_create("trades", key_column=None))
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.ipc.new_stream(sink, SCHEMA, options=options) as writer:
        writer.write_batch(_batch(list(range(100))))
    (result,) = driver.append(AppendItem("trades", b"", 0, sink.getvalue().to_pybytes()))
    assert result.error is None
    (effect,) = driver.effects
    assert isinstance(effect, AppendRecords)
    assert effect.encoded is not None
    read = pa.ipc.read_record_batch(pa.py_buffer(effect.encoded), SCHEMA)
    assert read.equals(_batch(list(range(100))))


@pytest.mark.unit
def test_schema_metadata_is_ignored_and_records_carry_the_table_schema() -> None:
    driver = _driver(_create("trades", key_column=None))
    tagged = SCHEMA.with_metadata({b"pandas": b"{}"})
    (result,) = driver.append(AppendItem("trades", b"", 0, _payload([1], schema=tagged)))
    assert result.error is None
    (effect,) = driver.effects
    assert isinstance(effect, AppendRecords)
    assert effect.batch.schema.equals(SCHEMA, check_metadata=True)


@pytest.mark.unit
def test_empty_stream_appends_nothing() -> None:
    driver = _driver(_create("trades", key_column=None))
    results = driver.append(_item("trades"), _item("trades", []))
    assert results == (ItemResult("trades", 0, 0, 0, False, None),) * 2
    assert driver.effects == []


# --- errors are results ----------------------------------------------------------------


@pytest.mark.unit
def test_append_errors_are_item_results_and_other_items_still_apply() -> None:
    driver = _driver(_create("trades", key_column=None))
    other = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("price", pa.float64())])
    results = driver.append(
        _item("missing", [1]),
        AppendItem("trades", b"", 0, b"not arrow"),
        AppendItem("trades", b"", 0, _payload([1], schema=other)),
        _item("trades", [7]),
    )
    assert isinstance(results[0].error, TableNotFound)
    assert isinstance(results[1].error, InvalidArgument)
    assert results[1].error.argument == "payload"
    assert isinstance(results[2].error, SchemaMismatch)
    assert results[3] == ItemResult("trades", 0, 1, 0, False, None)
    assert [_ids(effect) for effect in driver.effects] == [[7]]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("schema", "detail"),
    [
        (pa.schema([("id", pa.int64())]), "1 columns"),
        (
            pa.schema(
                [
                    ("id", pa.int64()),
                    ("ts", pa.timestamp("ms")),
                    ("px", pa.float64()),
                    ("sym", pa.string()),
                ]
            ),
            "'px'",
        ),
        (
            pa.schema(
                [
                    ("id", pa.int32()),
                    ("ts", pa.timestamp("ms")),
                    ("price", pa.float64()),
                    ("sym", pa.string()),
                ]
            ),
            "'id' has type int32",
        ),
        (
            pa.schema(
                [
                    ("id", pa.int64()),
                    ("ts", pa.timestamp("us")),
                    ("price", pa.float64()),
                    ("sym", pa.string()),
                ]
            ),
            "'ts'",
        ),
    ],
    ids=["columns", "name", "type", "unit"],
)
def test_schema_mismatch_names_the_differing_column(schema: pa.Schema, detail: str) -> None:
    driver = _driver(_create("trades", key_column=None))
    payload = _payload([1], schema=schema)
    with pytest.raises(SchemaMismatch, match=detail):
        driver.machine.validate_append("trades", payload)
    (result,) = driver.append(AppendItem("trades", b"", 0, payload))
    assert isinstance(result.error, SchemaMismatch)
    assert detail in result.error.detail


@pytest.mark.unit
def test_nulls_in_a_non_nullable_column_are_a_schema_mismatch() -> None:
    strict = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    loose = pa.schema([pa.field("id", pa.int64())])
    driver = _driver(_create("t", key_column=None, schema_ipc=_schema_ipc(strict)))
    results = driver.append(
        AppendItem("t", b"", 0, _payload([1, None], schema=loose)),
        AppendItem("t", b"", 0, _payload([2], schema=loose)),
    )
    assert isinstance(results[0].error, SchemaMismatch)
    assert "nullable" in results[0].error.detail
    assert results[1].error is None
    (effect,) = driver.effects
    assert isinstance(effect, AppendRecords)
    assert effect.batch.schema.equals(strict)


# --- key dedup ---------------------------------------------------------------------------


@pytest.mark.unit
def test_keyed_table_drops_rows_whose_key_was_written() -> None:
    driver = _driver(_create("trades"))
    assert driver.append(_item("trades", [1, 2, 2, 3])) == (
        ItemResult("trades", 0, 3, 1, False, None),
    )
    assert driver.append(_item("trades", [3, 4, 1, 5])) == (
        ItemResult("trades", 3, 2, 2, False, None),
    )
    assert [_ids(effect) for effect in driver.effects] == [[1, 2, 3], [4, 5]]
    assert driver.machine.table("trades").row_count == 5


@pytest.mark.unit
def test_batch_of_only_duplicates_appends_nothing() -> None:
    driver = _driver(_create("trades"))
    driver.append(_item("trades", [1, 2]))
    driver.effects.clear()
    assert driver.append(_item("trades", [2, 1, 1])) == (
        ItemResult("trades", 2, 0, 3, False, None),
    )
    assert driver.effects == []


@pytest.mark.unit
def test_keys_older_than_the_window_are_accepted_again() -> None:
    driver = _driver(_create("trades"), window=3)
    driver.append(_item("trades", [1, 2, 3, 4]))
    (result,) = driver.append(_item("trades", [1, 2]))
    assert (result.row_count, result.duplicates) == (1, 1)  # 1 left the window, 2 did not


# --- producer dedup ------------------------------------------------------------------------


@pytest.mark.unit
def test_producer_retry_returns_the_original_result_and_applies_nothing() -> None:
    driver = _driver(_create("trades", key_column=None))
    (first,) = driver.append(_item("trades", [1, 2], producer=P1, sequence=1))
    driver.effects.clear()
    (retry,) = driver.append(_item("trades", [1, 2], producer=P1, sequence=1))
    assert retry == ItemResult("trades", 0, 2, 0, True, None)
    assert (first.first_offset, first.row_count) == (retry.first_offset, retry.row_count)
    assert driver.effects == []
    assert driver.machine.table("trades").row_count == 2


@pytest.mark.unit
def test_producer_retry_in_the_same_entry_is_deduplicated() -> None:
    driver = _driver(_create("trades", key_column=None))
    results = driver.append(
        _item("trades", [1], producer=P1, sequence=4),
        _item("trades", [1], producer=P1, sequence=4),
        _item("trades", [9], producer=P2, sequence=4),
    )
    assert [(r.first_offset, r.row_count, r.duplicate_batch) for r in results] == [
        (0, 1, False),
        (0, 1, True),
        (1, 1, False),
    ]


@pytest.mark.unit
def test_older_sequence_is_answered_with_the_last_result() -> None:
    driver = _driver(_create("trades", key_column=None))
    driver.append(_item("trades", [1], producer=P1, sequence=1))
    driver.append(_item("trades", [2, 3], producer=P1, sequence=2))
    (old,) = driver.append(_item("trades", [1], producer=P1, sequence=1))
    assert old == ItemResult("trades", 1, 2, 0, True, None)
    (new,) = driver.append(_item("trades", [4], producer=P1, sequence=3))
    assert new == ItemResult("trades", 3, 1, 0, False, None)


@pytest.mark.unit
def test_failed_items_do_not_advance_the_producer() -> None:
    driver = _driver()
    (failed,) = driver.append(_item("trades", [1], producer=P1, sequence=1))
    assert isinstance(failed.error, TableNotFound)
    driver.run(_create("trades", key_column=None))
    (retry,) = driver.append(_item("trades", [1], producer=P1, sequence=1))
    assert retry == ItemResult("trades", 0, 1, 0, False, None)


@pytest.mark.unit
def test_producers_beyond_the_window_are_forgotten() -> None:
    driver = _driver(_create("trades", key_column=None), producers=1)
    driver.append(_item("trades", [1], producer=P1, sequence=1))
    driver.append(_item("trades", [2], producer=P2, sequence=1))
    (again,) = driver.append(_item("trades", [1], producer=P1, sequence=1))
    assert not again.duplicate_batch


# --- contiguous (pipelined) items: sequence gaps -----------------------------------------


@pytest.mark.unit
def test_contiguous_item_that_skips_a_sequence_is_a_gap_and_changes_nothing() -> None:
    driver = _driver(_create("trades", key_column=None))
    driver.append(_item("trades", [1], producer=P1, sequence=1, contiguous=True))
    driver.effects.clear()
    snapshot = driver.machine.snapshot()
    (gap,) = driver.append(_item("trades", [3], producer=P1, sequence=3, contiguous=True))
    assert isinstance(gap.error, SequenceGap)
    assert (gap.error.producer, gap.error.expected, gap.error.got) == (P1.hex(), 2, 3)
    assert (gap.first_offset, gap.row_count, gap.duplicate_batch) == (-1, 0, False)
    assert driver.effects == []
    assert json.loads(driver.machine.snapshot())["producers"] == json.loads(snapshot)["producers"]
    assert driver.machine.table("trades").row_count == 1
    (resent,) = driver.append(_item("trades", [2], producer=P1, sequence=2, contiguous=True))
    (after,) = driver.append(_item("trades", [3], producer=P1, sequence=3, contiguous=True))
    assert (resent.first_offset, after.first_offset) == (1, 2)
    assert [_ids(effect) for effect in driver.effects] == [[2], [3]]


@pytest.mark.unit
def test_a_failed_contiguous_item_makes_the_next_ones_of_its_entry_gaps() -> None:
    driver = _driver(_create("trades", key_column=None))
    driver.append(_item("trades", [1], producer=P1, sequence=1, contiguous=True))
    bad = AppendItem("trades", P1, 2, b"garbage", contiguous=True)
    results = driver.append(
        bad,
        _item("trades", [3], producer=P1, sequence=3, contiguous=True),
        _item("trades", [9], producer=P2, sequence=7, contiguous=True),  # another producer
    )
    assert isinstance(results[0].error, InvalidArgument)
    assert isinstance(results[1].error, SequenceGap)
    assert results[2] == ItemResult("trades", 1, 1, 0, False, None)


@pytest.mark.unit
def test_contiguous_retries_are_duplicates_and_older_ones_have_unknown_offsets() -> None:
    driver = _driver(_create("trades", key_column=None))
    for sequence, key in ((1, 1), (2, 2)):
        driver.append(_item("trades", [key], producer=P1, sequence=sequence, contiguous=True))
    driver.effects.clear()
    last, older = driver.append(
        _item("trades", [2], producer=P1, sequence=2, contiguous=True),
        _item("trades", [1], producer=P1, sequence=1, contiguous=True),
    )
    assert last == ItemResult("trades", 1, 1, 0, True, None)
    assert older == ItemResult("trades", -1, 0, 0, True, None)
    assert driver.effects == []


@pytest.mark.unit
def test_contiguous_item_of_an_unknown_producer_is_applied_whatever_its_sequence() -> None:
    driver = _driver(_create("trades", key_column=None))
    (first,) = driver.append(_item("trades", [1], producer=P1, sequence=41, contiguous=True))
    assert first == ItemResult("trades", 0, 1, 0, False, None)


@pytest.mark.unit
def test_unary_items_may_still_skip_sequences() -> None:
    driver = _driver(_create("trades", key_column=None))
    driver.append(_item("trades", [1], producer=P1, sequence=1))
    (jump,) = driver.append(_item("trades", [5], producer=P1, sequence=5))
    assert jump == ItemResult("trades", 1, 1, 0, False, None)


@pytest.mark.property
@given(
    st.lists(
        st.tuples(st.integers(0, 8), st.booleans(), st.sampled_from((P1, P2))),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 4),
)
def test_producer_windows_decide_the_same_on_every_replica(
    plan: list[tuple[int, bool, bytes]], per_entry: int
) -> None:
    """Two replicas applying the same entries give the same results and effects, and a
    contiguous producer's applied sequences never skip one."""
    replicas = [_driver(_create("trades", key_column=None)) for _ in range(2)]
    forms: list[list[Any]] = [[], []]
    applied: dict[bytes, list[int]] = {P1: [], P2: []}
    for start in range(0, len(plan), per_entry):
        items = [
            _item("trades", [sequence], producer=producer, sequence=sequence, contiguous=flag)
            for sequence, flag, producer in plan[start : start + per_entry]
        ]
        outcomes = [replica.run(Append(TS, tuple(items))) for replica in replicas]
        for form, outcome in zip(forms, outcomes, strict=True):
            form.append(_result_form(outcome))
        for item, result in zip(items, outcomes[0].items, strict=True):
            if result.error is None and not result.duplicate_batch:
                known = applied[item.producer_id]
                if item.contiguous and known:
                    assert item.sequence == known[-1] + 1, (known, item.sequence)
                known.append(item.sequence)
    assert forms[0] == forms[1]
    effects = [[_effect_form(effect) for effect in replica.effects] for replica in replicas]
    assert effects[0] == effects[1]


# --- group commit: small batches of one table become one data-file record ---------------


@pytest.mark.unit
def test_small_batches_of_one_table_in_an_entry_become_one_record_per_table() -> None:
    driver = _driver(_create("a", key_column=None), _create("b", key_column=None))
    driver.append(_item("a", [0]))
    driver.effects.clear()
    results = driver.append(
        _item("a", [1]), _item("b", [7]), _item("a", [2, 3]), _item("b", [8]), _item("a", [4])
    )
    assert [r.first_offset for r in results] == [1, 0, 2, 1, 4]
    assert [(e.table, e.first_offset, _ids(e)) for e in driver.effects] == [
        ("a", 1, [1, 2, 3, 4]),
        ("b", 0, [7, 8]),
    ]
    record = driver.effects[0]
    assert isinstance(record, AppendRecords)
    assert record.batch.schema.equals(SCHEMA, check_metadata=True)


@pytest.mark.unit
def test_payload_of_the_table_schema_and_one_with_other_schema_bytes_read_the_same() -> None:
    """The schema message of a payload written with the table's schema is not decoded
    again; a payload with other schema bytes (metadata) takes the full reader; same rows."""
    driver = _driver(_create("t", key_column=None))
    meta = driver.machine.table("t").meta
    plain = _payload([1, 2])
    assert plain.startswith(meta.stream_prefix)
    tagged_schema = SCHEMA.with_metadata({"origin": "elsewhere"})
    tagged = _payload([3], schema=tagged_schema)
    assert not tagged.startswith(meta.stream_prefix)
    assert driver.machine.validate_append("t", plain) == 2
    assert driver.machine.validate_append("t", tagged) == 1
    driver.append(AppendItem("t", b"", 0, plain), AppendItem("t", b"", 0, tagged))
    assert [_ids(effect) for effect in driver.effects] == [[1, 2, 3]]


# --- drop, offsets, noop, LSNs -------------------------------------------------------------


@pytest.mark.unit
def test_drop_removes_the_table_and_its_topic_offsets() -> None:
    driver = _driver(_create("t"), _create("t2"))
    driver.run(CommitOffset("t/a", 5))
    driver.run(CommitOffset("t/b", 6))
    driver.run(CommitOffset("t2/a", 7))
    assert driver.run(DropTable("t", force=False)) == CommandResult(4 + 2, None)
    assert driver.effects == [DropTableFiles("t", 1)]
    assert driver.machine.topics() == {"t2/a": 7}
    with pytest.raises(TableNotFound):
        driver.machine.table("t")
    (result,) = driver.append(_item("t", [1]))
    assert isinstance(result.error, TableNotFound)


@pytest.mark.unit
def test_drop_missing_table_is_a_table_not_found_result() -> None:
    driver = _driver()
    result = driver.run(DropTable("nope", force=True))
    assert isinstance(result.error, TableNotFound)
    assert driver.effects == []


@pytest.mark.unit
def test_drop_then_create_starts_offsets_at_zero() -> None:
    driver = _driver(_create("t", key_column=None))
    driver.append(_item("t", [1, 2]))
    driver.run(DropTable("t", force=True))
    driver.run(_create("t", key_column=None))
    assert driver.append(_item("t", [3])) == (ItemResult("t", 0, 1, 0, False, None),)


@pytest.mark.unit
def test_commit_offset_stores_the_offset_as_given() -> None:
    driver = _driver(_create("t"))
    assert driver.run(CommitOffset("t/action", 10)) == CommandResult(2, None, 10)
    assert driver.run(CommitOffset("t/action", 4)).error is None  # backwards is allowed
    assert driver.machine.topic_offset("t/action") == 4
    assert driver.machine.topic_offset("t/other") is None
    assert driver.machine.topics() == {"t/action": 4}


@pytest.mark.unit
def test_commit_offset_of_an_unknown_table_or_bad_topic_is_an_error_result() -> None:
    driver = _driver()
    missing = driver.run(CommitOffset("t/action", 1))
    assert isinstance(missing.error, TableNotFound)
    assert missing.error.table == "t"
    bad = driver.run(CommitOffset("no-slash", 1))
    assert isinstance(bad.error, InvalidArgument)
    assert driver.machine.topics() == {}


@pytest.mark.unit
def test_remove_offset() -> None:
    driver = _driver(_create("t"))
    driver.run(CommitOffset("t/a", 3))
    assert driver.run(RemoveOffset("t/a")) == CommandResult(3, None, 3)
    assert driver.machine.topics() == {}
    missing = driver.run(RemoveOffset("t/a"))
    assert isinstance(missing.error, TopicNotFound)


@pytest.mark.unit
def test_noop_only_advances_the_applied_lsn() -> None:
    driver = _driver()
    effects, result = driver.machine.apply(9, Noop())
    assert (effects, result) == ([], CommandResult(9, None))
    assert driver.machine.lsn_applied == 9


@pytest.mark.unit
def test_lsns_strictly_increase_and_may_skip() -> None:
    machine = GroupStateMachine(2)
    machine.apply(3, Noop())
    machine.apply(10, Noop())
    with pytest.raises(AssertionError):
        machine.apply(10, Noop())
    with pytest.raises(AssertionError):
        machine.apply(4, Noop())


# --- validate_append -----------------------------------------------------------------------


@pytest.mark.unit
def test_validate_append_returns_the_row_count() -> None:
    driver = _driver(_create("t"))
    assert driver.machine.validate_append("t", _payload([1, 2], [3])) == 3
    assert driver.machine.validate_append("t", memoryview(_payload([1]))) == 1


@pytest.mark.unit
def test_validate_append_errors() -> None:
    machine = _driver(_create("t")).machine
    with pytest.raises(TableNotFound):
        machine.validate_append("missing", _payload([1]))
    with pytest.raises(InvalidArgument) as garbage:
        machine.validate_append("t", b"\x00garbage" * 10)
    assert garbage.value.argument == "payload"
    with pytest.raises(EmptyBatch):
        machine.validate_append("t", _payload())
    with pytest.raises(EmptyBatch):
        machine.validate_append("t", _payload([], []))
    with pytest.raises(BatchTooLarge) as too_many_bytes:
        machine.validate_append("t", bytes(limits.BATCH_BYTES_MAX + 1))
    assert too_many_bytes.value.unit == "bytes"


@pytest.mark.unit
def test_validate_append_refuses_too_many_rows() -> None:
    schema = pa.schema([("id", pa.int8())])
    driver = _driver(_create("t", key_column=None, schema_ipc=_schema_ipc(schema)))
    rows = limits.BATCH_ROWS_MAX + 1
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch([pa.array(bytes(rows), type=pa.int8())], schema=schema))
    with pytest.raises(BatchTooLarge) as raised:
        driver.machine.validate_append("t", sink.getvalue().to_pybytes())
    assert (raised.value.size, raised.value.unit) == (rows, "rows")


GOOD_PAYLOAD = _payload([1, 2, None], [4])


@pytest.mark.property
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(GOOD_PAYLOAD) - 1), st.integers(0, 255)), max_size=4
    ),
    cut=st.integers(0, len(GOOD_PAYLOAD)),
)
def test_mangled_payloads_give_only_typed_errors(flips: list[tuple[int, int]], cut: int) -> None:
    """Flipped and cut bytes never raise anything but typed errors, in validate and apply."""
    driver = _driver(_create("t"))
    mangled = bytearray(GOOD_PAYLOAD)
    for position, value in flips:
        mangled[position] = value
    payload = bytes(mangled[:cut])
    with contextlib.suppress(InvalidArgument, SchemaMismatch, EmptyBatch):
        driver.machine.validate_append("t", payload)
    (result,) = driver.append(AppendItem("t", b"", 0, payload))
    assert result.error is None or isinstance(result.error, InvalidArgument | SchemaMismatch)


# --- snapshot / restore --------------------------------------------------------------------


def _rebuild(machine: GroupStateMachine, files: dict[str, list[int | None]]) -> None:
    """What the shell does after a restore: rebuild key windows from the data files."""
    for view in machine.tables():
        span = machine.key_window_range(view.meta.table)
        if span is None:
            continue
        offset_from, offset_to = span
        keys = pa.array(files[view.meta.table][offset_from:offset_to], type=pa.int64())
        machine.rebuild_key_window(view.meta.table, keys, offset_from)


def _files(effects: list[Effect]) -> dict[str, list[int | None]]:
    files: dict[str, list[int | None]] = {}
    for effect in effects:
        if isinstance(effect, CreateTableFiles):
            files[effect.meta.table] = []
        elif isinstance(effect, DropTableFiles):
            del files[effect.table]
        else:
            rows = files[effect.table]
            assert effect.first_offset == len(rows)
            rows.extend(_ids(effect))
    return files


def _history(driver: Driver) -> None:
    driver.run(_create("keyed"))
    driver.run(_create("plain", key_column=None))
    driver.append(_item("keyed", [1, 2, 3, 4, 5, 6], producer=P1, sequence=1))
    driver.append(_item("plain", [1, 1], producer=P2, sequence=8), _item("keyed", [6, 7, 8]))
    driver.run(CommitOffset("keyed/sub", 3))
    driver.run(CommitOffset("plain/sub", 1))


FUTURE: list[Command] = [
    Append(TS, (_item("keyed", [1, 2, 3, 9, 8]),)),  # 1, 2 left the window of 4
    Append(TS, (_item("keyed", [9], producer=P1, sequence=1),)),  # retry
    Append(TS, (_item("plain", [5], producer=P2, sequence=8),)),  # retry
    Append(TS, (_item("plain", [5], producer=P2, sequence=9),)),
    CommitOffset("keyed/sub", 7),
    DropTable("plain", force=True),
    RemoveOffset("plain/sub"),
    Noop(),
]


@pytest.mark.unit
def test_restored_machine_behaves_like_the_original() -> None:
    original = _driver(window=4, producers=10)
    _history(original)
    files = _files(original.effects)
    restored = Driver(
        GroupStateMachine.restore(2, original.machine.snapshot(), dedup_window_rows=4)
    )
    assert restored.machine.key_windows_pending() == ["keyed"]
    _rebuild(restored.machine, files)
    assert restored.machine.key_windows_pending() == []
    assert restored.machine.lsn_applied == original.machine.lsn_applied
    assert restored.machine.tables() == original.machine.tables()
    assert restored.machine.topics() == original.machine.topics()
    assert restored.machine.snapshot() == original.machine.snapshot()
    original.effects.clear()
    for command in FUTURE:
        assert _result_form(restored.run(command)) == _result_form(original.run(command))
    assert [_effect_form(e) for e in restored.effects] == [
        _effect_form(e) for e in original.effects
    ]
    assert restored.machine.snapshot() == original.machine.snapshot()


@pytest.mark.unit
def test_keyed_append_before_the_window_is_rebuilt_is_a_programmer_error() -> None:
    original = _driver()
    _history(original)
    restored = Driver(GroupStateMachine.restore(2, original.machine.snapshot()))
    restored.append(_item("plain", [1]))  # unkeyed tables need no window
    with pytest.raises(AssertionError, match="not rebuilt"):
        restored.append(_item("keyed", [100]))


@pytest.mark.unit
def test_snapshot_is_deterministic_json_without_key_windows() -> None:
    first, second = _driver(window=4), _driver(window=4)
    _history(first)
    _history(second)
    data = first.machine.snapshot()
    assert data == second.machine.snapshot()
    document = json.loads(data)
    assert data == json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    assert [table["table"] for table in document["tables"]] == ["keyed", "plain"]
    assert document["topics"] == {"keyed/sub": 3, "plain/sub": 1}
    assert document["lsn_applied"] == first.machine.lsn_applied
    assert "window" not in data.decode()


@pytest.mark.unit
def test_key_window_range() -> None:
    driver = _driver(_create("keyed"), _create("plain", key_column=None), window=4)
    assert driver.machine.key_window_range("keyed") == (0, 0)
    driver.append(_item("keyed", [1, 2, 3, 4, 5, 6]))
    assert driver.machine.key_window_range("keyed") == (2, 6)
    assert driver.machine.key_window_range("plain") is None
    with pytest.raises(TableNotFound):
        driver.machine.key_window_range("missing")


@pytest.mark.unit
def test_rebuild_from_a_shorter_suffix_is_accepted() -> None:
    """Rows lost to retention make a smaller window, not a failure."""
    original = _driver(window=4)
    _history(original)
    restored = GroupStateMachine.restore(2, original.machine.snapshot(), dedup_window_rows=4)
    restored.rebuild_key_window("keyed", pa.array([8], type=pa.int64()), 7)
    _, result = restored.apply(100, Append(TS, (_item("keyed", [8, 7]),)))
    assert isinstance(result, AppendResult)
    assert (result.items[0].row_count, result.items[0].duplicates) == (1, 1)


@pytest.mark.unit
@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b"{}",
        json.dumps({"format": 99}).encode(),
    ],
    ids=["garbage", "list", "empty", "format"],
)
def test_restore_of_malformed_data_raises_invalid_argument(data: bytes) -> None:
    with pytest.raises(InvalidArgument) as raised:
        GroupStateMachine.restore(2, data)
    assert raised.value.argument == "snapshot"


@pytest.mark.unit
def test_restore_refuses_another_groups_snapshot() -> None:
    data = GroupStateMachine(3).snapshot()
    with pytest.raises(InvalidArgument, match="group 3"):
        GroupStateMachine.restore(2, data)


# --- a model-based test -----------------------------------------------------------------

TABLES = ("a", "b")
PRODUCERS = tuple(bytes([n]) * 16 for n in range(1, 5))
WINDOW_ROWS = 3
PRODUCERS_MAX = 3
MODEL_SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])
MODEL_SCHEMA_IPC = MODEL_SCHEMA.serialize().to_pybytes()
OTHER_SCHEMA = pa.schema([("id", pa.int32()), ("sym", pa.string())])

keys_strategy = st.lists(st.none() | st.integers(0, 5), max_size=5)
item_strategy = st.tuples(
    st.sampled_from(TABLES),
    keys_strategy,
    st.sampled_from((None, *PRODUCERS)),
    st.sampled_from(("next", "same", "older", "jump")),
    st.sampled_from(("good",) * 8 + ("garbage", "mismatch")),
    st.booleans(),  # contiguous (a pipelined publish)
)


def _model_payload(keys: list[int | None], kind: str) -> bytes:
    if kind == "garbage":
        return b"\xff\xff\xff\xff" + bytes(len(keys))
    schema = OTHER_SCHEMA if kind == "mismatch" else MODEL_SCHEMA
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        ids = pa.array(keys, type=schema.field("id").type)
        syms = pa.array([f"s{k}" for k in keys], type=pa.string())
        writer.write_batch(pa.record_batch([ids, syms], schema=schema))
    data: bytes = sink.getvalue().to_pybytes()
    return data


class GroupModel(RuleBasedStateMachine):
    """GroupStateMachine beside a dumb model: dicts of lists, sets and an LRU list."""

    @initialize()
    def start(self) -> None:
        self.driver = Driver(
            GroupStateMachine(2, dedup_window_rows=WINDOW_ROWS, producers_max=PRODUCERS_MAX)
        )
        self.rows: dict[str, list[int | None]] = {}  # table -> keys of its rows
        self.keyed: dict[str, bool] = {}
        self.topics: dict[str, int] = {}
        # producer -> (last sequence, (first_offset, row_count, duplicates)); LRU order.
        self.producers: OrderedDict[bytes, tuple[int, tuple[int, int, int]]] = OrderedDict()
        # Start with a keyed and an unkeyed table so most appends reach a table.
        self.create("a", keyed=True)
        self.create("b", keyed=False)

    @rule(table=st.sampled_from(TABLES), keyed=st.booleans())
    def create(self, table: str, keyed: bool) -> None:
        result = self.driver.run(
            CreateTable(table, MODEL_SCHEMA_IPC, 10, "id" if keyed else None, 60)
        )
        if table in self.rows:
            assert isinstance(result.error, TableExists)
            return
        assert result.error is None
        self.rows[table] = []
        self.keyed[table] = keyed

    @rule(table=st.sampled_from(TABLES))
    def drop(self, table: str) -> None:
        result = self.driver.run(DropTable(table, force=True))
        if table not in self.rows:
            assert isinstance(result.error, TableNotFound)
            return
        assert result.error is None
        del self.rows[table]
        self.topics = {t: o for t, o in self.topics.items() if not t.startswith(f"{table}/")}

    def _sequence(self, producer: bytes | None, mode: str) -> int:
        if producer is None or producer not in self.producers:
            return 5
        last = self.producers[producer][0]
        return {"next": last + 1, "same": last, "older": max(0, last - 1), "jump": last + 3}[mode]

    def _expect(
        self,
        table: str,
        keys: list[int | None],
        producer: bytes | None,
        sequence: int,
        contiguous: bool,
    ) -> tuple[int, int, int, bool] | str:
        """The model's ItemResult fields (first_offset, row_count, duplicates, dup_batch), or
        "gap" for a SequenceGap."""
        if producer is not None and producer in self.producers:
            last, stored = self.producers[producer]
            if sequence == last or (sequence < last and not contiguous):
                return (*stored, True)
            if sequence < last:
                return (-1, 0, 0, True)
            if contiguous and sequence > last + 1:
                return "gap"
        rows = self.rows[table]
        first_offset = len(rows)
        kept: list[int | None] = []
        if self.keyed[table]:
            recent = set(rows[-WINDOW_ROWS:])
            for key in keys:
                if key not in recent and key not in kept:
                    kept.append(key)
        else:
            kept = list(keys)
        rows.extend(kept)
        stored = (first_offset, len(kept), len(keys) - len(kept))
        if producer is not None:
            self.producers.pop(producer, None)
            self.producers[producer] = (sequence, stored)
            while len(self.producers) > PRODUCERS_MAX:
                self.producers.popitem(last=False)
        return (*stored, False)

    @rule(entry=st.lists(item_strategy, min_size=1, max_size=3))
    def append(
        self, entry: list[tuple[str, list[int | None], bytes | None, str, str, bool]]
    ) -> None:
        items = []
        planned = []
        for table, keys, producer, mode, kind, contiguous in entry:
            sequence = self._sequence(producer, mode)
            payload = _model_payload(keys, kind)
            items.append(AppendItem(table, producer or b"", sequence, payload, contiguous))
            planned.append((table, keys, producer, sequence, kind, contiguous))
        # Items of one entry apply in order, so a later item sees an earlier one's effect.
        results = self.driver.append(*items)
        for result, plan in zip(results, planned, strict=True):
            table, keys, producer, sequence, kind, contiguous = plan
            if table not in self.rows:
                assert isinstance(result.error, TableNotFound)
            elif kind == "garbage":
                assert isinstance(result.error, InvalidArgument)
            elif kind == "mismatch":
                assert isinstance(result.error, SchemaMismatch)
            else:
                expected = self._expect(table, keys, producer, sequence, contiguous)
                if expected == "gap":
                    assert isinstance(result.error, SequenceGap)
                    continue
                assert result.error is None
                actual = (
                    result.first_offset,
                    result.row_count,
                    result.duplicates,
                    result.duplicate_batch,
                )
                assert actual == expected

    @rule(
        table=st.sampled_from(TABLES), action=st.sampled_from(("x", "y")), offset=st.integers(-1, 9)
    )
    def commit_offset(self, table: str, action: str, offset: int) -> None:
        topic = f"{table}/{action}"
        result = self.driver.run(CommitOffset(topic, offset))
        if table not in self.rows:
            assert isinstance(result.error, TableNotFound)
            return
        assert result == CommandResult(self.driver.machine.lsn_applied, None, offset)
        self.topics[topic] = offset

    @rule(table=st.sampled_from(TABLES), action=st.sampled_from(("x", "y")))
    def remove_offset(self, table: str, action: str) -> None:
        topic = f"{table}/{action}"
        result = self.driver.run(RemoveOffset(topic))
        if topic not in self.topics:
            assert isinstance(result.error, TopicNotFound)
            return
        assert result.offset == self.topics.pop(topic)

    @rule()
    def restart(self) -> None:
        """Checkpoint, restore and rebuild the key windows from the data files."""
        files = _files(self.driver.effects)
        machine = GroupStateMachine.restore(
            2,
            self.driver.machine.snapshot(),
            dedup_window_rows=WINDOW_ROWS,
            producers_max=PRODUCERS_MAX,
        )
        _rebuild(machine, files)
        self.driver.machine = machine

    @invariant()
    def tables_match(self) -> None:
        views = self.driver.machine.tables()
        assert [view.meta.table for view in views] == sorted(self.rows)
        for view in views:
            assert view.row_count == len(self.rows[view.meta.table])
            assert (view.meta.key_column is not None) == self.keyed[view.meta.table]

    @invariant()
    def files_match(self) -> None:
        assert _files(self.driver.effects) == self.rows

    @invariant()
    def topics_match(self) -> None:
        assert self.driver.machine.topics() == self.topics


# The model tests' settings (tests/test_check_memo.py runs its model with them too).
MODEL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
GroupModel.TestCase.settings = MODEL_SETTINGS
TestGroupModel = pytest.mark.property(GroupModel.TestCase)


# --- purity --------------------------------------------------------------------------------

CORE = ("commands.py", "dedup.py", "state_machine.py")
FORBIDDEN = {"os", "time", "random", "socket", "grpc", "pysyncobj", "threading", "subprocess"}


@pytest.mark.unit
@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_io(module: str) -> None:
    path = Path(__file__).resolve().parent.parent / "raftstore" / module
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN


@pytest.mark.unit
def test_has_table_answers_without_an_error_for_a_name_it_does_not_hold() -> None:
    machine = GroupStateMachine(2)
    assert not machine.has_table("t")
    machine.apply(1, _create("t"))
    assert machine.has_table("t")
    machine.apply(2, DropTable("t", force=False))
    assert not machine.has_table("t")
