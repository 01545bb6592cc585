"""The durable Raft journal: torn tails are cut, corruption refuses to start, every
operation survives a reopen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raftstore.errors import CorruptionError
from raftstore.storage.journal import DurableJournal

pytestmark = pytest.mark.storage


def fill(journal: DurableJournal, count: int, first_idx: int = 1, term: int = 1) -> None:
    for number in range(count):
        journal.add(f"command-{first_idx + number}".encode() * 3, first_idx + number, term)
    journal.sync()


def crash_while_writing(journal: DurableJournal, idx: int) -> None:
    """Entry `idx` written but not fdatasynced, then the process dies (kill -9)."""
    journal.add(f"command-{idx}".encode() * 3, idx, 1)
    os.close(journal._fd)


def entries(directory: Path) -> list[tuple[bytes, int, int]]:
    journal = DurableJournal(directory)
    try:
        return list(journal[:])
    finally:
        journal._destroy()


def test_entries_survive_reopen(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 50)
    expected = list(journal[:])
    journal._destroy()
    assert entries(tmp_path) == expected


def test_delete_entries_from_and_to_are_durable(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 20)
    journal.deleteEntriesFrom(15)  # a follower drops a conflicting suffix
    journal.add(b"new", 16, 2)
    journal.deleteEntriesTo(5)  # compaction after a checkpoint
    journal.sync()
    expected = list(journal[:])
    journal._destroy()
    assert [entry[1] for entry in expected] == list(range(6, 17))
    assert entries(tmp_path) == expected


def test_term_and_vote_survive_reopen(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.setCurrentTerm(7, "127.0.0.1:9000")
    journal.setRaftCommitIndex(42)
    journal.onOneSecondTimer()
    journal._destroy()
    reopened = DurableJournal(tmp_path)
    assert reopened.getCurrentTerm() == 7
    assert reopened.getVotedForNodeId() == "127.0.0.1:9000"
    assert reopened.getRaftCommitIndex() == 42
    reopened._destroy()


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(min_value=1, max_value=60))
def test_torn_tail_is_truncated_to_the_last_whole_entry(
    tmp_path_factory: pytest.TempPathFactory, cut: int
) -> None:
    directory = tmp_path_factory.mktemp("journal")
    journal = DurableJournal(directory)
    fill(journal, 9)
    kept = list(journal[:])
    journal.onOneSecondTimer()  # raft.meta: entries up to 9 are fdatasynced
    crash_while_writing(journal, 10)
    path = directory / "raft.journal"
    size = path.stat().st_size
    last_record = len(kept[-1][0]) + 24  # header of the last (10th) record + its command
    os.truncate(path, size - min(cut, last_record - 1))
    assert entries(directory) == kept


def test_zero_filled_tail_is_truncated(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 5)
    expected = list(journal[:])
    journal._destroy()
    with (tmp_path / "raft.journal").open("ab") as file:
        file.write(b"\0" * 4096)
    assert entries(tmp_path) == expected


def test_flipped_byte_in_the_middle_refuses_to_open(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 10)
    journal._destroy()
    path = tmp_path / "raft.journal"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as raised:
        DurableJournal(tmp_path)
    assert "raft.journal" in raised.value.path


def test_corrupt_meta_refuses_to_open(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.setCurrentTerm(3, None)
    journal._destroy()
    meta = tmp_path / "raft.meta"
    data = bytearray(meta.read_bytes())
    data[-2] ^= 0x01
    meta.write_bytes(bytes(data))
    with pytest.raises(CorruptionError):
        DurableJournal(tmp_path)


@pytest.mark.parametrize("size", [1, 4, 7])
def test_journal_shorter_than_its_header_refuses_to_open(tmp_path: Path, size: int) -> None:
    (tmp_path / "raft.journal").write_bytes(b"HSRJ\x01\x00\x00"[:size])
    with pytest.raises(CorruptionError) as raised:
        DurableJournal(tmp_path)
    assert "shorter than its header" in raised.value.detail


def test_damage_to_an_fdatasynced_last_entry_is_corruption_not_a_torn_tail(
    tmp_path: Path,
) -> None:
    # A flipped bit in the last record's length makes it run past the end of the file, which
    # looks like a torn write; raft.meta knows it was synced (and maybe acknowledged).
    journal = DurableJournal(tmp_path)
    fill(journal, 10)
    last_position = journal._positions[-1]
    journal._destroy()
    path = tmp_path / "raft.journal"
    data = bytearray(path.read_bytes())
    data[last_position + 7] ^= 0x01  # the high byte of command_len
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as raised:
        DurableJournal(tmp_path)
    assert "fdatasynced" in raised.value.detail


def test_a_torn_entry_written_after_the_log_was_cut_is_still_a_torn_tail(
    tmp_path: Path,
) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 10)
    journal.onOneSecondTimer()
    journal.deleteEntriesFrom(5)  # a new leader's log differs from index 6 on
    journal.sync()
    crash_while_writing(journal, 6)
    path = tmp_path / "raft.journal"
    os.truncate(path, path.stat().st_size - 3)
    assert [idx for _, idx, _ in entries(tmp_path)] == [1, 2, 3, 4, 5]
