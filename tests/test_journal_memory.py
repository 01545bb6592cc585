"""The journal holds only its newest commands in memory and reads the rest back from its
file: whatever it holds, every read answers as a plain list of the entries would."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hastream.errors import CorruptionError
from raftstore.storage.files import PAGE_BYTES, SimFiles
from raftstore.storage.journal import SPARE_PREFIX, SPARES_ROOM_CHECK_S, DurableJournal, Entry

pytestmark = pytest.mark.storage

SIM_DIR = Path("/node/group-1")
RESIDENT = 64  # bytes: a few commands, so most reads go to the file
SEGMENT = 150  # bytes: a new segment every few entries


def pysyncobj_get_entries(
    log: list[Entry], first: int, count: int | None, bytes_max: int | None
) -> list[Entry]:
    """pysyncobj's __getEntries over a plain list (syncobj.py, 0.3.17)."""
    result = log[first:] if count is None else log[first : first + count]
    if bytes_max is None:
        return result
    total = 0
    for i, entry in enumerate(result):
        total += len(entry[0])
        if total >= bytes_max:
            return result[: i + 1]
    return result


class JournalAgainstAList(RuleBasedStateMachine):
    segment = SEGMENT
    command_bytes: int | None = None  # every command this long (the drawn bytes padded)

    def __init__(self) -> None:
        super().__init__()
        self.sim = SimFiles()
        self.journal = self._open()
        self.model: list[Entry] = []
        self.synced = 0  # the model's first entries known to be on disk
        self.next_idx = 1
        self.term = 1
        self.clock = 0.0  # the tick's monotonic clock, for the journal's look at the room

    def _open(self) -> DurableJournal:
        return DurableJournal(
            SIM_DIR, files=self.sim, resident_bytes_max=RESIDENT, segment_bytes_max=self.segment
        )

    @rule(size=st.integers(0, 40), data=st.data())
    def append(self, size: int, data: st.DataObject) -> None:
        command = self._command(data.draw(st.binary(min_size=size, max_size=size)))
        self.journal.append(command, self.next_idx, self.term)
        self.model.append((command, self.next_idx, self.term))
        self.next_idx += 1

    def _command(self, drawn: bytes) -> bytes:
        if self.command_bytes is None:
            return drawn
        return (drawn + bytes(self.command_bytes))[: self.command_bytes]

    @rule(count=st.integers(1, 30), size=st.integers(0, 40), fill=st.integers(0, 255))
    def append_burst(self, count: int, size: int, fill: int) -> None:
        """Many entries at once, so that segments fill, are freed and are reused."""
        for number in range(count):
            command = self._command(bytes([(fill + number) % 256]) * size)
            self.journal.append(command, self.next_idx, self.term)
            self.model.append((command, self.next_idx, self.term))
            self.next_idx += 1

    @rule(size=st.integers(0, 40))
    def append_on_a_full_disk(self, size: int) -> None:
        """Someone else fills the disk: an append that needs new room fails with nothing
        changed and gives every spare back; once there is room, its resend goes in."""
        command = self._command(bytes([size % 256]) * size)
        self.sim.disk_bytes_max = self.sim.bytes_used()
        refused: OSError | None = None
        try:
            self.journal.append(command, self.next_idx, self.term)
        except OSError as error:
            refused = error
        finally:
            self.sim.disk_bytes_max = None
        if refused is not None:
            assert refused.errno == errno.ENOSPC, refused
            assert not self._spares()
            assert self.journal[:] == self.model
            self.journal.append(command, self.next_idx, self.term)
        self.model.append((command, self.next_idx, self.term))
        self.next_idx += 1

    @rule(full=st.booleans())
    def look_at_the_room(self, full: bool) -> None:
        """The tick's look at the file system: on a full disk the spares go."""
        self.clock += SPARES_ROOM_CHECK_S
        self.sim.disk_bytes_max = self.sim.bytes_used() if full else None
        kept = self._spares()
        self.journal.check_spares_room(self.clock)
        self.sim.disk_bytes_max = None
        assert self._spares() == ([] if full else kept)

    def _spares(self) -> list[str]:
        return sorted(name for name in self.sim.listdir(SIM_DIR) if name.startswith(SPARE_PREFIX))

    @rule()
    def sync(self) -> None:
        self.journal.sync()
        self.synced = len(self.model)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def truncate_from(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(0, len(self.model)))
        self.journal.truncate_from(count)
        del self.model[count:]
        self.synced = min(self.synced, count)
        self.term += 1  # a new leader overwrites the rest
        self.next_idx = self.model[-1][1] + 1 if self.model else self.next_idx

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop_first(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(1, len(self.model)))
        self.journal.drop_first(count)
        del self.model[:count]
        self.synced = max(0, self.synced - count)

    @rule()
    def restart(self) -> None:
        """kill -9 and start again: the files are all there is (and opening syncs them)."""
        self.journal = self._open()
        self.synced = len(self.model)

    @rule(torn=st.booleans())
    def power_loss(self, torn: bool) -> None:
        """What was synced is there, from where the log was last cut; what was not may be
        lost (and an unsynced cut of the tail undone), or kept in part (`torn`: a prefix of
        the writes since the last sync reached the disk, over a reused segment's old
        records too)."""
        self.sim.crash(torn=torn)
        self.journal = self._open()
        recovered = self.journal[:]
        assert recovered[: self.synced] == self.model[: self.synced]
        indexes = [idx for _, idx, _ in recovered]
        assert indexes == list(range(indexes[0], indexes[0] + len(indexes))) if indexes else True
        self.model = recovered
        self.synced = len(self.model)
        if self.model:
            self.next_idx = self.model[-1][1] + 1
            self.term = max(self.term, self.model[-1][2])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read_range(self, data: st.DataObject) -> None:
        first = data.draw(st.integers(0, len(self.model)))
        count = data.draw(st.none() | st.integers(0, len(self.model) + 2))
        bytes_max = data.draw(st.none() | st.integers(1, 200))
        expected = pysyncobj_get_entries(self.model, first, count, bytes_max)
        assert self.journal.entries(first, count, bytes_max) == expected

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def read_one(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(-len(self.model), len(self.model) - 1))
        assert self.journal[i] == self.model[i]

    @invariant()
    def holds_the_entries_of_the_model(self) -> None:
        assert len(self.journal) == len(self.model)
        assert self.journal[:] == self.model
        assert self.journal.bytes_total == sum(len(entry[0]) for entry in self.model)
        last = len(self.model[-1][0]) if self.model else 0
        assert self.journal.resident_bytes <= RESIDENT + last
        for i, entry in enumerate(self.model):
            assert self.journal.index_at(i) == entry[1]
        # Segments wholly before the log's start are gone: only the first holds dead
        # records, and every one between the first and the newest was full when it rolled.
        live_bytes = sum(len(entry[0]) + 24 for entry in self.model)
        assert self.journal.segment_count <= 2 + live_bytes // (self.segment - 8)


class JournalOfPagesAgainstAList(JournalAgainstAList):
    """The same, with segments of three pages and records of 1 KiB: a reused segment keeps
    its earlier use's records in the pages after a write's (the zeros a write runs on with
    end at its page), lined up with the new ones, which recovery must tell from entries
    and from damage."""

    segment = 3 * PAGE_BYTES
    command_bytes = 1000


TestJournalAgainstAList = JournalAgainstAList.TestCase
TestJournalAgainstAList.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestJournalOfPagesAgainstAList = JournalOfPagesAgainstAList.TestCase
TestJournalOfPagesAgainstAList.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None
)


def test_a_record_damaged_after_it_left_memory_is_corruption_when_read_back(
    tmp_path: Path,
) -> None:
    journal = DurableJournal(tmp_path, resident_bytes_max=RESIDENT)
    for idx in range(1, 11):
        journal.append(bytes([idx]) * 30, idx, 1)
    journal.sync()
    position = journal._positions[4] + 30  # inside entry 5's command, long out of memory
    with open(tmp_path / "raft.journal", "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0xFF]))
    assert journal[3] == (bytes([4]) * 30, 4, 1)  # its neighbours read back fine
    with pytest.raises(CorruptionError, match="not entry 5"):
        journal[4]
    journal.close()


def test_memory_holds_the_newest_commands_and_the_first_two(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path, resident_bytes_max=RESIDENT)
    for idx in range(1, 101):
        journal.append(bytes([idx]) * 30, idx, 1)
    assert journal.bytes_total == 3000
    assert journal.resident_bytes <= RESIDENT + 30
    held = [i for i, command in enumerate(journal._commands) if command is not None]
    assert held[:2] == [0, 1]
    assert held[-1] == 99
    assert len(held) <= 2 + RESIDENT // 30 + 1
    journal.drop_first(50)  # the new first two come back into memory
    assert journal._commands[0] == bytes([51]) * 30
    assert journal._commands[1] == bytes([52]) * 30
    assert [entry[1] for entry in journal[:]] == list(range(51, 101))
    journal.close()


def test_a_lower_resident_bound_drops_commands_at_once_and_reads_them_back(
    tmp_path: Path,
) -> None:
    """`use_resident_bytes` (tuning.py's journal_resident_bytes): a journal opened with the
    whole log in memory keeps only the newest commands from then on, and answers every
    read as before."""
    journal = DurableJournal(tmp_path, resident_bytes_max=10_000)
    for idx in range(1, 101):
        journal.append(bytes([idx]) * 30, idx, 1)
    journal.sync()
    everything = journal[:]
    assert journal.resident_bytes == 2940  # all but the pinned first two
    journal.use_resident_bytes(RESIDENT)
    assert journal.resident_bytes <= RESIDENT + 30
    assert journal[:] == everything  # the dropped ones read back from the file
    journal.append(bytes([101]) * 30, 101, 1)
    assert journal.resident_bytes <= RESIDENT + 30
    journal.close()
