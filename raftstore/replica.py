"""The one seam between a group's applier and its replica, declared once.

A replica orders commands: `RaftReplica` (replication.py, a pysyncobj member) or
`LocalReplica` (local_replica.py, the node-local group of non-HA tables). It owns the log,
leadership and the checkpoint file; the applier (apply.py) owns everything the commands
change. They meet here, built in order: applier, then the replica that calls it, then the
group that proposes through the replica (group.py). Nothing is wired after construction.

Every `ApplyHooks` method runs on the replica's apply thread (pysyncobj's tick thread),
one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeAlias

from hastream.errors import RaftStoreError
from raftstore.stats import HistogramSnapshot


class _Stalled:
    """The answer of `ApplyHooks.apply` for an entry it cannot apply yet."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "STALLED"


# `apply` returned this: the entry is NOT applied; the replica keeps it (and every later
# one) in its log and offers it again on a later tick. Its proposer is not answered yet.
STALLED: Final = _Stalled()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The applier's state at `lsn` (the last entry it applied), as bytes; its data files
    are durable up to there."""

    lsn: int
    state: bytes


class ApplyHooks(Protocol):
    """What a replica calls (apply thread only)."""

    def apply(self, lsn: int, command: memoryview) -> Any:
        """Apply committed entry `lsn` (LSNs strictly increase, and may skip numbers: the
        replica's own entries are not ours). Returns the result for the proposer, or
        STALLED. Never raises: an invalid command is a recorded no-op."""
        ...

    def checkpoint(self) -> Snapshot:
        """Make the data files durable and return the state to checkpoint. Raises
        CheckpointDeferred while the state is not whole (a repair runs, an entry waits)."""
        ...

    def checkpoint_written(self, lsn: int) -> None:
        """The checkpoint `checkpoint()` returned for `lsn` is durable and the log before it
        is gone (files only an older replay needed can go now)."""
        ...

    def checkpoint_wanted(self) -> bool:
        """The applier would like a checkpoint soon (say, to free a dropped table's files)."""
        ...

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the state with a checkpoint's (at start, or a leader's install)."""
        ...

    def on_tick(self) -> None:
        """Called every tick (tens of ms): background work that must own the state."""
        ...

    def in_doubt(self) -> bool:
        """True while this replica's state is not trustworthy (stalled, repairing or
        failed): it must not lead, stand for election, or acknowledge entries."""
        ...


ProposalCallback = Callable[[Any, RaftStoreError | None], None]
# A command to propose: its bytes, or the parts they join (commands.append_parts), which the
# replica joins once, behind its own framing, before `propose` returns.
CommandBytes: TypeAlias = bytes | Sequence[bytes | memoryview]


def join_command(command: CommandBytes, prefix: bytes = b"") -> bytes:
    """`command`'s bytes behind `prefix`, in one copy (none for bytes without a prefix): a
    12.7 MB entry was copied once to join it and once more to put pysyncobj's tag before it."""
    if isinstance(command, bytes):
        return prefix + command if prefix else command
    return b"".join((prefix, *command))


class HostedConnection(Protocol):
    """A client connection a replica's event loop serves (port_loop.LoopedConnection):
    called on the loop's thread, with the replica's state held."""

    def fileno(self) -> int: ...

    def on_event(self, fd: int, event: int) -> None:
        """The descriptor polled readable, hung up, or failed."""
        ...

    def on_tick(self) -> None:
        """Once a second or so, for its timeouts."""
        ...

    def close(self) -> None: ...


class ConnectionHost(Protocol):
    """A replica's event loop, which serves client connections beside its peers' (the
    leader's waited publishes, port_loop.py)."""

    def host(self, connection: HostedConnection) -> bool:
        """Serve `connection` from now on (any thread); False when the loop is closing."""
        ...

    def release(self, fd: int) -> None:
        """Stop polling `fd` (the loop's thread, before the connection closes it)."""
        ...

    def call_soon(self, call: Callable[[], None]) -> None:
        """Run `call` on the loop's thread, in its next round (any thread)."""
        ...

    def propose_now(self) -> None:
        """Add and send the proposals queued so far, now (the loop's thread)."""
        ...


class Replica(Protocol):
    """What the group asks of its replica (any thread)."""

    def propose(self, command: CommandBytes, callback: ProposalCallback) -> None:
        """Queue `command` (its parts are joined before this returns); `callback(result,
        error)` runs on the apply thread once it is applied here (result) or failed (error).
        Raises Overloaded when the queue is full."""
        ...

    def is_leader(self) -> bool: ...

    def is_leader_ready(self) -> bool:
        """Leader, and everything committed before its term is applied."""
        ...

    def leader_address(self) -> str | None:
        """The leader's replica address ("host:port" of its Raft port), None if unknown."""
        ...

    def replayed(self) -> bool:
        """Every entry known committed when this replica started is applied (a restart's
        replay is over)."""
        ...

    def status(self) -> dict[str, Any]: ...

    def transfer_leadership(self, target: str | None, timeout_s: float) -> str:
        """Hand leadership to the member at replica address `target` (None: any follower
        that holds every entry); returns the new leader's replica address. Refuses new
        proposals meanwhile. Raises NotLeader, InvalidArgument, TransferFailed."""
        ...

    def transfer_target(self) -> str | None:
        """The member a transfer under way hands leadership to ("" while not chosen yet);
        None when no transfer is under way."""
        ...

    def await_transfer(self, timeout_s: float) -> None:
        """Block until no transfer is under way, at most `timeout_s`."""
        ...

    def latencies(self) -> dict[str, HistogramSnapshot]:
        """Latency histograms the replica keeps (metrics.py), by name."""
        ...

    def request_checkpoint(self) -> None: ...

    def connection_host(self) -> ConnectionHost | None:
        """The event loop that can serve client connections, None when the replica has
        none of its own to offer."""
        ...

    def close(self) -> None: ...


class RoleSignal:
    """Leadership changes of one group replica, told to whoever listens.

    Built before the replica (which `set`s it on the apply thread) and handed to the
    parts that react: group commit fails its uncommitted proposals, subscriptions end.
    `epoch` counts changes, so a reader can tell that leadership moved since it looked.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[bool], None]] = []
        self.epoch = 0
        self.is_leader = False

    def listen(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(is_leader)` on every later change (on the apply thread)."""
        with self._lock:
            self._listeners.append(listener)

    def set(self, is_leader: bool) -> None:
        with self._lock:
            self.epoch += 1
            self.is_leader = is_leader
            listeners = list(self._listeners)
        for listener in listeners:
            listener(is_leader)
