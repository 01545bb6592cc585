"""The node's gRPC API on a real three-node cluster: tables, bad input, subscriptions,
consumer offsets, non-HA tables, garbage on the wire."""

from __future__ import annotations

import json
import pickle
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from proto import hastream_pb2 as pb
from raftstore import limits
from tests.harness import (
    LocalCluster,
    ipc_stream,
    read_stream,
    wait_until,
)

pytestmark = pytest.mark.cluster

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string()), ("price", pa.float64())])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("api") / "cluster", groups=(2, 3))
    cluster.start()
    yield cluster
    cluster.stop()


def error_of(raised: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[str, dict[str, object]]:
    metadata = dict(raised.value.trailing_metadata() or ())
    return str(metadata.get("hastream-error")), json.loads(
        metadata.get("hastream-error-fields", "{}")
    )


def rows(table: str, first: int, count: int, schema: pa.Schema = SCHEMA) -> bytes:
    data = pa.table(
        {
            "id": pa.array(range(first, first + count), pa.int64()),
            "sym": pa.array([f"s{i % 7}" for i in range(count)]),
            "price": pa.array([float(i) for i in range(count)]),
        },
        schema=schema,
    )
    return ipc_stream(data)


def publish(
    cluster: LocalCluster, table: str, payload: bytes, group: int = 2
) -> pb.PublishResponse:
    return cluster.stub(cluster.leader(group)).Publish(
        pb.PublishRequest(table=table, payload=payload), timeout=15
    )


def create(cluster: LocalCluster, table: str, group: int = 2, key_column: str = "id") -> None:
    cluster.create_table(table, SCHEMA, group=group, key_column=key_column)


# --- tables and bad input -------------------------------------------------------------


def test_publish_returns_committed_offsets_and_rows_reach_every_replica(
    cluster: LocalCluster,
) -> None:
    create(cluster, "offsets")
    first = publish(cluster, "offsets", rows("offsets", 0, 100))
    second = publish(cluster, "offsets", rows("offsets", 100, 50))
    assert (first.first_offset, first.row_count) == (0, 100)
    assert (second.first_offset, second.row_count) == (100, 50)
    assert second.lsn > first.lsn > 0
    wait_until(
        lambda: all(cluster.row_count(a, "offsets") == 150 for a in cluster.alive()),
        timeout_s=20,
        message="replicas have 150 rows",
    )
    for alias in cluster.alive():
        assert cluster.read_table(alias, "offsets").column("id").to_pylist() == list(range(150))


def test_key_column_drops_rows_already_written_and_within_batch(cluster: LocalCluster) -> None:
    create(cluster, "dedup")
    publish(cluster, "dedup", rows("dedup", 0, 10))
    data = pa.table(
        {"id": [5, 10, 10, 11], "sym": ["a", "b", "c", "d"], "price": [1.0, 2.0, 3.0, 4.0]},
        schema=SCHEMA,
    )
    reply = publish(cluster, "dedup", ipc_stream(data))
    assert (reply.first_offset, reply.row_count, reply.duplicates) == (10, 2, 2)
    table = cluster.read_table(cluster.leader(), "dedup")
    assert table.column("id").to_pylist() == [*range(10), 10, 11]
    assert table.column("sym").to_pylist()[-2:] == ["b", "d"]


def test_producer_retry_is_answered_not_reapplied(cluster: LocalCluster) -> None:
    create(cluster, "retry", key_column="")
    request = pb.PublishRequest(
        table="retry", payload=rows("retry", 0, 20), producer_id=b"p" * 16, sequence=1
    )
    stub = cluster.stub(cluster.leader())
    first = stub.Publish(request, timeout=15)
    again = stub.Publish(request, timeout=15)
    assert again.duplicate_batch
    assert (again.first_offset, again.row_count) == (first.first_offset, first.row_count)
    assert cluster.row_count(cluster.leader(), "retry") == 20


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown_table", "TableNotFound"),
        ("wrong_schema", "SchemaMismatch"),
        ("empty", "EmptyBatch"),
        ("garbage", "InvalidArgument"),
        ("oversized", "BatchTooLarge"),
    ],
)
def test_bad_publish_is_refused_with_a_typed_error_and_writes_nothing(
    cluster: LocalCluster, case: str, expected: str
) -> None:
    create(cluster, "strict")
    before = cluster.row_count(cluster.leader(), "strict")
    table = "strict"
    if case == "unknown_table":
        table, payload = "no_such_table", rows("x", 0, 5)
    elif case == "wrong_schema":
        other = pa.schema([("id", pa.int64()), ("sym", pa.string()), ("price", pa.int32())])
        payload = ipc_stream(pa.table({"id": [1], "sym": ["a"], "price": [1]}, schema=other))
    elif case == "empty":
        payload = ipc_stream(SCHEMA.empty_table())
    elif case == "garbage":
        payload = b"\x00garbage, not an Arrow IPC stream\xff" * 10
    else:
        payload = b"\x00" * (limits.BATCH_BYTES_MAX + 1)
    with pytest.raises(grpc.RpcError) as raised:
        cluster.stub(cluster.leader()).Publish(
            pb.PublishRequest(table=table, payload=payload), timeout=15
        )
    name, fields = error_of(raised)
    assert name == expected, (name, fields, raised.value.details())
    if case == "wrong_schema":
        assert "price" in str(fields["detail"])
    assert cluster.row_count(cluster.leader(), "strict") == before


def test_duplicate_table_and_bad_definitions_are_refused(cluster: LocalCluster) -> None:
    create(cluster, "twice")
    leader = cluster.stub(cluster.leader())
    request = pb.CreateTableRequest(
        raft_group=2, table="twice", schema_ipc=SCHEMA.serialize().to_pybytes(), cache_limit=10
    )
    with pytest.raises(grpc.RpcError) as raised:
        leader.HaStreamTable(request, timeout=15)
    assert error_of(raised)[0] == "TableExists"
    bad = [
        pb.CreateTableRequest(
            raft_group=2, table="bad name", schema_ipc=request.schema_ipc, cache_limit=10
        ),
        pb.CreateTableRequest(raft_group=2, table="badschema", schema_ipc=b"junk", cache_limit=10),
        pb.CreateTableRequest(
            raft_group=2,
            table="badkey",
            schema_ipc=request.schema_ipc,
            cache_limit=10,
            key_column="nope",
        ),
        pb.CreateTableRequest(
            raft_group=2, table="nocache", schema_ipc=request.schema_ipc, cache_limit=0
        ),
    ]
    for definition in bad:
        with pytest.raises(grpc.RpcError) as raised:
            leader.HaStreamTable(definition, timeout=15)
        assert error_of(raised)[0] == "InvalidArgument", definition.table
    with pytest.raises(grpc.RpcError) as raised:
        leader.HaStreamTable(
            pb.CreateTableRequest(
                raft_group=9, table="nogroup", schema_ipc=request.schema_ipc, cache_limit=5
            ),
            timeout=15,
        )
    assert error_of(raised)[0] == "UnknownGroup"
    groups = cluster.stub(cluster.leader()).GetStreamingRaftGroups(pb.Empty(), timeout=5)
    tables = {name for group in groups.groups for name in group.tables}
    assert not tables & {"bad name", "badschema", "badkey", "nocache", "nogroup"}


def test_tables_live_in_their_own_raft_group(cluster: LocalCluster) -> None:
    create(cluster, "in_three", group=3)
    publish(cluster, "in_three", rows("in_three", 0, 5), group=3)
    groups = {
        g.raft_group: g
        for g in cluster.stub("node1").GetStreamingRaftGroups(pb.Empty(), timeout=5).groups
    }
    assert "in_three" in groups[3].tables
    assert "in_three" not in groups[2].tables
    assert len(groups[3].sites) == 3


def test_non_ha_table_is_local_to_one_node_and_persisted(cluster: LocalCluster) -> None:
    stub = cluster.stub("node1")
    stub.HaStreamTable(
        pb.CreateTableRequest(
            raft_group=0,
            table="local_only",
            schema_ipc=SCHEMA.serialize().to_pybytes(),
            cache_limit=100,
        ),
        timeout=15,
    )
    reply = stub.Publish(
        pb.PublishRequest(table="local_only", payload=rows("l", 0, 30)), timeout=15
    )
    assert (reply.first_offset, reply.row_count) == (0, 30)
    with pytest.raises(grpc.RpcError) as raised:
        cluster.stub("node2").GetTableInfo(pb.TableRequest(table="local_only"), timeout=5)
    assert error_of(raised)[0] == "TableNotFound"


# --- subscriptions and offsets --------------------------------------------------------


def subscribe_rows(cluster: LocalCluster, request: pb.SubscribeRequest, wanted: int) -> list[int]:
    received: list[int] = []
    call = cluster.stub(cluster.leader()).Subscribe(request, timeout=30)
    try:
        for message in call:
            if message.row_count == 0:
                continue  # a heartbeat
            data = read_stream(message.payload)
            received.extend(data.column("id").to_pylist())
            if len(received) >= wanted:
                break
    finally:
        call.cancel()
    return received


@pytest.mark.parametrize(("offset", "expected_first"), [(0, 0), (15, 15), (-3, 0)])
def test_subscription_starts_where_asked(
    cluster: LocalCluster, offset: int, expected_first: int
) -> None:
    create(cluster, "subs")
    if cluster.row_count(cluster.leader(), "subs") == 0:
        publish(cluster, "subs", rows("subs", 0, 40))
    received = subscribe_rows(
        cluster, pb.SubscribeRequest(table="subs", action_name="a", offset=offset), 5
    )
    assert received[0] == expected_first


def test_subscription_from_latest_sees_only_new_rows(cluster: LocalCluster) -> None:
    create(cluster, "latest")
    publish(cluster, "latest", rows("latest", 0, 10))
    result: list[int] = []
    done = threading.Event()

    def consume() -> None:
        result.extend(
            subscribe_rows(
                cluster, pb.SubscribeRequest(table="latest", action_name="b", offset=-1), 5
            )
        )
        done.set()

    consumer = threading.Thread(target=consume)
    consumer.start()
    leader = cluster.leader()
    wait_until(
        lambda: cluster.group_status(leader, 2)["subscriptions"].get("latest/b", 0) > 0,
        timeout_s=20,
        message="subscription registered",
    )
    publish(cluster, "latest", rows("latest", 10, 5))
    assert done.wait(30)
    consumer.join()
    assert result == list(range(10, 15))


def test_persisted_offset_resumes_and_survives_failover(cluster: LocalCluster) -> None:
    create(cluster, "persist")
    publish(cluster, "persist", rows("persist", 0, 30))
    leader = cluster.stub(cluster.leader())
    leader.CommitOffset(
        pb.CommitOffsetRequest(table="persist", action_name="job", offset=19), timeout=15
    )
    for alias in cluster.alive():
        wait_until(
            lambda alias=alias: (
                cluster.stub(alias)
                .GetTopicProcessedOffset(pb.TopicRequest(topic="persist/job"), timeout=5)
                .offset
                == 19
            ),
            timeout_s=20,
            message=f"offset replicated to {alias}",
        )
    received = subscribe_rows(
        cluster, pb.SubscribeRequest(table="persist", action_name="job", offset=-2), 10
    )
    assert received[:10] == list(range(20, 30))
    cluster.stub(cluster.leader()).RemoveTopicOffset(
        pb.TopicRequest(topic="persist/job"), timeout=15
    )
    with pytest.raises(grpc.RpcError) as raised:
        cluster.stub(cluster.leader()).GetTopicProcessedOffset(
            pb.TopicRequest(topic="persist/job"), timeout=5
        )
    assert error_of(raised)[0] == "TopicNotFound"


def test_subscribe_to_a_follower_is_refused_with_the_leader(cluster: LocalCluster) -> None:
    create(cluster, "follow")
    leader = cluster.leader()
    follower = next(a for a in cluster.alive() if a != leader)
    with pytest.raises(grpc.RpcError) as raised:
        next(
            iter(
                cluster.stub(follower).Subscribe(
                    pb.SubscribeRequest(table="follow", offset=0), timeout=10
                )
            )
        )
    name, fields = error_of(raised)
    assert name == "NotLeader"
    assert str(fields["leader"]).endswith(f":{leader}")


def test_an_idle_subscription_gets_heartbeats_with_the_table_length(
    cluster: LocalCluster,
) -> None:
    create(cluster, "quiet")
    publish(cluster, "quiet", rows("quiet", 0, 3))
    call = cluster.stub(cluster.leader()).Subscribe(
        pb.SubscribeRequest(table="quiet", action_name="hb", offset=0), timeout=30
    )
    try:
        messages = iter(call)
        first = next(messages)
        assert (first.first_offset, first.row_count) == (0, 3)
        # Nothing more to send: the leader says it is alive, and how long the table is.
        heartbeat = next(messages)
        assert (heartbeat.row_count, heartbeat.payload, heartbeat.table_row_count) == (0, b"", 3)
        assert next(messages).row_count == 0
    finally:
        call.cancel()


def test_drop_is_refused_while_subscribed_unless_forced(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    create(cluster, "dropme")
    publish(cluster, "dropme", rows("dropme", 0, 10))
    call = cluster.stub(cluster.leader()).Subscribe(
        pb.SubscribeRequest(table="dropme", action_name="x", offset=0), timeout=60
    )
    next(iter(call))
    leader = cluster.stub(cluster.leader())
    with pytest.raises(grpc.RpcError) as raised:
        leader.DropStreamTable(pb.DropTableRequest(table="dropme"), timeout=15)
    assert error_of(raised)[0] == "TableSubscribed"
    leader.DropStreamTable(pb.DropTableRequest(table="dropme", force=True), timeout=15)
    call.cancel()
    for alias in cluster.alive():
        wait_until(
            lambda alias=alias: (
                not list((cluster.root / alias / "persistence" / "group-2").glob("dropme.*"))
            ),
            timeout_s=20,
            message=f"files dropped on {alias}",
        )


# --- garbage on the wire ----------------------------------------------------------------


class _OpensAFile:
    """Unpickling this creates a file: proof that a peer port executed foreign code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_garbage_on_client_and_raft_ports_changes_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    create(cluster, "wire")
    publish(cluster, "wire", rows("wire", 0, 5))
    config = cluster.config_path.read_text()
    raft_port = int(config.split("node1.raftPorts=")[1].split(",")[0].split(":")[1])
    marker = tmp_path / "executed"
    # pysyncobj frames are a 4-byte length and a (normally authenticated) pickle.
    evil = pickle.dumps(_OpensAFile(marker), protocol=2)
    frames = [struct.pack("<i", len(evil)) + evil, b"\x00\x00\x10\x00" + b"junk" * 100]
    for port in (cluster.nodes["node1"].port, raft_port):
        for frame in frames:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(frame)
    assert set(cluster.alive()) == set(cluster.nodes)
    assert not marker.exists(), "a pickle sent to the Raft port was executed"
    assert publish(cluster, "wire", rows("wire", 5, 5)).first_offset == 5
    for alias in cluster.alive():
        wait_until(
            lambda alias=alias: cluster.row_count(alias, "wire") == 10, timeout_s=20, message="rows"
        )


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_an_oversized_raft_frame_is_dropped_before_it_is_buffered(cluster: LocalCluster) -> None:
    """Before any authentication, a sender declaring a 2 GiB frame and streaming zeros is cut
    off (the node would otherwise buffer all of it, and copy the buffer on every read)."""
    create(cluster, "frames")
    config = cluster.config_path.read_text()
    raft_port = int(config.split("node1.raftPorts=")[1].split(",")[0].split(":")[1])
    process = cluster.nodes["node1"].process
    assert process is not None
    rss_before = _rss_bytes(process.pid)
    chunk = bytes(1 << 20)
    sent = 0
    refused: OSError | None = None
    with socket.create_connection(("127.0.0.1", raft_port), timeout=10) as sock:
        sock.sendall(struct.pack("<i", 2**31 - 1))
        try:
            while sent < 512 * limits.MIB:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError as error:  # reset or broken pipe: the node closed the link
            refused = error
    assert refused is not None, "the node read 512 MiB of one frame"
    assert sent < 64 * limits.MIB, f"the node read {sent} bytes of an oversized frame"
    assert _rss_bytes(process.pid) - rss_before < 64 * limits.MIB
    assert set(cluster.alive()) == set(cluster.nodes)
    assert publish(cluster, "frames", rows("frames", 0, 5)).first_offset == 0


def test_idle_unauthenticated_raft_links_are_bounded_and_closed(cluster: LocalCluster) -> None:
    """Links that never prove the key: at most RAFT_UNAUTHENTICATED_MAX wait at once (more
    are closed at accept), and each is closed after RAFT_HANDSHAKE_S."""
    create(cluster, "links")
    config = cluster.config_path.read_text()
    raft_port = int(config.split("node1.raftPorts=")[1].split(",")[0].split(":")[1])
    links = [socket.create_connection(("127.0.0.1", raft_port), timeout=5) for _ in range(100)]
    try:
        for link in links:
            link.setblocking(False)

        def closed(link: socket.socket) -> bool:
            try:
                return link.recv(1) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

        # Past the cap: closed at once (well before the handshake deadline).
        wait_until(
            lambda: sum(map(closed, links)) >= len(links) - limits.RAFT_UNAUTHENTICATED_MAX,
            timeout_s=limits.RAFT_HANDSHAKE_S - 1,
            message="links past the cap closed",
        )
        wait_until(lambda: all(map(closed, links)), timeout_s=30, message="every idle link closed")
    finally:
        for link in links:
            link.close()
    assert set(cluster.alive()) == set(cluster.nodes)
    assert publish(cluster, "links", rows("links", 0, 5)).first_offset == 0


def test_a_table_past_the_node_limit_is_refused_before_anything_is_proposed(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(tmp_path / "c", extra_config=("streamingTablesMax=2",)).start()
    try:
        create(cluster, "first")
        create(cluster, "second")
        leader = cluster.stub(cluster.leader())
        before = cluster.group_status(cluster.leader(), 2)["commit_index"]
        with pytest.raises(grpc.RpcError) as raised:
            leader.HaStreamTable(
                pb.CreateTableRequest(
                    raft_group=2, table="third", schema_ipc=SCHEMA.serialize().to_pybytes()
                ),
                timeout=15,
            )
        name, fields = error_of(raised)
        assert name == "TooManyTables"
        assert fields == {"table": "third", "tables": 2, "tables_max": 2}
        assert cluster.group_status(cluster.leader(), 2)["commit_index"] == before
        leader.DropStreamTable(pb.DropTableRequest(table="first"), timeout=15)
        create(cluster, "third")  # room again
    finally:
        cluster.stop()
