"""Reading a bounded range of rows `[offset_from, offset_to)` (for example one Spark
micro-batch), resuming where a failed stream stopped, bounded by a deadline.

Any node answers a Read with an explicit `offset_to`, but a follower may lag behind the
leader and end the range early, so such a read is only complete when every row up to it
arrived: a short stream is retried (at the leader if known, else the next site) from the
next missing offset. A read up to the end (`offset_to=-1`) is the leader's: it ends where
the acknowledged rows end (a follower learns of them a few ms later), and a follower
answers it with NotLeader naming the leader, which is followed at once. A stream that goes
silent past the session's hedge delay while the other sites agree on a leader is left for
it (`hedge.StreamGuard`), and resumed there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa

from api_clients import batches, times
from api_clients.call_policy import AttemptState
from api_clients.hedge import StreamGuard
from api_clients.transport import StreamBroken
from api_clients.types import StreamOpener
from hastream import wire
from hastream.errors import InvalidArgument, RaftStoreError
from proto import hastream_pb2

log = logging.getLogger(__name__)


def read_range(
    session: StreamOpener,
    table: str,
    offset_from: int,
    offset_to: int = -1,
    *,
    batch_rows: int = 0,
    deadline_s: float | None = None,
    include_metadata: bool = False,
) -> pa.Table:
    """The rows `[offset_from, offset_to)` of `table` (`offset_to=-1`: up to the end at the
    table's leader), with `include_metadata` also each row's offset and ingest time
    (`times.with_metadata`). Raises the last error when the deadline passes before the
    range is complete, and non-retryable errors (OffsetOutOfRange) at once; TableNotFound once
    every known site said so (a follower may not have applied the table's creation yet)."""
    if offset_from < 0 or (offset_to >= 0 and offset_to < offset_from):
        raise InvalidArgument("offset", f"bad range [{offset_from}, {offset_to})")
    if not 0 <= batch_rows <= wire.SUBSCRIBE_BATCH_ROWS_MAX:
        raise InvalidArgument("batch_rows", f"must be in [0, {wire.SUBSCRIBE_BATCH_ROWS_MAX}]")
    backoff = session.new_backoff(deadline_s)
    site = session.route(table=table)
    parts: list[pa.Table] = []
    position = offset_from
    # Where each retry goes is Session.call's step (Session.after_failure): TableNotFound is
    # believed once every known site said so, the first NotLeader hint is followed at once.
    memory = AttemptState(target=site, sites=(), time_left=True, table_lookup=True)
    while offset_to < 0 or position < offset_to:  # Bounded: every retry takes a wait.
        request = hastream_pb2.ReadRequest(
            table=table,
            offset_from=position,
            offset_to=offset_to,
            batch_rows=batch_rows,
            end_at_leader=offset_to < 0,
        )
        try:
            stream = _read_stream(session, site, request, backoff.remaining_s(), include_metadata)
            for rows in stream:
                parts.append(rows)
                position += rows.num_rows
        except RaftStoreError as error:
            reason: RaftStoreError = error
        else:
            if offset_to < 0:
                session.remember_leader(site, table=table, group=None)
                break
            if position >= offset_to:
                break
            reason = StreamBroken(site, f"the read ended at {position} before {offset_to}")
        decision = session.after_failure(memory, site, reason, backoff, table=table, group=None)
        if decision.target is None or (decision.backoff and not backoff.wait()):
            raise reason
        memory, site = decision.state, decision.target
    if not parts:
        schema = session.getTableInfo(table).schema
        if include_metadata:
            schema = pa.schema([*schema, *times.METADATA_FIELDS], metadata=schema.metadata)
        return schema.empty_table()
    return pa.concat_tables(parts)


def _read_stream(
    session: StreamOpener,
    site: str,
    request: hastream_pb2.ReadRequest,
    timeout_s: float,
    include_metadata: bool,
) -> Iterator[pa.Table]:
    """The stream's rows, message by message, checked to be contiguous from
    `request.offset_from`. Rows before a failure stay with the caller: a retry starts after."""
    position = request.offset_from
    stream = session.open_stream(site, "Read", request, timeout_s=timeout_s)
    watch = session.leader_watch(site, table=request.table)
    guard = StreamGuard(watch, stream.cancel) if watch is not None else None
    try:
        for message in stream:
            if guard is not None:
                guard.heard()
            if message.first_offset != position:
                raise InvalidArgument(
                    "first_offset", f"read expected offset {position}, got {message.first_offset}"
                )
            rows = batches.decode(message.payload)
            if rows.num_rows != message.row_count:
                raise InvalidArgument(
                    "payload", f"row_count={message.row_count}, got {rows.num_rows}"
                )
            if include_metadata:
                rows = times.with_metadata(
                    rows,
                    message.first_offset,
                    list(message.slice_offsets),
                    list(message.slice_timestamps_ms),
                )
            position += rows.num_rows
            yield rows
    except RaftStoreError:
        if guard is not None and guard.moved is not None:
            raise guard.moved from None  # a silent node left for the leader the others name
        raise
    finally:
        if guard is not None:
            guard.close()
