"""check_memo.py and its use by the state machine: a leader's payload check, kept for the
apply of the entry that carries it, never makes the leader decide otherwise than a follower
that reads the entry alone."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hastream.checksum import crc32
from hastream.errors import RaftStoreError
from raftstore import limits
from raftstore.batch_memory import COLUMN_OVERHEAD_BYTES
from raftstore.check_memo import CheckMemo
from raftstore.commands import Append, AppendItem, Command, CreateTable, DropTable
from raftstore.state_machine import (
    AppendRecords,
    AppendResult,
    CommandResult,
    GroupStateMachine,
)
from tests.test_state_machine import (
    MODEL_SCHEMA,
    MODEL_SETTINGS,
    OTHER_SCHEMA,
    Driver,
    _model_payload,
)

SCHEMA, OTHER = MODEL_SCHEMA, OTHER_SCHEMA  # (id int64, sym string) and (id int32, sym string)
TS = 1_700_000_000_000


def _payload(ids: list[int], schema: pa.Schema = SCHEMA) -> bytes:
    return _model_payload(list(ids), "mismatch" if schema is OTHER else "good")


def _create(table: str, schema: pa.Schema = SCHEMA, key: str | None = None) -> CreateTable:
    return CreateTable(table, schema.serialize().to_pybytes(), 100, key, 60)


def _machine(memo: CheckMemo[Any, Any] | None = None) -> Driver:
    """A replica's state machine, fed through the real command encoding (test_state_machine's
    Driver); `memo`: a smaller memo than the machine's own."""
    driver = Driver(GroupStateMachine(2))
    if memo is not None:
        driver.machine.check_memo = memo
    return driver


def _rows(driver: Driver, effect: AppendRecords) -> dict[str, list[Any]]:
    """The rows of an append effect: its batch, or its message where apply took a sealed
    publish unread (checked_payload.py)."""
    batch = effect.batch
    if batch is None:
        assert effect.encoded is not None
        schema = driver.machine.table(effect.table).meta.schema
        batch = pa.ipc.read_record_batch(pa.py_buffer(effect.encoded), schema)
    rows: dict[str, list[Any]] = batch.to_pydict()
    return rows


def _decided(driver: Driver, command: Command) -> Any:
    """What a replica decided for `command` and must write: results, rows, and the bytes a
    data file gets."""
    first = len(driver.effects)
    result = driver.run(command)
    written = [
        (
            e.table,
            e.first_offset,
            _rows(driver, e),
            None if e.encoded is None else bytes(e.encoded),
        )
        for e in driver.effects[first:]
        if isinstance(e, AppendRecords)
    ]
    if isinstance(result, CommandResult):
        answer: Any = (type(result.error).__name__, result.offset)
    else:
        answer = [
            (i.first_offset, i.row_count, i.duplicates, type(i.error).__name__)
            for i in result.items
        ]
    return answer, written


def _append(*payloads: tuple[str, bytes]) -> Append:
    return Append(TS, tuple(AppendItem(table, b"", 0, payload) for table, payload in payloads))


# --- the memo alone ---------------------------------------------------------------------------


@pytest.mark.unit
def test_a_check_is_taken_back_once_for_the_same_bytes_and_owner() -> None:
    memo: CheckMemo[object, str] = CheckMemo(entries_max=4, bytes_max=100, payload_bytes_max=10)
    owner = object()
    memo.remember("t", b"abc", owner, "checked", 3)
    assert memo.take("t", memoryview(b"xabc")[1:], owner) == "checked"
    assert memo.take("t", b"abc", owner) is None  # taken: forgotten
    assert (len(memo), memo.bytes_kept, memo.hits) == (0, 0, 1)


def _colliding(payload: bytes) -> bytes:
    """Other bytes of the same length and CRC-32 as `payload`: its first byte flipped, its
    last four solved for (CRC-32 is affine over GF(2) in them: 32 linear equations)."""
    head = bytes([payload[0] ^ 1]) + payload[1:-4]

    def crc_of(tail: int) -> int:
        return crc32(head + tail.to_bytes(4, "little"))

    base = crc_of(0)
    # Each row: the CRC bits a combination of tail bits flips, and that combination.
    rows = [(crc_of(1 << bit) ^ base, 1 << bit) for bit in range(32)]
    wanted, solution = crc32(payload) ^ base, 0
    for bit in range(32):
        pivot = next(row for row in rows if row[0] >> bit & 1)  # a bijection: always found
        rows.remove(pivot)
        rows = [
            (flips ^ pivot[0], tail ^ pivot[1]) if flips >> bit & 1 else (flips, tail)
            for flips, tail in rows
        ]
        if wanted >> bit & 1:
            wanted ^= pivot[0]
            solution ^= pivot[1]
    return head + solution.to_bytes(4, "little")


@pytest.mark.unit
def test_a_check_with_a_suffix_is_taken_back_only_by_the_payload_and_that_suffix() -> None:
    """The leader's seal follows the payload in the entry's blob (checked_payload.py)."""
    memo: CheckMemo[object, str] = CheckMemo(entries_max=4, bytes_max=100, payload_bytes_max=10)
    owner = object()
    for blob in (b"payload", b"payload" + b"seal", b"payload" + b"sEal", b"payloadseal!"):
        memo.remember("t", b"payload", owner, "checked", 10, suffix=b"seal")
        taken = memo.take("t", memoryview(blob), owner)
        assert taken == ("checked" if blob == b"payloadseal" else None), blob
    assert memo.hits == 1


@pytest.mark.unit
def test_bytes_of_the_same_length_and_crc_are_a_miss() -> None:
    memo: CheckMemo[object, str] = CheckMemo(entries_max=4, bytes_max=100, payload_bytes_max=16)
    owner = object()
    payload = b"0123456789ab"
    other = _colliding(payload)
    assert other != payload
    assert (len(other), crc32(other)) == (len(payload), crc32(payload))
    memo.remember("t", payload, owner, "checked", 12)
    assert memo.take("t", other, owner) is None  # found by its key, refused by its bytes
    assert (len(memo), memo.bytes_kept, memo.hits) == (0, 0, 0)


@pytest.mark.unit
def test_another_owner_table_or_bytes_is_a_miss() -> None:
    memo: CheckMemo[object, str] = CheckMemo(entries_max=4, bytes_max=100, payload_bytes_max=10)
    owner = object()
    memo.remember("t", b"abc", owner, "checked", 3)
    assert memo.take("u", b"abc", owner) is None
    assert memo.take("t", b"abd", owner) is None
    assert memo.take("t", b"abc", object()) is None  # a re-created table: another incarnation
    assert memo.take("t", b"abc", owner) is None  # the owner miss forgot it too
    assert memo.hits == 0


@pytest.mark.unit
def test_bounds_are_enforced_oldest_first() -> None:
    memo: CheckMemo[int, int] = CheckMemo(entries_max=3, bytes_max=10, payload_bytes_max=4)
    for number in range(5):
        memo.remember("t", bytes([number]) * 2, 0, number, 2)
    assert len(memo) == 3  # entries_max
    assert memo.take("t", b"\x00\x00", 0) is None
    assert memo.take("t", b"\x04\x04", 0) == 4
    memo.remember("t", b"aaaa", 0, 10, 4)
    memo.remember("t", b"bbbb", 0, 11, 7)  # what its value keeps alive counts too
    assert memo.bytes_kept <= 10  # bytes_max: the oldest went
    assert memo.take("t", b"aaaa", 0) is None
    assert memo.take("t", b"bbbb", 0) == 11
    memo.remember("t", b"cccc", 0, 12, 11)  # alone above bytes_max: not kept at all
    assert (memo.take("t", b"cccc", 0), memo.bytes_kept) == (None, 0)
    assert not memo.fits(b"12345")  # payload_bytes_max
    assert memo.take("t", b"12345", 0) is None


@pytest.mark.unit
def test_the_same_bytes_remembered_twice_count_once() -> None:
    memo: CheckMemo[int, int] = CheckMemo(entries_max=3, bytes_max=10, payload_bytes_max=4)
    memo.remember("t", b"ab", 0, 1, 5)
    memo.remember("t", b"ab", 0, 2, 3)
    assert (len(memo), memo.bytes_kept) == (1, 3)
    assert memo.take("t", b"ab", 0) == 2


@pytest.mark.unit
def test_clear_forgets_everything() -> None:
    memo: CheckMemo[int, int] = CheckMemo(entries_max=3, bytes_max=10, payload_bytes_max=4)
    memo.remember("t", b"ab", 0, 1, 2)
    memo.clear()
    assert (len(memo), memo.bytes_kept, memo.take("t", b"ab", 0)) == (0, 0, None)


@pytest.mark.unit
@pytest.mark.parametrize(
    "bounds",
    [(0, 10, 4), (3, 10, 0), (3, 3, 4)],
    ids=["no-entries", "no-payload", "bytes-below-one-payload"],
)
def test_bad_bounds_are_refused(bounds: tuple[int, int, int]) -> None:
    entries_max, bytes_max, payload_bytes_max = bounds
    with pytest.raises(ValueError, match="CheckMemo bounds"):
        CheckMemo(entries_max=entries_max, bytes_max=bytes_max, payload_bytes_max=payload_bytes_max)


@pytest.mark.unit
def test_the_machines_memo_has_the_declared_limits() -> None:
    memo = GroupStateMachine(2).check_memo
    assert memo.payload_bytes_max == limits.CHECK_MEMO_PAYLOAD_BYTES_MAX
    payload = b"x" * limits.CHECK_MEMO_PAYLOAD_BYTES_MAX
    for number in range(limits.CHECK_MEMO_ENTRIES_MAX + 10):
        memo.remember("t", number.to_bytes(4, "big") + payload[4:], 0, number, len(payload))
    assert len(memo) <= limits.CHECK_MEMO_ENTRIES_MAX
    assert memo.bytes_kept <= limits.CHECK_MEMO_BYTES_MAX


@pytest.mark.unit
def test_a_wide_tables_kept_checks_count_their_arrow_arrays() -> None:
    """One row of 60 columns is ~6 KB of payload but keeps ~30 KB of Arrow arrays alive: the
    bound counts those, so it holds about a hundred such checks, not a thousand."""
    columns = 60
    schema = pa.schema([(f"c{i}", pa.int32()) for i in range(columns)])
    machine = GroupStateMachine(2)
    machine.apply(1, CreateTable("wide", schema.serialize().to_pybytes(), 100, None, 60))
    for number in range(600):
        batch = pa.record_batch([pa.array([number], pa.int32())] * columns, schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as writer:
            writer.write_batch(batch)
        payload = sink.getvalue().to_pybytes()
        assert len(payload) <= limits.CHECK_MEMO_PAYLOAD_BYTES_MAX
        machine.validate_append("wide", payload)
    memo = machine.check_memo
    assert memo.bytes_kept <= limits.CHECK_MEMO_BYTES_MAX
    assert len(memo) < limits.CHECK_MEMO_BYTES_MAX // (columns * COLUMN_OVERHEAD_BYTES)


def _ipc(schema: pa.Schema, columns: list[pa.Array]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.record_batch(columns, schema=schema))
    return sink.getvalue().to_pybytes()


@pytest.mark.unit
def test_a_payload_above_16_kib_is_kept_only_when_it_is_mostly_rows() -> None:
    """A 1,000-row publish (64 KiB) is kept; one row of a 211-column table (22 KB, nearly
    all Arrow metadata) is not: the row cache would keep the copy alive beyond what it
    counts (peak RSS, docs/benchmark.md)."""
    narrow = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    wide = pa.schema([(f"c{i}", pa.int64()) for i in range(211)])
    machine = GroupStateMachine(2)
    for lsn, (name, schema) in enumerate((("narrow", narrow), ("wide", wide)), start=1):
        machine.apply(lsn, CreateTable(name, schema.serialize().to_pybytes(), 100, None, 60))
    rows = pa.array(range(4_000), pa.int64())
    many_rows = _ipc(narrow, [rows, rows])
    one_wide_row = _ipc(wide, [pa.array([1], pa.int64())] * 211)
    for payload in (many_rows, one_wide_row):
        assert 16 * 1024 < len(payload) <= limits.CHECK_MEMO_PAYLOAD_BYTES_MAX
    assert machine.validate_append("narrow", many_rows) == 4_000
    assert machine.validate_append("wide", one_wide_row) == 1
    assert len(machine.check_memo) == 1
    result = machine.apply(3, _append(("narrow", many_rows), ("wide", one_wide_row)))[1]
    assert isinstance(result, AppendResult)
    assert [item.row_count for item in result.items] == [4_000, 1]
    assert (machine.check_memo.hits, len(machine.check_memo)) == (1, 0)


# --- through the state machine ------------------------------------------------------------------


@pytest.mark.unit
def test_the_leaders_apply_takes_its_check_back_and_decides_as_a_follower() -> None:
    leader, follower = _machine(), _machine()
    for replica in (leader, follower):
        replica.run(_create("t"))
    payload = _payload([1, 2])
    assert leader.machine.validate_append("t", payload) == 2
    entry = _append(("t", payload))
    assert _decided(leader, entry) == _decided(follower, entry)
    assert leader.machine.check_memo.hits == 1
    assert follower.machine.check_memo.hits == 0
    assert len(leader.machine.check_memo) == 0


@pytest.mark.unit
def test_a_check_made_before_a_drop_and_re_create_is_not_used() -> None:
    leader, follower = _machine(), _machine()
    for replica in (leader, follower):
        replica.run(_create("t"))
    payload = _payload([1])
    leader.machine.validate_append("t", payload)  # valid against the first incarnation
    for replica in (leader, follower):
        replica.run(DropTable("t", force=True))
        replica.run(_create("t", OTHER))
    entry = _append(("t", payload))
    decided = _decided(leader, entry)
    assert decided == _decided(follower, entry)
    assert decided[0] == [(-1, 0, 0, "SchemaMismatch")]
    assert leader.machine.check_memo.hits == 0


@pytest.mark.unit
def test_a_reused_caller_buffer_does_not_change_what_was_kept() -> None:
    """The publish port reads into buffers it reuses: the kept check must not view them."""
    leader, follower = _machine(), _machine()
    for replica in (leader, follower):
        replica.run(_create("t"))
    payload = _payload([7, 8, 9])
    buffer = bytearray(payload)
    leader.machine.validate_publish(leader.machine.table("t").meta, memoryview(buffer))
    buffer[:] = _payload([0, 0, 0])  # same length, other rows
    entry = _append(("t", payload))
    decided = _decided(leader, entry)
    assert decided == _decided(follower, entry)
    assert decided[1][0][2] == {"id": [7, 8, 9], "sym": ["s7", "s8", "s9"]}


@pytest.mark.unit
def test_a_payload_above_the_memos_size_is_checked_and_read_again() -> None:
    leader = _machine()
    leader.run(_create("t"))
    payload = _payload(list(range(20_000)))
    assert len(payload) > limits.CHECK_MEMO_PAYLOAD_BYTES_MAX
    assert leader.machine.validate_append("t", payload) == 20_000
    assert len(leader.machine.check_memo) == 0
    result = leader.run(_append(("t", payload)))
    assert isinstance(result, AppendResult)
    assert result.items[0].row_count == 20_000


# --- a leader and a follower side by side, over generated sequences ----------------------------

TABLES = ("a", "b")
PAYLOADS = (
    _payload([1]),
    _payload([2, 3]),
    _payload([1], OTHER),  # valid for a re-created table of the other schema
    b"\xff\xff\xff\xff" + bytes(12),  # garbage: never remembered
)


class LeaderBesideFollower(RuleBasedStateMachine):
    """The leader validates some payloads (some against tables that later change), and both
    apply the same entries; a tiny memo makes eviction common. Both must decide alike."""

    @initialize()
    def start(self) -> None:
        memo: CheckMemo[Any, Any] = CheckMemo(entries_max=3, bytes_max=4096, payload_bytes_max=2048)
        self.leader = _machine(memo)
        self.follower = _machine()
        self.queued: list[tuple[str, bytes]] = []
        for table in TABLES:  # most publishes then reach a table
            self.create(table, other=False)

    def _both(self, command: Command) -> None:
        assert _decided(self.leader, command) == _decided(self.follower, command)

    @rule(table=st.sampled_from(TABLES), other=st.booleans())
    def create(self, table: str, other: bool) -> None:
        self._both(_create(table, OTHER if other else SCHEMA))

    @rule(table=st.sampled_from(TABLES))
    def drop(self, table: str) -> None:
        self._both(DropTable(table, force=True))

    @rule(table=st.sampled_from(TABLES), payload=st.sampled_from(PAYLOADS), checked=st.booleans())
    def publish(self, table: str, payload: bytes, checked: bool) -> None:
        """A publish the leader validated (if it passes), or one it did not (a replay after a
        restart, an entry of an earlier leader): both reach the log the same way."""
        if checked:
            try:
                self.leader.machine.validate_append(table, payload)
            except RaftStoreError:
                return  # refused before proposing: never in the log
        self.queued.append((table, payload))

    @precondition(lambda self: bool(self.queued))
    @rule(count=st.integers(1, 4))
    def commit(self, count: int) -> None:
        items, self.queued = self.queued[:count], self.queued[count:]
        self._both(_append(*items))

    @invariant()
    def bounded(self) -> None:
        memo = self.leader.machine.check_memo
        assert len(memo) <= 3
        assert memo.bytes_kept <= 4096
        assert len(self.follower.machine.check_memo) == 0


LeaderBesideFollower.TestCase.settings = MODEL_SETTINGS
TestLeaderBesideFollower = pytest.mark.property(LeaderBesideFollower.TestCase)
