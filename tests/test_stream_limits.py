"""Bounds a client cannot push a node past: held streams (counted apart from unary calls,
per node and per connection), action names, persisted topics. Each refusal is typed and
changes nothing; publishes keep flowing while the stream slots are full."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from api_clients import Session, transport
from api_clients.transport import typed_error
from hastream.errors import Overloaded, SlowConsumer, TooManyTopics
from hastream.wire import NODE_CALLS_MAX, NODE_CALLS_REFUSED_DETAILS
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc
from raftstore import limits
from raftstore.admission import StreamSlots
from raftstore.slow_consumers import SlowConsumers
from raftstore.threads import Threads
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    assert_replicas_hold_exactly,
    ipc_stream,
    wait_until,
)
from tests.shell import Shell, raises

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("sym", pa.string())])

# The call-limit test's publish refused past the limit: a key no held publish has.
REFUSED_KEY = 1_000_000


@pytest.mark.unit
def test_stream_slots_bound_the_node_and_each_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "STREAMS_MAX", 3)
    monkeypatch.setattr(limits, "STREAMS_PER_CONNECTION_MAX", 2)
    slots = StreamSlots()
    with slots.hold("a"), slots.hold("a"):
        with pytest.raises(Overloaded, match="one connection"), slots.hold("a"):
            pass
        with slots.hold("b"):
            assert slots.open == 3
            with pytest.raises(Overloaded, match="streams is full"), slots.hold("c"):
                pass
    assert slots.open == 0
    with slots.hold("a"), slots.hold("a"):  # released slots are free again
        pass


@pytest.mark.storage
def test_a_new_topic_past_the_group_limit_is_refused_before_anything_is_proposed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "TOPICS_PER_GROUP_MAX", 3)
    shell = Shell(tmp_path).start()
    try:
        shell.create("t", SCHEMA)
        for action in ("a", "b", "c"):
            shell.g.commit_offset(f"t/{action}", 1)
        applied = shell.g.applier.status()["lsn_applied"]
        refused = raises(shell.g.commit_offset, "t/d", 1)
        assert isinstance(refused, TooManyTopics)
        assert (refused.topic, refused.topics_max) == ("t/d", 3)
        assert shell.g.applier.status()["lsn_applied"] == applied
        shell.g.commit_offset("t/a", 2)  # a known topic moves on
        shell.g.remove_offset("t/b")
        shell.g.commit_offset("t/d", 1)  # room again
    finally:
        shell.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("limits") / "cluster")
    cluster.start()
    cluster.create_table("held", SCHEMA)
    yield cluster
    cluster.stop()


def _error(raised: Any) -> tuple[str, dict[str, Any]]:
    metadata = dict(raised.trailing_metadata() or ())
    return metadata.get("hastream-error", ""), json.loads(
        metadata.get("hastream-error-fields", "{}")
    )


def pb_stub(channel: grpc.Channel) -> Any:
    return hastream_pb2_grpc.StreamTableStub(channel)


def _streams_open(cluster: LocalCluster, alias: str) -> int:
    return int(cluster.status(alias)["streams_open"])


@pytest.mark.cluster
def test_held_streams_are_bounded_and_never_stop_publishes(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    site = cluster.nodes[leader].site
    request = pb.SubscribeRequest(table="held", action_name="idle", offset=-1)
    # Channels of one process share a connection unless told otherwise.
    separate = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(site, options=separate) for _ in range(3)]
    calls: list[Any] = []
    try:
        # One connection: up to STREAMS_PER_CONNECTION_MAX.
        first = pb_stub(channels[0])
        calls += [first.Subscribe(request) for _ in range(limits.STREAMS_PER_CONNECTION_MAX)]
        wait_until(
            lambda: _streams_open(cluster, leader) == limits.STREAMS_PER_CONNECTION_MAX,
            timeout_s=60,
            message="streams of one connection admitted",
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(first.Subscribe(request))
        name, fields = _error(refused.value)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (name, fields["queue"]) == ("Overloaded", "streams of one connection")
        # Other connections: up to STREAMS_MAX in all.
        rest = limits.STREAMS_MAX - limits.STREAMS_PER_CONNECTION_MAX
        for index in range(rest):
            calls.append(pb_stub(channels[1 + index % 2]).Subscribe(request))
        wait_until(
            lambda: _streams_open(cluster, leader) == limits.STREAMS_MAX,
            timeout_s=60,
            message=f"every stream slot held ({_streams_open(cluster, leader)} open)",
        )
        with (
            grpc.insecure_channel(site, options=separate) as fresh,
            pytest.raises(grpc.RpcError) as refused,
        ):
            next(pb_stub(fresh).Subscribe(request))
        name, fields = _error(refused.value)
        assert (name, fields) == ("Overloaded", {"queue": "streams", "limit": limits.STREAMS_MAX})
        # Unary calls have workers of their own: publishes and status go on.
        publisher = AckedPublisher(cluster, "held", SCHEMA)
        publishers = [
            threading.Thread(target=publisher.publish, args=(key, 100))
            for key in range(0, 2000, 100)
        ]
        for thread in publishers:
            thread.start()
        for thread in publishers:
            thread.join(timeout=60)
        assert len(publisher.acked) == 2000
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
    wait_until(lambda: _streams_open(cluster, leader) == 0, timeout_s=60, message="released")


@pytest.mark.cluster
def test_oversized_action_names_are_refused_and_change_nothing(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    stub = cluster.stub(leader)
    before = cluster.group_status(leader, 2)["commit_index"]
    # Too long, the topic separator, a forged log line.
    for action in ("x" * 60_000, "a/b", "ok\n2026-11-24 INFO raftstore.node forged line"):
        with pytest.raises(grpc.RpcError) as refused:
            stub.CommitOffset(
                pb.CommitOffsetRequest(table="held", action_name=action, offset=1), timeout=10
            )
        name, fields = _error(refused.value)
        assert name == "InvalidArgument"
        assert fields["argument"] == "action_name"
        assert len(fields["detail"]) < 200  # the name is not echoed whole
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Subscribe(pb.SubscribeRequest(table="held", action_name=action)))
        assert _error(refused.value)[0] == "InvalidArgument"
    assert cluster.group_status(leader, 2)["commit_index"] == before


class _Context:
    def __init__(self) -> None:
        self.cancelled = 0

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def cancel(self) -> None:
        self.cancelled += 1


@pytest.mark.unit
def test_a_send_waiting_past_the_timeout_cancels_its_stream_once() -> None:
    now = [0.0]
    consumers = SlowConsumers(5.0, spawn=Threads().start, clock=lambda: now[0])
    context = _Context()
    stream = consumers.watched(context, iter(["a", "b"]))  # type: ignore[arg-type]
    assert next(stream) == "a"  # "a" is being sent until the next step
    now[0] = 4.0
    consumers.check()
    assert context.cancelled == 0
    now[0] = 6.0
    consumers.check()
    consumers.check()
    assert (context.cancelled, consumers.disconnected) == (1, 1)
    assert next(stream) == "b"  # a later send starts its own clock
    now[0] = 8.0
    consumers.check()
    assert context.cancelled == 1


STALLED_SUBSCRIBERS = 50


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.cluster
def test_subscribers_that_read_nothing_are_disconnected_and_cost_bounded_memory(
    tmp_path: Path,
) -> None:
    """50 subscribers that never read while 1 MB publishes go on: publishes keep flowing,
    the leader's memory stays bounded (gRPC flow control: one message and the windows per
    stream), and each subscriber is ended with a SlowConsumer its client can act on."""
    cluster = LocalCluster(tmp_path / "cluster", extra_config=("streamingSlowConsumerTimeout=2",))
    cluster.start()
    try:
        cluster.create_table("flood", SCHEMA)
        leader = cluster.leader()
        site = cluster.nodes[leader].site
        rss_before = _rss_mib(cluster.pid(leader))
        separate = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
        channels = [
            grpc.insecure_channel(site, options=separate) for _ in range(STALLED_SUBSCRIBERS)
        ]
        stalled = [
            hastream_pb2_grpc.StreamTableStub(channel).Subscribe(
                pb.SubscribeRequest(table="flood", action_name=f"stalled{index}", offset=0)
            )
            for index, channel in enumerate(channels)
        ]
        wait_until(
            lambda: cluster.status(leader)["streams_open"] >= STALLED_SUBSCRIBERS,
            timeout_s=30,
            message="every stalled subscription open",
        )
        rows = pa.table(
            {
                "id": pa.array(range(1000), pa.int64()),
                "ts": pa.array([0] * 1000, pa.timestamp("ms")),
                "sym": ["x" * 1000] * 1000,
            },
            schema=SCHEMA,
        )
        request = pb.PublishRequest(table="flood", payload=ipc_stream(rows))
        published = 0
        rss_peak = rss_before

        def all_disconnected() -> bool:
            nonlocal published, rss_peak
            # Publishes keep flowing while no subscriber reads (1 MB each).
            cluster.stub(leader).Publish(request, timeout=15)
            published += 1
            rss_peak = max(rss_peak, _rss_mib(cluster.pid(leader)))
            disconnected = cluster.status(leader)["slow_consumers_disconnected"]
            return bool(disconnected >= STALLED_SUBSCRIBERS)

        wait_until(all_disconnected, timeout_s=120, message="every slow consumer disconnected")
        assert published >= 5
        assert rss_peak - rss_before < 600, (rss_before, rss_peak)
        ended = 0
        for call in stalled:
            with pytest.raises(grpc.RpcError) as error:
                for _ in call:
                    pass
            typed = typed_error(error.value, site, None)
            assert isinstance(typed, SlowConsumer), typed
            assert typed.retryable  # its subscriber resubscribes from its offset
            ended += 1
        assert ended == STALLED_SUBSCRIBERS
        for channel in channels:
            channel.close()
        wait_until(lambda: cluster.status(leader)["streams_open"] == 0, timeout_s=10)
    finally:
        cluster.stop()


@pytest.mark.cluster
def test_a_call_past_the_nodes_call_limit_is_overloaded_and_retried(tmp_path: Path) -> None:
    """gRPC refuses a call past a node's maximum_concurrent_rpcs (NODE_CALLS_MAX) before
    any handler runs, with its own RESOURCE_EXHAUSTED and none of the node's typed metadata.
    The client raises Overloaded, retryable, the refused call changes nothing, and a Session
    call retries the busy node until calls there end. The node is filled with publishes that
    wait for a quorum: both followers are stopped (a long election timeout keeps the leader
    from falling back meanwhile), then resumed."""
    cluster = LocalCluster(tmp_path / "cluster", election_timeout_s=5.0)
    cluster.start()
    try:
        cluster.create_table("calls", SCHEMA, key_column="id")
        leader = cluster.leader()
        site = cluster.nodes[leader].site
        followers = [alias for alias in cluster.alive() if alias != leader]
        acked = AckedPublisher(cluster, "calls", SCHEMA)
        stub = cluster.stub(leader)

        def publish(first_key: int) -> pb.PublishRequest:
            return pb.PublishRequest(table="calls", payload=ipc_stream(acked.batch(first_key, 1)))

        for alias in followers:
            cluster.signal(alias, signal.SIGSTOP)
        held = [stub.Publish.future(publish(key), timeout=60) for key in range(NODE_CALLS_MAX)]
        info = pb.TableRequest(table="calls")

        def refused_for_its_calls() -> Overloaded | None:
            try:
                transport.unary(stub, "GetTableInfo", info, site, 5.0)
            except Overloaded as error:
                return error
            # The held publishes are not all in yet, or another call to the node was in
            # flight as one arrived (it was refused in its place) and has ended since: one
            # more fills the slot. Any surplus is refused.
            held.append(stub.Publish.future(publish(len(held)), timeout=60))
            return None

        try:
            refused = wait_until(refused_for_its_calls, timeout_s=7, message="the node full")
        except AssertionError:
            ended = [future.exception(timeout=0) for future in held if future.done()]
            kinds = sorted({str(error)[:160] for error in ended})
            raise AssertionError(f"not full: {len(ended)} held calls ended: {kinds}") from None
        assert refused.retryable
        assert refused.limit == NODE_CALLS_MAX
        assert site in str(refused)
        with pytest.raises(Overloaded):  # refused before any handler: nothing appended
            transport.unary(stub, "Publish", publish(REFUSED_KEY), site, 5.0)
        answered: list[str] = []
        with Session([site], deadline_s=60) as session:
            asking = threading.Thread(
                target=lambda: answered.append(session.getTableInfo("calls").table)
            )
            asking.start()
            for alias in followers:
                cluster.signal(alias, signal.SIGCONT)
            asking.join(timeout=60)
        assert answered == ["calls"]  # once the held calls ended
        refused_held = 0
        for key, future in enumerate(held):
            error = future.exception(timeout=60)
            if error is None:
                acked.acked.append(key)
            elif error.details() == NODE_CALLS_REFUSED_DETAILS:
                refused_held += 1
        assert acked.acked, "no held publish was acknowledged"
        assert refused_held >= len(held) - NODE_CALLS_MAX  # never more than the limit in flight
        assert_replicas_hold_exactly(cluster, "calls", acked.acked, ordered=False)
        rows = cluster.read_table(leader, "calls").column("id").to_pylist()
        assert REFUSED_KEY not in rows
    finally:
        cluster.stop()
