"""One Raft group on this node (or the node-local group of non-HA tables).

Wires the pure state machine to the data files, the cache, group commit and replication:
- `apply` (tick thread) decodes a command, runs the state machine, performs its effects
  (data files, cache, wakeups) and returns the result to the proposer;
- `write_checkpoint` / `read_checkpoint` (tick thread) persist and restore the state machine
  around pysyncobj's log compaction, and start a catch-up from a peer when the data files
  are behind the restored state;
- the public methods (gRPC threads) validate, propose and wait.

Locking: `_lock` guards the state machine and the table map. The tick thread holds it while
applying; gRPC threads hold it only to read metadata, never while waiting.
"""

from __future__ import annotations

import logging
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from raftstore import commands, limits
from raftstore.batcher import Batcher
from raftstore.errors import (
    CorruptionError,
    LeadershipLost,
    NodeUnavailable,
    NotLeader,
    OffsetOutOfRange,
    ProposalTimeout,
    RaftStoreError,
    TableNotFound,
    TableSubscribed,
)
from raftstore.model import NodeAddress
from raftstore.state_machine import (
    AppendRecords,
    CommandResult,
    CreateTableFiles,
    DropTableFiles,
    Effect,
    GroupStateMachine,
    ItemResult,
    TableView,
)
from raftstore.storage import checkpoint
from raftstore.storage.journal import Entry
from raftstore.storage.segments import DataRecord
from raftstore.tables import TableStore

log = logging.getLogger(__name__)

CHECKPOINT_KIND: Final = b"GCKP"
_CHECKPOINT_HEADER: Final = struct.Struct("<II")  # version, state length
_ENTRY_HEADER: Final = struct.Struct("<QQI")  # idx, term, command length
CHECKPOINT_VERSION: Final = 1

# Fetches data-file records [offset_from, offset_to) of a table from a peer.
FetchRecords = Callable[[NodeAddress, int, str, int, int], Iterator[DataRecord]]


class Replica(Protocol):
    """RaftReplica (replication.py) or LocalReplica (local_replica.py)."""

    def propose(
        self, command: bytes, callback: Callable[[Any, RaftStoreError | None], None]
    ) -> None: ...

    def is_leader(self) -> bool: ...

    def is_leader_ready(self) -> bool: ...

    def leader_address(self) -> str | None: ...

    def status(self) -> dict[str, Any]: ...

    def request_checkpoint(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """One member of a group by its two gRPC addresses (cluster.cfg `<alias>.host/port` and
    `<alias>.advertisedHost/advertisedPort`; equal unless the cfg advertises another)."""

    address: NodeAddress  # where peers dial it (catch-up); never handed to clients
    advertised: NodeAddress  # what clients are told: NotLeader hints, leader answers


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSettings:
    group_id: int
    data_dir: Path  # persistenceDir/group-<id>
    # This node's ADVERTISED address: what `Group.leader()` returns when this node leads.
    self_address: NodeAddress
    # Raft address ("host:port") -> every member, self included.
    members: dict[str, Member]


class Group:
    def __init__(self, settings: GroupSettings, fetch_records: FetchRecords) -> None:
        self.settings = settings
        self.group_id = settings.group_id
        self._fetch_records = fetch_records
        self._lock = threading.RLock()
        self._machine = GroupStateMachine(settings.group_id)
        self._stores: dict[str, TableStore] = {}
        self._replica: Replica | None = None
        self._batcher: Batcher | None = None
        # Bumped on every role change: subscriptions opened in an older epoch end.
        self.epoch = 0
        # Catch-up from a peer after a checkpoint install: later entries wait here.
        self._catching_up = False
        self._catch_up_done = threading.Event()
        self._pending: list[tuple[int, bytes]] = []
        self._subscribers: dict[str, int] = {}  # topic -> open subscriptions (this node)
        self._waiting: set[Future[Any]] = set()  # proposals of create/drop/offsets
        self.published_rows = 0
        self.checkpoints_written = 0
        self.checkpoints_loaded = 0
        self.corruptions_repaired = 0
        settings.data_dir.mkdir(parents=True, exist_ok=True)

    def attach(self, replica: Replica) -> None:
        """Called once the replica exists; starts group commit."""
        self._replica = replica
        self._batcher = Batcher(self.group_id, replica.propose)

    @property
    def replica(self) -> Replica:
        assert self._replica is not None, "group used before attach()"
        return self._replica

    # --- leadership -------------------------------------------------------------------

    def leader(self) -> NodeAddress | None:
        """The leader's address as clients are told it (advertised), for NotLeader hints and
        leader answers; None while unknown. A hint: pysyncobj's view can be stale."""
        member = self._leader_member()
        return None if member is None else member.advertised

    def _leader_member(self) -> Member | None:
        raft_address = self.replica.leader_address()
        if raft_address is None:
            return None
        return self.settings.members.get(raft_address)

    def require_leader(self) -> None:
        """Raise unless this node leads the group and has applied everything committed."""
        if not self.replica.is_leader():
            leader = self.leader()
            if leader == self.settings.self_address:
                leader = None  # an election is running; do not point the client back here
            raise NotLeader(None if leader is None else str(leader), self.group_id)
        if self._catching_up:
            raise NodeUnavailable(f"group {self.group_id} is catching up from a peer")
        if not self.replica.is_leader_ready():
            raise NodeUnavailable(f"group {self.group_id} leader is applying its log")

    # --- ReplicaHooks (tick thread) -------------------------------------------------

    def apply(self, lsn: int, command: memoryview) -> Any:
        if self._catching_up:
            self._pending.append((lsn, bytes(command)))
            return None
        return self._apply(lsn, command)

    def _apply(self, lsn: int, command: memoryview | bytes) -> Any:
        decoded = commands.decode(command)
        with self._lock:
            effects, result = self._machine.apply(lsn, decoded)
            for effect in effects:
                self._perform(effect)
        return result

    def _perform(self, effect: Effect) -> None:
        if isinstance(effect, AppendRecords):
            store = self._stores[effect.table]
            store.append(effect.lsn, effect.first_offset, effect.batch, effect.timestamp_ms)
        elif isinstance(effect, CreateTableFiles):
            self._open_store(effect.meta.table, created_lsn=effect.meta.created_lsn)
        elif isinstance(effect, DropTableFiles):
            dropped = self._stores.pop(effect.table, None)
            if dropped is not None:
                dropped.destroy()
            else:
                shutil.rmtree(self.settings.data_dir / effect.table, ignore_errors=True)
            log.info("dropped table group=%d table=%s", self.group_id, effect.table)
        else:  # pragma: no cover - exhaustive over Effect
            raise AssertionError(f"unknown effect {effect!r}")

    def _open_store(self, table: str, *, created_lsn: int) -> TableStore:
        view = self._machine.table(table)
        directory = self.settings.data_dir / table
        try:
            store = TableStore(view.meta, directory)
            first = next(iter(store.records(store.earliest_offset, store.row_count)), None)
        except CorruptionError as error:
            store = self._quarantine(view, directory, error)
            first = None
        if first is not None and first.lsn <= created_lsn:
            # Files left by an older table of the same name (dropped before a crash).
            log.warning("removing stale data files table=%s dir=%s", table, directory)
            store.destroy()
            store = TableStore(view.meta, directory)
        self._stores[table] = store
        return store

    def _quarantine(self, view: TableView, directory: Path, error: CorruptionError) -> TableStore:
        """Corrupt data files are never served or skipped: move them aside and start the
        table empty; the rows come back from the Raft log (replay) or from a peer (catch-up
        after a checkpoint restore)."""
        aside = directory.with_name(f"{directory.name}.corrupt-{int(time.time() * 1000)}")
        log.error(
            "corrupt data files group=%d table=%s moved_to=%s error=%s",
            self.group_id,
            view.meta.table,
            aside,
            error,
        )
        directory.rename(aside)
        self.corruptions_repaired += 1
        return TableStore(view.meta, directory)

    def on_role_change(self, is_leader: bool) -> None:
        with self._lock:
            self.epoch += 1
            stores = list(self._stores.values())
            waiting = list(self._waiting)
        if not is_leader:
            lost = LeadershipLost("this node stepped down before the entry committed")
            if self._batcher is not None:
                self._batcher.fail_in_flight(lost)
            for future in waiting:
                if not future.done():
                    future.set_exception(lost)
        for store in stores:
            store.wake()  # subscriptions notice the new epoch and close

    def on_tick(self) -> None:
        if self._catching_up and self._catch_up_done.is_set():
            self._finish_catch_up()

    def write_checkpoint(self, path: Path, last: Entry, previous: Entry) -> None:
        """Make the data files durable, then write the state machine (tick thread)."""
        if self._catching_up:
            # The state machine lags the log while entries wait for the catch-up; a
            # checkpoint now would let pysyncobj truncate entries not yet applied.
            raise NodeUnavailable(f"group {self.group_id} is catching up; checkpoint deferred")
        started = time.monotonic()
        with self._lock:
            for store in self._stores.values():
                store.log.sync()
            state = self._machine.snapshot()
            self._apply_retention()
        parts = [_CHECKPOINT_HEADER.pack(CHECKPOINT_VERSION, len(state)), state]
        for command, idx, term in (last, previous):
            parts += [_ENTRY_HEADER.pack(idx, term, len(command)), command]
        checkpoint.write_atomic(path, CHECKPOINT_KIND, b"".join(parts))
        self.checkpoints_written += 1
        log.info(
            "checkpoint group=%d lsn=%d tables=%d took_ms=%.1f",
            self.group_id,
            last[1],
            len(self._stores),
            (time.monotonic() - started) * 1000,
        )

    def _apply_retention(self) -> None:
        now_ms = int(time.time() * 1000)
        for store in self._stores.values():
            cutoff = now_ms - store.meta.retention_minutes * 60_000
            store.log.remove_segments_before(cutoff, keep_rows=limits.DEDUP_WINDOW_ROWS)

    def read_checkpoint(self, path: Path) -> tuple[Entry, Entry]:
        """Restore the state machine from `path` (tick thread): at startup, or when the
        leader installed its checkpoint on this lagging follower."""
        body = checkpoint.read_checked(path, CHECKPOINT_KIND)
        version, state_length = _CHECKPOINT_HEADER.unpack_from(body, 0)
        assert version == CHECKPOINT_VERSION, f"checkpoint version {version}"
        position = _CHECKPOINT_HEADER.size
        state = body[position : position + state_length]
        position += state_length
        entries: list[Entry] = []
        for _ in range(2):
            idx, term, length = _ENTRY_HEADER.unpack_from(body, position)
            position += _ENTRY_HEADER.size
            entries.append((body[position : position + length], idx, term))
            position += length
        self._restore(state)
        self.checkpoints_loaded += 1
        return entries[0], entries[1]

    def _restore(self, state: bytes) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            self._machine = GroupStateMachine.restore(self.group_id, state)
            behind: list[tuple[str, int, int]] = []
            for view in self._machine.tables():
                store = self._open_store(view.meta.table, created_lsn=view.meta.created_lsn)
                if store.row_count < view.row_count:
                    behind.append((view.meta.table, store.row_count, view.row_count))
            log.info(
                "restored checkpoint group=%d lsn=%d tables=%d behind=%d",
                self.group_id,
                self._machine.lsn_applied,
                len(self._stores),
                len(behind),
            )
            if not behind:
                self._rebuild_key_windows()
                return
            self._catching_up = True
            self._catch_up_done.clear()
        threading.Thread(
            target=self._catch_up, args=(behind,), name=f"catch-up-{self.group_id}", daemon=True
        ).start()

    def _rebuild_key_windows(self) -> None:
        for view in self._machine.tables():
            span = self._machine.key_window_range(view.meta.table)
            if span is None or view.meta.key_column is None:
                continue
            store = self._stores[view.meta.table]
            offset_from = max(span[0], store.earliest_offset)
            keys = store.read_keys(offset_from, span[1], view.meta.key_column)
            self._machine.rebuild_key_window(view.meta.table, keys, offset_from)

    # --- catch-up from a peer (background thread) -------------------------------------

    def _catch_up(self, behind: list[tuple[str, int, int]]) -> None:
        deadline = time.monotonic() + 3600
        for table, offset_from, offset_to in behind:
            while not self._fetch_table(table, offset_to):
                if time.monotonic() > deadline:
                    log.critical("catch-up failed group=%d table=%s", self.group_id, table)
                    return
                time.sleep(0.5)  # bounded by the deadline; peers may be restarting
            log.info(
                "caught up group=%d table=%s rows=[%d,%d)",
                self.group_id,
                table,
                offset_from,
                offset_to,
            )
        with self._lock:
            self._rebuild_key_windows()
        self._catch_up_done.set()

    def _fetch_table(self, table: str, offset_to: int) -> bool:
        store = self._stores[table]
        peers = self._peers_leader_first()
        retained_from: list[int] = []  # earliest offsets of peers that no longer hold ours
        for peer in peers:
            try:
                for record in self._fetch_records(
                    peer, self.group_id, table, store.row_count, offset_to
                ):
                    if record.first_offset != store.row_count:
                        raise AssertionError(
                            f"peer {peer} sent offset {record.first_offset}, "
                            f"expected {store.row_count}"
                        )
                    store.append_record(record)
                store.log.sync()
                if store.row_count >= offset_to:
                    return True
            except OffsetOutOfRange as error:
                log.warning("catch-up from %s: %s", peer, error)
                if error.earliest > store.row_count:
                    retained_from.append(error.earliest)
            except RaftStoreError as error:
                log.warning("catch-up from %s failed table=%s error=%s", peer, table, error)
        if len(retained_from) == len(peers) and store.row_count == store.earliest_offset:
            # Every peer's retention already removed the rows this (empty) replica lacks:
            # no node can send them. Continue where the peers' data begins.
            store.start_at(min(retained_from))  # the caller's next round fetches from there
        return False

    def _peers_leader_first(self) -> list[NodeAddress]:
        """The other members' cluster-internal addresses (not the advertised ones: those
        are for clients, and may not resolve or route from inside the cluster)."""
        leader = self._leader_member()
        self_alias = self.settings.self_address.alias
        others = [m for m in self.settings.members.values() if m.address.alias != self_alias]
        if leader in others:
            others.remove(leader)
            others.insert(0, leader)
        return [member.address for member in others]

    def _finish_catch_up(self) -> None:
        pending, self._pending = self._pending, []
        self._catching_up = False
        for lsn, command in pending:
            self._apply(lsn, command)
        log.info("catch-up complete group=%d replayed=%d", self.group_id, len(pending))

    # --- requests (gRPC threads) ------------------------------------------------------

    def create_table(self, command: commands.CreateTable) -> TableView:
        self.require_leader()
        with self._lock:
            self._machine.validate_create(command)
        self._propose_command(command)
        return self.table_view(command.table)

    def drop_table(self, table: str, *, force: bool) -> None:
        self.require_leader()
        self.table_view(table)
        topics = [topic for topic, count in self._subscribers.items() if count > 0]
        topics = [topic for topic in topics if topic.startswith(f"{table}/")]
        if topics and not force:
            raise TableSubscribed(table, topics)
        self._propose_command(commands.DropTable(table=table, force=force))

    def publish(self, item: commands.AppendItem) -> tuple[int, ItemResult]:
        """Append one batch; returns (lsn of the entry that carried it, its result)."""
        self.require_leader()
        # No group lock: validation reads only immutable table metadata (state_machine.py),
        # and holding the lock here would stall the tick thread's apply behind Arrow checks.
        self._machine.validate_append(item.table, item.payload)
        assert self._batcher is not None
        future = self._batcher.submit(item)
        lsn, result = self._wait(future)
        if result.error is not None:
            raise result.error
        self.published_rows += result.row_count
        return lsn, result

    def submit_appends(
        self, items: list[commands.AppendItem]
    ) -> list[Future[tuple[int, ItemResult]]]:
        """Hand validated items to group commit without waiting (PublishStream), in order:
        all are queued or none (Overloaded, LeadershipLost). Each future answers like
        `publish`: (lsn, result) once committed and applied, or LeadershipLost when this
        node steps down first."""
        self.require_leader()
        assert self._batcher is not None
        return self._batcher.submit_many(items)

    def commit_offset(self, topic: str, offset: int) -> int:
        self.require_leader()
        self._propose_command(commands.CommitOffset(topic=topic, offset=offset))
        return offset

    def remove_offset(self, topic: str) -> None:
        self.require_leader()
        self._propose_command(commands.RemoveOffset(topic=topic))

    def _propose_command(self, command: commands.Command) -> CommandResult:
        """Propose a non-append command; raise the error its apply returned."""
        result = self._propose(command)
        assert isinstance(result, CommandResult)
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
        self.replica.propose(commands.encode(command), done)
        try:
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
                leader = self.leader()
                if leader is not None and leader != self.settings.self_address:
                    raise NotLeader(str(leader), self.group_id) from None
            raise

    # --- reads (any thread) ----------------------------------------------------------

    def has_table(self, table: str) -> bool:
        with self._lock:
            return table in self._stores

    def table_names(self) -> list[str]:
        with self._lock:
            return sorted(self._stores)

    def table_view(self, table: str) -> TableView:
        with self._lock:
            return self._machine.table(table)

    def store(self, table: str) -> TableStore:
        with self._lock:
            store = self._stores.get(table)
        if store is None:
            raise TableNotFound(table)
        return store

    def topic_offset(self, topic: str) -> int | None:
        with self._lock:
            return self._machine.topic_offset(topic)

    def topics(self) -> dict[str, int]:
        with self._lock:
            return dict(self._machine.topics())

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
        replica = self.replica.status()
        leader = self.leader()
        with self._lock:
            tables = {
                name: {"row_count": store.row_count, "earliest_offset": store.earliest_offset}
                for name, store in self._stores.items()
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
            "catching_up": self._catching_up,
            "checkpoints_written": self.checkpoints_written,
            "checkpoints_loaded": self.checkpoints_loaded,
            "corruptions_repaired": self.corruptions_repaired,
            "publish_queue_depth": 0 if self._batcher is None else self._batcher.queue_depth,
            "entries_proposed": 0 if self._batcher is None else self._batcher.entries_proposed,
            "published_rows": self.published_rows,
            "tables": sorted(tables),
            "table_stats": tables,
            "subscriptions": self.subscriber_counts(),
        }

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        if self._replica is not None:
            self._replica.close()
        with self._lock:
            for store in self._stores.values():
                store.log.sync()
                store.close()
