"""storage/segments.py on real files: append, read, rolls, recovery, retention, repair."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hastream.errors import CorruptionError, NodeUnavailable, OffsetOutOfRange
from raftstore.storage.files import (
    DATA_WRITEBACK,
    Fault,
    FileHandle,
    OpenFiles,
    SimFiles,
    Writeback,
)
from raftstore.storage.format import HEADER_SIZE
from raftstore.storage.segments import DataRecord, TableLog, segment_name

pytestmark = pytest.mark.storage

LOGGER = "raftstore.storage.segments"
ROWS = 10  # Rows per record in most tests.
PAYLOAD_BYTES = 100
RECORD_BYTES = HEADER_SIZE + PAYLOAD_BYTES


def _payload(lsn: int, size: int = PAYLOAD_BYTES) -> bytes:
    """Deterministic, distinct per LSN, so a read can be checked against what was written."""
    seed = zlib.crc32(lsn.to_bytes(8, "little")).to_bytes(4, "little")
    return (seed * (size // 4 + 1))[:size]


def _append(log: TableLog, count: int, *, rows: int = ROWS, timestamp_ms: int = 1000) -> None:
    for _ in range(count):
        lsn = log.lsn_last + 1
        log.append(DataRecord(lsn, log.row_count, rows, timestamp_ms, _payload(lsn)))


def _read_all(log: TableLog) -> list[DataRecord]:
    return list(log.read(log.earliest_offset))


def _check_records(records: list[DataRecord], first_offset: int, lsn_first: int) -> None:
    """Records are contiguous, LSNs increasing by one, payloads as written."""
    offset, lsn = first_offset, lsn_first
    for record in records:
        assert record.first_offset == offset
        assert record.lsn == lsn
        assert bytes(record.payload) == _payload(record.lsn, len(record.payload))
        offset += record.row_count
        lsn += 1


def _segment_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("seg-"))


def _flip_byte(path: Path, position: int) -> None:
    with path.open("r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def table_dir(tmp_path: Path) -> Path:
    return tmp_path / "group2" / "trades"


def test_new_table_log_creates_directory_and_is_empty(table_dir: Path) -> None:
    log = TableLog(table_dir)
    assert table_dir.is_dir()
    assert (log.lsn_last, log.row_count, log.earliest_offset, log.bytes_total) == (0, 0, 0, 0)
    assert list(log.read(0)) == []
    log.close()


def test_append_and_read_across_segment_rolls(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 10)
    assert _segment_files(table_dir) == [segment_name(o) for o in (0, 30, 60, 90)]
    records = _read_all(log)
    assert len(records) == 10
    _check_records(records, 0, 1)
    assert (log.lsn_last, log.row_count, log.bytes_total) == (10, 100, 10 * RECORD_BYTES)
    log.close()


def test_the_newest_records_offset_counts_records_back_across_segments(table_dir: Path) -> None:
    # What bounds a replica digest by records (digest.py): the rows from there on fill at
    # most that many records.
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 10)  # records at 0, 10, ..., 90; three to a segment
    counts = (1, 3, 4, 9, 10, 11, 1000)
    assert [log.newest_records_offset(n) for n in counts] == [90, 70, 60, 10, 0, 0, 0]
    removed = log.remove_segments_before(2000, keep_rows=40)  # retention: 0..59 go
    assert removed == 60
    assert log.earliest_offset == 60
    assert [log.newest_records_offset(n) for n in (2, 4, 5)] == [80, 60, 60]
    log.close()


def test_read_range_returns_overlapping_records_only(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 10)
    records = list(log.read(35, 61))  # Rows 35..60: records at 30, 40, 50, 60.
    assert [r.first_offset for r in records] == [30, 40, 50, 60]
    assert [r.first_offset for r in log.read(40, 40)] == []
    assert log.record_at(99).first_offset == 90
    assert log.record_at(0).lsn == 1
    log.close()


def test_read_outside_retained_range_raises_offset_out_of_range(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    assert list(log.read(20)) == []
    with pytest.raises(OffsetOutOfRange) as caught:
        log.read(21)
    assert (caught.value.table, caught.value.offset, caught.value.latest) == ("trades", 21, 20)
    with pytest.raises(OffsetOutOfRange):
        log.record_at(20)
    log.close()


def test_reopen_restores_records_and_counters(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=4 * RECORD_BYTES)
    _append(log, 9)
    log.sync()
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=4 * RECORD_BYTES)
    assert (reopened.lsn_last, reopened.row_count, reopened.earliest_offset) == (9, 90, 0)
    assert reopened.bytes_total == 9 * RECORD_BYTES
    _check_records(_read_all(reopened), 0, 1)
    _append(reopened, 3)  # Continues in the reopened active segment, then rolls.
    _check_records(_read_all(reopened), 0, 1)
    assert _segment_files(table_dir) == [segment_name(o) for o in (0, 40, 80)]
    reopened.close()


def test_record_larger_than_segment_bytes_max_gets_its_own_segment(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 1)
    log.append(DataRecord(2, 10, 5, 0, b"x" * (3 * RECORD_BYTES)))
    _append(log, 1)
    assert _segment_files(table_dir) == [segment_name(o) for o in (0, 10, 15)]
    assert [r.row_count for r in _read_all(log)] == [10, 5, 10]
    log.close()


def test_arrow_record_batch_payload_round_trips(table_dir: Path) -> None:
    batch = pa.record_batch({"id": pa.array(range(1000), pa.int64()), "px": [0.5] * 1000})
    log = TableLog(table_dir)
    log.append(DataRecord(1, 0, batch.num_rows, 1234, batch.serialize().to_pybytes()))
    log.close()
    reopened = TableLog(table_dir)
    record = reopened.record_at(500)
    assert pa.ipc.read_record_batch(pa.py_buffer(record.payload), batch.schema).equals(batch)
    assert (record.lsn, record.row_count, record.timestamp_ms) == (1, 1000, 1234)
    reopened.close()


def test_append_asserts_lsn_and_offset_chain(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 1)
    with pytest.raises(AssertionError):
        log.append(DataRecord(0, 10, 1, 0, b"p"))  # LSN going backwards.
    log.append(DataRecord(1, 10, 1, 0, b"p"))  # One entry may carry several batches.
    with pytest.raises(AssertionError):
        log.append(DataRecord(2, 12, 1, 0, b"p"))  # Gap in offsets.
    with pytest.raises(AssertionError):
        log.append(DataRecord(2, 11, 0, 0, b"p"))  # No rows.
    log.close()


# --- torn tails ----------------------------------------------------------------------------


def test_cut_at_every_byte_of_last_record_truncates_to_previous_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    template = tmp_path / "template"
    log = TableLog(template)
    _append(log, 3)
    log.close()
    path = template / segment_name(0)
    last_start = 2 * RECORD_BYTES
    for cut in range(last_start + 1, 3 * RECORD_BYTES):
        directory = tmp_path / f"cut{cut}"
        shutil.copytree(template, directory)
        os.truncate(directory / path.name, cut)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            reopened = TableLog(directory)
        assert (reopened.row_count, reopened.lsn_last) == (20, 2), cut
        assert (directory / path.name).stat().st_size == last_start
        assert [r.levelname for r in caplog.records] == ["WARNING"], cut
        assert "truncated torn tail" in caplog.records[0].getMessage()
        assert f"position={last_start}" in caplog.records[0].getMessage()
        _append(reopened, 1)  # Appends go right after the last whole record.
        _check_records(_read_all(reopened), 0, 1)
        reopened.close()
        shutil.rmtree(directory)


def test_zero_filled_tail_is_truncated(table_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    log.close()
    path = table_dir / segment_name(0)
    with path.open("ab") as file:
        file.write(bytes(8192))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reopened = TableLog(table_dir)
    assert path.stat().st_size == 2 * RECORD_BYTES
    assert (reopened.row_count, reopened.lsn_last) == (20, 2)
    assert "truncated torn tail" in caplog.text
    reopened.close()


def test_last_record_with_zeroed_payload_end_and_zero_tail_is_truncated(
    table_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The header reached the disk, the rest of the record and beyond reads as zeros."""
    log = TableLog(table_dir)
    _append(log, 2)
    log.close()
    path = table_dir / segment_name(0)
    with path.open("r+b") as file:
        file.seek(RECORD_BYTES + HEADER_SIZE + 10)
        file.write(bytes(PAYLOAD_BYTES - 10 + 4096))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reopened = TableLog(table_dir)
    assert (reopened.row_count, path.stat().st_size) == (10, RECORD_BYTES)
    assert "truncated torn tail" in caplog.text
    reopened.close()


def test_torn_first_record_of_new_segment_reopens_previous_as_active(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 3)
    log.close()
    os.truncate(table_dir / segment_name(20), RECORD_BYTES // 2)
    reopened = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    assert (reopened.row_count, reopened.lsn_last) == (20, 2)
    assert _segment_files(table_dir) == [segment_name(0)]  # The emptied segment is gone.
    _append(reopened, 1)
    assert _segment_files(table_dir) == [segment_name(0), segment_name(20)]
    _check_records(_read_all(reopened), 0, 1)
    reopened.close()


def test_empty_trailing_segment_file_is_fine(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    log.close()
    (table_dir / segment_name(20)).touch()  # A roll that crashed before its first write.
    reopened = TableLog(table_dir)
    assert (reopened.row_count, reopened.lsn_last) == (20, 2)
    _append(reopened, 1)
    _check_records(_read_all(reopened), 0, 1)
    reopened.close()


# --- corruption ----------------------------------------------------------------------------


def test_flipped_payload_byte_in_middle_record_of_last_segment_raises_at_open(
    table_dir: Path,
) -> None:
    log = TableLog(table_dir)
    _append(log, 5)
    log.close()
    path = table_dir / segment_name(0)
    _flip_byte(path, 2 * RECORD_BYTES + HEADER_SIZE + 7)
    with pytest.raises(CorruptionError) as caught:
        TableLog(table_dir)
    assert (caught.value.path, caught.value.position) == (str(path), 2 * RECORD_BYTES)
    assert "crc" in caught.value.detail
    assert path.stat().st_size == 5 * RECORD_BYTES  # Nothing was cut.


def test_flipped_header_byte_in_middle_record_of_last_segment_raises_at_open(
    table_dir: Path,
) -> None:
    log = TableLog(table_dir)
    _append(log, 5)
    log.close()
    _flip_byte(table_dir / segment_name(0), 3 * RECORD_BYTES + 13)  # In the lsn field.
    with pytest.raises(CorruptionError) as caught:
        TableLog(table_dir)
    assert caught.value.position == 3 * RECORD_BYTES


def test_zeroed_header_followed_by_data_is_corruption_not_a_torn_tail(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 3)
    log.close()
    path = table_dir / segment_name(0)
    with path.open("r+b") as file:
        file.seek(2 * RECORD_BYTES)
        file.write(bytes(HEADER_SIZE))  # The last record's payload is still there.
    with pytest.raises(CorruptionError):
        TableLog(table_dir)


def test_flipped_payload_byte_in_sealed_segment_raises_at_read(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 9)
    log.close()
    path = table_dir / segment_name(0)
    _flip_byte(path, RECORD_BYTES + HEADER_SIZE + 50)
    reopened = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)  # Headers are fine.
    records = reopened.read(0)
    assert next(records).lsn == 1
    with pytest.raises(CorruptionError) as caught:
        next(records)
    assert (caught.value.path, caught.value.position) == (str(path), RECORD_BYTES)
    _check_records(list(reopened.read(30)), 30, 4)  # Other segments still read.
    reopened.close()


def test_flipped_header_byte_in_sealed_segment_raises_at_open(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 9)
    log.close()
    path = table_dir / segment_name(30)
    _flip_byte(path, 2 * RECORD_BYTES + 30)  # The last record of a sealed segment.
    with pytest.raises(CorruptionError) as caught:
        TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    assert (caught.value.path, caught.value.position) == (str(path), 2 * RECORD_BYTES)


def test_cut_sealed_segment_raises_at_open(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 9)
    log.close()
    os.truncate(table_dir / segment_name(30), 3 * RECORD_BYTES - 1)
    with pytest.raises(CorruptionError):
        TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)


def test_missing_middle_segment_raises_at_open(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 9)
    log.close()
    (table_dir / segment_name(30)).unlink()
    with pytest.raises(CorruptionError, match="previous one ends at 30"):
        TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)


# --- retention and repair ------------------------------------------------------------------


def test_retention_removes_old_segments_but_keeps_last_rows(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 6, timestamp_ms=1000)  # Segments at 0, 20, 40.
    _append(log, 2, timestamp_ms=5000)  # Segment at 60.
    # Everything before 5000 is old, but the last 35 rows (offsets 45..79) stay.
    assert log.remove_segments_before(5000, keep_rows=35) == 40
    assert _segment_files(table_dir) == [segment_name(40), segment_name(60)]
    assert (log.earliest_offset, log.row_count, log.bytes_total) == (40, 80, 4 * RECORD_BYTES)
    _check_records(_read_all(log), 40, 5)
    with pytest.raises(OffsetOutOfRange) as caught:
        log.read(39)
    assert (caught.value.earliest, caught.value.latest) == (40, 80)
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    assert (reopened.earliest_offset, reopened.row_count, reopened.lsn_last) == (40, 80, 8)
    reopened.close()


def test_retention_keeps_segments_with_recent_records(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 1, timestamp_ms=1000)
    _append(log, 1, timestamp_ms=9000)  # Same segment: its newest record is recent.
    _append(log, 2, timestamp_ms=1000)
    assert log.remove_segments_before(5000, keep_rows=0) == 0
    assert log.earliest_offset == 0
    log.close()


def test_retention_never_removes_the_active_segment(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 5)
    assert log.remove_segments_before(10**12, keep_rows=0) == 40
    assert (_segment_files(table_dir), log.earliest_offset, log.row_count) == (
        [segment_name(40)],
        40,
        50,
    )
    log.close()


def test_truncate_from_drops_records_across_segments(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 10)
    log.truncate_from(45)  # Record 40 holds row 45 and stays; records from 50 go.
    assert (log.row_count, log.lsn_last, log.bytes_total) == (50, 5, 5 * RECORD_BYTES)
    assert _segment_files(table_dir) == [segment_name(0), segment_name(30)]
    assert (table_dir / segment_name(30)).stat().st_size == 2 * RECORD_BYTES
    _append(log, 1)
    _check_records(_read_all(log), 0, 1)
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    assert (reopened.row_count, reopened.lsn_last) == (60, 6)
    reopened.close()


def test_truncate_from_segment_start_removes_that_segment(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    _append(log, 7)
    log.truncate_from(30)
    assert _segment_files(table_dir) == [segment_name(0)]
    assert (log.row_count, log.lsn_last) == (30, 3)
    _append(log, 1)  # Rolls into a fresh segment named 30 again.
    assert _segment_files(table_dir) == [segment_name(0), segment_name(30)]
    log.close()


def test_truncate_everything_retained_remembers_row_count_by_name(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 5)
    log.remove_segments_before(10**12, keep_rows=0)
    log.truncate_from(40)
    assert (log.row_count, log.earliest_offset, log.lsn_last) == (40, 40, 0)
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    assert (reopened.row_count, reopened.earliest_offset) == (40, 40)
    assert list(reopened.read(40)) == []
    reopened.append(DataRecord(9, 40, 10, 0, _payload(9)))
    assert reopened.record_at(45).lsn == 9
    reopened.close()


def test_truncate_from_at_row_count_changes_nothing(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    log.truncate_from(20)
    log.truncate_from(15)  # Inside the last record: it stays.
    assert (log.row_count, log.lsn_last) == (20, 2)
    log.close()


# --- threads, lifecycle --------------------------------------------------------------------


def test_concurrent_reader_sees_only_whole_records(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=8 * 1024)
    record_count = 2000
    done = threading.Event()
    failures: list[BaseException] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        try:
            seen = 0
            while not done.is_set() or seen < record_count * ROWS:
                records = list(log.read(0))
                _check_records(records, 0, 1)
                rows = sum(r.row_count for r in records)
                assert rows >= seen  # Never goes backwards.
                seen = rows
                reads += 1
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    for lsn in range(1, record_count + 1):
        size = 50 + lsn % 200  # Varying sizes: roll points move around.
        log.append(DataRecord(lsn, (lsn - 1) * ROWS, ROWS, 0, _payload(lsn, size)))
    done.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert failures == []
    assert reads >= 1
    log.close()


def test_concurrent_readers_and_truncations_never_see_garbage(table_dir: Path) -> None:
    """Readers walk a segment's records without the lock, from the indexed record before
    their offset. A truncation that cuts the file under them and appends records of other
    sizes at the same positions must end their read, never hand out a record whose payload
    is not its own, a broken offset chain, a CorruptionError, or records the truncation
    removed followed by records written after it (a log that never was)."""
    log = TableLog(table_dir, segment_bytes_max=16 * 1024, index_stride=4)
    done = threading.Event()
    failures: list[BaseException] = []
    reads: list[list[tuple[int, int]]] = []  # (first_offset, lsn) of each read's records
    truncations: list[tuple[int, int]] = []  # (offset, last LSN before it) of each

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not done.is_set():
                offset = rng.randrange(log.row_count + 1)
                try:
                    records = list(log.read(offset))
                except OffsetOutOfRange:  # A truncation moved the end below `offset`.
                    continue
                for before, after in itertools.pairwise(records):
                    assert after.first_offset == before.first_offset + before.row_count
                    assert after.lsn >= before.lsn
                for record in records:
                    assert bytes(record.payload) == _payload(record.lsn, len(record.payload))
                assert not records or records[0].first_offset <= offset
                reads.append([(record.first_offset, record.lsn) for record in records])
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    rng = random.Random(7)
    lsn = 0
    try:
        for cycle in range(150):
            for _ in range(rng.randrange(10, 40)):
                lsn += 1
                # Every other cycle sized by offset: a record appended after a truncation
                # then starts where the removed one at its offset did, so a reader walking on
                # finds a valid header where it expects one. Otherwise the reader meets the
                # middle of a record or the cut end of the file.
                size = 20 + log.row_count * 37 % 380 if cycle % 2 else rng.randrange(20, 400)
                log.append(DataRecord(lsn, log.row_count, ROWS, 0, _payload(lsn, size)))
            offset = rng.randrange(log.row_count // 2, log.row_count + 1)
            truncations.append((offset, lsn))
            log.truncate_from(offset)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)
    assert failures == []
    assert len(reads) >= 10
    for records in reads:
        for offset, lsn_before in truncations:
            removed = [
                i for i, (first, lsn) in enumerate(records) if first >= offset and lsn <= lsn_before
            ]
            assert not removed or records[-1][1] <= lsn_before, (offset, lsn_before, records)
    _check_chain_of(list(log.read(0)))
    log.close()


def _check_chain_of(records: list[DataRecord]) -> None:
    offset = 0
    for record in records:
        assert record.first_offset == offset
        assert bytes(record.payload) == _payload(record.lsn, len(record.payload))
        offset += record.row_count


def test_read_after_close_raises_node_unavailable(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    records = log.read(0)
    log.close()
    with pytest.raises(NodeUnavailable):
        next(records)


def test_sync_after_rolls_then_reopen(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 5)
    log.sync()
    _append(log, 1)
    log.sync()
    log.sync()
    log.close()
    assert TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES).row_count == 60


def test_destroy_removes_the_directory(table_dir: Path) -> None:
    log = TableLog(table_dir)
    _append(log, 2)
    log.destroy()
    assert not table_dir.exists()


def test_reading_a_million_rows_in_10k_row_records(table_dir: Path) -> None:
    batch = pa.record_batch({"id": pa.array(range(10_000), pa.int64())})
    payload = batch.serialize().to_pybytes()
    log = TableLog(table_dir, segment_bytes_max=1024 * 1024)
    for lsn in range(1, 101):
        log.append(DataRecord(lsn, (lsn - 1) * 10_000, 10_000, 0, payload))
    rows = sum(r.row_count for r in log.read(0))
    assert rows == 1_000_000
    log.close()


def test_many_rolls_between_syncs_keep_every_record(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=RECORD_BYTES)
    _append(log, 30)  # 30 segments: more than are left unsynced until the next sync.
    log.sync()
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=RECORD_BYTES)
    assert len(_segment_files(table_dir)) == 30
    _check_records(_read_all(reopened), 0, 1)
    reopened.close()


def test_empty_log_can_start_where_the_peers_retained_data_begins(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    log.start_at(70)
    assert (log.row_count, log.earliest_offset, log.lsn_last) == (70, 70, 0)
    with pytest.raises(OffsetOutOfRange):
        log.read(0)
    log.append(DataRecord(5, 70, 10, 0, _payload(5)))
    log.sync()
    log.close()
    reopened = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    assert (reopened.row_count, reopened.earliest_offset, reopened.lsn_last) == (80, 70, 5)
    assert reopened.record_at(75).lsn == 5
    with pytest.raises(AssertionError):
        reopened.start_at(200)  # it holds rows: never skip over them
    reopened.close()


def test_start_at_on_a_log_emptied_by_truncation_moves_forward_only(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=2 * RECORD_BYTES)
    _append(log, 3)
    log.truncate_from(0)  # an empty log at offset 0, its one segment file empty
    log.start_at(10)
    assert (log.row_count, log.earliest_offset) == (10, 10)
    log.start_at(5)  # behind: nothing to do
    assert log.row_count == 10
    log.close()
    assert _segment_files(table_dir) == [segment_name(10)]


# --- environment errors and bounded open files (simulated disk) ----------------------------

SIM_TABLE = Path("/node/group-1/trades")


def _sim_log(sim: SimFiles, open_files: OpenFiles | None = None) -> TableLog:
    return TableLog(
        SIM_TABLE,
        segment_bytes_max=3 * RECORD_BYTES,
        files=sim,
        open_files=open_files or OpenFiles(open_max=2),
    )


def _table_steps(log: TableLog) -> list[Callable[[], object]]:
    """Appends that roll segments, syncs, retention and a repair."""
    steps: list[Callable[[], object]] = [lambda: _append(log, 1) for _ in range(8)]
    steps.insert(4, log.sync)
    steps.append(lambda: log.remove_segments_before(10**12, keep_rows=25))
    steps.append(log.sync)
    steps.append(lambda: log.truncate_from(log.row_count - ROWS))
    steps += [lambda: _append(log, 1), lambda: _append(log, 1), log.sync]
    return steps


def _table_state(log: TableLog) -> tuple[int, int, int, int]:
    return (log.earliest_offset, log.row_count, log.lsn_last, log.bytes_total)


def _attempt(step: Callable[[], object]) -> OSError | CorruptionError | None:
    try:
        step()
    except (OSError, CorruptionError) as error:
        return error
    return None


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO], ids=errno.errorcode.get)
def test_an_error_at_any_operation_leaves_the_table_as_it_was_or_refuses_writes(
    error: int,
) -> None:
    """The fault hits one operation; the caller retries the failed call once. Then a restart
    finds every record the table held in memory, in a consistent chain."""
    dry = SimFiles()
    log = _sim_log(dry)
    before = dry.operations
    for step in _table_steps(log):
        step()
    operations = dry.operations - before
    assert operations > 20
    for failing in range(operations):
        where = f"{errno.errorcode[error]} at operation {failing}"
        sim = SimFiles()
        log = _sim_log(sim)
        sim.fail(Fault(error, skip=failing))
        for step in _table_steps(log):
            state = _table_state(log)
            raised = _attempt(step)
            if raised is None:
                continue
            assert isinstance(raised, OSError), (where, raised)
            assert raised.errno == error, where
            fault = sim.log[-1]
            if log.failed is not None:  # An fsync, or a truncation midway: refused from now.
                with pytest.raises(CorruptionError):
                    log.sync()
                break
            if "unlink" not in fault:  # Retention forgets a segment it failed to unlink.
                assert _table_state(log) == state, (where, fault)
            assert _attempt(step) is None, (where, fault)  # The retry: the fault is spent.
        in_memory = [(r.first_offset, r.lsn, bytes(r.payload)) for r in _read_all(log)]
        reopened = _sim_log(sim)  # kill -9 and start again.
        found = [(r.first_offset, r.lsn, bytes(r.payload)) for r in _read_all(reopened)]
        assert set(in_memory) <= set(found), where
        _check_records(_read_all(reopened), reopened.earliest_offset, found[0][1])


def test_a_failed_fsync_refuses_later_writes(table_dir: Path) -> None:
    sim = SimFiles()
    log = _sim_log(sim)
    _append(log, 2)
    sim.fail(Fault(errno.EIO, op="fsync"))
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        log.sync()
    with pytest.raises(CorruptionError, match="fsync failed"):
        log.sync()
    with pytest.raises(CorruptionError):
        _append(log, 1)
    assert _sim_log(sim).row_count == 20  # Reopening reads what the disk holds.


def test_sync_through_a_handle_that_was_closed_makes_the_appends_durable() -> None:
    """Each table's fd is dropped by the next table's appends (a bound of one fd): sync
    reopens the segment, and fsync of the reopened fd makes the earlier appends durable."""
    sim = SimFiles()
    open_files = OpenFiles(open_max=1)
    logs = [
        TableLog(Path(f"/node/group-1/t{n}"), files=sim, open_files=open_files) for n in range(5)
    ]
    for log in logs:
        _append(log, 3)
    assert sim.open_fds == 1
    for log in logs:
        log.sync()
    sim.crash()
    for n in range(5):
        reopened = TableLog(Path(f"/node/group-1/t{n}"), files=sim, open_files=open_files)
        _check_records(_read_all(reopened), 0, 1)
        assert reopened.row_count == 3 * ROWS


def test_many_tables_on_few_fds_append_read_and_sync_without_emfile() -> None:
    sim = SimFiles(open_files_max=8)  # The "process" can open 8 files at once.
    open_files = OpenFiles(open_max=4)
    logs = [
        TableLog(
            Path(f"/node/group-1/t{n}"),
            segment_bytes_max=2 * RECORD_BYTES,
            files=sim,
            open_files=open_files,
        )
        for n in range(50)
    ]
    for round_number in range(3):
        for log in logs:
            _append(log, 2)
            assert len(_read_all(log)) == 2 * (round_number + 1)
    for log in logs:
        log.sync()
        _check_records(_read_all(log), 0, 1)
    assert sim.open_fds <= 4


def test_2000_tables_under_an_fd_limit_of_256(tmp_path: Path) -> None:
    """The process-wide bound keeps data files under a quarter of the soft limit: 2,000
    tables, each appended to, read and synced, never hit EMFILE."""
    script = textwrap.dedent(
        f"""
        import os, resource
        from pathlib import Path
        from raftstore.storage.segments import DataRecord, TableLog
        from raftstore.storage.files import OPEN_DATA_FILES

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        root = Path({str(tmp_path)!r})
        logs = [TableLog(root / f"t{{n}}") for n in range(2000)]
        for round_number in range(2):
            for n, log in enumerate(logs):
                log.append(DataRecord(round_number + 1, log.row_count, 10, 0, b"row" * n))
                records = list(log.read(0))
                assert len(records) == round_number + 1, (n, len(records))
                assert bytes(records[-1].payload) == b"row" * n
        for log in logs:
            log.sync()
        fds = len(os.listdir("/proc/self/fd"))
        assert fds < 256, fds
        assert OPEN_DATA_FILES.count <= 64, OPEN_DATA_FILES.count
        print("fds", fds, "held", OPEN_DATA_FILES.count, "opened", OPEN_DATA_FILES.opened_total)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fds" in result.stdout


# --- the time index (offset_for_time) ---------------------------------------------------------


def _first_stamped_at_or_after(stamps: list[tuple[int, int]], at: int) -> tuple[int, int] | None:
    """The model: (first_offset, timestamp) of the first record stamped >= at."""
    return next(((offset, stamp) for offset, stamp in stamps if stamp >= at), None)


@given(
    stamps=st.lists(st.integers(0, 50), min_size=0, max_size=40),
    probes=st.lists(st.integers(-1, 52), min_size=1, max_size=8),
    cut=st.integers(0, 40),
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_offset_for_time_is_the_first_record_stamped_at_or_after(
    tmp_path_factory: pytest.TempPathFactory,
    stamps: list[int],
    probes: list[int],
    cut: int,
) -> None:
    """Stamps out of order (leaders' clocks disagree) included; the same answers after a
    truncation and after the files are reopened (the index is rebuilt from the headers)."""
    directory = tmp_path_factory.mktemp("times") / "t"
    log = TableLog(directory, segment_bytes_max=3 * RECORD_BYTES)
    records: list[tuple[int, int]] = []
    for stamp in stamps:
        records.append((log.row_count, stamp))
        _append(log, 1, timestamp_ms=stamp)
    for probe in probes:
        assert log.offset_for_time(probe) == _first_stamped_at_or_after(records, probe)
    if cut < len(records):
        log.truncate_from(records[cut][0])
        records = records[:cut]
    log.sync()
    log.close()
    log = TableLog(directory, segment_bytes_max=3 * RECORD_BYTES)
    for probe in probes:
        assert log.offset_for_time(probe) == _first_stamped_at_or_after(records, probe)
    log.close()


def test_offset_for_time_skips_segments_removed_by_retention(table_dir: Path) -> None:
    log = TableLog(table_dir, segment_bytes_max=3 * RECORD_BYTES)
    for stamp in range(9):  # three segments of three records, stamped 0..8
        _append(log, 1, timestamp_ms=stamp)
    log.sync()
    assert log.remove_segments_before(3, keep_rows=0) == 3 * ROWS
    assert log.offset_for_time(0) == (3 * ROWS, 3), "before the earliest: the earliest"
    assert log.offset_for_time(5) == (5 * ROWS, 5)
    assert log.offset_for_time(9) is None, "after the newest: none"
    log.close()


class _CountingWriteback(Writeback):
    def __init__(self) -> None:
        super().__init__()
        self.requested: list[Path] = []

    def request(self, handle: FileHandle) -> None:
        self.requested.append(handle.path)


def test_appends_ask_for_writeback_every_writeback_bytes(table_dir: Path) -> None:
    writeback = _CountingWriteback()
    record_size = HEADER_SIZE + len(_payload(1))
    log = TableLog(table_dir, writeback_bytes=3 * record_size, writeback=writeback)
    _append(log, 7)
    assert writeback.requested == [table_dir / segment_name(0)] * 2  # After records 3 and 6.
    log.sync()  # Writeback makes nothing durable: the fsync still does.
    log.close()
    assert len(_read_all(TableLog(table_dir))) == 7


def test_the_process_writeback_really_runs_for_a_big_table(table_dir: Path) -> None:
    log = TableLog(table_dir, writeback_bytes=1)
    before = DATA_WRITEBACK.started_total + DATA_WRITEBACK.dropped_total
    _append(log, 3)
    assert DATA_WRITEBACK.wait_idle(10)
    assert DATA_WRITEBACK.started_total + DATA_WRITEBACK.dropped_total > before
    assert DATA_WRITEBACK.failed_total == 0
    log.close()
