"""Journal segments a checkpoint freed are kept as spares and reused: the log reads back as
written, the earlier use's records after its end are never taken for entries nor for
corruption, and damage inside the log is still corruption.

Every test runs on real files in a tmp dir but one: a power loss cannot be had from a real
disk in a test, so the seeded power losses run on the simulated disk (SimFiles, checked
against the real one by tests/test_files.py), which tears unsynced writes as a power cut
would. A kill -9 is the real files left as they are (`_kill`)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hastream.errors import CorruptionError
from raftstore import limits
from raftstore.storage.files import PAGE_BYTES, REAL_FILES, SimFiles
from raftstore.storage.journal import (
    FILE_VERSION_REUSED,
    SPARE_PREFIX,
    SPARES_ROOM_CHECK_S,
    DurableJournal,
    segment_paths,
)
from tests.chaos.faults import Tmpfs

pytestmark = pytest.mark.storage

# Records of 1 KiB, every one the same length, so that the records of a file's two uses
# line up; sixteen to a segment of four pages (a write's zeros to its page's end leave the
# earlier use's records in the pages after).
COMMAND = 1000
SEGMENT = 16 * 1024
SMALL_DISK = 8 * 1024 * 1024  # the tmpfs of the tests of a disk that fills up


def _command(idx: int, term: int = 1) -> bytes:
    return f"{idx:08d}-{term:04d}".encode().ljust(COMMAND, b".")


def _open(
    directory: Path, *, spares: int = 2, files: SimFiles | None = None, free_min: int = 0
) -> DurableJournal:
    """Spares kept whatever the disk has free (`free_min`): the test machine's disk may be
    nearly full."""
    return DurableJournal(
        directory,
        segment_bytes_max=SEGMENT,
        spares_max=spares,
        spares_free_bytes_min=free_min,
        files=REAL_FILES if files is None else files,
    )


def _with_spares(
    directory: Path, *, spares: int = 2, files: SimFiles | None = None
) -> DurableJournal:
    """Entries 1-60 written and the first 50 dropped: the full segments freed are spares."""
    journal = _open(directory, spares=spares, files=files)
    _append(journal, 1, 60)
    journal.drop_first(50)
    return journal


def _append(journal: DurableJournal, first: int, last: int, term: int = 1) -> None:
    for idx in range(first, last + 1):
        journal.append(_command(idx, term), idx, term)
    journal.sync()


def _spares(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.name.startswith(SPARE_PREFIX))


def _version(path: Path) -> int:
    return path.read_bytes()[4]


def _kill(journal: DurableJournal) -> None:
    """kill -9: the files stay as they are, raft.meta as last stored."""
    for segment in journal._segments:
        os.close(segment.fd)


def _bytes_in(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def _indexes(journal: DurableJournal) -> list[int]:
    return [idx for _, idx, _ in journal[:]]


def _with_a_reused_newest_segment(directory: Path, extra: int) -> tuple[DurableJournal, int]:
    """Entries up to 60 written, the first 50 dropped (spares made), then more until one
    starts a reused segment, and `extra` more there (fewer than 16: the segment holds
    them): the journal and its last index. The earlier use's records follow them."""
    journal = _with_spares(directory)
    assert _spares(directory)
    last = 60
    while _version(segment_paths(directory)[-1]) != FILE_VERSION_REUSED:
        last += 1
        _append(journal, last, last)
    _append(journal, last + 1, last + extra)
    assert _version(segment_paths(directory)[-1]) == FILE_VERSION_REUSED
    return journal, last + extra


def test_a_freed_full_segment_becomes_a_spare_and_the_next_segment_reuses_its_file(
    tmp_path: Path,
) -> None:
    journal = _with_spares(tmp_path)
    spares = _spares(tmp_path)
    assert len(spares) == 2  # spares_max: the rest were removed
    inodes = {path.stat().st_ino for path in spares}
    sizes = {path.stat().st_size for path in spares}
    assert min(sizes) >= SEGMENT
    _append(journal, 61, 100)  # three new segments: the two spares, then a new file
    assert not _spares(tmp_path)
    reused = [path for path in segment_paths(tmp_path) if path.stat().st_ino in inodes]
    assert len(reused) == 2
    assert all(_version(path) == FILE_VERSION_REUSED for path in reused)
    assert _version(segment_paths(tmp_path)[-1]) == 1
    assert _indexes(journal) == list(range(51, 101))
    journal.close()
    reopened = _open(tmp_path)
    assert reopened[:] == [(_command(idx), idx, 1) for idx in range(51, 101)]
    reopened.close()


def test_a_write_into_a_reused_segment_runs_on_with_zeros_to_its_pages_end(
    tmp_path: Path,
) -> None:
    journal, _ = _with_a_reused_newest_segment(tmp_path, 4)  # past the header's page
    end = journal._segments[-1].end
    data = segment_paths(tmp_path)[-1].read_bytes()
    page_end = -(-end // PAGE_BYTES) * PAGE_BYTES
    assert end % PAGE_BYTES
    assert not any(data[end:page_end])
    assert any(data[page_end : page_end + PAGE_BYTES])  # the earlier use's records
    journal.close()


def test_a_reused_segment_reopens_at_its_last_record_and_cuts_the_earlier_records_after_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal, last = _with_a_reused_newest_segment(tmp_path, 2)
    newest = segment_paths(tmp_path)[-1]
    journal.close()
    assert newest.stat().st_size > SEGMENT  # the earlier use's records still follow
    with caplog.at_level(logging.WARNING):
        reopened = _open(tmp_path)
    assert _indexes(reopened) == list(range(51, last + 1))
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert newest.stat().st_size < SEGMENT
    _append(reopened, last + 1, 90)
    reopened.close()
    assert _indexes(_open(tmp_path)) == list(range(51, 91))


def test_records_of_the_earlier_use_that_line_up_with_the_log_end_are_not_taken(
    tmp_path: Path,
) -> None:
    """A power loss that kept a reused segment's records but not the zeros after the last
    one: the earlier use's record there is whole, valid for its own crc32, and starts right
    where the log ends (every record is the same length). It must end the log, not be read
    as an entry nor as an index out of order."""
    for extra in range(15):
        directory = tmp_path / f"extra-{extra}"
        journal = _with_spares(directory)
        before = {path.stat().st_ino: path.read_bytes() for path in _spares(directory)}
        last = 60
        while _version(segment_paths(directory)[-1]) != FILE_VERSION_REUSED:
            last += 1
            _append(journal, last, last)
        _append(journal, last + 1, last + extra)
        newest = segment_paths(directory)[-1]
        end = journal._segments[-1].end
        journal.close()
        earlier = before[newest.stat().st_ino]
        record = _command(0)  # any: for the length
        old = earlier[end : end + 24 + len(record)]
        assert len(old) == 24 + len(record)
        assert int.from_bytes(old[4:8], "little") == len(record)  # a whole record there
        data = bytearray(newest.read_bytes())
        data[end : end + len(old)] = old
        newest.write_bytes(bytes(data))
        reopened = _open(directory)
        assert _indexes(reopened) == list(range(51, last + extra + 1))
        reopened.close()


def test_a_damaged_record_inside_a_reused_segment_is_corruption(tmp_path: Path) -> None:
    journal, _ = _with_a_reused_newest_segment(tmp_path, 3)
    newest = segment_paths(tmp_path)[-1]
    first = journal._positions[journal._seqs.index(journal._seqs[-1])]
    _kill(journal)  # raft.meta's synced_last_index stays behind: only the search tells
    data = bytearray(newest.read_bytes())
    data[first + 30] ^= 0x01  # the reused segment's first record: others follow it
    newest.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="follows at") as raised:
        _open(tmp_path)
    assert raised.value.path == str(newest)


def test_a_damaged_last_record_that_was_fdatasynced_is_corruption_in_a_reused_segment(
    tmp_path: Path,
) -> None:
    journal, _ = _with_a_reused_newest_segment(tmp_path, 3)
    newest = segment_paths(tmp_path)[-1]
    last = journal._positions[-1]
    journal.close()  # stores synced_last_index
    data = bytearray(newest.read_bytes())
    data[last + 30] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="fdatasynced"):
        _open(tmp_path)


def test_dropping_every_entry_of_a_reused_segment_then_reopening(tmp_path: Path) -> None:
    journal, last = _with_a_reused_newest_segment(tmp_path, 2)
    journal.drop_first(len(journal))
    journal.close()
    reopened = _open(tmp_path)
    assert len(reopened) == 0
    _append(reopened, last + 1, last + 9)
    reopened.close()
    assert _indexes(_open(tmp_path)) == list(range(last + 1, last + 10))


def test_spares_are_removed_when_the_journal_starts_over(tmp_path: Path) -> None:
    journal = _with_spares(tmp_path)
    journal.close()
    assert _spares(tmp_path)
    for path in segment_paths(tmp_path):
        path.unlink()
    (tmp_path / "raft.meta").unlink()
    fresh = _open(tmp_path)
    assert not _spares(tmp_path)
    _append(fresh, 1, 20)
    fresh.close()
    assert _indexes(_open(tmp_path)) == list(range(1, 21))


def test_no_spares_are_kept_when_none_are_allowed(tmp_path: Path) -> None:
    journal = _with_spares(tmp_path, spares=0)
    assert not _spares(tmp_path)
    journal.close()


@pytest.mark.parametrize("kept", [True, False], ids=["room", "no-room"])
def test_spares_are_kept_only_while_the_disk_has_room_besides(tmp_path: Path, kept: bool) -> None:
    """On this machine's disk: with no free room asked for, the freed segments are kept;
    asked for more room than the disk holds at all, they are removed, their room given
    back."""
    free_min = 0 if kept else shutil.disk_usage(tmp_path).total + 1
    journal = _open(tmp_path, free_min=free_min)
    _append(journal, 1, 60)
    used = _bytes_in(tmp_path)
    journal.drop_first(50)
    assert bool(_spares(tmp_path)) == kept
    assert (_bytes_in(tmp_path) < used - SEGMENT) != kept
    _append(journal, 61, 100)
    journal.close()
    assert _indexes(_open(tmp_path)) == list(range(51, 101))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Tmpfs]:
    """A real file system that fills up: a tmpfs of SMALL_DISK bytes (root only)."""
    disk = Tmpfs(tmp_path / "small", SMALL_DISK).mount_or_skip()
    try:
        yield disk
    finally:
        disk.unmount()


def test_spares_are_given_back_once_the_disk_has_less_room_free_than_asked_for(
    small_disk: Tmpfs, caplog: pytest.LogCaptureFixture
) -> None:
    directory = small_disk.path
    journal = _open(directory, free_min=SMALL_DISK // 4)
    _append(journal, 1, 60)
    journal.drop_first(50)
    assert len(_spares(directory)) == 2
    journal.check_spares_room(100.0)  # the disk nearly empty: kept
    assert len(_spares(directory)) == 2
    small_disk.fill()  # filled up by someone else (the data files, another journal)
    journal.check_spares_room(100.0 + SPARES_ROOM_CHECK_S / 2)  # not asked again so soon
    assert len(_spares(directory)) == 2
    with caplog.at_level(logging.WARNING):
        journal.check_spares_room(100.0 + SPARES_ROOM_CHECK_S)
    assert not _spares(directory)
    assert "journal spares removed" in caplog.text
    assert small_disk.free_bytes() >= 2 * SEGMENT  # their room is the file system's again
    _append(journal, 61, 62)  # the journal goes on in that room
    journal.close()
    assert _indexes(_open(directory)) == list(range(51, 63))


def test_a_write_that_finds_the_disk_full_gives_the_spares_back_and_its_retry_goes_in(
    small_disk: Tmpfs, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest segment grows a page at a time (a new file: spares are only reused by a
    roll), so its appends need new blocks now and then."""
    directory = small_disk.path
    journal = DurableJournal(
        directory,
        segment_bytes_max=SEGMENT,
        extend_bytes=PAGE_BYTES,
        spares_max=2,
        spares_free_bytes_min=0,
    )
    _append(journal, 1, 50)  # segments 0-2 full, 49 and 50 in segment 3
    journal.drop_first(40)  # segments 0 and 1 freed: the spares
    assert len(_spares(directory)) == 2
    small_disk.fill()
    with caplog.at_level(logging.WARNING):
        last, full = _append_until_refused(journal, 50)
    assert full.errno == errno.ENOSPC
    assert not _spares(directory)
    assert "journal spares removed" in caplog.text
    journal.append(_command(last + 1), last + 1, 1)  # the retry (pysyncobj's resend)
    _append(journal, last + 2, last + 3)
    journal.close()
    small_disk.filler.unlink()
    assert _indexes(_open(directory)) == list(range(41, last + 4))


def _append_until_refused(journal: DurableJournal, last: int) -> tuple[int, OSError]:
    """Append after `last` until a write fails: the last index in and the error."""
    for _ in range(SEGMENT // COMMAND):  # bounded: the segment grows before it is full
        try:
            journal.append(_command(last + 1), last + 1, 1)
        except OSError as error:
            return last, error
        last += 1
    raise AssertionError(f"appends up to {last} all went in")


def test_smaller_segments_ask_for_proportionally_less_room_to_keep_spares(
    small_disk: Tmpfs,
) -> None:
    """Asked for RAFT_JOURNAL_SPARES_FREE_BYTES_MIN (1 GiB, the default): none kept on this
    small disk; rolling at SEGMENT bytes through the tuning knob asks for
    RAFT_JOURNAL_SPARES_FREE_SEGMENTS segments of room instead: kept."""
    assert limits.RAFT_JOURNAL_SPARES_FREE_SEGMENTS * SEGMENT < SMALL_DISK // 2
    directory = small_disk.path
    journal = DurableJournal(directory, segment_bytes_max=SEGMENT, spares_max=2)
    _append(journal, 1, 60)
    journal.drop_first(50)
    assert not _spares(directory)
    journal.use_segment_bytes(SEGMENT)
    _append(journal, 61, 120)
    journal.drop_first(50)
    assert len(_spares(directory)) == 2
    journal.close()


@pytest.mark.parametrize("seed", range(40))
def test_a_power_loss_while_writing_a_reused_segment_keeps_what_was_synced(seed: int) -> None:
    """Unsynced records over the earlier use's: the power goes, and the disk keeps a random
    prefix of those writes (SimFiles' torn crash). Opening finds every synced entry, and
    after them only whole entries that were written, in order."""
    sim = SimFiles(seed=seed)
    directory = Path("/node/group-1")
    journal = _with_spares(directory, files=sim)
    synced_last = 64 + seed % 9  # 65 on: in a reused segment
    _append(journal, 61, synced_last)
    for idx in range(synced_last + 1, synced_last + 1 + seed % 7 + 1):
        journal.append(_command(idx, 2), idx, 2)
    sim.crash(torn=True)
    reopened = _open(directory, files=sim)
    found = reopened[:]
    assert [idx for _, idx, _ in found[: synced_last - 50]] == list(range(51, synced_last + 1))
    for command, idx, term in found[synced_last - 50 :]:
        assert (command, term) == (_command(idx, 2), 2)
    assert _indexes(reopened) == list(range(51, 51 + len(found)))
    _append(reopened, 51 + len(found), 51 + len(found) + 10, term=3)
    reopened.close()


def test_a_kill_during_reuse_leaves_a_spare_or_a_segment_never_half_of_each(
    tmp_path: Path,
) -> None:
    journal = _with_spares(tmp_path)
    spare = _spares(tmp_path)[-1]
    # The header is rewritten and fsynced before the rename: a kill between leaves the
    # spare with its new header, and the next open keeps it a spare.
    fd = os.open(spare, os.O_RDWR)
    os.pwrite(fd, b"HSRJ\x02\x00\x00\x00", 0)
    os.close(fd)
    journal.close()
    reopened = _open(tmp_path)
    assert spare in _spares(tmp_path)
    assert _indexes(reopened) == list(range(51, 61))
    _append(reopened, 61, 80)
    reopened.close()
    assert _indexes(_open(tmp_path)) == list(range(51, 81))
