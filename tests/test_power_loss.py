"""Power loss at any point of a node's storage work, on the simulated disk (SimFiles).

A seeded workload drives what a group does to its files (append to tables' data files, sync
them, add and sync Raft journal entries, drop a conflicting suffix, take a checkpoint and
compact the journal, create tables, apply retention, repair a table, and restart the
process after a kill -9). The power goes at a seeded point, optionally tearing un-fsynced
appends; then everything is reopened and checked: whatever a call had reported durable
(its data fsynced AND its directories fsynced) is there, and nothing beyond what was
written is invented. Nothing un-synced is required.

Replay a failure: the seed and crash point are in the test id and the assertion message,
e.g. `pytest tests/test_power_loss.py -k "seed7"`.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hastream.errors import OffsetOutOfRange
from raftstore.storage import checkpoint
from raftstore.storage.files import OpenFiles, PowerLoss, SimFiles
from raftstore.storage.journal import DurableJournal
from raftstore.storage.segments import DataRecord, TableLog

pytestmark = pytest.mark.storage

GROUP = Path("/node/group-1")
CHECKPOINT = GROUP / "checkpoint"
CHECKPOINT_KIND = b"GCKP"
SEGMENT_BYTES_MAX = 400  # Small: segments roll every few records.
# Small too: the journal rolls every few entries, and its checkpoints free segments that
# later ones reuse (spares).
JOURNAL_SEGMENT_BYTES_MAX = 120
STEPS = 70
SEEDS = range(24)
CRASH_POINTS_PER_SEED = 10


def _payload(table: str, first_offset: int, size: int) -> bytes:
    seed = zlib.crc32(f"{table}/{first_offset}".encode()).to_bytes(4, "little")
    return (seed * (size // 4 + 1))[:size]


def _command(idx: int, term: int) -> bytes:
    return f"command-{idx}-term-{term}".encode()


@dataclass
class _Table:
    records: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # offset -> lsn..
    row_count: int = 0  # Rows appended (completed calls).
    synced_rows: int = 0  # Rows that must survive.
    earliest: int = 0  # earliest_offset after the last completed call that moves it.
    earliest_uncertain: bool = False  # Such a call was in flight.
    # earliest_offset at the last completed sync: retention's removals are durable only
    # from the next sync on, so a power loss may bring removed rows back down to here.
    earliest_durable: int = 0


@dataclass
class _Expected:
    tables: dict[str, _Table] = field(default_factory=dict)  # Constructor returned.
    commands_ever: dict[int, set[bytes]] = field(default_factory=dict)
    journal_required: dict[int, bytes] = field(default_factory=dict)
    checkpoints: set[bytes | None] = field(default_factory=lambda: {None})


class _Node:
    """One node's storage on the simulated disk, driven by a seeded workload. Expectations
    of what must be there change only when a call returns (a PowerLoss unwinds out of the
    call); what may be there (`commands_ever`) grows before the write is tried."""

    def __init__(self, sim: SimFiles, seed: int) -> None:
        self.sim = sim
        self.random = random.Random(seed)
        self.expected = _Expected()
        self.idx = 0  # The journal's last Raft index.
        self.term = 1
        self.clock_ms = 0
        self.checkpoints = 0
        self.open_process()

    def open_process(self) -> None:
        """Start (or restart after a kill -9: nothing lost, nothing synced by the old
        process). What is found is made durable at open, so all of it is required now."""
        self.open_files = OpenFiles(open_max=3)  # Tiny: handles are dropped and reopened.
        self.journal = DurableJournal(
            GROUP, files=self.sim, segment_bytes_max=JOURNAL_SEGMENT_BYTES_MAX
        )
        self.expected.journal_required = {idx: command for command, idx, _ in self.journal[:]}
        self.tables: dict[str, TableLog] = {}
        for name in self.expected.tables:
            log = self._open_table(name)
            table = self.expected.tables[name]
            table.synced_rows = table.row_count
            table.earliest = table.earliest_durable = log.earliest_offset

    def _open_table(self, name: str) -> TableLog:
        log = TableLog(
            GROUP / name,
            segment_bytes_max=SEGMENT_BYTES_MAX,
            files=self.sim,
            open_files=self.open_files,
        )
        self.tables[name] = log
        return log

    def run(self, steps: int) -> None:
        actions = (
            (self.create_table, 1),
            (self.apply, 8),
            (self.sync_table, 2),
            (self.sync_journal, 3),
            (self.conflicting_suffix, 1),
            (self.checkpoint, 2),
            (self.retention, 1),
            (self.repair, 1),
            (self.restart, 1),
        )
        choices = [action for action, weight in actions for _ in range(weight)]
        self.create_table()
        for _ in range(steps):
            self.random.choice(choices)()

    # --- steps -------------------------------------------------------------------------

    def create_table(self) -> None:
        name = f"t{len(self.tables)}"
        if name in self.tables:
            return
        self._open_table(name)
        self.expected.tables[name] = _Table()

    def apply(self) -> None:
        """One Raft entry: journal add, then its batches appended to a table (no syncs)."""
        self._add_entry()
        name = self.random.choice(sorted(self.tables))
        log, table = self.tables[name], self.expected.tables[name]
        # A record's LSN is its entry's index; it never goes down, also across a suffix the
        # journal dropped (conflicting_suffix).
        lsn = max(self.idx, log.lsn_last)
        self.clock_ms += self.random.randint(0, 50)
        for _ in range(self.random.randint(1, 3)):
            rows, size = self.random.randint(1, 5), self.random.randint(1, 150)
            first_offset = log.row_count
            payload = _payload(name, first_offset, size)
            log.append(DataRecord(lsn, first_offset, rows, self.clock_ms, payload))
            table.records[first_offset] = (lsn, rows, size)
            table.row_count = first_offset + rows

    def sync_table(self) -> None:
        self._sync_table(self.random.choice(sorted(self.tables)))

    def _sync_table(self, name: str) -> None:
        log, table = self.tables[name], self.expected.tables[name]
        log.sync()
        table.synced_rows = table.row_count
        table.earliest_durable = log.earliest_offset

    def sync_journal(self) -> None:
        self.journal.sync()
        self.expected.journal_required = {idx: command for command, idx, _ in self.journal[:]}

    def conflicting_suffix(self) -> None:
        """A follower drops entries a new leader does not have, then takes the leader's."""
        if len(self.journal) < 2:
            return
        keep = self.random.randint(1, len(self.journal) - 1)
        first_dropped = self.journal[keep][1]
        for idx in list(self.expected.journal_required):
            if idx >= first_dropped:
                del self.expected.journal_required[idx]  # No longer required, from now on.
        self.journal.truncate_from(keep)
        self.term += 1
        self.idx = first_dropped - 1
        for _ in range(self.random.randint(1, 3)):
            self._add_entry()

    def _add_entry(self) -> None:
        command = _command(self.idx + 1, self.term)
        # Before the call: a record whose write the power cut may still be whole on disk
        # (a torn write keeps any prefix of it, all of it too).
        self.expected.commands_ever.setdefault(self.idx + 1, set()).add(command)
        self.journal.append(command, self.idx + 1, self.term)
        self.idx += 1

    def checkpoint(self) -> None:
        """What the group's serializer does: sync every table, write the checkpoint, then
        compact the journal."""
        for name in self.tables:
            self._sync_table(name)
        self.checkpoints += 1
        body = f"checkpoint {self.checkpoints} idx {self.idx}".encode()
        self.expected.checkpoints.add(body)
        checkpoint.write_atomic(CHECKPOINT, CHECKPOINT_KIND, body, files=self.sim)
        self.expected.checkpoints = {body}
        if len(self.journal) > 2:
            first_kept = self.journal[len(self.journal) - 2][1]
            for idx in list(self.expected.journal_required):
                if idx < first_kept:
                    del self.expected.journal_required[idx]  # Covered by the checkpoint.
            self.journal.drop_first(len(self.journal) - 2)

    def retention(self) -> None:
        name = self.random.choice(sorted(self.tables))
        log, table = self.tables[name], self.expected.tables[name]
        table.earliest_uncertain = True
        cutoff = self.clock_ms - self.random.randint(0, 100)
        log.remove_segments_before(cutoff, keep_rows=self.random.randint(0, 20))
        table.earliest = log.earliest_offset
        table.earliest_uncertain = False

    def repair(self) -> None:
        """truncate_from: rows from a record boundary on are dropped (durably on return)."""
        name = self.random.choice(sorted(self.tables))
        log, table = self.tables[name], self.expected.tables[name]
        candidates = [offset for offset in table.records if offset >= log.earliest_offset]
        if not candidates:
            return
        cut = self.random.choice(candidates)
        table.synced_rows = min(table.synced_rows, cut)  # May go down to here from now on.
        table.earliest_uncertain = True
        log.truncate_from(cut)
        for offset in [offset for offset in table.records if offset >= cut]:
            del table.records[offset]
        table.row_count = log.row_count
        table.earliest = table.earliest_durable = log.earliest_offset  # It syncs first.
        table.earliest_uncertain = False
        assert table.row_count == cut

    def restart(self) -> None:
        """kill -9 and start again: the page cache keeps everything, nothing is synced."""
        self.open_process()


# --- checks ----------------------------------------------------------------------------------


def _check_tables(sim: SimFiles, expected: _Expected, where: str) -> None:
    open_files = OpenFiles(open_max=3)
    for name, table in expected.tables.items():
        assert sim.is_dir(GROUP / name), f"{where}: table directory {name} vanished"
        log = TableLog(
            GROUP / name, segment_bytes_max=SEGMENT_BYTES_MAX, files=sim, open_files=open_files
        )
        label = f"{where} table={name}"
        assert log.row_count >= table.synced_rows, (label, log.row_count, table.synced_rows)
        assert log.row_count <= max(table.row_count, table.synced_rows), label
        earliest_max = log.row_count if table.earliest_uncertain else table.earliest
        earliest_range = (table.earliest_durable, earliest_max)
        assert min(earliest_range[0], log.row_count) <= log.earliest_offset, (label, earliest_range)
        assert log.earliest_offset <= min(earliest_range[1], log.row_count), (label, earliest_range)
        offset = log.earliest_offset
        try:
            records = list(log.read(offset))
        except OffsetOutOfRange as error:
            raise AssertionError(f"{label}: {error}") from error
        for record in records:
            assert record.first_offset == offset, label
            lsn, rows, size = table.records[offset]
            assert (record.lsn, record.row_count) == (lsn, rows), label
            assert bytes(record.payload) == _payload(name, offset, size), label
            offset += rows
        assert offset == log.row_count, label
        log.close()


def _check_journal(sim: SimFiles, expected: _Expected, where: str) -> None:
    journal = DurableJournal(GROUP, files=sim, segment_bytes_max=JOURNAL_SEGMENT_BYTES_MAX)
    found = {idx: command for command, idx, _ in journal[:]}
    for idx, command in expected.journal_required.items():
        assert found.get(idx) == command, f"{where}: synced journal entry {idx} lost"
    for idx, command in found.items():
        assert command in expected.commands_ever.get(idx, set()), f"{where}: entry {idx}"
    journal.close()


def _check_checkpoint(sim: SimFiles, expected: _Expected, where: str) -> None:
    try:
        body: bytes | None = checkpoint.read_checked(CHECKPOINT, CHECKPOINT_KIND, files=sim)
    except FileNotFoundError:
        body = None
    assert body in expected.checkpoints, (where, body, expected.checkpoints)


def _operations(seed: int) -> int:
    """How many operations the workload of `seed` performs, run without a power loss."""
    sim = SimFiles(seed=seed)
    _Node(sim, seed).run(STEPS)
    return sim.operations


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed{seed}")
def test_power_loss_keeps_everything_synced_and_invents_nothing(seed: int) -> None:
    total = _operations(seed)
    picker = random.Random(seed)
    crash_points = sorted(picker.sample(range(total), min(CRASH_POINTS_PER_SEED, total)))
    for crash_point in crash_points:
        torn = picker.random() < 0.5
        where = f"seed={seed} crash_at={crash_point}/{total} torn={torn}"
        print(where)
        sim = SimFiles(seed=seed)
        sim.crash_at(crash_point, torn=torn)
        node: _Node | None = None
        try:
            node = _Node(sim, seed)
            node.run(STEPS)
        except PowerLoss:
            pass
        assert not sim.powered, f"{where}: the power never went"
        sim.restart()
        expected = node.expected if node is not None else _Expected()
        _check_journal(sim, expected, where)
        _check_checkpoint(sim, expected, where)
        _check_tables(sim, expected, where)


def test_power_loss_after_a_kill_and_restart_keeps_what_the_dead_process_wrote() -> None:
    """A process killed before its syncs leaves data in the page cache; the next run takes
    it as written (its Raft log may then be compacted), so it must be made durable at open."""
    sim = SimFiles(seed=1)
    node = _Node(sim, seed=1)
    node.create_table()
    for _ in range(10):
        node.apply()
    node.restart()  # Nothing was synced by the first process.
    sim.crash()
    _check_journal(sim, node.expected, "after restart")
    _check_tables(sim, node.expected, "after restart")
