"""storage/segments.py against a plain list of records: generated sequences of appends,
reads, seeks, time lookups, truncations, retention and reopenings, on real files.

The index keeps only every `index_stride`-th record, so every lookup but those of indexed
records reads headers from the indexed one before it. The strides drawn here (1, 2, 3, 5
and the default) and segments of one to a few records put the sought record at every
distance from an indexed one, at segment ends and right after a cut or a reopen.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from raftstore.storage.format import HEADER_SIZE
from raftstore.storage.segments import INDEX_STRIDE, DataRecord, TableLog

pytestmark = pytest.mark.storage


def _end(record: DataRecord) -> int:
    return record.first_offset + record.row_count


class TableLogAgainstAList(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.parent = Path(tempfile.mkdtemp(prefix="segments-model-"))
        self.directory = self.parent / "table"
        self.records: list[DataRecord] = []  # Retained, oldest first (payloads as bytes).
        self.earliest = 0
        self.row_count = 0
        self.lsn_last = 0
        self.log: TableLog

    @initialize(
        stride=st.sampled_from([1, 2, 3, 5, INDEX_STRIDE]),
        segment_bytes_max=st.sampled_from([HEADER_SIZE + 1, 400, 1_000, 64 * 1024]),
    )
    def open_log(self, stride: int, segment_bytes_max: int) -> None:
        self.stride = stride
        self.segment_bytes_max = segment_bytes_max
        self.log = self._open()

    def _open(self) -> TableLog:
        return TableLog(
            self.directory, segment_bytes_max=self.segment_bytes_max, index_stride=self.stride
        )

    # --- changes ---------------------------------------------------------------------------

    @rule(
        count=st.integers(1, 12),
        rows=st.integers(1, 4),
        lsn_step=st.integers(0, 1),
        timestamp_ms=st.integers(0, 60),
        size=st.integers(1, 300),
    )
    def append(self, count: int, rows: int, lsn_step: int, timestamp_ms: int, size: int) -> None:
        for i in range(count):
            record = DataRecord(
                lsn=max(self.lsn_last, 1) + lsn_step,
                first_offset=self.row_count,
                row_count=rows,
                # Leaders' clocks may disagree: stamps go back as well as forward.
                timestamp_ms=(timestamp_ms + 7 * i) % 61,
                payload=bytes([(self.row_count + i) % 251]) * (size + i),
            )
            self.log.append(record)
            self.records.append(record)
            self.row_count, self.lsn_last = _end(record), record.lsn

    @rule(data=st.data())
    def truncate_from(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(self.earliest, self.row_count + 1))
        self.log.truncate_from(offset)
        self.records = [record for record in self.records if record.first_offset < offset]
        if self.records:
            self.row_count, self.lsn_last = _end(self.records[-1]), self.records[-1].lsn
        else:
            self.row_count, self.lsn_last = self.earliest, 0

    @rule(cutoff_ms=st.integers(0, 70), keep_rows=st.integers(0, 30))
    def retention(self, cutoff_ms: int, keep_rows: int) -> None:
        removed = self.log.remove_segments_before(cutoff_ms, keep_rows=keep_rows)
        earliest = self.log.earliest_offset
        assert earliest == self.earliest + removed
        if removed:
            assert earliest <= self.row_count - keep_rows
            assert earliest < self.row_count
        gone = [record for record in self.records if record.first_offset < earliest]
        assert all(record.timestamp_ms < cutoff_ms for record in gone)
        self.records = self.records[len(gone) :]
        assert not self.records or self.records[0].first_offset == earliest
        self.earliest = earliest

    @rule()
    def reopen(self) -> None:
        self.log.sync()
        self.log.close()
        self.log = self._open()

    # --- reads -----------------------------------------------------------------------------

    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        offset_from = data.draw(st.integers(self.earliest, self.row_count))
        offset_to = data.draw(st.integers(offset_from, self.row_count + 2))
        # A record read back holds a memoryview: it compares equal to the same bytes.
        expected = [
            record
            for record in self.records
            if _end(record) > offset_from
            and record.first_offset < offset_to
            and offset_from < min(offset_to, self.row_count)
        ]
        assert list(self.log.read(offset_from, offset_to)) == expected

    @rule(data=st.data())
    def record_at(self, data: st.DataObject) -> None:
        if self.row_count == self.earliest:
            return
        offset = data.draw(st.integers(self.earliest, self.row_count - 1))
        (expected,) = [r for r in self.records if r.first_offset <= offset < _end(r)]
        assert self.log.record_at(offset) == expected

    @rule(timestamp_ms=st.integers(0, 62))
    def offset_for_time(self, timestamp_ms: int) -> None:
        expected = next(
            (
                (record.first_offset, record.timestamp_ms)
                for record in self.records
                if record.timestamp_ms >= timestamp_ms
            ),
            None,
        )
        assert self.log.offset_for_time(timestamp_ms) == expected

    @rule(count=st.integers(1, 40))
    def newest_records_offset(self, count: int) -> None:
        expected = self.records[-count].first_offset if count <= len(self.records) else None
        assert self.log.newest_records_offset(count) == (
            self.earliest if expected is None else expected
        )

    @invariant()
    def totals_match(self) -> None:
        if not hasattr(self, "log"):
            return
        assert self.log.row_count == self.row_count
        assert self.log.earliest_offset == self.earliest
        assert self.log.lsn_last == self.lsn_last
        assert self.log.bytes_total == sum(HEADER_SIZE + len(r.payload) for r in self.records)

    def teardown(self) -> None:
        if hasattr(self, "log"):
            self.log.close()
        shutil.rmtree(self.parent, ignore_errors=True)


TableLogAgainstAList.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_table_log_against_a_list = TableLogAgainstAList.TestCase
