"""The replica of the node-local group: non-HA persisted stream tables.

Same journal, same state machine, same data files and checkpoints as a Raft group, minus
the network: a proposal is acknowledged once it is fsynced in this node's journal and
applied. This is what the benchmark compares HA tables against.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from raftstore import commands, limits
from raftstore.errors import LeadershipLost, Overloaded, RaftStoreError
from raftstore.replication import ReplicaHooks
from raftstore.storage.journal import DurableJournal

log = logging.getLogger(__name__)

LOCAL_ADDRESS: Final = "local"
_TERM: Final = 1

Callback = Callable[[Any, RaftStoreError | None], None]


class LocalReplica:
    def __init__(self, directory: Path, hooks: ReplicaHooks, checkpoint_interval_s: float) -> None:
        self._hooks = hooks
        self._journal = DurableJournal(directory)
        self._checkpoint_path = directory / "checkpoint"
        self._checkpoint_interval_s = checkpoint_interval_s
        self._queue: collections.deque[tuple[bytes, Callback]] = collections.deque()
        self._condition = threading.Condition()
        self._closed = False
        self._last_applied = 0
        self._recover()
        self._last_checkpoint = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="local-replica", daemon=True)
        self._thread.start()

    def _recover(self) -> None:
        if len(self._journal) == 0:
            self._journal.add(commands.encode(commands.Noop()), 1, _TERM)
            self._journal.sync()
        if self._checkpoint_path.exists():
            last, _previous = self._hooks.read_checkpoint(self._checkpoint_path)
            self._last_applied = last[1]
        for command, idx, _term in list(self._journal[:]):
            if idx > self._last_applied:
                self._hooks.apply(idx, memoryview(command))
                self._last_applied = idx
        log.info("local group recovered lsn=%d", self._last_applied)

    def propose(self, command: bytes, callback: Callback) -> None:
        with self._condition:
            if self._closed:
                raise LeadershipLost("node shutting down")
            if len(self._queue) >= limits.RAFT_COMMAND_QUEUE_MAX:
                raise Overloaded("local commands", limits.RAFT_COMMAND_QUEUE_MAX)
            self._queue.append((command, callback))
            self._condition.notify()

    def _run(self) -> None:  # the local group's event loop: runs until close()
        while True:
            with self._condition:
                if not self._queue and not self._closed:
                    self._condition.wait(timeout=1.0)
                if self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
            if batch:
                self._commit(batch)
            self._hooks.on_tick()
            if time.monotonic() - self._last_checkpoint > self._checkpoint_interval_s:
                self.checkpoint()

    def _commit(self, batch: list[tuple[bytes, Callback]]) -> None:
        first = self._last_applied + 1
        for number, (command, _) in enumerate(batch):
            self._journal.add(command, first + number, _TERM)
        self._journal.sync()  # one fsync for everything queued: group commit
        for number, (command, callback) in enumerate(batch):
            result = self._hooks.apply(first + number, memoryview(command))
            self._last_applied = first + number
            callback(result, None)
        if self._journal.bytes_total > limits.RAFT_LOG_BYTES_MAX:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write a checkpoint and truncate the journal to its last two entries (local
        thread only)."""
        self._last_checkpoint = time.monotonic()
        if len(self._journal) < 2:
            return
        last, previous = self._journal[-1], self._journal[-2]
        self._hooks.write_checkpoint(self._checkpoint_path, last, previous)
        self._journal.deleteEntriesTo(len(self._journal) - 2)

    def is_leader(self) -> bool:
        return True

    def is_leader_ready(self) -> bool:
        return True

    def leader_address(self) -> str | None:
        return LOCAL_ADDRESS

    def status(self) -> dict[str, Any]:
        return {
            "role": "leader",
            "term": _TERM,
            "commit_index": self._last_applied,
            "last_applied": self._last_applied,
            "log_len": len(self._journal),
            "journal_bytes": self._journal.bytes_total,
            "journal_syncs": self._journal.syncs,
        }

    def request_checkpoint(self) -> None:
        with self._condition:
            self._last_checkpoint = 0.0
            self._condition.notify()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout=10)
        self._journal._destroy()
