"""The gRPC servicer: proto <-> model, exceptions <-> status. No business logic here.

A RaftStoreError becomes a gRPC status with the error's class name and fields in trailing
metadata (`errors.to_wire`), so the client rebuilds the same typed exception.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc
import pyarrow as pa

from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc
from raftstore import commands, limits
from raftstore.errors import (
    InvalidArgument,
    NodeUnavailable,
    NotLeader,
    RaftStoreError,
    TableExists,
    TableNotFound,
    TopicNotFound,
    UnknownGroup,
    to_wire,
)
from raftstore.group import Group
from raftstore.model import LOCAL_GROUP, topic_name
from raftstore.pipeline import PublishStream, publish_response
from raftstore.state_machine import TableView
from raftstore.subscriptions import follow, resolve_start
from raftstore.tables import RowSlice

log = logging.getLogger(__name__)

Response = TypeVar("Response")


class NodeView(Protocol):
    """What the servicer needs from the node."""

    alias: str

    def groups(self) -> list[Group]: ...

    def group(self, group_id: int) -> Group: ...

    def group_sites(self, group_id: int) -> list[str]: ...


def _abort(context: grpc.ServicerContext, error: RaftStoreError) -> None:
    context.set_trailing_metadata(to_wire(error))
    context.abort(getattr(grpc.StatusCode, error.grpc_code), str(error))


def unary(method: Callable[..., Response]) -> Callable[..., Response]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Response:
        try:
            return method(self, request, context)
        except RaftStoreError as error:
            _abort(context, error)
            raise AssertionError("unreachable: abort raises") from error

    return wrapper


def streaming(method: Callable[..., Iterator[Response]]) -> Callable[..., Iterator[Response]]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Response]:
        try:
            yield from method(self, request, context)
        except RaftStoreError as error:
            _abort(context, error)

    return wrapper


def _ipc_stream(slices: list[RowSlice]) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, slices[0].batch.schema) as writer:
        for rows in slices:
            writer.write_batch(rows.batch)
    payload: bytes = sink.getvalue().to_pybytes()
    return payload


def _messages(slices: list[RowSlice], table_row_count: int) -> Iterator[pb.RowBatch]:
    """Pack contiguous slices into messages under the byte limit."""
    group: list[RowSlice] = []
    size = 0
    for rows in slices:
        if group and size + rows.batch.nbytes > limits.SUBSCRIBE_BATCH_BYTES_MAX:
            yield _message(group, table_row_count)
            group, size = [], 0
        group.append(rows)
        size += rows.batch.nbytes
    if group:
        yield _message(group, table_row_count)


def _message(group: list[RowSlice], table_row_count: int) -> pb.RowBatch:
    return pb.RowBatch(
        first_offset=group[0].first_offset,
        row_count=sum(rows.batch.num_rows for rows in group),
        payload=_ipc_stream(group),
        table_row_count=table_row_count,
    )


def _rows_max(view: TableView, requested: int) -> int:
    rows = requested if requested > 0 else limits.SUBSCRIBE_BATCH_ROWS_MAX
    return min(rows, limits.SUBSCRIBE_BATCH_ROWS_MAX)


class StreamTableService(hastream_pb2_grpc.StreamTableServicer):
    def __init__(self, node: NodeView) -> None:
        self._node = node

    # --- routing ---

    def _group_of(self, table: str, *, leader_only: bool = False) -> Group:
        """The group holding `table` on this node.

        A node that leads (and has applied) a group knows that group's tables for sure, so
        it answers TableNotFound. A node that leads no group may simply not have applied a
        table's creation yet: for requests only a leader serves it sends the client on
        (NotLeader with the leader when it is in one group, else a retryable
        NodeUnavailable) instead of a wrong TableNotFound."""
        groups = self._node.groups()
        for group in groups:
            if group.has_table(table):
                return group
        raft_groups = [group for group in groups if group.group_id != LOCAL_GROUP]
        if (
            leader_only
            and raft_groups
            and not any(group.replica.is_leader_ready() for group in raft_groups)
        ):
            if len(raft_groups) == 1:
                leader = raft_groups[0].leader()
                if leader is not None and leader != raft_groups[0].settings.self_address:
                    raise NotLeader(str(leader), raft_groups[0].group_id)
            raise NodeUnavailable(f"table {table!r} unknown here and this node leads no group")
        raise TableNotFound(table)

    def _table_info(self, group: Group, view: TableView) -> pb.TableInfo:
        store = group.store(view.meta.table)
        return pb.TableInfo(
            table=view.meta.table,
            raft_group=group.group_id,
            schema_ipc=view.meta.schema_ipc,
            cache_limit=view.meta.cache_limit,
            key_column=view.meta.key_column or "",
            retention_minutes=view.meta.retention_minutes,
            row_count=store.row_count,
            earliest_offset=store.earliest_offset,
        )

    # --- tables ---

    @unary
    def HaStreamTable(self, request: pb.CreateTableRequest, context: Any) -> pb.TableInfo:
        group = self._node.group(request.raft_group)
        for other in self._node.groups():
            if other is not group and other.has_table(request.table):
                raise TableExists(request.table)
        command = commands.CreateTable(
            table=request.table,
            schema_ipc=request.schema_ipc,
            cache_limit=request.cache_limit,
            key_column=request.key_column or None,
            retention_minutes=request.retention_minutes or 1440,
        )
        view = group.create_table(command)
        log.info("created table group=%d table=%s", group.group_id, request.table)
        return self._table_info(group, view)

    @unary
    def DropStreamTable(self, request: pb.DropTableRequest, context: Any) -> pb.DropTableResponse:
        self._group_of(request.table, leader_only=True).drop_table(
            request.table, force=request.force
        )
        return pb.DropTableResponse(table=request.table)

    @unary
    def GetTableInfo(self, request: pb.TableRequest, context: Any) -> pb.TableInfo:
        group = self._group_of(request.table)
        return self._table_info(group, group.table_view(request.table))

    # --- data ---

    @unary
    def Publish(self, request: pb.PublishRequest, context: Any) -> pb.PublishResponse:
        if request.producer_id and len(request.producer_id) != 16:
            raise InvalidArgument("producer_id", "must be empty or exactly 16 bytes")
        item = commands.AppendItem(
            table=request.table,
            producer_id=request.producer_id,
            sequence=request.sequence,
            payload=request.payload,
        )
        lsn, result = self._group_of(request.table, leader_only=True).publish(item)
        return publish_response(lsn, result)

    @streaming
    def PublishStream(
        self, request_iterator: Iterator[pb.PublishBatch], context: Any
    ) -> Iterator[pb.PublishAcks]:
        stream = PublishStream(
            request_iterator,
            route=lambda table: self._group_of(table, leader_only=True),
            is_active=context.is_active,
        )
        try:
            yield from stream.responses()
        finally:
            stream.close()

    @streaming
    def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> Iterator[pb.RowBatch]:
        group = self._group_of(request.table, leader_only=True)
        group.require_leader()
        store = group.store(request.table)
        view = group.table_view(request.table)
        action = request.action_name or "default"
        position = resolve_start(group, store, action, request.offset)
        topic = topic_name(request.table, action)
        group.subscriber_opened(topic)
        log.info("subscription opened topic=%s offset=%d", topic, position)
        try:
            rows_max = _rows_max(view, request.batch_rows)
            for slices in follow(group, store, position, rows_max, context.is_active):
                if not slices:  # a heartbeat: no rows, the table's current length
                    yield pb.RowBatch(row_count=0, table_row_count=store.row_count)
                    continue
                yield from _messages(slices, store.row_count)
        finally:
            group.subscriber_closed(topic)
            log.info("subscription closed topic=%s", topic)

    @streaming
    def Read(self, request: pb.ReadRequest, context: Any) -> Iterator[pb.RowBatch]:
        group = self._group_of(request.table)
        store = group.store(request.table)
        view = group.table_view(request.table)
        end = store.row_count if request.offset_to < 0 else min(request.offset_to, store.row_count)
        if request.offset_from < store.earliest_offset or request.offset_from > end:
            from raftstore.errors import OffsetOutOfRange

            raise OffsetOutOfRange(request.table, request.offset_from, store.earliest_offset, end)
        position = request.offset_from
        rows_max = _rows_max(view, request.batch_rows)
        while position < end and context.is_active():
            slices = store.read(position, end, rows_max)
            if not slices:
                break
            yield from _messages(slices, store.row_count)
            position = slices[-1].first_offset + slices[-1].batch.num_rows

    @streaming
    def FetchRecords(
        self, request: pb.FetchRecordsRequest, context: Any
    ) -> Iterator[pb.DataRecord]:
        store = self._node.group(request.raft_group).store(request.table)
        end = min(request.offset_to, store.row_count)
        for record in store.records(request.offset_from, end):
            if record.first_offset >= end or not context.is_active():
                break
            yield pb.DataRecord(
                lsn=record.lsn,
                first_offset=record.first_offset,
                row_count=record.row_count,
                timestamp_ms=record.timestamp_ms,
                payload=bytes(record.payload),
            )

    # --- offsets ---

    @unary
    def CommitOffset(self, request: pb.CommitOffsetRequest, context: Any) -> pb.TopicOffset:
        topic = topic_name(request.table, request.action_name or "default")
        self._group_of(request.table, leader_only=True).commit_offset(topic, request.offset)
        return pb.TopicOffset(topic=topic, offset=request.offset)

    def _topic_group(self, topic: str) -> Group:
        table, _, action = topic.rpartition("/")
        if not table or not action:
            raise InvalidArgument("topic", f"{topic!r} is not 'table/actionName'")
        return self._group_of(table)

    @unary
    def GetTopicProcessedOffset(self, request: pb.TopicRequest, context: Any) -> pb.TopicOffset:
        offset = self._topic_group(request.topic).topic_offset(request.topic)
        if offset is None:
            raise TopicNotFound(request.topic)
        return pb.TopicOffset(topic=request.topic, offset=offset)

    @unary
    def RemoveTopicOffset(self, request: pb.TopicRequest, context: Any) -> pb.TopicOffset:
        group = self._topic_group(request.topic)
        offset = group.topic_offset(request.topic)
        group.remove_offset(request.topic)
        return pb.TopicOffset(topic=request.topic, offset=-1 if offset is None else offset)

    # --- admin ---

    @unary
    def GetStreamingLeader(self, request: pb.GroupRequest, context: Any) -> pb.LeaderInfo:
        if request.raft_group == LOCAL_GROUP:
            raise UnknownGroup(request.raft_group)
        leader = self._node.group(request.raft_group).leader()
        return pb.LeaderInfo(
            raft_group=request.raft_group, leader="" if leader is None else str(leader)
        )

    @unary
    def GetStreamingRaftGroups(self, request: pb.Empty, context: Any) -> pb.RaftGroups:
        groups = []
        for group in self._node.groups():
            if group.group_id == LOCAL_GROUP:
                continue
            leader = group.leader()
            groups.append(
                pb.RaftGroupInfo(
                    raft_group=group.group_id,
                    sites=self._node.group_sites(group.group_id),
                    leader="" if leader is None else str(leader),
                    tables=group.table_names(),
                )
            )
        return pb.RaftGroups(groups=groups)

    @unary
    def GetStreamingStat(self, request: pb.Empty, context: Any) -> pb.JsonDocument:
        return pb.JsonDocument(json=json.dumps(self._stat()))

    def _stat(self) -> dict[str, Any]:
        publish, subscriptions = [], []
        for group in self._node.groups():
            status = group.status()
            for table, stats in status["table_stats"].items():
                publish.append({"raft_group": group.group_id, "table": table, **stats})
            topics = group.topics()
            for topic, count in status["subscriptions"].items():
                table = topic.rpartition("/")[0]
                rows = status["table_stats"].get(table, {}).get("row_count", 0)
                offset = topics.get(topic, -1)
                subscriptions.append(
                    {
                        "topic": topic,
                        "connections": count,
                        "persisted_offset": offset,
                        "lag": rows - 1 - offset,
                    }
                )
        return {
            "alias": self._node.alias,
            "tables": publish,
            "subscriptions": subscriptions,
            "topics": {
                topic: o for group in self._node.groups() for topic, o in group.topics().items()
            },
            "groups": [self._group_status(group) for group in self._node.groups()],
        }

    def _group_status(self, group: Group) -> dict[str, Any]:
        status = group.status()
        status.pop("table_stats")
        return status

    @unary
    def GetNodeStatus(self, request: pb.Empty, context: Any) -> pb.JsonDocument:
        document = {
            "alias": self._node.alias,
            "groups": [self._group_status(group) for group in self._node.groups()],
        }
        return pb.JsonDocument(json=json.dumps(document))
