"""Retention: removing data files older than a table's `retentionMinutes`, on its own clock.

Retention is local housekeeping, not replicated state: each replica removes whole sealed
segments whose newest row is older than the table's retention, never the segment holding
the last rows, nor any of the last `keep_rows` rows (the key window is rebuilt from them).
It reads the wall clock, so it never runs inside apply or a checkpoint: the applier calls
`run_if_due` from its tick, which owns the stores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

from raftstore import limits
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

INTERVAL_S: Final = 60.0


class Retention:
    def __init__(
        self,
        *,
        interval_s: float = INTERVAL_S,
        keep_rows: int = limits.DEDUP_WINDOW_ROWS,
        monotonic: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self._interval_s = interval_s
        self._keep_rows = keep_rows
        self._monotonic = monotonic
        self._wall_ms = wall_ms
        self._next_run = monotonic() + interval_s
        self.rows_removed = 0

    def due(self) -> bool:
        """Whether `run_if_due` would run now (a caller skips listing the stores if not)."""
        return self._monotonic() >= self._next_run

    def run_if_due(self, stores: Iterable[TableStore]) -> None:
        if not self.due():
            return
        self._next_run = self._monotonic() + self._interval_s
        self.run(stores)

    def run(self, stores: Iterable[TableStore]) -> None:
        now_ms = self._wall_ms()
        for store in stores:
            cutoff_ms = now_ms - store.meta.retention_minutes * 60_000
            self.rows_removed += store.log.remove_segments_before(
                cutoff_ms, keep_rows=self._keep_rows
            )
