"""Logins and grants on a real three-node cluster with `authentication=on`: who may publish,
read and administer, what a refused call leaves behind (nothing), and users that survive a
leader kill and a restart of every node (they live in the catalog group's Raft log)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from api_clients import connect
from api_clients.connection import Session
from api_clients.publisher import Publisher
from hastream.errors import PermissionDenied, Unauthenticated, UserExists
from proto import hastream_pb2 as pb
from proto import hastream_pb2_grpc
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    assert_replicas_hold_exactly,
    ipc_stream,
    wait_until,
)

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])
ADMIN_PASSWORD = "admin-password-for-tests"

pytestmark = pytest.mark.cluster


def rows(first: int, count: int) -> pa.Table:
    return pa.table(
        {"id": pa.array(range(first, first + count), pa.int64()), "sym": ["s"] * count},
        schema=SCHEMA,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("auth"), groups=(2, 3))
    local.enable_authentication(ADMIN_PASSWORD)
    local.start()
    try:
        local.leader(2)  # the harness logs in as the first admin: it exists
        local.create_table("trades", SCHEMA, group=2)
        local.create_table("quotes", SCHEMA, group=3)
        yield local
    finally:
        local.stop()


def sites(cluster: LocalCluster) -> list[str]:
    return [node.site for node in cluster.nodes.values()]


def login(cluster: LocalCluster, user: str, password: str, alias: str = "node1") -> Session:
    node = cluster.nodes[alias]
    return connect(node.host, node.port, user, password, highAvailabilitySites=sites(cluster))


def row_count(cluster: LocalCluster, table: str) -> int:
    return cluster.row_count(cluster.leader(2), table)


def refused_soon(call: Callable[[], object], error: type[Exception]) -> None:
    """A restriction (a denial, a reset, a delete) counts on a node once the node applied
    it: milliseconds after the leader acknowledged it. Wait for `call` to raise `error`."""

    def refused() -> bool:
        try:
            call()
        except error:
            return True
        return False

    wait_until(refused, timeout_s=10, interval_s=0.05, message=f"refused with {error.__name__}")


@pytest.fixture(scope="module")
def admin(cluster: LocalCluster) -> Iterator[Session]:
    with login(cluster, "admin", ADMIN_PASSWORD) as session:
        yield session


def test_no_login_or_a_wrong_password_is_refused_and_writes_nothing(
    cluster: LocalCluster,
) -> None:
    before = row_count(cluster, "trades")
    with pytest.raises(Unauthenticated, match="wrong user name or password"):
        login(cluster, "admin", "not-the-password")
    with Session(sites(cluster)) as anonymous:
        with pytest.raises(Unauthenticated, match="needs a login"):
            Publisher(anonymous, "trades").append(rows(0, 10))
        with pytest.raises(Unauthenticated):
            anonymous.getStreamingRaftGroups()
        # Who leads is operational status, answered without a login (health checks use it).
        assert anonymous.getStreamingLeader(2)
    forged = pb.PublishRequest(table="trades", payload=ipc_stream(rows(0, 10)))
    with grpc.insecure_channel(cluster.nodes["node1"].site) as channel:
        raw = hastream_pb2_grpc.StreamTableStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            raw.Publish(forged, metadata=[("hastream-token", "admin:1:9999999999999:00")])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert row_count(cluster, "trades") == before


UNARY_REQUESTS = {
    "HaStreamTable": pb.CreateTableRequest(raft_group=2, table="x"),
    "DropStreamTable": pb.DropTableRequest(table="trades"),
    "GetTableInfo": pb.TableRequest(table="trades"),
    "Publish": pb.PublishRequest(table="trades"),
    "CommitOffset": pb.CommitOffsetRequest(table="trades", action_name="a", offset=0),
    "GetTopicProcessedOffset": pb.TopicRequest(topic="trades/a"),
    "RemoveTopicOffset": pb.TopicRequest(topic="trades/a"),
    "GetStreamingRaftGroups": pb.Empty(),
    "GetStreamingStat": pb.Empty(),
    "TransferLeadership": pb.TransferLeadershipRequest(raft_group=2),
    "ManageAccess": pb.AccessRequest(operation=pb.AccessRequest.CREATE_USER, userid="x"),
    "GetAccess": pb.Empty(),
}
STREAM_REQUESTS = {
    "Subscribe": pb.SubscribeRequest(table="trades"),
    "Read": pb.ReadRequest(table="trades", offset_from=0, offset_to=-1),
}


def test_every_client_call_without_a_login_is_refused(cluster: LocalCluster) -> None:
    before = row_count(cluster, "trades")
    with grpc.insecure_channel(cluster.nodes["node2"].site) as channel:
        raw = hastream_pb2_grpc.StreamTableStub(channel)
        for method, request in UNARY_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as refused:
                getattr(raw, method)(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        for method, request in STREAM_REQUESTS.items():
            with pytest.raises(grpc.RpcError) as refused:
                list(getattr(raw, method)(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        batch = pb.PublishBatch(requests=[pb.PublishRequest(table="trades", producer_id=b"p" * 16)])
        with pytest.raises(grpc.RpcError) as refused:
            list(raw.PublishStream(iter([batch]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Operational status and the login itself need none.
        raw.GetStreamingLeader(pb.GroupRequest(raft_group=2), timeout=10)
        raw.GetNodeStatus(pb.Empty(), timeout=10)
    assert row_count(cluster, "trades") == before


def test_grants_decide_who_publishes_reads_and_administers(
    cluster: LocalCluster, admin: Session, tmp_path: Path
) -> None:
    buffer_dir = tmp_path / "buffer"
    admin.createUser("writer", "writer-password")
    admin.createUser("reader", "reader-password")
    admin.grant("writer", "TABLE_WRITE", "trades")
    admin.grant("reader", "TABLE_READ", ["trades", "quotes"])
    with pytest.raises(UserExists):
        admin.createUser("writer", "another-password")
    before = row_count(cluster, "trades")
    with login(cluster, "writer", "writer-password", "node2") as writer:
        publisher = Publisher(writer, "trades")  # a writer may read the schema it writes
        publisher.append(rows(1_000, 50))
        publisher.append_async(rows(1_050, 50)).result(timeout=30)  # pipelined: PublishStream
        with pytest.raises(PermissionDenied) as denied:
            writer.read("trades", 0)
        assert (denied.value.user, denied.value.action) == ("writer", "TABLE_READ")
        with pytest.raises(PermissionDenied):
            Publisher(writer, "quotes").append(rows(0, 10))
        with pytest.raises(PermissionDenied, match="ADMIN"):
            writer.createUser("intruder", "intruder-password")
        with pytest.raises(PermissionDenied, match="ADMIN"):
            writer.dropStreamTable("trades")
        # The durable-buffer publisher logs in through the same session.
        buffered = Publisher(writer, "trades", durable_buffer_dir=str(buffer_dir))
        buffered.append(rows(1_100, 20))
        assert buffered.flush() == 0  # nothing left unacknowledged
        buffered.close()
    assert row_count(cluster, "trades") == before + 120
    assert row_count(cluster, "quotes") == 0
    with login(cluster, "reader", "reader-password", "node3") as reader:
        assert reader.read("trades", before).column("id").to_pylist() == list(range(1_000, 1_120))
        with pytest.raises(PermissionDenied):
            Publisher(reader, "trades").append(rows(0, 10))
        with pytest.raises(PermissionDenied, match="ADMIN"):
            reader.removeTopicOffset("trades/any")
        with pytest.raises(PermissionDenied, match="ADMIN"):
            reader.dropStreamTable("trades")
        admin.deny("reader", "TABLE_READ", "*")  # a denial beats the grant on trades
        refused_soon(lambda: reader.read("trades", 0), PermissionDenied)
        admin.revoke("reader", "TABLE_READ", "*")
        assert reader.read("trades", before).num_rows == 120
    access = {entry["user"]: entry for entry in admin.getUserAccess()}
    assert access["reader"]["rules"] == [
        {"privilege": "TABLE_READ", "table": "quotes", "effect": "GRANT"},
        {"privilege": "TABLE_READ", "table": "trades", "effect": "GRANT"},
    ]
    assert "hash" not in str(access)


def test_a_password_reset_or_a_delete_ends_the_users_sessions(
    cluster: LocalCluster, admin: Session
) -> None:
    admin.createUser("temp", "first-password")
    admin.grant("temp", "TABLE_READ", "trades")
    with login(cluster, "temp", "first-password") as old:
        old.read("trades", 0, 0)
        admin.resetPwd("temp", "second-password")
        refused_soon(lambda: old.read("trades", 0, 0), Unauthenticated)
    refused_soon(lambda: login(cluster, "temp", "first-password").close(), Unauthenticated)
    with login(cluster, "temp", "second-password") as new:
        new.read("trades", 0, 0)
        admin.deleteUser("temp")
        refused_soon(lambda: new.read("trades", 0, 0), Unauthenticated)
    assert "temp" not in admin.getUserList()


def test_users_survive_a_leader_kill_and_a_restart_of_every_node(
    cluster: LocalCluster, admin: Session
) -> None:
    admin.createUser("durable", "durable-password")
    admin.grant("durable", "TABLE_WRITE", "trades")
    publisher = AckedPublisher(cluster, "trades", SCHEMA)
    first = 1_000_000
    publisher.publish(first, 100)
    leader = cluster.leader(2)  # also the catalog group: users live in its log
    cluster.kill(leader)
    publisher.publish(first + 100, 100)
    admin.createUser("after_kill", "after-kill-password")  # the new leader takes changes
    cluster.start_node(leader)
    for alias in cluster.nodes:  # every node, the restarted one too, verifies the user
        node = cluster.nodes[alias]
        with connect(node.host, node.port, "durable", "durable-password", highAvailability=False):
            pass
    for alias in cluster.nodes:
        cluster.terminate(alias)
    cluster.start()
    with login(cluster, "after_kill", "after-kill-password", "node2") as session:
        assert session.getStreamingRaftGroups()
    with login(cluster, "durable", "durable-password", "node3") as session:
        Publisher(session, "trades").append(rows(first + 200, 100))
    publisher.acked.extend(range(first + 200, first + 300))
    trades = cluster.read_table(cluster.leader(2), "trades").column("id").to_pylist()
    mine = [key for key in trades if key >= first]
    assert mine == list(range(first, first + 300))
    assert_replicas_hold_exactly(cluster, "trades", trades, ordered=False)
