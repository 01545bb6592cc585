"""Serving a subscription: where it starts, and following the table as rows arrive.

A subscription is served by the group's leader only. It ends (with NotLeader) as soon as
the node loses leadership, so the subscriber reconnects to the new leader and resumes from
its last processed offset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Final

from hastream.errors import NodeUnavailable, OffsetOutOfRange, RaftStoreError, TableNotFound
from hastream.model import OFFSET_EARLIEST, OFFSET_LATEST, OFFSET_PERSISTED, topic_name
from raftstore import limits
from raftstore.group import Group
from raftstore.tables import RowSlice, TableStore

# How long a subscription waits for new rows before it re-checks leadership and liveness.
_WAIT_S: Final = 0.25


def resolve_start(group: Group, store: TableStore, action_name: str, offset: int) -> int:
    """The first offset to send. -2 with no persisted offset starts at the earliest retained
    row (the subscriber has never committed, so it has processed nothing)."""
    table = store.meta.table
    if offset == OFFSET_LATEST:
        return store.row_count
    if offset == OFFSET_EARLIEST:
        return store.earliest_offset
    if offset == OFFSET_PERSISTED:
        persisted = group.topic_offset(topic_name(table, action_name))
        start = store.earliest_offset if persisted is None else persisted + 1
        return max(start, store.earliest_offset)
    if offset < 0 or offset < store.earliest_offset or offset > store.row_count:
        raise OffsetOutOfRange(table, offset, store.earliest_offset, store.row_count)
    return offset


def follow(
    group: Group,
    store: TableStore,
    position: int,
    rows_max: int,
    is_active: Callable[[], bool],
) -> Iterator[list[RowSlice]]:
    """Yield lists of row slices from `position` on, waiting for new rows, until the client
    goes away; an empty list after SUBSCRIBE_HEARTBEAT_S without rows (a heartbeat). Raises
    NotLeader when leadership is lost, ReplicaInDoubt when this replica stops being
    trusted (it never sends a row from a replica in doubt), TableNotFound when dropped,
    NodeUnavailable when its files were reopened under it."""
    rows_max = min(rows_max or limits.SUBSCRIBE_BATCH_ROWS_MAX, limits.SUBSCRIBE_BATCH_ROWS_MAX)
    role = group.role
    epoch = role.epoch
    sent_at = time.monotonic()
    while is_active():
        if role.epoch != epoch or not group.is_leader():
            raise group.not_leader()
        group.require_serving()
        if store.closed:
            raise _closed_error(group, store)
        slices = store.read(position, store.row_count, rows_max)
        if slices:
            last = slices[-1]
            position = last.first_offset + last.row_count
            yield slices
            sent_at = time.monotonic()
            continue
        if time.monotonic() - sent_at >= limits.SUBSCRIBE_HEARTBEAT_S:
            yield []
            sent_at = time.monotonic()
            continue
        with store.changed:
            if store.row_count <= position and not store.closed and role.epoch == epoch:
                store.changed.wait(_WAIT_S)


def _closed_error(group: Group, store: TableStore) -> RaftStoreError:
    """Why the files a subscription follows were closed: the table was dropped
    (TableNotFound), or this incarnation's files were reopened under it (a repair swapping
    fetched rows in): NodeUnavailable, so the subscriber comes back and resumes."""
    table = store.meta.table
    try:
        held = group.table_view(table).meta.created_lsn == store.meta.created_lsn
    except TableNotFound:
        held = False
    if held:
        return NodeUnavailable(f"table {table!r}: its files were reopened here; subscribe again")
    return TableNotFound(table)
