"""The online scrub: re-read every table's data files at a bounded rate and check every CRC.

A flipped bit in a sealed segment is otherwise found only when a reader reaches it or the
node restarts. The scrub reads each record through the same checked path readers use (the
offset and LSN chain from the index, the header CRC, the payload CRC); damage is reported to
the group's applier, which moves the table aside and repairs it from a peer (apply.py).

The rate (`streamingScrubRate`, MB/s) bounds the scrub's share of the disk, and
SCRUB_CPU_SHARE_MAX its share of a core: a record costs Python work however small it is
(7.5 us for a one-row record on a 2-core VM), so a table of 152-byte records read at 8 MB/s
would alone keep 40% of a core busy, and hold the GIL the Raft thread waits for. A pass over
all tables is followed by a pause. Runs on one thread the node owns (`run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from hastream.errors import CorruptionError, RaftStoreError
from raftstore import limits
from raftstore.group import Group
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

# Pause between passes, and the first pass's delay after start (let replay finish first).
PASS_PAUSE_S: Final = 10.0
# Bytes, and records, read between two looks at the pace (one look reads two clocks).
_CHUNK_BYTES: Final = 1 << 20
_CHUNK_RECORDS: Final = 64


@dataclass(frozen=True, slots=True)
class Pace:
    """The scrub's two bounds: bytes read per second and the share of one core it uses."""

    rate_bytes_s: float
    cpu_share: float

    def wait_s(self, read_bytes: int, cpu_s: float, elapsed_s: float) -> float:
        """How long to wait now so that, counted from the start of the work, neither
        `read_bytes` nor `cpu_s` is ahead of its bound."""
        return max(
            0.0, read_bytes / self.rate_bytes_s - elapsed_s, cpu_s / self.cpu_share - elapsed_s
        )


class _PassClock:
    """One pass's work so far against its Pace: counted across tables, so that a thousand
    small tables are paced like one big one. Used by the scrub thread only."""

    __slots__ = ("_cpu_started", "_pace", "_read", "_started", "_unchecked", "_unchecked_bytes")

    def __init__(self, pace: Pace) -> None:
        self._pace = pace
        self._started = time.monotonic()
        self._cpu_started = time.thread_time()  # this thread's CPU, system calls included
        self._read = self._unchecked = self._unchecked_bytes = 0

    def charge(self, payload_bytes: int) -> float:
        """Counts one record read; the seconds to wait now (0 between looks at the pace)."""
        self._read += payload_bytes
        self._unchecked += 1
        self._unchecked_bytes += payload_bytes
        if self._unchecked < _CHUNK_RECORDS and self._unchecked_bytes < _CHUNK_BYTES:
            return 0.0
        self._unchecked = self._unchecked_bytes = 0
        return self._pace.wait_s(
            self._read,
            time.thread_time() - self._cpu_started,
            time.monotonic() - self._started,
        )

    def cpu_s(self) -> float:
        return time.thread_time() - self._cpu_started


@dataclass(frozen=True, slots=True)
class ScrubFinding:
    group_id: int
    table: str
    detail: str
    at_ms: int


class Scrubber:
    def __init__(
        self,
        groups: Callable[[], Sequence[Group]],
        rate_mb_s: float,
        *,
        pause_s: float = PASS_PAUSE_S,
        cpu_share: float = limits.SCRUB_CPU_SHARE_MAX,
    ) -> None:
        assert rate_mb_s > 0, rate_mb_s
        assert 0 < cpu_share <= 1, cpu_share
        self._groups = groups
        self._pace = Pace(rate_mb_s * 1_000_000, cpu_share)
        self._pause_s = pause_s
        self._lock = threading.Lock()
        self.passes = 0
        self.cpu_s = 0.0  # the scrub thread's CPU over the passes it finished
        self.bytes_verified = 0
        self.records_verified = 0
        self.findings: list[ScrubFinding] = []  # the newest few
        self._current = ""

    def run(self, stopping: threading.Event) -> None:  # the scrub loop: runs until stopping
        while not stopping.wait(self._pause_s):
            clock = _PassClock(self._pace)
            for group in self._groups():
                for store in group.applier.stores():
                    if stopping.is_set():
                        return
                    self._scrub(group, store, clock, stopping)
            with self._lock:
                self.passes += 1
                self.cpu_s += clock.cpu_s()
                self._current = ""

    def _scrub(
        self, group: Group, store: TableStore, clock: _PassClock, stopping: threading.Event
    ) -> None:
        table = store.meta.table
        with self._lock:
            self._current = f"{group.group_id}/{table}"
        try:
            for record in store.records(store.earliest_offset, store.row_count):
                with self._lock:
                    self.bytes_verified += len(record.payload)
                    self.records_verified += 1
                wait_s = clock.charge(len(record.payload))
                if wait_s > 0 and stopping.wait(wait_s):
                    return
        except CorruptionError as error:
            log.error("scrub found damage group=%d table=%s: %s", group.group_id, table, error)
            finding = ScrubFinding(group.group_id, table, str(error), int(time.time() * 1000))
            with self._lock:
                self.findings = [*self.findings[-9:], finding]
            group.applier.report_damage(table, store.meta.created_lsn, error.detail)
        except RaftStoreError as error:
            # Dropped, closed or trimmed by retention under the scrub: next pass.
            log.debug("scrub skipped group=%d table=%s: %s", group.group_id, table, error)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rate_mb_s": self._pace.rate_bytes_s / 1_000_000,
                "cpu_share_max": self._pace.cpu_share,
                "passes": self.passes,
                "cpu_s": round(self.cpu_s, 3),
                "bytes_verified": self.bytes_verified,
                "records_verified": self.records_verified,
                "current": self._current,
                "findings": [
                    {"group": f.group_id, "table": f.table, "detail": f.detail, "at_ms": f.at_ms}
                    for f in self.findings
                ],
            }
