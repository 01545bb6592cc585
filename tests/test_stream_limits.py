"""Bounds a client cannot push a node past: held streams (counted apart from unary calls,
per node and per connection), action names, persisted topics. Each refusal is typed and
changes nothing; publishes keep flowing while the stream slots are full."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from hastream.errors import Overloaded, TooManyTopics
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc
from raftstore import limits
from raftstore.admission import StreamSlots
from tests.harness import AckedPublisher, LocalCluster, wait_until
from tests.shell import Shell, raises

SCHEMA = pa.schema([("id", pa.int64()), ("ts", pa.timestamp("ms")), ("sym", pa.string())])


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
    for action in ("x" * 60_000, "a/b"):
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
