"""The gRPC servicer: proto <-> model, exceptions <-> status. No business logic here.

A RaftStoreError becomes a gRPC status with the error's class name and fields in trailing
metadata (`errors.to_wire`), so the client rebuilds the same typed exception.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import grpc
import pyarrow as pa
from grpc_health.v1 import health_pb2_grpc

from hastream.errors import (
    CorruptionError,
    InvalidArgument,
    NodeUnavailable,
    OffsetOutOfRange,
    RaftStoreError,
    ReplicaInDoubt,
    TableExists,
    TableNotFound,
    TooManyTables,
    TopicNotFound,
    Unauthenticated,
    UnknownGroup,
    shown,
    to_wire,
)
from hastream.model import LOCAL_GROUP, topic_name
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc
from raftstore import (
    access,
    commands,
    grpc_unary,
    limits,
    passwords,
    publish_wire,
    routing,
    trace,
)
from raftstore.admission import StreamSlots
from raftstore.auth import Authenticator, Principal
from raftstore.catalog import Catalog
from raftstore.config import ClusterConfig
from raftstore.digest import table_digest
from raftstore.group import Group, PendingPublish
from raftstore.log_limits import OncePerInterval
from raftstore.peer_auth import PeerVerifier
from raftstore.pipeline import PublishStream, StreamedPublish
from raftstore.replica import ConnectionHost
from raftstore.slow_consumers import SlowConsumers
from raftstore.state_machine import ItemResult, TableView
from raftstore.storage.segments import DataRecord
from raftstore.subscriptions import follow, resolve_start
from raftstore.tables import RowSlice, TableStore

log = logging.getLogger(__name__)

Response = TypeVar("Response")


class NodeView(Protocol):
    """What the servicer needs from the node."""

    alias: str
    catalog: Catalog
    cluster: ClusterConfig
    peer_verifier: PeerVerifier
    authenticator: Authenticator
    slow_consumers: SlowConsumers

    @property
    def publish_port(self) -> int: ...  # 0: none (publish_port.py)

    def groups(self) -> list[Group]: ...

    def ready(self) -> bool: ...

    def housekeeping_status(self) -> dict[str, Any]: ...

    def streaming_stat(self) -> dict[str, Any]: ...

    def group_statuses(self) -> list[dict[str, Any]]: ...

    def group(self, group_id: int) -> Group: ...

    def group_sites(self, group_id: int) -> list[str]: ...


def _abort(context: grpc.ServicerContext, error: RaftStoreError) -> None:
    context.set_trailing_metadata(to_wire(error))
    context.abort(getattr(grpc.StatusCode, error.grpc_code), str(error))


def _publish_answer(group: Group, pending: PendingPublish, started: float) -> pb.PublishResponse:
    """The answer to a unary Publish once its entry is applied: on the worker that waits
    for it, or deferred, on the thread that applied the entry. Raises its typed error."""
    lsn, result = group.publish_outcome(pending)
    tracer = trace.current()
    if tracer.on:
        tracer.answered(lsn, started, trace.clock())
    return publish_response(lsn, result)


@dataclass(frozen=True, slots=True)
class StartedPublish:
    """A unary publish handed to group commit: `future` completes once its entry is applied
    (on the thread that applied it); `answer()` then makes the response, or raises the
    publish's typed error (waiting for the future when called before)."""

    future: futures.Future[Any]
    answer: Callable[[], pb.PublishResponse]
    # The event loop of the group it went to (Group.connection_host), for the publish port.
    host: ConnectionHost | None = None


def begin_publish(
    node: NodeView,
    request: publish_wire.PublishView,
    metadata: Iterable[tuple[str, str | bytes]],
    *,
    wait: bool = True,
) -> StartedPublish:
    """Checks a unary publish (the caller's right to write, the producer id, this node's
    leadership, the rows) and hands it to group commit. Raises the typed error of a
    refused request, with nothing queued. For gRPC's Publish and the publish port
    (publish_port.py). Without `wait`, raises group.WouldWait where the leader would hold
    the request for a moment (`Group.require_leader`)."""
    node.authenticator.require("Publish", metadata, commands.Privilege.TABLE_WRITE, request.table)
    if request.producer_id and len(request.producer_id) != 16:
        raise InvalidArgument("producer_id", "must be empty or exactly 16 bytes")
    item = commands.AppendItem(
        table=request.table,
        producer_id=request.producer_id,
        sequence=request.sequence,
        payload=request.payload,
    )
    started = trace.clock()
    group = group_of(node, request.table, leader_only=True)
    pending = group.start_publish(item, wait=wait)
    return StartedPublish(
        pending.future,
        functools.partial(_publish_answer, group, pending, started),
        group.connection_host(),
    )


def _advertising(answer: Callable[[], pb.PublishResponse], port: int) -> pb.PublishResponse:
    response = answer()
    response.publish_port = port
    return response


def group_of(node: NodeView, table: str, *, leader_only: bool = False) -> Group:
    """The group of `table` on this node (routing.group_of). While the node still replays
    its log it cannot tell a table it has not replayed yet from one that does not exist: it
    says NodeUnavailable (retryable, the client asks elsewhere or again) instead of a
    TableNotFound a client would believe. A restarted node serves from its first moment,
    and a client that dials it at once (the publish port has no reconnect backoff) found
    its table "not found" there for a few tens of milliseconds."""
    try:
        return routing.group_of(
            node.groups(),
            table,
            leader_only=leader_only,
            owner_of=routing.owner_in(node.catalog.authoritative_claims),
        )
    except TableNotFound:
        if not node.ready():
            reason = f"table {table!r} unknown here while this node replays its log"
            raise NodeUnavailable(reason) from None
        raise


def _answering(context: grpc.ServicerContext, answer: Callable[[], Response]) -> Response:
    """`answer()`, its typed errors made the call's status and trailing metadata."""
    try:
        return answer()
    except RaftStoreError as error:
        _abort(context, error)
        raise AssertionError("unreachable: abort raises") from error


def unary(method: Callable[..., Response]) -> Callable[..., Response]:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Response:
        return _answering(context, functools.partial(method, self, request, context))

    return wrapper


def streaming(method: Callable[..., Iterator[Response]]) -> Callable[..., Iterator[Response]]:
    """A server-streaming or bidirectional method: it holds a stream slot (admission.py)
    while it runs, and its typed errors become statuses."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Response]:
        try:
            with self._streams.hold(context.peer()):
                yield from method(self, request, context)
        except RaftStoreError as error:
            _abort(context, error)

    return wrapper


def peer_only(method: Callable[..., Response]) -> Callable[..., Response]:
    """Refuse the call (Unauthenticated) unless a cluster node signed it (peer_auth.py).
    Goes under `unary`/`streaming`, which turn the refusal into the typed status."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Response:
        try:
            self._node.peer_verifier.verify(method.__name__, context.invocation_metadata())
        except Unauthenticated as refused:
            _log_refusal(context.peer(), refused)
            raise
        return method(self, request, context)

    return wrapper


_refusals = OncePerInterval()


def _log_refusal(peer: str, refused: Unauthenticated) -> None:
    events = _refusals.due()
    if events is not None:
        log.warning(
            "refused a peer-only call from %r: %s (%d refused since the last line)",
            peer,
            refused.reason,
            events,
        )


def _action_name(text: str) -> str:
    """A subscriber's action name (default "default"): bounded, without the topic separator
    and without control characters (it is logged: a newline would forge log lines).
    Raises InvalidArgument (a prefix of the name is echoed, escaped, never all of it)."""
    action = text or "default"
    size = len(action.encode())
    controls = any(ord(char) < 0x20 or ord(char) == 0x7F for char in action)
    if size > limits.ACTION_NAME_BYTES_MAX or "/" in action or controls:
        reason = (
            f"{shown(action)} ({size} bytes): want 1..{limits.ACTION_NAME_BYTES_MAX} bytes, "
            "no '/', no control characters"
        )
        raise InvalidArgument("action_name", reason)
    return action


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
        row_count=sum(rows.row_count for rows in group),
        payload=_ipc_stream(group),
        table_row_count=table_row_count,
        slice_offsets=[rows.first_offset for rows in group],
        slice_timestamps_ms=[rows.timestamp_ms for rows in group],
    )


# What one record adds to a DataRecords message beside its payload, at most: the field's
# tag and length, and in the DataRecord five tags, four int64 varints (10 bytes at most
# each) and the payload's length (5).
_RECORD_FRAMING_BYTES_MAX: Final = 1 + 5 + 5 + 4 * 10 + 5


def record_batches(records: Iterable[DataRecord]) -> Iterator[pb.DataRecords]:
    """`records` in order, packed into messages of at most FETCH_BATCH_BYTES_MAX encoded
    bytes each (counted with each record's largest framing, so the bound holds without
    asking protobuf for sizes); a record larger than that goes alone in its message."""
    message = pb.DataRecords()
    size = 0
    for record in records:
        record_size = len(record.payload) + _RECORD_FRAMING_BYTES_MAX
        if size and size + record_size > limits.FETCH_BATCH_BYTES_MAX:
            yield message
            message, size = pb.DataRecords(), 0
        message.records.append(_wire_record(record))
        size += record_size
    if size:
        yield message


def _wire_record(record: DataRecord) -> pb.DataRecord:
    return pb.DataRecord(
        lsn=record.lsn,
        first_offset=record.first_offset,
        row_count=record.row_count,
        timestamp_ms=record.timestamp_ms,
        payload=bytes(record.payload),
    )


def _rows_max(view: TableView, requested: int) -> int:
    rows = requested if requested > 0 else limits.SUBSCRIBE_BATCH_ROWS_MAX
    return min(rows, limits.SUBSCRIBE_BATCH_ROWS_MAX)


def publish_response(lsn: int, result: ItemResult, sequence: int = 0) -> pb.PublishResponse:
    """The answer to one committed publish (unary or pipelined)."""
    return pb.PublishResponse(
        lsn=lsn,
        first_offset=result.first_offset,
        row_count=result.row_count,
        duplicates=result.duplicates,
        duplicate_batch=result.duplicate_batch,
        sequence=sequence,
    )


def open_publish_stream(
    node: NodeView,
    metadata: Iterable[tuple[str, str | bytes]],
    messages: Iterator[list[StreamedPublish]],
    *,
    is_active: Callable[[], bool],
) -> PublishStream:
    """A PublishStream call of the caller `metadata` names (Unauthenticated otherwise),
    each table checked against its grants as its requests arrive. For gRPC's PublishStream
    and the publish port's streams (publish_port.py)."""
    authenticator = node.authenticator
    principal = authenticator.principal("PublishStream", metadata)

    def route(table: str) -> Group:
        authenticator.check(principal, commands.Privilege.TABLE_WRITE, table)
        return group_of(node, table, leader_only=True)

    return PublishStream(messages, route=route, is_active=is_active)


def publish_acks(stream: PublishStream) -> Iterator[pb.PublishAcks]:
    """The stream's answers as PublishAcks messages; raises the error that ends it."""
    for acks in stream.responses():
        yield pb.PublishAcks(
            responses=[publish_response(a.lsn, a.result, a.sequence) for a in acks]
        )


def streamed(requests: list[publish_wire.PublishView]) -> list[StreamedPublish]:
    """One PublishBatch's requests (read by publish_wire) as the domain's."""
    return [
        StreamedPublish(
            table=request.table,
            producer_id=request.producer_id,
            sequence=request.sequence,
            payload=request.payload,
        )
        for request in requests
    ]


def _streamed_publishes(
    messages: Iterator[list[publish_wire.PublishView]],
) -> Iterator[list[StreamedPublish]]:
    """The stream's requests (each message a PublishBatch read by publish_wire) as the
    domain's, message by message; ends when the client half-closes or the call ends under
    the reader (cancelled, aborted)."""
    try:
        for requests in messages:
            yield streamed(requests)
    except grpc.RpcError as error:
        log.debug("publish stream ended while reading error=%r", error)


@contextlib.contextmanager
def _reporting_damage(group: Group, store: TableStore) -> Iterator[None]:
    """A read that finds damage reports it, so the applier moves the table aside and
    repairs it from a peer. The reader is answered as any reader of a replica in doubt is:
    ReplicaInDoubt, retryable, so clients route around it (to a healthy replica), never a
    DATA_LOSS for rows the cluster still holds."""
    try:
        yield
    except CorruptionError as error:
        group.applier.report_damage(store.meta.table, store.meta.created_lsn, error.detail)
        reason = f"damage found in {store.meta.table} ({error}); repairing from a peer"
        raise ReplicaInDoubt(group.group_id, "repairing", reason) from error


def _subscription(
    group: Group, store: TableStore, position: int, rows_max: int, context: Any
) -> Iterator[pb.RowBatch]:
    with _reporting_damage(group, store):
        for slices in follow(group, store, position, rows_max, context.is_active):
            if not slices:  # a heartbeat: no rows, the table's current length
                yield pb.RowBatch(row_count=0, table_row_count=store.row_count)
                continue
            yield from _messages(slices, store.row_count)


class StreamTableService(hastream_pb2_grpc.StreamTableServicer):
    def __init__(self, node: NodeView) -> None:
        self._node = node
        self._streams = StreamSlots()

    # --- who calls (auth.py) ---

    def _principal(self, context: grpc.ServicerContext, method: str) -> Principal:
        return self._node.authenticator.principal(method, context.invocation_metadata())

    def _require(
        self, context: grpc.ServicerContext, method: str, privilege: commands.Privilege, table: str
    ) -> Principal:
        metadata = context.invocation_metadata()
        return self._node.authenticator.require(method, metadata, privilege, table)

    def _require_admin(self, context: grpc.ServicerContext, method: str) -> None:
        self._node.authenticator.require_admin(method, context.invocation_metadata())

    # --- routing ---

    def _group_of(self, table: str, *, leader_only: bool = False) -> Group:
        return group_of(self._node, table, leader_only=leader_only)

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
        self._require_admin(context, "HaStreamTable")
        group = self._node.group(request.raft_group)
        groups = self._node.groups()
        for other in groups:
            if other is not group and other.has_table(request.table):
                raise TableExists(request.table, other.group_id)
        tables = routing.table_count(groups)
        if tables >= self._node.cluster.tables_max:
            raise TooManyTables(request.table, tables, self._node.cluster.tables_max)
        command = commands.CreateTable(
            table=request.table,
            schema_ipc=request.schema_ipc,
            cache_limit=request.cache_limit,
            key_column=request.key_column or None,
            retention_minutes=request.retention_minutes or 1440,
        )
        if group.group_id == LOCAL_GROUP:  # node-local names: this node alone decides
            view = group.create_table(command)
        else:
            view = self._node.catalog.create(group, command)
        log.info("created table group=%d table=%s", group.group_id, request.table)
        return self._table_info(group, view)

    @unary
    def DropStreamTable(self, request: pb.DropTableRequest, context: Any) -> pb.DropTableResponse:
        self._require_admin(context, "DropStreamTable")
        group = self._group_of(request.table, leader_only=True)
        if group.group_id == LOCAL_GROUP:
            group.drop_table(request.table, force=request.force)
        else:
            self._node.catalog.drop(group, request.table, force=request.force)
        return pb.DropTableResponse(table=request.table)

    @unary
    def GetTableInfo(self, request: pb.TableRequest, context: Any) -> pb.TableInfo:
        # A writer learns the schema of what it may write (a Publisher asks first).
        self._node.authenticator.require(
            "GetTableInfo",
            context.invocation_metadata(),
            commands.Privilege.TABLE_READ,
            request.table,
            or_also=commands.Privilege.TABLE_WRITE,
        )
        group = self._group_of(request.table)
        return self._table_info(group, group.table_view(request.table))

    # --- data ---

    @unary
    def Publish(
        self, request: publish_wire.PublishView, context: Any
    ) -> pb.PublishResponse | grpc_unary.Deferred:
        started = begin_publish(self._node, request, context.invocation_metadata())
        answer = started.answer
        if port := self._node.publish_port:
            # Where this client's next waited publishes may go (api_clients/publish_port.py).
            answer = functools.partial(_advertising, answer, port)
        if grpc_unary.defers():
            # Answered by the thread that applies the entry (the Raft tick's): no wake-up
            # of this worker between the commit and the answer.
            return grpc_unary.Deferred(
                started.future, functools.partial(_answering, context, answer)
            )
        return answer()

    @streaming
    def PublishStream(
        self, request_iterator: Iterator[list[publish_wire.PublishView]], context: Any
    ) -> Iterator[pb.PublishAcks]:
        stream = open_publish_stream(
            self._node,
            context.invocation_metadata(),
            _streamed_publishes(request_iterator),
            is_active=context.is_active,
        )
        try:
            yield from publish_acks(stream)
        finally:
            stream.close()

    @streaming
    def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> Iterator[pb.RowBatch]:
        self._require(context, "Subscribe", commands.Privilege.TABLE_READ, request.table)
        action = _action_name(request.action_name)
        group = self._group_of(request.table, leader_only=True)
        group.require_leader()
        store = group.store(request.table)
        view = group.table_view(request.table)
        position = resolve_start(group, store, action, request.offset)
        topic = topic_name(request.table, action)
        group.subscriber_opened(topic)
        log.info("subscription opened topic=%s offset=%d", topic, position)
        try:
            rows_max = _rows_max(view, request.batch_rows)
            messages = _subscription(group, store, position, rows_max, context)
            yield from self._node.slow_consumers.watched(context, messages)
        finally:
            group.subscriber_closed(topic)
            log.info("subscription closed topic=%s", topic)

    @streaming
    def Read(self, request: pb.ReadRequest, context: Any) -> Iterator[pb.RowBatch]:
        self._require(context, "Read", commands.Privilege.TABLE_READ, request.table)
        # Up to the end that was acknowledged: only the leader knows it at once (a follower
        # learns the commit index with the next entry or a brought-forward heartbeat).
        at_leader = request.end_at_leader and request.offset_to < 0
        group = self._group_of(request.table, leader_only=at_leader)
        if at_leader:
            group.require_leader()
        store = group.store(request.table)
        view = group.table_view(request.table)
        if request.offset_from > store.row_count:
            # Past the rows this replica holds: a follower may only lag the acknowledged end
            # by the few ms until it learns the commit, a new leader may not have applied
            # its log yet. The leader, once ready, answers: the rows, or OffsetOutOfRange
            # past its end too (a follower answers NotLeader naming it).
            group.require_leader()
        end = store.row_count if request.offset_to < 0 else min(request.offset_to, store.row_count)
        if request.offset_from < store.earliest_offset or request.offset_from > end:
            raise OffsetOutOfRange(request.table, request.offset_from, store.earliest_offset, end)
        position = request.offset_from
        rows_max = _rows_max(view, request.batch_rows)
        with _reporting_damage(group, store):
            while position < end and context.is_active():
                slices = store.read(position, end, rows_max)
                if not slices:
                    break
                yield from _messages(slices, store.row_count)
                position = slices[-1].first_offset + slices[-1].row_count

    @unary
    def GetOffsetForTime(self, request: pb.OffsetForTimeRequest, context: Any) -> pb.OffsetForTime:
        self._require(context, "GetOffsetForTime", commands.Privilege.TABLE_READ, request.table)
        # The leader: a follower that lags would answer its own end for a time it has not
        # seen yet, and a subscription from there could begin before the time asked.
        group = self._group_of(request.table, leader_only=True)
        group.require_leader()
        store = group.store(request.table)
        end = store.row_count  # before the search: rows after it are newer than any before
        found = store.offset_for_time(request.timestamp_ms)
        if found is None:
            return pb.OffsetForTime(table=request.table, found=False, offset=end, timestamp_ms=-1)
        offset, stamp = found
        return pb.OffsetForTime(table=request.table, found=True, offset=offset, timestamp_ms=stamp)

    @streaming
    @peer_only
    def FetchRecords(
        self, request: pb.FetchRecordsRequest, context: Any
    ) -> Iterator[pb.DataRecord]:
        # Nodes of earlier versions ask this: one record per message.
        for record in self._fetched_records(request, context):
            yield _wire_record(record)

    @streaming
    @peer_only
    def FetchRecordBatches(
        self, request: pb.FetchRecordsRequest, context: Any
    ) -> Iterator[pb.DataRecords]:
        yield from record_batches(self._fetched_records(request, context))

    def _fetched_records(
        self, request: pb.FetchRecordsRequest, context: Any
    ) -> Iterator[DataRecord]:
        """The records FetchRecords and FetchRecordBatches send, until the caller leaves.
        Raises IncarnationDropped, TableNotFound, ReplicaInDoubt (this replica is in doubt,
        or the read found damage: reported, so the table is repaired)."""
        group = self._node.group(request.raft_group)
        if request.created_lsn:
            group.applier.check_incarnation(request.table, request.created_lsn)
        store = group.store(request.table)  # refused while this replica is in doubt
        if request.created_lsn and store.meta.created_lsn != request.created_lsn:
            raise TableNotFound(request.table)  # dropped and re-created since the check
        end = min(request.offset_to, store.row_count)
        with _reporting_damage(group, store):
            for record in store.records(request.offset_from, end):
                if record.first_offset >= end or not context.is_active():
                    break
                yield record

    # --- offsets ---

    @unary
    def CommitOffset(self, request: pb.CommitOffsetRequest, context: Any) -> pb.TopicOffset:
        self._require(context, "CommitOffset", commands.Privilege.TABLE_READ, request.table)
        topic = topic_name(request.table, _action_name(request.action_name))
        self._group_of(request.table, leader_only=True).commit_offset(topic, request.offset)
        return pb.TopicOffset(topic=topic, offset=request.offset)

    def _topic_group(self, topic: str) -> Group:
        table, _, action = topic.rpartition("/")
        if not table or not action:
            raise InvalidArgument("topic", f"{topic!r} is not 'table/actionName'")
        return self._group_of(table)

    @unary
    def GetTopicProcessedOffset(self, request: pb.TopicRequest, context: Any) -> pb.TopicOffset:
        table = request.topic.rpartition("/")[0]
        self._require(context, "GetTopicProcessedOffset", commands.Privilege.TABLE_READ, table)
        offset = self._topic_group(request.topic).topic_offset(request.topic)
        if offset is None:
            raise TopicNotFound(request.topic)
        return pb.TopicOffset(topic=request.topic, offset=offset)

    @unary
    def RemoveTopicOffset(self, request: pb.TopicRequest, context: Any) -> pb.TopicOffset:
        self._require_admin(context, "RemoveTopicOffset")
        group = self._topic_group(request.topic)
        offset = group.topic_offset(request.topic)
        group.remove_offset(request.topic)
        return pb.TopicOffset(topic=request.topic, offset=-1 if offset is None else offset)

    # --- admin ---

    @unary
    def GetStreamingLeader(self, request: pb.GroupRequest, context: Any) -> pb.LeaderInfo:
        # No login needed: who leads is operational status (as GetNodeStatus and the
        # metrics port), which health checks and operators' tools read without a user.
        if request.raft_group == LOCAL_GROUP:
            raise UnknownGroup(request.raft_group)
        leader = self._node.group(request.raft_group).leader()
        return pb.LeaderInfo(
            raft_group=request.raft_group, leader="" if leader is None else str(leader)
        )

    @unary
    def GetStreamingRaftGroups(self, request: pb.Empty, context: Any) -> pb.RaftGroups:
        self._principal(context, "GetStreamingRaftGroups")
        raft_groups = [g for g in self._node.groups() if g.group_id != LOCAL_GROUP]
        tables = routing.one_group_per_name(
            {group.group_id: group.table_names() for group in raft_groups},
            routing.owner_in(self._node.catalog.authoritative_claims),
        )
        groups = []
        for group in raft_groups:
            leader = group.leader()
            groups.append(
                pb.RaftGroupInfo(
                    raft_group=group.group_id,
                    sites=self._node.group_sites(group.group_id),
                    leader="" if leader is None else str(leader),
                    tables=tables[group.group_id],
                )
            )
        return pb.RaftGroups(groups=groups)

    @unary
    def GetStreamingStat(self, request: pb.Empty, context: Any) -> pb.JsonDocument:
        self._principal(context, "GetStreamingStat")
        return pb.JsonDocument(json=json.dumps(self._node.streaming_stat()))

    @unary
    def TransferLeadership(
        self, request: pb.TransferLeadershipRequest, context: Any
    ) -> pb.LeaderInfo:
        self._require_admin(context, "TransferLeadership")
        if request.raft_group == LOCAL_GROUP:
            raise UnknownGroup(request.raft_group)
        group = self._node.group(request.raft_group)
        timeout_s = request.timeout_s or limits.TRANSFER_TIMEOUT_S_DEFAULT
        if not 0 < timeout_s <= limits.TRANSFER_TIMEOUT_S_MAX:
            reason = f"must be in (0, {limits.TRANSFER_TIMEOUT_S_MAX}] seconds"
            raise InvalidArgument("timeout_s", reason)
        leader = group.transfer_leadership(request.to_node or None, timeout_s)
        return pb.LeaderInfo(raft_group=group.group_id, leader=str(leader))

    # --- peers: the catalog of table names ---

    @unary
    @peer_only
    def ClaimTableName(self, request: pb.NameClaim, context: Any) -> pb.Empty:
        self._node.catalog.serve_claim(request.table, request.raft_group, request.nonce)
        return pb.Empty()

    @unary
    @peer_only
    def ReleaseTableName(self, request: pb.NameClaim, context: Any) -> pb.Empty:
        self._node.catalog.serve_release(request.table, request.raft_group, request.nonce)
        return pb.Empty()

    @unary
    @peer_only
    def GetTableClaims(self, request: pb.GroupRequest, context: Any) -> pb.NameClaims:
        claims = self._node.catalog.serve_claims()
        return pb.NameClaims(
            claims=[
                pb.NameClaim(table=table, raft_group=group_id, nonce=nonce)
                for table, (group_id, nonce) in sorted(claims.items())
            ]
        )

    # --- peers: replicas compare themselves ---

    @unary
    @peer_only
    def GetTableDigest(self, request: pb.TableDigestRequest, context: Any) -> pb.TableDigest:
        group = self._node.group(request.raft_group)
        store = group.store(request.table)  # refused while this replica is in doubt
        with _reporting_damage(group, store):
            found = table_digest(store, request.offset_from, request.offset_to)
        return pb.TableDigest(
            offset_from=found.offset_from,
            offset_to=found.offset_to,
            records=found.records,
            digest=found.digest,
            earliest_offset=found.earliest_offset,
            row_count=found.row_count,
        )

    @unary
    @peer_only
    def RepairTable(self, request: pb.RepairTableRequest, context: Any) -> pb.Empty:
        group = self._node.group(request.raft_group)
        view = group.table_view(request.table)
        log.error(
            "asked to repair group=%d table=%s reason=%s",
            request.raft_group,
            request.table,
            request.reason[:200],
        )
        group.applier.report_damage(request.table, view.meta.created_lsn, request.reason[:200])
        return pb.Empty()

    @unary
    def GetNodeStatus(self, request: pb.Empty, context: Any) -> pb.JsonDocument:
        # No login needed (see GetStreamingLeader): roles, indexes, health, no table data.
        document = {
            "alias": self._node.alias,
            "ready": self._node.ready(),
            "groups": self._node.group_statuses(),
            "streams_open": self._streams.open,
            "slow_consumers_disconnected": self._node.slow_consumers.disconnected,
            **self._node.housekeeping_status(),
        }
        return pb.JsonDocument(json=json.dumps(document))

    # --- users and grants ---

    @unary
    def Login(self, request: pb.LoginRequest, context: Any) -> pb.LoginResponse:
        authenticator = self._node.authenticator
        if not authenticator.enabled:  # authentication=off: everyone acts as an admin
            return pb.LoginResponse(token="", expires_ms=0, admin=True)
        token, expires_ms, admin = authenticator.login(request.userid, request.password)
        return pb.LoginResponse(token=token, expires_ms=expires_ms, admin=admin)

    @unary
    def ManageAccess(self, request: pb.AccessRequest, context: Any) -> pb.Empty:
        self._require_admin(context, "ManageAccess")
        command = _access_command(request)
        self._node.catalog.change_access(command)
        log.info(
            "access changed operation=%s user=%s",
            pb.AccessRequest.Operation.Name(request.operation),
            request.userid,
        )
        return pb.Empty()

    @unary
    def GetAccess(self, request: pb.Empty, context: Any) -> pb.JsonDocument:
        self._require_admin(context, "GetAccess")
        users = self._node.catalog.access_control().describe()
        document = {"authentication": self._node.authenticator.enabled, "users": users}
        return pb.JsonDocument(json=json.dumps(document))

    @unary
    @peer_only
    def GetAccessControl(self, request: pb.GroupRequest, context: Any) -> pb.JsonDocument:
        return pb.JsonDocument(json=json.dumps(self._node.catalog.serve_access()))


_RULE_EFFECTS: Final = {
    pb.AccessRequest.GRANT: commands.RuleEffect.GRANT,
    pb.AccessRequest.DENY: commands.RuleEffect.DENY,
    pb.AccessRequest.REVOKE: commands.RuleEffect.REVOKE,
}
# A password an admin sets for a user: at least this long.
PASSWORD_CHARS_MIN: Final = 8


def _access_command(request: pb.AccessRequest) -> commands.Command:
    """The catalog command of an access request; the password is hashed here (the log only
    ever holds the hash). Raises InvalidArgument naming the bad field."""
    user = access.check_user_name(request.userid)
    operation = request.operation
    if operation in (pb.AccessRequest.CREATE_USER, pb.AccessRequest.RESET_PASSWORD):
        passwords.check_password(request.password, chars_min=PASSWORD_CHARS_MIN)
        mode = (
            commands.UserMode.CREATE
            if operation == pb.AccessRequest.CREATE_USER
            else commands.UserMode.RESET
        )
        password_hash = passwords.hash_password(request.password)
        return commands.PutUser(user, password_hash, request.admin, mode)
    if operation == pb.AccessRequest.DELETE_USER:
        return commands.DeleteUser(user)
    effect = _RULE_EFFECTS.get(operation)
    if effect is None:
        raise InvalidArgument("operation", f"unknown access operation {operation}")
    try:
        privilege = commands.Privilege[request.privilege]
    except KeyError:
        names = [p.name for p in commands.Privilege]
        raise InvalidArgument("privilege", f"{request.privilege!r}: want one of {names}") from None
    return commands.SetRule(user, privilege, access.check_rule_table(request.table), effect)


# Every stream holds a worker while it lasts: the streams' share plus the unary calls'.
GRPC_WORKERS: Final = limits.STREAMS_MAX + limits.UNARY_WORKERS


class _PublishViews(grpc.ServerInterceptor):
    """Publish and PublishStream requests are read by `publish_wire` (the payload a view of
    the received bytes) instead of protobuf's parser, which copies it twice. The handlers
    are the generated ones with only their request deserializer replaced."""

    _PARSERS: Final = {
        "/hastream.v1.StreamTable/Publish": publish_wire.parse_publish,
        "/hastream.v1.StreamTable/PublishStream": publish_wire.parse_publish_batch,
    }

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        parser = self._PARSERS.get(handler_call_details.method)
        if parser is None or handler is None:
            return handler
        return handler._replace(request_deserializer=parser)


def start_server(
    node: NodeView,
    address: str,
    *,
    health: Any = None,
    credentials: grpc.ServerCredentials | None = None,
) -> grpc.Server:
    """Serve the StreamTable service of `node` on `address` ("host:port"), and `health`
    (a grpc.health.v1 HealthServicer) beside it when given; over TLS with `credentials`.
    Raises OSError when the port cannot be bound."""
    grpc_unary.install()  # a unary request is taken in by the serving thread (one hand-off)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=GRPC_WORKERS, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_receive_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
            ("grpc.max_send_message_length", limits.GRPC_MESSAGE_BYTES_MAX),
            ("grpc.so_reuseport", 0),
            # Let clients probe idle streams (a subscriber must notice a frozen leader).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 2_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        maximum_concurrent_rpcs=limits.NODE_CALLS_MAX,  # past it: Overloaded at the client
        interceptors=[_PublishViews()],
    )
    hastream_pb2_grpc.add_StreamTableServicer_to_server(StreamTableService(node), server)
    if health is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = (
        server.add_insecure_port(address)
        if credentials is None
        else server.add_secure_port(address, credentials)
    )
    if bound == 0:
        raise OSError(f"cannot bind gRPC port {address}")
    server.start()
    return server
