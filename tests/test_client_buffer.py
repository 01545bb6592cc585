"""The client's durable buffer on real files in a tmp dir: reopen, COMMIT, corrupt tails,
byte limit, locking, and a real kill -9 of a process appending to it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from api_clients import MultithreadedTableWriter, Session, batches
from api_clients import buffer_format as fmt
from api_clients.buffer import COMMIT_NAME, DurableBuffer, MemoryBuffer
from hastream.errors import CorruptionError, InvalidArgument, Overloaded, RaftStoreError

pytestmark = pytest.mark.storage

REPO = Path(__file__).resolve().parents[1]
SCHEMA = pa.schema([("id", pa.int64()), ("price", pa.float64()), ("sym", pa.string())])
TABLE = "ticks"


def rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table(
        {"id": ids, "price": [i / 2 for i in ids], "sym": [f"s{i:06d}" for i in ids]}, schema=SCHEMA
    )


def payload(first: int, count: int = 10) -> bytes:
    return batches.encode(rows(first, count))


def ids_of(records: list[object]) -> list[int]:
    out: list[int] = []
    for record in records:
        out.extend(batches.decode(record.payload).column("id").to_pylist())  # type: ignore[attr-defined]
    return out


def segments(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if fmt.segment_first_sequence(p.name))


def record_ends(segment: Path) -> list[int]:
    """The byte position after each record of a segment."""
    data = segment.read_bytes()
    ends = [0]
    while ends[-1] < len(data):
        ends.append(ends[-1] + fmt.decode_header(data[ends[-1] :]).record_bytes)
    return ends[1:]


def fill(directory: Path, count: int, **kwargs: int) -> list[int]:
    with DurableBuffer(directory, table=TABLE, **kwargs) as buffer:
        return [buffer.append(payload(number * 10), 10) for number in range(count)]


def test_records_survive_reopen_in_order_with_a_stable_producer(tmp_path: Path) -> None:
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        producer_id = buffer.producer_id
        sequences = [buffer.append(payload(number * 10), 10) for number in range(5)]
    assert sequences == [1, 2, 3, 4, 5]
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert buffer.producer_id == producer_id
        pending = buffer.pending_records()
        assert [record.sequence for record in pending] == sequences
        assert ids_of(pending) == list(range(50))
        stats = buffer.stats()
        assert (stats.reopened_records, stats.reopened_rows, stats.truncated_tails) == (5, 50, 0)
        assert buffer.append(payload(50), 10) == 6  # Sequences continue, never reused.


def test_commit_marker_hides_acknowledged_records_after_reopen(tmp_path: Path) -> None:
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        for number in range(4):
            buffer.append(payload(number * 10), 10)
        record = buffer.head(0)
        assert record is not None
        assert record.sequence == 1
        buffer.commit(1)
        record = buffer.head(0)
        assert record is not None
        assert record.sequence == 2
        buffer.commit(2)
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert [record.sequence for record in buffer.pending_records()] == [3, 4]
        assert buffer.stats().committed_sequence == 2
        assert buffer.append(payload(40), 10) == 5


def test_head_returns_the_same_record_until_it_is_committed(tmp_path: Path) -> None:
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert buffer.head(0.01) is None
        buffer.append(payload(0), 10)
        buffer.append(payload(10), 10)
        first = buffer.head(0)
        again = buffer.head(0)
        assert first == again
        assert first is not None
        buffer.commit(first.sequence)
        second = buffer.head(0)
        assert second is not None
        assert second.sequence == 2


@pytest.mark.parametrize(
    "damage",
    ["cut_mid_payload", "cut_mid_header", "flip_payload_byte", "garbage_after_last"],
)
def test_corrupt_tail_is_truncated_logged_and_counted_on_reopen(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    fill(tmp_path, 3)
    (segment,) = segments(tmp_path)
    data = segment.read_bytes()
    ends = record_ends(segment)
    if damage == "cut_mid_payload":
        segment.write_bytes(data[: ends[2] - 100])
    elif damage == "cut_mid_header":
        segment.write_bytes(data[: ends[1] + 20])
    elif damage == "flip_payload_byte":
        flipped = bytearray(data)
        flipped[-5] ^= 0x40
        segment.write_bytes(bytes(flipped))
    else:
        segment.write_bytes(data + b"HSBR\x01garbage")
    keep = 3 if damage == "garbage_after_last" else 2
    damaged_size = segment.stat().st_size
    with caplog.at_level(logging.WARNING, logger="api_clients.buffer"):
        buffer = DurableBuffer(tmp_path, table=TABLE)
    with buffer:
        assert [record.sequence for record in buffer.pending_records()] == list(range(1, keep + 1))
        assert ids_of(buffer.pending_records()) == list(range(keep * 10))
        stats = buffer.stats()
        assert stats.truncated_tails == 1
        assert stats.truncated_bytes == damaged_size - ends[keep - 1]
        assert buffer.append(payload(keep * 10), 10) == keep + 1
    assert segment.stat().st_size == ends[keep - 1]  # Cut on disk, not only in memory.
    assert "buffer segment tail truncated" in caplog.text


def test_corruption_in_a_sealed_segment_with_unsent_records_raises(tmp_path: Path) -> None:
    record_bytes = fmt.RECORD_HEADER_BYTES + len(payload(0))
    fill(tmp_path, 6, segment_bytes_max=2 * record_bytes)  # Three segments of two records.
    first = segments(tmp_path)[0]
    damaged = bytearray(first.read_bytes())
    damaged[fmt.RECORD_HEADER_BYTES + 3] ^= 0xFF
    first.write_bytes(bytes(damaged))
    with pytest.raises(CorruptionError) as raised:
        DurableBuffer(tmp_path, table=TABLE)
    assert raised.value.path == str(first)
    assert raised.value.position == 0
    with DurableBuffer(tmp_path / "other", table=TABLE):
        pass  # The failed open released its lock and files (nothing leaks into a new open).


def test_acknowledged_segments_are_deleted_and_their_damage_is_harmless(tmp_path: Path) -> None:
    record_bytes = fmt.RECORD_HEADER_BYTES + len(payload(0))
    with DurableBuffer(tmp_path, table=TABLE, segment_bytes_max=2 * record_bytes) as buffer:
        for number in range(6):
            buffer.append(payload(number * 10), 10)
        assert len(segments(tmp_path)) == 3
        for sequence in range(1, 4):
            assert buffer.head(0) is not None
            buffer.commit(sequence)
        buffer.flush_commit()
        # The first segment (1, 2) is fully acknowledged: gone. The second holds 4.
        assert [fmt.segment_first_sequence(p.name) for p in segments(tmp_path)] == [3, 5]
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert [record.sequence for record in buffer.pending_records()] == [4, 5, 6]


def test_byte_limit_drops_the_oldest_records_and_counts_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record_bytes = fmt.RECORD_HEADER_BYTES + len(payload(0))
    with (
        caplog.at_level(logging.WARNING, logger="api_clients.buffer"),
        DurableBuffer(tmp_path, table=TABLE, bytes_max=3 * record_bytes) as buffer,
    ):
        for number in range(5):
            buffer.append(payload(number * 10), 10)
        stats = buffer.stats()
        assert (stats.dropped_records, stats.dropped_rows) == (2, 20)
        assert (stats.pending_records, stats.pending_bytes) == (3, 3 * record_bytes)
        assert [record.sequence for record in buffer.pending_records()] == [3, 4, 5]
        assert stats.committed_sequence == 2  # Dropped counts as done for the marker.
    assert "buffer full, dropped oldest" in caplog.text
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert [record.sequence for record in buffer.pending_records()] == [3, 4, 5]


def test_byte_limit_never_drops_the_record_being_sent(tmp_path: Path) -> None:
    record_bytes = fmt.RECORD_HEADER_BYTES + len(payload(0))
    with DurableBuffer(tmp_path, table=TABLE, bytes_max=2 * record_bytes) as buffer:
        buffer.append(payload(0), 10)
        in_flight = buffer.head(0)
        assert in_flight is not None
        for number in range(1, 4):
            buffer.append(payload(number * 10), 10)
        assert [record.sequence for record in buffer.pending_records()] == [1, 4]
        buffer.commit(1)
        assert buffer.stats().committed_sequence == 3  # 2 and 3 were dropped.
        head = buffer.head(0)
        assert head is not None
        assert head.sequence == 4


def test_a_leftover_commit_tmp_from_a_crash_is_ignored(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    (tmp_path / (COMMIT_NAME + ".tmp")).write_bytes(fmt.encode_commit(3, b"\0" * 16)[:7])
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        assert [record.sequence for record in buffer.pending_records()] == [1, 2, 3]


def test_a_corrupt_commit_marker_resends_everything_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DurableBuffer(tmp_path, table=TABLE) as buffer:
        for number in range(3):
            buffer.append(payload(number * 10), 10)
        buffer.head(0)
        buffer.commit(2)
        buffer.flush_commit()
    marker = tmp_path / COMMIT_NAME
    damaged = bytearray(marker.read_bytes())
    damaged[9] ^= 0x01
    marker.write_bytes(bytes(damaged))
    with caplog.at_level(logging.WARNING), DurableBuffer(tmp_path, table=TABLE) as buffer:
        # Resending 1 and 2 is safe: the cluster's producer window answers them.
        assert [record.sequence for record in buffer.pending_records()] == [1, 2, 3]
    assert "COMMIT unreadable" in caplog.text


def test_a_directory_is_used_by_one_buffer_at_a_time(tmp_path: Path) -> None:
    with (
        DurableBuffer(tmp_path, table=TABLE),
        pytest.raises(InvalidArgument, match="in use by another writer"),
    ):
        DurableBuffer(tmp_path, table=TABLE)
    with DurableBuffer(tmp_path, table=TABLE):
        pass


def test_a_directory_of_another_table_is_refused(tmp_path: Path) -> None:
    fill(tmp_path, 1)
    with pytest.raises(InvalidArgument, match="buffers table 'ticks'"):
        DurableBuffer(tmp_path, table="other")


def test_memory_buffer_makes_producers_wait_instead_of_dropping() -> None:
    buffer = MemoryBuffer(bytes_max=100)
    buffer.append(b"x" * 80, 1)
    assert buffer.wait_for_space(0)
    buffer.append(b"y" * 80, 1)
    assert not buffer.wait_for_space(0.05)
    with pytest.raises(Overloaded):
        buffer.append(b"z" * 10, 1)
    record = buffer.head(0)
    assert record is not None
    buffer.commit(record.sequence)
    assert buffer.wait_for_space(0)
    assert [record.payload for record in buffer.pending_records()] == [b"y" * 80]


def dead_site() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_writer_reports_a_truncated_tail_in_get_status(tmp_path: Path) -> None:
    """A writer whose cluster is unreachable keeps rows in its durable buffer; after its
    segment is torn, the next writer on the directory truncates, reports and resends."""
    session = Session([dead_site()], deadline_s=0.5)
    writer = MultithreadedTableWriter(
        session, TABLE, batchSize=10, throttle=0.05, durableBufferDir=tmp_path, schema=SCHEMA
    )
    for key in range(30):
        writer.insert(key, key / 2, f"s{key}")
    writer.close()
    (segment,) = segments(tmp_path / "thread-0")
    segment.write_bytes(segment.read_bytes()[:-7])
    writer = MultithreadedTableWriter(
        session, TABLE, batchSize=10, throttle=0.05, durableBufferDir=tmp_path, schema=SCHEMA
    )
    status = writer.getStatus()
    assert status.truncatedTails == 1
    assert (status.resentRows, status.unsentRows, status.sentRows) == (20, 20, 0)
    assert writer.getUnwrittenData().column("id").to_pylist() == list(range(20))
    writer.close()
    session.close()


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import pyarrow as pa
    from api_clients import batches
    from api_clients.buffer import DurableBuffer

    schema = pa.schema([("id", pa.int64()), ("price", pa.float64()), ("sym", pa.string())])
    buffer = DurableBuffer(sys.argv[1], table="ticks", segment_bytes_max=64 * 1024)
    number = 0
    while True:  # Until killed.
        ids = list(range(number * 100, number * 100 + 100))
        table = pa.table({"id": ids, "price": [i / 2 for i in ids],
                          "sym": ["s" * (i % 50) for i in ids]}, schema=schema)
        sequence = buffer.append(batches.encode(table), 100)
        print(sequence, flush=True)
        number += 1
    """
)


def test_records_appended_before_a_kill_9_survive_it(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    directory = tmp_path / "buffer"
    child = subprocess.Popen(
        [sys.executable, str(script), str(directory), str(REPO)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    deadline = time.monotonic() + 60
    reported = 0
    while reported < 300:  # Several segments' worth, then kill in the middle of appends.
        assert time.monotonic() < deadline, "child appended too slowly"
        line = child.stdout.readline()
        assert line, "child exited early"
        reported = int(line)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    with DurableBuffer(directory, table=TABLE) as buffer:
        pending = buffer.pending_records()
        sequences = [record.sequence for record in pending]
        assert sequences == list(range(1, len(sequences) + 1))
        assert len(sequences) >= reported  # Everything acknowledged by append() is there.
        assert ids_of(pending) == list(range(100 * len(sequences)))


def test_a_writer_that_fails_to_start_leaves_no_buffer_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        site = f"127.0.0.1:{sock.getsockname()[1]}"
    with Session([site], deadline_s=0.5, hedge_delay_s=None) as session:
        with pytest.raises(RaftStoreError):
            MultithreadedTableWriter(session, "unknown_table")
        assert not (tmp_path / ".hastream_buffer").exists()
        given = tmp_path / "mine" / "buffers"
        with pytest.raises(RaftStoreError):
            MultithreadedTableWriter(session, "unknown_table", durableBufferDir=given)
        assert not (tmp_path / "mine").exists()
        existing = tmp_path / "kept"
        existing.mkdir()
        with pytest.raises(RaftStoreError):
            MultithreadedTableWriter(session, "unknown_table", durableBufferDir=existing)
        assert existing.is_dir()  # not created by the writer: left alone
