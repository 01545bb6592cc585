"""The cluster calls the Spark readers, writers and the offset listener share.

A leaf of `spark_publisher/` (source.py, sink.py and listener.py import it; it imports none
of them): every call goes through the process's cached `api_clients.Session`
(`clients.session`), so nothing here is stored on an object Spark pickles.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

from api_clients import OffsetForTime, TableInfo
from spark_publisher import clients
from spark_publisher.options import HAStreamOptions

# Calls made while planning a micro-batch (latestOffset, commit) give up sooner than data
# calls: a trigger that finds the cluster electing a leader just sees "no new data".
PLANNING_TIMEOUT_S: Final = 10.0
# How long a read or a write keeps retrying a TableNotFound (a table created a moment ago
# that the node asked has not applied yet) before it believes it.
TABLE_NOT_FOUND_RETRY_S: Final = 15.0


def table_info(options: HAStreamOptions, *, fresh: bool = False) -> TableInfo:
    """The table's schema, row count and earliest retained row. Raises TableNotFound at once
    for an unknown table.

    Any node answers, and a follower's row count may lag the leader's by the rows it has not
    applied yet (every row it counts is committed, so a lagging count is safe, only late).
    With `fresh`, the count is asked of the group's leader (falling back to any node during
    an election), so a read planned right after an acknowledged write sees that write.
    """
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    info = client.getTableInfo(options.table)
    if not fresh:
        return info
    # The session routes a table's calls to its group's leader once it knows it.
    if client.getStreamingLeader(info.raft_group):
        return client.getTableInfo(options.table)
    return info


def publish_schema(options: HAStreamOptions) -> pa.Schema:
    """The table's schema, for a task about to publish to it, and its group's leader known
    to the session, so the publishes go straight to it. One call once the process's session
    knows the leader (a reused Python worker keeps it across tasks): the table's info, asked
    of that leader. Raises TableNotFound at once for an unknown table."""
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    info = client.getTableInfo(options.table)
    if client.group_leader(info.raft_group) is None:
        client.getStreamingLeader(info.raft_group)
    return info.schema


def offset_for_time(options: HAStreamOptions, timestamp_ms: int) -> OffsetForTime:
    """The first retained row stamped at or after `timestamp_ms` (asked of the leader)."""
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    return client.offsetForTime(options.table, timestamp_ms)


def commit_offset(options: HAStreamOptions, offset: int, timeout_s: float) -> None:
    """Persists `offset` (the last processed row) as the action's offset, through Raft on
    the table's leader. Raises the cluster's typed errors."""
    client = clients.session(options.sites, options.timeout_s, options.tls, options.login)
    client.commit_offset(options.table, options.action, offset, deadline_s=timeout_s)
