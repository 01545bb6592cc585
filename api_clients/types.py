"""The client's shared value types and the one seam its stream users receive.

A leaf of `api_clients/` (it imports no module that imports it back): the results callers
get (`AppendResult`, `TableInfo`), the subscription callbacks (`Handler`, `Filter`), and
`StreamOpener`, what the subscriber, the reader and the publish pipeline need of a session.
`connection.Session` implements it; they receive a session and never import connection.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from api_clients.call_policy import AttemptState, Decision
from api_clients.hedge import LeaderWatch
from api_clients.retry import Backoff, Sleep
from api_clients.transport import Stream
from hastream.errors import RaftStoreError

# handler(message, first_offset): message is a pyarrow.Table (msgAsTable=True) or a list of
# row dicts; first_offset is the offset of the first row of the range before filtering.
Handler = Callable[[Any, int], object]
# filter(table) returns the rows to keep: a pyarrow.Table, or a boolean mask over `table`.
Filter = Callable[[pa.Table], "pa.Table | pa.Array | pa.ChunkedArray"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendResult:
    """What the cluster committed for one `append`. Offsets of one request are contiguous:
    `[first_offset, first_offset + row_count)`. When the data was split into several
    requests, `parts` holds each request's result (other publishers' rows may lie between
    them), `first_offset` is the first part's and `lsn` the last part's."""

    first_offset: int
    row_count: int  # Rows appended (after key-column dedup).
    duplicates: int  # Rows dropped by key-column dedup.
    lsn: int  # Raft log index of the (last) entry that carried the rows.
    duplicate_batch: bool = False  # A retry answered from the producer window.
    parts: tuple[AppendResult, ...] = field(default=())
    # With a durable buffer: rows of this append the cluster has not acknowledged yet (they
    # are safe in the buffer and are resent later). 0 means everything was acknowledged.
    buffered_rows: int = 0

    @property
    def acknowledged(self) -> bool:
        return self.buffered_rows == 0

    @staticmethod
    def merge(results: list[AppendResult]) -> AppendResult:
        """The result of a split append: one part per request, in order."""
        assert results, "an append sends at least one request"
        if len(results) == 1:
            return results[0]
        return AppendResult(
            first_offset=results[0].first_offset,
            row_count=sum(result.row_count for result in results),
            duplicates=sum(result.duplicates for result in results),
            lsn=results[-1].lsn,
            duplicate_batch=any(result.duplicate_batch for result in results),
            parts=tuple(results),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TableInfo:
    """A stream table as the cluster describes it. Offsets: `earliest_offset` is the earliest
    row still retained, `row_count` the offset the next appended row will get."""

    table: str
    raft_group: int  # >= 2 for an HA table; 0 for a non-HA table on one node.
    schema: pa.Schema
    cache_limit: int
    key_column: str | None
    retention_minutes: int
    row_count: int
    earliest_offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class OffsetForTime:
    """The first retained row of `table` stamped at or after the time asked (Kafka's
    offsetsForTimes). `found=False`: every retained row is older, and `offset` is the
    table's row count (the next row); `timestamp_ms` is then -1."""

    table: str
    found: bool
    offset: int
    timestamp_ms: int


class StreamOpener(Protocol):
    """What the subscriber, the reader and the publish pipeline need of a session: the site
    list and leader memory, retry budgets, streams, a watch that tells when to leave a silent
    site (`hedge.LeaderWatch`), and two unary calls. See `connection.Session` for each
    method's contract."""

    @property
    def sites(self) -> list[str]: ...

    @property
    def deadline_s(self) -> float: ...

    def new_backoff(
        self, deadline_s: float | None = None, *, sleep: Sleep | None = None
    ) -> Backoff: ...

    def route(self, *, table: str | None = None, group: int | None = None) -> str: ...

    def next_site(self, site: str) -> str: ...

    def redirect_target(self, error: RaftStoreError, site: str) -> str | None: ...

    def remember_leader(self, site: str, *, table: str | None, group: int | None) -> None: ...

    def forget_leader(self, site: str, *, table: str | None, group: int | None) -> None: ...

    def after_failure(
        self,
        memory: AttemptState,
        target: str,
        error: RaftStoreError,
        backoff: Backoff,
        *,
        table: str | None,
        group: int | None,
        pinned: bool = False,
    ) -> Decision: ...

    def open_stream(
        self, site: str, method_name: str, request: Any, *, timeout_s: float | None = None
    ) -> Stream: ...

    def leader_watch(
        self,
        site: str,
        *,
        table: str | None = None,
        group: int | None = None,
        delay_s: float | None = None,
    ) -> LeaderWatch | None: ...

    def getTableInfo(self, tableName: str, *, deadline_s: float | None = None) -> TableInfo: ...

    def commit_offset(
        self, tableName: str, actionName: str, offset: int, *, deadline_s: float | None = None
    ) -> None: ...
