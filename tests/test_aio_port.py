"""The asyncio client's publishes over the publish port (api_clients/aio_port.py): what
its connections do on a request cut short, an error answer and the bound (plain listening
sockets answering as a port would, scripted), and real nodes answering `api_clients.aio`
sessions through a leader kill and a frozen leader. The rules it shares with the threaded
client's port (a port nobody listens on, another service, a connection lost after the
request) are tested for both in tests/test_publish_port.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from api_clients import aio
from api_clients.aio_port import AioPublishPorts
from api_clients.publish_port import CONNECTIONS_PER_SITE_MAX, PortRefused
from api_clients.transport import DeadlineExceeded
from hastream import publish_frames as frames
from hastream.errors import InvalidArgument, NotLeader, RaftStoreError
from proto import hastream_pb2 as pb
from tests.harness import (
    LocalCluster,
    ManualClock,
    assert_replicas_hold_exactly,
    cluster_with_logins,
    ipc_stream,
    publish_through_faults,
)

ADMIN_PASSWORD = "aio-port-admin"
SCHEMA = pa.schema([("id", pa.int64()), ("sym", pa.string())])
SITE = "127.0.0.1:1"


def rows(first: int, count: int) -> pa.Table:
    ids = list(range(first, first + count))
    return pa.table({"id": ids, "sym": [f"s{i}" for i in ids]}, schema=SCHEMA)


def _request() -> pb.PublishRequest:
    return pb.PublishRequest(table="t", payload=ipc_stream(rows(0, 1)))


class _Peer:
    """A listening socket whose connections `serve(connection)` handles, one thread each;
    counts the connections it accepted."""

    def __init__(self, serve: Any) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.server.getsockname()[1])
        self.accepted = 0
        self._serve = serve
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            threading.Thread(target=self._served, args=(connection,), daemon=True).start()

    def _served(self, connection: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the client closed it: a test's own doing
            self._serve(connection)

    def close(self) -> None:
        frames.shut(self.server)


def _greet(connection: socket.socket) -> None:
    connection.recv(1024)
    connection.sendall(frames.frame(frames.HELLO, frames.BANNER + b" node9"))


def _read_request(connection: socket.socket) -> bool:
    """Reads one PUBLISH frame; False when the client left."""
    head = connection.recv(frames.HEADER.size, socket.MSG_WAITALL)
    if len(head) < frames.HEADER.size:
        return False
    _, length = frames.parse_header(head, frames.FRAME_BYTES_MAX)
    return len(connection.recv(length, socket.MSG_WAITALL)) == length


def _answering(kind: int, body: bytes) -> Any:
    """A port that greets and answers every request with one frame."""

    def serve(connection: socket.socket) -> None:
        with connection:
            _greet(connection)
            while _read_request(connection):
                connection.sendall(frames.frame(kind, body))

    return serve


@pytest.mark.unit
def test_no_answer_in_time_is_deadline_exceeded_and_that_connection_is_not_used_again() -> None:
    """A late answer must never be read as the next request's: the connection of a request
    that timed out (or whose task was cancelled) is closed, and the next request dials."""
    answer = pb.PublishResponse(first_offset=7).SerializeToString()
    requests = 0

    def first_silent(connection: socket.socket) -> None:
        nonlocal requests
        with connection:
            _greet(connection)
            while _read_request(connection):
                requests += 1
                if requests > 1:
                    connection.sendall(frames.frame(frames.ANSWER, answer))

    peer = _Peer(first_silent)

    async def scenario() -> None:
        ports = AioPublishPorts(ManualClock())
        ports.learn(SITE, peer.port)
        with pytest.raises(DeadlineExceeded):
            await ports.publish(SITE, _request(), "", timeout_s=0.3)
        assert (await ports.publish(SITE, _request(), "", timeout_s=5)).first_offset == 7
        task = asyncio.ensure_future(ports.publish(SITE, _request(), "", timeout_s=5))
        await asyncio.sleep(0)  # it holds the (healthy) pooled connection now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await ports.publish(SITE, _request(), "", timeout_s=5)).first_offset == 7
        await ports.close()

    try:
        asyncio.run(scenario())
    finally:
        peer.close()
    assert peer.accepted == 3  # the timed-out and the cancelled request's were closed


@pytest.mark.unit
def test_a_typed_error_keeps_the_connection_and_an_error_about_the_frame_does_not() -> None:
    refusal = frames.error_body(NotLeader("127.0.0.1:9"))
    peer = _Peer(_answering(frames.ERROR, refusal))
    about_the_frame = InvalidArgument("publish port frame", "frame of 9 bytes")
    garbage_peer = _Peer(_answering(frames.ERROR, frames.error_body(about_the_frame)))

    async def scenario() -> None:
        ports = AioPublishPorts(ManualClock())
        ports.learn(SITE, peer.port)
        ports.learn("127.0.0.1:2", garbage_peer.port)
        for _ in range(3):
            with pytest.raises(NotLeader) as raised:
                await ports.publish(SITE, _request(), "", timeout_s=5)
            assert raised.value.leader == "127.0.0.1:9"
            with pytest.raises(RaftStoreError, match="frame of 9 bytes"):
                await ports.publish("127.0.0.1:2", _request(), "", timeout_s=5)
        await ports.close()

    try:
        asyncio.run(scenario())
    finally:
        peer.close()
        garbage_peer.close()
    assert (peer.accepted, garbage_peer.accepted) == (1, 3)


@pytest.mark.unit
def test_a_request_cancelled_while_its_connection_is_greeted_leaves_nothing_behind() -> None:
    """Cancelled during the dial's greeting, more often than the bound: every half-greeted
    connection is closed (the peer sees it end), and none is counted against the bound."""
    ended: list[bytes] = []
    greeting = threading.Event()

    def slow_greeting(connection: socket.socket) -> None:
        with connection:
            connection.recv(1024)  # the client's HELLO
            greeting.set()
            ended.append(connection.recv(1024))  # b"": the client closed it

    peer = _Peer(slow_greeting)

    async def scenario() -> None:
        ports = AioPublishPorts(ManualClock())
        ports.learn(SITE, peer.port)
        for _ in range(CONNECTIONS_PER_SITE_MAX + 1):
            greeting.clear()
            task = asyncio.ensure_future(ports.publish(SITE, _request(), "", timeout_s=10))
            while not greeting.is_set():
                assert not task.done(), "the publish ended without dialling"  # the bound?
                await asyncio.sleep(0.01)
            closed = len(ended) + 1  # this connection's peer waits for its end
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(1000):  # up to 10 s, the loop running: closed now, not at its end
                if len(ended) == closed:
                    break
                await asyncio.sleep(0.01)
            assert len(ended) == closed, "a cancelled dial's connection stayed open"
        await ports.close()

    try:
        asyncio.run(scenario())
    finally:
        peer.close()
    assert ended == [b""] * (CONNECTIONS_PER_SITE_MAX + 1)
    assert peer.accepted == CONNECTIONS_PER_SITE_MAX + 1  # never refused by the bound


@pytest.mark.unit
def test_at_most_connections_per_site_max_requests_use_a_site_at_once() -> None:
    """Beyond the bound a request is refused before anything is sent (gRPC takes it)."""
    release = threading.Event()
    answer = pb.PublishResponse(first_offset=1).SerializeToString()

    def slow(connection: socket.socket) -> None:
        with connection:
            _greet(connection)
            while _read_request(connection):
                release.wait(10)
                connection.sendall(frames.frame(frames.ANSWER, answer))

    peer = _Peer(slow)

    async def scenario() -> None:
        ports = AioPublishPorts(ManualClock())
        ports.learn(SITE, peer.port)
        held = [
            asyncio.ensure_future(ports.publish(SITE, _request(), "", timeout_s=10))
            for _ in range(CONNECTIONS_PER_SITE_MAX)
        ]
        await asyncio.sleep(0)
        with pytest.raises(PortRefused):
            await ports.publish(SITE, _request(), "", timeout_s=10)
        release.set()
        assert [(await task).first_offset for task in held] == [1] * CONNECTIONS_PER_SITE_MAX
        await ports.close()

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        peer.close()
    assert peer.accepted == CONNECTIONS_PER_SITE_MAX


# --- real nodes, logins on ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with cluster_with_logins(tmp_path_factory.mktemp("aio-port"), ADMIN_PASSWORD) as local:
        yield local


def _answered(cluster: LocalCluster) -> int:
    return sum(cluster.status(alias)["publish_port"]["answered"] for alias in cluster.alive())


async def _session(cluster: LocalCluster, **options: Any) -> aio.AioSession:
    sites = [node.site for node in cluster.nodes.values()]
    session = aio.AioSession(sites, userid="admin", password=ADMIN_PASSWORD, **options)
    await session.login()
    return session


@pytest.mark.cluster
def test_waited_appends_go_over_the_port_after_the_first_and_land_once_everywhere(
    cluster: LocalCluster,
) -> None:
    cluster.create_table("aio_port", SCHEMA, key_column="id")
    before = _answered(cluster)
    term = cluster.highest_term()

    async def scenario() -> None:
        session = await _session(cluster)
        try:
            for key in range(100):  # the first over gRPC, whose answer names the port
                result = await session.append("aio_port", [(key, f"s{key}")])
                assert (result.first_offset, result.row_count) == (key, 1)
            again = await session.append("aio_port", rows(95, 10))  # 95..99 are known keys
            assert (again.row_count, again.duplicates) == (5, 5)
        finally:
            await session.close()

    asyncio.run(scenario())
    # A new leader (an election on a starved machine) is learned through one more gRPC
    # Publish, whose answer names its port: each costs the port one answer.
    elections = cluster.highest_term() - term
    assert 100 - elections <= _answered(cluster) - before <= 100
    assert_replicas_hold_exactly(cluster, "aio_port", list(range(105)))


@pytest.mark.cluster
def test_no_acknowledged_row_is_lost_when_the_leader_is_killed_then_frozen(
    cluster: LocalCluster,
) -> None:
    """Waited appends of the asyncio client over the port while the leader is killed (-9)
    and, once it is back, the next leader frozen (SIGSTOP): the frozen leader's port
    answers nothing, the attempt's timeout moves the session on (the asyncio client does
    not hedge), and every row it was told is committed is on every replica once, in
    order."""
    cluster.create_table("aio_faults", SCHEMA, key_column="id")

    async def appends(
        stop: threading.Event, acked: list[int], failures: list[BaseException]
    ) -> None:
        session = await _session(cluster, timeout_s=1.0, deadline_s=60.0)
        try:
            key = 0
            while not stop.is_set():
                try:
                    await session.append("aio_faults", [(key, "f")])
                except RaftStoreError as error:  # the deadline passed: not acknowledged
                    failures.append(error)
                    continue  # the same key again: the table's key drops a repeat
                acked.append(key)
                key += 1
        finally:
            await session.close()

    def publish(stop: threading.Event, acked: list[int], failures: list[BaseException]) -> None:
        asyncio.run(appends(stop, acked, failures))

    before = _answered(cluster)
    acked = publish_through_faults(cluster, publish, step=150)
    assert _answered(cluster) > before
    assert_replicas_hold_exactly(cluster, "aio_faults", acked)
