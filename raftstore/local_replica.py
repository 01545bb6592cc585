"""The replica of the node-local group: non-HA persisted stream tables.

Same journal, same applier, same data files and checkpoints as a Raft group, minus the
network: a proposal is committed once it is fsynced in this node's journal, and answered
once applied. This is what the benchmark compares HA tables against.

Like a Raft member, it keeps an entry the applier answers STALLED (an environment error, a
repair) in its journal and offers it again later; proposals behind it wait in order.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from hastream.errors import (
    CheckpointDeferred,
    InvalidArgument,
    LeadershipLost,
    NodeUnavailable,
    Overloaded,
    RaftStoreError,
)
from raftstore import limits
from raftstore.replica import (
    STALLED,
    ApplyHooks,
    CommandBytes,
    ConnectionHost,
    RoleSignal,
    Snapshot,
    join_command,
)
from raftstore.stats import HistogramSnapshot
from raftstore.storage import checkpoint, group_checkpoint
from raftstore.storage.files import REAL_FILES, Files
from raftstore.storage.group_checkpoint import GroupCheckpoint
from raftstore.storage.journal import DurableJournal
from raftstore.threads import Spawn

log = logging.getLogger(__name__)

LOCAL_ADDRESS: Final = "local"
_TERM: Final = 1
# While the applier answers STALLED, the loop looks again this often.
_STALLED_WAIT_S: Final = 0.05

Callback = Callable[[Any, RaftStoreError | None], None]


class LocalReplica:
    def __init__(
        self,
        directory: Path,
        hooks: ApplyHooks,
        role: RoleSignal,
        checkpoint_interval_s: float,
        *,
        spawn: Spawn,
        files: Files = REAL_FILES,
    ) -> None:
        """Recovers, then runs the group's loop on a thread started through `spawn`."""
        self._hooks = hooks
        self._files = files
        self._journal = DurableJournal(directory, files=files)
        self._checkpoint_path = directory / "checkpoint"
        self._checkpoint_interval_s = checkpoint_interval_s
        self._queue: collections.deque[tuple[bytes, Callback]] = collections.deque()
        self._callbacks: dict[int, Callback] = {}  # journal index -> proposer, until applied
        self._condition = threading.Condition()
        self._closed = False
        self._last_applied = 0
        self._last_index = 0  # of the journal, or of the checkpoint when the journal is empty
        self._recover()
        self._replayed_to = self._last_index
        self._last_checkpoint = time.monotonic()
        self._checkpoint_requested = False
        role.set(True)  # the only member: always the leader
        self._thread = spawn("local-replica", self._run)

    def _recover(self) -> None:
        if self._files.exists(self._checkpoint_path):
            body = checkpoint.read_checked(
                self._checkpoint_path, group_checkpoint.KIND, files=self._files
            )
            decoded = group_checkpoint.decode(body)
            self._hooks.restore(Snapshot(decoded.lsn, decoded.state))
            self._last_applied = decoded.lsn
        self._last_index = max(self._last_applied, self._journal_last())
        log.info(
            "local group recovered checkpoint_lsn=%d journal_last=%d",
            self._last_applied,
            self._journal_last(),
        )

    def _journal_last(self) -> int:
        return int(self._journal[-1][1]) if len(self._journal) else 0

    def propose(self, command: CommandBytes, callback: Callback) -> None:
        command = join_command(command)
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
                idle = not self._queue and self._last_applied >= self._last_index
                if idle and not self._closed:
                    self._condition.wait(timeout=1.0)
                if self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
            if batch:
                self._append(batch)
            if not self._apply_committed():
                time.sleep(_STALLED_WAIT_S)  # the applier waits on the environment
            self._hooks.on_tick()
            due = time.monotonic() - self._last_checkpoint > self._checkpoint_interval_s
            if due or self._checkpoint_requested or self._hooks.checkpoint_wanted():
                self._checkpoint_requested = False
                self.checkpoint()

    def _append(self, batch: list[tuple[bytes, Callback]]) -> None:
        """Journal the proposals with one fsync (group commit): they are committed."""
        first = self._last_index + 1
        try:
            for number, (command, _) in enumerate(batch):
                self._journal.append(command, first + number, _TERM)
            self._journal.sync()
        except OSError as error:
            # Not committed: refuse them (the journal cut back what it could not write).
            log.error("local journal write failed: %s", error)
            self._cut_journal_to(self._last_index)
            for _, callback in batch:
                callback(None, NodeUnavailable(f"local journal write failed: {error}"))
            return
        for number, (_, callback) in enumerate(batch):
            self._callbacks[first + number] = callback
        self._last_index = first + len(batch) - 1
        if self._journal.bytes_total > limits.RAFT_LOG_BYTES_MAX:
            self._checkpoint_requested = True

    def _cut_journal_to(self, last_index: int) -> None:
        while len(self._journal) and self._journal[-1][1] > last_index:
            self._journal.truncate_from(len(self._journal) - 1)

    def _apply_committed(self) -> bool:
        """Apply journaled entries in order. False when the applier stalled."""
        while self._last_applied < self._last_index:
            index = self._last_applied + 1
            command = self._entry(index)
            result = self._hooks.apply(index, memoryview(command))
            if result is STALLED:
                return False
            self._last_applied = index
            callback = self._callbacks.pop(index, None)
            if callback is not None:
                callback(result, None)
        return True

    def _entry(self, index: int) -> bytes:
        first = self._journal.index_at(0)
        command, held, _ = self._journal[index - first]
        assert held == index, (held, index)
        return bytes(command)

    def checkpoint(self) -> None:
        """Write a checkpoint and drop the journal entries it holds (local thread only)."""
        self._last_checkpoint = time.monotonic()
        if self._last_applied == 0:
            return
        try:
            snapshot = self._hooks.checkpoint()
        except CheckpointDeferred as deferred:
            log.info("local checkpoint deferred: %s", deferred.reason)
            return
        body = group_checkpoint.encode(
            GroupCheckpoint(lsn=snapshot.lsn, state=snapshot.state, trailer=b"")
        )
        try:
            checkpoint.write_atomic(
                self._checkpoint_path, group_checkpoint.KIND, body, files=self._files
            )
            if len(self._journal):  # the entries up to the lsn (drop_first clamps the count)
                self._journal.drop_first(snapshot.lsn - self._journal.index_at(0) + 1)
            self._hooks.checkpoint_written(snapshot.lsn)
        except OSError as error:
            # The journal keeps every entry: the next checkpoint tries again.
            log.error("local checkpoint failed: %s", error)

    def is_leader(self) -> bool:
        return True

    def is_leader_ready(self) -> bool:
        return True

    def replayed(self) -> bool:
        return self._last_applied >= self._replayed_to

    def leader_address(self) -> str | None:
        return LOCAL_ADDRESS

    def status(self) -> dict[str, Any]:
        return {
            "role": "leader",
            "term": _TERM,
            "commit_index": self._last_index,
            "last_applied": self._last_applied,
            "log_len": len(self._journal),
            "journal_bytes": self._journal.bytes_total,
            "journal_syncs": self._journal.syncs,
        }

    def transfer_leadership(self, target: str | None, timeout_s: float) -> str:
        raise InvalidArgument("raft_group", "the node-local group has no other member to lead")

    def transfer_target(self) -> str | None:
        return None

    def await_transfer(self, timeout_s: float) -> None:
        return

    def latencies(self) -> dict[str, HistogramSnapshot]:
        return {}

    def request_checkpoint(self) -> None:
        with self._condition:
            self._checkpoint_requested = True
            self._condition.notify()

    def connection_host(self) -> ConnectionHost | None:
        return None  # its loop waits on a condition, not a poll: connections keep threads

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout=10)  # the loop writes the journal: it stops first
        self._journal.close()
