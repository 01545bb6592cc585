"""One Raft group on this node, as request handlers see it: leadership, proposals, reads.

Built last, from parts already built (node.py): the applier that owns the group's state and
files (apply.py), the replica that orders commands (replica.py), the role signal the
replica raises on leadership changes, and group commit (batcher.py). Nothing is wired after
construction.

Every public method runs on a request thread (gRPC). Writes go through the leader:
`require_leader` refuses a follower (NotLeader with the leader's advertised address) and a
replica in doubt (ReplicaInDoubt); reads refuse a replica in doubt too (`require_serving`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hastream.errors import (
    InvalidArgument,
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    ProposalTimeout,
    RaftStoreError,
    ReplicaInDoubt,
    TableSubscribed,
    TooManyTopics,
)
from hastream.model import NodeAddress
from raftstore import commands, limits
from raftstore.apply import Applier
from raftstore.batcher import Batcher
from raftstore.health import Health
from raftstore.replica import ConnectionHost, Replica, RoleSignal
from raftstore.state_machine import CommandResult, ItemResult, TableView
from raftstore.stats import HistogramSnapshot, PublishStats
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

# How often a request waiting for a new leader's first entry looks again.
_LEADER_READY_POLL_S = 0.002


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """One member of a group by its two gRPC addresses (cluster.cfg `<alias>.host/port` and
    `<alias>.advertisedHost/advertisedPort`; equal unless the cfg advertises another)."""

    address: NodeAddress  # where peers dial it (catch-up); never handed to clients
    advertised: NodeAddress  # what clients are told: NotLeader hints, leader answers


@dataclass(frozen=True, slots=True)
class PendingPublish:
    """A publish handed to group commit (`Group.start_publish`), not answered yet."""

    table: str
    size: int  # payload bytes, read before group commit released the payload
    started_s: float  # time.monotonic() of its arrival
    future: Future[tuple[int, ItemResult]]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSettings:
    group_id: int
    data_dir: Path  # persistenceDir/group-<id>
    # This node's ADVERTISED address: what `Group.leader()` returns when this node leads.
    self_address: NodeAddress
    # Replica address ("host:port" of the Raft port) -> every member, self included.
    members: dict[str, Member]


class WouldWait(Exception):
    """A request this thread may not wait for (`Group.require_leader(wait=False)`): the
    group's leader is handing over, or has not applied its term's first entry yet, and the
    thread is the one that moves both on. Not a client's error: the caller hands the
    request to a thread that may wait."""

    def __init__(self, group_id: int) -> None:
        super().__init__(f"group {group_id}: the leader is not ready to take it at once")
        self.group_id = group_id


class Group:
    def __init__(
        self,
        settings: GroupSettings,
        applier: Applier,
        replica: Replica,
        role: RoleSignal,
        batcher: Batcher,
    ) -> None:
        self.settings = settings
        self.group_id = settings.group_id
        self.applier = applier
        self._replica = replica
        self.role = role
        self._batcher = batcher
        self._lock = threading.Lock()
        self._subscribers: dict[str, int] = {}  # topic -> open subscriptions (this node)
        self._waiting: set[Future[Any]] = set()  # proposals of non-append commands
        self.publish_stats = PublishStats()
        role.listen(self._on_role_change)

    # --- leadership -------------------------------------------------------------------

    def leader(self) -> NodeAddress | None:
        """The leader's address as clients are told it (advertised), for NotLeader hints and
        leader answers; None while unknown. A hint: the replica's view can be stale."""
        member = self._leader_member()
        return None if member is None else member.advertised

    def leader_peer(self) -> NodeAddress | None:
        """The leader's address as its peers dial it (never handed to clients); None while
        unknown or when this node leads."""
        member = self._leader_member()
        if member is None or member.advertised == self.settings.self_address:
            return None
        return member.address

    def _leader_member(self) -> Member | None:
        replica_address = self._replica.leader_address()
        if replica_address is None:
            return None
        return self.settings.members.get(replica_address)

    def is_leader(self) -> bool:
        return self._replica.is_leader()

    def leads_and_ready(self) -> bool:
        """Leads, has applied everything committed before its term, and is not in doubt."""
        return self._replica.is_leader_ready() and not self.applier.in_doubt()

    def not_leader(self) -> NotLeader:
        """The NotLeader error for this group, naming the leader when it is another node
        (while this leader hands leadership over: the member taking over)."""
        leader = self.leader()
        target = self._replica.transfer_target()
        if target:
            member = self.settings.members.get(target)
            leader = None if member is None else member.advertised
        if leader == self.settings.self_address:
            leader = None  # an election is running; do not point the client back here
        return NotLeader(None if leader is None else str(leader), self.group_id)

    def require_leader(self, *, wait: bool = True) -> None:
        """Raise unless this node leads the group, is not handing leadership over, has
        applied everything committed, and can be trusted (not in doubt).

        Two short, bounded waits spare the client a retry round: while this leader hands
        leadership over, the request waits for the transfer to end and is then refused
        with the new leader's address; a new leader holds it until its first entry is
        applied (both at most `limits.LEADER_WAIT_S`). Without `wait` (the Raft loop's
        own thread, which drives both) it raises WouldWait instead."""
        if self._replica.transfer_target() is not None:
            if not wait:
                raise WouldWait(self.group_id)
            self._replica.await_transfer(limits.LEADER_WAIT_S)
            raise self.not_leader()
        if not self._replica.is_leader():
            raise self.not_leader()
        self.require_serving()
        if not wait and not self._replica.is_leader_ready():
            raise WouldWait(self.group_id)
        deadline = time.monotonic() + limits.LEADER_WAIT_S
        while not self._replica.is_leader_ready():  # bounded by the deadline
            if time.monotonic() >= deadline or not self._replica.is_leader():
                raise NodeUnavailable(f"group {self.group_id} leader is applying its log")
            time.sleep(_LEADER_READY_POLL_S)

    def require_serving(self) -> None:
        """Raise ReplicaInDoubt while this replica's state cannot be trusted."""
        health = self.applier.health()
        if health.in_doubt:
            raise ReplicaInDoubt(self.group_id, health.state.value, health.reason)

    def health(self) -> Health:
        return self.applier.health()

    def ready(self) -> bool:
        """Replayed its log since start, and not in doubt (what NODE READY waits for)."""
        return self._replica.replayed() and not self.applier.in_doubt()

    def transfer_leadership(self, to_alias: str | None, timeout_s: float) -> NodeAddress:
        """Hand this group's leadership to node `to_alias` (None: any follower holding every
        entry) and return the new leader's advertised address. Blocks up to `timeout_s`.
        Raises NotLeader (with the leader), InvalidArgument, TransferFailed."""
        target = None
        if to_alias is not None:
            target = self._replica_address(to_alias)
            if self.settings.members[target].advertised == self.settings.self_address:
                if self.is_leader():
                    return self.settings.self_address
                raise self.not_leader()
        if not self._replica.is_leader():
            raise self.not_leader()
        leader = self._replica.transfer_leadership(target, timeout_s)
        member = self.settings.members.get(leader)
        if member is None:
            raise InvalidArgument("leader", f"{leader} is not a member of group {self.group_id}")
        return member.advertised

    def _replica_address(self, alias: str) -> str:
        for replica_address, member in self.settings.members.items():
            if member.advertised.alias == alias:
                return replica_address
        aliases = ", ".join(sorted(m.advertised.alias for m in self.settings.members.values()))
        reason = f"{alias!r} is not a member of group {self.group_id}: {aliases}"
        raise InvalidArgument("to", reason)

    def member_alias(self, replica_address: str) -> str:
        """The alias of the member at `replica_address` (the address itself if unknown)."""
        member = self.settings.members.get(replica_address)
        return replica_address if member is None else member.advertised.alias

    def _on_role_change(self, is_leader: bool) -> None:
        """Apply thread. On a step-down every write not committed yet fails, so none is
        proposed after an earlier one failed; subscriptions notice the new epoch."""
        with self._lock:
            waiting = list(self._waiting)
        if not is_leader:
            # A follower reads every entry it applies: the checks kept for this node's own
            # proposals (check_memo.py) would only hold memory.
            self.applier.machine.check_memo.clear()
            lost = LeadershipLost("this node stepped down before the entry committed")
            self._batcher.fail_in_flight(lost)
            for future in waiting:
                if not future.done():
                    future.set_exception(lost)
        for store in self.applier.stores():
            store.wake()

    # --- writes (request threads) -----------------------------------------------------

    def create_table(self, command: commands.CreateTable) -> TableView:
        """Propose the table (the catalog claim is the caller's, catalog.py)."""
        self.require_leader()
        self.applier.machine.validate_create(command)
        self.propose_command(command)
        return self.table_view(command.table)

    def drop_table(self, table: str, *, force: bool) -> None:
        self.require_leader()
        self.table_view(table)
        prefix = f"{table}/"
        topics = [topic for topic in self.subscriber_counts() if topic.startswith(prefix)]
        if topics and not force:
            raise TableSubscribed(table, topics)
        self.propose_command(commands.DropTable(table=table, force=force))
        self.publish_stats.forget(table)

    def publish(self, item: commands.AppendItem) -> tuple[int, ItemResult]:
        """Append one batch; returns (lsn of the entry that carried it, its result)."""
        return self.publish_outcome(self.start_publish(item))

    def connection_host(self) -> ConnectionHost | None:
        """The replica's event loop, which can serve a publish-port connection of this
        group's leader (port_loop.py); None when it has none."""
        return self._replica.connection_host()

    def start_publish(self, item: commands.AppendItem, *, wait: bool = True) -> PendingPublish:
        """Validate one batch and hand it to group commit; `publish_outcome` waits for it.
        `wait`: as `require_leader`'s."""
        started_s = time.monotonic()
        self.require_leader(wait=wait)
        # No lock: validation reads only immutable table metadata (state_machine.py), and a
        # lock here would stall the apply thread behind Arrow checks.
        machine = self.applier.machine
        seal = machine.validate_publish(machine.table_meta(item.table), item.payload).seal
        if seal:
            item = commands.AppendItem(
                item.table, item.producer_id, item.sequence, item.payload, item.contiguous, seal
            )
        size = len(item.payload)  # group commit releases the payload once it is copied
        return PendingPublish(item.table, size, started_s, self._batcher.submit(item))

    def publish_outcome(self, pending: PendingPublish) -> tuple[int, ItemResult]:
        """(lsn, result) of a started publish once committed and applied (at once if its
        future is done), or its typed error; counted in the table's publish stats."""
        lsn, result = self._wait(pending.future)
        if result.error is not None:
            raise result.error
        self.record_publish(pending.table, result.row_count, pending.size, pending.started_s)
        return lsn, result

    def submit_appends(
        self, items: list[commands.AppendItem]
    ) -> list[Future[tuple[int, ItemResult]]]:
        """Hand validated items to group commit without waiting (PublishStream), in order:
        all are queued or none (Overloaded, LeadershipLost). Each future answers like
        `publish`: (lsn, result) once committed and applied, or LeadershipLost when this
        node steps down first."""
        self.require_leader()
        return self._batcher.submit_many(items)

    def record_publish(self, table: str, rows: int, payload_bytes: int, started_s: float) -> None:
        """An acknowledged publish: `started_s` is the time.monotonic() of its arrival."""
        self.publish_stats.record(table, rows, payload_bytes, time.monotonic() - started_s)

    def latencies(self) -> dict[str, HistogramSnapshot]:
        return self._replica.latencies()

    def commit_offset(self, topic: str, offset: int) -> int:
        """Raises TooManyTopics (nothing proposed) for a new topic past the group's limit.
        Checked on the leader, not in the state machine: entries already in logs replay
        as they applied. Concurrent first commits of new topics may pass it by the few
        proposals in flight."""
        self.require_leader()
        if (
            self.applier.topic_offset(topic) is None
            and self.applier.topic_count() >= limits.TOPICS_PER_GROUP_MAX
        ):
            raise TooManyTopics(topic, limits.TOPICS_PER_GROUP_MAX)
        self.propose_command(commands.CommitOffset(topic=topic, offset=offset))
        return offset

    def remove_offset(self, topic: str) -> None:
        self.require_leader()
        self.propose_command(commands.RemoveOffset(topic=topic))

    def propose_command(self, command: commands.Command) -> CommandResult:
        """Propose a non-append command and wait; raise the error its apply returned."""
        result = self._propose(command)
        if not isinstance(result, CommandResult):
            raise LeadershipLost("entry applied without a result")
        if result.error is not None:
            raise result.error
        return result

    def _propose(self, command: commands.Command) -> Any:
        future: Future[Any] = Future()

        def done(result: Any, error: RaftStoreError | None) -> None:
            with self._lock:
                self._waiting.discard(future)
            if future.done():  # already failed by a step-down
                return
            if error is not None:
                future.set_exception(error)
            elif result is None:
                future.set_exception(LeadershipLost("entry applied without a result"))
            else:
                future.set_result(result)

        with self._lock:
            self._waiting.add(future)
        try:
            self._replica.propose(commands.encode(command), done)
            return self._wait(future)
        finally:
            with self._lock:
                self._waiting.discard(future)

    def _wait(self, future: Future[Any]) -> Any:
        try:
            return future.result(timeout=limits.PROPOSAL_TIMEOUT_S)
        except FutureTimeout:
            raise ProposalTimeout(limits.PROPOSAL_TIMEOUT_S) from None
        except NotLeader as error:
            if error.leader is None:
                hint = self.not_leader()
                if hint.leader is not None:
                    raise hint from None
            raise

    # --- reads (any thread) ----------------------------------------------------------

    def has_table(self, table: str) -> bool:
        return self.applier.has_table(table)

    def table_names(self) -> list[str]:
        return self.applier.table_names()

    def table_view(self, table: str) -> TableView:
        return self.applier.table_view(table)

    def store(self, table: str) -> TableStore:
        """The table's files, for reading. Raises TableNotFound, ReplicaInDoubt,
        NodeUnavailable (its files are being reopened)."""
        self.require_serving()
        return self.applier.store(table)

    def topic_offset(self, topic: str) -> int | None:
        return self.applier.topic_offset(topic)

    def topics(self) -> dict[str, int]:
        return self.applier.topics()

    def subscriber_opened(self, topic: str) -> None:
        with self._lock:
            self._subscribers[topic] = self._subscribers.get(topic, 0) + 1

    def subscriber_closed(self, topic: str) -> None:
        with self._lock:
            self._subscribers[topic] = self._subscribers.get(topic, 1) - 1

    def subscriber_counts(self) -> dict[str, int]:
        with self._lock:
            return {topic: count for topic, count in self._subscribers.items() if count > 0}

    def status(self) -> dict[str, Any]:
        replica = self._replica.status()
        leader = self.leader()
        applied = self.applier.status()
        table_stats = applied.pop("table_stats")
        match_index = {
            self.member_alias(address): index
            for address, index in replica.get("match_index", {}).items()
        }
        return {
            "raft_group": self.group_id,
            "role": replica["role"],
            "leader": "" if leader is None else str(leader),
            "term": replica.get("term", 0),
            "commit_index": replica.get("commit_index", 0),
            "last_applied": replica.get("last_applied", 0),
            "log_len": replica.get("log_len", 0),
            "journal_bytes": replica.get("journal_bytes", 0),
            "journal_syncs": replica.get("journal_syncs", 0),
            "last_log_index": replica.get("last_log_index", replica.get("commit_index", 0)),
            "leader_changes": replica.get("leader_changes", 0),
            "slow_ticks": replica.get("slow_ticks", 0),
            "pre_votes": replica.get("pre_votes", 0),
            "transfer_target": replica.get("transfer_target"),
            "checkpoint_bytes_last": replica.get("checkpoint_bytes_last", 0),
            "match_index": match_index,
            **applied,
            "publish_queue_depth": self._batcher.queue_depth,
            "entries_proposed": self._batcher.entries_proposed,
            "published_rows": self.publish_stats.rows_total(),
            "tables": sorted(table_stats),
            "table_stats": table_stats,
            "subscriptions": self.subscriber_counts(),
        }

    def request_checkpoint(self) -> None:
        """Checkpoint soon (and let the replica's log go), instead of at the next interval."""
        self._replica.request_checkpoint()

    def close(self) -> None:
        """Stop group commit, then the replica (no more applies), then the files."""
        self._batcher.close()
        self._replica.close()
        self.applier.close()
