"""Helpers for tests that run raftstore's Raft members (replication.RaftReplica) in the
test's own process, on loopback ports, with real journals."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from raftstore import replication
from raftstore.replica import RoleSignal, Snapshot
from raftstore.replication import RaftReplica, RaftSettings
from tests.harness import free_ports


@dataclass
class RecordingHooks:
    """ApplyHooks that keep every applied command, in order (the tick thread)."""

    applied: list[bytes] = field(default_factory=list)

    def apply(self, lsn: int, command: memoryview) -> Any:
        self.applied.append(bytes(command))
        return lsn

    def checkpoint(self) -> Snapshot:
        return Snapshot(0, b"")

    def checkpoint_written(self, lsn: int) -> None:
        pass

    def checkpoint_wanted(self) -> bool:
        return False

    def restore(self, snapshot: Snapshot) -> None:
        pass

    def on_tick(self) -> None:
        pass

    def in_doubt(self) -> bool:
        return False


@dataclass
class Acks:
    """The follower's acknowledgements, as they leave through pysyncobj's real send."""

    sent: list[dict[str, Any]] = field(default_factory=list)


@contextmanager
def one_follower(acks: Acks, monkeypatch: pytest.MonkeyPatch) -> Iterator[RaftReplica]:
    """A lone member whose two peers nobody runs: the test plays its leader, handing it
    messages with `deliver`; its acknowledgements are recorded in `acks` as they leave."""
    real_send = replication._original_send_next_node_idx

    def recorded(self: Any, node: Any, **kwargs: Any) -> None:
        acks.sent.append(kwargs)
        real_send(self, node, **kwargs)

    monkeypatch.setattr(replication, "_original_send_next_node_idx", recorded)
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    with tempfile.TemporaryDirectory() as directory:
        settings = RaftSettings(
            group_id=2,
            self_address=addresses[0],
            peer_addresses=tuple(addresses[1:]),  # nobody listens: the test is the leader
            directory=Path(directory),
            secret="append-rule-test",
            election_timeout_s=120.0,  # never a candidate while the test runs
            checkpoint_interval_s=3600.0,
        )
        replica = RaftReplica(settings, RecordingHooks(), RoleSignal())
        try:
            yield replica
        finally:
            replica.close()


def deliver(replica: RaftReplica, message: dict[str, Any]) -> None:
    """Hand the follower a message as its tick thread does, then let its fdatasync and the
    acknowledgements it holds for it go out."""
    sync_obj = replica._sync_obj
    leader = sorted(sync_obj._SyncObj__otherNodes, key=str)[0]
    with sync_obj._tick_lock:
        sync_obj._SyncObj__onMessageReceived(leader, message)
        sync_obj._sync_and_acknowledge()
