"""Raft peer links (replication.py's TcpConnection patches) on real loopback sockets, and the
failover they make one election long on a real cluster."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pysyncobj.poller import PollPoller
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection

from raftstore import limits, pysyncobj_patches
from tests.harness import LocalCluster, wait_until

TIMEOUT_S = 5.0


@dataclass
class Link:
    """A pysyncobj connection on one end of a loopback TCP pair; `peer` is the other end."""

    connection: TcpConnection
    peer: socket.socket
    disconnects: list[bool] = field(default_factory=list)

    @property
    def connected(self) -> bool:
        return bool(self.connection.state == CONNECTION_STATE.CONNECTED)

    def go_silent(self) -> None:
        """As if nothing had been read on the link for longer than its timeout."""
        self.connection._TcpConnection__lastReadTime -= 2 * TIMEOUT_S


@pytest.fixture
def link() -> Iterator[Link]:
    pysyncobj_patches.install()
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    ours.setblocking(False)
    disconnects: list[bool] = []
    connection = TcpConnection(
        PollPoller(),
        onDisconnected=lambda: disconnects.append(True),
        socket=ours,
        timeout=TIMEOUT_S,
    )
    yield Link(connection, peer, disconnects)
    connection.disconnect()
    peer.close()


def test_first_message_on_an_idle_link_is_sent_not_dropped(link: Link) -> None:
    # Two followers never talk between elections; the candidate's vote request must get out.
    link.go_silent()
    link.connection.send({"type": "request_vote", "term": 7})
    assert link.connected
    link.peer.settimeout(TIMEOUT_S)
    assert link.peer.recv(1 << 16)


def test_a_peer_that_stops_answering_what_we_send_is_dropped(link: Link) -> None:
    link.connection.send({"type": "append_entries"})
    link.go_silent()  # we keep sending; nothing comes back (a SIGSTOPped follower)
    link.connection.send({"type": "append_entries"})
    assert not link.connected
    assert link.disconnects == [True]


def test_a_silent_link_with_bytes_waiting_is_kept(link: Link) -> None:
    # The reply to our vote request arrives after a long silence: read it, do not drop it.
    link.connection.send({"type": "request_vote"})
    link.peer.sendall(b"\x00\x00\x00\x00")
    wait_until(
        lambda: pysyncobj_patches._bytes_waiting(link.connection._TcpConnection__socket),
        timeout_s=TIMEOUT_S,
    )
    link.go_silent()
    link.connection._TcpConnection__processConnectionTimeout()
    assert link.connected


def test_send_buffer_past_the_cap_drops_the_link(
    link: Link, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 1 << 20
    monkeypatch.setattr(limits, "RAFT_SEND_BUFFER_BYTES_MAX", cap)
    # The peer never reads: the kernel buffers fill, then pysyncobj's own buffer grows.
    chunk = b"x" * (256 << 10)
    for _ in range(400):
        link.connection.send({"type": "append_entries", "data": chunk})
        if not link.connected:
            break
    assert not link.connected, "the link outlived 100 MiB of unread sends"
    assert link.connection.getSendBufferSize() == 0  # memory released


@pytest.mark.cluster
def test_leader_kill_on_an_idle_cluster_takes_one_election(tmp_path: Path) -> None:
    """Before the fix, the vote request on the idle follower-follower link was dropped and
    the first election after a leader kill always failed. A split vote (both followers
    timing out together) can also cost a term on a loaded machine, by chance: so the kill
    is tried up to three times, and one single-election failover shows the link works."""
    cluster = LocalCluster(tmp_path / "cluster", election_timeout_s=0.5).start()
    terms_taken: list[int] = []
    try:
        for _ in range(3):
            leader = cluster.leader()
            term = cluster.group_status(leader, 2)["term"]
            # Let the follower-follower link idle past connectionTimeout (2 x 0.5 s).
            idle_since = time.monotonic()
            wait_until(lambda since=idle_since: time.monotonic() - since > 2.5, timeout_s=10)
            cluster.kill(leader)
            new_leader = cluster.leader(timeout_s=30)
            assert new_leader != leader
            terms_taken.append(cluster.group_status(new_leader, 2)["term"] - term)
            if terms_taken[-1] == 1:
                break
            cluster.start_node(leader)
        assert 1 in terms_taken, f"no failover took one election: terms taken {terms_taken}"
    finally:
        cluster.stop()


def _connected_pair(
    poller: PollPoller, received: list[object]
) -> tuple[TcpConnection, TcpConnection]:
    """Two patched connections on a loopback socket pair, polled by `poller`: the second
    appends what it receives to `received`."""
    pysyncobj_patches.install()
    left, right = socket.socketpair()
    left.setblocking(False)
    right.setblocking(False)
    sender = TcpConnection(poller, socket=left, timeout=TIMEOUT_S)
    receiver = TcpConnection(
        poller, socket=right, onMessageReceived=received.append, timeout=TIMEOUT_S
    )
    return sender, receiver


def test_messages_of_any_size_cross_a_link_whole_and_in_order() -> None:
    """Two patched connections on a loopback pair, encrypted as between nodes: a frame of many
    MiB (received in place, sent in pieces) between small ones."""
    poller = PollPoller()
    received: list[object] = []
    sender, receiver = _connected_pair(poller, received)
    sender.encryptor = receiver.encryptor = pysyncobj_patches.AesGcmEncryptor("link-secret")
    messages = [
        {"type": "append_entries", "entries": [(bytes([n]) * size, n, 1)]}
        for n, size in enumerate([10, 9 << 20, 3, 300_000, 0, 5 << 20, 1])
    ]
    try:
        for message in messages:
            sender.send(message)
        deadline = time.monotonic() + 30
        while len(received) < len(messages) and time.monotonic() < deadline:
            poller.poll(0.05)
        assert received == messages
        assert sender.getSendBufferSize() == 0
    finally:
        sender.disconnect()
        receiver.disconnect()


class _CountingAead:
    """AESGCM that counts the encryptions of split-token pieces."""

    def __init__(self, aead: object) -> None:
        self.aead = aead
        self.pieces_sealed = 0

    def encrypt(self, nonce: bytes, data: bytes, associated: bytes) -> bytes:
        if associated == pysyncobj_patches.AesGcmEncryptor._PIECE_AAD:
            self.pieces_sealed += 1
        return self.aead.encrypt(nonce, data, associated)  # type: ignore[attr-defined, no-any-return]

    def decrypt(self, nonce: bytes, data: bytes, associated: bytes) -> bytes:
        return self.aead.decrypt(nonce, data, associated)  # type: ignore[attr-defined, no-any-return]


def test_a_leader_seals_an_entry_once_for_all_its_followers() -> None:
    """One encryptor for every link of a Raft group, as pysyncobj's SyncObj has: an entry sent
    to two followers in one tick is encrypted once, and each follower gets it whole, between
    and after messages that travel as one token."""
    poller = PollPoller()
    received: list[list[object]] = [[], []]
    pairs = [_connected_pair(poller, received[0]), _connected_pair(poller, received[1])]
    leader = pysyncobj_patches.AesGcmEncryptor("link-secret")
    counting = _CountingAead(leader._aead)
    leader._aead = counting  # type: ignore[assignment]
    for sender, receiver in pairs:
        sender.encryptor = leader
        receiver.encryptor = pysyncobj_patches.AesGcmEncryptor("link-secret")
    entry = (b"e" * (3 << 20), 9, 2)
    ticks = [
        {"type": "append_entries", "entries": [(b"small", 8, 2), entry]},
        {"type": "append_entries", "term": 2, "commit_index": 9},
        {"type": "append_entries", "entries": [(b"x" * (1 << 20), 10, 2), (b"y" * 10, 11, 2)]},
    ]
    try:
        for message in ticks:
            for sender, _ in pairs:
                sender.send(message)
            leader.forget_pieces()  # the tick ends (replication._SyncObj._onTick)
        deadline = time.monotonic() + 30
        while any(len(got) < len(ticks) for got in received) and time.monotonic() < deadline:
            poller.poll(0.05)
        assert received == [ticks, ticks]
        assert counting.pieces_sealed == 2  # the 3 MiB and the 1 MiB command, once each
    finally:
        for sender, receiver in pairs:
            sender.disconnect()
            receiver.disconnect()


def test_a_frame_larger_than_the_socket_buffers_goes_out_whole_with_no_later_send() -> None:
    """pysyncobj polls a link for writability only until its buffer first runs empty; a
    later frame that does not fit the socket's buffers must still go out whole, through the
    poller, without waiting for the next message (a heartbeat, up to appendEntriesPeriod
    later, on each multi-MiB entry)."""
    poller = PollPoller()
    received: list[object] = []
    sender, receiver = _connected_pair(poller, received)
    message = {"type": "append_entries", "entries": [(b"x" * (16 << 20), 1, 1)]}
    try:
        poller.poll(0)  # the first (empty) write event: the link is polled for reads only
        sender.send(message)
        assert sender.getSendBufferSize() > 0, "the frame fit the socket buffers"
        deadline = time.monotonic() + 30
        while not received and time.monotonic() < deadline:
            poller.poll(0.05)
        assert received == [message]
        assert sender.getSendBufferSize() == 0
    finally:
        sender.disconnect()
        receiver.disconnect()
