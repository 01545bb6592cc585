"""storage/raft_checkpoint.py: the Raft replica's checkpoint file, its trailer, and the
journal trim that lets pysyncobj keep the entries after a checkpoint."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from hastream.errors import CorruptionError
from raftstore.storage import checkpoint, group_checkpoint, raft_checkpoint
from raftstore.storage.files import FILE_MODE, SimFiles, ensure_dir, write_all
from raftstore.storage.group_checkpoint import GroupCheckpoint
from raftstore.storage.journal import DurableJournal
from raftstore.storage.raft_checkpoint import RaftCheckpoint

pytestmark = pytest.mark.storage

ROOT = Path("/sim")
IMAGE = RaftCheckpoint(
    lsn=12, state=b'{"tables": {}}', last=(b"\x00last", 12, 3), previous=(b"", 11, 3)
)


def test_the_previous_entry_is_stored_without_its_command(tmp_path: Path) -> None:
    # pysyncobj uses only its index and term; the last entry's command is kept (it is sent to
    # a follower one entry behind the checkpoint).
    path = tmp_path / "checkpoint"
    big = replace(IMAGE, last=(b"L" * 1000, 12, 3), previous=(b"P" * 1000, 11, 3))
    size = raft_checkpoint.write(path, big)
    assert size < 1000 + 100 + len(big.state)
    assert raft_checkpoint.read(path) == replace(big, previous=(b"", 11, 3))


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    size = raft_checkpoint.write(path, IMAGE)
    assert size == len(checkpoint.read_checked(path, group_checkpoint.KIND))
    assert raft_checkpoint.read(path) == IMAGE


@pytest.mark.parametrize("cut", [1, 20, 24])
def test_a_short_trailer_is_corruption(cut: int) -> None:
    trailer = raft_checkpoint.encode_trailer(IMAGE.last, IMAGE.previous)
    with pytest.raises(CorruptionError, match="short"):
        raft_checkpoint.decode_trailer(Path("checkpoint"), trailer[:-cut])


def test_bytes_after_the_trailer_entries_are_corruption(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    trailer = raft_checkpoint.encode_trailer(IMAGE.last, IMAGE.previous) + b"x"
    body = group_checkpoint.encode(GroupCheckpoint(lsn=12, state=b"{}", trailer=trailer))
    checkpoint.write_atomic(path, group_checkpoint.KIND, body)
    with pytest.raises(CorruptionError, match="trailing bytes"):
        raft_checkpoint.read(path)


def test_read_makes_a_file_renamed_into_place_without_fsync_durable() -> None:
    """A leader's checkpoint installed on a follower arrives that way, and pysyncobj clears
    the journal once it is loaded."""
    sim = SimFiles(seed=3)
    ensure_dir(sim, ROOT, root=ROOT)
    path = ROOT / "checkpoint"
    raft_checkpoint.write(path.with_name("image"), IMAGE, files=sim)
    data = sim.durable_bytes(path.with_name("image"))
    assert data is not None
    fd = sim.open(path.with_name("staged"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    write_all(sim, fd, [data])
    sim.close(fd)
    sim.replace(path.with_name("staged"), path)
    assert sim.durable_bytes(path) is None

    assert raft_checkpoint.read(path, files=sim) == IMAGE
    assert sim.durable_bytes(path) == data


def _journal(tmp_path: Path, first: int, last: int) -> DurableJournal:
    journal = DurableJournal(tmp_path)
    for idx in range(first, last + 1):
        journal.append(b"cmd%d" % idx, idx, 2)
    journal.sync()
    return journal


def test_trim_drops_the_entries_before_the_checkpoint_pair(tmp_path: Path) -> None:
    journal = _journal(tmp_path, 5, 12)
    last, previous = (b"ignored", 10, 2), (b"ignored", 9, 2)
    assert raft_checkpoint.trim_journal_to(journal, last, previous) == (
        (b"cmd10", 10, 2),
        (b"cmd9", 9, 2),
    )
    assert [entry[1] for entry in journal] == [9, 10, 11, 12]
    journal.close()


@pytest.mark.parametrize(
    ("last", "previous"),
    [
        ((b"", 4, 2), (b"", 3, 2)),  # before the journal
        ((b"", 13, 2), (b"", 12, 2)),  # its last entry has no successor here
        ((b"", 10, 1), (b"", 9, 2)),  # another term: not the same entries
    ],
)
def test_trim_leaves_a_journal_without_the_pair_alone(
    tmp_path: Path, last: tuple[bytes, int, int], previous: tuple[bytes, int, int]
) -> None:
    journal = _journal(tmp_path, 5, 12)
    assert raft_checkpoint.trim_journal_to(journal, last, previous) == (last, previous)
    assert len(journal) == 8
    journal.close()
