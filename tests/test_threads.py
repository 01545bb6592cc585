"""The node's thread owner (raftstore/threads.py), and a node whose threads all end at stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from raftstore import config
from raftstore.node import Node
from raftstore.threads import Threads
from tests.harness import free_ports, wait_until


@pytest.mark.unit
def test_start_runs_the_target_in_a_named_daemon_thread() -> None:
    threads = Threads()
    seen: list[str] = []
    thread = threads.start("worker", lambda: seen.append(threading.current_thread().name))
    assert thread.name == "worker"
    assert thread.daemon
    assert threads.join(5.0) == []
    assert seen == ["worker"]


@pytest.mark.unit
def test_join_waits_for_threads_told_to_stop() -> None:
    threads = Threads()
    stop = threading.Event()
    for name in ("a", "b"):
        threads.start(name, lambda: stop.wait(30))
    assert sorted(threads.alive()) == ["a", "b"]
    stop.set()
    assert threads.join(10.0) == []
    assert threads.alive() == []


@pytest.mark.unit
def test_join_gives_up_at_one_deadline_for_all_and_names_the_threads_left() -> None:
    threads = Threads()
    release = threading.Event()
    names = [f"stuck-{number}" for number in range(5)]
    for name in names:
        threads.start(name, lambda: release.wait(30))
    started = time.monotonic()
    left = threads.join(0.2)
    elapsed = time.monotonic() - started
    assert left == names
    # One deadline in all: a deadline per thread would have taken 5 x 0.2 s.
    assert elapsed < 0.9, elapsed
    release.set()
    assert threads.join(10.0) == []


@pytest.mark.unit
def test_finished_threads_are_forgotten_when_the_next_one_starts() -> None:
    threads = Threads()
    for number in range(20):
        threads.start(f"job-{number}", lambda: None).join(5.0)
    stop = threading.Event()
    threads.start("long", lambda: stop.wait(30))
    assert [thread.name for thread in threads._threads] == ["long"]
    stop.set()
    assert threads.join(10.0) == []


@pytest.mark.unit
def test_a_registered_thread_may_join_the_others_without_joining_itself() -> None:
    threads = Threads()
    result: list[list[str]] = []
    threads.start("joiner", lambda: result.append(threads.join(5.0))).join(10.0)
    assert result == [[]]


@pytest.mark.storage
def test_a_started_node_has_every_thread_joined_after_stop(tmp_path: Path) -> None:
    """One node of a three-node cluster, in this process, the other two never started:
    start() runs every long-lived thread (no quorum needed), stop() must end them all."""
    ports = free_ports(7)
    cfg = tmp_path / "cluster.cfg"
    cfg.write_text(
        "streamingHAMode=raft\nstreamingRaftGroups=2:n1:n2:n3\nstreamingRaftSecret=s\n"
        f"persistenceDir={tmp_path}/<ALIAS>/p\nstreamingHADir={tmp_path}/<ALIAS>/r\n"
        + "".join(
            f"n{i}.host=127.0.0.1\nn{i}.port={ports[i - 1]}\nn{i}.raftPorts=2:{ports[2 + i]}\n"
            for i in (1, 2, 3)
        )
        + f"n1.metricsPort={ports[6]}\n"
    )
    before = set(threading.enumerate())
    node = Node(config.load(cfg), "n1")
    try:
        node.start()
        owned = set(node._threads.alive())
        expected = {"local-replica", "batcher-0", "batcher-2", "status-http", "housekeeping"}
        assert owned >= expected | {"watch", "slow-consumers"}, owned
    finally:
        node.stop()
    assert node._threads.alive() == []
    # Nor any other thread the node started (gRPC's and pysyncobj's end within stop too).
    wait_until(
        lambda: not [thread for thread in threading.enumerate() if thread not in before],
        timeout_s=10,
        message="every thread the node started has ended",
    )
