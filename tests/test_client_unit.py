"""Unit tests of `api_clients/`: backoff with a fake clock, and leader following, retries,
validation, idempotency tokens and subscriber resume against real in-process gRPC servers
running a small scriptable fake node (real-cluster tests live elsewhere)."""

from __future__ import annotations

import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pandas as pd
import pyarrow as pa
import pytest

from api_clients import Publisher, Session, batches, connect, parse_site
from api_clients.admin import schema_to_ipc
from api_clients.retry import Backoff
from proto import hastream_pb2, hastream_pb2_grpc
from raftstore import errors

pytestmark = pytest.mark.unit

SCHEMA = pa.schema([("id", pa.int64()), ("price", pa.float64()), ("sym", pa.string())])
TABLE = "ticks"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Polls `predicate` until it holds; fails the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        threading.Event().wait(0.01)


def rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table(
        {"id": ids, "price": [float(i) / 2 for i in ids], "sym": [f"s{i}" for i in ids]},
        schema=SCHEMA,
    )


# -- backoff -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_backoff_delays_grow_exponentially_and_cap_at_max() -> None:
    clock = FakeClock()
    backoff = Backoff(0.05, 1.0, 60.0, jitter=0.0, clock=clock, sleep=clock.sleep)
    for _ in range(7):
        assert backoff.wait()
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_backoff_jitter_stays_within_bounds_and_varies() -> None:
    clock = FakeClock()
    fractions = iter([0.0, 0.999, 0.5, 0.25] * 5)
    backoff = Backoff(
        0.1,
        0.4,
        60.0,
        jitter=0.5,
        clock=clock,
        sleep=clock.sleep,
        random_fraction=lambda: next(fractions),
    )
    bases = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]
    for _ in bases:
        assert backoff.wait()
    for delay, base in zip(clock.sleeps, bases, strict=True):
        assert base * 0.5 <= delay <= base
    assert len(set(clock.sleeps[2:])) > 1  # Jitter spreads equal bases apart.


def test_backoff_wait_ends_at_the_deadline() -> None:
    clock = FakeClock()
    backoff = Backoff(0.05, 1.0, 2.0, jitter=0.0, clock=clock, sleep=clock.sleep)
    waits = 0
    while backoff.wait():
        waits += 1
        assert waits < 100
    assert sum(clock.sleeps) == pytest.approx(2.0)
    assert backoff.remaining_s() == 0
    assert not backoff.wait()
    assert len(clock.sleeps) == waits + 1  # The last wait slept only to the deadline.


def test_backoff_wait_ends_after_retries_max() -> None:
    clock = FakeClock()
    backoff = Backoff(0.01, 0.01, 60.0, retries_max=3, clock=clock, sleep=clock.sleep)
    assert [backoff.wait() for _ in range(5)] == [True, True, True, False, False]
    assert len(clock.sleeps) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": 0.0},
        {"initial_s": 2.0, "max_s": 1.0},
        {"deadline_s": -1.0},
        {"jitter": 1.5},
        {"retries_max": 0},
        {"multiplier": 0.5},
    ],
)
def test_backoff_refuses_unbounded_or_bad_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        Backoff(**kwargs)


# -- a scriptable fake node on a real gRPC server ------------------------------------


def abort(context: grpc.ServicerContext, error: errors.RaftStoreError) -> None:
    """Fails the RPC the way the real service does: status + typed trailing metadata."""
    context.set_trailing_metadata(errors.to_wire(error))
    context.abort(grpc.StatusCode[error.grpc_code], str(error))


class FakeNode(hastream_pb2_grpc.StreamTableServicer):
    """Holds one table in memory. `leader_hint` set: a follower that answers NotLeader.
    `errors[method]`: errors raised, in order, by the next calls of that method.
    `lose_acks`: Publish calls that apply the rows and then fail UNAVAILABLE.
    `subscribe_scripts`: generators run, in order, by the next Subscribe calls.
    `read_scripts`: how the next Read calls end early."""

    def __init__(self) -> None:
        self.address = ""
        self.lock = threading.Lock()
        self.requests: dict[str, list[Any]] = defaultdict(list)
        self.errors: dict[str, list[errors.RaftStoreError]] = defaultdict(list)
        self.leader_hint: str | None = None
        self.follower = False
        self.lose_acks = 0
        self.table = SCHEMA.empty_table()
        self.producers: dict[bytes, tuple[int, hastream_pb2.PublishResponse]] = {}
        self.subscribe_scripts: list[Callable[..., Iterator[hastream_pb2.RowBatch]]] = []
        # Read calls: (rows served at most, error raised after them or None).
        self.read_scripts: list[tuple[int, errors.RaftStoreError | None]] = []

    def calls(self, method: str) -> list[Any]:
        with self.lock:
            return list(self.requests[method])

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests[method].append(request)
            pending = self.errors[method].pop(0) if self.errors[method] else None
        if self.follower:
            abort(context, errors.NotLeader(self.leader_hint, 2))
        if pending is not None:
            abort(context, pending)

    def GetTableInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("GetTableInfo", request, context)
        return hastream_pb2.TableInfo(
            table=request.table,
            raft_group=2,
            schema_ipc=schema_to_ipc(SCHEMA),
            cache_limit=1000,
            row_count=self.table.num_rows,
        )

    def GetStreamingLeader(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("GetStreamingLeader", request, context)
        return hastream_pb2.LeaderInfo(raft_group=request.raft_group, leader=self.address)

    def Publish(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("Publish", request, context)
        with self.lock:
            last = self.producers.get(request.producer_id)
            if last is not None and request.sequence <= last[0]:
                response = hastream_pb2.PublishResponse()
                response.CopyFrom(last[1])
                response.duplicate_batch = True
                return response
            batch = batches.decode(request.payload)
            response = hastream_pb2.PublishResponse(
                first_offset=self.table.num_rows, row_count=batch.num_rows, lsn=len(self.producers)
            )
            self.table = pa.concat_tables([self.table, batch])
            self.producers[request.producer_id] = (request.sequence, response)
            lose_ack = self.lose_acks > 0
            self.lose_acks -= int(lose_ack)
        if lose_ack:
            context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (ack lost)")
        return response

    def Read(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._enter("Read", request, context)
        end = self.table.num_rows if request.offset_to < 0 else request.offset_to
        with self.lock:
            rows_max, error = self.read_scripts.pop(0) if self.read_scripts else (end, None)
        stop = min(end, request.offset_from + rows_max)
        yield from row_batches(self, request.offset_from, stop, per_message=4)
        if error is not None:
            abort(context, error)

    def CommitOffset(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("CommitOffset", request, context)
        topic = f"{request.table}/{request.action_name}"
        return hastream_pb2.TopicOffset(topic=topic, offset=request.offset)

    def Subscribe(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._enter("Subscribe", request, context)
        with self.lock:
            script = self.subscribe_scripts.pop(0) if self.subscribe_scripts else serve_rows
        yield from script(self, request, context)


def row_batches(node: FakeNode, offset: int, end: int, per_message: int) -> Iterator[Any]:
    for first in range(offset, end, per_message):
        part = node.table.slice(first, min(per_message, end - first))
        yield hastream_pb2.RowBatch(
            first_offset=first,
            row_count=part.num_rows,
            payload=batches.encode(part),
            table_row_count=node.table.num_rows,
        )


def serve_rows(node: FakeNode, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
    """Sends the table from the requested offset, then holds the stream open until the
    client cancels (bounded, so a broken test cannot hang the server)."""
    offset = node.table.num_rows if request.offset == -1 else max(request.offset, 0)
    yield from row_batches(node, offset, node.table.num_rows, per_message=3)
    cancelled = threading.Event()
    context.add_callback(cancelled.set)
    cancelled.wait(timeout=10.0)


@pytest.fixture
def start_node() -> Iterator[Callable[[], FakeNode]]:
    servers: list[grpc.Server] = []

    def start() -> FakeNode:
        node = FakeNode()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        hastream_pb2_grpc.add_StreamTableServicer_to_server(node, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        node.address = f"127.0.0.1:{port}:node{len(servers) + 1}"
        servers.append(server)
        return node

    yield start
    for server in servers:
        server.stop(grace=None)


def site(node: FakeNode) -> str:
    return parse_site(node.address)


def dead_site() -> str:
    """A loopback port with nothing listening: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def make_session(*sites: str, deadline_s: float = 5.0) -> Session:
    return Session(list(sites), deadline_s=deadline_s, backoff_initial_s=0.01, backoff_max_s=0.05)


# -- sites and connect ---------------------------------------------------------------


def test_parse_site_drops_alias_and_refuses_garbage() -> None:
    assert parse_site("10.0.0.1:8902:node2") == "10.0.0.1:8902"
    assert parse_site(" localhost:8901 ") == "localhost:8901"
    for bad in ["localhost", "host:port", ":8901", "h:70000", "a:1:b:c"]:
        with pytest.raises(errors.InvalidArgument):
            parse_site(bad)


def test_connect_puts_the_named_node_first_then_the_ha_sites() -> None:
    session = connect("h1", 1, "admin", "secret", highAvailabilitySites=["h2:2:n2", "h1:1"])
    assert session.sites == ["h1:1", "h2:2"]
    session.close()


# -- leader following ----------------------------------------------------------------


def test_not_leader_redirects_to_hinted_site_and_remembers_it(
    start_node: Callable[[], FakeNode],
) -> None:
    leader, follower = start_node(), start_node()
    follower.follower, follower.leader_hint = True, leader.address
    with make_session(site(follower)) as session:
        info = session.getTableInfo(TABLE)
        assert info.schema == SCHEMA
        assert site(leader) in session.sites
        session.getTableInfo(TABLE)
    assert len(follower.calls("GetTableInfo")) == 1  # The second call went straight there.
    assert len(leader.calls("GetTableInfo")) == 2


def test_not_leader_without_hint_tries_next_site(start_node: Callable[[], FakeNode]) -> None:
    leader, electing = start_node(), start_node()
    electing.follower = True
    with make_session(site(electing), site(leader)) as session:
        assert session.getTableInfo(TABLE).raft_group == 2
    assert len(electing.calls("GetTableInfo")) == 1


def test_unavailable_site_is_skipped_for_the_next_site(
    start_node: Callable[[], FakeNode],
) -> None:
    leader = start_node()
    with make_session(dead_site(), site(leader)) as session:
        assert session.getTableInfo(TABLE).table == TABLE


def test_retryable_typed_error_tries_again_until_it_succeeds(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.errors["GetTableInfo"] = [errors.LeadershipLost("test"), errors.NodeUnavailable("boot")]
    with make_session(site(node)) as session:
        assert session.getTableInfo(TABLE).table == TABLE
    assert len(node.calls("GetTableInfo")) == 3


def test_call_raises_last_error_when_deadline_passes(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    node.errors["GetTableInfo"] = [errors.NodeUnavailable("catching up")] * 1000
    started = time.monotonic()
    with (
        make_session(site(node), dead_site(), deadline_s=0.5) as session,
        pytest.raises(errors.NodeUnavailable),
    ):
        session.getTableInfo(TABLE)
    assert time.monotonic() - started < 3.0
    assert len(node.calls("GetTableInfo")) >= 2  # It did retry, within the deadline.


def test_non_retryable_typed_error_is_raised_at_once(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    node.errors["Publish"] = [errors.SchemaMismatch(TABLE, "column price is int32")]
    with make_session(site(node)) as session:
        with pytest.raises(errors.SchemaMismatch) as raised:
            Publisher(session, TABLE).append(rows(0, 2))
        assert raised.value.detail == "column price is int32"
    assert len(node.calls("Publish")) == 1


def test_overloaded_leader_is_retried_not_left(start_node: Callable[[], FakeNode]) -> None:
    leader, other = start_node(), start_node()
    leader.errors["Publish"] = [errors.Overloaded("publish", 10)]
    with make_session(site(leader), site(other)) as session:
        assert Publisher(session, TABLE).append(rows(0, 1)).row_count == 1
    assert len(leader.calls("Publish")) == 2
    assert other.calls("Publish") == []


def test_publish_redirect_remembers_the_table_leader(start_node: Callable[[], FakeNode]) -> None:
    leader, follower = start_node(), start_node()
    follower.follower, follower.leader_hint = True, leader.address
    with make_session(site(follower)) as session:
        publisher = Publisher(session, TABLE)
        publisher.append(rows(0, 1))
        assert session.route(table=TABLE) == site(leader)
        assert session.route(group=2) == site(leader)
        publisher.append(rows(1, 1))
    assert len(leader.calls("Publish")) == 2
    assert leader.table.num_rows == 2


def test_get_streaming_leader_learns_the_leader_site(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    with make_session(site(node)) as session:
        assert session.getStreamingLeader(2) == node.address
        assert session.route(group=2) == site(node)


# -- publisher -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (pd.DataFrame({"id": [1], "price": [1.0]}), errors.SchemaMismatch),
        (pd.DataFrame({"id": [1], "cost": [1.0], "sym": ["a"]}), errors.SchemaMismatch),
        (pd.DataFrame({"id": ["x"], "price": [1.0], "sym": ["a"]}), errors.SchemaMismatch),
        (pd.DataFrame({"id": [1], "price": [1.0], "sym": ["a"], "x": [2]}), errors.SchemaMismatch),
        (pd.DataFrame({"id": [], "price": [], "sym": []}), errors.EmptyBatch),
    ],
)
def test_publisher_refuses_bad_dataframe_before_any_publish(
    start_node: Callable[[], FakeNode], frame: pd.DataFrame, error: type[Exception]
) -> None:
    node = start_node()
    with make_session(site(node)) as session, pytest.raises(error):
        Publisher(session, TABLE).append(frame)
    assert node.calls("Publish") == []


def test_publisher_refuses_arrow_table_with_wrong_types() -> None:
    wrong = pa.table({"id": pa.array([1], pa.int32()), "price": [1.0], "sym": ["a"]})
    with pytest.raises(errors.SchemaMismatch, match="'id' has type int32"):
        batches.to_table(wrong, SCHEMA, TABLE)


def test_publisher_input_forms_convert_to_the_same_table() -> None:
    expected = rows(0, 2)
    forms: list[object] = [
        expected.to_pandas(),
        expected,
        expected.to_batches()[0],
        [(0, 0.0, "s0"), (1, 0.5, "s1")],
        [{"id": 0, "price": 0.0, "sym": "s0"}, {"sym": "s1", "price": 0.5, "id": 1}],
    ]
    for data in forms:
        table = batches.to_table(data, SCHEMA, TABLE)
        assert table.equals(expected)
        assert table.schema.metadata is None  # pandas metadata stripped: the exact schema.


def test_publisher_reuses_idempotency_token_on_retry(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    node.lose_acks = 1  # The first attempt is committed but its answer is lost.
    with make_session(site(node)) as session:
        publisher = Publisher(session, TABLE)
        result = publisher.append(rows(0, 5))
        publisher.append(rows(5, 1))
    first, retry, second = node.calls("Publish")
    assert (retry.producer_id, retry.sequence) == (first.producer_id, first.sequence)
    assert len(first.producer_id) == 16
    assert second.sequence == first.sequence + 1
    assert result.duplicate_batch
    assert (result.first_offset, result.row_count) == (0, 5)
    assert node.table.num_rows == 6  # Not appended twice.


def test_publisher_splits_data_over_the_byte_limit(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    data = rows(0, 2000)
    bytes_max = len(batches.encode(data)) // 5
    with make_session(site(node)) as session:
        result = Publisher(session, TABLE, batch_bytes_max=bytes_max).append(data)
    requests = node.calls("Publish")
    assert len(requests) > 1
    assert all(len(request.payload) <= bytes_max for request in requests)
    assert [request.sequence for request in requests] == list(range(1, len(requests) + 1))
    assert (result.first_offset, result.row_count, len(result.parts)) == (0, 2000, len(requests))
    assert node.table.equals(data)


def test_single_row_over_the_byte_limit_raises_batch_too_large() -> None:
    table = batches.to_table([(1, 1.0, "x" * 5000)], SCHEMA, TABLE)
    with pytest.raises(errors.BatchTooLarge) as raised:
        batches.encode_chunks(table, bytes_max=1000)
    assert raised.value.size_max == 1000


# -- subscriber ----------------------------------------------------------------------


class Collector:
    """A subscription handler that records what it was given."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[int, int]] = []  # (first_offset, rows)
        self.ids: list[int] = []

    def __call__(self, table: pa.Table, first_offset: int) -> None:
        with self.lock:
            self.calls.append((first_offset, table.num_rows))
            self.ids.extend(table.column("id").to_pylist())

    def seen(self) -> list[int]:
        with self.lock:
            return list(self.ids)


def fail_after(count: int, error: errors.RaftStoreError) -> Callable[..., Iterator[Any]]:
    """A Subscribe script: serves `count` rows from the requested offset, then fails."""

    def script(node: FakeNode, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from row_batches(node, request.offset, request.offset + count, per_message=2)
        abort(context, error)

    return script


def test_subscriber_reconnect_resumes_at_last_processed_offset_plus_one(
    start_node: Callable[[], FakeNode],
) -> None:
    old_leader, new_leader = start_node(), start_node()
    for node in (old_leader, new_leader):
        node.table = rows(0, 10)
    old_leader.subscribe_scripts = [fail_after(5, errors.NotLeader(new_leader.address, 2))]
    handler = Collector()
    with make_session(site(old_leader)) as session:
        subscription = session.subscribe(TABLE, handler, offset=0, actionName="a1", throttle=0.0)
        wait_until(lambda: handler.seen() == list(range(10)))
        assert subscription.processed_offset == 9
        subscription.stop()
        assert not subscription.is_alive()
        assert subscription.error is None
    assert [request.offset for request in new_leader.calls("Subscribe")] == [5]
    assert new_leader.calls("CommitOffset")[-1].offset == 9
    assert subscription.connections == 2


def test_subscriber_does_not_hand_over_rows_twice_when_resent(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 6)

    def resend_from_zero(node: FakeNode, request: Any, context: Any) -> Iterator[Any]:
        yield from serve_rows(node, hastream_pb2.SubscribeRequest(offset=0), context)

    node.subscribe_scripts = [fail_after(4, errors.LeadershipLost("test")), resend_from_zero]
    handler = Collector()
    with make_session(site(node)) as session:
        subscription = session.subscribe(TABLE, handler, offset=0, persistOffset=False)
        wait_until(lambda: subscription.processed_offset == 5)
    assert handler.seen() == list(range(6))
    assert node.calls("CommitOffset") == []


def test_subscriber_from_latest_resumes_at_row_count_when_nothing_processed(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 3)
    node.subscribe_scripts = [fail_after(0, errors.LeadershipLost("test"))]
    with make_session(site(node)) as session:
        subscription = session.subscribe(TABLE, Collector(), offset=-1)
        wait_until(lambda: len(node.calls("Subscribe")) == 2)
        subscription.stop()
    # Rows appended while it was disconnected are not skipped: it resumes at the row count
    # the table had when it subscribed.
    assert [request.offset for request in node.calls("Subscribe")] == [-1, 3]


def test_subscriber_with_msg_as_table_false_hands_over_row_dicts(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 2)
    received: list[tuple[list[dict[str, Any]], int]] = []
    with make_session(site(node)) as session:
        subscription = session.subscribe(
            TABLE, lambda batch, first: received.append((batch, first)), offset=0, msgAsTable=False
        )
        wait_until(lambda: subscription.processed_offset == 1)
    assert received == [
        ([{"id": 0, "price": 0.0, "sym": "s0"}, {"id": 1, "price": 0.5, "sym": "s1"}], 0)
    ]


def test_subscriber_without_reconnect_surfaces_the_error(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 4)
    node.subscribe_scripts = [fail_after(4, errors.NodeUnavailable("shutting down"))]
    handler = Collector()
    with make_session(site(node)) as session:
        subscription = session.subscribe(TABLE, handler, offset=0, reconnect=False)
        wait_until(lambda: not subscription.is_alive())
        assert isinstance(subscription.error, errors.NodeUnavailable)
        assert subscription.processed_offset == 3
        assert subscription.committed_offset == 3  # Committed when it ended.
    assert len(node.calls("Subscribe")) == 1


def test_subscriber_non_retryable_error_ends_it_even_with_reconnect(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.errors["Subscribe"] = [errors.TableNotFound(TABLE)]
    with make_session(site(node)) as session:
        subscription = session.subscribe(TABLE, Collector(), offset=0)
        wait_until(lambda: not subscription.is_alive())
        assert isinstance(subscription.error, errors.TableNotFound)


def test_subscriber_batches_rows_and_applies_the_filter(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 12)
    handler = Collector()
    with make_session(site(node)) as session:
        subscription = session.subscribe(
            TABLE,
            handler,
            offset=0,
            batchSize=6,
            throttle=30.0,
            filter=lambda table: pa.compute.equal(pa.compute.bit_wise_and(table["id"], 1), 0),
        )
        wait_until(lambda: subscription.processed_offset == 11)
        subscription.stop()
    assert handler.seen() == [0, 2, 4, 6, 8, 10]
    assert handler.calls == [(0, 3), (6, 3)]  # Two flushes of 6 rows, filtered to 3 each.


def test_subscriber_handler_error_ends_subscription_without_committing_it(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    node.table = rows(0, 3)

    def failing_handler(table: pa.Table, first_offset: int) -> None:
        raise RuntimeError("handler bug")

    with make_session(site(node)) as session:
        subscription = session.subscribe(TABLE, failing_handler, offset=0)
        wait_until(lambda: not subscription.is_alive())
        assert isinstance(subscription.error, RuntimeError)
        assert subscription.processed_offset == -1
    assert node.calls("CommitOffset") == []


def test_unsubscribe_stops_and_allows_a_new_subscription(
    start_node: Callable[[], FakeNode],
) -> None:
    node = start_node()
    with make_session(site(node)) as session:
        first = session.subscribe(TABLE, Collector(), actionName="x")
        with pytest.raises(errors.InvalidArgument):
            session.subscribe(TABLE, Collector(), actionName="x")
        session.unsubscribe(TABLE, "x")
        assert not first.is_alive()
        second = session.subscribe(TABLE, Collector(), actionName="x")
        assert second.is_alive()
    assert not second.is_alive()  # close() stops subscriptions.


# -- bounded reads -------------------------------------------------------------------


def test_read_resumes_after_a_failed_stream_and_a_lagging_node(
    start_node: Callable[[], FakeNode],
) -> None:
    lagging, leader = start_node(), start_node()
    for node in (lagging, leader):
        node.table = rows(0, 30)
    # The first node ends 5 rows short, like a follower that lags; the next fails after 10
    # rows; the first, asked again, serves the rest.
    lagging.read_scripts = [(5, None)]
    leader.read_scripts = [(10, errors.NodeUnavailable("stopping"))]
    with make_session(site(lagging), site(leader)) as session:
        table = session.read(TABLE, 2, 28)
    assert table.equals(rows(0, 30).slice(2, 26))
    assert [request.offset_from for request in lagging.calls("Read")] == [2, 17]
    assert [request.offset_from for request in leader.calls("Read")] == [7]


def test_read_of_an_empty_range_returns_an_empty_table(start_node: Callable[[], FakeNode]) -> None:
    node = start_node()
    with make_session(site(node)) as session:
        assert session.read(TABLE, 5, 5).schema == SCHEMA
    assert node.calls("Read") == []
