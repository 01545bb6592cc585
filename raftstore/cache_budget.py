"""One memory bound for the row caches of every table on a node.

Each table caches its newest `cacheLimit` rows (tables.py), as DolphinDB's stream tables do.
That bound is per table: a node with many tables, or wide rows, would hold the sum of them
all (a 211-column table caches ~170 MB at the default 100,000 rows). `CacheBudget` counts
the bytes every table's cache holds and, past `bytes_max`, drops the batches cached longest
ago, whatever their table; a read of those rows then comes from the data files, as it does
for rows past `cacheLimit`. Nothing but memory depends on the cache.

Threads: `added` is called by the apply thread of the table's group (one per group), with
no store lock held; eviction takes each victim's store lock in turn, never two at once.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raftstore import limits


@dataclass(slots=True, eq=False)
class CacheEntry:
    """One cached batch: held by its table's cache and by the budget's order. `rows` is
    dropped (None) once the table let it go, so the budget's order keeps no batch alive."""

    rows: Any  # tables.RowSlice; Any keeps this module below tables.py
    nbytes: int  # counted in the budget's bytes; 0 once out of the count
    evict: Callable[[CacheEntry], bool]  # the table drops the entry if it still holds it


class CacheBudget:
    def __init__(self, bytes_max: int = limits.CACHE_BYTES_MAX) -> None:
        if bytes_max <= 0:
            raise ValueError(f"bytes_max must be > 0, got {bytes_max}")
        self.bytes_max = bytes_max
        self._lock = threading.Lock()
        self._order: collections.deque[CacheEntry] = collections.deque()  # oldest first
        self._bytes = 0  # of the entries whose table still holds them
        self._released = 0  # entries in `_order` whose table let them go
        self.evicted_batches = 0

    @property
    def bytes_cached(self) -> int:
        with self._lock:
            return self._bytes

    def added(self, entry: CacheEntry) -> None:
        """A table cached `entry` (call with no store lock held). Drops the oldest cached
        batches of any table while the total is over the bound."""
        victims: list[CacheEntry] = []
        with self._lock:
            self._order.append(entry)
            self._bytes += entry.nbytes
            while self._bytes > self.bytes_max and self._order:
                oldest = self._order.popleft()
                if oldest.rows is None:
                    self._released -= 1
                    continue
                self._bytes -= oldest.nbytes
                oldest.nbytes = 0
                victims.append(oldest)
        for victim in victims:
            if victim.evict(victim):
                self.evicted_batches += 1

    def released(self, entry: CacheEntry) -> None:
        """The table let `entry` go by itself (its cacheLimit, or it closed)."""
        with self._lock:
            if entry.rows is None:
                return
            if entry.nbytes == 0:  # `added` took it out of the order to evict it: not there
                entry.rows = None
                return
            self._bytes -= entry.nbytes
            entry.nbytes = 0
            entry.rows = None
            self._released += 1
            # Bounded: released entries behind a long-cached one would pile up in the order
            # (an idle table's batch ahead of a busy table's); sweep them out, amortized O(1).
            if self._released > 64 and self._released * 2 > len(self._order):
                self._order = collections.deque(e for e in self._order if e.rows is not None)
                self._released = 0
