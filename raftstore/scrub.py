"""The online scrub: re-read every table's data files at a bounded rate and check every CRC.

A flipped bit in a sealed segment is otherwise found only when a reader reaches it or the
node restarts. The scrub reads each record through the same checked path readers use (the
header against the index, the header CRC, the payload CRC); damage is reported to the
group's applier, which moves the table aside and repairs it from a peer (apply.py).

The rate (`streamingScrubRate`, MB/s) bounds the scrub's share of the disk; a pass over all
tables is followed by a pause. Runs on one thread the node owns (`run`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from hastream.errors import CorruptionError, RaftStoreError
from raftstore.group import Group
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

# Pause between passes, and the first pass's delay after start (let replay finish first).
PASS_PAUSE_S: Final = 10.0
# Bytes read between rate checks.
_CHUNK_BYTES: Final = 1 << 20


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
    ) -> None:
        assert rate_mb_s > 0, rate_mb_s
        self._groups = groups
        self._rate_bytes_s = rate_mb_s * 1_000_000
        self._pause_s = pause_s
        self._lock = threading.Lock()
        self.passes = 0
        self.bytes_verified = 0
        self.records_verified = 0
        self.findings: list[ScrubFinding] = []  # the newest few
        self._current = ""

    def run(self, stopping: threading.Event) -> None:  # the scrub loop: runs until stopping
        while not stopping.wait(self._pause_s):
            for group in self._groups():
                for store in group.applier.stores():
                    if stopping.is_set():
                        return
                    self._scrub(group, store, stopping)
            with self._lock:
                self.passes += 1
                self._current = ""

    def _scrub(self, group: Group, store: TableStore, stopping: threading.Event) -> None:
        table = store.meta.table
        with self._lock:
            self._current = f"{group.group_id}/{table}"
        started = time.monotonic()
        read = 0
        try:
            for record in store.records(store.earliest_offset, store.row_count):
                read += len(record.payload)
                with self._lock:
                    self.bytes_verified += len(record.payload)
                    self.records_verified += 1
                if read % _CHUNK_BYTES < len(record.payload):  # about once per MiB
                    ahead_s = read / self._rate_bytes_s - (time.monotonic() - started)
                    if ahead_s > 0 and stopping.wait(ahead_s):
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
                "rate_mb_s": self._rate_bytes_s / 1_000_000,
                "passes": self.passes,
                "bytes_verified": self.bytes_verified,
                "records_verified": self.records_verified,
                "current": self._current,
                "findings": [
                    {"group": f.group_id, "table": f.table, "detail": f.detail, "at_ms": f.at_ms}
                    for f in self.findings
                ],
            }
