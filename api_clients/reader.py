"""Reading a bounded range of rows `[offset_from, offset_to)` (for example one Spark
micro-batch), resuming where a failed stream stopped, bounded by a deadline.

Any node answers a Read, but a follower may lag behind the leader and end the range early,
so a read with an explicit `offset_to` is only complete when every row up to it arrived:
a short stream is retried (at the leader if known, else the next site) from the next
missing offset.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc
import pyarrow as pa

from api_clients import batches
from api_clients.connection import rebuild_error
from proto import hastream_pb2
from raftstore import limits
from raftstore.errors import InvalidArgument, NodeUnavailable, RaftStoreError

if TYPE_CHECKING:
    from api_clients.connection import Session

log = logging.getLogger(__name__)


def read_range(
    session: Session,
    table: str,
    offset_from: int,
    offset_to: int = -1,
    *,
    batch_rows: int = 0,
    deadline_s: float | None = None,
) -> pa.Table:
    """The rows `[offset_from, offset_to)` of `table` (`offset_to=-1`: up to the end the
    answering node knows). Raises the last error when the deadline passes before the range
    is complete, and non-retryable errors (OffsetOutOfRange, TableNotFound) at once."""
    if offset_from < 0 or (offset_to >= 0 and offset_to < offset_from):
        raise InvalidArgument("offset", f"bad range [{offset_from}, {offset_to})")
    if not 0 <= batch_rows <= limits.SUBSCRIBE_BATCH_ROWS_MAX:
        raise InvalidArgument("batch_rows", f"must be in [0, {limits.SUBSCRIBE_BATCH_ROWS_MAX}]")
    backoff = session.new_backoff(deadline_s)
    site = session.route(table=table)
    parts: list[pa.Table] = []
    position = offset_from
    while offset_to < 0 or position < offset_to:  # Bounded: every retry takes a wait.
        request = hastream_pb2.ReadRequest(
            table=table, offset_from=position, offset_to=offset_to, batch_rows=batch_rows
        )
        try:
            for rows in _read_stream(session, site, request, backoff.remaining_s()):
                parts.append(rows)
                position += rows.num_rows
        except grpc.RpcError as rpc_error:
            error = rebuild_error(rpc_error, site)
            if error is None:
                raise
            if not error.retryable:
                raise error from None
            reason: RaftStoreError = error
        else:
            if offset_to < 0 or position >= offset_to:
                break
            reason = NodeUnavailable(f"{site}: read ended at {position} before {offset_to}")
        log.debug(
            "read retry table=%s site=%s position=%d reason=%s", table, site, position, reason
        )
        hint = session.redirect_target(reason, site)
        if not backoff.wait():
            raise reason
        site = hint if hint is not None else session.next_site(site)
    if not parts:
        return session.getTableInfo(table).schema.empty_table()
    return pa.concat_tables(parts)


def _read_stream(
    session: Session, site: str, request: hastream_pb2.ReadRequest, timeout_s: float
) -> Iterator[pa.Table]:
    """The stream's rows, message by message, checked to be contiguous from
    `request.offset_from`. Rows before a failure stay with the caller: a retry starts after."""
    position = request.offset_from
    for message in session.open_stream(site, "Read", request, timeout_s=timeout_s):
        if message.first_offset != position:
            raise InvalidArgument(
                "first_offset", f"read expected offset {position}, got {message.first_offset}"
            )
        rows = batches.decode(message.payload)
        if rows.num_rows != message.row_count:
            raise InvalidArgument("payload", f"row_count={message.row_count}, got {rows.num_rows}")
        position += rows.num_rows
        yield rows
