"""A leader adds and sends a proposal on the proposing thread when no tick is running
(replication._SyncObj._applyCommand and the tick lock its poll lets go of). Three real
Raft members in this process, on loopback ports, with real journals: proposals from
several threads at once, racing the tick thread, are each applied exactly once, in each
thread's order, in the same order on every member."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hastream.errors import RaftStoreError
from raftstore.replica import RoleSignal
from raftstore.replication import RaftReplica, RaftSettings
from tests.harness import free_ports, wait_until
from tests.raft_members import RecordingHooks


@dataclass
class _Member:
    replica: RaftReplica
    hooks: RecordingHooks


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[_Member]]:
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    built: list[_Member] = []
    try:
        for index, address in enumerate(addresses):
            settings = RaftSettings(
                group_id=2,
                self_address=address,
                peer_addresses=tuple(a for a in addresses if a != address),
                directory=tmp_path / f"member{index}",
                secret="proposing-thread-test",
                election_timeout_s=1.0,
                checkpoint_interval_s=3600.0,
            )
            hooks = RecordingHooks()
            built.append(_Member(RaftReplica(settings, hooks, RoleSignal()), hooks))
        yield built
    finally:
        for member in built:
            member.replica.close()


def _leader(members: list[_Member]) -> _Member:
    wait_until(lambda: any(m.replica.is_leader_ready() for m in members), timeout_s=30)
    return next(m for m in members if m.replica.is_leader_ready())


@dataclass
class _Outcomes:
    lock: threading.Lock = field(default_factory=threading.Lock)
    results: dict[bytes, Any] = field(default_factory=dict)
    errors: list[RaftStoreError] = field(default_factory=list)

    def callback(self, command: bytes) -> Any:
        def done(result: Any, error: RaftStoreError | None) -> None:
            with self.lock:
                if error is not None:
                    self.errors.append(error)
                else:
                    assert command not in self.results, "answered twice"
                    self.results[command] = result

        return done


def test_a_proposal_made_while_a_tick_runs_is_left_to_that_tick(members: list[_Member]) -> None:
    leader = _leader(members)
    outcomes = _Outcomes()
    tick_lock = leader.replica._sync_obj._tick_lock
    with tick_lock:  # as the tick thread holds it for a tick, all but its poll's wait
        before = leader.replica.last_log_index()
        leader.replica.propose(b"during-a-tick", outcomes.callback(b"during-a-tick"))
        assert leader.replica.last_log_index() == before, "added beside a running tick"
    # The tick thread, woken by its pipe, adds and commits it.
    wait_until(lambda: b"during-a-tick" in outcomes.results, timeout_s=10)
    assert not outcomes.errors
    wait_until(lambda: all(b"during-a-tick" in m.hooks.applied for m in members), timeout_s=10)


def test_proposals_racing_the_tick_are_applied_once_in_order_on_every_member(
    members: list[_Member],
) -> None:
    leader = _leader(members)
    outcomes = _Outcomes()
    threads_count, per_thread = 4, 250
    start = threading.Barrier(threads_count)

    def propose(thread: int) -> None:
        start.wait()
        for number in range(per_thread):
            command = b"t%d-%04d" % (thread, number)
            leader.replica.propose(command, outcomes.callback(command))

    threads = [threading.Thread(target=propose, args=(n,)) for n in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = threads_count * per_thread
    wait_until(lambda: len(outcomes.results) + len(outcomes.errors) == total, timeout_s=60)
    assert not outcomes.errors
    wait_until(
        lambda: all(len([c for c in m.hooks.applied if c[:1] == b"t"]) == total for m in members),
        timeout_s=30,
    )
    orders = [[c for c in m.hooks.applied if c[:1] == b"t"] for m in members]
    assert orders[0] == orders[1] == orders[2], "the members applied different sequences"
    assert len(set(orders[0])) == total, "a proposal was applied twice"
    for thread in range(threads_count):
        own = [c for c in orders[0] if c.startswith(b"t%d-" % thread)]
        assert own == sorted(own), f"thread {thread}'s proposals were reordered"
    # Each proposer was answered with the LSN its command was applied at, on the leader.
    lsns = [outcomes.results[c] for c in orders[0]]
    assert lsns == sorted(lsns)
