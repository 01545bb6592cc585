"""Publishing rows to a stream table, safely retried.

Every request carries an idempotency token: the Publisher's random 16-byte `producer_id`
and a `sequence` that grows by one per request. A retry resends the *same* request, so if
the first attempt was committed but its answer lost, the leader answers the retry from its
producer window (`duplicate_batch=True`) instead of appending the rows twice.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import pyarrow as pa

from api_clients import batches
from proto import hastream_pb2
from raftstore import limits
from raftstore.errors import InvalidArgument, SchemaMismatch

if TYPE_CHECKING:
    from api_clients.connection import Session

log = logging.getLogger(__name__)

PRODUCER_ID_BYTES: Final = 16


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


class Publisher:
    """Appends rows to `tableName` through `session`, following its leader.

    `producer_id` (16 bytes) defaults to a random one. Pass a stable id derived from, for
    example, a Spark query, partition and epoch, to make a *re-run* of the same appends in
    the same order deduplicated too: the sequence restarts at `first_sequence`.

    Threads: appends through one Publisher are serialized (sequences must reach the leader
    in order); use one Publisher per thread for parallel publishing.
    """

    def __init__(
        self,
        session: Session,
        tableName: str,
        *,
        producer_id: bytes | None = None,
        first_sequence: int = 1,
        batch_bytes_max: int = limits.BATCH_BYTES_MAX,
        deadline_s: float | None = None,
    ) -> None:
        if producer_id is not None and len(producer_id) != PRODUCER_ID_BYTES:
            raise InvalidArgument("producer_id", f"must be {PRODUCER_ID_BYTES} bytes")
        if first_sequence < 1:
            raise InvalidArgument("first_sequence", f"must be >= 1, got {first_sequence}")
        if not 0 < batch_bytes_max <= limits.BATCH_BYTES_MAX:
            raise InvalidArgument("batch_bytes_max", f"must be in (0, {limits.BATCH_BYTES_MAX}]")
        self._session = session
        self._table = tableName
        self._producer_id = producer_id or secrets.token_bytes(PRODUCER_ID_BYTES)
        self._next_sequence = first_sequence
        self._batch_bytes_max = batch_bytes_max
        self._deadline_s = deadline_s
        self._schema: pa.Schema | None = None
        self._lock = threading.Lock()

    @property
    def table_name(self) -> str:
        return self._table

    @property
    def producer_id(self) -> bytes:
        return self._producer_id

    @property
    def next_sequence(self) -> int:
        """The sequence the next request will carry."""
        with self._lock:
            return self._next_sequence

    def schema(self) -> pa.Schema:
        """The table's schema, fetched once from the cluster."""
        with self._lock:
            return self._table_schema()

    def _table_schema(self) -> pa.Schema:
        if self._schema is None:
            self._schema = self._session.getTableInfo(self._table).schema
        return self._schema

    def append(self, data: object) -> AppendResult:
        """Appends `data` (a pandas DataFrame, a pyarrow Table or RecordBatch, or a list of
        row tuples or dicts) and returns the committed offsets.

        All validation happens before any row is sent: SchemaMismatch (column count, names,
        types, nulls in non-nullable columns), EmptyBatch, BatchTooLarge (one row alone over
        the batch byte limit). Data over the limit is split into several requests. Errors
        of the cluster are raised typed (see `Session.call`); if a split append fails
        part-way, the parts before the failed one are committed.
        """
        with self._lock:
            schema = self._table_schema()
            table = batches.to_table(data, schema, self._table)
            chunks = batches.encode_chunks(table, bytes_max=self._batch_bytes_max)
            results = [self._publish(chunk) for chunk in chunks]
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

    def _publish(self, chunk: batches.EncodedChunk) -> AppendResult:
        sequence = self._next_sequence
        self._next_sequence += 1
        request = hastream_pb2.PublishRequest(
            table=self._table,
            payload=chunk.payload,
            producer_id=self._producer_id,
            sequence=sequence,
        )
        try:
            response = self._session.call(
                "Publish", request, table=self._table, deadline_s=self._deadline_s
            )
        except SchemaMismatch:
            self._schema = None  # The table may have been re-created: fetch it again next time.
            raise
        log.debug(
            "published table=%s sequence=%d rows=%d first_offset=%d",
            self._table,
            sequence,
            response.row_count,
            response.first_offset,
        )
        return AppendResult(
            first_offset=response.first_offset,
            row_count=response.row_count,
            duplicates=response.duplicates,
            lsn=response.lsn,
            duplicate_batch=response.duplicate_batch,
        )
