"""Counters and latency histograms the node keeps on its hot paths, read at scrape time.

Kept apart from prometheus_client on purpose: the write path pays one uncontended lock, a
bisect and a few integer adds per observation (about a microsecond), and the metrics
exporter (metrics.py) turns a `snapshot()` into Prometheus families only when it is scraped.

Threads: every method may be called from any thread.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Final

# Bucket upper bounds, in seconds (Prometheus `le`), for the latencies the node measures.
# An fdatasync takes 0.1..20 ms on an SSD and much longer on a busy disk; an acknowledged
# publish one Raft round trip and two fdatasyncs, and seconds during a failover.
FSYNC_BUCKETS_S: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
ACK_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
CHECKPOINT_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last bound is +Inf), their sum and count."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum_s: float


class LatencyHistogram:
    """Durations counted into fixed buckets: `observe` costs a lock, a bisect and two adds."""

    __slots__ = ("_bounds", "_counts", "_lock", "_sum_s")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(set(bounds)), "bounds strictly increase"
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self._sum_s = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(self._bounds, seconds)
        with self._lock:
            self._counts[index] += 1
            self._sum_s += seconds

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts = list(self._counts)
            sum_s = self._sum_s
        cumulative: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), running, sum_s)


@dataclass(frozen=True, slots=True)
class TablePublishSnapshot:
    requests: int
    rows: int
    payload_bytes: int
    ack_latency: HistogramSnapshot


class _TablePublish:
    __slots__ = ("ack_latency", "lock", "payload_bytes", "requests", "rows")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.rows = 0
        self.payload_bytes = 0
        self.ack_latency = LatencyHistogram(ACK_BUCKETS_S)


class PublishStats:
    """Acknowledged publishes per table on this node (it led the group when it answered):
    requests, rows kept (after dedup), payload bytes, and the time from the request's
    arrival to its acknowledgement."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, _TablePublish] = {}

    def record(self, table: str, rows: int, payload_bytes: int, latency_s: float) -> None:
        stats = self._tables.get(table)
        if stats is None:
            with self._lock:
                stats = self._tables.setdefault(table, _TablePublish())
        with stats.lock:
            stats.requests += 1
            stats.rows += rows
            stats.payload_bytes += payload_bytes
        stats.ack_latency.observe(latency_s)

    def forget(self, table: str) -> None:
        """The table was dropped: its series end."""
        with self._lock:
            self._tables.pop(table, None)

    def snapshot(self) -> dict[str, TablePublishSnapshot]:
        with self._lock:
            tables = dict(self._tables)
        result: dict[str, TablePublishSnapshot] = {}
        for table, stats in sorted(tables.items()):
            with stats.lock:
                requests, rows, payload_bytes = stats.requests, stats.rows, stats.payload_bytes
            result[table] = TablePublishSnapshot(
                requests, rows, payload_bytes, stats.ack_latency.snapshot()
            )
        return result

    def rows_total(self) -> int:
        return sum(snapshot.rows for snapshot in self.snapshot().values())


def subscriber_lag(row_count: int, persisted_offset: int) -> int:
    """Rows a topic's consumer is behind: offsets are of the last row processed (-1: none),
    so a consumer that processed every row of a table of `row_count` rows lags 0."""
    return max(0, row_count - 1 - persisted_offset)
