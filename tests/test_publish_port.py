"""The publish port (raftstore/publish_port.py, api_clients/publish_port.py): waited publishes
over framed TCP beside gRPC, on real node processes, with logins on.

What it must keep of gRPC's Publish: the same answers and typed errors, the same checks
(login, grant, schema, garbage: refused with nothing written), its own bounds (frame size,
connections), and a client that falls back to gRPC whenever the port cannot be used and
loses no acknowledged row when the leader is killed or frozen under it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_clients.aio_port import AioPublishPorts
from api_clients.connection import Session, connect
from api_clients.login import Login
from api_clients.publish_port import PORT_RETRY_S, PortRefused, PublishPorts
from api_clients.publisher import Publisher
from api_clients.transport import SiteUnavailable
from deploy.local_cluster import LocalCluster, ipc_stream, wait_until
from hastream import publish_frames as frames
from hastream.errors import (
    InvalidArgument,
    NotLeader,
    Overloaded,
    PermissionDenied,
    RaftStoreError,
    SchemaMismatch,
    Unauthenticated,
)
from proto import hastream_pb2 as pb
from raftstore import limits
from tests.harness import (
    ManualClock,
    assert_replicas_hold_exactly,
    cluster_with_logins,
    publish_through_faults,
)

SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])
ADMIN_PASSWORD = "admin-password-for-port-tests"


def rows(first: int, count: int) -> pa.Table:
    return pa.table(
        {"id": pa.array(range(first, first + count), pa.int64()), "sym": ["s"] * count},
        schema=SCHEMA,
    )


# --- the frames (no cluster) ---------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "error",
    [
        NotLeader("127.0.0.1:1:node2", 2),
        Overloaded("publish port connections", 64),
        SchemaMismatch("t", "column 'x' missing"),
        Unauthenticated("no login token"),
        InvalidArgument("publish port frame", "frame of 9 bytes > 5"),
    ],
)
def test_an_error_frame_carries_the_typed_error_with_its_fields(error: RaftStoreError) -> None:
    again = frames.parse_error(frames.error_body(error))
    assert type(again) is type(error)
    assert again.fields() == error.fields()


@pytest.mark.unit
@pytest.mark.parametrize(
    "body", [b"", b"{", b"[]", b'{"type": 1}', b'{"type": "Nope", "fields": {}}']
)
def test_an_error_frame_that_is_not_one_is_no_typed_error(body: bytes) -> None:
    assert frames.parse_error(body) is None


@pytest.mark.unit
def test_headers_of_unknown_kinds_or_over_the_bound_are_refused() -> None:
    assert frames.parse_header(frames.header(frames.PUBLISH, 10), 10) == (frames.PUBLISH, 10)
    with pytest.raises(frames.FrameError, match="kind 9"):
        frames.parse_header(frames.header(9, 1), 10)
    with pytest.raises(frames.FrameError, match="11 bytes > 10"):
        frames.parse_header(frames.header(frames.PUBLISH, 11), 10)


@pytest.mark.unit
def test_a_publish_body_splits_into_its_token_and_request() -> None:
    body = b"".join(frames.publish_body("admin:1:2:ab", b"\x0a\x01t"))
    token, request = frames.split_publish(body)
    assert (token, bytes(request)) == ("admin:1:2:ab", b"\x0a\x01t")
    with pytest.raises(frames.FrameError):
        frames.publish_body("x" * (frames.TOKEN_BYTES_MAX + 1), b"")


@pytest.mark.unit
@given(st.binary(max_size=64))
def test_any_bytes_as_a_publish_body_split_or_raise_frame_error(body: bytes) -> None:
    try:
        token, request = frames.split_publish(body)
    except frames.FrameError:
        return
    assert len(token) <= frames.TOKEN_BYTES_MAX
    assert frames.TOKEN_LENGTH.size + len(token) + len(request) == len(body)


# --- the client's fallback (real sockets, no cluster) ----------------------------------


def _request() -> pb.PublishRequest:
    return pb.PublishRequest(table="t", payload=ipc_stream(rows(0, 1)))


# The rules below hold for both clients' ports: the threaded Session's (publish_port.py)
# and the asyncio session's (aio_port.py, the same calls on an event loop).
CLIENTS = ["threaded", "asyncio"]


def _ports(client: str, clock: ManualClock) -> PublishPorts | AioPublishPorts:
    return PublishPorts(clock) if client == "threaded" else AioPublishPorts(clock)


def _publish(
    ports: PublishPorts | AioPublishPorts, site: str, timeout_s: float
) -> pb.PublishResponse:
    if isinstance(ports, AioPublishPorts):
        return asyncio.run(ports.publish(site, _request(), "", timeout_s=timeout_s))
    return ports.publish(site, _request(), "", timeout_s=timeout_s)


@pytest.mark.unit
@pytest.mark.parametrize("client", CLIENTS)
def test_a_port_nobody_listens_on_is_put_aside_and_tried_again_later(client: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        dead_port = probe.getsockname()[1]  # closed on leaving: nothing listens there
    clock = ManualClock()
    ports = _ports(client, clock)
    site = "127.0.0.1:1"
    ports.learn(site, dead_port)
    assert ports.usable(site, 100)
    with pytest.raises(PortRefused):
        _publish(ports, site, timeout_s=2)
    assert not ports.usable(site, 100)  # gRPC for PORT_RETRY_S
    clock.now += PORT_RETRY_S
    assert ports.usable(site, 100)
    assert not ports.usable(site, frames.PAYLOAD_BYTES_MAX + 1)  # too big: always gRPC


@pytest.mark.unit
@pytest.mark.parametrize("client", CLIENTS)
def test_a_service_that_does_not_greet_like_a_publish_port_is_not_used(client: str) -> None:
    """Some other service behind the number (a published Docker port that maps elsewhere):
    the client sends only its HELLO, and uses gRPC."""
    received: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:

        def other_service() -> None:
            connection, _ = server.accept()
            with connection:
                received.append(connection.recv(1024))
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=other_service, daemon=True)
        thread.start()
        ports = _ports(client, ManualClock())
        ports.learn("127.0.0.1:1", server.getsockname()[1])
        with pytest.raises(PortRefused):
            _publish(ports, "127.0.0.1:1", timeout_s=2)
        thread.join(timeout=5)
    assert received == [frames.frame(frames.HELLO, frames.BANNER)]
    assert not ports.usable("127.0.0.1:1", 100)


# --- a real cluster, logins on -------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with cluster_with_logins(tmp_path_factory.mktemp("publish-port"), ADMIN_PASSWORD) as local:
        yield local


def _sites(cluster: LocalCluster) -> list[str]:
    return [node.site for node in cluster.nodes.values()]


def _login(cluster: LocalCluster, user: str, password: str) -> Session:
    node = cluster.nodes["node1"]
    return connect(node.host, node.port, user, password, highAvailabilitySites=_sites(cluster))


def _port_status(cluster: LocalCluster, alias: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.status(alias)["publish_port"]
    return status


def _answered(cluster: LocalCluster) -> int:
    return sum(_port_status(cluster, alias)["answered"] for alias in cluster.alive())


class _RawPort:
    """A hand-made client of a node's publish port: frames exactly as given."""

    def __init__(self, cluster: LocalCluster, alias: str) -> None:
        port = _port_status(cluster, alias)["port"]
        self.socket = socket.create_connection((cluster.nodes[alias].host, port), timeout=10)

    def send(self, data: bytes) -> None:
        self.socket.sendall(data)

    def frame(self, kind: int, body: bytes) -> None:
        self.send(frames.frame(kind, body))

    def hello(self) -> bytes:
        self.frame(frames.HELLO, frames.BANNER)
        kind, body = self.read()
        assert kind == frames.HELLO
        return body

    def read(self) -> tuple[int, bytes]:
        head = self._exactly(frames.HEADER.size)
        kind, length = frames.parse_header(head, frames.FRAME_BYTES_MAX)
        return kind, self._exactly(length)

    def error(self) -> RaftStoreError:
        kind, body = self.read()
        assert kind == frames.ERROR, (kind, body[:100])
        error = frames.parse_error(body)
        assert error is not None, body
        return error

    def closed_by_node(self) -> bool:
        try:
            return self.socket.recv(1) == b""
        except ConnectionResetError:
            return True

    def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.socket.recv(size - len(data))
            assert chunk, "the node closed the connection"
            data += chunk
        return data

    def close(self) -> None:
        self.socket.close()


def _publish_frame(token: str, request: pb.PublishRequest) -> bytes:
    return frames.frame(frames.PUBLISH, *frames.publish_body(token, request.SerializeToString()))


@pytest.mark.cluster
def test_waited_appends_go_over_the_port_after_the_first_and_land_once_everywhere(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("waited", SCHEMA)
    before = _answered(cluster)
    with _login(cluster, "admin", ADMIN_PASSWORD) as session:
        publisher = Publisher(session, "waited")
        results = [publisher.append(rows(key, 1)) for key in range(200)]
        results.append(publisher.append(rows(200, 300)))
    # The first went over gRPC (its answer named the port); every later one came by the port.
    assert _answered(cluster) - before == 200
    assert [result.first_offset for result in results[:200]] == list(range(200))
    assert results[200].first_offset == 200
    assert results[200].row_count == 300
    assert_replicas_hold_exactly(cluster, "waited", list(range(500)))


@pytest.mark.cluster
def test_a_connection_the_hedge_closed_while_its_answer_came_is_not_used_again(
    cluster: LocalCluster,
) -> None:
    """The session's hedge leaves a site (`drop`: its connections closed, in use or not)
    just as a request on one of them got its answer: that connection comes back healthy
    and closed. It was kept as idle, and the next publish failed with a bare OSError
    (EBADF) in a chaos run (seed 4302); now it is closed and the next one dials anew. The
    interleaving is made with the pool's own steps, on a real node's port."""
    cluster.create_table("hedged", SCHEMA)
    with _login(cluster, "admin", ADMIN_PASSWORD) as session:
        publisher = Publisher(session, "hedged")
        publisher.append(rows(0, 1))  # over gRPC: the answer names the port
        publisher.append(rows(1, 1))  # over the port: a connection to the leader, idle now
        ports = session._ports
        site = cluster.nodes[cluster.leader(2)].site
        connection = ports._take(site, 5.0)  # a request's
        ports.drop(site)  # the hedge leaves the site meanwhile
        ports._give_back(site, connection, healthy=True)  # its answer had come
        assert connection.fileno() == -1
        publisher.append(rows(2, 1))  # on a new connection, not on the closed one
        assert all(idle.fileno() != -1 for idle in ports._sites[site].idle)
    assert_replicas_hold_exactly(cluster, "hedged", [0, 1, 2])


@pytest.mark.cluster
def test_a_connection_served_by_the_raft_loop_answers_in_order_and_hands_a_stream_back(
    cluster: LocalCluster,
) -> None:
    """After its first answer a connection to the leader is served by the leader's Raft
    loop (raftstore/port_loop.py): pipelined PUBLISH frames are answered one by one in
    order, a refused one in its place, a STREAM later on the same connection goes back to
    a thread of its own, and the port counts the connection and its answers throughout."""
    cluster.create_table("looped", SCHEMA)
    leader = cluster.leader(2)
    token = _token(cluster, "admin", ADMIN_PASSWORD)
    connections_before = _port_status(cluster, leader)["connections"]
    answered_before = _port_status(cluster, leader)["answered"]
    raw = _RawPort(cluster, leader)
    try:
        raw.hello()
        raw.send(
            _publish_frame(token, pb.PublishRequest(table="looped", payload=ipc_stream(rows(0, 1))))
        )
        assert raw.read()[0] == frames.ANSWER  # by the connection's thread
        # Now the loop's: three at once, the second refused (no such table).
        raw.send(
            _publish_frame(token, pb.PublishRequest(table="looped", payload=ipc_stream(rows(1, 2))))
            + _publish_frame(token, pb.PublishRequest(table="nothing", payload=b""))
            + _publish_frame(
                token, pb.PublishRequest(table="looped", payload=ipc_stream(rows(3, 4)))
            )
        )
        first = raw.read()
        assert first[0] == frames.ANSWER, frames.parse_error(first[1])
        assert pb.PublishResponse.FromString(first[1]).first_offset == 1
        assert raw.error().fields()["table"] == "nothing"
        third = raw.read()
        assert third[0] == frames.ANSWER, frames.parse_error(third[1])
        assert pb.PublishResponse.FromString(third[1]).first_offset == 3
        # A request bigger than one read (received into a buffer of its own) and a small
        # one behind it, sent at once: answered in order.
        raw.send(
            _publish_frame(
                token, pb.PublishRequest(table="looped", payload=ipc_stream(rows(7, 30_000)))
            )
            + _publish_frame(
                token, pb.PublishRequest(table="looped", payload=ipc_stream(rows(30_007, 1)))
            )
        )
        for first_offset, count in ((7, 30_000), (30_007, 1)):
            kind, body = raw.read()
            assert kind == frames.ANSWER, frames.parse_error(body)
            answer = pb.PublishResponse.FromString(body)
            assert (answer.first_offset, answer.row_count) == (first_offset, count)
        assert _port_status(cluster, leader)["connections"] == connections_before + 1
        assert _port_status(cluster, leader)["answered"] == answered_before + 5
        producer = os.urandom(16)
        requests = [
            pb.PublishRequest(
                table="looped",
                payload=ipc_stream(rows(30_008, 1)),
                producer_id=producer,
                sequence=1,
            ),
            pb.PublishRequest(
                table="looped",
                payload=ipc_stream(rows(30_009, 2)),
                producer_id=producer,
                sequence=2,
            ),
        ]
        raw.send(_stream_frame(token) + _batch_frame(*requests) + frames.frame(frames.END))
        answered: list[int] = []
        while len(answered) < 2:
            kind, body = raw.read()
            assert kind == frames.ACKS, frames.parse_error(body)
            answered += [ack.sequence for ack in pb.PublishAcks.FromString(body).responses]
        assert answered == [1, 2]
        assert raw.closed_by_node()
    finally:
        raw.close()
    wait_until(
        lambda: _port_status(cluster, leader)["connections"] == connections_before, timeout_s=10
    )
    assert_replicas_hold_exactly(cluster, "looped", list(range(30_011)))


def _token(cluster: LocalCluster, user: str, password: str) -> str:
    with grpc.insecure_channel(cluster.nodes["node1"].site) as channel:
        return Login(user, password).log_in(channel)


@pytest.mark.cluster
def test_the_port_checks_logins_grants_and_rows_as_grpc_does(cluster: LocalCluster) -> None:
    cluster.create_table("guarded", SCHEMA)
    with _login(cluster, "admin", ADMIN_PASSWORD) as admin:
        admin.createUser("port_reader", "port-reader-password")
        admin.grant("port_reader", "TABLE_READ", "guarded")
        publisher = Publisher(admin, "guarded")
        publisher.append(rows(0, 1))  # over gRPC: the session learns the port
        before = _answered(cluster)
        publisher.append(rows(1, 1))  # over the port
        assert _answered(cluster) == before + 1
    leader = cluster.leader(2)
    reader_token = _token(cluster, "port_reader", "port-reader-password")
    admin_token = _token(cluster, "admin", ADMIN_PASSWORD)
    payload = ipc_stream(rows(20, 1))
    raw = _RawPort(cluster, leader)
    try:
        assert raw.hello() == frames.BANNER + b" " + leader.encode()
        refused = {
            "no token": ("", payload, Unauthenticated),
            "a forged token": ("admin:1:9999999999999:00", payload, Unauthenticated),
            "no grant": (reader_token, payload, PermissionDenied),
            "another schema": (
                admin_token,
                ipc_stream(pa.table({"id": [1], "other": [2]})),
                SchemaMismatch,
            ),
            "garbage rows": (admin_token, b"junk", InvalidArgument),
        }
        # A publish's own error leaves the connection usable: each next frame is read.
        for case, (token, data, error) in refused.items():
            raw.send(_publish_frame(token, pb.PublishRequest(table="guarded", payload=data)))
            assert isinstance(raw.error(), error), case
        garbage_request = b"\xff\xff\xff"  # not a protobuf message
        body = b"".join(frames.publish_body(admin_token, garbage_request))
        raw.frame(frames.PUBLISH, body)
        assert isinstance(raw.error(), InvalidArgument)
        raw.send(_publish_frame(admin_token, pb.PublishRequest(table="guarded", payload=payload)))
        kind, answer = raw.read()
        assert kind == frames.ANSWER
        assert pb.PublishResponse.FromString(answer).first_offset == 2
    finally:
        raw.close()
    assert_replicas_hold_exactly(cluster, "guarded", [0, 1, 20])


@pytest.mark.cluster
@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # not this protocol at all
        frames.frame(frames.PUBLISH, b"abc"),  # a PUBLISH before the HELLO
        frames.header(frames.HELLO, frames.HELLO_BYTES_MAX + 1),  # an oversized greeting
        frames.frame(frames.HELLO, b"hello!"),  # a wrong banner
    ],
    ids=["http", "no-hello", "oversized-hello", "wrong-banner"],
)
def test_garbage_before_the_greeting_is_refused_and_the_connection_closed(
    cluster: LocalCluster, garbage: bytes
) -> None:
    leader = cluster.leader(2)
    raw = _RawPort(cluster, leader)
    try:
        raw.send(garbage)
        error = raw.error()
        assert isinstance(error, InvalidArgument)
        assert error.argument == "publish port frame"
        assert raw.closed_by_node()
    finally:
        raw.close()


@pytest.mark.cluster
def test_garbage_after_the_greeting_writes_nothing_and_the_node_serves_on(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("garbage", SCHEMA)
    leader = cluster.leader(2)
    with _login(cluster, "admin", ADMIN_PASSWORD) as admin:
        Publisher(admin, "garbage").append(rows(0, 1))
    cases = [
        frames.header(frames.PUBLISH, frames.FRAME_BYTES_MAX + 1),  # over the bound
        frames.header(7, 0),  # an unknown kind
        frames.header(frames.ANSWER, 0),  # a kind only nodes send
        frames.frame(frames.PUBLISH, b"\xff"),  # shorter than its token length
    ]
    for garbage in cases:
        raw = _RawPort(cluster, leader)
        try:
            raw.hello()
            raw.send(garbage)
            error = raw.error()
            assert isinstance(error, InvalidArgument), garbage
            assert raw.closed_by_node()
        finally:
            raw.close()
    # A frame that ends half-way: the node drops the connection when the client does.
    raw = _RawPort(cluster, leader)
    raw.hello()
    raw.send(frames.header(frames.PUBLISH, 1000) + b"x" * 10)
    raw.close()
    with _login(cluster, "admin", ADMIN_PASSWORD) as admin:
        publisher = Publisher(admin, "garbage")
        publisher.append(rows(1, 1))
        publisher.append(rows(2, 1))
    assert_replicas_hold_exactly(cluster, "garbage", [0, 1, 2])


@pytest.mark.cluster
def test_connections_over_the_bound_are_told_overloaded_and_publishes_go_over_grpc(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("crowded", SCHEMA)
    leader = cluster.leader(2)
    held: list[_RawPort] = []
    try:
        wait_until(
            lambda: _port_status(cluster, leader)["connections"] == 0,
            timeout_s=10,
            message="earlier tests' connections closed",
        )
        for _ in range(limits.PUBLISH_PORT_CONNECTIONS_MAX):
            held.append(_RawPort(cluster, leader))
            held[-1].hello()
        assert _port_status(cluster, leader)["connections"] == limits.PUBLISH_PORT_CONNECTIONS_MAX
        extra = _RawPort(cluster, leader)
        try:
            error = extra.error()
            assert isinstance(error, Overloaded)
            assert error.limit == limits.PUBLISH_PORT_CONNECTIONS_MAX
            assert extra.closed_by_node()
        finally:
            extra.close()
        before = _answered(cluster)
        with _login(cluster, "admin", ADMIN_PASSWORD) as admin:
            publisher = Publisher(admin, "crowded")
            for key in range(5):
                publisher.append(rows(key, 1))
        assert _answered(cluster) == before  # all five over gRPC
    finally:
        for raw in held:
            raw.close()
    wait_until(
        lambda: _port_status(cluster, leader)["connections"] == 0,
        timeout_s=10,
        message="the node let go of the closed connections",
    )
    assert_replicas_hold_exactly(cluster, "crowded", list(range(5)))


# One round of a publisher under faults: appends from `key` on, notes the keys acknowledged
# and the failures; returns the next key, or None to stop.
PublishRound = Callable[[Publisher, int, list[int], list[BaseException]], int | None]


def _publish_through_faults(
    cluster: LocalCluster, table: str, round_: PublishRound, *, max_in_flight: int | None, step: int
) -> list[int]:
    """Runs rounds of `round_` (appending to `table`, noting each acknowledged key and each
    failure) through harness.publish_through_faults; returns the keys acknowledged."""
    cluster.create_table(table, SCHEMA)

    def publish(stop: threading.Event, acked: list[int], failures: list[BaseException]) -> None:
        with _login(cluster, "admin", ADMIN_PASSWORD) as session:
            publisher = Publisher(session, table, max_in_flight=max_in_flight)
            key: int | None = 0
            while key is not None and not stop.is_set():
                key = round_(publisher, key, acked, failures)
            publisher.close()

    return publish_through_faults(cluster, publish, step=step)


@pytest.mark.cluster
def test_no_acknowledged_row_is_lost_when_the_leader_is_killed_then_frozen(
    cluster: LocalCluster,
) -> None:
    """Waited one-row appends over the port while the leader is killed (-9), and, once it
    is back, the next leader frozen (SIGSTOP): the publisher goes on through the others
    (a frozen leader's connection is closed by the session's hedge), and
    every row it was told is committed is on every replica once, in order."""

    def waited(
        publisher: Publisher, key: int, acked: list[int], failures: list[BaseException]
    ) -> int | None:
        try:
            publisher.append(rows(key, 1))
        except RaftStoreError as error:  # the deadline passed: not acknowledged
            failures.append(error)
            return key
        acked.append(key)
        return key + 1

    acked = _publish_through_faults(cluster, "faults", waited, max_in_flight=None, step=200)
    assert _answered(cluster) > 0
    assert_replicas_hold_exactly(cluster, "faults", acked)


@pytest.mark.cluster
def test_a_session_over_a_port_that_goes_away_falls_back_to_grpc(cluster: LocalCluster) -> None:
    """The node behind a site closes its port (it stops); a publish whose connection breaks
    before an answer is retried over gRPC elsewhere without a duplicate."""
    cluster.create_table("away", SCHEMA)
    with _login(cluster, "admin", ADMIN_PASSWORD) as session:
        publisher = Publisher(session, "away")
        publisher.append(rows(0, 1))
        publisher.append(rows(1, 1))
        leader = cluster.leader(2)
        assert cluster.terminate(leader) == 0
        publisher.append(rows(2, 1))
        cluster.start_node(leader)
        publisher.append(rows(3, 1))
    assert_replicas_hold_exactly(cluster, "away", [0, 1, 2, 3])


@pytest.mark.unit
@pytest.mark.parametrize("client", CLIENTS)
def test_a_lost_connection_after_the_request_was_sent_is_site_unavailable(client: str) -> None:
    """A port that greets and then drops the connection without an answer: the attempt
    fails SiteUnavailable (the session's policy retries it under the same sequence)."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def greet_then_drop() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(1024)
                body = frames.BANNER + b" node9"
                connection.sendall(frames.frame(frames.HELLO, body))
                connection.recv(1 << 16)

        thread = threading.Thread(target=greet_then_drop, daemon=True)
        thread.start()
        ports = _ports(client, ManualClock())
        ports.learn("127.0.0.1:1", server.getsockname()[1])
        with pytest.raises(SiteUnavailable, match="connection lost"):
            _publish(ports, "127.0.0.1:1", timeout_s=5)
        thread.join(timeout=5)
    assert ports.usable("127.0.0.1:1", 100)  # the port itself is fine: dialled again


# --- pipelined publishing (PublishStream) over the port ---------------------------------


def _batch_frame(*requests: pb.PublishRequest) -> bytes:
    return frames.frame(frames.BATCH, pb.PublishBatch(requests=list(requests)).SerializeToString())


def _stream_frame(token: str) -> bytes:
    return frames.frame(frames.STREAM, frames.stream_body(token))


@pytest.mark.cluster
def test_pipelined_appends_go_over_the_port_in_order_once(cluster: LocalCluster) -> None:
    cluster.create_table("pipelined", SCHEMA)
    before = _answered(cluster)
    with _login(cluster, "admin", ADMIN_PASSWORD) as session:
        publisher = Publisher(session, "pipelined", max_in_flight=16)
        futures = [publisher.append_async(rows(key, 1)) for key in range(3000)]
        futures.append(publisher.append_async(rows(3000, 2000)))
        assert publisher.flush(60) == 0
        offsets = [future.result().first_offset for future in futures]
        publisher.close()
    assert offsets[:3000] == list(range(3000))
    assert offsets[3000] == 3000
    assert _answered(cluster) > before  # the stream's requests were answered by the port
    assert_replicas_hold_exactly(cluster, "pipelined", list(range(5000)))


@pytest.mark.cluster
def test_a_stream_on_the_port_checks_the_login_and_each_tables_grant(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("streamed", SCHEMA)
    with _login(cluster, "admin", ADMIN_PASSWORD) as admin:
        admin.createUser("stream_reader", "stream-reader-password")
        admin.grant("stream_reader", "TABLE_READ", "streamed")
    leader = cluster.leader(2)
    reader_token = _token(cluster, "stream_reader", "stream-reader-password")
    request = pb.PublishRequest(
        table="streamed", payload=ipc_stream(rows(0, 1)), producer_id=b"p" * 16, sequence=1
    )
    for token, refused in (("", Unauthenticated), (reader_token, PermissionDenied)):
        raw = _RawPort(cluster, leader)
        try:
            raw.hello()
            raw.send(_stream_frame(token) + _batch_frame(request))
            assert isinstance(raw.error(), refused)
            assert raw.closed_by_node()
        finally:
            raw.close()
    assert cluster.row_count(leader, "streamed") == 0


@pytest.mark.cluster
def test_garbage_inside_a_stream_ends_it_after_the_answers_before_it(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("stream_garbage", SCHEMA)
    leader = cluster.leader(2)
    token = _token(cluster, "admin", ADMIN_PASSWORD)
    producer = b"g" * 16

    def request(sequence: int) -> pb.PublishRequest:
        payload = ipc_stream(rows(sequence, 1))
        return pb.PublishRequest(
            table="stream_garbage", payload=payload, producer_id=producer, sequence=sequence
        )

    garbage_frames = {
        "not a PublishBatch": frames.frame(frames.BATCH, b"\xff\xff\xff"),
        "a PUBLISH inside a stream": _publish_frame(token, request(9)),
        "an unknown kind": frames.header(9, 0),
    }
    next_sequence = 1
    for case, garbage in garbage_frames.items():
        raw = _RawPort(cluster, leader)
        try:
            raw.hello()
            raw.send(_stream_frame(token) + _batch_frame(request(next_sequence)) + garbage)
            kind, body = raw.read()
            assert kind == frames.ACKS, case
            acks = pb.PublishAcks.FromString(body)
            assert [ack.sequence for ack in acks.responses] == [next_sequence], case
            error = raw.error()
            assert isinstance(error, InvalidArgument), case
            assert error.argument == "publish port frame", case
            assert raw.closed_by_node(), case
        finally:
            raw.close()
        next_sequence += 1
    raw = _RawPort(cluster, leader)
    try:
        raw.hello()
        raw.frame(frames.STREAM, frames.stream_body(token) + b"extra")  # the token alone
        assert isinstance(raw.error(), InvalidArgument)
        assert raw.closed_by_node()
    finally:
        raw.close()
    assert_replicas_hold_exactly(cluster, "stream_garbage", [1, 2, 3])


@pytest.mark.cluster
def test_no_pipelined_row_is_lost_when_the_leader_is_killed_then_frozen(
    cluster: LocalCluster,
) -> None:
    """append_async over the port's stream while the leader is killed (-9), and, once it
    is back, the next leader frozen (SIGSTOP): the pipeline's watchdog cancels the frozen
    stream (closing its connection), resends elsewhere, and every acknowledged row is on
    every replica once, in order."""

    def pipelined(
        publisher: Publisher, key: int, acked: list[int], failures: list[BaseException]
    ) -> int | None:
        window = [(k, publisher.append_async(rows(k, 1))) for k in range(key, key + 50)]
        for number, future in window:
            try:
                future.result(timeout=120)
            except RaftStoreError as error:
                failures.append(error)
                return None
            acked.append(number)
        return key + 50

    acked = _publish_through_faults(cluster, "stream_faults", pipelined, max_in_flight=8, step=500)
    assert_replicas_hold_exactly(cluster, "stream_faults", acked)


# --- generated sequences of frames against a real node -----------------------------------

# A connection's first PUBLISH is served by a thread of its own; the next ones by the
# leader's Raft loop (raftstore/port_loop.py): `looped` operations publish once first.
_LOOPED = st.booleans()
_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(1, 50)),
        st.tuples(st.just("pipelined"), st.lists(st.integers(1, 20), min_size=2, max_size=4)),
        st.tuples(st.just("bad_token"), st.integers(1, 5)),
        st.tuples(st.just("garbage"), st.tuples(st.binary(min_size=1, max_size=64), _LOOPED)),
        st.tuples(st.just("cut"), st.tuples(st.floats(0.0, 0.99), _LOOPED)),
        st.tuples(st.just("stream"), st.tuples(st.integers(1, 6), _LOOPED)),
    ),
    min_size=1,
    max_size=12,
)


class _Model:
    """What the node must hold after a sequence: the keys of every answered publish."""

    def __init__(self, cluster: LocalCluster, table: str) -> None:
        self.cluster = cluster
        self.table = table
        self.leader = cluster.leader(2)
        self.token = _token(cluster, "admin", ADMIN_PASSWORD)
        self.acked: list[int] = []
        self.next_key = 0
        self.port = _RawPort(cluster, self.leader)
        self.port.hello()

    def request(self, count: int, producer: bytes = b"", sequence: int = 0) -> pb.PublishRequest:
        payload = ipc_stream(rows(self.next_key, count))
        return pb.PublishRequest(
            table=self.table, payload=payload, producer_id=producer, sequence=sequence
        )

    def apply(self, operation: str, argument: Any) -> None:
        getattr(self, operation)(argument)

    def publish(self, count: int, port: _RawPort | None = None) -> None:
        port = port or self.port
        port.send(_publish_frame(self.token, self.request(count)))
        kind, body = port.read()
        assert kind == frames.ANSWER, frames.parse_error(body)
        assert pb.PublishResponse.FromString(body).row_count == count
        self._acked(count)

    def pipelined(self, counts: list[int]) -> None:
        """Several PUBLISH frames sent at once, before any answer: answered in order."""
        data = b""
        for count in counts:
            data += _publish_frame(self.token, self.request(count))
            self.next_key += count
        self.next_key -= sum(counts)
        self.port.send(data)
        for count in counts:
            kind, body = self.port.read()
            assert kind == frames.ANSWER, frames.parse_error(body)
            answer = pb.PublishResponse.FromString(body)
            assert answer.row_count == count
            assert answer.first_offset == len(self.acked)
            self._acked(count)

    def _connection(self, looped: bool) -> _RawPort:
        """A new greeted connection; with `looped`, one publish answered on it first."""
        raw = _RawPort(self.cluster, self.leader)
        raw.hello()
        if looped:
            self.publish(1, raw)
        return raw

    def bad_token(self, count: int) -> None:
        self.port.send(_publish_frame("nobody:1:1:00", self.request(count)))
        assert isinstance(self.port.error(), Unauthenticated)  # and the connection stays

    def garbage(self, argument: tuple[bytes, bool]) -> None:
        """Bytes after a greeting on a connection of their own: never an answer."""
        data, looped = argument
        raw = self._connection(looped)
        try:
            raw.send(data)
            raw.socket.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := raw.socket.recv(1 << 16):
                reply += chunk
            if reply:
                kind, _ = frames.parse_header(reply[: frames.HEADER.size], frames.FRAME_BYTES_MAX)
                assert kind == frames.ERROR, reply[:100]
        except ConnectionResetError:
            pass
        finally:
            raw.close()

    def cut(self, argument: tuple[float, bool]) -> None:
        """A valid PUBLISH cut short by the client's leaving: never applied."""
        share, looped = argument
        raw = self._connection(looped)
        frame = _publish_frame(self.token, self.request(3))
        raw.send(frame[: int(len(frame) * share)])
        raw.close()

    def stream(self, argument: tuple[int, bool]) -> None:
        batches, looped = argument
        raw = self._connection(looped)
        try:
            producer = os.urandom(16)
            requests = []
            for sequence in range(1, batches + 1):
                requests.append(self.request(2, producer, sequence))
                self._acked(2)
            raw.send(_stream_frame(self.token) + _batch_frame(*requests) + frames.frame(frames.END))
            answered = []
            while len(answered) < batches:
                kind, body = raw.read()
                assert kind == frames.ACKS, frames.parse_error(body)
                answered += [ack.sequence for ack in pb.PublishAcks.FromString(body).responses]
            assert answered == list(range(1, batches + 1))
            assert raw.closed_by_node()  # after the END, once all is answered
        finally:
            raw.close()

    def _acked(self, count: int) -> None:
        self.acked += range(self.next_key, self.next_key + count)
        self.next_key += count


@pytest.mark.cluster
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=_OPERATIONS)
def test_generated_frame_sequences_leave_exactly_the_answered_rows(
    cluster: LocalCluster, operations: list[tuple[str, Any]]
) -> None:
    """Random sequences of good publishes, refused ones, garbage, frames cut short and
    streams, on one node: every replica ends holding exactly the rows that were answered,
    once and in order."""
    table = f"generated_{uuid.uuid4().hex[:12]}"
    cluster.create_table(table, SCHEMA)
    model = _Model(cluster, table)
    try:
        for operation, argument in operations:
            model.apply(operation, argument)
    finally:
        model.port.close()
    assert_replicas_hold_exactly(cluster, table, model.acked)


@pytest.mark.unit
def test_leaving_a_silent_site_while_its_port_is_dialled_ends_the_attempt() -> None:
    """A frozen node's kernel still accepts connections, and its greeting never comes; the
    session's hedge leaves the site meanwhile (drop). The attempt then fails at once with
    SiteUnavailable instead of going on over gRPC (a channel nobody would close)."""
    with socket.create_server(("127.0.0.1", 0)) as frozen:  # listens, never accepts
        ports = PublishPorts(ManualClock())
        site = "127.0.0.1:1"
        ports.learn(site, frozen.getsockname()[1])
        leave = threading.Timer(0.3, ports.drop, args=(site,))
        leave.start()
        with pytest.raises(SiteUnavailable, match="left this site"):
            ports.publish(site, _request(), "", timeout_s=5)
        leave.join()
        with pytest.raises(PortRefused):  # not left again: the port is just set aside
            ports.publish(site, _request(), "", timeout_s=5)
