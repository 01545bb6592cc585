"""The durable Raft journal: torn tails are cut, corruption refuses to start, every
operation survives a reopen."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hastream.errors import CorruptionError
from raftstore import limits
from raftstore.storage import checkpoint
from raftstore.storage.files import PAGE_BYTES, Fault, RealFiles, SimFiles
from raftstore.storage.journal import META_KIND, DurableJournal, segment_paths

pytestmark = pytest.mark.storage


def fill(journal: DurableJournal, count: int, first_idx: int = 1, term: int = 1) -> None:
    for number in range(count):
        journal.append(f"command-{first_idx + number}".encode() * 3, first_idx + number, term)
    journal.sync()


def crash_while_writing(journal: DurableJournal, idx: int) -> None:
    """Entry `idx` written but not fdatasynced, then the process dies (kill -9)."""
    journal.append(f"command-{idx}".encode() * 3, idx, 1)
    os.close(journal._segments[-1].fd)


def entries(directory: Path) -> list[tuple[bytes, int, int]]:
    journal = DurableJournal(directory)
    try:
        return list(journal[:])
    finally:
        journal.close()


def test_entries_survive_reopen(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 50)
    expected = list(journal[:])
    journal.close()
    assert entries(tmp_path) == expected


def test_delete_entries_from_and_to_are_durable(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 20)
    journal.truncate_from(15)  # a follower drops a conflicting suffix
    journal.append(b"new", 16, 2)
    journal.drop_first(5)  # compaction after a checkpoint
    journal.sync()
    expected = list(journal[:])
    journal.close()
    assert [entry[1] for entry in expected] == list(range(6, 17))
    assert entries(tmp_path) == expected


@pytest.mark.parametrize("count", [511, 512, 513, 1500])
def test_compaction_rewrites_a_journal_of_more_entries_than_one_writev_takes(
    tmp_path: Path, count: int
) -> None:
    # Found by a randomized chaos run: a restart that trimmed a journal of 512+ entries to
    # its checkpoint passed 1,025 buffers to one writev (EINVAL), and the node crash-looped.
    journal = DurableJournal(tmp_path)
    fill(journal, count)
    journal.sync()
    journal.drop_first(1)
    expected = list(journal[:])
    journal.close()
    assert [entry[1] for entry in expected] == list(range(2, count + 1))
    assert entries(tmp_path) == expected


def test_term_and_vote_survive_reopen(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.set_term(7, "127.0.0.1:9000")
    journal.set_commit_index(42)
    journal.store_meta_if_changed()
    journal.close()
    reopened = DurableJournal(tmp_path)
    assert reopened.term == 7
    assert reopened.voted_for == "127.0.0.1:9000"
    assert reopened.commit_index == 42
    reopened.close()


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(min_value=1, max_value=60), zeroed=st.booleans())
def test_torn_tail_is_truncated_to_the_last_whole_entry(
    tmp_path_factory: pytest.TempPathFactory, cut: int, zeroed: bool
) -> None:
    """The last record's end lost: the file cut there (a write past the end whose size
    update was lost, or an older version's append), or, with `zeroed`, its bytes back to
    the zeros the segment was grown by (a write in place whose pages were lost)."""
    directory = tmp_path_factory.mktemp("journal")
    journal = DurableJournal(directory)
    fill(journal, 9)
    kept = list(journal[:])
    journal.store_meta_if_changed()  # raft.meta: entries up to 9 are fdatasynced
    records_end = journal._segments[-1].end + len(b"command-10") * 3 + 24
    crash_while_writing(journal, 10)
    path = directory / "raft.journal"
    assert path.stat().st_size > records_end  # the grown tail
    lost = min(cut, len(b"command-10") * 3 + 24 - 1)  # of the 10th record (header + command)
    if zeroed:
        with path.open("r+b") as file:
            file.seek(records_end - lost)
            file.write(bytes(lost))
    else:
        os.truncate(path, records_end - lost)
    assert entries(directory) == kept
    assert path.stat().st_size == records_end - len(b"command-10") * 3 - 24  # cut at open


def test_zero_filled_tail_is_truncated(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 5)
    expected = list(journal[:])
    journal.close()
    with (tmp_path / "raft.journal").open("ab") as file:
        file.write(b"\0" * 4096)
    assert entries(tmp_path) == expected


def test_the_newest_segment_is_grown_ahead_and_its_zeros_cut_silently_at_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Records are written in place over allocated zeros (no new file size for an
    fdatasync to commit); a full segment is cut to its records before the next one starts;
    a reopen finds the end among the zeros without taking them for a torn write."""
    journal = DurableJournal(tmp_path, segment_bytes_max=4000, extend_bytes=1000)
    fill(journal, 200)  # ~40 bytes a record: several segments
    expected = list(journal[:])
    paths = segment_paths(tmp_path)
    assert len(paths) > 2
    newest_end = journal._segments[-1].end
    journal.close()
    assert paths[-1].stat().st_size > newest_end  # the zeros ahead
    records = paths[-1].read_bytes()[newest_end:]
    assert records == bytes(len(records))
    for full in paths[:-1]:  # cut to their records: only the newest ends in zeros
        data = full.read_bytes()
        assert data[-24:] != bytes(24)
    assert entries(tmp_path) == expected
    assert paths[-1].stat().st_size == newest_end  # cut at open
    assert "torn" not in caplog.text
    journal = DurableJournal(tmp_path, segment_bytes_max=4000, extend_bytes=1000)
    fill(journal, 5, first_idx=201)  # grown again
    assert len(journal) == 205
    journal.close()
    assert [idx for _, idx, _ in entries(tmp_path)] == list(range(1, 206))


_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_UNWRITTEN = 0x800
_FIEMAP_HEAD = struct.Struct("=QQIIII")  # start, length, flags, mapped, count, reserved
_FIEMAP_EXTENT = struct.Struct("=QQQQQIIII")  # logical, physical, length, 2 reserved, flags


def _unwritten_bytes(path: Path, start: int, end: int) -> int | None:
    """Bytes of [start, end) of the file that the file system holds as allocated but
    unwritten blocks (fallocate's), by the FIEMAP ioctl; None where it cannot tell."""
    slots = 64
    request = bytearray(_FIEMAP_HEAD.size + slots * _FIEMAP_EXTENT.size)
    _FIEMAP_HEAD.pack_into(request, 0, start, end - start, _FIEMAP_FLAG_SYNC, 0, slots, 0)
    with path.open("rb") as file:
        try:
            fcntl.ioctl(file.fileno(), _FS_IOC_FIEMAP, request)
        except OSError:
            return None
    mapped = _FIEMAP_HEAD.unpack_from(request, 0)[3]
    unwritten = 0
    for index in range(mapped):
        at = _FIEMAP_HEAD.size + index * _FIEMAP_EXTENT.size
        extent = _FIEMAP_EXTENT.unpack_from(request, at)
        logical, length, flags = extent[0], extent[2], extent[5]
        if flags & _FIEMAP_EXTENT_UNWRITTEN:
            unwritten += max(0, min(end, logical + length) - max(start, logical))
    return unwritten


@pytest.mark.parametrize(
    ("record_bytes", "written"), [(1_000, True), (200_000, False)], ids=["small", "big"]
)
def test_small_records_are_grown_ahead_by_written_zeros_big_ones_by_fallocate(
    tmp_path: Path, record_bytes: int, written: bool
) -> None:
    """ext4 keeps fallocate's blocks unwritten, and the fdatasync after a record that first
    fills one must commit their conversion too: small records get written zeros ahead
    (one flush per fdatasync), big ones allocated ones (fewer bytes written)."""
    journal = DurableJournal(tmp_path)
    command = os.urandom(record_bytes)
    journal.append(command, 1, 1)
    journal.sync()
    segment = journal._segments[-1]
    ahead = (segment.end, segment.size)
    path = segment_paths(tmp_path)[-1]
    unwritten = _unwritten_bytes(path, *ahead)
    journal.close()
    if unwritten is None:
        pytest.skip("the file system does not map extents (FIEMAP)")
    assert ahead[1] - ahead[0] >= limits.RAFT_JOURNAL_EXTEND_BYTES // 2
    assert entries(tmp_path) == [(command, 1, 1)]
    if written:
        assert unwritten == 0
    elif unwritten == 0:
        pytest.skip("the file system keeps no unwritten extents (fallocate writes zeros)")
    else:
        assert unwritten >= (ahead[1] - ahead[0]) // 2


def test_bytes_after_the_zeros_of_the_grown_tail_refuse_to_open(tmp_path: Path) -> None:
    """A record header gone to zeros with data after it cannot be told from the zeros ahead
    of the records with a flipped byte in them: both are corruption, not a torn tail."""
    journal = DurableJournal(tmp_path)
    fill(journal, 5)
    end = journal._segments[-1].end
    journal.close()
    path = tmp_path / "raft.journal"
    assert path.stat().st_size > end + 100
    with path.open("r+b") as file:
        file.seek(end + 100)
        file.write(b"\x01")
    with pytest.raises(CorruptionError):
        DurableJournal(tmp_path)


def test_flipped_byte_in_the_middle_refuses_to_open(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    fill(journal, 10)
    journal.close()
    path = tmp_path / "raft.journal"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as raised:
        DurableJournal(tmp_path)
    assert "raft.journal" in raised.value.path


def test_corrupt_meta_refuses_to_open(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path)
    journal.set_term(3, None)
    journal.close()
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
    journal.close()
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
    journal.store_meta_if_changed()
    journal.truncate_from(5)  # a new leader's log differs from index 6 on
    journal.sync()
    crash_while_writing(journal, 6)
    records_end = journal._segments[-1].end
    os.truncate(tmp_path / "raft.journal", records_end - 3)
    assert [idx for _, idx, _ in entries(tmp_path)] == [1, 2, 3, 4, 5]


# --- environment errors (simulated disk) -------------------------------------------------

SIM_DIR = Path("/node/group-1")


def _sim_journal(
    sim: SimFiles,
    resident: int = limits.RAFT_LOG_RESIDENT_BYTES,
    segment: int = limits.RAFT_JOURNAL_SEGMENT_BYTES,
    extend: int = limits.RAFT_JOURNAL_EXTEND_BYTES,
) -> DurableJournal:
    journal = DurableJournal(
        SIM_DIR,
        files=sim,
        resident_bytes_max=resident,
        segment_bytes_max=segment,
        extend_bytes=extend,
    )
    fill(journal, 5)
    journal.store_meta_if_changed()
    return journal


def _journal_steps(journal: DurableJournal) -> list[tuple[str, Callable[[], object]]]:
    """Every kind of write the journal does, in a Raft-like order."""
    return [
        ("add", lambda: journal.append(b"six", 6, 1)),
        ("add", lambda: journal.append(b"seven", 7, 1)),
        ("sync", journal.sync),
        ("term", lambda: journal.set_term(2, "127.0.0.1:9001")),
        ("delete_from", lambda: journal.truncate_from(len(journal) - 1)),
        ("add", lambda: journal.append(b"seven, term 2", 7, 2)),
        ("sync", journal.sync),
        ("commit", lambda: journal.set_commit_index(6)),
        ("timer", journal.store_meta_if_changed),
        ("delete_to", lambda: journal.drop_first(3)),
        ("add", lambda: journal.append(b"eight", 8, 2)),
        ("sync", journal.sync),
    ]


def _state(journal: DurableJournal, sim: SimFiles) -> tuple[object, ...]:
    return (_entries_unfaulted(journal, sim), journal.term, journal.voted_for)


def _entries_unfaulted(journal: DurableJournal, sim: SimFiles) -> list[tuple[bytes, int, int]]:
    """The test's own look at the entries (which may read the file back) is no operation
    under test: the pending fault waits for the next one."""
    faults, sim._faults = sim._faults, []
    try:
        return list(journal[:])
    finally:
        sim._faults = faults


def _journal_operations(resident: int, segment: int) -> int:
    sim = SimFiles()
    journal = _sim_journal(sim, resident, segment)
    before = sim.operations
    for _, step in _journal_steps(journal):
        step()
    return sim.operations - before


def _attempt(step: Callable[[], object]) -> OSError | CorruptionError | None:
    try:
        step()
    except (OSError, CorruptionError) as error:
        return error
    return None


@pytest.mark.parametrize(
    ("resident", "segment"),
    [(limits.RAFT_LOG_RESIDENT_BYTES, limits.RAFT_JOURNAL_SEGMENT_BYTES), (4, 64)],
    ids=["held", "read-back-small-segments"],
)
@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO], ids=errno.errorcode.get)
def test_an_error_at_any_operation_changes_nothing_and_leaves_a_recoverable_journal(
    error: int, resident: int, segment: int
) -> None:
    """The fault hits one operation; the caller then retries the failed call once, as
    pysyncobj would on its next tick. With a tiny `resident` bound most commands are read
    back from the file (a failing read must change nothing either); with tiny segments
    nearly every add starts a new one and a cut removes whole segments."""
    operations = _journal_operations(resident, segment)
    assert operations > 20
    for failing in range(operations):
        where = f"{errno.errorcode[error]} at operation {failing}"
        sim = SimFiles()
        journal = _sim_journal(sim, resident, segment)
        synced = list(journal[:])
        sim.fail(Fault(error, skip=failing))
        terms = {journal.term}
        for name, step in _journal_steps(journal):
            before = _state(journal, sim)
            raised = _attempt(step)
            if isinstance(raised, CorruptionError):
                assert journal.failed is raised, where
                break  # After a failed fdatasync every write is refused.
            if raised is not None:
                assert raised.errno == error, where
                fault = sim.log[-1]
                terms.add(2)  # A term frame may be in place, not durable (write_atomic).
                assert _state(journal, sim) == before, (where, name, fault)
                if name == "sync":
                    assert journal.failed is not None, where
                if journal.failed is not None:  # a failed fdatasync (a sync, or a new segment's)
                    assert "fdatasync" in fault, where
                    break
                raised = _attempt(step)  # The retry: the fault is spent.
                assert raised is None, (where, name, raised)
            if name == "sync":
                synced = _entries_unfaulted(journal, sim)
            terms.add(journal.term)
        assert sim.log, where
        assert "fault" in sim.log[0], where
        in_memory = _entries_unfaulted(journal, sim)
        # The process restarts (kill -9).
        reopened = DurableJournal(
            SIM_DIR, files=sim, resident_bytes_max=resident, segment_bytes_max=segment
        )
        assert list(reopened[:]) == in_memory, where
        assert reopened.term in terms, where
        reopened.close()
        sim.crash()  # And then the power goes.
        recovered = list(
            DurableJournal(
                SIM_DIR, files=sim, resident_bytes_max=resident, segment_bytes_max=segment
            )[:]
        )
        assert recovered == in_memory, where  # The reopen made everything durable.
        compacted = {1, 2, 3}  # Dropped after the checkpoint: no longer required.
        assert {idx for _, idx, _ in synced} - compacted <= {idx for _, idx, _ in recovered}


def test_a_partial_write_that_cannot_be_cut_off_refuses_later_writes(caplog: Any) -> None:
    sim = SimFiles(disk_bytes_max=None)
    journal = _sim_journal(sim, extend=0)  # grown by each record alone: no zeros ahead
    sim.disk_bytes_max = sim.bytes_used() + 30  # The next entry is written short...
    sim.fail(Fault(errno.EIO, op="ftruncate"))  # ... and cannot be cut back.
    before = list(journal[:])
    with pytest.raises(CorruptionError, match="cannot remove a partial write") as caught:
        journal.append(b"x" * 100, 6, 1)
    assert isinstance(caught.value.__cause__, OSError)
    assert list(journal[:]) == before
    with pytest.raises(CorruptionError):
        journal.append(b"y", 6, 1)
    with pytest.raises(CorruptionError):
        journal.sync()
    sim.disk_bytes_max = None
    reopened = DurableJournal(SIM_DIR, files=sim)  # The garbage is a torn tail.
    assert list(reopened[:]) == before
    assert "truncated torn journal tail" in caplog.text


@pytest.mark.parametrize("extend", [0, 1000], ids=["no-zeros-ahead", "grown-ahead"])
def test_a_full_disk_fails_the_add_and_the_journal_goes_on_once_there_is_room(
    extend: int,
) -> None:
    """With zeros ahead, the adds fill them first; the growth that finds no room leaves the
    next record to grow the file itself, which the full disk refuses."""
    sim = SimFiles()
    journal = _sim_journal(sim, extend=extend)
    sim.disk_bytes_max = sim.bytes_used() + 500
    raised = None
    while raised is None:
        raised = _attempt(lambda: journal.append(b"z" * 40, len(journal) + 1, 1))
    assert isinstance(raised, OSError)
    assert raised.errno == errno.ENOSPC
    added = len(journal)
    assert added > 5
    assert sim.bytes_used() < sim.disk_bytes_max  # The short write was cut back.
    sim.disk_bytes_max = None
    journal.append(b"room again", added + 1, 1)
    journal.sync()
    entries_now = list(journal[:])
    sim.crash()
    assert list(DurableJournal(SIM_DIR, files=sim)[:]) == entries_now


def test_a_failed_fdatasync_refuses_later_writes_until_reopened() -> None:
    sim = SimFiles()
    journal = _sim_journal(sim)
    journal.append(b"six", 6, 1)
    sim.fail(Fault(errno.EIO, op="fdatasync"))
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        journal.sync()
    # Linux may have dropped the pages and marked them clean: a second fdatasync could
    # succeed without the entry on disk, so the journal does not try.
    assert not journal.settled  # the Raft loop's shortcut must not skip the refusal below
    with pytest.raises(CorruptionError, match="fdatasync failed"):
        journal.sync()
    with pytest.raises(CorruptionError):
        journal.append(b"seven", 7, 1)
    reopened = DurableJournal(SIM_DIR, files=sim)
    assert [idx for _, idx, _ in reopened[:]] == [1, 2, 3, 4, 5, 6]


def test_creating_a_journal_on_a_full_disk_leaves_no_half_header() -> None:
    sim = SimFiles(disk_bytes_max=5)
    with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)):
        DurableJournal(SIM_DIR, files=sim)
    sim.disk_bytes_max = None
    assert len(DurableJournal(SIM_DIR, files=sim)) == 0  # An empty file is a new journal.


@pytest.mark.parametrize(
    "body", [b"[1, 2]", b'{"term": "7"}', b"not json"], ids=["list", "string term", "bytes"]
)
def test_raft_meta_of_the_wrong_shape_is_corruption(tmp_path: Path, body: bytes) -> None:
    checkpoint.write_atomic(tmp_path / "raft.meta", META_KIND, body)
    with pytest.raises(CorruptionError) as caught:
        DurableJournal(tmp_path)
    assert caught.value.path.endswith("raft.meta")


# --- segments ---------------------------------------------------------------------------


def _segmented(directory: Path, count: int, segment: int = 200) -> DurableJournal:
    journal = DurableJournal(directory, segment_bytes_max=segment)
    fill(journal, count)
    return journal


def test_a_cut_removes_whole_segments_and_copies_nothing(tmp_path: Path) -> None:
    journal = _segmented(tmp_path, 40)
    assert len(segment_paths(tmp_path)) >= 8
    first_kept = segment_paths(tmp_path)[3]
    kept_bytes = first_kept.read_bytes()
    journal.drop_first(30)
    assert [entry[1] for entry in journal[:]] == list(range(31, 41))
    assert segment_paths(tmp_path)[0].stat().st_size <= 200 + 64
    assert first_kept not in segment_paths(tmp_path) or first_kept.read_bytes() == kept_bytes
    journal.close()
    assert [entry[1] for entry in entries(tmp_path)] == list(range(31, 41))


def test_segments_a_crash_left_before_the_logs_start_are_removed_at_open(tmp_path: Path) -> None:
    journal = _segmented(tmp_path, 40)
    before = segment_paths(tmp_path)
    journal.drop_first(30)
    journal.close()
    for path in before[:2]:  # the cut's removals never happened (kill -9 in between)
        if not path.exists():
            path.write_bytes(b"HSRJ\x01\x00\x00\x00")
    assert [entry[1] for entry in entries(tmp_path)] == list(range(31, 41))
    assert segment_paths(tmp_path)[0] not in before[:2]


def test_a_damaged_record_at_the_end_of_an_older_segment_is_corruption(tmp_path: Path) -> None:
    journal = _segmented(tmp_path, 20)
    journal.close()
    older = segment_paths(tmp_path)[0]
    data = bytearray(older.read_bytes())
    data[-1] ^= 0x01  # a torn tail anywhere but in the newest segment is no torn write
    older.write_bytes(bytes(data))
    with pytest.raises(CorruptionError) as raised:
        DurableJournal(tmp_path, segment_bytes_max=200)
    assert raised.value.path == str(older)


def test_a_missing_segment_where_the_log_starts_is_corruption(tmp_path: Path) -> None:
    journal = _segmented(tmp_path, 40)
    journal.drop_first(30)
    journal.close()
    segment_paths(tmp_path)[0].unlink()
    with pytest.raises(CorruptionError, match=r"where raft\.meta says the log starts, is missing"):
        DurableJournal(tmp_path)


def test_truncating_into_an_older_segment_removes_the_newer_ones(tmp_path: Path) -> None:
    journal = _segmented(tmp_path, 40)
    journal.truncate_from(5)
    journal.append(b"term two", 6, 2)
    journal.sync()
    assert len(segment_paths(tmp_path)) <= 2
    journal.close()
    assert [(idx, term) for _, idx, term in entries(tmp_path)] == [(i, 1) for i in range(1, 6)] + [
        (6, 2)
    ]


def test_a_journal_of_the_single_file_layout_opens_as_its_first_segment(tmp_path: Path) -> None:
    # What older versions wrote: raft.journal and a raft.meta without journal_start (and
    # perhaps a compaction's copy left by a crash).
    journal = DurableJournal(tmp_path)
    fill(journal, 5)
    journal.close()
    (tmp_path / "raft.journal.tmp").write_bytes(b"HSRJ\x01\x00\x00\x00")
    assert [entry[1] for entry in entries(tmp_path)] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "raft.journal.tmp").exists()
    assert segment_paths(tmp_path) == [tmp_path / "raft.journal"]


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO], ids=errno.errorcode.get)
def test_a_cut_back_across_segments_that_fails_midway_keeps_memory_equal_to_disk(
    error: int,
) -> None:
    """truncate_from reaching back over several segments removes them newest first: a
    failure leaves fewer entries, never memory that names files already gone."""

    def build(sim: SimFiles) -> DurableJournal:
        journal = DurableJournal(SIM_DIR, files=sim, segment_bytes_max=64)
        fill(journal, 12)
        journal.store_meta_if_changed()
        return journal

    sim = SimFiles()
    journal = build(sim)
    before = list(journal[:])
    operations = sim.operations
    journal.truncate_from(2)
    operations = sim.operations - operations
    assert operations > 5
    for failing in range(operations):
        where = f"{errno.errorcode[error]} at operation {failing}"
        sim = SimFiles()
        journal = build(sim)
        sim.fail(Fault(error, skip=failing))
        raised = _attempt(lambda journal=journal: journal.truncate_from(2))
        in_memory = _entries_unfaulted(journal, sim)
        assert in_memory == before[: len(in_memory)], where
        assert len(in_memory) >= 2, where
        if raised is None:
            assert len(in_memory) == 2, where
        reopened = DurableJournal(SIM_DIR, files=sim, segment_bytes_max=64)
        assert list(reopened[:]) == in_memory, where


class _DropRecorder(RealFiles):
    """The real file system, recording what the page cache is told to forget and checking
    it was made durable first."""

    def __init__(self) -> None:
        self.synced: dict[int, int] = {}
        self.dropped: list[tuple[int, int]] = []

    def fdatasync(self, fd: int, /) -> None:
        os.fdatasync(fd)
        self.synced[fd] = os.fstat(fd).st_size

    def drop_cached(self, fd: int, position: int, length: int, /) -> None:
        assert position + length <= self.synced.get(fd, 0), "dropped before fdatasync"
        RealFiles.drop_cached(fd, position, length)
        self.dropped.append((position, length))


def test_what_fdatasync_made_durable_is_dropped_from_the_page_cache_behind_the_writes(
    tmp_path: Path,
) -> None:
    files = _DropRecorder()
    journal = DurableJournal(tmp_path, files=files)
    command = os.urandom(300_000)
    for idx in range(1, 14):
        journal.append(command, idx, 1)
        journal.sync()
    expected = list(journal[:])
    journal.close()
    ranges = files.dropped
    assert len(ranges) >= 2
    assert ranges[0][0] == 0
    assert all(p % PAGE_BYTES == 0 and n % PAGE_BYTES == 0 for p, n in ranges)
    assert all(n >= limits.JOURNAL_DROP_BEHIND_BYTES - PAGE_BYTES for _, n in ranges)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    written = 13 * 300_000
    assert ranges[-1][0] + ranges[-1][1] > written - limits.JOURNAL_DROP_BEHIND_BYTES
    assert entries(tmp_path) == expected  # read back from the disk


# --- the leader's fdatasync on the helper thread (sync_ahead) ------------------------------


class _GatedSyncs(RealFiles):
    """The real file system whose fdatasync waits for a permit (`allow`), so a test sees
    the journal while one runs."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.started = 0

    def fdatasync(self, fd: int, /) -> None:
        self.started += 1
        assert self.permits.acquire(timeout=30), "the test never allowed the fdatasync"
        os.fdatasync(fd)

    def allow(self) -> None:
        self.permits.release()


class _Waker:
    """What the Raft loop gives `sync_ahead` (replication.py): `wake` is called on the
    helper thread; `watch` (the kernel's fdatasyncs) gets an eventfd to poll."""

    def __init__(self) -> None:
        self.woken = threading.Event()
        self.watched: list[int] = []

    def wake(self) -> None:
        self.woken.set()

    def watch(self, fd: int) -> None:
        self.watched.append(fd)


def _woken() -> tuple[threading.Event, _Waker]:
    waker = _Waker()
    return waker.woken, waker


def _gated_with_three_entries(directory: Path) -> tuple[_GatedSyncs, DurableJournal]:
    files = _GatedSyncs()
    journal = DurableJournal(directory, files=files)
    for idx in (1, 2, 3):
        journal.append(b"entry", idx, 1)
    return files, journal


def test_sync_ahead_returns_at_once_and_counts_the_entries_once_the_fdatasync_returned(
    tmp_path: Path,
) -> None:
    files, journal = _gated_with_three_entries(tmp_path)
    woken, wake = _woken()
    assert journal.sync_ahead(wake) is None  # returned while the fdatasync waits
    journal.want_wake()
    assert files.started <= 1
    assert journal.durable_index == 0
    assert journal.dirty
    files.allow()
    assert woken.wait(timeout=30)
    assert journal.durable_index == 3
    took = journal.sync_ahead(wake)  # takes what it made durable; nothing left to sync
    assert took is not None
    assert took >= 0
    assert not journal.dirty
    assert files.started == 1
    journal.close()
    assert list(DurableJournal(tmp_path)[:]) == [(b"entry", idx, 1) for idx in (1, 2, 3)]


def test_entries_written_while_the_fdatasync_runs_wait_for_the_next_one(tmp_path: Path) -> None:
    files = _GatedSyncs()
    journal = DurableJournal(tmp_path, files=files)
    journal.append(b"one", 1, 1)
    woken, wake = _woken()
    journal.sync_ahead(wake)
    journal.want_wake()
    journal.append(b"two", 2, 1)  # written beside the running fdatasync
    assert journal.sync_ahead(wake) is None  # one at a time: nothing new starts
    files.allow()
    assert woken.wait(timeout=30)
    assert journal.durable_index == 1  # it covered what was written when it started
    woken.clear()
    journal.sync_ahead(wake)  # takes the first, starts the next for entry 2
    journal.want_wake()
    assert journal.dirty
    files.allow()
    assert woken.wait(timeout=30)
    assert journal.durable_index == 2
    journal.sync()  # settles it: nothing left
    assert not journal.dirty
    assert files.started == 2
    journal.close()


def test_settled_only_with_nothing_written_nothing_running_and_no_failure(tmp_path: Path) -> None:
    # The Raft loop skips its sync on every tick that finds the journal settled.
    files = _GatedSyncs()
    journal = DurableJournal(tmp_path, files=files)
    assert journal.settled
    journal.append(b"one", 1, 1)
    assert not journal.settled  # written, not synced
    woken, wake = _woken()
    journal.sync_ahead(wake)
    journal.want_wake()
    assert not journal.settled  # its fdatasync runs
    files.allow()
    assert woken.wait(timeout=30)
    assert not journal.settled  # returned, its result not taken yet
    journal.sync_ahead(wake)
    assert journal.settled
    journal.append(b"two", 2, 1)
    files.allow()
    journal.sync()
    assert journal.settled
    journal.close()


def test_sync_waits_for_the_fdatasync_sync_ahead_started(tmp_path: Path) -> None:
    files = _GatedSyncs()
    journal = DurableJournal(tmp_path, files=files)
    journal.append(b"one", 1, 1)
    journal.sync_ahead()
    journal.append(b"two", 2, 1)
    files.allow()
    files.allow()  # sync: the first one's end, then one more for entry 2
    journal.sync()
    assert journal.durable_index == 2
    assert not journal.dirty
    journal.close()


def test_a_truncation_takes_the_running_fdatasync_first_and_lowers_the_durable_index(
    tmp_path: Path,
) -> None:
    files, journal = _gated_with_three_entries(tmp_path)
    woken, wake = _woken()
    journal.sync_ahead(wake)
    journal.want_wake()
    files.allow()
    assert woken.wait(timeout=30)
    journal.truncate_from(1)
    assert journal.durable_index == 1
    assert [idx for _, idx, _ in journal[:]] == [1]
    files.allow()
    journal.close()
    assert [idx for _, idx, _ in DurableJournal(tmp_path)[:]] == [1]


def test_a_failed_fdatasync_on_the_helper_thread_fails_the_journal_as_sync_does() -> None:
    sim = SimFiles()
    journal = _sim_journal(sim)
    journal.append(b"six", 6, 1)
    sim.fail(Fault(errno.EIO, op="fdatasync"))
    woken, wake = _woken()
    journal.sync_ahead(wake)
    journal.want_wake()
    assert woken.wait(timeout=30)
    assert journal.durable_index == 5  # the failed one counts nothing
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        journal.sync_ahead(wake)
    with pytest.raises(CorruptionError, match="fdatasync failed"):
        journal.sync_ahead(wake)
    with pytest.raises(CorruptionError):
        journal.append(b"seven", 7, 1)
    reopened = DurableJournal(SIM_DIR, files=sim)
    assert [idx for _, idx, _ in reopened[:]] == [1, 2, 3, 4, 5, 6]


def test_what_sync_ahead_made_durable_survives_a_power_loss() -> None:
    sim = SimFiles()
    journal = _sim_journal(sim)
    journal.append(b"six", 6, 1)
    woken, wake = _woken()
    journal.sync_ahead(wake)
    journal.want_wake()
    assert woken.wait(timeout=30)
    assert journal.durable_index == 6
    sim.crash()
    assert [idx for _, idx, _ in DurableJournal(SIM_DIR, files=sim)[:]] == [1, 2, 3, 4, 5, 6]


def test_close_ends_the_helper_thread(tmp_path: Path) -> None:
    journal = DurableJournal(tmp_path, kernel_syncs=False)
    journal.append(b"one", 1, 1)
    journal.sync_ahead()
    helper = journal._ahead_thread
    assert helper is not None
    assert helper.name == "journal-sync"
    assert helper.is_alive()
    journal.close()
    assert not helper.is_alive()


def test_the_helper_wakes_the_caller_only_when_asked(tmp_path: Path) -> None:
    files, journal = _gated_with_three_entries(tmp_path)
    woken, wake = _woken()
    journal.sync_ahead(wake)
    files.allow()
    running = journal._ahead
    assert running is not None
    assert running.done is not None
    # Wait for the helper's own "returned" signal (the lock it releases after the fdatasync).
    assert running.done.acquire(timeout=30), "the fdatasync never returned"
    running.done.release()
    assert journal.durable_index == 3  # it returned: nobody asked to be woken
    assert not woken.is_set()
    journal.want_wake()  # asked after it returned: woken at once, by the caller's thread
    assert woken.is_set()
    journal.close()
