"""A publish-port connection served by a Raft member's loop (raftstore/port_loop.py): its
bounds, its timeout and its end, on a real member (replication.RaftReplica, its tick
thread's poll) and a real socket pair. What it serves (publishes, streams, their answers
and errors) is tested through real nodes in tests/test_publish_port.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from hastream import publish_frames as frames
from hastream.errors import InvalidArgument, Overloaded, RaftStoreError
from raftstore import port_loop
from raftstore.group import WouldWait
from raftstore.port_loop import LoopedConnection
from raftstore.replication import RaftReplica
from raftstore.service import StartedPublish
from tests.harness import ManualClock, wait_until
from tests.raft_members import Acks, one_follower


@dataclass
class _PortCalls:
    """The publish port's side of a looped connection (publish_port.PublishPort), as far
    as these tests reach: no frame here gets as far as a publish."""

    forgotten: list[socket.socket] = field(default_factory=list)
    begun: list[tuple[bytes, bool]] = field(default_factory=list)
    leader_busy: bool = False  # as a leader that hands over: no answer without a wait

    def begin(self, body: bytes | bytearray, *, wait: bool = True) -> StartedPublish:
        self.begun.append((bytes(body), wait))
        if self.leader_busy and not wait:
            raise WouldWait(2)
        if body == b"bug":
            raise ValueError("a bug in serving a publish")
        raise InvalidArgument("publish request", "not served in this test")

    def answered(self) -> None:
        raise AssertionError("nothing is answered here")

    def serve_stream(self, connection: socket.socket, leftover: bytes, body: bytes) -> None:
        raise AssertionError("no stream here")

    def forget(self, connection: socket.socket) -> None:
        self.forgotten.append(connection)


@pytest.fixture
def member(monkeypatch: pytest.MonkeyPatch) -> Iterator[RaftReplica]:
    with one_follower(Acks(), monkeypatch) as replica:
        yield replica


@dataclass
class _Looped:
    client: socket.socket
    connection: LoopedConnection
    port: _PortCalls
    clock: ManualClock


@pytest.fixture
def looped(member: RaftReplica) -> Iterator[_Looped]:
    server, client = socket.socketpair()
    client.settimeout(10)
    port = _PortCalls()
    clock = ManualClock()
    host = member.connection_host()
    assert host is not None
    connection = LoopedConnection(server, b"", port, host, clock=clock)
    assert connection.start()
    try:
        yield _Looped(client, connection, port, clock)
    finally:
        client.close()


def _read_error(client: socket.socket) -> RaftStoreError:
    data = b""
    while len(data) < frames.HEADER.size:
        data += client.recv(frames.HEADER.size - len(data))
    kind, length = frames.parse_header(data, frames.FRAME_BYTES_MAX)
    body = b""
    while len(body) < length:
        body += client.recv(length - len(body))
    assert kind == frames.ERROR
    error = frames.parse_error(body)
    assert error is not None
    return error


def _closed_by_node(client: socket.socket) -> bool:
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True


def _released(member: RaftReplica, looped: _Looped) -> bool:
    hosted = member._sync_obj._hosted
    return looped.connection.fileno() not in hosted and looped.port.forgotten != []


def test_a_silent_connection_is_closed_after_the_idle_timeout(
    member: RaftReplica, looped: _Looped
) -> None:
    looped.clock.now += port_loop.IDLE_TIMEOUT_S - 1
    looped.client.settimeout(1.5)  # more than a tick's look at the timeouts
    with pytest.raises(TimeoutError):
        looped.client.recv(1)
    looped.client.settimeout(10)
    looped.clock.now += 2
    assert _closed_by_node(looped.client)
    wait_until(lambda: _released(member, looped), timeout_s=10)


def test_a_half_sent_frame_counts_as_silence(member: RaftReplica, looped: _Looped) -> None:
    looped.client.sendall(frames.header(frames.PUBLISH, 100) + b"x" * 10)
    wait_until(lambda: len(looped.connection._buffer) == frames.HEADER.size + 10, timeout_s=10)
    looped.clock.now += port_loop.IDLE_TIMEOUT_S + 1
    assert _closed_by_node(looped.client)
    wait_until(lambda: _released(member, looped), timeout_s=10)
    assert looped.port.begun == []


@pytest.mark.parametrize("declared", [5_000, 600_000])  # gathered, or received apart
def test_unanswered_bytes_past_the_bound_are_refused(
    member: RaftReplica, looped: _Looped, monkeypatch: pytest.MonkeyPatch, declared: int
) -> None:
    monkeypatch.setattr(port_loop, "BUFFERED_BYTES_MAX", 1_000)
    looped.client.sendall(frames.header(frames.PUBLISH, declared) + b"x" * 1_500)
    error = _read_error(looped.client)
    assert isinstance(error, Overloaded)
    assert error.limit == 1_000
    assert _closed_by_node(looped.client)
    wait_until(lambda: _released(member, looped), timeout_s=10)
    assert looped.port.begun == []


@pytest.mark.parametrize(
    "garbage",
    [
        frames.header(frames.ANSWER, 0),  # a kind only nodes send
        frames.header(frames.HELLO, 0),  # the greeting is over
        frames.header(99, 0),  # no kind at all
        frames.header(frames.PUBLISH, frames.FRAME_BYTES_MAX + 1),  # over the bound
    ],
)
def test_a_frame_that_is_not_a_publish_is_refused_and_ends_the_connection(
    member: RaftReplica, looped: _Looped, garbage: bytes
) -> None:
    looped.client.sendall(garbage)
    error = _read_error(looped.client)
    assert isinstance(error, InvalidArgument)
    assert error.argument == "publish port frame"
    assert _closed_by_node(looped.client)
    wait_until(lambda: _released(member, looped), timeout_s=10)
    assert looped.port.begun == []


def test_a_refused_publish_is_answered_and_the_connection_serves_on(
    member: RaftReplica, looped: _Looped
) -> None:
    looped.client.sendall(
        frames.frame(frames.PUBLISH, b"one") + frames.frame(frames.PUBLISH, b"two")
    )
    for _ in range(2):
        assert isinstance(_read_error(looped.client), InvalidArgument)
    assert looped.port.begun == [(b"one", False), (b"two", False)]
    assert looped.connection.fileno() in member._sync_obj._hosted


def test_big_frames_are_received_whole_and_served_in_order_with_the_small_ones(
    member: RaftReplica, looped: _Looped
) -> None:
    """A body past one read is received into a buffer of its own (port_loop._BigFrame);
    frames before and after it keep their order and bytes."""
    big = bytes(range(256)) * 2_400  # 614,400 bytes
    data = (
        frames.frame(frames.PUBLISH, b"before")
        + frames.frame(frames.PUBLISH, big)
        + frames.frame(frames.PUBLISH, b"after")
        + frames.frame(frames.PUBLISH, big[:300_000])
    )
    for start in range(0, len(data), 100_000):  # in pieces, as a slow client sends
        looped.client.sendall(data[start : start + 100_000])
    for _ in range(4):
        assert isinstance(_read_error(looped.client), InvalidArgument)
    assert looped.port.begun == [
        (b"before", False),
        (big, False),
        (b"after", False),
        (big[:300_000], False),
    ]


def test_a_publish_the_leader_would_hold_is_begun_on_a_thread_that_may_wait(
    member: RaftReplica, looped: _Looped
) -> None:
    """The loop's thread drives a leadership transfer and a new term's first apply: a
    publish that would wait for either is begun on a thread of its own, in its turn."""
    looped.port.leader_busy = True
    looped.client.sendall(
        frames.frame(frames.PUBLISH, b"one") + frames.frame(frames.PUBLISH, b"two")
    )
    for _ in range(2):
        assert isinstance(_read_error(looped.client), InvalidArgument)
    assert looped.port.begun == [(b"one", False), (b"one", True), (b"two", False), (b"two", True)]
    assert looped.connection.fileno() in member._sync_obj._hosted


def test_a_bug_in_serving_a_publish_ends_the_connection_not_the_raft_loop(
    member: RaftReplica, looped: _Looped
) -> None:
    looped.client.sendall(frames.frame(frames.PUBLISH, b"bug"))
    assert _closed_by_node(looped.client)
    wait_until(lambda: _released(member, looped), timeout_s=10)
    # The member's loop goes on: it still serves a new connection.
    server, client = socket.socketpair()
    client.settimeout(10)
    try:
        host = member.connection_host()
        assert host is not None
        other = LoopedConnection(server, b"", looped.port, host)
        assert other.start()
        client.sendall(frames.frame(frames.PUBLISH, b"after"))
        assert isinstance(_read_error(client), InvalidArgument)
    finally:
        client.close()


def test_the_peer_leaving_releases_the_connection(member: RaftReplica, looped: _Looped) -> None:
    looped.client.close()
    wait_until(lambda: _released(member, looped), timeout_s=10)


def test_a_closing_member_takes_no_connection_and_closes_those_it_serves(
    member: RaftReplica, looped: _Looped
) -> None:
    member.close()
    assert _closed_by_node(looped.client)
    server, client = socket.socketpair()
    try:
        host = member.connection_host()
        assert host is not None
        late = LoopedConnection(server, b"", _PortCalls(), host)
        assert not late.start()
    finally:
        server.close()
        client.close()
