"""pysyncobj_patches.py: the version guard, and one test per patch (the GMAC authenticator
and the link timeouts have their own files: test_peer_auth.py, test_peer_links.py)."""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

import pysyncobj.pickle as pysyncobj_pickle
import pysyncobj.poller as pysyncobj_poller
import pysyncobj.syncobj as pysyncobj_syncobj
import pysyncobj.tcp_connection as pysyncobj_tcp_connection
import pysyncobj.tcp_server as pysyncobj_tcp_server
import pysyncobj.transport as pysyncobj_transport
import pytest
from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.node import TCPNode
from pysyncobj.pipe_notifier import PipeNotifier

from raftstore import limits, pysyncobj_patches
from raftstore.pysyncobj_patches import PysyncobjJournal, UnsupportedPysyncobj
from raftstore.storage.journal import DurableJournal


def test_the_installed_pysyncobj_is_the_one_the_patches_were_written_for() -> None:
    pysyncobj_patches.check_pysyncobj()


def test_another_pysyncobj_version_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedPysyncobj, match=r"0\.3\.99 is installed.*0\.3\.17"):
        pysyncobj_patches.check_pysyncobj("0.3.99")


def test_every_private_method_the_patches_replace_or_call_exists() -> None:
    for name in pysyncobj_patches.SYNCOBJ_METHODS:
        assert callable(getattr(SyncObj, name)), name


def test_every_private_attribute_the_adapter_touches_exists_on_a_live_syncobj(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # As replication.py configures it (the pipe notifier exists only without batching).
    conf = SyncObjConf(
        autoTick=False, journalFile=str(tmp_path / "journal"), appendEntriesUseBatch=False
    )
    member = SyncObj(f"127.0.0.1:{port}", [], conf=conf)
    try:
        for name in pysyncobj_patches.SYNCOBJ_ATTRIBUTES:
            assert hasattr(member, name), name
        for name in pysyncobj_patches.POLLER_ATTRIBUTES:
            assert hasattr(member._poller, name), name
        queue = member._SyncObj__commandsQueue
        assert hasattr(queue, pysyncobj_patches.QUEUE_ATTRIBUTE)
        serializer = member._SyncObj__serializer
        assert hasattr(serializer, pysyncobj_patches.SERIALIZER_PID_ATTRIBUTE)
    finally:
        member.destroy()


def test_install_replaces_the_module_globals() -> None:
    pysyncobj_patches.install()
    assert getattr(pysyncobj_pickle, "__protocol") == 5
    assert pysyncobj_tcp_connection.zlib is pysyncobj_patches._NoCompression
    assert pysyncobj_syncobj.createJournal is pysyncobj_patches._create_journal
    assert pysyncobj_syncobj.getEncryptor is pysyncobj_patches.AesGcmEncryptor
    connection = pysyncobj_tcp_connection.TcpConnection
    assert connection.send is pysyncobj_patches._connection_send
    timeout = connection._TcpConnection__processConnectionTimeout
    assert timeout is pysyncobj_patches._connection_timeout
    assert connection._TcpConnection__processRead is pysyncobj_patches._connection_read
    transport = pysyncobj_transport.TCPTransport
    assert transport._onNewIncomingConnection is pysyncobj_patches._incoming_connection
    assert transport._onTick is pysyncobj_patches._transport_tick
    pysyncobj_patches.install()  # idempotent


def test_messages_are_not_compressed() -> None:
    data = b"\x00" * 1000
    assert pysyncobj_patches._NoCompression.compress(data) is data
    assert pysyncobj_patches._NoCompression.decompress(data) is data


def test_the_journal_adapter_maps_pysyncobj_calls_onto_the_durable_journal(
    tmp_path: Path,
) -> None:
    journal = PysyncobjJournal(DurableJournal(tmp_path / "journal"))
    for idx in range(1, 6):
        journal.add(b"entry%d" % idx, idx, 1)
    journal.flush()
    assert len(journal) == 5
    assert journal[0] == (b"entry1", 1, 1)
    journal.deleteEntriesFrom(3)  # pysyncobj: drop positions 3.. (a conflicting tail)
    assert [entry[1] for entry in journal[:]] == [1, 2, 3]
    journal.deleteEntriesTo(1)  # pysyncobj: drop positions ..1 (compaction)
    assert [entry[1] for entry in journal[:]] == [2, 3]
    journal.setCurrentTerm(4, "node2")
    journal.setRaftCommitIndex(3)
    assert (journal.getCurrentTerm(), journal.getVotedForNodeId()) == (4, "node2")
    assert journal.getRaftCommitIndex() == 3
    journal.onOneSecondTimer()
    journal._destroy()
    reopened = DurableJournal(tmp_path / "journal")
    assert [entry[1] for entry in reopened[:]] == [2, 3]
    assert reopened.term == 4
    reopened.close()


class _AcceptFails:
    """The listening socket, but its next accept fails as with no file descriptor left."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock

    def accept(self) -> tuple[socket.socket, object]:
        raise OSError(errno.EMFILE, "Too many open files")

    def __getattr__(self, name: str) -> object:
        return getattr(self._socket, name)


def test_a_raft_listener_closed_by_a_failed_accept_is_bound_again(tmp_path: Path) -> None:
    pysyncobj_patches.install()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = SyncObjConf(autoTick=False, journalFile=str(tmp_path / "journal"))
    member = SyncObj(f"127.0.0.1:{port}", [], conf=conf)
    try:
        transport = member._SyncObj__transport
        deadline = time.monotonic() + 10
        while not transport.ready and time.monotonic() < deadline:
            member.doTick(0.05)
        server = transport._server
        server._TcpServer__socket = _AcceptFails(server._TcpServer__socket)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            member.doTick(0.2)  # pysyncobj's accept fails: it closes its listener
        assert server._TcpServer__state == pysyncobj_tcp_server.SERVER_STATE.UNBINDED
        with socket.socket() as refused:
            assert refused.connect_ex(("127.0.0.1", port)) != 0
        deadline = time.monotonic() + 5
        while server._TcpServer__state != pysyncobj_tcp_server.SERVER_STATE.BINDED:
            assert time.monotonic() < deadline, "the listener was not bound again"
            member.doTick(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            member.doTick(0.05)  # accepted: the node takes peers' links again
        assert transport.ready
    finally:
        member.destroy()


def test_the_clock_is_the_one_pysyncobj_reads_without_a_python_frame() -> None:
    pysyncobj_patches.install()
    for module in (pysyncobj_syncobj, pysyncobj_tcp_connection, pysyncobj_transport):
        clock = module.monotonicTime
        assert clock is pysyncobj_patches._MONOTONIC_RAW, module
        before = time.clock_gettime(time.CLOCK_MONOTONIC_RAW)
        assert before <= clock() <= time.clock_gettime(time.CLOCK_MONOTONIC_RAW)


def test_nodes_hash_and_compare_by_id() -> None:
    pysyncobj_patches.install()
    first, same = TCPNode("127.0.0.1:5000"), TCPNode("127.0.0.1:5000")
    other = TCPNode("127.0.0.1:5001")
    assert first == same
    assert hash(first) == hash(same) == hash("127.0.0.1:5000")
    assert first != other
    assert first != "127.0.0.1:5000"  # not a Node
    assert {first: 1}[same] == 1
    assert same in {first, other}
    assert len({first, same, other}) == 2


def test_the_connection_upkeep_runs_once_per_interval_while_ready(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Real transports: a member's, bound, and a second one on the member whose port another
    # socket holds, so it stays unready. pysyncobj's upkeep is counted on its way through,
    # and the patch's clock is held still, then moved by one interval.
    pysyncobj_patches.install()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conf = SyncObjConf(autoTick=False, journalFile=str(tmp_path / "journal"))
    member = SyncObj(f"127.0.0.1:{port}", [], conf=conf)  # returns once its port is bound
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = TCPNode(f"127.0.0.1:{holder.getsockname()[1]}")
        binding = pysyncobj_transport.TCPTransport(member, held, [])
        try:
            ready = member._SyncObj__transport
            assert ready.ready
            names = {id(ready): "ready", id(binding): "binding"}
            upkeep: list[str] = []
            real_tick = pysyncobj_patches._original_transport_tick

            def counted(transport: pysyncobj_transport.TCPTransport) -> None:
                upkeep.append(names[id(transport)])
                real_tick(transport)

            monkeypatch.setattr(pysyncobj_patches, "_original_transport_tick", counted)
            now = [time.monotonic() + 1000.0]  # past any upkeep time set before
            monkeypatch.setattr(pysyncobj_patches, "_MONOTONIC_RAW", lambda: now[0])
            for _ in range(3):
                pysyncobj_patches._transport_tick(ready)
                pysyncobj_patches._transport_tick(binding)  # not ready: every tick tries
            assert not binding.ready
            assert upkeep == ["ready", "binding", "binding", "binding"]
            now[0] += limits.RAFT_TRANSPORT_TICK_S
            pysyncobj_patches._transport_tick(ready)
            assert upkeep == ["ready", "binding", "binding", "binding", "ready"]
        finally:
            binding.destroy()
            member.destroy()


def test_the_wake_up_pipe_is_read_once_per_event_and_never_left_readable() -> None:
    pysyncobj_patches.install()
    poller = pysyncobj_poller.createPoller("auto")
    woken: list[int] = []
    notifier = PipeNotifier(poller, callback=lambda: woken.append(1))
    # The kernel's own count of this thread's read system calls; reading it costs one.
    own_read = _reads_of_this_thread() - _reads_of_this_thread()
    try:
        for burst in (1, 3, pysyncobj_patches._NOTIFICATIONS_READ_BYTES + 10):
            woken.clear()
            for _ in range(burst):
                notifier.notify()
            before = _reads_of_this_thread()
            for _ in range(3):  # a burst past one read's worth takes a second event
                poller.poll(0)
            reads = _reads_of_this_thread() - before + own_read
            events = 1 if burst <= pysyncobj_patches._NOTIFICATIONS_READ_BYTES else 2
            assert len(woken) == reads == events, burst  # no read only for EAGAIN
    finally:
        os.close(notifier._PipeNotifier__pipeR)
        os.close(notifier._PipeNotifier__pipeW)


def _reads_of_this_thread() -> int:
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("no syscr in /proc/thread-self/io")
