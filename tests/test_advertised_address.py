"""`<alias>.advertisedHost` / `<alias>.advertisedPort` on real three-node clusters.

Every node binds 127.0.0.1:<cfg port> and advertises 127.0.0.2:<another port>, where a TCP
forwarder (as a published Docker port, or NAT) pipes to the node. Nothing of the node
listens on 127.0.0.2, so a client that reaches a node there got the address from the
cluster's answers, and it could only have come from the advertised keys. A last cluster
advertises addresses where nothing listens: node-to-node catch-up must not use them.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from api_clients import Publisher, connect
from proto import hastream_pb2 as pb
from tests.harness import (
    AckedPublisher,
    LocalCluster,
    assert_replicas_hold_exactly,
    free_ports,
    ipc_stream,
    wait_until,
)

pytestmark = pytest.mark.cluster

GROUP = 2
ADVERTISED_HOST = "127.0.0.2"  # loopback too, but no node binds it
SCHEMA = pa.schema([("id", pa.int64()), ("price", pa.float64())])
ACCEPT_POLL_S = 0.2
PIPE_BYTES = 64 * 1024


class TcpForwarder:
    """Accepts on `listen_host`:<free port> and pipes every connection to `target`, both
    ways, on daemon threads. `connections` counts the accepted ones."""

    def __init__(self, listen_host: str, target: tuple[str, int]) -> None:
        self._target = target
        self._server = socket.create_server((listen_host, 0))
        self._server.settimeout(ACCEPT_POLL_S)  # so the accept loop sees `close()`
        self.host, self.port = self._server.getsockname()[:2]
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        self.connections = 0
        threading.Thread(target=self._accept_loop, name="forwarder", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():  # the forwarder's event loop
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self.connections += 1
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(PIPE_BYTES):
                sink.sendall(data)
        except OSError:
            pass  # the other side or close() ended the connection
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()


@pytest.fixture(scope="module")
def forwarded(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, dict[str, TcpForwarder]]]:
    cluster = LocalCluster(tmp_path_factory.mktemp("advertised") / "cluster")
    forwarders: dict[str, TcpForwarder] = {}
    try:
        for alias, node in cluster.nodes.items():
            forwarders[alias] = TcpForwarder(ADVERTISED_HOST, ("127.0.0.1", node.port))
            cluster.advertise(alias, ADVERTISED_HOST, forwarders[alias].port)
        cluster.start()
        yield cluster, forwarders
    finally:
        cluster.stop()
        for forwarder in forwarders.values():
            forwarder.close()


def advertised(forwarders: dict[str, TcpForwarder], alias: str) -> str:
    return f"{ADVERTISED_HOST}:{forwarders[alias].port}:{alias}"


def rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table({"id": ids, "price": [float(i) for i in ids]}, schema=SCHEMA)


def test_leader_answers_name_the_advertised_address(
    forwarded: tuple[LocalCluster, dict[str, TcpForwarder]],
) -> None:
    cluster, forwarders = forwarded
    leader = cluster.leader(GROUP)
    expected = advertised(forwarders, leader)
    sites = [advertised(forwarders, alias) for alias in cluster.nodes]
    for alias in cluster.nodes:
        # `cluster.stub` dials the cfg address 127.0.0.1:<port>: the node binds that one.
        stub = cluster.stub(alias)
        reply = stub.GetStreamingLeader(pb.GroupRequest(raft_group=GROUP), timeout=5)
        assert reply.leader == expected, alias
        (group,) = stub.GetStreamingRaftGroups(pb.Empty(), timeout=5).groups
        assert (group.leader, list(group.sites)) == (expected, sites), alias
        assert cluster.group_status(alias, GROUP)["leader"] == expected, alias


def test_not_leader_hint_carries_the_advertised_address(
    forwarded: tuple[LocalCluster, dict[str, TcpForwarder]],
) -> None:
    cluster, forwarders = forwarded
    cluster.create_table("hinted", SCHEMA, group=GROUP)
    leader = cluster.leader(GROUP)
    follower = next(alias for alias in cluster.nodes if alias != leader)
    # The follower applies the table's creation shortly after the leader does.
    wait_until(lambda: cluster.row_count(follower, "hinted") == 0, timeout_s=30)
    request = pb.PublishRequest(table="hinted", payload=ipc_stream(rows(0, 3)))
    with pytest.raises(grpc.RpcError) as raised:
        cluster.stub(follower).Publish(request, timeout=15)
    metadata = dict(raised.value.trailing_metadata() or ())
    assert metadata.get("hastream-error") == "NotLeader"
    fields = json.loads(metadata.get("hastream-error-fields", "{}"))
    assert fields["leader"] == advertised(forwarders, leader)


def test_node_does_not_bind_the_advertised_address(
    forwarded: tuple[LocalCluster, dict[str, TcpForwarder]],
) -> None:
    cluster, _ = forwarded
    for alias, node in cluster.nodes.items():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ADVERTISED_HOST, node.port), timeout=5).close()
        socket.create_connection(("127.0.0.1", node.port), timeout=5).close()
        assert f"NODE READY alias={alias} port={node.port}" in cluster.log_tail(alias, 200)


def test_plain_client_follows_not_leader_to_the_advertised_address(
    forwarded: tuple[LocalCluster, dict[str, TcpForwarder]],
) -> None:
    cluster, forwarders = forwarded
    leader = cluster.leader(GROUP)
    follower = next(alias for alias in cluster.nodes if alias != leader)
    accepted_before = forwarders[leader].connections
    # The session knows one follower's advertised site only: every write is redirected.
    with connect(ADVERTISED_HOST, forwarders[follower].port) as session:
        session.haStreamTable(GROUP, SCHEMA, "redirected", cacheLimit=1000, keyColumn="id")
        result = Publisher(session, "redirected").append(rows(0, 50))
        assert (result.first_offset, result.row_count) == (0, 50)
        assert session.getStreamingLeader(GROUP) == advertised(forwarders, leader)
        assert f"{ADVERTISED_HOST}:{forwarders[leader].port}" in session.sites
    assert forwarders[leader].connections > accepted_before  # it went the advertised way
    for alias in cluster.nodes:
        wait_until(lambda a=alias: cluster.row_count(a, "redirected") == 50, timeout_s=30)


def test_catch_up_from_peers_uses_the_cfg_address_not_the_advertised_one(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(tmp_path / "cluster", purge_interval_s=1.0)
    ports = free_ports(len(cluster.nodes), ADVERTISED_HOST)
    for alias, port in zip(cluster.nodes, ports, strict=True):
        cluster.advertise(alias, ADVERTISED_HOST, port)
    cluster.start()
    try:
        schema = pa.schema([("id", pa.int64()), ("price", pa.float64())])
        cluster.create_table("caught", schema, key_column="id")
        publisher = AckedPublisher(cluster, "caught", schema)  # dials the cfg ports
        publisher.publish(0, 1000)
        leader = cluster.leader(GROUP)
        follower = next(alias for alias in cluster.alive() if alias != leader)
        wait_until(lambda: cluster.row_count(follower, "caught") == 1000, timeout_s=30)
        # Stopped while the leader checkpoints (and purges its log) three times, the
        # follower can only catch up by installing a checkpoint and then fetching the data
        # files from a peer, which is reachable only on its cfg address.
        cluster.signal(follower, signal.SIGSTOP)
        try:
            checkpoints = cluster.group_status(leader, GROUP)["checkpoints_written"]
            key, deadline = 1000, time.monotonic() + 120
            while cluster.group_status(leader, GROUP)["checkpoints_written"] < checkpoints + 3:
                assert time.monotonic() < deadline, "leader wrote no checkpoints"
                publisher.publish(key, 1000)
                key += 1000
        finally:
            cluster.signal(follower, signal.SIGCONT)
        expected = cluster.row_count(leader, "caught")
        wait_until(
            lambda: cluster.row_count(follower, "caught") == expected,
            timeout_s=90,
            message="stopped follower catches up",
        )
        assert cluster.group_status(follower, GROUP)["checkpoints_loaded"] >= 1
        assert "catch-up from" not in cluster.log_tail(follower, 400)  # no failed fetch
        assert_replicas_hold_exactly(cluster, "caught", publisher.acked, group=GROUP)
    finally:
        cluster.stop()
